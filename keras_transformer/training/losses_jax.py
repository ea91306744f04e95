"""5.4's label-smoothed cross-entropy under Keras' JAX backend: its gradient written by hand,
and the per-token statistics of the logits that the loss and the metrics read, in one
reduction on accelerators. Chosen by `keras_transformer.training.losses` (beside
`losses_tensorflow`, which does the same for TensorFlow).

JAX's autodiff of the loss differentiates the label's gather (`take_along_axis`) into a
scatter-add over a zero (tokens, vocab) tensor, and logsumexp and the mean into their own
(tokens, vocab) passes, then adds them: on (tokens, vocab) logits every one of these is a
memory-bound pass. The gradient has a closed form, softmax - (1 - eps) * one_hot - eps / V,
which `_backward` computes in one elementwise pass over the logits (the one-hot as a
comparison with the label, never stored) and writes in the logits' dtype.

The forward pass needs, per token, logsumexp, the label's logit and the mean logit, and the
accuracy metric the first argmax. As separate reductions, XLA:GPU compiles the `base`
trainer step (vocabulary 37,000, 25,600 target tokens) into four passes over the bfloat16
logits (1.9 GB each) besides the gradient's, for the loss and the metrics together
(`benchmarks/gpu_program.py`). `token_statistics` computes all four in one variadic
reduction (an online softmax: a running maximum and the sum of exponentials rescaled to
it) on GPUs and other accelerators, which the loss and the metrics share (one read of the
logits for both): with the gradient's pass, 5.9 GB of traffic over the logits outside the
matmuls in place of 11.4 GB. XLA:CPU runs a variadic reduction element
by element (the loss and the metrics 2x slower on this project's CPU), so on CPUs the
statistics are the separate reductions, with the values the portable loss
(`losses._portable_cross_entropy`) computes; `jax.lax.platform_dependent`
chooses when the step is lowered for its device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class TokenStatistics(NamedTuple):
    """Per-token statistics of logits (batch, length, vocab) over the vocabulary, each
    (batch, length): float32 unless said."""

    log_normalizer: jax.Array  # logsumexp of the logits
    label_logit: jax.Array  # the logit of the token's label
    mean_logit: jax.Array  # the mean of the logits
    best: jax.Array  # int32: the first index of the largest logit (argmax)


def token_statistics(labels, logits) -> TokenStatistics:
    """`TokenStatistics` of `logits` (batch, length, vocab), any float dtype, computed in
    float32, for int `labels` (batch, length) in [0, vocab) (outside it the label's logit
    is undefined, and differs between the forms): one pass over the logits on accelerators,
    separate reductions on CPUs (module docstring). Not differentiable (JAX has no
    derivative for a reduction with its own combiner, and traces both forms): the loss
    differentiates through `token_cross_entropy`'s hand-written gradient."""
    labels = _label_ids(labels)
    return TokenStatistics(*lax.platform_dependent(
        labels, logits, cpu=_separate_reductions, default=_one_reduction))


def _label_ids(labels):
    """int32 label ids, through float32 as Keras' `Loss.__call__` passes the loss its labels
    (its dtype): the metrics' labels are then the loss's, one value in the compiled step,
    and XLA computes the metrics' statistics in the loss's pass over the logits (with int32
    labels left as they are, the `base` step moves 1.9 GB more:
    `benchmarks/gpu_program.py`). Exact for ids below 2**24."""
    return jnp.asarray(labels, jnp.float32).astype(jnp.int32)


def _separate_reductions(labels, logits):
    """`TokenStatistics` as `keras.ops` computes them under JAX (logsumexp, take_along_axis,
    mean, argmax): the portable loss's values."""
    x = logits.astype(jnp.float32)
    label_logit = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    return (jax.scipy.special.logsumexp(x, axis=-1), label_logit, jnp.mean(x, axis=-1),
            jnp.argmax(x, axis=-1).astype(jnp.int32))


def _one_reduction(labels, logits):
    """`TokenStatistics` from one variadic reduction over the vocabulary (`_combine`)."""
    operands = _reduced_operands(labels, logits)
    vocab = logits.shape[-1]
    return _statistics(lax.reduce(operands, _empty(vocab), _combine, (logits.ndim - 1,)),
                       vocab)


def _reduced_operands(labels, logits) -> tuple:
    """What `_combine` reduces, each like `logits` (batch, length, vocab): the float32
    logits as the maximum, ones for the sum of exponentials, the logits for their sum, the
    label's logit (0 elsewhere), the class indices."""
    x = logits.astype(jnp.float32)
    classes = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return x, jnp.ones_like(x), x, jnp.where(classes == labels[..., None], x, 0.0), classes


def _statistics(accumulator: tuple, vocab: int) -> tuple:
    """`TokenStatistics`' fields from `_combine`'s accumulator over the whole vocabulary."""
    high, exp_sum, total, label_logit, best = accumulator
    return high + jnp.log(exp_sum), label_logit, total / vocab, best


def _empty(vocab: int) -> tuple:
    """The reduction's identity: no logits seen (an index past the vocabulary)."""
    return (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.0),
            jnp.int32(vocab))


def _combine(a, b):
    """Two partial accumulators (running maximum m, sum of exp(x - m), sum of x, the label's
    logit, the first index of m) as one. Commutative and associative up to round-off, as
    XLA's tree reductions need, NaN included: a NaN is the maximum and its first index wins,
    as `jnp.argmax` has it."""
    high_a, exp_sum_a, sum_a, label_a, index_a = a
    high_b, exp_sum_b, sum_b, label_b, index_b = b
    high = jnp.maximum(high_a, high_b)
    # Each side's sum rescaled to the new maximum; the side holding it keeps its sum
    # unscaled, so two empty sides (-inf, 0) give 0, not 0 * exp(-inf + inf) = nan.
    exp_sum = (jnp.where(high_a == high, exp_sum_a, exp_sum_a * jnp.exp(high_a - high))
               + jnp.where(high_b == high, exp_sum_b, exp_sum_b * jnp.exp(high_b - high)))
    nan_a, nan_b = jnp.isnan(high_a), jnp.isnan(high_b)
    tied = (high_a == high_b) | (nan_a & nan_b)
    first = (high_a > high_b) | (nan_a & ~nan_b) | (tied & (index_a < index_b))
    return high, exp_sum, sum_a + sum_b, label_a + label_b, jnp.where(first, index_a, index_b)


def smoothed_cross_entropy(statistics: TokenStatistics, label_smoothing: float):
    """(1 - eps) * (logsumexp - logit[label]) + eps * (logsumexp - mean(logits)), float32
    (batch, length): the portable loss's formula on `token_statistics`."""
    loss = statistics.log_normalizer - statistics.label_logit
    eps = float(label_smoothing)
    if eps:
        loss = (1.0 - eps) * loss + eps * (statistics.log_normalizer - statistics.mean_logit)
    return loss


def token_cross_entropy(labels, logits, label_smoothing: float):
    """Per-token (smoothed) cross-entropy whose gradient is one fused pass.

    Args:
        labels: int (batch, length), or their float32 values (as Keras' losses get them).
        logits: (batch, length, vocab); computed in float32 whatever their dtype.
        label_smoothing: eps_ls; the target is (1 - eps) * one_hot + eps / vocab.

    Returns:
        float32 (batch, length); not yet masked. Its gradient with respect to `logits` has
        the logits' dtype; `labels` get none.
    """
    return _cross_entropy(float(label_smoothing), jnp.asarray(labels), logits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cross_entropy(eps: float, labels, logits):
    """The smoothed loss, float32 (batch, length), differentiated by `_backward` (reverse
    mode only: `jax.jvp` and `jax.hessian` of it raise, as of any `jax.custom_vjp`)."""
    return smoothed_cross_entropy(token_statistics(labels, logits), eps)


def _forward(eps: float, labels, logits):
    """The loss and what `_backward` needs: the labels (batch, length), the logits (batch,
    length, vocab) as given, their float32 logsumexp (batch, length)."""
    statistics = token_statistics(labels, logits)
    return (smoothed_cross_entropy(statistics, eps),
            (labels, logits, statistics.log_normalizer))


def _backward(eps: float, residuals, upstream):
    """d loss / d logits = upstream * (exp(logits - logsumexp) - target), where the target is
    1 - eps + eps / V at the label and eps / V elsewhere: (batch, length, vocab) in the
    logits' dtype, from the float32 upstream gradient (batch, length); the labels get no
    gradient (None)."""
    labels, logits, log_normalizer = residuals
    labels = _label_ids(labels)
    vocab = logits.shape[-1]
    classes = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    off_target = eps / vocab
    target = jnp.where(classes == labels[..., None], 1.0 - eps + off_target, off_target)
    probabilities = jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None])
    gradient = (probabilities - target) * upstream.astype(jnp.float32)[..., None]
    return None, gradient.astype(logits.dtype)


_cross_entropy.defvjp(_forward, _backward)
