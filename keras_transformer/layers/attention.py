"""3.2 Attention: scaled dot-product attention (3.2.1) and multi-head attention (3.2.2).

The paper projects d_model into h heads of size d_k = d_v = d_model / h, so multi-head attention
costs about as much as single-head attention of full width. (The TensorFlow tutorial passes
key_dim=d_model, which makes every head full width: h times the paper's cost. We do not.)

Masks are explicit boolean tensors (True = may attend), never Keras masks: the Keras mask
machinery adds work to every layer and hides where a mask comes from.
"""

from __future__ import annotations

import keras
from keras import ops


def padding_mask(token_ids, pad_id: int = 0):
    """Boolean mask of real tokens.

    Args:
        token_ids: int tensor (batch, length).
        pad_id: id of the padding token.

    Returns:
        bool tensor (batch, length), True where the token is not padding.
    """
    return ops.not_equal(token_ids, pad_id)


def causal_mask(query_length, key_length, query_offset=0):
    """Mask that lets query position i attend to key positions <= i + query_offset.

    Args:
        query_length: number of query positions (int or scalar tensor).
        key_length: number of key positions (int or scalar tensor).
        query_offset: absolute position of the first query (non-zero when decoding with a
            cache, where one new query sits at `cache_update_index`).

    Returns:
        bool tensor (1, query_length, key_length).
    """
    query_positions = ops.arange(query_length)[:, None] + query_offset
    key_positions = ops.arange(key_length)[None, :]
    return ops.expand_dims(ops.greater_equal(query_positions, key_positions), 0)


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Multi-head attention with the paper's head size and an explicit key/value cache.

    A `keras.layers.MultiHeadAttention` built from `d_model` and `num_heads` with per-head size
    d_k = d_v = d_model / num_heads (paper 3.2.2). For incremental decoding it takes a cache in
    and returns the updated cache, as keras-hub's `CachedMultiHeadAttention` does, so each
    decoding step projects one new position instead of the whole prefix.

    Args:
        d_model: model width; the output has this size too.
        num_heads: number of heads h; must divide `d_model`.
        dropout: dropout rate on the attention weights (the paper uses none; 0.0).
        **kwargs: passed to `keras.layers.MultiHeadAttention` (e.g. `kernel_initializer`).

    Call arguments:
        query: (batch, target_length, d_model).
        value: (batch, source_length, d_model); also the key unless `key` is given.
        key: optional (batch, source_length, d_model).
        attention_mask: optional bool, broadcastable to (batch, target_length, source_length);
            True where attention is allowed.
        cache: optional (batch, 2, cache_length, num_heads, d_k): projected keys ([:, 0]) and
            values ([:, 1]). With `cache_update_index=None` the cache is used as is (e.g.
            precomputed encoder keys/values for cross-attention) and `key`/`value` are ignored.
        cache_update_index: int scalar; where to write the projections of `key`/`value` into
            the cache before attending over the whole cache.
        return_attention_scores: also return weights (batch, num_heads, target_length,
            source_length).
        training: Python bool; enables dropout.

    Returns:
        attention_output (batch, target_length, d_model), then the attention scores if asked,
        then the updated cache if a cache was given.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, **kwargs):
        if d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}: the paper splits "
                "d_model into equal heads (d_k = d_model / h). Choose num_heads dividing d_model."
            )
        for name in ("key_dim", "value_dim", "output_shape"):
            kwargs.pop(name, None)  # derived from d_model/num_heads; present in get_config()
        super().__init__(
            num_heads=num_heads, key_dim=d_model // num_heads, dropout=dropout, **kwargs
        )
        self.d_model = d_model

    def call(
        self,
        query,
        value,
        key=None,
        attention_mask=None,
        cache=None,
        cache_update_index=None,
        return_attention_scores: bool = False,
        training=None,
    ):
        use_cache_as_is = cache is not None and cache_update_index is None
        if use_cache_as_is:
            (query_heads,) = self._project(query, self._query_dense)
            key_heads, value_heads = cache[:, 0, ...], cache[:, 1, ...]
        elif key is None and value is query:
            query_heads, key_heads, value_heads = self._project(
                query, self._query_dense, self._key_dense, self._value_dense
            )
        else:
            (query_heads,) = self._project(query, self._query_dense)
            if key is None:
                key_heads, value_heads = self._project(value, self._key_dense, self._value_dense)
            else:
                (key_heads,) = self._project(key, self._key_dense)
                (value_heads,) = self._project(value, self._value_dense)
        if cache is not None and not use_cache_as_is:
            start = [0, cache_update_index, 0, 0]
            key_heads = ops.slice_update(cache[:, 0, ...], start, key_heads)
            value_heads = ops.slice_update(cache[:, 1, ...], start, value_heads)
            cache = ops.stack((key_heads, value_heads), axis=1)

        attention_output, attention_scores = self._compute_attention(
            query_heads,
            key_heads,
            value_heads,
            attention_mask=attention_mask,
            training=training,
            return_attention_scores=return_attention_scores,
        )
        attention_output = self._merge_heads(attention_output)

        outputs = (attention_output,)
        if return_attention_scores:
            outputs += (attention_scores,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _project(self, inputs, *dense_layers):
        """Applies the head projections `dense_layers` to `inputs` in one 2-D matmul.

        The weights stay those of keras' EinsumDense layers ((d_model, heads, d_k) kernels), but
        autodiff of their 3-D einsum computes the kernel gradient as a batched matmul followed by
        a sum over the batch, which dominated the CPU step time; a reshape to (tokens, d_model)
        and one MatMul for Q, K and V together avoids both.

        Returns:
            one (batch, length, num_heads, d_k) tensor per layer.
        """
        kernel = ops.concatenate(
            [ops.reshape(ops.cast(layer.kernel, self.compute_dtype), (self.d_model, -1))
             for layer in dense_layers], axis=-1,
        )
        shape = ops.shape(inputs)
        outputs = ops.matmul(ops.reshape(inputs, (-1, shape[-1])), kernel)
        if self._use_bias:
            outputs = outputs + ops.concatenate(
                [ops.reshape(ops.cast(layer.bias, self.compute_dtype), (-1,))
                 for layer in dense_layers], axis=-1,
            )
        head_dim = self.d_model // self.num_heads
        outputs = ops.reshape(outputs, (shape[0], shape[1], len(dense_layers) * self.num_heads,
                                        head_dim))
        return ops.split(outputs, len(dense_layers), axis=2)

    def _merge_heads(self, heads):
        """The output projection: (batch, length, heads, d_k) -> (batch, length, d_model)."""
        layer = self._output_dense
        shape = ops.shape(heads)
        kernel = ops.reshape(ops.cast(layer.kernel, self.compute_dtype), (self.d_model, -1))
        outputs = ops.matmul(ops.reshape(heads, (-1, self.d_model)), kernel)
        if self._use_bias:
            outputs = outputs + ops.cast(layer.bias, self.compute_dtype)
        return ops.reshape(outputs, (shape[0], shape[1], -1))

    def project_key_value(self, inputs):
        """Projects `inputs` (batch, length, d_model) into a cache (batch, 2, length, h, d_k)."""
        return ops.stack(self._project(inputs, self._key_dense, self._value_dense), axis=1)

    def get_config(self) -> dict:
        config = super().get_config()
        for name in ("key_dim", "value_dim", "output_shape"):
            config.pop(name, None)
        config["d_model"] = self.d_model
        return config
