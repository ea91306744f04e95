"""3.1 Encoder and Decoder Stacks, assembled as a functional Keras model.

`Transformer` is a functional `keras.Model` (as keras-hub's backbones are): calling it on
`{"source": ids, "target": shifted ids}` gives logits, so `fit`/`evaluate`/`predict` and
`.keras` saving work as for any Keras model. Its `encode`/`decode` methods call the same layers
step by step with an explicit key/value cache for incremental decoding.

It holds the architecture only. Training beyond plain Keras (gradient accumulation, the
step-counting loss scaling of mixed_float16) is `keras_transformer.training.trainer_model.
TransformerTrainer`'s, a subclass with the same weights. Its hyperparameters and presets are
in `keras_transformer.model.config` (re-exported here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
from keras import ops

from keras_transformer.layers import (
    DecoderLayer,
    EncoderLayer,
    LayerNormalization,
    PositionalEmbedding,
    padding_mask,
)
from keras_transformer.model.config import PRESETS, TransformerConfig, transformer_config
from pipelines.constants import PAD_ID

# Re-exported: `from keras_transformer.model.transformer import PRESETS, ...` keeps working.
__all__ = ["PRESETS", "Transformer", "TransformerConfig", "build_transformer",
           "transformer_config"]


@keras.saving.register_keras_serializable(package="keras_transformer")
class Transformer(keras.Model):
    """The encoder-decoder Transformer as a functional model.

    Args: the fields of `TransformerConfig` (see `transformer_config` for presets), plus
        `dtype` (a dtype policy such as "mixed_bfloat16"), `flash_attention` (under JAX:
        attention by lengths, cuDNN's fused kernel on an NVIDIA GPU; see `MultiHeadAttention`;
        sources must be right-padded, as the project's batches are; a computation choice, not
        saved in `get_config()`) and the usual `keras.Model` kwargs.

    Inputs:
        {"source": int32 (batch, source_length), "target": int32 (batch, target_length)}, the
        target being shifted right (BOS first). Id 0 is padding.

    Outputs:
        float32 logits (batch, target_length, vocab_size), whatever the compute dtype.

    `compile`, `fit` and the train step are Keras' own (under mixed_float16, Keras' loss
    scaling). `keras_transformer.training.trainer_model.TransformerTrainer` adds gradient
    accumulation and the step-counting loss scaling on the same layers and weights.
    """

    def __init__(
        self,
        vocab_size: int = 8000,
        num_layers: int = 6,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 2048,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        pre_norm: bool = False,
        tie_embeddings: bool = True,
        layer_norm_epsilon: float = 1e-6,
        max_wavelength: float = 10000.0,
        dtype=None,
        flash_attention: bool = False,
        **kwargs,
    ):
        config = TransformerConfig(
            vocab_size=vocab_size, num_layers=num_layers, d_model=d_model,
            num_heads=num_heads, d_ff=d_ff, dropout=dropout,
            attention_dropout=attention_dropout, activation=activation, pre_norm=pre_norm,
            tie_embeddings=tie_embeddings, layer_norm_epsilon=layer_norm_epsilon,
            max_wavelength=max_wavelength,
        )
        # === Layers ===
        embedding = dict(vocab_size=vocab_size, d_model=d_model, dropout=dropout,
                         max_wavelength=max_wavelength, dtype=dtype)
        self.source_embedding = PositionalEmbedding(**embedding, name="source_embedding")
        self.target_embedding = (
            self.source_embedding if tie_embeddings
            else PositionalEmbedding(**embedding, name="target_embedding")
        )
        stack = dict(d_model=d_model, num_heads=num_heads, d_ff=d_ff, dropout=dropout,
                     attention_dropout=attention_dropout, activation=activation,
                     pre_norm=pre_norm, layer_norm_epsilon=layer_norm_epsilon,
                     flash_attention=flash_attention, dtype=dtype)
        self.encoder_layers = [
            EncoderLayer(**stack, name=f"encoder_layer_{i}") for i in range(num_layers)
        ]
        self.decoder_layers = [
            DecoderLayer(**stack, name=f"decoder_layer_{i}") for i in range(num_layers)
        ]
        # Pre-norm stacks end with a LayerNorm; post-norm layers already end normalized.
        self.encoder_norm = self.decoder_norm = None
        if pre_norm:
            self.encoder_norm = LayerNormalization(
                epsilon=layer_norm_epsilon, dtype=dtype, name="encoder_norm")
            self.decoder_norm = LayerNormalization(
                epsilon=layer_norm_epsilon, dtype=dtype, name="decoder_norm")
        self.output_projection = None
        if not tie_embeddings:
            self.output_projection = keras.layers.Dense(
                vocab_size, use_bias=False, dtype=dtype, name="output_projection")

        # === Functional model ===
        source = keras.Input(shape=(None,), dtype="int32", name="source")
        target = keras.Input(shape=(None,), dtype="int32", name="target")
        encoder_output, source_mask = self._encode(source)
        logits = self._decode(target, encoder_output, source_mask)
        super().__init__(inputs={"source": source, "target": target}, outputs=logits, **kwargs)
        # Functional.__init__ silently drops `dtype`: set the model's own policy, so that
        # `compute_dtype` (used by `initial_cache`) and `get_config` (used by `.keras` saving)
        # follow it, as keras-hub's Backbone does.
        if dtype is not None:
            self.dtype_policy = keras.dtype_policies.get(dtype)
        self.config = config

    # --- the two halves, shared by the functional graph and incremental decoding ---

    def _encode(self, source_ids, training=None):
        source_mask = padding_mask(source_ids, PAD_ID)
        x = self.source_embedding(source_ids, training=training)
        for layer in self.encoder_layers:
            x = layer(x, padding_mask=source_mask, training=training)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, source_mask

    def _logits(self, x):
        x = self.decoder_norm(x) if self.decoder_norm is not None else x
        if self.output_projection is not None:
            logits = self.output_projection(x)
        else:
            logits = self.target_embedding(x, reverse=True)
        return ops.cast(logits, "float32")

    def _decode(self, target_ids, encoder_output, source_mask, training=None):
        x = self.target_embedding(target_ids, training=training)
        for layer in self.decoder_layers:
            x = layer(x, encoder_output, encoder_padding_mask=source_mask, training=training)
        return self._logits(x)

    # --- public API for decoding ---

    def encode(self, source_ids, training: bool = False):
        """Runs the encoder once.

        Args:
            source_ids: int32 (batch, source_length), 0-padded.

        Returns:
            (encoder_output (batch, source_length, d_model), source_mask bool (batch,
            source_length)).
        """
        return self._encode(source_ids, training=training)

    def initial_cache(self, encoder_output, max_length):
        """Empty self-attention caches and the (computed once) cross-attention caches.

        Each cache is a tuple with one (keys, values) pair per decoder layer: separate
        tensors, so a decoding step writes one position into each instead of slicing and
        re-stacking one tensor holding every layer.

        Args:
            encoder_output: (batch, source_length, d_model) from `encode`.
            max_length: number of target positions the cache can hold.

        Returns:
            (self_cache: num_layers pairs of zeros (batch, num_heads, max_length, d_k),
             cross_cache: num_layers pairs (batch, num_heads, source_length, d_k)).
        """
        batch = ops.shape(encoder_output)[0]
        head_dim = self.config.d_model // self.config.num_heads
        shape = (batch, self.config.num_heads, max_length, head_dim)
        self_cache = tuple(
            (ops.zeros(shape, dtype=self.compute_dtype), ops.zeros(shape, dtype=self.compute_dtype))
            for _ in self.decoder_layers
        )
        cross_cache = tuple(
            layer.cross_attention.project_key_value(encoder_output)
            for layer in self.decoder_layers
        )
        return self_cache, cross_cache

    def decode(
        self,
        target_ids,
        source_mask,
        self_cache,
        cross_cache,
        cache_update_index,
        return_attention_scores: bool = False,
        grow_cache: bool = False,
    ):
        """Decoder logits for `target_ids` at absolute positions from `cache_update_index`.

        Args:
            target_ids: int32 (batch, length), usually length 1 (one new token per step).
            source_mask: bool (batch, source_length) from `encode`.
            self_cache, cross_cache: from `initial_cache` or a previous `decode` call.
            cache_update_index: int scalar, position of `target_ids[:, 0]`.
            return_attention_scores: also return a list (one per layer) of encoder-decoder
                attention weights (batch, num_heads, length, source_length).
            grow_cache: the self-attention caches hold exactly the positions before
                `cache_update_index` (from `initial_cache(..., max_length=0)`) and grow by
                `length`, instead of being written into at a fixed length.

        Returns:
            (float32 logits (batch, length, vocab_size), updated self_cache
            [, attention scores]).
        """
        x = self.target_embedding(target_ids, start_index=cache_update_index)
        updated, scores = [], []
        for layer, layer_cache, layer_cross_cache in zip(
                self.decoder_layers, self_cache, cross_cache, strict=True):
            outputs = layer(
                x,
                encoder_padding_mask=source_mask,
                self_attention_cache=layer_cache,
                cache_update_index=cache_update_index,
                cross_attention_cache=layer_cross_cache,
                return_attention_scores=return_attention_scores,
                grow_cache=grow_cache,
            )
            x = outputs[0]
            if return_attention_scores:
                scores.append(outputs[1])
            updated.append(tuple(outputs[-1]))
        logits = self._logits(x)
        if return_attention_scores:
            return logits, tuple(updated), scores
        return logits, tuple(updated)

    def get_config(self) -> dict:
        config = {"name": self.name, "trainable": self.trainable}
        config.update(dataclasses.asdict(self.config))
        config["dtype"] = keras.dtype_policies.serialize(self.dtype_policy)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.dtype_policies.deserialize(config["dtype"])
        return cls(**config)


def build_transformer(preset: str = "base", dtype=None, flash_attention: bool = False,
                      **overrides: Any) -> Transformer:
    """Builds a `Transformer` from a preset ("base", "big", "small", "tiny") and overrides.

    Example:
        model = build_transformer("small", vocab_size=8000, dropout=0.2)

    Raises:
        ValueError: unknown preset or field, d_model not divisible by num_heads, vocab < 4, ...
    """
    config = transformer_config(preset, **overrides)
    return Transformer(**dataclasses.asdict(config), dtype=dtype,
                       flash_attention=flash_attention)
