"""3.1 Layer normalization (Ba et al. 2016), with a hand-written gradient.

LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + epsilon) * gamma + beta over the last axis,
computed in float32 whatever the input dtype, as keras' layer does. Autodiff of keras'
formulation builds ~25 small ops per LayerNorm (moments, rsqrt, broadcasts and their
gradients); the closed-form gradient below needs about half as many passes over the
activations: measured on this project's CPU, forward + backward of a (64, 32, 256) bfloat16
LayerNorm takes 0.84-1.07 ms instead of 1.24-1.45 ms (XLA-compiling it was slower, 1.85 ms).

That gradient is a TensorFlow fast path, chosen under the TensorFlow backend only (through
`kernels.custom_gradient`: `tf.custom_gradient`, letting the graphs that call it be freed),
and only where a gradient tape could record it (`kernels.custom_gradient.gradients_recorded`);
inference, decoding and exports compute the same forward operations without it, so a
SavedModel carries no gradient functions for its loaders to register. Under JAX the layer is
keras' own, whose autodiff XLA fuses into a few passes.
`standardize` and `layer_normalization` are TensorFlow functions (the decoding step's too).
"""

from __future__ import annotations

import keras

from keras_transformer.kernels.custom_gradient import custom_gradient, gradients_recorded


def standardize(x, epsilon: float):
    """(x - mean(x)) / sqrt(var(x) + epsilon) over the last axis, and 1 / sqrt(var + epsilon).

    The forward arithmetic of `layer_normalization` (before gamma and beta), shared with the
    inference decoding step so that both compute the same values.

    Args:
        x: float32 (..., features).
        epsilon: added to the variance.

    Returns:
        (normalized like `x`, inverse_std (..., 1)).
    """
    import tensorflow as tf  # a TensorFlow fast path (module docstring)

    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
    inverse_std = tf.math.rsqrt(variance + epsilon)
    return centered * inverse_std, inverse_std


def layer_normalization(inputs, gamma, beta, epsilon: float):
    """Normalizes `inputs` over the last axis, then scales by `gamma` and shifts by `beta`.

    Args:
        inputs: (..., features) of any float dtype.
        gamma, beta: float32 (features,).
        epsilon: added to the variance.

    Returns:
        a tensor like `inputs` (same shape and dtype).

    The gradient is the closed form: with x_hat the normalized input and g = dy * gamma,
    dx = (g - mean(g) - x_hat * mean(g * x_hat)) / std, dgamma = sum(dy * x_hat),
    dbeta = sum(dy), the means over the features and the sums over all other axes.
    """
    import tensorflow as tf  # a TensorFlow fast path (module docstring)

    def forward(x, gamma, beta):
        normalized, inverse_std = standardize(tf.cast(x, tf.float32), epsilon)
        return tf.cast(normalized * gamma + beta, x.dtype), normalized, inverse_std

    inputs = tf.convert_to_tensor(inputs)
    gamma, beta = tf.cast(gamma, tf.float32), tf.cast(beta, tf.float32)
    if not gradients_recorded():  # the same values; autodiff if a gradient is asked for
        return forward(inputs, gamma, beta)[0]

    @custom_gradient
    def normalize(x, gamma, beta):
        outputs, normalized, inverse_std = forward(x, gamma, beta)

        def grad(upstream):
            upstream = tf.cast(upstream, tf.float32)
            scaled = upstream * gamma
            dx = inverse_std * (
                scaled - tf.reduce_mean(scaled, axis=-1, keepdims=True)
                - normalized * tf.reduce_mean(scaled * normalized, axis=-1, keepdims=True)
            )
            batch_axes = list(range(len(x.shape) - 1))
            return (tf.cast(dx, x.dtype), tf.reduce_sum(upstream * normalized, batch_axes),
                    tf.reduce_sum(upstream, batch_axes))

        return outputs, grad

    return normalize(inputs, gamma, beta)


@keras.saving.register_keras_serializable(package="keras_transformer")
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` over the last axis, with `layer_normalization`'s
    closed-form gradient under TensorFlow. Same weights (gamma, beta) and arguments; other
    backends, other axes, `center=False`, `scale=False` or `rms_scaling` use keras'
    computation.

    Call arguments:
        inputs: (..., features).

    Returns:
        a tensor like `inputs`, in the layer's compute dtype.
    """

    def call(self, inputs):
        last_axis = self.axis in ([-1], [len(inputs.shape) - 1])
        if (not (self.center and self.scale) or self.rms_scaling or not last_axis
                or keras.backend.backend() != "tensorflow"):
            return super().call(inputs)
        outputs = layer_normalization(inputs, self.gamma, self.beta, self.epsilon)
        return keras.ops.cast(outputs, self.compute_dtype)
