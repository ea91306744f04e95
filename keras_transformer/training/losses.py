"""5.4 Regularization: label-smoothed cross-entropy; plus token accuracy and perplexity.

All three ignore padding (label id 0) and compute in float32 even when the model runs in
bfloat16/float16. None materializes one-hot labels: the smoothed cross-entropy is
(1 - eps) * NLL(label) + eps * (logsumexp(logits) - mean(logits)), since the smoothed target
puts eps / V on every class. TensorFlow-specific (tf.custom_gradient), like the project.

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
import tensorflow as tf
from keras import ops

from keras_transformer.kernels import (
    fused_kernels,
    smoothed_cross_entropy,
    smoothed_cross_entropy_value,
)
from pipelines.constants import PAD_ID


def token_cross_entropy(labels, logits, label_smoothing: float = 0.0):
    """Per-token (smoothed) cross-entropy, with a fused gradient.

    The gradient, softmax - (1 - eps) * one_hot - eps / V, is written by hand (autodiff of
    the label gather materializes and scatters a full (tokens, vocab) tensor, ~3x slower on
    CPU) and computed in the same pass as the loss: one XLA computation reads the logits
    once and returns both, so the backward pass only scales the stored gradient by the
    upstream per-token weights. On (tokens, vocab) logits every op is a memory-bound pass
    and XLA fuses them (forward + gradient on 64x32x8000 logits on this CPU: 40 ms as
    separate TensorFlow ops, 22 ms as two XLA computations, 20 ms as this one). Only this
    elementwise part is compiled; the matmuls stay with oneDNN.

    With the fused CPU kernels (`keras_transformer.kernels`) the forward pass is one C++ op
    that keeps only the log-normalizer, and the backward pass writes the gradient, already
    scaled, in one more: 64x32x8000 bfloat16 logits take 3.2 + 4.5 ms on this project's CPU
    instead of the XLA pass's ~20 ms plus the scaling and casts.

    Args:
        labels: int (batch, length).
        logits: (batch, length, vocab); computed in float32 whatever their dtype.
        label_smoothing: eps_ls; the target is (1 - eps) * one_hot + eps / vocab.

    Returns:
        float32 (batch, length); not yet masked.
    """
    labels = tf.cast(labels, tf.int32)
    eps = float(label_smoothing)
    library = fused_kernels()
    if library is not None:
        return smoothed_cross_entropy(library, labels, logits, eps)

    @tf.custom_gradient
    def cross_entropy(logits):
        loss, unscaled_gradient = _cross_entropy_and_gradient(logits, labels, eps)

        def grad(upstream):
            return unscaled_gradient * tf.cast(upstream, unscaled_gradient.dtype)[..., None]

        return loss, grad

    return cross_entropy(logits)


def _before_exact_upcast(logits):
    """The bfloat16 tensor that graph-mode `logits` were cast to float32 from, if any.

    A mixed-precision model returns float32 logits cast from its 16-bit matmul (keras'
    advice for outputs). The cast is exact, so reading the 16-bit tensor gives the same
    values at half the memory traffic, and the cast and its gradient drop out of the step
    (5.6 ms of 64x32x8000 logits on this project's CPU). The gradient then flows into the
    bfloat16 tensor, not the float32 one: use it only where nothing differentiates with
    respect to the float32 logits themselves. Eager tensors are returned as is.
    """
    op = getattr(logits, "op", None)
    if op is None or op.type != "Cast" or logits.dtype != tf.float32:
        return logits
    source = op.inputs[0]
    return source if source.dtype == tf.bfloat16 else logits  # the kernels take bfloat16


def _smoothed_loss(logits, labels, log_normalizer, eps: float):
    """Per-token loss from float32 logits and their logsumexp."""
    loss = log_normalizer - tf.gather(logits, labels, batch_dims=len(labels.shape))
    if eps:
        uniform = log_normalizer - tf.reduce_mean(logits, axis=-1)
        loss = (1.0 - eps) * loss + eps * uniform
    return loss


@tf.function(jit_compile=True, reduce_retracing=True, autograph=False)
def _cross_entropy_and_gradient(logits, labels, eps: float):
    """(per-token loss float32 (batch, length), d loss / d logits in the logits' dtype)."""
    logits32 = tf.cast(logits, tf.float32)
    maximum = tf.reduce_max(logits32, axis=-1, keepdims=True)
    exponentials = tf.exp(logits32 - maximum)
    total = tf.reduce_sum(exponentials, axis=-1, keepdims=True)
    log_normalizer = (tf.math.log(total) + maximum)[..., 0]
    loss = _smoothed_loss(logits32, labels, log_normalizer, eps)
    vocab = tf.shape(logits)[-1]
    target = tf.one_hot(labels, vocab, on_value=1.0 - eps, off_value=0.0)
    if eps:
        target += eps / tf.cast(vocab, tf.float32)
    return loss, tf.cast(exponentials / total - target, logits.dtype)


@tf.function(jit_compile=True, reduce_retracing=True, autograph=False)
def _cross_entropy_value(logits, labels, eps: float):
    """`token_cross_entropy` without a gradient (for metrics): per-token float32 loss."""
    logits32 = tf.cast(logits, tf.float32)
    return _smoothed_loss(logits32, labels, tf.reduce_logsumexp(logits32, axis=-1), eps)


def token_cross_entropy_value(labels, logits, label_smoothing: float = 0.0):
    """`token_cross_entropy` for metrics and validation: the loss only, nothing prepared for a
    gradient (the fallback's fused pass would also write a (tokens, vocab) gradient).

    Args and returns as `token_cross_entropy`.
    """
    labels = tf.cast(labels, tf.int32)
    eps = float(label_smoothing)
    library = fused_kernels()
    if library is not None:
        return smoothed_cross_entropy_value(library, labels, _before_exact_upcast(logits), eps)
    return _cross_entropy_value(logits, labels, eps)


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
    the cast (`_before_exact_upcast`): the loss and the weights' gradients are unchanged, but
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
        if fused_kernels() is not None:
            # Keras differentiates the loss with respect to the weights only, so reading the
            # model's bfloat16 logits before their exact float32 cast gives the same gradients.
            y_pred = _before_exact_upcast(y_pred)
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
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return local / ops.maximum(local_tokens, 1.0)
        replicas = context.num_replicas_in_sync
        local_and_tokens = ops.stack([ops.stop_gradient(local), local_tokens])
        total, tokens = ops.unstack(context.all_reduce(tf.distribute.ReduceOp.SUM,
                                                       local_and_tokens))
        tokens = ops.maximum(tokens, 1.0)
        gradient_part = local / tokens
        return gradient_part + ops.stop_gradient(total / (tokens * replicas) - gradient_part)
