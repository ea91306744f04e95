"""One step of incremental decoding over the live hypotheses, and the batch that shrinks.

`loops` runs greedy and beam search as loops over `Stepper` calls. A stepper holds what a step
reads per hypothesis row (the self-attention cache, the encoder side: cross-attention keys and
values and the source mask) and applies the beam reorder and the removal of finished sentences
(`select`); `kept_sentences` decides when the batch shrinks. The step itself is a decoder's:
`InferenceDecoder` (the serving layout, for float32 Transformers) or `ModelDecoder` (any
model's `initial_cache`/`decode`).

Conventions: token buffers hold BOS in column 0 and the generated token of step `i` in column
`i + 1`; the batch*beam axis is batch-major (row `b * beam_size + k`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.decoding import inference_decoder
from keras_transformer.decoding.inference_decoder import InferenceDecoder

# With jit_compile, cache lengths and source widths are rounded up to these multiples, so a
# run over many batches compiles a few shapes rather than one per batch. The extra cache
# positions and source columns are masked, so results do not change.
JIT_LENGTH_BUCKET = 8
JIT_SOURCE_BUCKET = 8


def map_structure(function, structure):
    """`function` applied to every tensor of a nested cache structure."""
    return tf.nest.map_structure(function, structure)


def round_up(value, multiple: int):
    return (value + multiple - 1) // multiple * multiple


def write_column(sequences, index, tokens):
    """sequences (..., T) with column `index` set to tokens (...)."""
    columns = tf.range(tf.shape(sequences)[-1])
    return tf.where(columns == index, tokens[..., None], sequences)


def _vocab_size(model):
    """The vocabulary size from `model.config` (a `Transformer`'s); None for other models."""
    config = getattr(model, "config", None)
    return None if config is None else config.vocab_size


class ModelDecoder:
    """The step interface of `InferenceDecoder` over any model's `initial_cache` and `decode`
    (a `Transformer` in another dtype, or a hand-made test model).

    Args:
        model: exposes `initial_cache` and `decode` (as `Transformer`).
    """

    def __init__(self, model):
        self.model = model

    def start(self, encoder_output, source_mask, max_length):
        """(empty self-attention cache, the encoder side) of one row per sentence."""
        cache, cross_cache = self.model.initial_cache(encoder_output, max_length)
        return cache, (cross_cache, source_mask)

    @property
    def vocab_size(self):
        """The size of the log-probs `step` returns (None if the model does not say)."""
        return _vocab_size(self.model)

    def step(self, tokens, index, cache, encoder_side, grow_cache=True):
        """(log-probs float32 (rows, vocab), updated cache) after `tokens` (rows,) at `index`."""
        cross_cache, source_mask = encoder_side
        logits, cache = self.model.decode(tokens[:, None], source_mask, cache, cross_cache,
                                          index, grow_cache=grow_cache)
        return tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32)), cache


class Stepper:
    """One decoding step over the live hypotheses, cached (one position) or uncached (prefix).

    The state holds, per hypothesis row, what a step reads: the self-attention cache, the
    encoder side (the cross-attention keys/values and the source mask, or the encoder output
    when uncached); plus the pending row order. `select` schedules which cache rows the next
    step continues (a beam reorder, and fewer rows once sentences have finished). In beam
    search the gather is deferred to the start of the next step (under XLA it then fuses with
    the cache writes instead of being one more full cache copy); in greedy search, where rows
    only move when sentences leave, it happens then, and steps do not gather at all.

    Args:
        model: a `Transformer` or `InferenceModel` (a float32 one runs its steps through
            `InferenceDecoder`), or any object with `initial_cache` and `decode`.
        encoder_output, source_mask: from `model.encode`, one row per sentence.
        repeats: hypotheses per sentence (the beam size).
        max_length: target positions a fixed-length cache holds (with `fixed_length`).
        use_cache: incremental decoding; False re-runs the decoder over the whole prefix.
        fixed_length: a cache of `max_length` positions written in place (shapes stay fixed,
            as XLA wants) instead of one that grows by a position a step.
        reorders: rows may continue other rows' caches at every step (beam search); False:
            only when sentences leave (greedy search).
    """

    def __init__(self, model, encoder_output, source_mask, repeats, max_length, use_cache,
                 fixed_length=False, reorders=True):
        self.model = model
        self.use_cache = use_cache
        self.fixed_length = fixed_length
        self.reorders = reorders
        if use_cache:
            # A float32 Transformer runs its steps in the serving layout (same results); any
            # other model through its `initial_cache`/`decode`.
            self.decoder = (InferenceDecoder(model, max_length) if inference_decoder.supports(model)
                            else ModelDecoder(model))
            # The encoder side is computed once per sentence, then shared by its beams. A
            # growing self-attention cache makes a step copy (reorder, append) only the
            # positions so far.
            cache, encoder_side = self.decoder.start(
                encoder_output, source_mask, max_length if fixed_length else 0)
            cache, encoder_side = map_structure(
                lambda t: tf.repeat(t, repeats, axis=0), (cache, encoder_side))
            rows = tf.shape(source_mask)[0] * repeats
            self.initial_state = (cache, tf.range(rows), encoder_side)
        else:
            self.initial_state = (tf.repeat(encoder_output, repeats, axis=0),
                                  tf.repeat(source_mask, repeats, axis=0))

    @property
    def vocab_size(self):
        """The size of the log-probs a step returns (None if the model does not say)."""
        if self.use_cache:
            return self.decoder.vocab_size
        return _vocab_size(self.model)

    def _cached_step(self, tokens, cache, rows, encoder_side, index):
        if self.reorders or self.fixed_length:  # beams move nearly every step: no tf.cond
            cache = map_structure(lambda t: tf.gather(t, rows, axis=0), cache)
        return self.decoder.step(tokens, index, cache, encoder_side,
                                 grow_cache=not self.fixed_length)

    def __call__(self, sequences, index, state):
        """Log-probs (rows, vocab) float32 of the token after `sequences[:, index]`."""
        if self.use_cache:
            cache, rows, encoder_side = state
            # A gather, not [:, index]: XLA then knows the shape (rows,).
            tokens = tf.gather(sequences, index, axis=1)
            log_probs, cache = self._cached_step(tokens, cache, rows, encoder_side, index)
            return log_probs, (cache, tf.range(tf.shape(rows)[0]), encoder_side)
        # The whole decoder re-runs over the prefix with fresh caches: the baseline that the
        # cache is measured against (the encoder output is still computed once).
        encoder_output, source_mask = state
        prefix = sequences[:, : index + 1]
        self_cache, cross_cache = self.model.initial_cache(encoder_output, index + 1)
        logits, _ = self.model.decode(prefix, source_mask, self_cache, cross_cache, 0)
        return tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32)), state

    def settle(self, state):
        """The state with the pending row order applied (the cache then has one row per
        hypothesis, as a loop over fixed shapes needs)."""
        if not self.use_cache:
            return state
        cache, rows, encoder_side = state
        cache = map_structure(lambda t: tf.gather(t, rows, axis=0), cache)
        return cache, tf.range(tf.shape(rows)[0]), encoder_side

    def pending_rows(self, state):
        """The cache rows (rows,) int32 that the next step continues, as `select` left them."""
        if self.use_cache:
            return state[1]
        return tf.range(tf.shape(state[1])[0])

    def select(self, state, rows, kept=None):
        """The state for the next step: its row i continues the cache row `rows[i]` of this
        step. `kept` (the rows of this step that go on, in the new order; None: all) is given
        when finished sentences leave: the encoder side then shrinks with them."""
        if kept is not None:
            state = self._keep_encoder_side(state, kept)
        if not self.use_cache:
            return state
        cache, _, encoder_side = state
        if not self.reorders:
            # Greedy rows only move when sentences leave: the cache follows now, and steps
            # never gather.
            if kept is not None:
                cache = map_structure(lambda t: tf.gather(t, rows, axis=0), cache)
            rows = tf.range(tf.shape(rows)[0])
        return cache, rows, encoder_side

    def _keep_encoder_side(self, state, kept):
        if self.use_cache:
            cache, rows, encoder_side = state
            return cache, rows, map_structure(lambda t: tf.gather(t, kept, axis=0), encoder_side)
        encoder_output, source_mask = state
        return tf.gather(encoder_output, kept, axis=0), tf.gather(source_mask, kept, axis=0)


def kept_sentences(active, powers_of_two):
    """Which sentences (rows of `active` (n,) bool) the next step computes, active first.

    Leaving the batch costs a copy of the rows that stay (the cache is gathered), so the
    batch shrinks once a quarter of its rows have finished, to exactly the active ones.
    With `powers_of_two` (XLA, where every new row count is a new compilation) the count
    only falls to a power of two (32, 16, 8, ...: a handful of shapes), the remaining places
    filled with finished sentences, computed but ignored.
    """
    rows = tf.shape(active)[0]
    count = tf.reduce_sum(tf.cast(active, tf.int32))
    if powers_of_two:
        count = tf.minimum(rows, tf.bitwise.left_shift(1, tf.cast(tf.math.ceil(
            tf.math.log(tf.cast(tf.maximum(count, 1), tf.float32)) / tf.math.log(2.0)),
            tf.int32)))
    else:
        count = tf.where(rows - count >= tf.maximum(rows // 4, 1), count, rows)
    order = tf.argsort(tf.cast(tf.logical_not(active), tf.int32), stable=True)
    return order[:count]


def encode(model, source_ids, bucketed):
    """The encoder output, with the source padded to a bucketed width if `bucketed`."""
    if bucketed:
        width = tf.shape(source_ids)[1]
        source_ids = tf.pad(source_ids, [[0, 0], [0, round_up(width, JIT_SOURCE_BUCKET) - width]])
    return model.encode(source_ids)
