"""5.4 Regularization: label-smoothed cross-entropy; plus token accuracy and perplexity.

All three ignore padding (label id 0) and compute in float32 even when the model runs in
bfloat16/float16. None materializes one-hot labels: the smoothed cross-entropy is
(1 - eps) * NLL(label) + eps * (logsumexp(logits) - mean(logits)), since the smoothed target
puts eps / V on every class. Written with `keras.ops` for every backend; under TensorFlow the
per-token loss and its gradient are the fast paths of `losses_tensorflow` (a hand-written
gradient, the fused CPU kernels), chosen there only; under JAX the gradient is written by
hand too, and the loss and the metrics read the logits' per-token statistics in one shared
pass on accelerators (`losses_jax`).

Under `tf.distribute`, `GlobalTokenCrossEntropy` normalizes by the global batch's tokens.
How Keras 3's TF trainer combines replicas (keras/src/backend/tensorflow/trainer.py,
losses/loss.py, optimizer.py): each replica computes its loss, `Loss.__call__` divides it by
the number of replicas only when the loss is not already a scalar (ours is: a masked mean),
the gradients are *summed* over replicas, and the logged loss is the replica value times the
replica count, averaged with batch-size weights. With token-budget batches the replicas hold
different numbers of tokens, so no per-replica mean reproduces the single-device update.
`GlobalTokenCrossEntropy` divides each replica's token-loss sum by the *global* token count
(one all-reduce): the summed gradients are then exactly those of the global-batch mean.
"""

from __future__ import annotations

import keras
from keras import ops

from pipelines.constants import PAD_ID


def _backend_is_tensorflow() -> bool:
    return keras.backend.backend() == "tensorflow"


def token_cross_entropy(labels, logits, label_smoothing: float = 0.0):
    """Per-token (smoothed) cross-entropy.

    Under TensorFlow with a hand-written gradient fused with the loss (or the fused CPU
    kernels): `keras_transformer.training.losses_tensorflow.token_cross_entropy`. Under JAX
    the same loss with a hand-written gradient (`losses_jax`). Under other backends
    `keras.ops` and autodiff.

    Args:
        labels: int (batch, length).
        logits: (batch, length, vocab); computed in float32 whatever their dtype.
        label_smoothing: eps_ls; the target is (1 - eps) * one_hot + eps / vocab.

    Returns:
        float32 (batch, length); not yet masked.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_transformer.training import losses_tensorflow

        return losses_tensorflow.token_cross_entropy(labels, logits, label_smoothing)
    if backend == "jax":
        from keras_transformer.training import losses_jax

        return losses_jax.token_cross_entropy(labels, logits, label_smoothing)
    return _portable_cross_entropy(labels, logits, label_smoothing)


def token_cross_entropy_value(labels, logits, label_smoothing: float = 0.0):
    """`token_cross_entropy` for metrics and validation: the loss only (under TensorFlow
    nothing is prepared for a gradient; under JAX the same function, whose statistics the
    loss and the metrics of a step share). Args and returns as `token_cross_entropy`."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_transformer.training import losses_tensorflow

        return losses_tensorflow.token_cross_entropy_value(labels, logits, label_smoothing)
    if backend == "jax":
        from keras_transformer.training import losses_jax

        return losses_jax.token_cross_entropy(labels, logits, label_smoothing)
    return _portable_cross_entropy(labels, logits, label_smoothing)


def _portable_cross_entropy(labels, logits, label_smoothing: float):
    """The smoothed cross-entropy in `keras.ops`: (1 - eps) * (logsumexp - logit[label])
    + eps * (logsumexp - mean(logits)), in float32. float32 (batch, length). Under JAX
    `losses_jax` computes the same formula, with a hand-written gradient."""
    logits = ops.cast(logits, "float32")
    log_normalizer = ops.logsumexp(logits, axis=-1)
    labels = ops.expand_dims(ops.cast(labels, "int32"), -1)
    loss = log_normalizer - ops.squeeze(ops.take_along_axis(logits, labels, axis=-1), -1)
    eps = float(label_smoothing)
    if eps:
        loss = (1.0 - eps) * loss + eps * (log_normalizer - ops.mean(logits, axis=-1))
    return loss


def _real_tokens(labels):
    return ops.cast(ops.not_equal(labels, PAD_ID), "float32")


def masked_token_loss_sum(labels, logits, label_smoothing: float = 0.0,
                          differentiable: bool = True):
    """(sum of the smoothed cross-entropy over non-padding tokens, their count), float32.

    The pieces of a token mean, kept apart so that means over several batches or replicas can
    be exact (sum the sums, sum the counts, divide once). `differentiable=False` (validation)
    computes the loss only.
    """
    weights = _real_tokens(labels)
    per_token = token_cross_entropy if differentiable else token_cross_entropy_value
    losses = per_token(labels, logits, label_smoothing)
    return ops.sum(losses * weights), ops.sum(weights)


@keras.saving.register_keras_serializable(package="keras_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Mean label-smoothed cross-entropy over the non-padding tokens of a batch.

    With the fused kernels, float32 logits that a graph cast from bfloat16 are read before
    the cast (`losses_tensorflow.before_exact_upcast`): the loss and the weights' gradients are unchanged, but
    a gradient with respect to those float32 logits themselves is None; use
    `masked_token_loss_sum` for that.

    Args:
        label_smoothing: paper: 0.1.

    Call arguments:
        y_true: int labels (batch, length), 0 = padding.
        y_pred: logits (batch, length, vocab).

    Returns:
        float32 scalar.
    """

    def __init__(self, label_smoothing: float = 0.1, name: str = "label_smoothed_ce", **kwargs):
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
        super().__init__(name=name, dtype="float32", **kwargs)
        self.label_smoothing = label_smoothing

    def call(self, y_true, y_pred):
        loss_sum, tokens = self.sum_and_count(y_true, y_pred)
        return loss_sum / ops.maximum(tokens, 1.0)

    def sum_and_count(self, y_true, y_pred):
        """(float32 sum of the token losses, float32 number of non-padding tokens): the
        parts of the mean, for means over several micro-batches or replicas."""
        if _backend_is_tensorflow():
            from keras_transformer.training import losses_tensorflow

            # Keras differentiates the loss with respect to the weights only, so reading the
            # model's bfloat16 logits before their exact float32 cast gives the same gradients
            # (with the fused kernels; otherwise the logits are returned as they are).
            y_pred = losses_tensorflow.before_exact_upcast_for_kernels(y_pred)
        return masked_token_loss_sum(y_true, y_pred, self.label_smoothing)

    def get_config(self) -> dict:
        return {"label_smoothing": self.label_smoothing, "name": self.name}


class _MaskedMean(keras.metrics.Metric):
    """Running mean of a per-token value over non-padding tokens."""

    def __init__(self, name: str, **kwargs):
        kwargs.pop("dtype", None)  # always float32, also when restored from a config
        super().__init__(name=name, dtype="float32", **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def per_token(self, y_true, y_pred):
        raise NotImplementedError

    def update_state(self, y_true, y_pred, sample_weight=None):
        weights = _real_tokens(y_true)
        if sample_weight is not None:
            weights = weights * ops.cast(sample_weight, "float32")
        self.total.assign_add(ops.sum(self.per_token(y_true, y_pred) * weights))
        self.count.assign_add(ops.sum(weights))

    def result(self):
        return self.total / ops.maximum(self.count, 1.0)

    def reset_state(self):
        self.total.assign(0.0)
        self.count.assign(0.0)


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedAccuracy(_MaskedMean):
    """Fraction of non-padding tokens whose argmax prediction is the label."""

    def __init__(self, name: str = "accuracy", **kwargs):
        super().__init__(name=name, **kwargs)

    def per_token(self, y_true, y_pred):
        if keras.backend.backend() == "jax":
            from keras_transformer.training import losses_jax

            # The argmax of the pass over the logits that the loss reads too.
            predictions = losses_jax.token_statistics(y_true, y_pred).best
        else:
            predictions = ops.argmax(y_pred, axis=-1)
        return ops.cast(ops.equal(ops.cast(y_true, "int32"), ops.cast(predictions, "int32")),
                        "float32")


@keras.saving.register_keras_serializable(package="keras_transformer")
class Perplexity(_MaskedMean):
    """exp of the mean (unsmoothed) cross-entropy over non-padding tokens."""

    def __init__(self, name: str = "perplexity", **kwargs):
        super().__init__(name=name, **kwargs)

    def per_token(self, y_true, y_pred):
        return token_cross_entropy_value(y_true, y_pred, 0.0)

    def result(self):
        return ops.exp(super().result())


@keras.saving.register_keras_serializable(package="keras_transformer")
class GlobalTokenCrossEntropy(LabelSmoothedCrossEntropy):
    """`LabelSmoothedCrossEntropy` normalized by the token count of the *global* batch.

    With S_r the summed token losses of replica r, S their sum over replicas, N the global
    token count and R the replica count, each replica's gradient is that of S_r / N; Keras
    sums them over replicas: the gradient of S / N, the single-device loss of the global
    batch. The *value* returned is S / (N R) (a stop-gradient term), because Keras logs the
    value times R: the logged loss is then S / N too.

    Call arguments:
        y_true: int labels (batch, length), 0 = padding.
        y_pred: logits (batch, length, vocab).

    Returns:
        float32 scalar.
    """

    def call(self, y_true, y_pred):
        local, local_tokens = self.sum_and_count(y_true, y_pred)
        if not _backend_is_tensorflow():
            # JAX: one program over the global batch (keras.distribution shards it), so the
            # batch's own token mean is already the global one.
            return local / ops.maximum(local_tokens, 1.0)
        from keras_transformer.training import losses_tensorflow

        replicas = losses_tensorflow.replicas_in_sync()
        if replicas == 1:
            return local / ops.maximum(local_tokens, 1.0)
        local_and_tokens = ops.stack([ops.stop_gradient(local), local_tokens])
        total, tokens = ops.unstack(losses_tensorflow.sum_over_replicas(local_and_tokens))
        tokens = ops.maximum(tokens, 1.0)
        gradient_part = local / tokens
        return gradient_part + ops.stop_gradient(total / (tokens * replicas) - gradient_part)


def validation_loss(model, batches, label_smoothing: float = 0.1) -> float:
    """Label-smoothed cross-entropy per target token of `model` over `batches`: the exact
    token mean over the whole split, not a mean of batch means.

    Args:
        model: a `Transformer`.
        batches: `(features, labels)` pairs, e.g. `make_batches(corpus, tokenizer,
            shuffle=False)`.
        label_smoothing: epsilon_ls (0 gives the plain cross-entropy).
    """
    total = tokens = 0.0
    for features, labels in batches:
        loss_sum, count = masked_token_loss_sum(labels, model(features, training=False),
                                                label_smoothing, differentiable=False)
        total += float(loss_sum)
        tokens += float(count)
    return total / max(tokens, 1.0)
