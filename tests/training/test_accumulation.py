"""Gradient accumulation: N micro-batches give the update of one batch holding them all, on
one device and over replicas, in float32 and mixed_bfloat16 (with the fused kernels)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.model.transformer import build_transformer
from keras_transformer.training.losses import LabelSmoothedCrossEntropy
from keras_transformer.training.optimizer import paper_adam
from keras_transformer.training.trainer_model import build_trainer
from tests.cli.test_train import REPO, cli_env

VOCAB = 40
SPEC = ({"source": tf.TensorSpec([None, None], tf.int32),
         "target": tf.TensorSpec([None, None], tf.int32)}, tf.TensorSpec([None, None], tf.int32))
# The micro-batches of one update: (sentences, length); their token counts differ a lot, so a
# mean of the micro-batches' means would weigh their tokens unequally.
SHAPES = ((2, 5), (4, 9), (3, 7))


def _ids(rng, batch: int, length: int) -> np.ndarray:
    ids = rng.integers(4, VOCAB, size=(batch, length + 1)).astype("int32")
    for row, n in enumerate(rng.integers(2, length + 1, size=batch)):
        ids[row, n:] = 0
    return ids


def _updates(count: int, seed: int = 0) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Per update, the (source, target) micro-batches, each of its own shape."""
    rng = np.random.default_rng(seed)
    return [[(_ids(rng, b, n), _ids(rng, b, n + 1)) for b, n in SHAPES] for _ in range(count)]


def _features(source, target):
    return {"source": source, "target": target[:, :-1]}, target[:, 1:]


def _pad(array: np.ndarray, width: int) -> np.ndarray:
    return np.pad(array, [(0, 0), (0, width - array.shape[1])])


def _one_batch_each(updates):
    """Every update's micro-batches as one padded batch."""
    for group in updates:
        yield _features(np.concatenate([_pad(s, 10) for s, _ in group]),
                        np.concatenate([_pad(t, 11) for _, t in group]))


def _micro_batches(updates):
    for group in updates:
        for source, target in group:
            yield _features(source, target)


def _train(updates, accumulate: int, optimizer, precision=None, keras_accumulation=False):
    """Weights after fitting `updates` (as micro-batches if accumulate > 1)."""
    keras.utils.set_random_seed(0)
    if keras_accumulation:  # keras' own: the mean of the micro-batches' means
        # TransformerTrainer.compile refuses it, so the plain model (same initial weights).
        model = build_transformer("tiny", vocab_size=VOCAB, dtype=precision)
        optimizer.gradient_accumulation_steps = accumulate
        model.compile(optimizer, loss=LabelSmoothedCrossEntropy(0.1))
    else:
        model = build_trainer("tiny", vocab_size=VOCAB, dtype=precision)
        model.compile(optimizer, loss=LabelSmoothedCrossEntropy(0.1), accumulate_steps=accumulate)
    initial = [w.numpy() for w in model.trainable_weights]
    batches = _one_batch_each if accumulate == 1 else _micro_batches
    data = tf.data.Dataset.from_generator(lambda: batches(updates), output_signature=SPEC)
    model.fit(data.repeat(), epochs=1, steps_per_epoch=len(updates) * accumulate, verbose=0,
              shuffle=False)  # (the plain model's fit would warn that it ignores True)
    return model, initial


def _kept(model) -> list[np.ndarray]:
    # Key biases have a zero true gradient (softmax ignores a shift shared by all keys), so
    # their Adam updates are normalised round-off: left out of weight comparisons.
    return [w.numpy() for w in model.weights if not w.path.endswith("key/bias")]


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def test_accumulated_micro_batches_give_the_weights_of_one_batch_holding_them_all():
    updates = _updates(4)
    one, _ = _train(updates, 1, paper_adam(32, 4, 1.0))
    accumulated, _ = _train(updates, len(SHAPES), paper_adam(32, 4, 1.0))
    # The optimizer (and the learning rate schedule) counted updates, not micro-batches.
    assert int(accumulated.optimizer.iterations) == int(one.optimizer.iterations) == 4
    # float32 round-off of another summation order, after 4 Adam updates.
    assert _max_difference(_kept(one), _kept(accumulated)) < 1e-4
    # keras' own accumulation (a mean of the micro-batches' means) is not the same update:
    # the test can tell.
    means, _ = _train(updates, len(SHAPES), paper_adam(32, 4, 1.0), keras_accumulation=True)
    assert _max_difference(_kept(one), _kept(means)) > 1e-3


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_accumulated_gradient_is_the_token_mean_over_all_micro_batches(precision):
    # With SGD at rate 1, one update moves every weight by minus its gradient.
    updates = _updates(1, seed=1)
    one, start_one = _train(updates, 1, keras.optimizers.SGD(1.0), precision)
    accumulated, start = _train(updates, len(SHAPES), keras.optimizers.SGD(1.0), precision)
    means, start_means = _train(updates, len(SHAPES), keras.optimizers.SGD(1.0), precision,
                                keras_accumulation=True)
    exact = np.concatenate([(a - w.numpy()).ravel()
                            for a, w in zip(start_one, one.trainable_weights, strict=True)])
    assert all(np.array_equal(a, b) for a, b in zip(start, start_one, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(start_means, start_one, strict=True))
    step = np.concatenate([(a - w.numpy()).ravel()
                           for a, w in zip(start, accumulated.trainable_weights, strict=True)])
    mean_of_means = np.concatenate([(a - w.numpy()).ravel()
                                    for a, w in zip(start, means.trainable_weights, strict=True)])
    error = np.linalg.norm(step - exact) / np.linalg.norm(exact)
    control = np.linalg.norm(mean_of_means - exact) / np.linalg.norm(exact)
    # bfloat16 forward/backward passes round differently per batch shape (~3 digits).
    assert error < (1e-5 if precision == "float32" else 2e-2), error
    assert control > 5 * max(error, 1e-3), (control, error)


def test_no_update_before_the_last_micro_batch_of_a_step():
    updates = _updates(1, seed=2)
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=VOCAB)
    model.compile(paper_adam(32, 4, 1.0), loss=LabelSmoothedCrossEntropy(0.1),
                  accumulate_steps=len(SHAPES))
    initial = [w.numpy() for w in model.trainable_weights]
    micro = list(_micro_batches(updates))
    for count, (x, y) in enumerate(micro, start=1):
        model.train_on_batch(x, y)
        unchanged = all(np.array_equal(a, w.numpy())
                        for a, w in zip(initial, model.trainable_weights, strict=True))
        assert unchanged == (count < len(micro)), count
        assert int(model.optimizer.iterations) == (count == len(micro))
    assert model.accumulate_steps == len(SHAPES)


def test_each_fit_and_each_weight_load_starts_a_fresh_update():
    updates = _updates(1, seed=3)
    micro = list(_micro_batches(updates))

    def fitted(model, batches):
        data = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=SPEC)
        model.fit(data, epochs=1, steps_per_epoch=len(batches), verbose=0)

    keras.utils.set_random_seed(0)
    fresh = build_trainer("tiny", vocab_size=VOCAB)
    fresh.compile(paper_adam(32, 4, 1.0), loss=LabelSmoothedCrossEntropy(0.1), accumulate_steps=2)
    initial = fresh.get_weights()
    fitted(fresh, micro[1:3])
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=VOCAB)
    model.compile(paper_adam(32, 4, 1.0), loss=LabelSmoothedCrossEntropy(0.1), accumulate_steps=2)
    fitted(model, micro[:1])  # half an update, never applied
    assert all(np.array_equal(a, b) for a, b in zip(initial, model.get_weights(), strict=True))
    fitted(model, micro[1:3])  # a new fit: micro-batch 0 is not part of this update
    assert _max_difference(fresh.get_weights(), model.get_weights()) == 0.0


def test_compile_refuses_what_accumulation_cannot_do():
    model = build_trainer("tiny", vocab_size=VOCAB)
    for steps in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="accumulate_steps"):
            model.compile(paper_adam(32), loss=LabelSmoothedCrossEntropy(), accumulate_steps=steps)
    with pytest.raises(ValueError, match="sum_and_count"):
        model.compile(paper_adam(32), loss="sparse_categorical_crossentropy", accumulate_steps=2)
    model.compile(paper_adam(32), loss=LabelSmoothedCrossEntropy(), accumulate_steps=2,
                  steps_per_execution=2)
    x, y = next(_micro_batches(_updates(1)))
    with pytest.raises(ValueError, match="steps_per_execution"):
        model.fit(x, y, epochs=1, verbose=0)


# Two logical CPUs under MirroredStrategy, each accumulating 2 micro-batches per update, vs
# one device whose batch holds all 4 (of 4 different shapes).
def compare_with_one_device(strategy, share) -> dict:
    """Trains 3 updates of 2 accumulated micro-batches per replica under `strategy`, and the
    same 3 updates as one batch each on one device; `share(group)` is the micro-batches this
    input pipeline yields for one update's group of 4 (run inside a subprocess)."""
    from keras_transformer.cluster.keras_patches import build_for_distributed_fit
    from keras_transformer.training.losses import GlobalTokenCrossEntropy

    rng = np.random.default_rng(0)
    updates, accumulate = 3, 2
    groups = [[(_ids(rng, b, n), _ids(rng, b, n + 1)) for b, n in ((2, 5), (4, 9), (3, 7), (5, 4))]
              for _ in range(updates)]

    def train(strategy, accumulate):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build_trainer("tiny", vocab_size=VOCAB)
            model.compile(paper_adam(32, 4, 1.0), loss=GlobalTokenCrossEntropy(0.1),
                          accumulate_steps=accumulate)
        if accumulate == 1:
            def batches():
                yield from _one_batch_each(groups)
        else:
            def batches():
                for group in groups:
                    for source, target in share(group):
                        yield _features(source, target)
        build_for_distributed_fit(model, next(batches()))
        data = strategy.distribute_datasets_from_function(
            lambda context: tf.data.Dataset.from_generator(batches, output_signature=SPEC))
        model.fit(data, epochs=1, steps_per_epoch=updates * accumulate, verbose=0)
        return model

    one = train(tf.distribute.get_strategy(), 1)
    two = train(strategy, accumulate)
    return {"replicas": two.distribute_strategy.num_replicas_in_sync,
            "updates": [int(one.optimizer.iterations.numpy()),
                        int(two.optimizer.iterations.numpy())],
            "weight_diff": _max_difference(_kept(one), _kept(two))}


# Two logical CPUs under MirroredStrategy: one input pipeline, whose consecutive elements go
# to consecutive replicas.
TWO_REPLICAS = textwrap.dedent(
    """
    import json
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from keras_transformer.cluster.strategy import select_strategy
    from tests.training.test_accumulation import compare_with_one_device

    print(json.dumps(compare_with_one_device(select_strategy(), lambda group: group)))
    """
)

# One process per worker (TF_CONFIG, MultiWorkerMirroredStrategy, one replica each): worker k
# reads micro-batches k and k + 2 of each group, as replica k above. The strategy first.
TWO_WORKERS = textwrap.dedent(
    """
    import json, os
    from keras_transformer.cluster.strategy import select_strategy
    strategy = select_strategy()
    from tests.training.test_accumulation import compare_with_one_device

    me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(json.dumps(compare_with_one_device(strategy, lambda group: group[me::2])))
    """
)


def _check_against_one_device(output: str) -> None:
    numbers = json.loads(output.strip().splitlines()[-1])
    assert numbers["replicas"] == 2
    assert numbers["updates"] == [3, 3]
    assert numbers["weight_diff"] < 1e-4


def test_two_replicas_accumulating_match_one_device_on_the_whole_batch():
    result = subprocess.run([sys.executable, "-c", TWO_REPLICAS], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    _check_against_one_device(result.stdout)


@pytest.mark.slow
def test_two_workers_accumulating_match_one_device_on_the_whole_batch():
    from tests.cluster.test_workers import run_on_two_workers

    for output in run_on_two_workers(TWO_WORKERS):
        _check_against_one_device(output)


def test_a_compiled_model_reloads_compiled_without_warnings(tmp_path):
    """`.keras` keeps the compile settings, accumulation included; Keras' default would warn
    that a custom `compile()` was skipped and return an uncompiled model."""
    import warnings

    from keras_transformer.training.losses import LabelSmoothedCrossEntropy, MaskedAccuracy
    from keras_transformer.training.optimizer import FusedAdam, paper_adam

    model = build_trainer("tiny", vocab_size=50)
    model.compile(optimizer=paper_adam(32, 100), loss=LabelSmoothedCrossEntropy(0.1),
                  metrics=[MaskedAccuracy()], accumulate_steps=2)
    features = {"source": np.ones((2, 5), "int32"), "target": np.ones((2, 4), "int32")}
    model.fit(features, np.ones((2, 4), "int32"), epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.compiled and isinstance(loaded.optimizer, FusedAdam)
    assert loaded.get_compile_config()["accumulate_steps"] == 2
    assert isinstance(loaded.loss, LabelSmoothedCrossEntropy)
