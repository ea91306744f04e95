"""3.2 Attention: scaled dot-product attention (3.2.1) and multi-head attention (3.2.2).

The paper projects d_model into h heads of size d_k = d_v = d_model / h, so multi-head attention
costs about as much as single-head attention of full width. (The TensorFlow tutorial passes
key_dim=d_model, which makes every head full width: h times the paper's cost. We do not.)

Masks are explicit boolean tensors (True = may attend), never Keras masks: the Keras mask
machinery adds work to every layer and hides where a mask comes from.

Written with `keras.ops`, so it runs on every Keras backend. Two pieces are one backend's:
`attend_one_query`, the decoding step's attention by products and sums (decoding and export
stay TensorFlow), chosen only under the TensorFlow backend; and under JAX, flash attention
(`flash_attention=True`): the padding mask passed as key lengths and the causal mask as a flag
to cuDNN's fused kernel (`attention_jax.py`).
"""

from __future__ import annotations

import math

import keras
import ml_dtypes
import numpy as np
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



def _one_position(tensor, axis: int) -> bool:
    """Whether `tensor` has, statically, length 1 on `axis` (one decoding step)."""
    return tensor.shape[axis] == 1


def _masked_score(dtype) -> float:
    """Score of a masked position: the most negative finite value of `dtype` (float16's is
    -65504; -1e9 would be -inf there), so a fully masked row gives uniform weights rather
    than NaN, as keras' masked softmax does."""
    name = keras.backend.standardize_dtype(dtype)
    return float(ml_dtypes.finfo(ml_dtypes.bfloat16).min if name == "bfloat16"
                 else np.finfo(name).min)


def attend_one_query(query_heads, key_heads, value_heads, attention_mask=None):
    """3.2.1 for one query position per row (a decoding step), by products and sums.

    With oneDNN each BatchMatMul, Softmax and Transpose op costs tens of microseconds whatever
    its size, which made them a third of a decoding step at serving batch sizes; elementwise
    ops and reductions cost a few (a step 1.4x faster at 4 rows, as fast at 128). float32
    only: the sums would accumulate in a 16-bit dtype.

    Args:
        query_heads: (rows, heads, 1, d_k).
        key_heads, value_heads: (rows, heads, length, d_k).
        attention_mask: optional bool, broadcastable to (rows, heads, length); True where
            attention is allowed.

    Returns:
        (attended (rows, heads, d_k), weights (rows, heads, length)).
    """
    import tensorflow as tf  # a TensorFlow fast path: decoding and export stay TensorFlow

    scale = 1.0 / math.sqrt(query_heads.shape[-1])
    scores = tf.reduce_sum((query_heads * scale) * key_heads, axis=-1)
    if attention_mask is not None:
        scores = tf.where(attention_mask, scores, _masked_score(scores.dtype))
    scores = tf.exp(scores - tf.reduce_max(scores, axis=-1, keepdims=True))
    weights = scores / tf.reduce_sum(scores, axis=-1, keepdims=True)
    attended = tf.reduce_sum(weights[:, :, :, None] * value_heads, axis=2)
    return attended, weights


# keras.layers.MultiHeadAttention options that this layer's own attention does not implement,
# with the values that mean "not used" (the first is keras' default).
_UNSUPPORTED_OPTIONS = {"attention_axes": (None,), "sliding_window": (None,),
                        "use_gate": (False,)}


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
        flash_attention: under the JAX backend, attend by cuDNN's fused kernel on an NVIDIA
            GPU (the XLA reference of the same function elsewhere) when the mask allows it:
            none, a key-padding mask (batch, 1, source_length) of right-padded keys, or
            `use_causal_mask`; other masks, attention weights asked for and a cache take the
            explicit path. Off by default (Keras' global `enable_flash_attention()` is on
            unless disabled, and this path is not yet measured faster on a GPU). A computation
            choice, not saved in `get_config()`; refused under another backend, and with
            attention dropout.
        **kwargs: passed to `keras.layers.MultiHeadAttention` (e.g. `kernel_initializer`);
            `attention_axes`, `sliding_window` and `use_gate` are refused (ValueError) rather
            than ignored.

    Call arguments:
        query: (batch, target_length, d_model).
        value: (batch, source_length, d_model); also the key unless `key` is given.
        key: optional (batch, source_length, d_model).
        attention_mask: optional bool, broadcastable to (batch, target_length, source_length);
            True where attention is allowed.
        use_causal_mask: also mask keys after each query's position (the decoder's
            self-attention in training; target_length == source_length).
        cache: optional pair (keys, values), each (batch, num_heads, cache_length, d_k):
            projected keys and values, head-major so that attending is a plain batched
            matmul. With `cache_update_index=None` the cache is used as is (e.g. precomputed
            encoder keys/values for cross-attention) and `key`/`value` are ignored. The cache
            is for inference: no attention dropout is applied with it.
        cache_update_index: int scalar; where to write the projections of `key`/`value` into
            the cache before attending over the whole cache.
        grow_cache: append the new projections to the cache (which then holds exactly the
            positions before `cache_update_index`) instead of writing them into a cache of
            fixed length: each step copies only the positions so far (without XLA, writing
            into a fixed-length cache copies all of it).
        return_attention_scores: also return weights (batch, num_heads, target_length,
            source_length).
        training: Python bool; enables dropout.

    Returns:
        attention_output (batch, target_length, d_model), then the attention scores if asked,
        then the updated cache if a cache was given.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0,
                 flash_attention: bool = False, **kwargs):
        if d_model % num_heads:
            raise ValueError(
                f"d_model={d_model} is not divisible by num_heads={num_heads}: the paper splits "
                "d_model into equal heads (d_k = d_model / h). Choose num_heads dividing d_model."
            )
        for name in ("key_dim", "value_dim", "output_shape"):
            kwargs.pop(name, None)  # derived from d_model/num_heads; present in get_config()
        unsupported = {name: kwargs.pop(name) for name, unused in _UNSUPPORTED_OPTIONS.items()
                       if kwargs.get(name, unused[0]) not in unused}
        for name in _UNSUPPORTED_OPTIONS:
            kwargs.pop(name, None)  # at their defaults (as get_config() writes them)
        if unsupported:
            raise ValueError(
                f"keras_transformer.MultiHeadAttention does not support "
                f"{', '.join(f'{k}={v!r}' for k, v in unsupported.items())}: it attends over "
                "the sequence axis with its own head-major matmuls (the paper's 3.2.1, which "
                "also give decoding's attention weights), and these keras.layers."
                "MultiHeadAttention options would be silently ignored. Use keras.layers."
                "MultiHeadAttention for them.")
        if flash_attention and keras.backend.backend() != "jax":
            raise ValueError(
                "flash_attention=True is the JAX backend's (cuDNN's fused attention on NVIDIA "
                f"GPUs); the Keras backend here is {keras.backend.backend()!r}. Set "
                "KERAS_BACKEND=jax, or leave flash_attention unset.")
        if flash_attention and dropout:
            raise ValueError(
                f"flash_attention=True with attention dropout {dropout}: the fused kernel "
                "never forms the attention weights that dropout would drop. Set dropout=0.0 "
                "(the paper's: it drops the sub-layers' outputs, not the weights).")
        super().__init__(
            num_heads=num_heads, key_dim=d_model // num_heads, dropout=dropout, **kwargs
        )
        self.d_model = d_model
        self._use_flash = bool(flash_attention)

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
        grow_cache: bool = False,
        use_causal_mask: bool = False,
    ):
        if (self._use_flash and cache is None and not return_attention_scores
                and (attention_mask is None or attention_mask.shape[1] == 1)):
            return self._flash_attend(query, value, key, attention_mask, use_causal_mask)
        if use_causal_mask:
            if cache is not None:
                raise ValueError(
                    "use_causal_mask with a cache: a cached step's causal mask starts at "
                    "cache_update_index; pass it as attention_mask (causal_mask(query_length, "
                    "key_length, cache_update_index)).")
            causal = causal_mask(ops.shape(query)[1], ops.shape(value)[1])
            attention_mask = (causal if attention_mask is None
                              else ops.logical_and(attention_mask, causal))
        if cache is not None and cache_update_index is None:
            (query_heads,) = self._project(query, self._query_dense)
            key_heads, value_heads = cache
        else:
            query_heads, key_heads, value_heads = self._project_attended(query, value, key)
            if cache is not None and grow_cache:
                key_heads = ops.concatenate([cache[0], key_heads], axis=2)
                value_heads = ops.concatenate([cache[1], value_heads], axis=2)
                cache = (key_heads, value_heads)
            elif cache is not None:
                start = [0, 0, cache_update_index, 0]
                key_heads = ops.slice_update(cache[0], start, key_heads)
                value_heads = ops.slice_update(cache[1], start, value_heads)
                cache = (key_heads, value_heads)
        attended, weights = self._attend(
            query_heads, key_heads, value_heads, attention_mask, training)
        outputs = (self._merge_heads(attended),)
        if return_attention_scores:
            outputs += (weights,)
        if cache is not None:
            outputs += (cache,)
        return outputs[0] if len(outputs) == 1 else outputs

    def _flash_attend(self, query, value, key, key_mask, causal: bool):
        """`call` by `attention_jax.attend_by_lengths`: projections in JAX's (batch, length,
        heads, d_k) layout, so neither they nor the result are transposed.

        Args:
            query: (batch, target_length, d_model).
            value, key: (batch, source_length, d_model); `key` None: `value`.
            key_mask: None, or bool (batch or 1, 1, source_length), True on real keys, which
                come first in each row (right padding, as the project's batches have it).
            causal: the decoder's self-attention mask.

        Returns:
            (batch, target_length, d_model).
        """
        from keras_transformer.layers import attention_jax

        query_heads, key_heads, value_heads = self._project_attended(
            query, value, key, head_major=False)
        attended = attention_jax.attend_by_lengths(
            query_heads, key_heads, value_heads, key_mask=key_mask, causal=causal)
        return self._merge_heads(attended, head_major=False)

    def _attend(self, query_heads, key_heads, value_heads, attention_mask, training):
        """3.2.1 Scaled dot-product attention, head-major: softmax(Q K^T / sqrt(d_k)) V.

        Args:
            query_heads: (batch, heads, target_length, d_k).
            key_heads, value_heads: (batch, heads, source_length, d_k).
            attention_mask: optional bool, broadcastable to (batch, target_length,
                source_length).
            training: enables dropout on the weights.

        Returns:
            (attended (batch, heads, target_length, d_k), weights (batch, heads,
            target_length, source_length)).

        Two batched matmuls on head-major tensors: keras' einsum path transposes every
        operand (and, when decoding, the whole cache) on each call; this is 3x faster for one
        query over a cache and ~25% faster for training shapes (forward + backward) here.
        """
        if (_one_position(query_heads, axis=2) and query_heads.dtype == "float32"
                and not training and keras.backend.backend() == "tensorflow"):
            return self._attend_one_query(query_heads, key_heads, value_heads, attention_mask)
        scale = ops.cast(1.0 / math.sqrt(self._key_dim), query_heads.dtype)
        scores = ops.matmul(query_heads * scale, ops.transpose(key_heads, (0, 1, 3, 2)))
        if attention_mask is not None:
            scores = ops.where(ops.expand_dims(attention_mask, 1), scores,
                               ops.cast(_masked_score(scores.dtype), scores.dtype))
        weights = ops.softmax(scores, axis=-1)
        attended = ops.matmul(self._dropout_layer(weights, training=training), value_heads)
        return attended, weights

    def _attend_one_query(self, query_heads, key_heads, value_heads, attention_mask):
        """`_attend` for one query position (a decoding step): `attend_one_query` with the
        target-length axis of 1 kept."""
        attended, weights = attend_one_query(query_heads, key_heads, value_heads,
                                             attention_mask)
        return attended[:, :, None, :], weights[:, :, None, :]

    def _project_attended(self, query, value, key=None, head_major: bool = True):
        """Query, key and value heads of `call`'s inputs, in as few matmuls as they allow:
        one for all three in self-attention (`value is query`, no `key`), else one for the
        query and one for key and value (one each with a separate `key`).

        Returns:
            (query_heads, key_heads, value_heads), as `_project` lays them out.
        """
        if key is None and value is query:
            return tuple(self._project(query, self._query_dense, self._key_dense,
                                       self._value_dense, head_major=head_major))
        (query_heads,) = self._project(query, self._query_dense, head_major=head_major)
        if key is None:
            key_heads, value_heads = self._project(
                value, self._key_dense, self._value_dense, head_major=head_major)
        else:
            (key_heads,) = self._project(key, self._key_dense, head_major=head_major)
            (value_heads,) = self._project(value, self._value_dense, head_major=head_major)
        return query_heads, key_heads, value_heads

    def _project(self, inputs, *dense_layers, head_major: bool = True):
        """Applies the head projections `dense_layers` to `inputs` in one 2-D matmul.

        The weights stay those of keras' EinsumDense layers ((d_model, heads, d_k) kernels), but
        autodiff of their 3-D einsum computes the kernel gradient as a batched matmul followed by
        a sum over the batch, which dominated the CPU step time; a reshape to (tokens, d_model)
        and one MatMul for Q, K and V together avoids both.

        Returns:
            one head-major (batch, num_heads, length, d_k) tensor per layer; with
            `head_major=False`, (batch, length, num_heads, d_k).
        """
        kernel, bias = self.projection_weights(*dense_layers)
        shape = ops.shape(inputs)
        outputs = ops.matmul(ops.reshape(inputs, (-1, shape[-1])), kernel)
        if bias is not None:
            outputs = outputs + bias
        head_dim = self.d_model // self.num_heads
        # One position, head-major: no transpose needed (see `_attend_one_query`).
        if head_major and _one_position(inputs, axis=1):
            outputs = ops.reshape(
                outputs, (shape[0], len(dense_layers), self.num_heads, 1, head_dim))
            return ops.unstack(outputs, len(dense_layers), axis=1)
        outputs = ops.reshape(
            outputs, (shape[0], shape[1], len(dense_layers), self.num_heads, head_dim))
        if not head_major:
            return ops.unstack(outputs, len(dense_layers), axis=2)
        # One transpose for Q, K and V together: (projection, batch, heads, length, d_k).
        outputs = ops.transpose(outputs, (2, 0, 3, 1, 4))
        return ops.unstack(outputs, len(dense_layers), axis=0)

    def projection_weights(self, *dense_layers):
        """The kernels of projections (`_query_dense`, ...) side by side as one 2-D matrix.

        Args:
            *dense_layers: EinsumDense layers of this attention, kernels (d_model, heads, d_k)
                (or (heads, d_k, d_model) for the output projection).

        Returns:
            (kernel (d_model, n * d_model), bias (n * d_model,) or None without biases), in
            the compute dtype; one layer's are views of its variables, not copies.
        """
        kernels = [ops.reshape(ops.cast(layer.kernel, self.compute_dtype), (self.d_model, -1))
                   for layer in dense_layers]
        biases = ([ops.reshape(ops.cast(layer.bias, self.compute_dtype), (-1,))
                   for layer in dense_layers] if self._use_bias else None)
        if len(dense_layers) == 1:
            return kernels[0], None if biases is None else biases[0]
        return (ops.concatenate(kernels, axis=-1),
                None if biases is None else ops.concatenate(biases, axis=-1))

    def _merge_heads(self, heads, head_major: bool = True):
        """The output projection: (batch, heads, length, d_k) -> (batch, length, d_model)
        (with `head_major=False`, from (batch, length, heads, d_k))."""
        layer = self._output_dense
        shape = ops.shape(heads)
        length = shape[2] if head_major else shape[1]
        if head_major and not _one_position(heads, axis=2):
            heads = ops.transpose(heads, (0, 2, 1, 3))
        heads = ops.reshape(heads, (-1, self.d_model))
        kernel = ops.reshape(ops.cast(layer.kernel, self.compute_dtype), (self.d_model, -1))
        outputs = ops.matmul(heads, kernel)
        if self._use_bias:
            outputs = outputs + ops.cast(layer.bias, self.compute_dtype)
        return ops.reshape(outputs, (shape[0], length, -1))

    def project_key_value(self, inputs):
        """Projects `inputs` (batch, length, d_model) into a cache: (keys, values), each
        (batch, num_heads, length, d_k)."""
        return tuple(self._project(inputs, self._key_dense, self._value_dense))

    def get_config(self) -> dict:
        config = super().get_config()
        # flash_attention: how to compute, not what (a model saved with it loads anywhere).
        for name in ("key_dim", "value_dim", "output_shape", "flash_attention",
                     *_UNSUPPORTED_OPTIONS):
            config.pop(name, None)
        config["d_model"] = self.d_model
        return config
