"""5.4 Residual Dropout, with a mask that is cheaper to draw on CPU.

Keras' dropout draws one float32 uniform per element; on CPU the random-number generation then
costs more than the rest of the dropout. Comparing 16 random bits per element against a
threshold keeps the same distribution (rate rounded to a multiple of 1/65536) at about half
the cost of drawing the mask. That is a TensorFlow fast path (`tf.bitcast`), chosen under the
TensorFlow backend only; other backends draw keras' own mask.
"""

from __future__ import annotations

import keras

_LEVELS = 1 << 16


@keras.saving.register_keras_serializable(package="keras_transformer")
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` drawing 16 random bits per element under TensorFlow (no
    `noise_shape`); keras' own dropout on other backends.

    Args:
        rate: fraction of elements zeroed while training; survivors are scaled by
            1 / (1 - rate). Rounded to a multiple of 1/65536.
        seed: optional int seed.

    Call arguments:
        inputs: a tensor of any shape.
        training: Python bool or scalar; dropout only applies when true.

    Returns:
        a tensor like `inputs`.
    """

    def __init__(self, rate: float, seed: int | None = None, **kwargs):
        if kwargs.get("noise_shape") is not None:
            raise ValueError("keras_transformer Dropout does not support noise_shape.")
        kwargs.pop("noise_shape", None)
        super().__init__(rate, seed=seed, **kwargs)
        self.threshold = round(rate * _LEVELS)

    def call(self, inputs, training=False):
        if not training or self.threshold == 0:
            return inputs
        if keras.backend.backend() != "tensorflow":
            return super().call(inputs, training=training)
        import tensorflow as tf  # the TensorFlow fast path (module docstring)

        seed = tf.cast(
            tf.math.floormod(tf.cast(self.seed_generator.next(), tf.int64), tf.int32.max - 1),
            tf.int32,
        )
        size = tf.size(inputs)
        words = tf.random.stateless_uniform(
            [(size + 1) // 2], seed=seed, minval=None, maxval=None, dtype=tf.uint32
        )
        bits = tf.reshape(tf.bitcast(words, tf.uint16), [-1])[:size]
        keep = tf.reshape(bits, tf.shape(inputs)) >= self.threshold
        scale = _LEVELS / (_LEVELS - self.threshold)
        return inputs * tf.cast(keep, inputs.dtype) * tf.cast(scale, inputs.dtype)
