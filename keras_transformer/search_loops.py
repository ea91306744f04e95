"""The graph-mode search loops behind `keras_transformer.decoding` (paper 6.1).

Both loops are plain TensorFlow (`tf.while_loop`) so they trace into a `tf.function` and export
into a SavedModel. They only use a model's `encode`, `initial_cache` and `decode` methods (with
`Transformer.decode`'s `grow_cache` argument), so any object exposing that API (such as a
hand-made test model) can be searched.

Conventions: token buffers hold BOS in column 0 and the generated token of step `i` in column
`i + 1`; the batch*beam axis is batch-major (row `b * beam_size + k`).
"""

from __future__ import annotations

import tensorflow as tf

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Finite rather than -inf: dead hypotheses keep getting log-probs added, and -inf arithmetic
# (-inf - -inf) would produce NaNs that top_k orders arbitrarily.
NEG_INF = -1e9


def length_penalty(length, alpha):
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016), float32."""
    return tf.pow((5.0 + tf.cast(length, tf.float32)) / 6.0, tf.cast(alpha, tf.float32))


def _token_bias(vocab_size, eos_allowed):
    """Additive log-prob bias (vocab,) that forbids PAD and BOS, and EOS unless allowed.

    Emitting PAD would make the 0-padded output ambiguous; BOS is never a target token.
    """
    ids = tf.range(vocab_size)
    forbidden = (ids == PAD_ID) | (ids == BOS_ID) | ((ids == EOS_ID) & tf.logical_not(eos_allowed))
    return tf.where(forbidden, tf.constant(NEG_INF, tf.float32), 0.0)


def _write_column(sequences, index, tokens):
    """sequences (..., T) with column `index` set to tokens (...)."""
    columns = tf.range(tf.shape(sequences)[-1])
    return tf.where(columns == index, tokens[..., None], sequences)


# With jit_compile, cache lengths and source widths are rounded up to these multiples, so a
# run over many batches compiles a few step shapes rather than one per batch. The extra cache
# positions and source columns are masked, so results do not change.
_JIT_LENGTH_BUCKET = 8
_JIT_SOURCE_BUCKET = 8


def _map(function, structure):
    """`function` applied to every tensor of a nested cache structure."""
    return tf.nest.map_structure(function, structure)


def _round_up(value, multiple: int):
    return (value + multiple - 1) // multiple * multiple


class _Stepper:
    """One decoding step over the live hypotheses, cached (one position) or uncached (prefix).

    The state holds, per hypothesis row, what a step reads: the self-attention cache, the
    encoder side (the cross-attention keys/values, or the encoder output when uncached) and
    the source mask; plus the pending row order. `select` schedules which cache rows the
    next step continues (a beam reorder, and fewer rows once sentences have finished); the
    gather itself is deferred to the start of the next step, so with `jit_compile` it fuses
    into the XLA step with the cache writes instead of being one more full cache copy.
    """

    def __init__(self, model, encoder_output, source_mask, repeats, max_length, use_cache,
                 jit_compile=False):
        self.model = model
        self.use_cache = use_cache
        self.jit_compile = jit_compile
        source_mask = tf.repeat(source_mask, repeats, axis=0)
        if use_cache:
            # The encoder-side keys/values are projected once per sentence, then shared by its
            # beams. The self-attention cache grows by one position a step, so a step copies
            # (reorders, appends) only the positions so far. XLA wants fixed shapes instead: a
            # cache of the whole length, written in place.
            max_length = _round_up(max_length, _JIT_LENGTH_BUCKET) if jit_compile else 0
            self_cache, cross_cache = model.initial_cache(encoder_output, max_length)
            cross_cache = _map(lambda t: tf.repeat(t, repeats, axis=0), cross_cache)
            self_cache = _map(lambda t: tf.repeat(t, repeats, axis=0), self_cache)
            rows = tf.shape(source_mask)[0]
            self.initial_state = (self_cache, tf.range(rows), cross_cache, source_mask)
            # One XLA cluster per step fuses the cache writes and reordering with the small
            # projections; compiled once per (rows, cache length, source) shape.
            self._step = (tf.function(self._cached_step, jit_compile=True, autograph=False)
                          if jit_compile else self._cached_step)
        else:
            self.initial_state = (tf.repeat(encoder_output, repeats, axis=0), source_mask)

    def _cached_step(self, tokens, cache, rows, cross_cache, source_mask, index):
        def reordered():
            return _map(lambda t: tf.gather(t, rows, axis=0), cache)

        if self.jit_compile:
            cache = reordered()
        else:  # without XLA the gather is a full copy: skip it when no row moved
            unchanged = tf.reduce_all(rows == tf.range(tf.shape(rows)[0])) & (
                tf.shape(rows)[0] == tf.shape(tf.nest.flatten(cache)[0])[0])
            cache = tf.cond(unchanged, lambda: cache, reordered)
        logits, cache = self.model.decode(tokens, source_mask, cache, cross_cache, index,
                                          grow_cache=not self.jit_compile)
        return tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32)), cache

    def __call__(self, sequences, index, state):
        """Log-probs (rows, vocab) float32 of the token after `sequences[:, index]`."""
        if self.use_cache:
            cache, rows, cross_cache, source_mask = state
            log_probs, cache = self._step(sequences[:, index: index + 1], cache, rows,
                                          cross_cache, source_mask, index)
            return log_probs, (cache, tf.range(tf.shape(rows)[0]), cross_cache, source_mask)
        # The whole decoder re-runs over the prefix with fresh caches: the baseline that the
        # cache is measured against (the encoder output is still computed once).
        encoder_output, source_mask = state
        prefix = sequences[:, : index + 1]
        self_cache, cross_cache = self.model.initial_cache(encoder_output, index + 1)
        logits, _ = self.model.decode(prefix, source_mask, self_cache, cross_cache, 0)
        return tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32)), state

    def select(self, state, rows, kept=None):
        """The state for the next step: its row i continues the cache row `rows[i]` of this
        step. `kept` (the rows of this step that go on, in the new order; None: all) is given
        when finished sentences leave: the encoder side then shrinks with them."""
        if kept is not None:
            state = self._keep_encoder_side(state, kept)
        return (state[0], rows, *state[2:]) if self.use_cache else state

    def _keep_encoder_side(self, state, kept):
        if self.use_cache:
            cache, rows, cross_cache, source_mask = state
            cross_cache = _map(lambda t: tf.gather(t, kept, axis=0), cross_cache)
            return cache, rows, cross_cache, tf.gather(source_mask, kept, axis=0)
        encoder_output, source_mask = state
        return tf.gather(encoder_output, kept, axis=0), tf.gather(source_mask, kept, axis=0)


def _kept_sentences(active, jit_compile):
    """Which sentences (rows of `active` (n,) bool) the next step computes, active first.

    Leaving the batch costs a copy of the rows that stay (the cache is gathered), so the
    batch shrinks once a quarter of its rows have finished, to exactly the active ones.
    With XLA every new row count is a new compilation, so the count only falls to a power of
    two (32, 16, 8, ...: a handful of shapes), the remaining places filled with finished
    sentences, computed but ignored.
    """
    rows = tf.shape(active)[0]
    count = tf.reduce_sum(tf.cast(active, tf.int32))
    if jit_compile:
        count = tf.minimum(rows, tf.bitwise.left_shift(1, tf.cast(tf.math.ceil(
            tf.math.log(tf.cast(tf.maximum(count, 1), tf.float32)) / tf.math.log(2.0)),
            tf.int32)))
    else:
        count = tf.where(rows - count >= tf.maximum(rows // 4, 1), count, rows)
    order = tf.argsort(tf.cast(tf.logical_not(active), tf.int32), stable=True)
    return order[:count]


def _encode(model, source_ids, jit_compile):
    """The encoder output, with the source padded to a bucketed width under jit_compile."""
    if jit_compile:
        width = tf.shape(source_ids)[1]
        source_ids = tf.pad(source_ids, [[0, 0], [0, _round_up(width, _JIT_SOURCE_BUCKET) - width]])
    return model.encode(source_ids)


def _limits(source_ids, extra_length, max_length, force_length):
    """Per-sentence number of target tokens allowed (batch,) int32, at least 1."""
    source_length = tf.reduce_sum(tf.cast(source_ids != PAD_ID, tf.int32), axis=1)
    limits = tf.minimum(source_length + extra_length, max_length)
    limits = tf.where(force_length > 0, force_length, limits)
    return tf.maximum(limits, 1)


def _trim(ids):
    """Drops the all-PAD trailing columns of ids (..., T)."""
    lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.int32), axis=-1)
    return ids[..., : tf.reduce_max(tf.concat([tf.reshape(lengths, [-1]), [0]], 0))]


def greedy_loop(model, source_ids, extra_length, max_length, min_length, force_length, use_cache,
                jit_compile=False):
    """Greedy decoding. Returns ids (batch, T) int32 and summed log-probs (batch,) float32.

    Arguments as in `decoding.greedy_search`, all tensors; `force_length > 0` masks EOS and
    stops every sentence at exactly that many tokens. A sentence leaves the batch at the step
    it ends (EOS or its length limit): later steps compute only the sentences still going.
    """
    batch = tf.shape(source_ids)[0]
    limits = _limits(source_ids, extra_length, max_length, force_length)
    steps = tf.reduce_max(limits)
    min_length = tf.where(force_length > 0, force_length + 1, min_length)
    encoder_output, source_mask = _encode(model, source_ids, jit_compile)
    stepper = _Stepper(model, encoder_output, source_mask, 1, steps, use_cache, jit_compile)
    sequences = _write_column(tf.zeros([batch, steps + 1], tf.int32), 0, tf.fill([batch], BOS_ID))

    def body(index, sequences, scores, sentences, active, output, output_scores, state):
        # Row i is sentence `sentences[i]`; inactive rows are finished ones kept as padding.
        log_probs, state = stepper(sequences, index, state)
        log_probs += _token_bias(tf.shape(log_probs)[-1], index + 1 >= min_length)[None, :]
        tokens = tf.where(active, tf.argmax(log_probs, axis=-1, output_type=tf.int32), PAD_ID)
        scores += tf.where(active, tf.gather(log_probs, tokens, batch_dims=1), 0.0)
        sequences = _write_column(sequences, index + 1, tokens)
        ends = active & ((tokens == EOS_ID) | (index + 1 >= tf.gather(limits, sentences)))
        ending = tf.where(ends)[:, 0]
        at = tf.gather(sentences, ending)[:, None]
        output = tf.tensor_scatter_nd_update(output, at, tf.gather(sequences, ending))
        output_scores = tf.tensor_scatter_nd_update(output_scores, at, tf.gather(scores, ending))
        active &= tf.logical_not(ends)
        kept = _kept_sentences(active, jit_compile)

        def shrink():
            return (tf.gather(sequences, kept), tf.gather(scores, kept),
                    tf.gather(sentences, kept), tf.gather(active, kept),
                    stepper.select(state, kept, kept))

        def same():
            return sequences, scores, sentences, active, stepper.select(
                state, tf.range(tf.shape(active)[0]))

        sequences, scores, sentences, active, state = tf.cond(
            tf.size(kept) < tf.size(active), shrink, same)
        return index + 1, sequences, scores, sentences, active, output, output_scores, state

    def cond(index, sequences, scores, sentences, active, *_):
        return tf.reduce_any(active)

    loop_vars = (tf.constant(0), sequences, tf.zeros([batch]), tf.range(batch),
                 tf.ones([batch], tf.bool), tf.zeros_like(sequences), tf.zeros([batch]),
                 stepper.initial_state)
    outputs = tf.while_loop(cond, body, loop_vars, maximum_iterations=steps,
                            shape_invariants=_invariants(loop_vars))
    return _trim(outputs[5][:, 1:]), outputs[6]


def _invariants(loop_vars):
    """Shape invariants with every dimension unknown except the trailing static ones."""
    def relax(tensor):
        shape = tensor.shape.as_list()
        if len(shape) <= 1:
            return tf.TensorShape([None] * len(shape))
        # Cache tensors (rows, heads, length, d_k): rows and length vary.
        if len(shape) == 4:
            return tf.TensorShape([None, shape[1], None, shape[3]])
        return tf.TensorShape([None] * len(shape))
    return tf.nest.map_structure(relax, loop_vars)


def beam_loop(model, source_ids, beam_size, alpha, extra_length, max_length, min_length,
              force_length, num_return, use_cache, jit_compile=False):
    """Beam search with finished hypotheses kept apart (as tensor2tensor's `beam_search`).

    Each step expands the alive beams into 2*beam_size candidates: those ending in EOS (or
    reaching the sentence's length limit) compete with the finished pool on length-penalized
    score, the others become the next alive beams on raw log-prob. So a finished hypothesis is
    only ever displaced by a better-scoring finished one. A sentence stops when its limit is
    reached or when its `num_return`-th best finished score beats the best score any alive
    beam could still reach (log-probs only fall, and alpha >= 0 makes the penalty largest at
    the limit). A stopped sentence's pool goes to the output and the sentence leaves the
    batch: later steps compute only the sentences still searching (as CTranslate2 does).

    Returns:
        ids (batch, num_return, T) int32 and length-penalized scores (batch, num_return).
    """
    if num_return is None:
        num_return = beam_size
    batch = tf.shape(source_ids)[0]
    limits = _limits(source_ids, extra_length, max_length, force_length)
    steps = tf.reduce_max(limits)
    min_length = tf.where(force_length > 0, force_length + 1, min_length)
    max_penalty = length_penalty(limits, alpha)
    encoder_output, source_mask = _encode(model, source_ids, jit_compile)
    stepper = _Stepper(model, encoder_output, source_mask, beam_size, steps, use_cache,
                       jit_compile)
    beams = tf.range(beam_size)

    width = steps + 1
    alive_seq = _write_column(tf.zeros([batch, beam_size, width], tf.int32), 0,
                              tf.fill([batch, beam_size], BOS_ID))
    # Only beam 0 is live at first, so the first expansion does not repeat one prefix K times.
    alive_log_probs = tf.tile(
        tf.concat([[0.0], tf.fill([beam_size - 1], NEG_INF)], 0)[None, :], [batch, 1]
    )
    finished_seq = tf.zeros([batch, beam_size, width], tf.int32)
    finished_scores = tf.fill([batch, beam_size], NEG_INF)
    finished_flags = tf.zeros([batch, beam_size], tf.bool)

    def body(index, sentences, active, alive_seq, alive_log_probs, finished_seq,
             finished_scores, finished_flags, output, output_scores, state):
        # Row i of the per-sentence tensors is sentence `sentences[i]`; inactive rows are
        # finished sentences kept as padding (XLA only), whose results are already out.
        count = tf.shape(sentences)[0]
        rows = count * beam_size
        flat_seq = tf.reshape(alive_seq, [rows, width])
        log_probs, state = stepper(flat_seq, index, state)
        vocab = tf.shape(log_probs)[-1]
        log_probs += _token_bias(vocab, index + 1 >= min_length)[None, :]
        candidates = alive_log_probs[:, :, None] + tf.reshape(log_probs, [count, beam_size, vocab])
        top_log_probs, top_ids = tf.math.top_k(
            tf.reshape(candidates, [count, beam_size * vocab]), k=2 * beam_size)
        parents, tokens = top_ids // vocab, top_ids % vocab
        candidate_seq = _write_column(
            tf.gather(alive_seq, parents, batch_dims=1), index + 1, tokens)

        sentence_limits = tf.gather(limits, sentences)
        at_limit = index + 1 >= sentence_limits
        is_eos = tokens == EOS_ID
        ends = ((is_eos | at_limit[:, None]) & active[:, None]
                & (top_log_probs > NEG_INF / 2))

        # Alive: the best beam_size candidates not ending in EOS (there are always enough:
        # each beam contributes at most one EOS candidate to the 2*beam_size).
        _, keep = tf.math.top_k(tf.where(is_eos, NEG_INF, top_log_probs), k=beam_size)
        alive_seq = tf.gather(candidate_seq, keep, batch_dims=1)
        alive_log_probs = tf.gather(top_log_probs, keep, batch_dims=1)
        alive_parents = tf.gather(parents, keep, batch_dims=1)

        # Finished: merge the pool with the candidates that end here, keep the best.
        candidate_scores = tf.where(
            ends, top_log_probs / length_penalty(index + 1, alpha), NEG_INF)
        pool_scores = tf.concat([finished_scores, candidate_scores], axis=1)
        pool_seq = tf.concat([finished_seq, candidate_seq], axis=1)
        pool_flags = tf.concat([finished_flags, ends], axis=1)
        finished_scores, best = tf.math.top_k(pool_scores, k=beam_size)
        finished_seq = tf.gather(pool_seq, best, batch_dims=1)
        finished_flags = tf.gather(pool_flags, best, batch_dims=1)

        best_alive_bound = alive_log_probs[:, 0] / tf.gather(max_penalty, sentences)
        settled = finished_flags[:, num_return - 1] & (
            finished_scores[:, num_return - 1] > best_alive_bound)
        stops = active & (at_limit | settled)
        stopping = tf.where(stops)[:, 0]
        at = tf.gather(sentences, stopping)[:, None]
        output = tf.tensor_scatter_nd_update(output, at, tf.gather(finished_seq, stopping))
        output_scores = tf.tensor_scatter_nd_update(output_scores, at,
                                                    tf.gather(finished_scores, stopping))
        active &= tf.logical_not(stops)
        # The next step's cache rows: each surviving beam's parent row.
        parent_rows = alive_parents + tf.range(count)[:, None] * beam_size
        kept = _kept_sentences(active, jit_compile)

        def shrink():
            kept_rows = tf.reshape(kept[:, None] * beam_size + beams[None, :], [-1])
            gathered = [tf.gather(t, kept) for t in (
                sentences, active, alive_seq, alive_log_probs, finished_seq, finished_scores,
                finished_flags)]
            return (*gathered, stepper.select(
                state, tf.reshape(tf.gather(parent_rows, kept), [-1]), kept_rows))

        def same():
            return (sentences, active, alive_seq, alive_log_probs, finished_seq,
                    finished_scores, finished_flags,
                    stepper.select(state, tf.reshape(parent_rows, [-1])))

        (sentences, active, alive_seq, alive_log_probs, finished_seq, finished_scores,
         finished_flags, state) = tf.cond(tf.size(kept) < count, shrink, same)
        return (index + 1, sentences, active, alive_seq, alive_log_probs, finished_seq,
                finished_scores, finished_flags, output, output_scores, state)

    def cond(index, sentences, active, *_):
        return tf.reduce_any(active)

    loop_vars = (tf.constant(0), tf.range(batch), tf.ones([batch], tf.bool), alive_seq,
                 alive_log_probs, finished_seq, finished_scores, finished_flags,
                 tf.zeros_like(finished_seq), tf.fill([batch, beam_size], NEG_INF),
                 stepper.initial_state)
    outputs = tf.while_loop(cond, body, loop_vars, maximum_iterations=steps,
                            shape_invariants=_invariants(loop_vars))
    output, output_scores = outputs[-3], outputs[-2]
    return _trim(output[:, :num_return, 1:]), output_scores[:, :num_return]
