"""3.1 Decoder: one of the N identical layers.

"In addition to the two sub-layers in each encoder layer, the decoder inserts a third
sub-layer, which performs multi-head attention over the output of the encoder stack", and masks
its self-attention so that position i depends only on positions before i.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.layers.attention import MultiHeadAttention, causal_mask
from keras_transformer.layers.encoder import EncoderLayer
from keras_transformer.layers.residual import ResidualNorm


@keras.saving.register_keras_serializable(package="keras_transformer")
class DecoderLayer(EncoderLayer):
    """Causal self-attention, encoder-decoder attention and feed-forward sub-layers.

    Takes the same arguments as `EncoderLayer`.

    Call arguments:
        inputs: (batch, target_length, d_model).
        encoder_output: (batch, source_length, d_model); may be None when
            `cross_attention_cache` is given.
        encoder_padding_mask: optional bool (batch, source_length), True on real source tokens.
        self_attention_cache: optional pair (keys, values), each (batch, num_heads,
            max_length, d_k), of earlier target positions; requires `cache_update_index`.
        cache_update_index: int scalar, absolute position of `inputs[:, 0]`.
        grow_cache: the self-attention cache holds exactly the positions before
            `cache_update_index` and grows by `target_length` (see `MultiHeadAttention`).
        cross_attention_cache: optional pair (keys, values), each (batch, num_heads,
            source_length, d_k): the projected encoder output (see
            `MultiHeadAttention.project_key_value`), computed once per sentence instead of
            once per step.
        return_attention_scores: also return the encoder-decoder attention weights
            (batch, num_heads, target_length, source_length).
        training: Python bool.

    Returns:
        outputs (batch, target_length, d_model), then the cross-attention scores if asked, then
        the updated self-attention cache if one was given.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cross_attention = MultiHeadAttention(
            self.d_model, self.num_heads, dropout=self.attention_dropout,
            flash_attention=self.flash_attention, dtype=self.dtype_policy,
            name="cross_attention",
        )
        self.cross_attention_block = ResidualNorm(
            dropout=self.dropout, pre_norm=self.pre_norm, epsilon=self.layer_norm_epsilon,
            dtype=self.dtype_policy, name="cross_attention_block",
        )

    def build(self, inputs_shape, encoder_output_shape=None):
        super().build(inputs_shape)
        encoder_output_shape = encoder_output_shape or inputs_shape
        self.cross_attention.build(inputs_shape, encoder_output_shape)
        self.cross_attention_block.build(inputs_shape)
        self.built = True

    def call(
        self,
        inputs,
        encoder_output=None,
        encoder_padding_mask=None,
        self_attention_cache=None,
        cache_update_index=None,
        cross_attention_cache=None,
        return_attention_scores: bool = False,
        training=None,
        grow_cache: bool = False,
    ):
        x = self.self_attention_block.before(inputs)
        if self_attention_cache is None:
            attended = self.self_attention(x, x, use_causal_mask=True, training=training)
        else:
            target_length = ops.shape(inputs)[1]
            key_length = ops.shape(self_attention_cache[0])[2]
            if grow_cache:
                key_length = key_length + target_length
            # One new position attends to every cached one: no mask needed.
            mask = (None if grow_cache and isinstance(target_length, int) and target_length == 1
                    else causal_mask(target_length, key_length, cache_update_index))
            attended, self_attention_cache = self.self_attention(
                x, x, attention_mask=mask, cache=self_attention_cache,
                cache_update_index=cache_update_index, training=training, grow_cache=grow_cache,
            )
        x = self.self_attention_block.after(inputs, attended, training=training)

        cross_mask = None if encoder_padding_mask is None else encoder_padding_mask[:, None, :]
        y = self.cross_attention_block.before(x)
        attended = self.cross_attention(
            y, y if encoder_output is None else encoder_output,
            attention_mask=cross_mask, cache=cross_attention_cache,
            return_attention_scores=return_attention_scores, training=training,
        )
        if cross_attention_cache is not None:
            attended = attended[:-1]  # the cross-attention cache comes back unchanged
            attended = attended[0] if len(attended) == 1 else attended
        if return_attention_scores:
            attended, scores = attended
        x = self.cross_attention_block.after(x, attended, training=training)

        y = self.feed_forward(self.feed_forward_block.before(x))
        outputs = (self.feed_forward_block.after(x, y, training=training),)
        if return_attention_scores:
            outputs += (scores,)
        if self_attention_cache is not None:
            outputs += (self_attention_cache,)
        return outputs[0] if len(outputs) == 1 else outputs
