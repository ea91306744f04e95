"""The 16-bit-mask Dropout keeps keras Dropout's distribution and semantics."""

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.layers.dropout import Dropout


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_drop_rate_and_scale(rate):
    layer = Dropout(rate, seed=1)
    outputs = layer(tf.ones((500, 1000)), training=True).numpy()
    kept = outputs > 0
    # 500k Bernoulli draws: the standard error of the kept fraction is under 7e-4.
    assert abs(kept.mean() - (1 - rate)) < 4e-3
    np.testing.assert_allclose(outputs[kept], 1 / (1 - rate), rtol=1e-4)
    assert abs(outputs.mean() - 1.0) < 6e-3


def test_identity_when_not_training_or_rate_zero():
    inputs = tf.random.normal((4, 7, 6))
    np.testing.assert_array_equal(Dropout(0.5)(inputs, training=False), inputs)
    np.testing.assert_array_equal(Dropout(0.0)(inputs, training=True), inputs)


def test_masks_differ_between_calls_and_keep_odd_sizes_and_dtype():
    layer = Dropout(0.5, seed=3, dtype="mixed_bfloat16")
    inputs = tf.ones((3, 5, 7), dtype=tf.bfloat16)  # odd element count: 105
    first, second = layer(inputs, training=True), layer(inputs, training=True)
    assert first.shape == inputs.shape and first.dtype == tf.bfloat16
    assert not np.array_equal(first.numpy(), second.numpy())


def test_gradient_is_the_mask():
    layer = Dropout(0.2, seed=0)
    inputs = tf.random.normal((8, 16))
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        outputs = layer(inputs, training=True)
    gradient = tape.gradient(outputs, inputs).numpy()
    # The rate is rounded to 16 bits, so the scale differs from 1/0.8 by ~4e-6.
    np.testing.assert_allclose(gradient, (outputs.numpy() != 0) / 0.8, rtol=1e-5)


def test_config_round_trip_and_noise_shape_refused():
    layer = Dropout.from_config(Dropout(0.25, seed=4).get_config())
    assert layer.rate == 0.25 and layer.threshold == round(0.25 * 65536)
    with pytest.raises(ValueError, match="noise_shape"):
        Dropout(0.1, noise_shape=(1, 2))
