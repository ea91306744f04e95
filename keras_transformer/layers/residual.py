"""3.1 Residual connection and layer normalization around every sub-layer.

Post-norm (the paper): LayerNorm(x + Dropout(Sublayer(x))).
Pre-norm (the later variant that trains more stably without warmup tuning):
x + Dropout(Sublayer(LayerNorm(x))); the stack then needs one final LayerNorm.
"""

from __future__ import annotations

import keras

from keras_transformer.kernels import fused_kernels, residual_norm
from keras_transformer.layers.dropout import Dropout
from keras_transformer.layers.normalization import LayerNormalization


@keras.saving.register_keras_serializable(package="keras_transformer")
class ResidualNorm(keras.layers.Layer):
    """The normalization and residual dropout-add that wrap one sub-layer.

    Use as `y = sublayer(block.before(x)); x = block.after(x, y, training)`.

    Args:
        dropout: rate on the sub-layer output before the residual add (paper 5.4: 0.1).
        pre_norm: normalize the sub-layer input instead of the residual sum.
        epsilon: LayerNorm epsilon.
    """

    def __init__(self, dropout: float = 0.0, pre_norm: bool = False, epsilon: float = 1e-6,
                 **kwargs):
        super().__init__(**kwargs)
        self.dropout = dropout
        self.pre_norm = pre_norm
        self.epsilon = epsilon
        self.norm = LayerNormalization(
            epsilon=epsilon, dtype=self.dtype_policy, name="norm"
        )
        self.dropout_layer = Dropout(dropout, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.built = True

    def before(self, inputs):
        """The sub-layer input: normalized for pre-norm, unchanged for post-norm."""
        return self.norm(inputs) if self.pre_norm else inputs

    def after(self, inputs, sublayer_output, training=None):
        """The block output from the block input and the sub-layer output.

        Post-norm training steps use the fused kernel (`keras_transformer.kernels`): dropout,
        residual add and LayerNorm in one pass forward and one backward, instead of ~25 small
        ops. Inference, and so every export, uses the layers' standard ops, as does every
        backend but TensorFlow (`fused_kernels()` is None there).
        """
        fusable = (not self.pre_norm and training is True
                   and self.compute_dtype in ("float32", "bfloat16"))
        library = fused_kernels() if fusable else None
        if library is not None:
            seed = (self.dropout_layer.seed_generator.next() if self.dropout > 0
                    else keras.ops.zeros((2,), "int64"))
            outputs = residual_norm(
                library, sublayer_output, keras.ops.cast(inputs, sublayer_output.dtype),
                self.norm.gamma, self.norm.beta, seed, self.epsilon, self.dropout)
            return keras.ops.cast(outputs, self.norm.compute_dtype)
        outputs = inputs + self.dropout_layer(sublayer_output, training=training)
        return outputs if self.pre_norm else self.norm(outputs)

    def call(self, inputs):
        return self.before(inputs)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(dropout=self.dropout, pre_norm=self.pre_norm, epsilon=self.epsilon)
        return config
