"""Fused CPU kernels (keras_transformer.kernels): the same results as the TensorFlow ops.

References: the XLA loss pass in `losses` (itself tested against keras' autodiff), and
`layer_normalization` (tested against keras' LayerNormalization) applied to
residual + x * mask, with the mask read back from the kernel's own gradients.

Tolerances: float32 within 1e-5 (round-off of two formulations, ~1-ulp exp polynomial);
bfloat16 outputs and gradients within 1e-2 absolute (bfloat16 has 8 significant bits).
"""

import concurrent.futures

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import kernels
from keras_transformer.layers.normalization import layer_normalization
from keras_transformer.training.losses_tensorflow import _cross_entropy_and_gradient

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def library():
    os_mode = kernels.mode()
    if os_mode == "off":
        pytest.fail("KERAS_TRANSFORMER_FUSED_KERNELS=off: these tests need the kernels")
    return kernels.fused_kernels() or pytest.fail("the fused kernels did not build here")


def tolerance(dtype):
    return F32_TOL if dtype == tf.float32 else BF16_TOL


def gradients(function, tensors, upstream):
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        outputs = function(*tensors)
    return outputs, tape.gradient(outputs, tensors, output_gradients=upstream)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_and_gradient_match_the_xla_pass(library, dtype, eps):
    rng = np.random.default_rng(0)
    logits = tf.cast(rng.normal(size=(3, 5, 50)).astype("float32") * 4, dtype)
    labels = tf.constant(rng.integers(0, 50, (3, 5)), tf.int32)
    upstream = tf.constant(rng.uniform(size=(3, 5)).astype("float32"))
    upstream = tf.tensor_scatter_nd_update(upstream, [[0, 0]], [0.0])  # a padding row
    loss, (gradient,) = gradients(
        lambda x: kernels.smoothed_cross_entropy(library, labels, x, eps), [logits], upstream)
    expected_loss, unscaled = _cross_entropy_and_gradient(logits, labels, eps)
    expected_gradient = tf.cast(unscaled, tf.float32) * upstream[..., None]
    assert loss.dtype == tf.float32 and gradient.dtype == dtype
    np.testing.assert_allclose(loss.numpy(), expected_loss.numpy(), **F32_TOL)
    np.testing.assert_allclose(tf.cast(gradient, tf.float32).numpy(), expected_gradient.numpy(),
                               **tolerance(dtype))
    assert not np.any(tf.cast(gradient, tf.float32).numpy()[0, 0])


def test_cross_entropy_is_stable_for_large_logits(library):
    logits = tf.constant([[1000.0, 0.0, -1000.0]])
    loss = kernels.smoothed_cross_entropy(library, tf.constant([1]), logits, 0.0)
    np.testing.assert_allclose(loss.numpy(), [1000.0], rtol=1e-6)


def test_cross_entropy_rejects_labels_outside_the_vocabulary(library):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"label 7 .* outside \[0, 5\)"):
        kernels.smoothed_cross_entropy(library, tf.constant([1, 7]), tf.zeros([2, 5]), 0.1)


def reference_residual_norm(x, residual, gamma, beta, keep):
    return layer_normalization(residual + x * tf.cast(keep, x.dtype), gamma, beta, 1e-6)


def random_block(dtype, shape=(4, 6, 32), seed=0):
    rng = np.random.default_rng(seed)
    x, residual, upstream = (tf.cast(rng.normal(size=shape).astype("float32") * 2 + 1, dtype)
                             for _ in range(3))
    gamma = tf.constant(rng.normal(size=shape[-1]).astype("float32") + 1)
    beta = tf.constant(rng.normal(size=shape[-1]).astype("float32"))
    return x, residual, gamma, beta, upstream


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_residual_norm_without_dropout_is_layer_norm_of_the_sum(library, dtype):
    x, residual, gamma, beta, upstream = random_block(dtype)
    seed = tf.constant([1, 2], tf.int64)
    tensors = [x, residual, gamma, beta]
    fused, fused_grads = gradients(
        lambda *t: kernels.residual_norm(library, *t, seed, 1e-6, 0.0), tensors, upstream)
    # The reference in float32 from the same (bfloat16-representable) values: the kernel adds
    # x and residual in float32, where the TensorFlow ops would round their bfloat16 sum.
    expected, expected_grads = gradients(
        lambda *t: reference_residual_norm(*t, 1.0),
        [tf.cast(t, tf.float32) for t in tensors], tf.cast(upstream, tf.float32))
    assert fused.dtype == dtype
    for got, want in zip([fused, *fused_grads], [expected, *expected_grads], strict=True):
        np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(),
                                   tf.cast(want, tf.float32).numpy(), **tolerance(dtype))


def fused_with_mask(library, rate, seed, shape=(8, 16, 64), dtype=tf.float32):
    """Output, gradients and the dropout keep-scale recovered as dx / d residual."""
    x, residual, gamma, beta, upstream = random_block(dtype, shape)
    seed = tf.constant(seed, tf.int64)
    outputs, grads = gradients(
        lambda *t: kernels.residual_norm(library, *t, seed, 1e-6, rate),
        [x, residual, gamma, beta], upstream)
    dx, dres = (tf.cast(g, tf.float32).numpy() for g in grads[:2])
    keep = np.divide(dx, dres, out=np.zeros_like(dx), where=dres != 0)
    return (x, residual, gamma, beta, upstream), outputs, grads, keep


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
def test_residual_norm_dropout_is_one_mask_forward_and_backward(library, dtype):
    rate = 0.3
    (x, residual, gamma, beta, upstream), outputs, grads, keep = fused_with_mask(
        library, rate, [5, 6], dtype=dtype)
    # dx = d residual * keep, where keep is 0 or 1 / (1 - rate) per element (up to bfloat16
    # rounding of dx and d residual).
    np.testing.assert_allclose(np.minimum(np.abs(keep), np.abs(keep - 1 / (1 - rate))), 0,
                               atol=1e-4 if dtype == tf.float32 else 2e-2)
    keep = np.where(keep > 0.5, 1 / (1 - rate), 0.0).astype("float32")
    assert abs((keep == 0).mean() - rate) < 0.01  # 8,192 elements: 5 standard deviations
    tensors = [tf.cast(t, tf.float32) for t in (x, residual, gamma, beta)]
    expected, expected_grads = gradients(
        lambda *t: reference_residual_norm(*t, keep), tensors, tf.cast(upstream, tf.float32))
    for got, want in zip([outputs, *grads], [expected, *expected_grads], strict=True):
        np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), want.numpy(),
                                   **tolerance(dtype))


def test_residual_norm_dropout_mask_depends_on_the_seed_only(library):
    *_, first = fused_with_mask(library, 0.5, [1, 2])
    *_, again = fused_with_mask(library, 0.5, [1, 2])
    *_, other = fused_with_mask(library, 0.5, [1, 3])
    np.testing.assert_array_equal(first, again)
    assert 0.4 < (np.sign(first) != np.sign(other)).mean() < 0.6  # independent masks


def test_residual_norm_rejects_mismatched_shapes(library):
    with pytest.raises(tf.errors.InvalidArgumentError, match="same shape"):
        library.kt_residual_norm(tf.zeros([2, 4]), tf.zeros([2, 3]), tf.ones([4]),
                                 tf.zeros([4]), tf.zeros([2], tf.int64), epsilon=1e-6, rate=0.1)


def test_mode_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(kernels.MODE_VARIABLE, "off")
    assert kernels.fused_kernels() is None
    monkeypatch.setenv(kernels.MODE_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="KERAS_TRANSFORMER_FUSED_KERNELS='sometimes'"):
        kernels.mode()


def test_a_failed_build_falls_back_or_raises_and_leaves_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    builds = []
    real_build = kernels.build
    monkeypatch.setattr(kernels, "build", lambda path: builds.append(path) or real_build(path))
    kernels._load.cache_clear()
    kernels._warn_fallback.cache_clear()
    try:
        monkeypatch.setenv(kernels.MODE_VARIABLE, "auto")
        with pytest.warns(RuntimeWarning, match="compiling the fused kernels .* failed"):
            assert kernels.fused_kernels() is None
        assert kernels.fused_kernels() is None
        monkeypatch.setenv(kernels.MODE_VARIABLE, "on")
        with pytest.raises(kernels.KernelBuildError, match="failed"):
            kernels.fused_kernels()
        assert len(builds) == 1  # one attempt per process, not one per layer call
        assert not list(tmp_path.rglob("*.so"))
    finally:
        kernels._load.cache_clear()
        kernels._warn_fallback.cache_clear()


def test_processes_starting_together_build_the_library_once(monkeypatch, tmp_path):
    """Four builders at once (as pytest's workers, or a cluster's workers on one machine,
    start): one compiles, the others wait and find its library; a library that did not load
    is rebuilt once, not once per process."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "cxx"
    # Answers -dM -E (the target flags) with no macros; a "build" takes 0.5 s, is counted and
    # writes the file after -o.
    compiler.write_text(
        "#!/bin/sh\ncase \"$*\" in *-dM*) exit 0;; esac\n"
        f"echo build >> {calls}\nsleep 0.5\n"
        'while [ "$1" != "-o" ]; do shift; done\necho library > "$2"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    path = tmp_path / "cache" / "kernels" / "fused_ops-test.so"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # flock: per open file, so
        built = list(pool.map(lambda _: kernels.build_once(path), range(4)))  # threads too
    assert built == [path] * 4 and path.read_text() == "library\n"
    assert calls.read_text().count("build") == 1
    stale = kernels._file_identity(path)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: kernels.build_once(path, replace=stale), range(2)))
    assert calls.read_text().count("build") == 2 and kernels._file_identity(path) != stale


def test_half_precision_packets_are_off_where_native_enables_them(tmp_path):
    """A CPU with AVX512-FP16 (Sapphire Rapids): TensorFlow's Eigen does not compile with
    `-march=native` there, so the build turns those packets off, and only there."""
    reports = {"fp16": "#define __AVX512FP16__ 1\n#define __AVX512F__ 1\n",
               "plain": "#define __AVX512F__ 1\n"}
    for name, macros in reports.items():
        compiler = tmp_path / f"cxx-{name}"
        compiler.write_text(f"#!/bin/sh\nprintf '{macros}'\n")
        compiler.chmod(0o755)
        flags = kernels._target_flags(str(compiler))
        assert flags == (("-mno-avx512fp16",) if name == "fp16" else ()), name
    assert kernels._target_flags(str(tmp_path / "no-such-compiler")) == ()


def op_types(function, *args) -> set:
    """Op types of the traced function, including the functions nested in its graph."""
    graph_def = tf.function(function).get_concrete_function(*args).graph.as_graph_def()
    types = {node.op for node in graph_def.node}
    return types | {node.op for nested in graph_def.library.function for node in nested.node_def}


def test_only_training_graphs_use_the_kernels(library, monkeypatch):
    """Training calls run the fused ops; inference (and so every export) runs standard ops,
    also for functions nested in the graph."""
    from keras_transformer.model.transformer import build_transformer

    monkeypatch.setenv(kernels.MODE_VARIABLE, "on")
    model = build_transformer("tiny", vocab_size=40, dropout=0.1)
    inputs = {"source": tf.constant([[5, 6, 7, 0]]), "target": tf.constant([[1, 8, 9, 0]])}
    training = op_types(lambda x: model(x, training=True), inputs)
    inference = op_types(lambda x: model(x, training=False), inputs)
    assert "KtResidualNorm" in training
    assert not {name for name in inference if name.startswith("Kt")}


def test_training_step_matches_tensorflow_ops_without_dropout(monkeypatch):
    """One optimizer step with and without the kernels: the same loss and the same weights."""
    import keras

    from keras_transformer.model.transformer import build_transformer
    from keras_transformer.training.losses import LabelSmoothedCrossEntropy

    rng = np.random.default_rng(0)
    inputs = {"source": tf.constant(rng.integers(1, 40, (4, 7)), tf.int32),
              "target": tf.constant(rng.integers(1, 40, (4, 6)), tf.int32)}
    labels = tf.constant(rng.integers(0, 40, (4, 6)), tf.int32)
    results = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(kernels.MODE_VARIABLE, mode)
        keras.utils.set_random_seed(0)
        model = build_transformer("tiny", vocab_size=40)
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=LabelSmoothedCrossEntropy(0.1))
        loss = model.train_on_batch(inputs, labels)
        results[mode] = (loss, [w.numpy() for w in model.trainable_weights])
    np.testing.assert_allclose(results["on"][0], results["off"][0], **F32_TOL)
    for got, want in zip(results["on"][1], results["off"][1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_loss_reads_bfloat16_logits_through_an_exact_upcast(library, monkeypatch):
    """The Keras loss reads model outputs cast bfloat16 -> float32 before the cast: the same
    loss, and the same gradient for the bfloat16 logits, as the TensorFlow ops through the
    cast. The per-token function keeps the float32 logits differentiable."""
    from keras_transformer.training.losses import LabelSmoothedCrossEntropy, token_cross_entropy
    from keras_transformer.training.losses_tensorflow import before_exact_upcast

    rng = np.random.default_rng(0)
    logits16 = tf.cast(rng.normal(size=(2, 3, 20)).astype("float32") * 3, tf.bfloat16)
    labels = tf.constant(rng.integers(1, 20, (2, 3)), tf.int32)

    def loss_and_gradients():
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(logits16)
            logits = tf.cast(logits16, tf.float32)
            assert before_exact_upcast(logits) is not logits  # graph mode: the bf16 input
            loss = LabelSmoothedCrossEntropy(0.1)(labels, logits)
            per_token = tf.reduce_sum(token_cross_entropy(labels, logits, 0.1))
        to_float32 = tape.gradient(per_token, logits)
        return loss, tape.gradient(loss, logits16), to_float32

    results = {}
    for mode in ("on", "off"):
        monkeypatch.setenv(kernels.MODE_VARIABLE, mode)
        traced = tf.function(loss_and_gradients)  # traced anew in each mode
        results[mode] = [tf.cast(t, tf.float32).numpy() for t in traced()]
    np.testing.assert_allclose(results["on"][0], results["off"][0], **F32_TOL)
    np.testing.assert_allclose(results["on"][1], results["off"][1], **BF16_TOL)
    np.testing.assert_allclose(results["on"][2], results["off"][2], **BF16_TOL)
    eager = tf.cast(logits16, tf.float32)
    assert before_exact_upcast(eager) is eager


def test_xla_compiled_steps_use_tensorflow_ops(library):
    from keras_transformer.training.losses import token_cross_entropy

    logits = tf.random.normal([2, 3, 11])
    labels = tf.constant([[1, 2, 3], [4, 5, 0]])
    for jit in (False, True):
        graph = tf.function(lambda x: token_cross_entropy(labels, x, 0.1),
                            jit_compile=jit).get_concrete_function(logits).graph
        used = {op.type for op in graph.get_operations()}
        assert ("KtSmoothedCrossEntropy" in used) is not jit
    compiled = tf.function(lambda x: token_cross_entropy(labels, x, 0.1), jit_compile=True)
    np.testing.assert_allclose(compiled(logits).numpy(),
                               token_cross_entropy(labels, logits, 0.1).numpy(), **F32_TOL)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forward_only_loss_equals_the_differentiable_one(mode, monkeypatch):
    from keras_transformer.training.losses import Perplexity, masked_token_loss_sum

    monkeypatch.setenv(kernels.MODE_VARIABLE, mode)
    rng = np.random.default_rng(1)
    logits = tf.constant(rng.normal(size=(3, 4, 30)).astype("float32") * 2)
    labels = tf.constant(rng.integers(0, 30, (3, 4)), tf.int32)
    with_gradient = masked_token_loss_sum(labels, logits, 0.1)
    value_only = masked_token_loss_sum(labels, logits, 0.1, differentiable=False)
    np.testing.assert_allclose(np.array(value_only), np.array(with_gradient), **F32_TOL)
    perplexity = Perplexity()
    perplexity.update_state(labels, logits)
    loss_sum, tokens = masked_token_loss_sum(labels, logits, 0.0)
    np.testing.assert_allclose(float(perplexity.result()), np.exp(float(loss_sum / tokens)),
                               rtol=1e-5)
