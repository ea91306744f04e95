"""The JAX backend's checks, run once in a subprocess by `tests/test_jax_backend.py`.

Keras chooses its backend once per process, so everything that needs JAX runs here, in one
process started with KERAS_BACKEND=jax and two host devices
(XLA_FLAGS=--xla_force_host_platform_device_count=2); it writes what it measured as JSON and
the tests assert on it. Usage: python tests/jax_backend_checks.py WORK_DIR (WORK_DIR holds
what the TensorFlow side wrote: parity.weights.h5, parity_inputs.npz).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script, Python puts tests/ first on sys.path, where tests/pipelines (the tests of
# `pipelines`) would be imported in place of the project's `pipelines` package.
sys.path[:] = [entry for entry in sys.path
               if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

VOCAB = 40
# The micro-batches of one update: 4 sentences of at most 9 tokens each (one shape, one XLA
# compilation), whose real lengths reach these maxima: token counts far apart, so that a
# mean of the micro-batches' means would weigh their tokens unequally. Even sentence
# counts, so that two devices split them.
MICRO_BATCH, PADDED_LENGTH, LONGEST = 4, 9, (3, 9, 6)


def _ids(rng, batch: int, longest: int, length: int) -> np.ndarray:
    ids = rng.integers(4, VOCAB, size=(batch, length + 1)).astype("int32")
    for row, n in enumerate(rng.integers(2, longest + 1, size=batch)):
        ids[row, n:] = 0
    return ids


def _updates(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [[(_ids(rng, MICRO_BATCH, n, PADDED_LENGTH), _ids(rng, MICRO_BATCH, n + 1,
                                                                 PADDED_LENGTH + 1))
             for n in LONGEST] for _ in range(count)]


def _features(source, target):
    return {"source": source, "target": target[:, :-1]}, target[:, 1:]


def _batches(updates, accumulate: int):
    """Each update as one padded batch, or as its micro-batches."""
    for group in updates:
        if accumulate == 1:
            yield _features(np.concatenate([s for s, _ in group]),
                            np.concatenate([t for _, t in group]))
        else:
            yield from (_features(s, t) for s, t in group)


def _train(updates, accumulate: int, optimizer, precision=None, distribution=None):
    """(model, initial weights) after fitting `updates`, as micro-batches if accumulate > 1."""
    import keras

    from keras_transformer.training.losses import LabelSmoothedCrossEntropy
    from keras_transformer.training.trainer_model import build_trainer

    keras.distribution.set_distribution(distribution)
    try:
        keras.utils.set_random_seed(0)
        # One layer a side: every kind of layer is there, whose gradients are summed and
        # scaled the same at any depth, and each training program compiles twice as fast.
        model = build_trainer("tiny", vocab_size=VOCAB, num_layers=1, dtype=precision)
        model.compile(optimizer, loss=LabelSmoothedCrossEntropy(0.1),
                      accumulate_steps=accumulate)
        initial = [np.array(w) for w in model.trainable_weights]
        steps = len(updates) * (1 if accumulate == 1 else len(LONGEST))
        model.fit(_batches(updates, accumulate), epochs=1, steps_per_epoch=steps, verbose=0)
        return model, initial
    finally:
        keras.distribution.set_distribution(None)


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))))
               for x, y in zip(a, b, strict=True))


def _kept(model):
    # Key biases have a zero true gradient: their Adam updates are normalised round-off.
    return [np.array(w) for w in model.weights if not w.path.endswith("key/bias")]


def _step(initial, model):
    return np.concatenate([(a - np.array(w)).ravel()
                           for a, w in zip(initial, model.trainable_weights, strict=True)])


def check_imports() -> dict:
    """The model, the training step and the whole JAX run (its run directory, backups,
    averaging) import no TensorFlow under JAX."""
    import keras  # noqa: F401

    import keras_transformer.training.accumulation_jax  # noqa: F401
    import keras_transformer.training.run_jax  # noqa: F401
    import keras_transformer.training.trainer_model  # noqa: F401
    from keras_transformer.training.losses import GlobalTokenCrossEntropy  # noqa: F401
    return {"backend": keras.backend.backend(), "tensorflow_imported": "tensorflow" in sys.modules}


def check_parity(work: Path) -> dict:
    """Logits of TensorFlow's weights under JAX, against TensorFlow's own logits."""
    import keras

    from keras_transformer.model.transformer import build_transformer

    inputs = np.load(work / "parity_inputs.npz")
    config = json.loads(str(inputs["config"]))
    model = build_transformer(**config)
    model.load_weights(work / "parity.weights.h5")
    logits = np.asarray(model.predict_on_batch(  # one XLA program, not op by op
        {"source": inputs["source"], "target": inputs["target"]}), "float64")
    expected = inputs["tf_logits"].astype("float64")
    relative = np.max(np.abs(logits - expected)) / np.max(np.abs(expected))
    return {"parity_max_relative_difference": float(relative),
            "parity_shape": list(logits.shape), "backend_of_parity": keras.backend.backend()}


def check_loss_gradient(work: Path) -> dict:
    """The loss's hand-written gradient (`losses_jax`) against JAX's autodiff of the same
    loss and against TensorFlow's gradient, on TensorFlow's logits of real val sentences
    and the labels TensorFlow's gradient was taken for (padding 0 weighted 0)."""
    import re

    import jax
    import jax.numpy as jnp

    from keras_transformer.training.losses import _portable_cross_entropy, token_cross_entropy

    inputs = np.load(work / "parity_inputs.npz")
    labels = jnp.asarray(inputs["labels"])
    weights = (labels != 0).astype(jnp.float32)
    found = {"real_tokens": int(weights.sum()),
             # Dispatched to losses_jax: its custom_vjp is in the traced loss.
             "custom_vjp_in_the_loss": "custom_vjp_call" in str(jax.make_jaxpr(
                 lambda values: token_cross_entropy(labels, values, 0.1))(
                     jnp.asarray(inputs["tf_logits"])))}
    for dtype in ("float32", "bfloat16", "float16"):
        logits = jnp.asarray(inputs["tf_logits"], dtype)
        for eps in (0.1, 0.0):
            steps = {name: jax.jit(jax.value_and_grad(
                lambda values, per_token=per_token, eps=eps: jnp.sum(
                    per_token(labels, values, eps) * weights))).lower(logits).compile()
                for name, per_token in (("autodiff", _portable_cross_entropy),
                                        ("closed_form", token_cross_entropy))}
            (value_a, grad_a), (value_b, grad_b) = (step(logits) for step in steps.values())
            a, b = (np.asarray(g, "float64") for g in (grad_a, grad_b))
            # The largest difference relative to the largest element (where softmax and the
            # smoothed target cancel, round-off is all that is left), and element by element
            # relative to the element (floored at 1e-6 of the largest): 16-bit gradients
            # differ by a unit in their last place where the float32 values round apart.
            floor = 1e-6 * np.max(np.abs(a))
            key = f"{dtype}_eps{eps}"
            found[key] = {
                "values": [float(value_a), float(value_b)],
                "gradient_max_difference_to_largest": float(
                    np.max(np.abs(a - b)) / np.max(np.abs(a))),
                "gradient_max_elementwise_difference": float(
                    np.max(np.abs(a - b) / np.maximum(np.abs(a), floor))),
                "gradient_dtype": str(grad_b.dtype)}
            if dtype == "float32" and eps == 0.1:
                expected = inputs["tf_gradient"].astype("float64")
                found[key]["against_tensorflow"] = float(
                    np.max(np.abs(b - expected)) / np.max(np.abs(expected)))
                found["scatters"] = {name: len(re.findall(r"\bscatter\(", step.as_text()))
                                     for name, step in steps.items()}
    return found


def check_token_statistics(work: Path) -> dict:
    """`losses_jax.token_statistics`' two forms, the one variadic reduction (accelerators)
    against the separate reductions (CPUs), both run here on TensorFlow's logits of real val
    sentences, in three dtypes; argmax ties and non-finite logits; and which form a step
    lowered for a GPU or a CPU holds (`jax.export` lowers for a platform without its
    device)."""
    import re

    import jax
    import jax.numpy as jnp

    from keras_transformer.training import losses_jax

    inputs = np.load(work / "parity_inputs.npz")
    labels = jnp.asarray(inputs["labels"], jnp.int32)
    forms = {"separate": jax.jit(losses_jax._separate_reductions),
             "one": jax.jit(losses_jax._one_reduction),
             # The combiner as a GPU's tree applies it: partial results of chunks of the
             # vocabulary, combined in a shuffled order, either side first.
             "tree": lambda labels, logits: _in_shuffled_chunks(labels, logits, 96, seed=3)}
    found = {}
    for dtype in ("float32", "bfloat16", "float16"):
        logits = jnp.asarray(inputs["tf_logits"], dtype)
        reference = losses_jax.TokenStatistics(*(
            np.asarray(v, "float64") for v in forms["separate"](labels, logits)))
        scale = float(np.max(np.abs(np.asarray(logits, "float64"))))
        for form in ("one", "tree"):
            other = losses_jax.TokenStatistics(*(
                np.asarray(v, "float64") for v in forms[form](labels, logits)))
            found[f"{dtype}_{form}"] = _statistics_differences(reference, other, scale)
    # Ties in bfloat16 (the first index wins, as argmax), a row with inf, a row with NaN.
    row = np.linspace(-3.0, 3.0, 50)
    rows = np.stack([row, np.where(np.arange(50) % 7 == 3, 3.0, row), row, row])
    rows[2, 10], rows[3, 20] = np.inf, np.nan
    tricky = jnp.asarray(rows[None], jnp.bfloat16)
    tricky_labels = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    results = {form: function(tricky_labels, tricky) for form, function in forms.items()}
    found["tricky_best"] = {form: np.asarray(result[3])[0].tolist()
                            for form, result in results.items()}
    found["non_finite_log_normalizer"] = {
        form: [bool(np.isfinite(v)) for v in np.asarray(result[0])[0]]
        for form, result in results.items()}
    found["non_finite_loss"] = {
        form: [bool(np.isfinite(v)) for v in np.asarray(losses_jax.smoothed_cross_entropy(
            losses_jax.TokenStatistics(*result), 0.1))[0]] for form, result in results.items()}
    # The form each platform's step gets: stablehlo.reduce ops in the lowered statistics.
    shapes = (jax.ShapeDtypeStruct(labels.shape, jnp.int32),
              jax.ShapeDtypeStruct(inputs["tf_logits"].shape, jnp.bfloat16))
    statistics = jax.jit(losses_jax.token_statistics)
    found["reductions_lowered_for"] = {
        platform: len(re.findall(r"stablehlo\.reduce[( ]", jax.export.export(
            statistics, platforms=[platform])(*shapes).mlir_module()))
        for platform in ("cuda", "cpu")}
    return found


def _statistics_differences(reference, other, scale: float) -> dict:
    """How far two `TokenStatistics` (float64 numpy) are apart."""
    from keras_transformer.training import losses_jax

    loss_a = losses_jax.smoothed_cross_entropy(reference, 0.1)
    loss_b = losses_jax.smoothed_cross_entropy(other, 0.1)
    return {
        "log_normalizer_relative": float(np.max(
            np.abs(reference.log_normalizer - other.log_normalizer)
            / np.abs(reference.log_normalizer))),
        "label_logit_difference": float(np.max(np.abs(reference.label_logit
                                                      - other.label_logit))),
        "mean_logit_difference_to_largest": float(
            np.max(np.abs(reference.mean_logit - other.mean_logit)) / scale),
        "argmax_disagreements": int(np.sum(reference.best != other.best)),
        "loss_relative": float(np.max(np.abs(loss_a - loss_b) / np.abs(loss_a)))}


def _in_shuffled_chunks(labels, logits, chunk: int, seed: int):
    """`losses_jax._one_reduction`'s statistics with its combiner applied as a tree: each
    chunk of the vocabulary reduced alone, the partial results then combined in a random
    order, the accumulator on a random side each time."""
    from jax import lax

    from keras_transformer.training import losses_jax

    rng = np.random.default_rng(seed)
    operands = losses_jax._reduced_operands(labels, logits)
    vocab = logits.shape[-1]
    parts = [lax.reduce(tuple(v[..., start:start + chunk] for v in operands),
                        losses_jax._empty(vocab), losses_jax._combine, (logits.ndim - 1,))
             for start in range(0, vocab, chunk)]
    order = rng.permutation(len(parts))
    total = parts[order[0]]
    for index in order[1:]:
        pair = (total, parts[index]) if rng.random() < 0.5 else (parts[index], total)
        total = losses_jax._combine(*pair)
    return losses_jax._statistics(total, vocab)


def check_accumulation() -> tuple[dict, list]:
    """Accumulated micro-batches against one batch holding them all (Adam, 2 updates), and
    the SGD step against the token mean of all micro-batches. Also returns the accumulated
    SGD step, which `check_data_parallel` compares with."""
    import keras

    from keras_transformer.training.optimizer import paper_adam

    updates = _updates(2)
    one, _ = _train(updates, 1, paper_adam(32, 4, 1.0))
    accumulated, _ = _train(updates, len(LONGEST), paper_adam(32, 4, 1.0))
    results = {
        "adam_iterations": [int(one.optimizer.iterations), int(accumulated.optimizer.iterations)],
        "adam_max_difference": _max_difference(_kept(one), _kept(accumulated)),
    }
    sgd_updates = _updates(1, seed=1)
    one, start_one = _train(sgd_updates, 1, keras.optimizers.SGD(1.0))
    accumulated, start = _train(sgd_updates, len(LONGEST), keras.optimizers.SGD(1.0))
    exact, step = _step(start_one, one), _step(start, accumulated)
    results["sgd_same_start"] = _max_difference(start, start_one) == 0.0
    results["sgd_relative_error"] = float(np.max(np.abs(step - exact)) / np.max(np.abs(exact)))
    return results, step


def check_data_parallel(single_device_step: np.ndarray) -> dict:
    """The accumulated SGD step of `check_accumulation` over two devices
    (keras.distribution.DataParallel), against the one on one device."""
    import jax
    import keras

    devices = jax.devices()
    parallel, start = _train(_updates(1, seed=1), len(LONGEST), keras.optimizers.SGD(1.0),
                             distribution=keras.distribution.DataParallel(devices=devices))
    step = _step(start, parallel)
    return {"devices": len(devices),
            "data_parallel_relative_error": float(np.max(np.abs(step - single_device_step))
                                                  / np.max(np.abs(single_device_step))),
            "data_parallel_iterations": int(parallel.optimizer.iterations)}


def check_loss_scaling() -> dict:
    """mixed_float16: an overflowing scale skips the update, which still counts as a step."""
    from keras_transformer.training.loss_scaling import LossScaleOptimizer
    from keras_transformer.training.optimizer import paper_adam

    optimizer = LossScaleOptimizer(paper_adam(32, 4, 1.0), initial_scale=2.0**60)
    updates = _updates(1, seed=3)
    model, initial = _train(updates, len(LONGEST), optimizer, precision="mixed_float16")
    return {"skipped_updates": int(model.optimizer.skipped_updates),
            "iterations": int(model.optimizer.iterations),
            "weights_unchanged": _max_difference(initial, model.trainable_weights) == 0.0,
            "scale": float(model.optimizer.dynamic_scale)}


def check_dropout() -> dict:
    """The 16-bit-mask Dropout under JAX: keras Dropout's distribution, scale and gradient,
    drawn from Threefry-2x32 blocks with the layer's seed generator's key."""
    import jax
    import jax.numpy as jnp
    import keras
    from jax.extend.random import threefry_2x32

    from keras_transformer.layers.dropout import Dropout

    layer = Dropout(0.3, seed=5)
    inputs = jnp.ones((500, 1000))
    key = np.asarray(layer.seed_generator.state.value)
    first = np.asarray(layer(inputs, training=True))
    second = np.asarray(layer(inputs, training=True))
    # Four 16-bit draws from each Threefry-2x32 block, whose counter (0, position) runs over
    # the (500, 250) positions row by row. `threefry_2x32` pairs its count's halves.
    blocks = inputs.size // 4
    words = np.asarray(threefry_2x32(key, jnp.concatenate(
        [jnp.zeros(blocks, jnp.uint32), jnp.arange(blocks, dtype=jnp.uint32)])))
    pairs = np.stack([words[:blocks], words[blocks:]], axis=-1)
    expected = pairs.view(np.uint16).reshape(inputs.shape) >= layer.threshold
    # The gradient is the scaled mask of the same draw.

    def summed(x):
        outputs = layer(x, training=True)
        return jnp.sum(outputs), outputs

    (_, outputs), gradient = jax.value_and_grad(summed, has_aux=True)(jnp.ones((64, 48)))
    scale = 65536 / (65536 - layer.threshold)
    # A data-parallel step's dropout (inputs split by rows over the 2 host devices): each
    # device draws its own rows' masks, with no collective.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
    sharded = jax.device_put(jnp.ones((8, 6, 10)), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("batch")))
    seed_state = layer.seed_generator.state

    def stateless(x, state_value):
        with keras.StatelessScope(state_mapping=[(seed_state, state_value)]):
            return layer(x, training=True)

    program = jax.jit(stateless).lower(sharded, seed_state.value).compile().as_text()
    collectives = sum(program.count(op) for op in ("all-gather", "all-reduce", "all-to-all",
                                                   "collective-permute"))
    bfloat16 = Dropout(0.5, seed=3, dtype="mixed_bfloat16")(
        jnp.ones((3, 5, 7), jnp.bfloat16), training=True)
    return {"backend": keras.backend.backend(),
            "kept_fraction": float((first > 0).mean()),
            "survivor_values": sorted({float(v) for v in np.unique(first[first > 0])}),
            "scale": scale,
            "mask_is_the_16_bit_draw": bool(np.array_equal(first > 0, expected)),
            "masks_differ_between_calls": not np.array_equal(first, second),
            "gradient_is_the_scaled_mask": bool(np.array_equal(
                np.asarray(gradient), np.where(np.asarray(outputs) != 0, np.float32(scale),
                                               np.float32(0.0)))),
            "bfloat16_dtype": str(bfloat16.dtype),
            "devices": len(jax.devices()), "collectives_when_split_by_rows": collectives,
            "identity_when_not_training": bool(np.array_equal(
                np.asarray(layer(inputs, training=False)), np.asarray(inputs)))}


def check_flash_attention(work: Path) -> dict:
    """The parity model with flash attention (lengths and a causal flag, JAX's XLA
    reference of cuDNN's call on a CPU) against its explicit masks, on the same real val
    batch and weights: logits, and the gradient of a label-smoothed loss on them, in
    float32; logits in mixed_bfloat16 (each path's error against float32); one-token
    sources and targets. Two rows are padding alone (length 0), as static-shape batches may
    hold. Counts the calls that took the flash path."""
    import jax

    from keras_transformer.layers import attention_jax
    from keras_transformer.layers.attention import MultiHeadAttention
    from keras_transformer.model.transformer import build_transformer
    from keras_transformer.training.losses import LabelSmoothedCrossEntropy

    inputs = np.load(work / "parity_inputs.npz")
    config = json.loads(str(inputs["config"]))
    source, target = inputs["source"].copy(), inputs["target"].copy()
    source[-2:], target[-2:] = 0, 0
    features = {"source": source, "target": target[:, :-1]}
    labels = target[:, 1:]
    short = {"source": source[:, :1], "target": target[:, :1]}  # one token a side
    loss = LabelSmoothedCrossEntropy(0.1)
    calls = []
    attend = attention_jax.attend_by_lengths

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("causal")))
        return attend(*args, **kwargs)

    attention_jax.attend_by_lengths = counted
    results, paths = {}, []
    try:
        for flash in (False, True):
            model = build_transformer(**dict(config), flash_attention=flash)
            model.load_weights(work / "parity.weights.h5")
            paths = [v.path for v in model.trainable_variables]

            def loss_of(values, model=model):
                logits, _ = model.stateless_call(
                    values, [v.value for v in model.non_trainable_variables], features,
                    training=False)
                return loss(labels, logits), logits

            del calls[:]
            (value, logits), grads = jax.jit(jax.value_and_grad(loss_of, has_aux=True))(
                [v.value for v in model.trainable_variables])
            traced = list(calls)
            bfloat16 = build_transformer(**dict(config), flash_attention=flash,
                                         dtype="mixed_bfloat16")
            bfloat16.load_weights(work / "parity.weights.h5")
            results[flash] = {
                "calls": traced, "loss": float(value),
                "logits": np.asarray(logits, "float64"),
                "grads": [np.asarray(g, "float64") for g in grads],
                "short": np.asarray(model.predict_on_batch(short), "float64"),
                "bfloat16": np.asarray(bfloat16.predict_on_batch(features), "float64")}
    finally:
        attention_jax.attend_by_lengths = attend
    try:
        MultiHeadAttention(32, 4, dropout=0.1, flash_attention=True)
        refused = None
    except ValueError as error:
        refused = str(error)
    plain, flash = results[False], results[True]
    kept = slice(0, -2)  # the padding-only rows' outputs are padding's, read by no one
    scale = np.max(np.abs(plain["logits"]))

    def relative(a, b):
        return float(np.max(np.abs(a[kept] - b[kept])) / scale)

    return {
        "implementation_on_cpu": attention_jax.attention_implementation("bfloat16", 64),
        "flash_calls": [len(plain["calls"]), len(flash["calls"])],
        "causal_flash_calls": sum(flash["calls"]),
        "layers": int(config["num_layers"]),
        "logits_max_relative_difference": relative(plain["logits"], flash["logits"]),
        "one_token_max_relative_difference": relative(plain["short"], flash["short"]),
        "bfloat16_error_explicit": relative(plain["bfloat16"], plain["logits"]),
        "bfloat16_error_flash": relative(flash["bfloat16"], plain["logits"]),
        "loss": [plain["loss"], flash["loss"]],
        # Each variable's gradient by norm, |a - b| / |a|, not element by element: a ReLU
        # input within round-off of zero may fall on the other side of the kink in one path
        # (on the AVX2 machine, one feed-forward unit at one position: 2.7e-4 of that
        # kernel's largest element, 3.5e-5 of its norm). Key biases have a zero true
        # gradient (softmax ignores a constant added to a row's scores): theirs is
        # round-off in either path, compared with the largest gradient.
        "gradient_max_relative_difference": max(
            float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30))
            for path, a, b in zip(paths, plain["grads"], flash["grads"], strict=True)
            if not path.endswith("key/bias")),
        "key_bias_gradient_to_largest": max(
            float(np.max(np.abs(g))) for path, g in zip(paths, flash["grads"], strict=True)
            if path.endswith("key/bias")) / max(float(np.max(np.abs(g)))
                                               for g in plain["grads"]),
        "refusal_with_attention_dropout": refused,
        "gradients_finite": bool(all(np.all(np.isfinite(g)) for g in flash["grads"])),
        "real_target_tokens": int((labels != 0).sum())}


def main(work: Path) -> None:
    results, timings = {}, {}

    def timed(name, check):
        start = time.perf_counter()
        value = check()
        timings[name] = round(time.perf_counter() - start, 2)
        return value

    results["imports"] = timed("imports", check_imports)
    results["parity"] = timed("parity", lambda: check_parity(work))
    results["loss_gradient"] = timed("loss_gradient", lambda: check_loss_gradient(work))
    results["token_statistics"] = timed("token_statistics",
                                        lambda: check_token_statistics(work))
    results["accumulation"], accumulated = timed("accumulation", check_accumulation)
    results["data_parallel"] = timed("data_parallel", lambda: check_data_parallel(accumulated))
    results["loss_scaling"] = timed("loss_scaling", check_loss_scaling)
    results["dropout"] = timed("dropout", check_dropout)
    results["flash_attention"] = timed("flash_attention", lambda: check_flash_attention(work))
    results["seconds"] = timings
    (work / "jax_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
