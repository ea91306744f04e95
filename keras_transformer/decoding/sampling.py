"""Random sampling of the next token (top-k, nucleus, temperature), seeded per input line.

Sampling replaces the argmax of greedy search; it serves back-translation and data generation
(Edunov et al. 2018: sampled back-translations beat beam search on large monolingual data).

Reproducible by construction: each step draws one uniform number from a counter-based hash of
(the line's seed, the step), and the line's seed is a hash of (the user's seed, the line's
index in its input). So a line's output depends on neither the batch it shares, nor the order
of the lines, nor an interrupted run resumed later; only on the seed, the line's index and the
model. The hash is integer arithmetic on uint32 (stock TensorFlow ops, so it exports into a
SavedModel); a numpy twin (`line_seeds_numpy`) gives the same seeds outside TensorFlow.

The token is drawn by inverse transform sampling: the kept tokens' probabilities (softmax of
log-probs / temperature) cumulated, and the first token whose cumulative mass exceeds
u * total. No draw sorts the vocabulary (on CPU a sort of 8,000 logits costs more than a
decoding step):
- the whole vocabulary: its tokens in their own order, cumulated in two levels
  (`_vocabulary_choice`);
- top-k: the k best, found in two stages (`_top_k`), best first; `top_k` 1 is the argmax,
  greedy search;
- top-p alone: exact rejection sampling (`_nucleus_choice`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

__all__ = ["Sampling", "choose_tokens", "line_seeds", "line_seeds_numpy", "next_uniforms",
           "next_uniforms_numpy", "step_uniforms"]

# The "lowbias32" integer hash (Chris Wellons' hash-prospector): full avalanche on 32 bits.
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
# The searches' log-prob of a forbidden token (`decoding.loops`).
NEG_INF = -1e9
_GOLDEN = 0x9E3779B9  # separates the counters of consecutive steps and lines
# Separates the uniforms of a step's successive draws (nucleus sampling's rejections).
_DRAW = 0x85EBCA6B
# Nucleus draws before the rows still rejected sort their vocabulary (`_nucleus_choice`).
MAX_NUCLEUS_DRAWS = 16


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
    with np.errstate(over="ignore"):
        lines = np.asarray(line_indices, np.int64).astype(np.uint32)
        return _hash_numpy(_hash_numpy(np.uint32(seed)) ^ (lines * np.uint32(_GOLDEN)))


def next_uniforms_numpy(uniforms, draw: int) -> np.ndarray:
    """`next_uniforms` in numpy (the same float32 values)."""
    with np.errstate(over="ignore"):
        bits = (np.asarray(uniforms, np.float32) * np.float32(2**24)).astype(np.uint32)
        hashed = _hash_numpy(bits + np.uint32(draw) * np.uint32(_DRAW))
    return (hashed >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 2**24)


def _hash_numpy(x):
    """`_hash` in numpy (uint32 arrays; the caller ignores overflow)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_MULTIPLIERS[0])
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_MULTIPLIERS[1])
    return x ^ (x >> np.uint32(16))


def step_uniforms(seeds, index):
    """One uniform float32 in [0, 1) per row: rows' seeds uint32 (n,), the step index."""
    counter = tf.cast(tf.cast(index, tf.int64), tf.uint32) * tf.constant(_GOLDEN, tf.uint32)
    return _uniforms(_hash(seeds + counter + tf.constant(1, tf.uint32)))


def next_uniforms(uniforms, draw):
    """The uniforms (n,) of a step's draw number `draw` >= 1, from those of its first draw
    (n,): a hash of their 24 bits and `draw`, so a row's draws depend on its seed alone."""
    bits = tf.cast(uniforms * 2**24, tf.uint32)
    return _uniforms(_hash(bits + tf.cast(draw, tf.uint32) * tf.constant(_DRAW, tf.uint32)))


def _uniforms(hashed):
    """Uniform float32 in [0, 1) from uint32 hashes: their top 24 bits (exact in float32)."""
    bits = tf.bitwise.right_shift(hashed, tf.constant(8, tf.uint32))
    return tf.cast(bits, tf.float32) * (1.0 / 2**24)


def choose_tokens(log_probs, uniforms, sampling: Sampling, compiled: bool = False):
    """Sampled token ids int32 (n,) from log-probs (n, vocab) (forbidden tokens at -1e9).

    top_k 1 is greedy search: the `tf.argmax` of the log-probs, the token greedy search
    takes, at any temperature and without a draw. So the SavedModel's one greedy search
    serves sampling too (`serving.detailed_signatures`).

    Args:
        log_probs: float32 (n, vocab), already biased (forbidden tokens very negative); the
            vocabulary size is static.
        uniforms: float32 (n,) in [0, 1), from `step_uniforms`: the step's first draw (top-p
            draws again with `next_uniforms`); or a function returning them, called only
            where a token is drawn (not at top_k 1).
        sampling: the options: Python values (the branches are chosen while tracing), or
            scalar tensors (a SavedModel's inputs: the branches are chosen at run time).
        compiled: traced for XLA, which needs a static k: a tensor `top_k` then takes the
            k best of the vocabulary sorted.
    """
    def greedy():
        return tf.argmax(log_probs, axis=-1, output_type=tf.int32)

    if sampling.static:
        return greedy() if sampling.top_k == 1 else _draw(log_probs, uniforms, sampling,
                                                          compiled)
    return tf.cond(tf.equal(tf.cast(sampling.top_k, tf.int32), 1), greedy,
                   lambda: _draw(log_probs, uniforms, sampling, compiled))


def _draw(log_probs, uniforms, sampling: Sampling, compiled: bool):
    """`choose_tokens` where a token is drawn (top_k other than 1)."""
    if callable(uniforms):
        uniforms = uniforms()

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
    # (the inverse transforms take unnormalized masses).
    if sampling.static:
        if sampling.top_k > 0:
            return _top_k_choice(logits, uniforms, sampling.top_k, sampling.top_p, compiled)
        if sampling.top_p < 1.0:
            return _nucleus_choice(logits, uniforms, sampling.top_p)
        return _vocabulary_choice(tf.exp(logits), uniforms, logits)
    top_k, top_p = tf.cast(sampling.top_k, tf.int32), tf.cast(sampling.top_p, tf.float32)
    return tf.cond(
        top_k > 0, lambda: _top_k_choice(logits, uniforms, top_k, top_p, compiled),
        lambda: tf.cond(top_p < 1.0, lambda: _nucleus_choice(logits, uniforms, top_p),
                        lambda: _vocabulary_choice(tf.exp(logits), uniforms, logits)))


def _top_k_choice(logits, uniforms, top_k, top_p, compiled):
    """A draw among the top_k best tokens (best first), within the nucleus of mass top_p
    among them: each candidate is kept while the mass before it is below top_p (the best one
    always)."""
    values, candidates = _top_k(logits, top_k, compiled)
    return tf.gather(candidates, _nucleus_position(values, uniforms, top_p), batch_dims=1)


def _nucleus_position(values, uniforms, top_p):
    """The drawn position (n,) among logits `values` (n, k) sorted best first, within their
    nucleus of mass top_p (a scalar or (n, 1))."""
    probs = tf.nn.softmax(values)
    before = tf.cumsum(probs, axis=-1, exclusive=True)
    return _inverse_transform(tf.where(before < top_p, probs, 0.0), uniforms)


def _top_k(logits, k, compiled):
    """(values, ids) (n, k), best first: the k best tokens; under XLA with a tensor k, the
    whole vocabulary sorted (n, vocab) with the tokens after the k-th at -inf.

    A small k goes in two stages, because `tf.math.top_k` over the vocabulary costs several
    times the rest of a draw on CPU: the k best tokens lie in at most k blocks, and those are
    among the k blocks whose best tokens are best. So: the vocabulary in blocks of
    ~sqrt(vocab / 8) tokens, the k best blocks by their maxima, the k best of their tokens.
    The same tokens (the order of ties between blocks aside).
    """
    vocab = logits.shape[-1]
    width = _block_width(max(vocab // 8, 1))
    if isinstance(k, int):
        k = min(k, vocab)
        if k * width <= vocab // 2:
            return _two_stage_top_k(logits, k, width)
        return tuple(tf.math.top_k(logits, k=k))
    if compiled:
        values, ids = tf.math.top_k(logits, k=vocab)
        return tf.where(tf.range(vocab) < k, values, float("-inf")), ids
    k = tf.minimum(k, vocab)
    return tf.cond(k * width <= vocab // 2, lambda: _two_stage_top_k(logits, k, width),
                   lambda: tuple(tf.math.top_k(logits, k=k)))


def _two_stage_top_k(logits, k, width: int):
    """`tf.math.top_k(logits, k)` through the k best blocks of `width` tokens (`_top_k`)."""
    blocks = _blocks(logits, width, float("-inf"))
    _, best_blocks = tf.math.top_k(tf.reduce_max(blocks, axis=-1), k=k)
    # In vocabulary order, so that ties go to the lower id, as in `tf.math.top_k`.
    best_blocks = tf.sort(best_blocks, axis=-1)
    candidates = tf.reshape(tf.gather(blocks, best_blocks, batch_dims=1),
                            [tf.shape(logits)[0], k * width])
    values, positions = tf.math.top_k(candidates, k=k)
    block = tf.gather(best_blocks, positions // width, batch_dims=1)
    # A padded position (-inf, with fewer than k finite tokens) has no mass: never drawn,
    # but kept a valid id.
    return values, tf.minimum(block * width + positions % width, logits.shape[-1] - 1)


def _nucleus_choice(logits, uniforms, top_p):
    """A draw from the nucleus of the whole vocabulary: exact, without sorting it.

    The nucleus is the fewest most likely tokens whose probability sums to at least top_p:
    a token is in it when the tokens more likely than it hold less than top_p of the mass.
    Rejection sampling, as the sorting-free samplers of FlashInfer (Ye et al. 2025): draw
    from the tokens not ruled out (`_vocabulary_choice`); keep the draw if it is in the
    nucleus; otherwise rule it out with every less likely token (none of them is in the
    nucleus either) and draw again, with the step's next uniform. A kept draw follows the
    nucleus' renormalized probabilities, as a sorted nucleus' draw does (not the same token
    for a given uniform). A first draw is kept with probability >= top_p and each rejection
    rules out more, so a step takes one to a few draws; rows still rejected after
    `MAX_NUCLEUS_DRAWS` draw from their sorted nucleus. A best token that holds top_p alone
    is the whole nucleus: chosen without a draw (a tiny top_p is greedy search).

    Ties: a token tied with the nucleus' least likely one is in it here, where a sorted
    nucleus (`_top_k_choice`, the fallback) keeps ties in id order, up to top_p. The two
    differ only when log-probs tie exactly at the boundary; ranking ties by id here as well
    made a draw ~60% slower on CPU (two more passes over the vocabulary).
    """
    probs = tf.exp(logits)
    total = tf.reduce_sum(probs, axis=-1)
    target = tf.cast(top_p, tf.float32) * total
    best = tf.argmax(logits, axis=-1, output_type=tf.int32)
    # The best token alone, or no mass at all (no finite probability): the best token.
    settled = (tf.gather(probs, best, batch_dims=1) >= target) | tf.logical_not(total > 0)

    def draw_again(draw, tokens, settled, floor):
        allowed, draw_uniforms = tf.cond(
            draw > 0, lambda: (tf.where(logits > floor[:, None], probs, 0.0),
                               next_uniforms(uniforms, draw)),
            lambda: (probs, uniforms))
        drawn = _vocabulary_choice(allowed, draw_uniforms, logits)
        drawn_logit = tf.gather(logits, drawn, batch_dims=1)
        above = tf.reduce_sum(tf.where(logits > drawn_logit[:, None], probs, 0.0), axis=-1)
        kept = tf.logical_not(settled) & (above < target)
        floor = tf.where(settled | kept, floor, drawn_logit)
        return draw + 1, tf.where(kept, drawn, tokens), settled | kept, floor

    def rejected(draw, tokens, settled, floor):
        return (draw < MAX_NUCLEUS_DRAWS) & tf.logical_not(tf.reduce_all(settled))

    floor = tf.fill(tf.shape(total), float("-inf"))
    _, tokens, settled, _ = tf.while_loop(rejected, draw_again,
                                          (tf.constant(0), best, settled, floor))

    def sorted_nucleus():
        values, ids = tf.math.top_k(logits, k=logits.shape[-1])
        # A uniform of its own: the rows here are those whose earlier draws were rejected.
        position = _nucleus_position(values, next_uniforms(uniforms, MAX_NUCLEUS_DRAWS),
                                     tf.cast(top_p, tf.float32))
        return tf.where(settled, tokens, tf.gather(ids, position, batch_dims=1))

    return tf.cond(tf.reduce_all(settled), lambda: tokens, sorted_nucleus)


def _vocabulary_choice(probs, uniforms, logits):
    """A draw (n,) int32 by inverse transform over `probs` (n, vocab) in vocabulary order;
    `logits`' argmax for a row without any mass.

    In two levels, as a cumulative sum along the vocabulary is the costliest part of a draw
    on CPU: the tokens in blocks of ~sqrt(vocab), the first block whose cumulative mass
    exceeds uniforms * total, then the first token of that block whose does.
    """
    blocks = _blocks(probs, _block_width(probs.shape[-1]), 0.0)
    width = blocks.shape[-1]
    cumulative = tf.cumsum(tf.reduce_sum(blocks, axis=-1), axis=-1)
    total = cumulative[:, -1]
    level = uniforms * total
    block = tf.reduce_sum(tf.cast(cumulative <= level[:, None], tf.int32), axis=-1)
    block = tf.minimum(block, blocks.shape[1] - 1)
    before = tf.gather(tf.pad(cumulative, [[0, 0], [1, 0]]), block, batch_dims=1)
    inner = tf.cumsum(tf.gather(blocks, block, batch_dims=1), axis=-1)
    # The block's first position whose cumulative mass exceeds the rest of the level; the
    # two levels' rounding may leave none, and then its last position with mass.
    position = tf.reduce_sum(tf.cast(inner <= (level - before)[:, None], tf.int32), axis=-1)
    last_with_mass = tf.reduce_sum(tf.cast(inner < inner[:, -1:], tf.int32), axis=-1)
    chosen = block * width + tf.minimum(position, last_with_mass)
    return tf.where(total > 0, chosen, tf.argmax(logits, axis=-1, output_type=tf.int32))


def _blocks(values, width: int, padding: float):
    """`values` (n, vocab) as (n, blocks, width), the last block padded with `padding`."""
    vocab = values.shape[-1]
    count = -(-vocab // width)
    if count * width > vocab:
        values = tf.pad(values, [[0, 0], [0, count * width - vocab]], constant_values=padding)
    return tf.reshape(values, [tf.shape(values)[0], count, width])


def _block_width(size: int) -> int:
    """A block width near sqrt(size): a divisor of `size` up to twice that if it has one
    (no padding)."""
    root = max(1, math.isqrt(size))
    for width in range(root, 2 * root + 1):
        if size % width == 0:
            return width
    return root + (root * root < size)


def _inverse_transform(probs, uniforms):
    """The first position (n,) int32 whose cumulative mass exceeds uniforms * total;
    zero-mass positions never are (their cumulative equals their predecessor's)."""
    cumulative = tf.cumsum(probs, axis=-1)
    threshold = uniforms[:, None] * cumulative[:, -1:]
    position = tf.reduce_sum(tf.cast(cumulative <= threshold, tf.int32), axis=-1)
    position = tf.minimum(position, tf.shape(probs)[-1] - 1)
    # No mass at all (no finite probability): the best candidate, never the last.
    return tf.where(cumulative[:, -1] > 0, position, 0)
