"""Token embeddings and sinusoidal positions (paper 3.4, 3.5)."""

import math

import keras
import numpy as np
import pytest

from keras_transformer.layers.embedding import PositionalEmbedding, sinusoidal_encoding

VOCAB, D_MODEL = 40, 32


def paper_encoding(length, d_model, base=10000.0):
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)), float64."""
    positions = np.arange(length, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
    angles = positions / base ** (two_i / d_model)
    encoding = np.empty((length, d_model))
    encoding[:, 0::2] = np.sin(angles)
    encoding[:, 1::2] = np.cos(angles)
    return encoding


@pytest.fixture(scope="module")
def embedding():
    layer = PositionalEmbedding(VOCAB, D_MODEL, name="embedding")
    layer.build()
    return layer


def _ids(batch, length, seed=0):
    return np.random.default_rng(seed).integers(1, VOCAB, size=(batch, length)).astype("int32")


@pytest.mark.parametrize("d_model", [4, 32, 512])
def test_sinusoidal_encoding_matches_paper_formula(d_model):
    encoding = keras.ops.convert_to_numpy(sinusoidal_encoding(np.arange(64), d_model))
    assert encoding.shape == (64, d_model) and encoding.dtype == np.float32
    np.testing.assert_allclose(encoding, paper_encoding(64, d_model), atol=1e-5)
    # Position 0: sin(0) = 0 in even channels, cos(0) = 1 in odd channels.
    np.testing.assert_array_equal(encoding[0, 0::2], 0.0)
    np.testing.assert_array_equal(encoding[0, 1::2], 1.0)


def test_embedding_works_beyond_any_length_seen_before(embedding):
    embedding(_ids(1, 10))  # a short call first: there is no table sized by earlier calls
    length = 5000
    ids = _ids(1, length, seed=1)
    vectors = keras.ops.convert_to_numpy(embedding(ids))
    assert vectors.shape == (1, length, D_MODEL)
    assert np.all(np.isfinite(vectors))
    tokens = embedding.embeddings.numpy()[ids[0]] * math.sqrt(D_MODEL)
    positions = vectors[0] - tokens
    assert np.abs(positions).max() <= 1.0 + 1e-4  # sines and cosines stay bounded
    # float32 angles up to 5000 rad carry ~3e-4 rad of rounding; still the paper's values.
    np.testing.assert_allclose(positions, paper_encoding(length, D_MODEL), atol=1e-3)
    # Distant positions stay distinguishable.
    assert np.abs(positions[4000] - positions[4001]).max() > 0.1


def test_token_embeddings_are_scaled_by_sqrt_d_model(embedding):
    ids = _ids(2, 7, seed=2)
    vectors = keras.ops.convert_to_numpy(embedding(ids))
    expected = embedding.embeddings.numpy()[ids] * math.sqrt(D_MODEL) + paper_encoding(7, D_MODEL)
    np.testing.assert_allclose(vectors, expected, atol=1e-5)


def test_default_initializer_gives_unit_variance_after_scaling():
    layer = PositionalEmbedding(2000, 64)
    layer.build()
    std = layer.embeddings.numpy().std()
    assert std == pytest.approx(64**-0.5, rel=0.05)


@pytest.mark.parametrize("start_index", [1, 3, 9])
def test_start_index_offsets_positions(embedding, start_index):
    ids = _ids(2, 10, seed=3)
    full = keras.ops.convert_to_numpy(embedding(ids))
    suffix = keras.ops.convert_to_numpy(embedding(ids[:, start_index:], start_index=start_index))
    np.testing.assert_allclose(suffix, full[:, start_index:], atol=1e-5)
    # A tensor start index (as inside a decoding loop) gives the same.
    one = embedding(
        ids[:, start_index:start_index + 1],
        start_index=keras.ops.convert_to_tensor(start_index, "int32"),
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(one), full[:, start_index:start_index + 1], atol=1e-5
    )


def test_reverse_projects_with_transposed_embedding_matrix(embedding):
    x = np.random.default_rng(4).normal(size=(2, 5, D_MODEL)).astype("float32")
    logits = keras.ops.convert_to_numpy(embedding(x, reverse=True))
    assert logits.shape == (2, 5, VOCAB)
    np.testing.assert_allclose(logits, x @ embedding.embeddings.numpy().T, atol=1e-5)


def test_dropout_only_in_training():
    layer = PositionalEmbedding(VOCAB, D_MODEL, dropout=0.5)
    ids = _ids(2, 6, seed=5)
    inference = keras.ops.convert_to_numpy(layer(ids))
    expected = layer.embeddings.numpy()[ids] * math.sqrt(D_MODEL) + paper_encoding(6, D_MODEL)
    np.testing.assert_allclose(inference, expected, atol=1e-5)
    training = keras.ops.convert_to_numpy(layer(ids, training=True))
    assert np.mean(training == 0.0) > 0.2


def test_odd_d_model_raises():
    with pytest.raises(ValueError, match="d_model must be even"):
        PositionalEmbedding(VOCAB, 31)


def test_get_config_round_trip(embedding):
    config = embedding.get_config()
    clone = PositionalEmbedding.from_config(config)
    assert clone.get_config() == config
    clone.build()
    clone.set_weights(embedding.get_weights())
    ids = _ids(2, 4, seed=6)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(clone(ids)), keras.ops.convert_to_numpy(embedding(ids)),
        atol=1e-6,
    )
