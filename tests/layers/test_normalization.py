"""3.1 LayerNormalization with the closed-form gradient: the same as keras' layer.

Every comparison is against `keras.layers.LayerNormalization` (or `keras.ops.layer_normalization`)
with the same random gamma and beta, whose gradients come from autodiff.

Tolerances: float32 outputs and gradients within 1e-5 (round-off of the two formulations);
bfloat16 outputs and input gradients within 3e-2 relative and absolute (a few bfloat16 ulps
at these magnitudes), gamma/beta gradients (float32 sums of bfloat16 products) within 1e-2.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.layers import normalization
from keras_transformer.layers.normalization import LayerNormalization, layer_normalization
from keras_transformer.model.transformer import build_transformer

FEATURES = 8
EPSILON = 1e-6
SHAPES = {"rank2": (5, FEATURES), "rank3": (2, 3, FEATURES)}
F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


def random_inputs(shape, seed=0):
    """Off-centre, non-unit-scale inputs, so the normalization does something."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=shape) * 3.0 + 1.5).astype("float32")


def random_gamma_beta(features=FEATURES, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=features).astype("float32") + 1.0,
            rng.normal(size=features).astype("float32"))


def layer_pair(input_shape, seed=1, **kwargs):
    """Ours and keras' layer, built, with the same random weights."""
    ours = LayerNormalization(**kwargs)
    reference = keras.layers.LayerNormalization(**kwargs)
    ours.build(input_shape)
    reference.build(input_shape)
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=w.shape).astype("float32") + (1.0 if "gamma" in w.path else 0.0)
               for w in reference.weights]
    reference.set_weights(weights)
    ours.set_weights(weights)
    return ours, reference


def forward_backward(layer, inputs, upstream, graph=False):
    """(outputs, [d inputs, d weights...]) of sum(outputs * upstream)."""

    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
            loss = tf.reduce_sum(tf.cast(outputs, tf.float32) * upstream)
        return outputs, tape.gradient(loss, [x, *layer.weights])

    if graph:
        # Unknown dimensions, as with variable-length batches.
        spec = tf.TensorSpec([None] * (len(inputs.shape) - 1) + [inputs.shape[-1]], inputs.dtype)
        run = tf.function(run, input_signature=[spec])
    return run(tf.convert_to_tensor(inputs))


def assert_same(ours, reference, **tolerance):
    for a, b in zip(ours, reference, strict=True):
        assert a is not None and b is not None
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a, "float32"), np.asarray(b, "float32"), **tolerance)


@pytest.fixture
def fast_path_calls(monkeypatch):
    """Counts the layer's calls of `layer_normalization` (the closed-form path; under a tape,
    its hand-written gradient)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return layer_normalization(*args, **kwargs)

    monkeypatch.setattr(normalization, "layer_normalization", spy)
    return calls


# --- the function ---


@pytest.mark.parametrize("epsilon", [EPSILON, 0.5])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_function_matches_keras_ops(shape, epsilon):
    x = tf.constant(random_inputs(shape))
    gamma, beta = (tf.constant(v) for v in random_gamma_beta())
    upstream = tf.constant(random_inputs(shape, seed=2))
    results = []
    for function in (
        lambda x, g, b: layer_normalization(x, g, b, epsilon),
        lambda x, g, b: keras.ops.layer_normalization(x, g, b, epsilon=epsilon),
    ):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            outputs = function(x, gamma, beta)
            loss = tf.reduce_sum(outputs * upstream)
        results.append([outputs, *tape.gradient(loss, [x, gamma, beta])])
    assert_same(results[0], results[1], **F32_TOL)
    # And the forward is the textbook formula.
    x64 = x.numpy().astype("float64")
    centered = x64 - x64.mean(-1, keepdims=True)
    expected = centered / np.sqrt((centered**2).mean(-1, keepdims=True) + epsilon)
    np.testing.assert_allclose(
        results[0][0], expected * gamma.numpy() + beta.numpy(), **F32_TOL)


def test_function_keeps_bfloat16_and_constant_rows_finite():
    x = random_inputs((4, FEATURES))
    x[1] = 2.0  # zero variance: only epsilon keeps the gradient finite
    gamma, beta = (tf.constant(v) for v in random_gamma_beta())
    upstream = tf.constant(random_inputs((4, FEATURES), seed=2), tf.bfloat16)
    results = []
    for function in (layer_normalization,
                     lambda x, g, b, e: keras.ops.layer_normalization(x, g, b, epsilon=e)):
        x16 = tf.constant(x, tf.bfloat16)
        with tf.GradientTape() as tape:
            tape.watch([x16, gamma, beta])
            outputs = function(x16, gamma, beta, 1e-3)
            loss = tf.reduce_sum(tf.cast(outputs * upstream, tf.float32))
        results.append([outputs, *tape.gradient(loss, [x16, gamma, beta])])
    ours = results[0]
    assert [t.dtype for t in ours] == [tf.bfloat16, tf.bfloat16, tf.float32, tf.float32]
    assert all(np.all(np.isfinite(np.asarray(t, "float32"))) for t in ours)
    np.testing.assert_allclose(np.asarray(ours[0], "float32")[1], beta.numpy(), **BF16_TOL)
    assert_same(ours[:2], results[1][:2], **BF16_TOL)
    assert_same(ours[2:], results[1][2:], rtol=1e-2, atol=1e-2)


# --- the layer: the closed-form path ---


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_layer_matches_keras_float32(shape, graph, fast_path_calls):
    ours, reference = layer_pair(shape, epsilon=EPSILON)
    x = random_inputs(shape)
    upstream = random_inputs(shape, seed=2)
    out, grads = forward_backward(ours, x, upstream, graph)
    ref_out, ref_grads = forward_backward(reference, x, upstream, graph)
    assert fast_path_calls  # the closed-form path was used, not keras' fallback
    assert len(grads) == 3  # inputs, gamma, beta
    assert out.dtype == tf.float32
    assert_same([out, *grads], [ref_out, *ref_grads], **F32_TOL)
    # Not vacuous: gamma and beta are not the identity's ones and zeros.
    assert np.abs(ours.gamma.numpy() - 1.0).max() > 0.1 and np.abs(ours.beta.numpy()).max() > 0.1


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_layer_matches_keras_mixed_bfloat16(shape, fast_path_calls):
    ours, reference = layer_pair(shape, epsilon=EPSILON, dtype="mixed_bfloat16")
    assert ours.compute_dtype == "bfloat16" and ours.variable_dtype == "float32"
    assert ours.gamma.dtype == ours.beta.dtype == "float32"
    upstream = random_inputs(shape, seed=2)
    for x in (random_inputs(shape), tf.constant(random_inputs(shape), tf.bfloat16)):
        out, grads = forward_backward(ours, x, upstream)
        ref_out, ref_grads = forward_backward(reference, x, upstream)
        assert out.dtype == tf.bfloat16
        # d inputs in the inputs' dtype; d gamma, d beta in float32, like the variables.
        assert [g.dtype for g in grads] == [tf.convert_to_tensor(x).dtype, tf.float32, tf.float32]
        assert_same([out, grads[0]], [ref_out, ref_grads[0]], **BF16_TOL)
        assert_same(grads[1:], ref_grads[1:], rtol=1e-2, atol=1e-2)
    # keras' LayerNormalization does not autocast its inputs: float32 ones stay float32.
    assert fast_path_calls == [tf.float32, tf.bfloat16]
    # Close to the float32 layer too: the math is float32, only in/out are rounded.
    float_layer, _ = layer_pair(shape, epsilon=EPSILON)
    float_out = float_layer(random_inputs(shape))
    np.testing.assert_allclose(
        np.asarray(ours(random_inputs(shape)), "float32"), float_out, **BF16_TOL)


def test_axis_given_as_last_index_uses_closed_form(fast_path_calls):
    shape = SHAPES["rank3"]
    ours, reference = layer_pair(shape, axis=2, epsilon=EPSILON)
    x, upstream = random_inputs(shape), random_inputs(shape, seed=2)
    out, grads = forward_backward(ours, x, upstream)
    ref_out, ref_grads = forward_backward(reference, x, upstream)
    assert len(fast_path_calls) == 1
    assert_same([out, *grads], [ref_out, *ref_grads], **F32_TOL)


def custom_gradient_ops(graph) -> list:
    """The IdentityN ops through which `tf.custom_gradient` routes its calls' outputs."""
    ops = []
    for op in graph.get_operations():
        try:
            op.get_attr("_gradient_op_type")
        except ValueError:
            continue
        ops.append(op)
    return ops


def test_hand_written_gradient_only_where_a_tape_records():
    """Traced under a tape (a training step), the layer routes its outputs through the
    hand-written gradient; traced without one (inference, decoding, an export), it makes the
    same forward operations without it, with the same values, and autodiff still
    differentiates them."""
    shape = SHAPES["rank3"]
    ours, reference = layer_pair(shape, epsilon=EPSILON)
    x = tf.constant(random_inputs(shape))
    upstream = tf.constant(random_inputs(shape, seed=2))

    @tf.function(autograph=False)
    def with_tape(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = ours(x)
            loss = tf.reduce_sum(outputs * upstream)
        return outputs, tape.gradient(loss, [x, *ours.weights])

    @tf.function(autograph=False)
    def without_tape(x):
        outputs = ours(x)
        loss = tf.reduce_sum(outputs * upstream)
        return outputs, tf.gradients(loss, [x, *ours.weights])

    taped = with_tape.get_concrete_function(x)
    untaped = without_tape.get_concrete_function(x)
    assert len(custom_gradient_ops(taped.graph)) == 1
    assert custom_gradient_ops(untaped.graph) == []
    taped_out, taped_grads = taped(x)
    untaped_out, untaped_grads = untaped(x)
    np.testing.assert_allclose(untaped_out, taped_out, rtol=1e-6, atol=1e-6)
    ref_out, ref_grads = forward_backward(reference, x, upstream)
    assert_same([untaped_out, *untaped_grads], [ref_out, *ref_grads], **F32_TOL)
    assert_same(taped_grads, ref_grads, **F32_TOL)


def test_fit_takes_the_hand_written_gradient_and_evaluation_does_not(monkeypatch):
    recorded = []

    def spy(original=normalization.gradients_recorded):
        recorded.append(original())
        return recorded[-1]

    monkeypatch.setattr(normalization, "gradients_recorded", spy)
    inputs = keras.Input((3, FEATURES))
    model = keras.Model(inputs, LayerNormalization(epsilon=EPSILON)(keras.layers.Dense(
        FEATURES)(inputs)))
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    x, y = random_inputs((4, 3, FEATURES)), random_inputs((4, 3, FEATURES), seed=2)
    recorded.clear()
    model.fit(x, y, epochs=1, verbose=0)
    assert recorded and all(recorded)  # the train step traces the model inside its tape
    recorded.clear()
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    assert len(recorded) >= 2 and not any(recorded)


# --- the layer: keras' fallback ---


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning")
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(axis=1),
        dict(axis=[1, 2]),
        dict(center=False),
        dict(scale=False),
        dict(rms_scaling=True),
    ],
    ids=["axis1", "axes12", "no_center", "no_scale", "rms_scaling"],
)
def test_fallback_matches_keras(kwargs, fast_path_calls):
    shape = SHAPES["rank3"]
    ours, reference = layer_pair(shape, epsilon=EPSILON, **kwargs)
    x, upstream = random_inputs(shape), random_inputs(shape, seed=2)
    out, grads = forward_backward(ours, x, upstream)
    ref_out, ref_grads = forward_backward(reference, x, upstream)
    assert not fast_path_calls
    assert len(grads) == 1 + len(reference.weights)
    assert_same([out, *grads], [ref_out, *ref_grads], **F32_TOL)


# --- configuration and saving ---


def test_get_config_from_config_round_trip():
    shape = SHAPES["rank3"]
    ours, _ = layer_pair(shape, axis=-1, epsilon=1e-4, center=True, name="ln")
    config = ours.get_config()
    clone = LayerNormalization.from_config(config)
    assert type(clone) is LayerNormalization
    assert clone.get_config() == config
    assert (clone.epsilon, clone.center, clone.scale) == (1e-4, True, True)

    restored = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(keras.saving.serialize_keras_object(ours))))
    assert type(restored) is LayerNormalization
    assert restored.get_config() == config
    assert restored.built  # from the serialized build config
    restored.set_weights(ours.get_weights())
    x = random_inputs(shape)
    np.testing.assert_array_equal(restored(x), ours(x))
    # The registered name, so that `.keras` files find this class.
    assert keras.saving.get_registered_name(LayerNormalization) == (
        "keras_transformer>LayerNormalization")


def randomize_layer_norms(model, seed=0):
    """Random gamma/beta in every LayerNorm (initially ones/zeros); returns the layers."""
    rng = np.random.default_rng(seed)
    norms = [layer for layer in model._flatten_layers()
             if isinstance(layer, keras.layers.LayerNormalization)]
    for layer in norms:
        layer.set_weights([rng.normal(size=w.shape).astype("float32") + 1.0 for w in
                           layer.weights])
    return norms


def test_functional_model_with_both_paths_saves_and_loads(tmp_path):
    inputs = keras.Input((3, FEATURES))
    hidden = LayerNormalization(epsilon=EPSILON, name="last_axis")(inputs)
    outputs = LayerNormalization(axis=1, center=False, name="axis1")(hidden)
    model = keras.Model(inputs, outputs)
    randomize_layer_norms(model)
    x = random_inputs((2, 3, FEATURES))
    path = tmp_path / "norms.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    for name in ("last_axis", "axis1"):
        assert type(restored.get_layer(name)) is LayerNormalization
        assert restored.get_layer(name).get_config() == model.get_layer(name).get_config()
    np.testing.assert_array_equal(restored(x), model(x))


def test_pre_norm_transformer_save_load_keeps_layer_norms(tmp_path):
    # tests/model/test_transformer.py round-trips post-norm models with the initial (ones/zeros) LayerNorm
    # weights; here every LayerNorm, including the pre-norm stacks' final ones, has random
    # weights, so a LayerNorm whose weights were not restored would change the logits.
    keras.utils.set_random_seed(3)
    model = build_transformer("tiny", vocab_size=50, pre_norm=True, num_layers=1)
    rng = np.random.default_rng(0)
    inputs = {"source": rng.integers(4, 50, size=(2, 5)).astype("int32"),
              "target": rng.integers(4, 50, size=(2, 4)).astype("int32")}
    model(inputs)
    norms = randomize_layer_norms(model)
    # 2 per encoder layer, 3 per decoder layer, and the final encoder and decoder LayerNorm.
    assert len(norms) == 2 + 3 + 2
    assert all(type(layer) is LayerNormalization for layer in norms)
    path = tmp_path / "pre_norm.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    restored_norms = [layer for layer in restored._flatten_layers()
                      if isinstance(layer, keras.layers.LayerNormalization)]
    assert [type(layer) for layer in restored_norms] == [LayerNormalization] * len(norms)
    for layer, restored_layer in zip(norms, restored_norms, strict=True):
        for w, restored_w in zip(layer.weights, restored_layer.weights, strict=True):
            np.testing.assert_array_equal(restored_w.numpy(), w.numpy())
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(restored(inputs)), keras.ops.convert_to_numpy(model(inputs)))
