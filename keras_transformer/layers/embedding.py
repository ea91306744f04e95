"""3.4 Embeddings and Softmax, 3.5 Positional Encoding.

One layer holds the token embedding matrix and uses it both ways: ids -> vectors (scaled by
sqrt(d_model), plus sinusoidal positions, then dropout as in 5.4) and, with `reverse=True`,
vectors -> logits through the transposed matrix. Calling the same layer for the source, the
target and the pre-softmax projection is the paper's three-way weight sharing (3.4).
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_transformer.layers.dropout import Dropout


def sinusoidal_encoding(positions, d_model: int, max_wavelength: float = 10000.0):
    """Sinusoidal position encoding of 3.5, for any positions (no fixed table, no max length).

    PE(pos, 2i) = sin(pos / max_wavelength^(2i/d_model)), PE(pos, 2i+1) = cos(same angle).

    Args:
        positions: float tensor (length,) of absolute positions.
        d_model: encoding width (even).
        max_wavelength: the paper's 10000.

    Returns:
        float32 tensor (length, d_model) with sines in even and cosines in odd channels.
    """
    positions = ops.cast(positions, "float32")
    inverse_frequencies = ops.power(
        max_wavelength, -ops.arange(0, d_model, 2, dtype="float32") / d_model
    )
    angles = positions[:, None] * inverse_frequencies[None, :]
    encoding = ops.stack((ops.sin(angles), ops.cos(angles)), axis=-1)
    return ops.reshape(encoding, (-1, d_model))


@keras.saving.register_keras_serializable(package="keras_transformer")
class PositionalEmbedding(keras.layers.Layer):
    """Token embedding x sqrt(d_model) + sinusoidal position encoding, with dropout.

    Args:
        vocab_size: number of token ids.
        d_model: embedding width (even).
        dropout: rate applied to the sum of embeddings and positions (paper 5.4: 0.1).
        max_wavelength: position-encoding base (paper: 10000).
        embeddings_initializer: defaults to normal(0, d_model^-0.5), so that the embeddings
            scaled by sqrt(d_model) have unit variance and tied logits start small.

    Call arguments:
        inputs: int token ids (batch, length); or, with `reverse=True`, float vectors
            (batch, length, d_model).
        start_index: absolute position of the first token (for incremental decoding).
        reverse: project vectors to logits with the transposed embedding matrix.
        training: Python bool; enables dropout.

    Returns:
        (batch, length, d_model) vectors, or (batch, length, vocab_size) logits if `reverse`.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        dropout: float = 0.0,
        max_wavelength: float = 10000.0,
        embeddings_initializer=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if d_model % 2:
            raise ValueError(f"d_model must be even for sinusoidal positions, got {d_model}.")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.dropout = dropout
        self.max_wavelength = max_wavelength
        self.embeddings_initializer = keras.initializers.get(
            embeddings_initializer or keras.initializers.RandomNormal(stddev=d_model**-0.5)
        )
        self.dropout_layer = Dropout(dropout, dtype=self.dtype_policy)

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocab_size, self.d_model),
            initializer=self.embeddings_initializer,
        )
        self.built = True

    def call(self, inputs, start_index=0, reverse: bool = False, training=None):
        if reverse:
            return self._logits(inputs)
        vectors = ops.take(self.embeddings, ops.cast(inputs, "int32"), axis=0)
        vectors = ops.cast(vectors, self.compute_dtype) * math.sqrt(self.d_model)
        length = ops.shape(inputs)[-1]
        positions = ops.arange(length, dtype="float32") + ops.cast(start_index, "float32")
        encoding = sinusoidal_encoding(positions, self.d_model, self.max_wavelength)
        vectors = vectors + ops.cast(encoding, self.compute_dtype)
        return self.dropout_layer(vectors, training=training)

    def _logits(self, vectors):
        """vectors (..., d_model) -> logits (..., vocab_size) through the embedding matrix.

        One 2-D MatMul with `transpose_b`: its kernel gradient, grad^T x, comes out in the
        embedding's own (vocab, d_model) layout, where the transposed-matrix formulation
        computed a (d_model, vocab) product and transposed it (on this CPU the former runs at
        372 GFLOP/s, the latter at 315 plus the transpose). That is TensorFlow's; under other
        backends the transpose is part of the XLA dot (no copy).
        """
        kernel = ops.cast(self.embeddings, self.compute_dtype)
        shape = ops.shape(vectors)
        rows = ops.reshape(vectors, (-1, self.d_model))
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf  # the TensorFlow fast path above

            logits = tf.linalg.matmul(rows, kernel, transpose_b=True)
        else:
            logits = ops.matmul(rows, ops.transpose(kernel))
        return ops.reshape(logits, tuple(shape[:-1]) + (self.vocab_size,))

    def compute_output_shape(self, input_shape, reverse: bool = False):
        if reverse:
            return tuple(input_shape[:-1]) + (self.vocab_size,)
        return tuple(input_shape) + (self.d_model,)

    def compute_output_spec(self, inputs, start_index=0, reverse: bool = False, training=None):
        shape = self.compute_output_shape(inputs.shape, reverse=reverse)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            dropout=self.dropout,
            max_wavelength=self.max_wavelength,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config
