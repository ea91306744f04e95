"""6.1 decoding, one step at a time, in the layout a decoding step consumes.

A decoding step runs the decoder (3.1) on one new position per hypothesis. Through the Keras
layers a step on `small` was ~400 TensorFlow ops, most of them not arithmetic: the Q/K/V kernels
read, reshaped and concatenated on every call, 3-D reshapes around every projection, a
cross-attention mask and a position encoding rebuilt at every step. On a CPU at serving batch
sizes each op costs the executor's few microseconds whatever its size, so those ops, not the
matmuls, set the step's time.

`InferenceDecoder` computes exactly what `Transformer.decode` does, with the same weights read
once per search, outside the step loop: the self-attention's Q/K/V kernels fused into one
(d_model, 3 d_model) matrix, the encoder-side K/V kernels into one, every projection a 2-D
`MatMul` + `BiasAdd` (+ the residual add) that TensorFlow's oneDNN remapper fuses into one
`_FusedMatMul`, the step on (rows, d_model) throughout; the position encodings of every step,
the cross-attention mask and the forbidden-token biases computed once per batch. Training and
checkpoints are unchanged: this is another way to run the same weights, for float32 models
(what the SavedModel serves); an export adds only the fused and transposed copies
(`InferenceModel`). The attention and LayerNorm arithmetic is the layers' own
(`attend_one_query`, `standardize`).

Conventions as in `keras_transformer.decoding.stepper`: the self-attention cache of a layer is
(keys, values), each (rows, num_heads, length, d_k), grown by one position a step (or, under
XLA, of a fixed length written at `index`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import tensorflow as tf

from keras_transformer.layers.attention import attend_one_query
from keras_transformer.layers.embedding import sinusoidal_encoding
from keras_transformer.layers.normalization import standardize
from keras_transformer.model.transformer import Transformer


class _Norm(NamedTuple):
    gamma: tf.Tensor  # (d_model,)
    beta: tf.Tensor  # (d_model,)


class _LayerWeights(NamedTuple):
    """One decoder layer's weights as a step consumes them (all float32)."""

    self_qkv_kernel: tf.Tensor  # (d_model, 3 d_model): [query | key | value]
    self_qkv_bias: tf.Tensor  # (3 d_model,)
    self_output_kernel: tf.Tensor  # (d_model, d_model)
    self_output_bias: tf.Tensor
    self_norm: _Norm
    cross_query_kernel: tf.Tensor  # (d_model, d_model)
    cross_query_bias: tf.Tensor
    cross_kv_kernel: tf.Tensor  # (d_model, 2 d_model): [key | value], used once per batch
    cross_kv_bias: tf.Tensor
    cross_output_kernel: tf.Tensor
    cross_output_bias: tf.Tensor
    cross_norm: _Norm
    inner_kernel: tf.Tensor  # (d_model, d_ff)
    inner_bias: tf.Tensor
    outer_kernel: tf.Tensor  # (d_ff, d_model)
    outer_bias: tf.Tensor
    feed_forward_norm: _Norm


def _norm(layer) -> _Norm:
    return _Norm(tf.convert_to_tensor(layer.gamma), tf.convert_to_tensor(layer.beta))


def _attention_weights(attention, parts: tuple[str, ...]):
    """(kernel (d_model, len(parts) d_model), bias) of the named projections of a
    `MultiHeadAttention` ("query", "key", "value", "output") side by side."""
    return attention.projection_weights(
        *(getattr(attention, f"_{part}_dense") for part in parts))


class _Fused(NamedTuple):
    """The weights of a layer that the step layout builds from several variables."""

    self_qkv_kernel: tf.Tensor
    self_qkv_bias: tf.Tensor
    cross_kv_kernel: tf.Tensor
    cross_kv_bias: tf.Tensor


def _fused(layer) -> _Fused:
    return _Fused(*_attention_weights(layer.self_attention, ("query", "key", "value")),
                  *_attention_weights(layer.cross_attention, ("key", "value")))


def _layer_weights(layer, fused: _Fused) -> _LayerWeights:
    feed_forward = layer.feed_forward
    return _LayerWeights(
        fused.self_qkv_kernel, fused.self_qkv_bias,
        *_attention_weights(layer.self_attention, ("output",)),
        _norm(layer.self_attention_block.norm),
        *_attention_weights(layer.cross_attention, ("query",)),
        fused.cross_kv_kernel, fused.cross_kv_bias,
        *_attention_weights(layer.cross_attention, ("output",)),
        _norm(layer.cross_attention_block.norm),
        tf.convert_to_tensor(feed_forward.inner_dense.kernel),
        tf.convert_to_tensor(feed_forward.inner_dense.bias),
        tf.convert_to_tensor(feed_forward.output_dense.kernel),
        tf.convert_to_tensor(feed_forward.output_dense.bias),
        _norm(layer.feed_forward_block.norm),
    )


class DecoderWeights(NamedTuple):
    """Every weight a decoding step reads, in the step's layout (float32 tensors)."""

    layers: tuple[_LayerWeights, ...]
    final_norm: _Norm | None  # pre-norm stacks only
    embeddings: tf.Tensor  # (vocab_size, d_model), the target embedding
    output_kernel: tf.Tensor  # (d_model, vocab_size)


def _output_kernel(model) -> tf.Tensor:
    """The output projection as a (d_model, vocab) kernel. With tied embeddings (3.4) the
    embedding matrix transposed: a (d_model, vocab) kernel makes the step's largest MatMul
    ~20% faster than multiplying by the embedding matrix transposed at every step."""
    if model.output_projection is not None:
        return tf.convert_to_tensor(model.output_projection.kernel)
    return tf.transpose(tf.convert_to_tensor(model.target_embedding.embeddings))


def decoder_weights(model, stored: InferenceModel | None = None) -> DecoderWeights:
    """`model`'s decoder weights in the layout `InferenceDecoder` consumes.

    Read from the variables: in a `tf.function` the values at each call. The weights built
    from several variables (fused kernels, the transposed output projection) are computed
    here, unless `stored` holds them (an `InferenceModel` of `model`).
    """
    if stored is None:
        fused = [_fused(layer) for layer in model.decoder_layers]
        output_kernel = _output_kernel(model)
    else:
        fused = [_Fused(*map(tf.convert_to_tensor, layer)) for layer in stored.fused]
        output_kernel = tf.convert_to_tensor(stored.output_kernel)
    return DecoderWeights(
        layers=tuple(_layer_weights(layer, layer_fused)
                     for layer, layer_fused in zip(model.decoder_layers, fused, strict=True)),
        final_norm=None if model.decoder_norm is None else _norm(model.decoder_norm),
        embeddings=tf.convert_to_tensor(model.target_embedding.embeddings),
        output_kernel=output_kernel,
    )


def supports(model) -> bool:
    """Whether `InferenceDecoder` can run `model`: an `InferenceModel`, or a float32
    `Transformer` whose projections have biases (the layers' default)."""
    if isinstance(model, InferenceModel):
        return True
    if not isinstance(model, Transformer) or model.compute_dtype != "float32":
        return False
    return bool(model.decoder_layers[0].self_attention._use_bias)


class InferenceModel(tf.Module):
    """A float32 `Transformer` with the step layout's fused weights stored once.

    For exports: the fused Q/K/V and K/V kernels and the transposed output projection are
    computed here, once, and saved with the SavedModel (12 MB more at `small`), instead of
    being rebuilt at every request; the other weights are the model's own variables. Searches
    (`keras_transformer.decoding.search`) take it as they take the model. Build it from a
    model that no longer trains: the stored copies do not follow later changes.

    Args:
        model: a float32 `Transformer` (see `supports`).
    """

    def __init__(self, model):
        super().__init__(name="inference_model")
        if isinstance(model, InferenceModel) or not supports(model):
            raise ValueError("InferenceModel takes a float32 Transformer with biased projections.")
        self.model = model

        def stored(tensor):
            return tf.Variable(tensor, trainable=False)

        self.fused = [_Fused(*map(stored, _fused(layer)))
                      for layer in model.decoder_layers]
        self.output_kernel = stored(_output_kernel(model))

    def encode(self, source_ids):
        """`Transformer.encode`."""
        return self.model.encode(source_ids)

    def initial_cache(self, encoder_output, max_length):
        """`Transformer.initial_cache` (for searches without the step layout)."""
        return self.model.initial_cache(encoder_output, max_length)

    def decode(self, *args, **kwargs):
        """`Transformer.decode` (for searches without the step layout)."""
        return self.model.decode(*args, **kwargs)


class InferenceDecoder:
    """The decoder of a float32 `Transformer` as a decoding step runs it.

    Created inside the `tf.function` of a search, before its loop: the weights are read (and,
    unless stored by an `InferenceModel`, fused) there once per call, so the loop body holds
    no variable reads and no weight copies. Computes what `Transformer.decode` computes, op
    for op in the attention, LayerNorm and softmax arithmetic, so decoding gives the same
    tokens.

    Args:
        model: a float32 `Transformer` or an `InferenceModel` (see `supports`).
        max_steps: int32 scalar, the most steps any sentence of the batch takes: the position
            encodings of steps 0..max_steps are computed once, here.
    """

    def __init__(self, model, max_steps):
        if isinstance(model, InferenceModel):
            weights = decoder_weights(model.model, stored=model)
            model = model.model
        else:
            weights = decoder_weights(model)
        config = model.config
        self.d_model, self.num_heads = config.d_model, config.num_heads
        self.head_dim = self.d_model // self.num_heads
        self.pre_norm = config.pre_norm
        self.epsilon = config.layer_norm_epsilon
        self.activation = keras.activations.get(config.activation)
        self.layers, self.final_norm = weights.layers, weights.final_norm
        self.embeddings, self.output_kernel = weights.embeddings, weights.output_kernel
        # Every step's position encoding at once: (max_steps + 1, d_model), row = position.
        self.positions = sinusoidal_encoding(
            tf.range(max_steps + 1), self.d_model, config.max_wavelength)

    @property
    def vocab_size(self):
        """The size of the log-probs `step` returns."""
        return self.output_kernel.shape[1]

    # --- once per batch ---

    def start(self, encoder_output, source_mask, max_length):
        """The empty self-attention cache and the encoder side, one row per sentence.

        Args:
            encoder_output: (batch, source_length, d_model) from `Transformer.encode`.
            source_mask: bool (batch, source_length).
            max_length: positions of a fixed-length cache; 0 for a cache that grows.

        Returns:
            (cache: one (keys, values) pair of zeros (batch, num_heads, max_length, d_k) per
             layer; encoder side: ((keys, values) per layer, each (batch, num_heads,
             source_length, d_k), computed once here; the cross-attention mask (batch, 1,
             source_length) bool)).
        """
        shape = tf.shape(encoder_output)
        flat = tf.reshape(encoder_output, [-1, self.d_model])
        cross_caches = []
        for weights in self.layers:
            projected = tf.nn.bias_add(tf.matmul(flat, weights.cross_kv_kernel),
                                       weights.cross_kv_bias)
            projected = tf.reshape(
                projected, [shape[0], shape[1], 2, self.num_heads, self.head_dim])
            keys, values = tf.unstack(tf.transpose(projected, [2, 0, 3, 1, 4]), 2)
            cross_caches.append((keys, values))
        empty = [shape[0], self.num_heads, max_length, self.head_dim]
        cache = tuple((tf.zeros(empty), tf.zeros(empty)) for _ in self.layers)
        return cache, (tuple(cross_caches), source_mask[:, None, :])

    # --- every step ---

    def step(self, tokens, index, cache, encoder_side, grow_cache: bool = True):
        """Next-token log-probabilities of each row.

        Args:
            tokens: int32 (rows,), the tokens at position `index`.
            index: int32 scalar, their position.
            cache: from `start` or the previous step (rows as `tokens`).
            encoder_side: from `start`, one row per hypothesis row.
            grow_cache: append this position to the cache (else write it at `index` into a
                cache of fixed length, masking the positions after it).

        Returns:
            (log-probs float32 (rows, vocab_size), the updated cache).
        """
        cross_caches, cross_mask = encoder_side
        # 3.4: embeddings x sqrt(d_model), plus 3.5's encoding of this position.
        x = tf.gather(self.embeddings, tokens) * math.sqrt(self.d_model)
        x = x + self.positions[index]
        self_mask = None
        if not grow_cache:  # a fixed-length cache: only the positions up to `index` count
            length = tf.shape(cache[0][0])[2]
            self_mask = (tf.range(length) <= index)[None, None, :]
        updated = []
        for weights, layer_cache, cross_cache in zip(self.layers, cache, cross_caches,
                                                     strict=True):
            x, layer_cache = self._self_attention(x, weights, layer_cache, index, self_mask,
                                                  grow_cache)
            updated.append(layer_cache)
            x = self._cross_attention(x, weights, cross_cache, cross_mask)
            x = self._feed_forward(x, weights)
        if self.final_norm is not None:
            x = self._layer_norm(x, self.final_norm)
        return tf.nn.log_softmax(tf.matmul(x, self.output_kernel)), tuple(updated)

    def _self_attention(self, x, weights, cache, index, mask, grow_cache):
        inputs = self._layer_norm(x, weights.self_norm) if self.pre_norm else x
        qkv = tf.nn.bias_add(tf.matmul(inputs, weights.self_qkv_kernel), weights.self_qkv_bias)
        query, key, value = tf.unstack(
            tf.reshape(qkv, [-1, 3, self.num_heads, 1, self.head_dim]), 3, axis=1)
        if grow_cache:
            keys = tf.concat([cache[0], key], axis=2)
            values = tf.concat([cache[1], value], axis=2)
        else:
            start = [0, 0, index, 0]
            keys = keras.ops.slice_update(cache[0], start, key)
            values = keras.ops.slice_update(cache[1], start, value)
        attended = self._attend(query, keys, values, mask)
        return self._residual(x, attended, weights.self_output_kernel,
                              weights.self_output_bias, weights.self_norm), (keys, values)

    def _cross_attention(self, x, weights, cache, mask):
        inputs = self._layer_norm(x, weights.cross_norm) if self.pre_norm else x
        query = tf.nn.bias_add(tf.matmul(inputs, weights.cross_query_kernel),
                               weights.cross_query_bias)
        query = tf.reshape(query, [-1, self.num_heads, 1, self.head_dim])
        attended = self._attend(query, cache[0], cache[1], mask)
        return self._residual(x, attended, weights.cross_output_kernel,
                              weights.cross_output_bias, weights.cross_norm)

    def _feed_forward(self, x, weights):
        inputs = self._layer_norm(x, weights.feed_forward_norm) if self.pre_norm else x
        inner = self.activation(tf.nn.bias_add(tf.matmul(inputs, weights.inner_kernel),
                                               weights.inner_bias))
        outputs = tf.nn.bias_add(tf.matmul(inner, weights.outer_kernel), weights.outer_bias)
        return self._after(x, outputs, weights.feed_forward_norm)

    def _attend(self, query, keys, values, mask):
        """3.2.1 as the layers' one-query attention: query (rows, heads, 1, d_k), keys/values
        (rows, heads, length, d_k), mask bool broadcastable to (rows, heads, length) ->
        (rows, d_model)."""
        attended, _ = attend_one_query(query, keys, values, mask)
        return tf.reshape(attended, [-1, self.d_model])

    def _residual(self, x, attended, kernel, bias, norm):
        """The output projection, the residual add and (post-norm) LayerNorm."""
        return self._after(x, tf.nn.bias_add(tf.matmul(attended, kernel), bias), norm)

    def _after(self, x, outputs, norm):
        outputs = x + outputs
        return outputs if self.pre_norm else self._layer_norm(outputs, norm)

    def _layer_norm(self, x, norm: _Norm):
        """`keras_transformer.layers.normalization.layer_normalization`'s forward pass."""
        normalized, _ = standardize(x, self.epsilon)
        return normalized * norm.gamma + norm.beta
