"""The assembled Transformer: masking, cached decoding, weight tying, presets, saving, training.

Tolerances: logits that must not depend on some input are compared with atol 1e-5 (float32
round-off of reordered sums); `.keras` round trips with atol 1e-6.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.model.transformer import (
    PRESETS,
    Transformer,
    TransformerConfig,
    build_transformer,
    transformer_config,
)
from keras_transformer.training.losses import LabelSmoothedCrossEntropy, MaskedAccuracy, Perplexity
from keras_transformer.training.optimizer import paper_adam

PAD, BOS, EOS = 0, 2, 3
VOCAB = 37
ATOL = 1e-5
VARIANTS = {
    "post_norm": dict(),
    "pre_norm": dict(pre_norm=True),
    "untied": dict(tie_embeddings=False),
}


@pytest.fixture(scope="module")
def models():
    """Tiny models built once per module, by variant name."""
    keras.utils.set_random_seed(1234)
    return {name: build_transformer("tiny", vocab_size=VOCAB, **overrides)
            for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def batch():
    """Source with rows of length 7, 5 and 2 (0-padded); target starting with BOS."""
    rng = np.random.default_rng(0)
    source = rng.integers(4, 30, size=(3, 7)).astype("int32")
    source[1, 5:] = PAD
    source[2, 2:] = PAD
    target = rng.integers(4, 30, size=(3, 6)).astype("int32")
    target[:, 0] = BOS
    return source, target


def logits_of(model, source, target):
    return keras.ops.convert_to_numpy(model({"source": source, "target": target}))


def expected_parameter_count(config: TransformerConfig) -> int:
    """Weights of the paper's architecture, counted by hand."""
    d, d_ff, n, v = config.d_model, config.d_ff, config.num_layers, config.vocab_size
    attention = 4 * (d * d + d)  # W_Q, W_K, W_V (d x h x d_k, h d_k = d) and W_O, with biases
    feed_forward = d * d_ff + d_ff + d_ff * d + d
    layer_norm = 2 * d
    encoder_layer = attention + feed_forward + 2 * layer_norm
    decoder_layer = 2 * attention + feed_forward + 3 * layer_norm
    count = n * (encoder_layer + decoder_layer) + v * d  # one shared embedding matrix
    if config.pre_norm:
        count += 2 * layer_norm  # final encoder and decoder LayerNorm
    if not config.tie_embeddings:
        count += v * d + d * v  # separate target embedding and pre-softmax projection
    return count


def embedding_variables(model):
    return [w for w in model.weights if w.path.endswith("embeddings")]


# --- masking ---


@pytest.mark.parametrize("variant", ["post_norm", "pre_norm"])
def test_decoder_is_causal(models, batch, variant):
    model = models[variant]
    source, target = batch
    reference = logits_of(model, source, target)
    rng = np.random.default_rng(1)
    for t in range(target.shape[1] - 1):
        changed = target.copy()
        changed[:, t + 1:] = rng.integers(4, 30, size=changed[:, t + 1:].shape)
        changed[:, t + 1] = np.where(changed[:, t + 1] == target[:, t + 1], 31, changed[:, t + 1])
        logits = logits_of(model, source, changed)
        np.testing.assert_allclose(logits[:, :t + 1], reference[:, :t + 1], atol=ATOL)
        # The check is not vacuous: the changed position itself does see its new token.
        assert np.abs(logits[:, t + 1] - reference[:, t + 1]).max() > 1e-3


@pytest.mark.parametrize("variant", ["post_norm", "pre_norm"])
def test_padding_invariance(models, batch, variant):
    model = models[variant]
    source, target = batch
    reference = logits_of(model, source, target)
    # Extra source padding.
    padded_source = np.pad(source, ((0, 0), (0, 4)))
    np.testing.assert_allclose(logits_of(model, padded_source, target), reference, atol=ATOL)
    # Extra target padding: real positions unchanged.
    padded_target = np.pad(target, ((0, 0), (0, 3)))
    np.testing.assert_allclose(
        logits_of(model, source, padded_target)[:, :target.shape[1]], reference, atol=ATOL
    )
    # Each padded row gives what the row gives alone, without any padding.
    for row, length in ((1, 5), (2, 2)):
        alone = logits_of(model, source[row:row + 1, :length], target[row:row + 1])
        np.testing.assert_allclose(alone[0], reference[row], atol=ATOL)
    # Sanity: a real source token does matter.
    changed = source.copy()
    changed[:, 0] = np.where(source[:, 0] == 5, 6, 5)
    assert np.abs(logits_of(model, changed, target) - reference).max() > 1e-3


def test_all_padding_source_row_gives_finite_logits(models, batch):
    model = models["post_norm"]
    source, target = batch
    empty = source.copy()
    empty[2] = PAD  # fully masked attention rows must not produce NaN
    logits = logits_of(model, empty, target)
    assert np.all(np.isfinite(logits))
    np.testing.assert_allclose(logits[:2], logits_of(model, source, target)[:2], atol=ATOL)


# --- incremental decoding ---


def _shapes(cache) -> list:
    return [[tuple(t.shape) for t in pair] for pair in cache]


def _dtypes(cache) -> set:
    return {keras.backend.standardize_dtype(t.dtype) for pair in cache for t in pair}


@pytest.mark.parametrize("variant", ["post_norm", "pre_norm", "untied"])
def test_cached_decoding_matches_full_forward(models, batch, variant):
    model = models[variant]
    source, target = batch
    reference = logits_of(model, source, target)
    batch_size, length = target.shape
    max_length = length + 2  # the cache may be longer than what is decoded
    encoder_output, source_mask = model.encode(source)
    self_cache, cross_cache = model.initial_cache(encoder_output, max_length)
    config = model.config
    d_k = config.d_model // config.num_heads
    # One (keys, values) pair per layer, head-major.
    cache_shapes = [[(batch_size, config.num_heads, max_length, d_k)] * 2] * config.num_layers
    assert _shapes(self_cache) == cache_shapes
    assert _shapes(cross_cache) == [
        [(batch_size, config.num_heads, source.shape[1], d_k)] * 2] * config.num_layers
    steps = []
    for i in range(length):
        logits, new_cache = model.decode(target[:, i:i + 1], source_mask, self_cache, cross_cache, i)
        # Same shape and dtype every step, so the cache can be a while-loop variable.
        assert _shapes(new_cache) == cache_shapes
        assert {t.dtype for pair in new_cache for t in pair} == {self_cache[0][0].dtype}
        self_cache = new_cache
        steps.append(keras.ops.convert_to_numpy(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), reference, atol=ATOL)


def test_decode_returns_cross_attention_scores(models, batch):
    model = models["post_norm"]
    source, target = batch
    encoder_output, source_mask = model.encode(source)
    self_cache, cross_cache = model.initial_cache(encoder_output, 4)
    logits, _, scores = model.decode(
        target[:, :1], source_mask, self_cache, cross_cache, 0, return_attention_scores=True
    )
    assert len(scores) == model.config.num_layers
    for layer_scores in scores:
        layer_scores = keras.ops.convert_to_numpy(layer_scores)
        assert layer_scores.shape == (3, model.config.num_heads, 1, source.shape[1])
        np.testing.assert_allclose(layer_scores.sum(-1), 1.0, atol=1e-6)
        pad = np.broadcast_to((source == PAD)[:, None, None, :], layer_scores.shape)
        assert np.all(layer_scores[pad] == 0.0)


# --- weight tying (paper 3.4) ---


def test_three_way_weight_tying(models, batch):
    model = models["post_norm"]
    source, target = batch
    assert model.source_embedding is model.target_embedding
    assert model.output_projection is None
    (embeddings,) = embedding_variables(model)  # exactly one matrix
    assert tuple(embeddings.shape) == (VOCAB, model.config.d_model)

    # Logits are the last decoder output times the embedding matrix transposed.
    last_layer = model.get_layer(f"decoder_layer_{model.config.num_layers - 1}")
    hidden_model = keras.Model(model.inputs, last_layer.output)
    hidden = keras.ops.convert_to_numpy(hidden_model({"source": source, "target": target}))
    reference = logits_of(model, source, target)
    original = embeddings.numpy()
    np.testing.assert_allclose(reference, hidden @ original.T, atol=ATOL)

    unused = 35  # in neither source nor target: only the output projection uses its row
    assert unused not in source and unused not in target
    delta = np.random.default_rng(2).normal(size=original.shape[1]).astype("float32")
    perturbed = original.copy()
    perturbed[unused] += delta
    try:
        embeddings.assign(perturbed)
        logits = logits_of(model, source, target)
        np.testing.assert_allclose(
            logits[..., unused] - reference[..., unused], hidden @ delta, atol=ATOL
        )
        others = np.arange(VOCAB) != unused
        np.testing.assert_allclose(logits[..., others], reference[..., others], atol=ATOL)

        # A token only in the source changes every logit: the encoder reads the same matrix.
        source_only = int(source[0, 1])
        assert source_only not in target
        perturbed = original.copy()
        perturbed[source_only] += delta
        embeddings.assign(perturbed)
        assert np.abs(logits_of(model, source, target) - reference).max() > 1e-3
    finally:
        embeddings.assign(original)
    np.testing.assert_array_equal(logits_of(model, source, target), reference)


def test_untied_model_has_separate_matrices(models, batch):
    model = models["untied"]
    source, target = batch
    assert model.source_embedding is not model.target_embedding
    variables = embedding_variables(model)
    assert len(variables) == 2
    assert len({w.path for w in variables}) == 2
    projection = model.output_projection.kernel
    assert tuple(projection.shape) == (model.config.d_model, VOCAB)

    reference = logits_of(model, source, target)
    target_embeddings = model.target_embedding.embeddings
    unused = 35
    original = target_embeddings.numpy()
    perturbed = original.copy()
    perturbed[unused] += 1.0
    try:
        target_embeddings.assign(perturbed)  # the output does not read the target embedding
        np.testing.assert_allclose(logits_of(model, source, target), reference, atol=ATOL)
    finally:
        target_embeddings.assign(original)


# --- presets and configuration ---


def test_presets_have_paper_hyperparameters():
    base = transformer_config("base")
    assert (base.num_layers, base.d_model, base.num_heads, base.d_ff, base.dropout) == (
        6, 512, 8, 2048, 0.1
    )
    big = transformer_config("big")
    assert (big.num_layers, big.d_model, big.num_heads, big.d_ff, big.dropout) == (
        6, 1024, 16, 4096, 0.3
    )
    small = transformer_config("small")
    assert (small.num_layers, small.d_model, small.num_heads, small.d_ff) == (3, 256, 8, 1024)
    tiny = transformer_config("tiny")
    assert tiny.d_model % tiny.num_heads == 0
    assert set(PRESETS) == {"base", "big", "small", "tiny"}
    # Paper defaults shared by all presets.
    for config in (base, big, small):
        assert config.attention_dropout == 0.0
        assert config.activation == "relu"
        assert not config.pre_norm
        assert config.tie_embeddings
        assert config.max_wavelength == 10000.0
    # Paper heads: d_k = d_model / h = 64 for base and big.
    assert base.d_model // base.num_heads == 64 == big.d_model // big.num_heads
    # Overrides replace only what they name.
    custom = transformer_config("small", dropout=0.3, vocab_size=1000)
    assert (custom.dropout, custom.vocab_size, custom.d_model) == (0.3, 1000, 256)


def test_base_model_parameter_count_and_head_size():
    model = build_transformer("base", vocab_size=100)
    assert model.count_params() == expected_parameter_count(model.config) == 44_189_696
    attention = model.encoder_layers[0].self_attention
    assert tuple(attention._query_dense.kernel.shape) == (512, 8, 64)
    assert tuple(attention._output_dense.kernel.shape) == (8, 64, 512)
    assert model.encoder_layers[0].dropout == 0.1 and model.source_embedding.dropout == 0.1


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_parameter_counts(models, variant):
    model = models[variant]
    assert model.count_params() == expected_parameter_count(model.config)


@pytest.mark.parametrize(
    "preset, overrides, message",
    [
        ("tiny", dict(d_model=30, num_heads=4), "not divisible by num_heads"),
        ("base", dict(num_heads=7), "not divisible by num_heads"),
        ("huge", dict(), "Unknown preset 'huge'"),
        ("tiny", dict(num_head=4), r"Unknown model setting\(s\) \['num_head'\]"),
        ("tiny", dict(vocab_size=3), "vocab_size must be an integer >= 4"),
        ("tiny", dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
        ("tiny", dict(attention_dropout=1.0), r"attention_dropout must be in \[0, 1\)"),
        ("tiny", dict(num_layers=0), "num_layers must be a positive integer"),
        ("tiny", dict(d_ff=64.0), "d_ff must be a positive integer"),
    ],
)
def test_bad_builder_input_raises_clear_value_error(preset, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_transformer(preset, vocab_size=overrides.pop("vocab_size", VOCAB), **overrides)


def test_constructor_validates_too():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        Transformer(vocab_size=VOCAB, num_layers=1, d_model=30, num_heads=4, d_ff=8)


def test_dropout_only_in_training(batch):
    model = build_transformer("tiny", vocab_size=VOCAB, dropout=0.3)
    source, target = batch
    inputs = {"source": source, "target": target}
    first = keras.ops.convert_to_numpy(model(inputs))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(inputs)), first)
    trained = keras.ops.convert_to_numpy(model(inputs, training=True))
    assert np.abs(trained - first).max() > 1e-3


# --- saving ---


@pytest.mark.parametrize("variant", ["post_norm", "untied"])
def test_keras_save_load_round_trip(models, batch, tmp_path, variant):
    model = models[variant]
    source, target = batch
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert isinstance(restored, Transformer)
    assert restored.config == model.config
    assert restored.get_config() == model.get_config()
    reference = logits_of(model, source, target)
    np.testing.assert_allclose(logits_of(restored, source, target), reference, atol=1e-6)
    # The decoding API survives too.
    encoder_output, source_mask = restored.encode(source)
    self_cache, cross_cache = restored.initial_cache(encoder_output, target.shape[1])
    logits, _ = restored.decode(target[:, :1], source_mask, self_cache, cross_cache, 0)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(logits), reference[:, :1], atol=ATOL)


def test_mixed_bfloat16_model_and_round_trip(batch, tmp_path):
    global_policy = keras.config.dtype_policy()
    try:
        source, target = batch
        model = build_transformer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
        assert keras.config.dtype_policy().name == global_policy.name  # untouched
        assert model.dtype_policy.name == "mixed_bfloat16"
        assert model.compute_dtype == "bfloat16" and model.variable_dtype == "float32"
        assert model.decoder_layers[0].self_attention.compute_dtype == "bfloat16"
        assert all(w.dtype == "float32" for w in model.weights)
        logits = model({"source": source, "target": target})
        assert keras.backend.standardize_dtype(logits.dtype) == "float32"
        logits = keras.ops.convert_to_numpy(logits)

        # Same weights in float32 give nearly the same logits.
        float_model = build_transformer("tiny", vocab_size=VOCAB)
        float_model.set_weights(model.get_weights())
        assert np.abs(logits_of(float_model, source, target) - logits).max() < 0.25

        # The cache is in the compute dtype from the start and stays so.
        encoder_output, source_mask = model.encode(source)
        self_cache, cross_cache = model.initial_cache(encoder_output, target.shape[1])
        assert _dtypes(self_cache) == _dtypes(cross_cache) == {"bfloat16"}
        step_logits, new_cache = model.decode(target[:, :1], source_mask, self_cache,
                                              cross_cache, 0)
        assert _dtypes(new_cache) == {"bfloat16"}
        assert keras.backend.standardize_dtype(step_logits.dtype) == "float32"

        path = tmp_path / "bf16.keras"
        model.save(path)
        restored = keras.models.load_model(path)
        assert restored.dtype_policy.name == "mixed_bfloat16"
        assert restored.compute_dtype == "bfloat16"
        assert restored.decoder_layers[0].self_attention.compute_dtype == "bfloat16"
        np.testing.assert_allclose(logits_of(restored, source, target), logits, atol=1e-6)
    finally:
        keras.config.set_dtype_policy(global_policy)


# --- training ---


def copy_task(size, vocab, max_length, seed):
    """Copy a random sentence: source w, target input BOS w, labels w EOS; 0-padded."""
    rng = np.random.default_rng(seed)
    source = np.zeros((size, max_length), "int32")
    target = np.zeros((size, max_length + 1), "int32")
    labels = np.zeros((size, max_length + 1), "int32")
    for i in range(size):
        length = rng.integers(3, max_length + 1)
        words = rng.integers(4, vocab, size=length)
        source[i, :length] = words
        target[i, 0], target[i, 1:length + 1] = BOS, words
        labels[i, :length], labels[i, length] = words, EOS
    return {"source": source, "target": target}, labels


def test_fit_evaluate_predict():
    keras.utils.set_random_seed(0)
    vocab = 16
    inputs, labels = copy_task(128, vocab, 6, seed=3)
    dataset = tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(16)
    # One layer: tracing the training step costs far more than running it on 2 CPU cores.
    model = build_transformer("tiny", vocab_size=vocab, num_layers=1)
    model.compile(
        optimizer=paper_adam(model.config.d_model, warmup_steps=40),
        loss=LabelSmoothedCrossEntropy(0.1),
        metrics=[MaskedAccuracy(), Perplexity()],
    )
    before = model.evaluate(dataset, verbose=0, return_dict=True)
    history = model.fit(dataset, epochs=4, shuffle=False, verbose=0).history
    after = model.evaluate(dataset, verbose=0, return_dict=True)

    assert set(history) == {"loss", "accuracy", "perplexity"}
    assert history["loss"][-1] < history["loss"][0]
    assert after["loss"] < before["loss"] - 0.3
    assert after["accuracy"] > before["accuracy"]
    assert 1.0 < after["perplexity"] < before["perplexity"]

    # The same data as dict arrays gives the same evaluation.
    from_arrays = model.evaluate(inputs, labels, batch_size=16, verbose=0, return_dict=True)
    for name, value in after.items():
        assert from_arrays[name] == pytest.approx(value, rel=1e-4)

    direct = logits_of(model, inputs["source"], inputs["target"])
    predicted = model.predict(inputs, batch_size=16, verbose=0)
    assert predicted.shape == (128, 7, vocab) and predicted.dtype == np.float32
    np.testing.assert_allclose(predicted, direct, atol=ATOL)
    predicted = model.predict(dataset.map(lambda x, y: x), verbose=0)
    np.testing.assert_allclose(predicted, direct, atol=ATOL)
