"""5.4's label-smoothed cross-entropy with its gradient written by hand, chosen under Keras'
JAX backend by `keras_transformer.training.losses` (beside `losses_tensorflow`, which does
the same for TensorFlow).

JAX's autodiff of the loss differentiates the label's gather (`take_along_axis`) into a
scatter-add over a zero (tokens, vocab) tensor, and logsumexp and the mean into their own
(tokens, vocab) passes, then adds them: on (tokens, vocab) logits every one of these is a
memory-bound pass. The gradient has a closed form, softmax - (1 - eps) * one_hot - eps / V,
which `_backward` computes in one elementwise pass over the logits (the one-hot as a
comparison with the label, never stored) and writes in the logits' dtype. The forward pass
is the portable loss itself (`losses.smoothed_cross_entropy_and_normalizer`, passed in), so
the loss values are those of autodiff, bit for bit; only the log-normalizer is kept for the
backward pass, with the logits the model computed anyway.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def token_cross_entropy(labels, logits, label_smoothing: float, forward: Callable):
    """Per-token (smoothed) cross-entropy whose gradient is one fused pass.

    Args:
        labels: int (batch, length).
        logits: (batch, length, vocab); computed in float32 whatever their dtype.
        label_smoothing: eps_ls; the target is (1 - eps) * one_hot + eps / vocab.
        forward: `(labels, logits, eps) -> (loss, log-normalizer)`, both float32 (batch,
            length): the loss as every backend computes it
            (`losses.smoothed_cross_entropy_and_normalizer`).

    Returns:
        float32 (batch, length); not yet masked. Its gradient with respect to `logits` has
        the logits' dtype; `labels` get none.
    """
    return _cross_entropy(forward, float(label_smoothing), jnp.asarray(labels, jnp.int32),
                          logits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(forward: Callable, eps: float, labels, logits):
    """`forward`'s loss, float32 (batch, length), differentiated by `_backward` (reverse
    mode only: `jax.jvp` and `jax.hessian` of it raise, as of any `jax.custom_vjp`)."""
    return forward(labels, logits, eps)[0]


def _forward(forward: Callable, eps: float, labels, logits):
    """The loss and what `_backward` needs: int32 labels (batch, length), the logits (batch,
    length, vocab) as given, their float32 logsumexp (batch, length)."""
    loss, log_normalizer = forward(labels, logits, eps)
    return loss, (labels, logits, log_normalizer)


def _backward(forward: Callable, eps: float, residuals, upstream):
    """d loss / d logits = upstream * (exp(logits - logsumexp) - target), where the target is
    1 - eps + eps / V at the label and eps / V elsewhere: (batch, length, vocab) in the
    logits' dtype, from the float32 upstream gradient (batch, length); labels are integers
    (no gradient: None)."""
    labels, logits, log_normalizer = residuals
    vocab = logits.shape[-1]
    classes = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    off_target = eps / vocab
    target = jnp.where(classes == labels[..., None], 1.0 - eps + off_target, off_target)
    probabilities = jnp.exp(logits.astype(jnp.float32) - log_normalizer[..., None])
    gradient = (probabilities - target) * upstream.astype(jnp.float32)[..., None]
    return None, gradient.astype(logits.dtype)


_cross_entropy.defvjp(_forward, _backward)
