"""Multi-head attention (paper 3.2): head size, masking, key/value cache, serialization."""

import keras
import numpy as np
import pytest

from keras_transformer.layers.attention import MultiHeadAttention, causal_mask, padding_mask

D_MODEL, HEADS, BATCH = 32, 4, 3
ATOL = 1e-5


def _rng(seed=0):
    return np.random.default_rng(seed)


def _vectors(batch, length, seed=0):
    return _rng(seed).normal(size=(batch, length, D_MODEL)).astype("float32")


@pytest.fixture(scope="module")
def attention():
    layer = MultiHeadAttention(D_MODEL, HEADS, name="mha")
    layer.build((None, None, D_MODEL), (None, None, D_MODEL))
    return layer


@pytest.mark.parametrize("d_model, num_heads", [(32, 4), (512, 8), (1024, 16)])
def test_head_size_is_d_model_over_num_heads(d_model, num_heads):
    layer = MultiHeadAttention(d_model, num_heads)
    layer.build((None, None, d_model), (None, None, d_model))
    d_k = d_model // num_heads
    assert layer.num_heads == num_heads
    assert layer.key_dim == d_k
    assert layer.value_dim == d_k
    for dense in (layer._query_dense, layer._key_dense, layer._value_dense):
        assert tuple(dense.kernel.shape) == (d_model, num_heads, d_k)
    assert tuple(layer._output_dense.kernel.shape) == (num_heads, d_k, d_model)
    # Multi-head costs as much as one full-width head: 4 d_model^2 weights plus biases.
    assert layer.count_params() == 4 * d_model * d_model + 4 * d_model


def test_d_model_not_divisible_by_heads_raises():
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by num_heads=4"):
        MultiHeadAttention(30, 4)


def test_padding_and_causal_mask_helpers():
    ids = np.array([[5, 6, 0, 0], [7, 0, 0, 0]], dtype="int32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(padding_mask(ids)),
        [[True, True, False, False], [True, False, False, False]],
    )
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(causal_mask(3, 3)), np.tril(np.ones((1, 3, 3), bool))
    )
    # One query at absolute position 2 of a 5-slot cache sees keys 0..2.
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(causal_mask(1, 5, 2)), [[[True, True, True, False, False]]]
    )


def test_padded_keys_get_exactly_zero_weight(attention):
    source_ids = np.array(
        [[4, 5, 6, 7, 8], [4, 5, 6, 0, 0], [9, 0, 0, 0, 0]], dtype="int32"
    )
    query, value = _vectors(BATCH, 4, seed=1), _vectors(BATCH, 5, seed=2)
    mask = padding_mask(source_ids)[:, None, :]
    output, scores = attention(query, value, attention_mask=mask, return_attention_scores=True)
    scores = keras.ops.convert_to_numpy(scores)
    assert scores.shape == (BATCH, HEADS, 4, 5)
    is_pad = (source_ids == 0)[:, None, None, :]
    assert np.all(scores[np.broadcast_to(is_pad, scores.shape)] == 0.0)
    assert np.all(scores[np.broadcast_to(~is_pad, scores.shape)] > 0.0)
    np.testing.assert_allclose(scores.sum(-1), 1.0, atol=1e-6)

    # What sits at padded positions cannot leak into the output.
    noisy_value = value + 100.0 * (source_ids == 0)[..., None] * _vectors(BATCH, 5, seed=3)
    noisy_output = attention(query, noisy_value, attention_mask=mask)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(noisy_output), keras.ops.convert_to_numpy(output), atol=ATOL
    )


def test_causal_mask_gives_future_exactly_zero_weight(attention):
    length = 6
    x = _vectors(BATCH, length, seed=4)
    _, scores = attention(
        x, x, attention_mask=causal_mask(length, length), return_attention_scores=True
    )
    scores = keras.ops.convert_to_numpy(scores)
    future = np.triu(np.ones((length, length), bool), k=1)
    assert np.all(scores[..., future] == 0.0)
    assert np.all(scores[..., ~future] > 0.0)
    np.testing.assert_allclose(scores.sum(-1), 1.0, atol=1e-6)


def test_unmasked_weights_are_a_softmax_of_scaled_dot_products(attention):
    query, value = _vectors(BATCH, 3, seed=5), _vectors(BATCH, 4, seed=6)
    _, scores = attention(query, value, return_attention_scores=True)
    q = np.einsum("btd,dhk->bthk", query, attention._query_dense.kernel.numpy())
    q += attention._query_dense.bias.numpy()
    k = np.einsum("bsd,dhk->bshk", value, attention._key_dense.kernel.numpy())
    k += attention._key_dense.bias.numpy()
    logits = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(D_MODEL // HEADS)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(scores), expected, atol=1e-5)


def test_self_attention_cache_matches_full_computation(attention):
    length = 5
    x = _vectors(BATCH, length, seed=7)
    full = keras.ops.convert_to_numpy(
        attention(x, x, attention_mask=causal_mask(length, length))
    )
    empty = np.zeros((BATCH, HEADS, length, D_MODEL // HEADS), "float32")
    cache = (empty, empty)
    # Prime the cache with a 2-token prefix in one call, then decode one token at a time.
    prefix, cache = attention(
        x[:, :2], x[:, :2], attention_mask=causal_mask(2, length, 0),
        cache=cache, cache_update_index=0,
    )
    steps = [keras.ops.convert_to_numpy(prefix)]
    for i in range(2, length):
        step, cache = attention(
            x[:, i:i + 1], x[:, i:i + 1], attention_mask=causal_mask(1, length, i),
            cache=cache, cache_update_index=i,
        )
        steps.append(keras.ops.convert_to_numpy(step))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=ATOL)
    # The filled cache holds exactly the projected keys and values of the whole sequence.
    for cached, projected in zip(cache, attention.project_key_value(x), strict=True):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(cached), keras.ops.convert_to_numpy(projected), atol=ATOL
        )


def test_precomputed_cross_attention_cache_matches_full_computation(attention):
    source_ids = np.array([[4, 5, 6, 7], [4, 5, 0, 0], [4, 0, 0, 0]], dtype="int32")
    query, memory = _vectors(BATCH, 3, seed=8), _vectors(BATCH, 4, seed=9)
    mask = padding_mask(source_ids)[:, None, :]
    full = attention(query, memory, attention_mask=mask)
    cache = attention.project_key_value(memory)
    assert [tuple(t.shape) for t in cache] == [(BATCH, HEADS, 4, D_MODEL // HEADS)] * 2
    # With a cache and no update index, `value` is ignored: pass something unrelated.
    cached, returned_cache = attention(
        query, np.zeros_like(memory), attention_mask=mask, cache=cache
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(cached), keras.ops.convert_to_numpy(full), atol=ATOL
    )
    for returned, given in zip(returned_cache, cache, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(returned), keras.ops.convert_to_numpy(given)
        )


def test_get_config_from_config_round_trip(attention):
    config = attention.get_config()
    assert config["d_model"] == D_MODEL and config["num_heads"] == HEADS
    assert "key_dim" not in config and "value_dim" not in config
    clone = MultiHeadAttention.from_config(config)
    clone.build((None, None, D_MODEL), (None, None, D_MODEL))
    assert clone.key_dim == D_MODEL // HEADS
    assert clone.get_config() == config
    clone.set_weights(attention.get_weights())
    x = _vectors(BATCH, 4, seed=10)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(clone(x, x)), keras.ops.convert_to_numpy(attention(x, x)),
        atol=1e-6,
    )
    # Through the registered name, as `.keras` saving does.
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(attention)
    )
    assert isinstance(restored, MultiHeadAttention)
    assert restored.get_config() == config


def test_self_attention_projection_paths_agree(attention):
    # `value is query` may take a fused Q/K/V projection; distinct tensors and an explicit key
    # must give the same result.
    x = keras.ops.convert_to_tensor(_vectors(BATCH, 5, seed=11))
    copy = keras.ops.convert_to_tensor(_vectors(BATCH, 5, seed=11))
    mask = causal_mask(5, 5)
    same = keras.ops.convert_to_numpy(attention(x, x, attention_mask=mask))
    for value, key in ((copy, None), (x, x), (copy, copy)):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(attention(x, value, key=key, attention_mask=mask)),
            same, atol=1e-6,
        )


def test_every_weight_gets_a_gradient(attention):
    import tensorflow as tf

    query, value = _vectors(BATCH, 3, seed=12), _vectors(BATCH, 4, seed=13)
    for inputs in ((query, query), (query, value)):
        with tf.GradientTape() as tape:
            loss = keras.ops.sum(attention(*inputs) ** 2)
        gradients = tape.gradient(loss, attention.trainable_variables)
        assert len(gradients) == 8  # kernel and bias of query, key, value and output
        for variable, gradient in zip(attention.trainable_variables, gradients, strict=True):
            assert gradient is not None, variable.path
            if variable.path.endswith("key/bias"):
                continue  # adds q.b_k to a whole row of scores: softmax-invariant, grad ~ 0
            assert np.abs(keras.ops.convert_to_numpy(gradient)).max() > 1e-4, variable.path


def test_use_causal_mask_is_the_explicit_causal_mask_and_combines_with_padding(attention):
    x = _vectors(BATCH, 5, seed=14)
    keys = padding_mask(np.array([[3, 4, 5, 6, 7], [3, 4, 0, 0, 0], [3, 0, 0, 0, 0]]))
    for given in (None, keys[:, None, :]):
        explicit = causal_mask(5, 5)
        if given is not None:
            explicit = keras.ops.logical_and(given, explicit)
        out, scores = attention(x, x, attention_mask=given, use_causal_mask=True,
                                return_attention_scores=True)
        want, want_scores = attention(x, x, attention_mask=explicit,
                                      return_attention_scores=True)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(out),
                                      keras.ops.convert_to_numpy(want))
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(scores),
                                      keras.ops.convert_to_numpy(want_scores))
    assert np.all(keras.ops.convert_to_numpy(scores)[1, :, :, 2:] == 0.0)
    cache = attention.project_key_value(x)
    with pytest.raises(ValueError, match="cache_update_index"):
        attention(x[:, :1], x[:, :1], use_causal_mask=True, cache=cache, cache_update_index=0)


def test_options_it_would_ignore_are_refused_and_flash_is_jax_only():
    for option in (dict(attention_axes=(1,)), dict(use_gate=True), dict(sliding_window=4)):
        with pytest.raises(ValueError, match="does not support"):
            MultiHeadAttention(D_MODEL, HEADS, **option)
    # The suite's backend is TensorFlow; the JAX path is checked in tests/test_jax_backend.py.
    with pytest.raises(ValueError, match="JAX backend's"):
        MultiHeadAttention(D_MODEL, HEADS, flash_attention=True)
    assert "flash_attention" not in MultiHeadAttention(D_MODEL, HEADS).get_config()
