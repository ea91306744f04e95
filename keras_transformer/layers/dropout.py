"""5.4 Residual Dropout, with a mask that is cheaper to draw.

Keras' dropout draws one float32 uniform (32 random bits) per element; on CPU the random-number
generation then costs more than the rest of the dropout, and on a GPU drawing the masks was
~9% of a `base` training step under JAX (issue 36). Comparing 16 random bits per element
against a threshold keeps the same distribution (rate rounded to a multiple of 1/65536) for
half the random bits. Each backend draws them its own way: TensorFlow with a stateless
uniform of 32-bit words bitcast to 16-bit halves (`tf.bitcast`); JAX with Threefry-2x32
blocks on a counter laid out like the input, each block's 64 bits bitcast to four 16-bit
draws along the last axis, where keras' mask (`jax.random.bernoulli`, under JAX's default
partitionable Threefry) spends a block on every element, and `jax.random.bits(key, shape,
uint16)` would too (masks 5x faster forward and backward on a CPU,
`benchmarks/dropout_masks.py`). Other backends draw keras' own mask.
"""

from __future__ import annotations

import keras

_LEVELS = 1 << 16


@keras.saving.register_keras_serializable(package="keras_transformer")
class Dropout(keras.layers.Dropout):
    """`keras.layers.Dropout` drawing 16 random bits per element under TensorFlow and JAX (no
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
        backend = keras.backend.backend()
        if backend == "tensorflow":
            return self._tensorflow_dropout(inputs)
        if backend == "jax":
            return self._jax_dropout(inputs)
        return super().call(inputs, training=training)

    @property
    def _scale(self) -> float:
        """1 / (1 - the rounded rate): the survivors' scale."""
        return _LEVELS / (_LEVELS - self.threshold)

    def _tensorflow_dropout(self, inputs):
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
        return inputs * tf.cast(keep, inputs.dtype) * tf.cast(self._scale, inputs.dtype)

    def _jax_dropout(self, inputs):
        import jax.numpy as jnp  # the JAX fast path (module docstring)
        from jax import lax
        from jax.extend.random import threefry2x32_p

        # One Threefry-2x32 block (64 bits: four 16-bit draws) for every 4 elements along the
        # last axis, on a counter laid out like `inputs` (leading axes kept): each device of
        # a data-parallel step draws its own rows' masks, with no collective (a flat counter
        # made XLA gather the masks across devices). keras' JAX seed generator yields a raw
        # uint32[2] Threefry key, as keras' own dropout uses it.
        *leading, last = inputs.shape or (1,)
        counter_shape = (*leading, -(-last // 4))
        counter, stride = jnp.zeros(counter_shape, jnp.uint32), 1
        for axis in reversed(range(len(counter_shape))):  # the row-major position
            counter = counter + lax.broadcasted_iota(jnp.uint32, counter_shape, axis) * stride
            stride *= counter_shape[axis]
        key = self.seed_generator.next()
        high, low = threefry2x32_p.bind(key[0], key[1], jnp.zeros_like(counter), counter)
        bits = lax.bitcast_convert_type(jnp.stack([high, low], axis=-1), jnp.uint16)
        bits = bits.reshape(*counter_shape[:-1], counter_shape[-1] * 4)[..., :last]
        keep = bits.reshape(inputs.shape) >= self.threshold
        scaled = inputs * jnp.asarray(self._scale, inputs.dtype)
        return jnp.where(keep, scaled, jnp.zeros_like(inputs))
