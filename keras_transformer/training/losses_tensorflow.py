"""5.4's label-smoothed cross-entropy as TensorFlow fast paths, chosen under the TensorFlow
backend by `keras_transformer.training.losses` (which holds the backend-independent losses).

- `token_cross_entropy`: the gradient written by hand (`kernels.custom_gradient`), computed in
  the same XLA pass as the loss, or the fused C++ kernels of `keras_transformer.kernels`.
- `before_exact_upcast`: reads a graph's bfloat16 logits before their exact float32 cast.
- `replicas_in_sync`, `sum_over_replicas`: the all-reduce over `tf.distribute` replicas of
  `GlobalTokenCrossEntropy`, gradient accumulation and the loss scaling.
"""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.kernels import (
    fused_kernels,
    smoothed_cross_entropy,
    smoothed_cross_entropy_value,
)
from keras_transformer.kernels.custom_gradient import custom_gradient, release_custom_gradients


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

    @custom_gradient
    def cross_entropy(logits):
        loss, unscaled_gradient = _cross_entropy_and_gradient(logits, labels, eps)

        def grad(upstream):
            return unscaled_gradient * tf.cast(upstream, unscaled_gradient.dtype)[..., None]

        return loss, grad

    return cross_entropy(logits)


def before_exact_upcast(logits):
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
        return smoothed_cross_entropy_value(library, labels, before_exact_upcast(logits), eps)
    return _cross_entropy_value(logits, labels, eps)


def replicas_in_sync() -> int:
    """The number of `tf.distribute` replicas computing this step together (1 outside one)."""
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def sum_over_replicas(values):
    """`values` (a float32 tensor) summed over the replicas of this step: one all-reduce.

    tf.distribute's `all_reduce` is a `tf.custom_gradient`: in a traced step, the graph is
    then released from TensorFlow's gradient registry (`kernels.custom_gradient`), so that
    it is freed with its last user.
    """
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, values)
    release_custom_gradients()
    return total


def before_exact_upcast_for_kernels(logits):
    """`before_exact_upcast(logits)` where the fused kernels will read them, else `logits`."""
    return before_exact_upcast(logits) if fused_kernels() is not None else logits
