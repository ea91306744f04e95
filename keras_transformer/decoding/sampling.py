"""Random sampling of the next token (top-k, nucleus, temperature), seeded per input line.

Sampling replaces the argmax of greedy search; it serves back-translation and data generation
(Edunov et al. 2018: sampled back-translations beat beam search on large monolingual data).

Reproducible by construction: each step draws one uniform number from a counter-based hash of
(the line's seed, the step), and the line's seed is a hash of (the user's seed, the line's
index in its input). So a line's output depends on neither the batch it shares, nor the order
of the lines, nor an interrupted run resumed later; only on the seed, the line's index and the
model. The hash is integer arithmetic on uint32 (stock TensorFlow ops, so it exports into a
SavedModel); a numpy twin (`line_seeds_numpy`) gives the same seeds outside TensorFlow.

The token is drawn by inverse transform sampling over the kept candidates: their probabilities
(softmax of log-probs / temperature) in descending order, cumulated, and the first candidate
whose cumulative mass exceeds u * total. With `top_k` 1 that is the argmax: greedy search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

__all__ = ["Sampling", "choose_tokens", "line_seeds", "line_seeds_numpy", "step_uniforms"]

# The "lowbias32" integer hash (Chris Wellons' hash-prospector): full avalanche on 32 bits.
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
# The searches' log-prob of a forbidden token (`decoding.loops`).
NEG_INF = -1e9
_GOLDEN = 0x9E3779B9  # separates the counters of consecutive steps and lines
# Nucleus sampling over the whole vocabulary first looks among this many best tokens.
NUCLEUS_CANDIDATES = 256


@dataclass(frozen=True)
class Sampling:
    """Random sampling options (CTranslate2's names without the `sampling_` prefix).

    Args:
        top_k: sample among the k most likely tokens; 0 for the whole vocabulary; 1 is greedy.
        top_p: nucleus sampling: among the fewest most likely tokens whose probability sums
            to at least top_p (after top_k); 1.0 keeps them all.
        temperature: log-probs are divided by it before the softmax (< 1 sharper, > 1 flatter).
        seed: with the line's index in its input, fixes the line's random draws.
    """

    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    @property
    def static(self) -> bool:
        """Python values (the options fixed when the search is traced), not tensors."""
        return not any(isinstance(value, tf.Tensor) for value in vars(self).values())

    def __post_init__(self):
        if any(isinstance(value, tf.Tensor) for value in vars(self).values()):
            return  # a SavedModel's inputs: clipped there, not checked here
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 < self.temperature < float("inf"):
            raise ValueError(f"temperature must be > 0 and finite, got {self.temperature}.")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}.")


def _hash(x):
    """lowbias32 of uint32 tensors (wrapping arithmetic)."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))
    x = x * tf.constant(_MULTIPLIERS[0], tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(15, tf.uint32)))
    x = x * tf.constant(_MULTIPLIERS[1], tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def line_seeds(seed, line_indices):
    """Per-line seeds uint32 (n,) from the user's seed and each line's index (n,) in its input."""
    seed = tf.cast(tf.cast(seed, tf.int64), tf.uint32)
    lines = tf.cast(tf.cast(line_indices, tf.int64), tf.uint32)
    return _hash(_hash(seed) ^ (lines * tf.constant(_GOLDEN, tf.uint32)))


def line_seeds_numpy(seed: int, line_indices) -> np.ndarray:
    """`line_seeds` in numpy (the same uint32 values)."""
    def hashed(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(_MULTIPLIERS[0])
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(_MULTIPLIERS[1])
        return x ^ (x >> np.uint32(16))

    with np.errstate(over="ignore"):
        lines = np.asarray(line_indices, np.int64).astype(np.uint32)
        return hashed(hashed(np.uint32(seed)) ^ (lines * np.uint32(_GOLDEN)))


def step_uniforms(seeds, index):
    """One uniform float32 in [0, 1) per row: rows' seeds uint32 (n,), the step index."""
    counter = tf.cast(tf.cast(index, tf.int64), tf.uint32) * tf.constant(_GOLDEN, tf.uint32)
    bits = tf.bitwise.right_shift(_hash(seeds + counter + tf.constant(1, tf.uint32)),
                                  tf.constant(8, tf.uint32))
    return tf.cast(bits, tf.float32) * (1.0 / 2**24)  # 24 bits: exact in float32


def choose_tokens(log_probs, uniforms, sampling: Sampling):
    """Sampled token ids int32 (n,) from log-probs (n, vocab) (forbidden tokens at -1e9).

    Args:
        log_probs: float32 (n, vocab), already biased (forbidden tokens very negative).
        uniforms: float32 (n,) in [0, 1), from `step_uniforms`.
        sampling: the options: Python values (the branches are chosen while tracing), or
            scalar tensors (a SavedModel's inputs: the branches are chosen at run time).
    """
    def tempered():
        # Scaled from the best token down, so that no temperature overflows or underflows
        # the best one; forbidden tokens (-1e9 biases) stay forbidden at any temperature.
        best = tf.reduce_max(log_probs, axis=-1, keepdims=True)
        scaled = (log_probs - best) / tf.cast(sampling.temperature, tf.float32)
        return tf.where(log_probs > NEG_INF / 2, scaled, float("-inf"))

    # At temperature 1 the log-probabilities are the logits (forbidden tokens' exp is 0).
    if sampling.static:
        logits = log_probs if sampling.temperature == 1.0 else tempered()
    else:
        logits = tf.cond(tf.equal(tf.cast(sampling.temperature, tf.float32), 1.0),
                         lambda: log_probs, tempered)
    # Either way logits <= 0 with the best near 0: exp needs no softmax's max and sum
    # (the inverse transform takes unnormalized masses).
    if sampling.static:
        if sampling.top_k > 0 or sampling.top_p < 1.0:
            return _sorted_choice(logits, uniforms, sampling.top_k, sampling.top_p)
        return _inverse_transform(tf.exp(logits), uniforms)
    top_k, top_p = tf.cast(sampling.top_k, tf.int32), tf.cast(sampling.top_p, tf.float32)
    return tf.cond((top_k > 0) | (top_p < 1.0),
                   lambda: _sorted_choice(logits, uniforms, top_k, top_p),
                   lambda: _inverse_transform(tf.exp(logits), uniforms))


def _sorted_choice(logits, uniforms, top_k, top_p):
    """The choice among the best candidates: the top_k best, then the nucleus of mass top_p
    among them. With top_k 0 (the whole vocabulary) the nucleus is looked for among the best
    `NUCLEUS_CANDIDATES` first, and the vocabulary is sorted only when some row's nucleus
    is larger (a flat distribution): the same tokens, without a full sort at most steps."""
    vocab = tf.shape(logits)[-1]

    def among_best(k):
        values, candidates = tf.math.top_k(logits, k=k)
        return _nucleus_choice(tf.nn.softmax(values), candidates, uniforms, top_p)

    def whole_vocabulary():
        values, candidates = tf.math.top_k(logits, k=tf.minimum(NUCLEUS_CANDIDATES, vocab))
        # The full distribution's probabilities of the best candidates.
        probs = tf.exp(values - tf.reduce_logsumexp(logits, axis=-1, keepdims=True))
        fits = tf.reduce_all(tf.reduce_sum(probs, axis=-1) >= top_p)
        return tf.cond(fits, lambda: _nucleus_choice(probs, candidates, uniforms, top_p),
                       lambda: among_best(vocab))

    if isinstance(top_k, int):
        return among_best(tf.minimum(top_k, vocab)) if top_k > 0 else whole_vocabulary()
    return tf.cond(top_k > 0, lambda: among_best(tf.minimum(top_k, vocab)), whole_vocabulary)


def _nucleus_choice(probs, candidates, uniforms, top_p):
    """A draw among `candidates` (n, k) (best first, probabilities `probs`), keeping each
    while the mass before it is below top_p (the best one always)."""
    before = tf.cumsum(probs, axis=-1, exclusive=True)
    probs = tf.where(before < top_p, probs, 0.0)
    return tf.gather(candidates, _inverse_transform(probs, uniforms), batch_dims=1)


def _inverse_transform(probs, uniforms):
    """The first position whose cumulative mass exceeds uniforms * total (n,) int32;
    zero-mass positions never are (their cumulative equals their predecessor's)."""
    cumulative = tf.cumsum(probs, axis=-1)
    threshold = uniforms[:, None] * cumulative[:, -1:]
    position = tf.reduce_sum(tf.cast(cumulative <= threshold, tf.int32), axis=-1)
    position = tf.minimum(position, tf.shape(probs)[-1] - 1)
    # No mass at all (no finite probability): the best candidate, never the last.
    return tf.where(cumulative[:, -1] > 0, position, 0)
