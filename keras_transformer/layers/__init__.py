"""The Transformer's layers, one per file, each matching a section of the paper."""

from keras_transformer.layers.attention import MultiHeadAttention, causal_mask, padding_mask
from keras_transformer.layers.decoder import DecoderLayer
from keras_transformer.layers.embedding import PositionalEmbedding, sinusoidal_encoding
from keras_transformer.layers.encoder import EncoderLayer
from keras_transformer.layers.feed_forward import FeedForward
from keras_transformer.layers.normalization import LayerNormalization, layer_normalization
from keras_transformer.layers.residual import ResidualNorm

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LayerNormalization",
    "MultiHeadAttention",
    "PositionalEmbedding",
    "ResidualNorm",
    "causal_mask",
    "layer_normalization",
    "padding_mask",
    "sinusoidal_encoding",
]
