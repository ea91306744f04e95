"""Label-smoothed cross-entropy (paper 5.4), masked accuracy and perplexity."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.training.losses import (
    LabelSmoothedCrossEntropy,
    MaskedAccuracy,
    Perplexity,
    token_cross_entropy,
)

EPS, VOCAB = 0.1, 11


def logsumexp(x):
    peak = x.max(-1, keepdims=True)
    return (peak + np.log(np.exp(x - peak).sum(-1, keepdims=True)))[..., 0]


def numpy_nll(labels, logits):
    logits = logits.astype(np.float64)
    return logsumexp(logits) - np.take_along_axis(logits, labels[..., None], -1)[..., 0]


def as_float(x):
    return float(keras.ops.convert_to_numpy(x))


@pytest.fixture(scope="module")
def batch():
    """Labels with right padding (0) in some rows, and random logits."""
    rng = np.random.default_rng(0)
    labels = rng.integers(1, VOCAB, size=(3, 6)).astype("int32")
    labels[1, 4:] = 0
    labels[2, 2:] = 0
    logits = (3.0 * rng.normal(size=(3, 6, VOCAB))).astype("float32")
    return labels, logits


@pytest.mark.parametrize("margin", [5.0, 20.0])
def test_smoothed_loss_on_one_hot_logits_matches_analytic_value(margin):
    labels = np.array([[4, 7, 1, 0, 0]], dtype="int32")
    logits = margin * np.eye(VOCAB, dtype="float32")[labels]  # M on the label, 0 elsewhere
    log_z = np.log(np.exp(margin) + VOCAB - 1)
    nll = log_z - margin
    uniform = log_z - margin / VOCAB  # -mean over classes of log p
    expected = (1 - EPS) * nll + EPS * uniform
    loss = LabelSmoothedCrossEntropy(EPS)(labels, logits)
    assert as_float(loss) == pytest.approx(expected, rel=1e-5)
    # Without smoothing the confident prediction costs only the nll.
    unsmoothed = as_float(LabelSmoothedCrossEntropy(0.0)(labels, logits))
    assert unsmoothed == pytest.approx(nll, rel=1e-4, abs=1e-6)


def test_equals_keras_categorical_crossentropy_with_label_smoothing(batch):
    labels, logits = batch
    reference = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=EPS, reduction=None
    )(np.eye(VOCAB, dtype="float32")[labels], logits)
    reference = keras.ops.convert_to_numpy(reference)
    real = labels != 0
    expected = reference[real].mean()
    assert as_float(LabelSmoothedCrossEntropy(EPS)(labels, logits)) == pytest.approx(
        expected, rel=1e-5
    )
    per_token = keras.ops.convert_to_numpy(token_cross_entropy(labels, logits, EPS))
    np.testing.assert_allclose(per_token, reference, rtol=1e-5)
    unsmoothed = keras.ops.convert_to_numpy(token_cross_entropy(labels, logits))
    np.testing.assert_allclose(unsmoothed, numpy_nll(labels, logits), rtol=1e-5)


def test_padding_contributes_nothing(batch):
    labels, logits = batch
    loss_fn = LabelSmoothedCrossEntropy(EPS)
    loss = as_float(loss_fn(labels, logits))
    # Different logits at padded positions.
    noisy = logits + 50.0 * (labels == 0)[..., None] * np.random.default_rng(1).normal(
        size=logits.shape
    ).astype("float32")
    assert as_float(loss_fn(labels, noisy)) == pytest.approx(loss, rel=1e-6)
    # Extra padded positions.
    extra_labels = np.concatenate([labels, np.zeros((3, 4), "int32")], axis=1)
    extra_logits = np.concatenate(
        [logits, np.random.default_rng(2).normal(size=(3, 4, VOCAB)).astype("float32")], axis=1
    )
    assert as_float(loss_fn(extra_labels, extra_logits)) == pytest.approx(loss, rel=1e-6)
    # A batch of only padding gives 0, not NaN.
    assert as_float(loss_fn(np.zeros_like(labels), logits)) == 0.0


def test_mean_is_over_tokens_not_sentences(batch):
    labels, logits = batch
    per_token = numpy_nll(labels, logits)
    real = labels != 0
    expected = per_token[real].mean()  # differs from the mean of per-sentence means
    assert as_float(LabelSmoothedCrossEntropy(0.0)(labels, logits)) == pytest.approx(
        expected, rel=1e-5
    )


def test_computes_in_float32_for_bfloat16_logits(batch):
    labels, logits = batch
    bf16_logits = keras.ops.cast(logits, "bfloat16")
    upcast = keras.ops.convert_to_numpy(keras.ops.cast(bf16_logits, "float32"))
    loss = LabelSmoothedCrossEntropy(EPS)(labels, bf16_logits)
    assert keras.backend.standardize_dtype(loss.dtype) == "float32"
    assert as_float(loss) == pytest.approx(
        as_float(LabelSmoothedCrossEntropy(EPS)(labels, upcast)), rel=1e-6
    )
    per_token = token_cross_entropy(labels, bf16_logits, EPS)
    assert keras.backend.standardize_dtype(per_token.dtype) == "float32"
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(per_token),
        keras.ops.convert_to_numpy(token_cross_entropy(labels, upcast, EPS)),
        rtol=1e-6,
    )
    perplexity = Perplexity()
    perplexity.update_state(labels, bf16_logits)
    real = labels != 0
    assert as_float(perplexity.result()) == pytest.approx(
        np.exp(numpy_nll(labels, upcast)[real].mean()), rel=1e-5
    )


def test_loss_config_and_validation():
    loss = LabelSmoothedCrossEntropy(0.2)
    clone = LabelSmoothedCrossEntropy.from_config(loss.get_config())
    assert clone.label_smoothing == 0.2 and clone.name == loss.name
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="label_smoothing"):
            LabelSmoothedCrossEntropy(bad)


def test_masked_accuracy_ignores_padding_and_matches_numpy(batch):
    labels, logits = batch
    real = labels != 0
    # Make some predictions right, including at a padded position (must not count).
    logits = logits.copy()
    logits[0, 0, labels[0, 0]] = 100.0
    logits[1, 1, labels[1, 1]] = 100.0
    logits[2, 5, 0] = 100.0  # "correct" prediction of the pad label
    correct = logits.argmax(-1) == labels
    metric = MaskedAccuracy()
    metric.update_state(labels, logits)
    assert as_float(metric.result()) == pytest.approx(correct[real].mean(), rel=1e-6)
    # Accumulates over batches token-weighted, like one big batch.
    metric.update_state(labels[:1], logits[:1])
    both = np.concatenate([correct[real], correct[:1][real[:1]]])
    assert as_float(metric.result()) == pytest.approx(both.mean(), rel=1e-6)
    metric.reset_state()
    assert as_float(metric.result()) == 0.0
    restored = MaskedAccuracy.from_config(metric.get_config())
    assert restored.name == "accuracy"


def test_perplexity_ignores_padding_and_matches_numpy(batch):
    labels, logits = batch
    real = labels != 0
    nll = numpy_nll(labels, logits)
    metric = Perplexity()
    metric.update_state(labels, logits)
    assert as_float(metric.result()) == pytest.approx(np.exp(nll[real].mean()), rel=1e-5)
    # Changing logits at padded positions changes nothing.
    metric.reset_state()
    metric.update_state(labels, logits + 30.0 * (labels == 0)[..., None])
    assert as_float(metric.result()) == pytest.approx(np.exp(nll[real].mean()), rel=1e-5)
    # Token-weighted over batches.
    metric.update_state(labels[2:], logits[2:])
    both = np.concatenate([nll[real], nll[2:][real[2:]]])
    assert as_float(metric.result()) == pytest.approx(np.exp(both.mean()), rel=1e-5)
    restored = Perplexity.from_config(metric.get_config())
    assert restored.name == "perplexity"
    assert as_float(restored.result()) == 1.0  # exp(0) before any update


def _loss_gradient(loss_fn, labels, logits):
    logits = tf.convert_to_tensor(logits)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = loss_fn(labels, logits)
    return keras.ops.convert_to_numpy(tf.cast(tape.gradient(loss, logits), "float32"))


def test_fused_gradient_equals_autodiff_of_keras_crossentropy(batch):
    labels, logits = batch
    real = (labels != 0).astype("float32")
    keras_ce = keras.losses.CategoricalCrossentropy(
        from_logits=True, label_smoothing=EPS, reduction=None)

    def reference(y_true, y_pred):
        per_token = keras_ce(keras.ops.one_hot(y_true, VOCAB), y_pred)
        return keras.ops.sum(per_token * real) / real.sum()

    expected = _loss_gradient(reference, labels, logits)
    ours = _loss_gradient(LabelSmoothedCrossEntropy(EPS), labels, logits)
    np.testing.assert_allclose(ours, expected, atol=1e-7, rtol=1e-5)
    assert np.abs(ours[labels == 0]).max() == 0.0  # padding gets no gradient


def test_fused_gradient_keeps_the_dtype_of_bfloat16_logits(batch):
    labels, logits = batch
    bf16_logits = keras.ops.cast(logits, "bfloat16")
    with tf.GradientTape() as tape:
        tape.watch(bf16_logits)
        loss = LabelSmoothedCrossEntropy(EPS)(labels, bf16_logits)
    gradient = tape.gradient(loss, bf16_logits)
    assert keras.backend.standardize_dtype(gradient.dtype) == "bfloat16"
    upcast = keras.ops.cast(bf16_logits, "float32")
    expected = _loss_gradient(LabelSmoothedCrossEntropy(EPS), labels, upcast)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(tf.cast(gradient, "float32")),
                               expected, atol=2e-4, rtol=1e-2)
