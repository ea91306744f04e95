"""3.3 Position-wise Feed-Forward Networks: FFN(x) = max(0, x W1 + b1) W2 + b2."""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_transformer")
class FeedForward(keras.layers.Layer):
    """Two dense layers with an activation between them, applied at every position.

    Args:
        d_model: input and output width.
        d_ff: inner width (paper: 2048 for base, 4096 for big).
        activation: inner activation (paper: "relu").
        kernel_initializer: initializer of both kernels.

    Call arguments:
        inputs: (batch, length, d_model).

    Returns:
        (batch, length, d_model).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        kernel_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.d_ff = d_ff
        self.activation = activation
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.inner_dense = keras.layers.Dense(
            d_ff,
            activation=activation,
            kernel_initializer=self.kernel_initializer,
            dtype=self.dtype_policy,
            name="inner",
        )
        self.output_dense = keras.layers.Dense(
            d_model, kernel_initializer=self.kernel_initializer, dtype=self.dtype_policy,
            name="output",
        )

    def build(self, input_shape):
        self.inner_dense.build(input_shape)
        self.output_dense.build(tuple(input_shape[:-1]) + (self.d_ff,))
        self.built = True

    def call(self, inputs):
        # On 2-D (tokens, d_model) inputs keras' Dense is MatMul, bias add and activation
        # with nothing between, which TensorFlow's oneDNN remapper fuses into one op; on 3-D
        # inputs a reshape sits between them and each runs as a separate pass.
        shape = ops.shape(inputs)
        tokens = ops.reshape(inputs, (-1, shape[-1]))
        outputs = self.output_dense(self.inner_dense(tokens))
        return ops.reshape(outputs, tuple(shape[:-1]) + (self.d_model,))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.d_model,)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            d_model=self.d_model,
            d_ff=self.d_ff,
            activation=self.activation,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
        )
        return config
