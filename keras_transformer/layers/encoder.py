"""3.1 Encoder: one of the N identical layers (self-attention, then feed-forward)."""

from __future__ import annotations

import keras

from keras_transformer.layers.attention import MultiHeadAttention
from keras_transformer.layers.feed_forward import FeedForward
from keras_transformer.layers.residual import ResidualNorm


@keras.saving.register_keras_serializable(package="keras_transformer")
class EncoderLayer(keras.layers.Layer):
    """Self-attention and feed-forward sub-layers, each in a residual block with LayerNorm.

    Args:
        d_model: model width.
        num_heads: attention heads (divides d_model).
        d_ff: feed-forward inner width.
        dropout: residual dropout rate (paper 5.4: 0.1).
        attention_dropout: dropout on attention weights (paper: 0.0).
        activation: feed-forward activation.
        pre_norm: pre-norm residual blocks instead of the paper's post-norm.
        layer_norm_epsilon: LayerNorm epsilon.
        flash_attention: attend by lengths under JAX (see `MultiHeadAttention`); how to
            compute, not what: not in `get_config()`.

    Call arguments:
        inputs: (batch, source_length, d_model).
        padding_mask: optional bool (batch, source_length), True on real tokens.
        return_attention_scores: also return self-attention weights
            (batch, num_heads, source_length, source_length).
        training: Python bool.

    Returns:
        (batch, source_length, d_model) [, attention scores].
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        activation: str = "relu",
        pre_norm: bool = False,
        layer_norm_epsilon: float = 1e-6,
        flash_attention: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.flash_attention = flash_attention
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.attention_dropout = attention_dropout
        self.activation = activation
        self.pre_norm = pre_norm
        self.layer_norm_epsilon = layer_norm_epsilon
        block = dict(dropout=dropout, pre_norm=pre_norm, epsilon=layer_norm_epsilon,
                     dtype=self.dtype_policy)
        self.self_attention = MultiHeadAttention(
            d_model, num_heads, dropout=attention_dropout, flash_attention=flash_attention,
            dtype=self.dtype_policy, name="self_attention",
        )
        self.self_attention_block = ResidualNorm(**block, name="self_attention_block")
        self.feed_forward = FeedForward(
            d_model, d_ff, activation=activation, dtype=self.dtype_policy, name="feed_forward"
        )
        self.feed_forward_block = ResidualNorm(**block, name="feed_forward_block")

    def build(self, input_shape):
        self.self_attention.build(input_shape, input_shape)
        self.self_attention_block.build(input_shape)
        self.feed_forward.build(input_shape)
        self.feed_forward_block.build(input_shape)
        self.built = True

    def call(self, inputs, padding_mask=None, return_attention_scores: bool = False,
             training=None):
        attention_mask = None if padding_mask is None else padding_mask[:, None, :]
        x = self.self_attention_block.before(inputs)
        attended = self.self_attention(
            x, x, attention_mask=attention_mask,
            return_attention_scores=return_attention_scores, training=training,
        )
        if return_attention_scores:
            attended, scores = attended
        x = self.self_attention_block.after(inputs, attended, training=training)
        y = self.feed_forward(self.feed_forward_block.before(x))
        outputs = self.feed_forward_block.after(x, y, training=training)
        return (outputs, scores) if return_attention_scores else outputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            d_model=self.d_model, num_heads=self.num_heads, d_ff=self.d_ff,
            dropout=self.dropout, attention_dropout=self.attention_dropout,
            activation=self.activation, pre_norm=self.pre_norm,
            layer_norm_epsilon=self.layer_norm_epsilon,
        )
        return config
