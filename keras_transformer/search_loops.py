"""The graph-mode search loops behind `keras_transformer.decoding` (paper 6.1).

Both loops are plain TensorFlow (`tf.while_loop`) so they trace into a `tf.function` and export
into a SavedModel. They only use a model's `encode`, `initial_cache` and `decode` methods, so any
object exposing that API (such as a hand-made test model) can be searched.

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
    """One decoding step over `rows` hypotheses, cached (one position) or uncached (prefix).

    The cached state is (self-attention cache, pending row order): reordering after a beam
    step is deferred to the start of the next step, so with `jit_compile` the gather fuses
    into the XLA step with the cache writes instead of being one more full cache copy.
    """

    def __init__(self, model, encoder_output, source_mask, repeats, max_length, use_cache,
                 jit_compile=False):
        self.model = model
        self.use_cache = use_cache
        self.jit_compile = jit_compile
        self.source_mask = tf.repeat(source_mask, repeats, axis=0)
        if use_cache:
            # The encoder-side keys/values are projected once per sentence, then shared by its
            # beams; the self-attention cache starts empty.
            if jit_compile:
                max_length = _round_up(max_length, _JIT_LENGTH_BUCKET)
            self_cache, cross_cache = model.initial_cache(encoder_output, max_length)
            self.cross_cache = _map(lambda t: tf.repeat(t, repeats, axis=0), cross_cache)
            self_cache = _map(lambda t: tf.repeat(t, repeats, axis=0), self_cache)
            rows = tf.shape(tf.nest.flatten(self_cache)[0])[0]
            self.initial_state = (self_cache, tf.range(rows))
            # One XLA cluster per step fuses the cache writes and reordering with the small
            # projections; compiled once per (rows, cache length, source) shape.
            self._step = (tf.function(self._cached_step, jit_compile=True, autograph=False)
                          if jit_compile else self._cached_step)
        else:
            self.encoder_output = tf.repeat(encoder_output, repeats, axis=0)
            self.initial_state = tf.zeros([0], tf.float32)

    def _cached_step(self, tokens, cache, rows, index):
        def reordered():
            return _map(lambda t: tf.gather(t, rows, axis=0), cache)

        if self.jit_compile:
            cache = reordered()
        else:  # without XLA the gather is a full copy: skip it when no beam moved
            unchanged = tf.reduce_all(rows == tf.range(tf.shape(rows)[0]))
            cache = tf.cond(unchanged, lambda: cache, reordered)
        logits, cache = self.model.decode(tokens, self.source_mask, cache, self.cross_cache,
                                          index)
        return tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32)), cache

    def __call__(self, sequences, index, state):
        """Log-probs (rows, vocab) float32 of the token after `sequences[:, index]`."""
        if self.use_cache:
            cache, rows = state
            log_probs, cache = self._step(sequences[:, index: index + 1], cache, rows, index)
            return log_probs, (cache, tf.range(tf.shape(rows)[0]))
        # The whole decoder re-runs over the prefix with fresh caches: the baseline that the
        # cache is measured against (the encoder output is still computed once).
        prefix = sequences[:, : index + 1]
        self_cache, cross_cache = self.model.initial_cache(self.encoder_output, index + 1)
        logits, _ = self.model.decode(prefix, self.source_mask, self_cache, cross_cache, 0)
        return tf.nn.log_softmax(tf.cast(logits[:, -1, :], tf.float32)), state

    def reorder(self, state, rows):
        """Schedules the cache rows of the surviving hypotheses for the next step."""
        return (state[0], rows) if self.use_cache else state


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
    stops every sentence at exactly that many tokens.
    """
    batch = tf.shape(source_ids)[0]
    limits = _limits(source_ids, extra_length, max_length, force_length)
    steps = tf.reduce_max(limits)
    min_length = tf.where(force_length > 0, force_length + 1, min_length)
    encoder_output, source_mask = _encode(model, source_ids, jit_compile)
    stepper = _Stepper(model, encoder_output, source_mask, 1, steps, use_cache, jit_compile)
    sequences = _write_column(tf.zeros([batch, steps + 1], tf.int32), 0, tf.fill([batch], BOS_ID))

    def body(index, sequences, scores, finished, state):
        log_probs, state = stepper(sequences, index, state)
        log_probs += _token_bias(tf.shape(log_probs)[-1], index + 1 >= min_length)[None, :]
        tokens = tf.argmax(log_probs, axis=-1, output_type=tf.int32)
        tokens = tf.where(finished, PAD_ID, tokens)
        chosen = tf.gather(log_probs, tokens, batch_dims=1)
        scores += tf.where(finished, 0.0, chosen)
        sequences = _write_column(sequences, index + 1, tokens)
        finished |= (tokens == EOS_ID) | (index + 1 >= limits)
        return index + 1, sequences, scores, finished, state

    def cond(index, sequences, scores, finished, state):
        return tf.logical_not(tf.reduce_all(finished))

    loop_vars = (tf.constant(0), sequences, tf.zeros([batch]), tf.zeros([batch], tf.bool),
                 stepper.initial_state)
    _, sequences, scores, _, _ = tf.while_loop(
        cond, body, loop_vars, maximum_iterations=steps,
        shape_invariants=_invariants(loop_vars),
    )
    return _trim(sequences[:, 1:]), scores


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
    the limit); a stopped sentence's results are frozen while others in the batch go on.

    Returns:
        ids (batch, num_return, T) int32 and length-penalized scores (batch, num_return).
    """
    if num_return is None:
        num_return = beam_size
    batch = tf.shape(source_ids)[0]
    rows = batch * beam_size
    limits = _limits(source_ids, extra_length, max_length, force_length)
    steps = tf.reduce_max(limits)
    min_length = tf.where(force_length > 0, force_length + 1, min_length)
    max_penalty = length_penalty(limits, alpha)
    encoder_output, source_mask = _encode(model, source_ids, jit_compile)
    stepper = _Stepper(model, encoder_output, source_mask, beam_size, steps, use_cache,
                       jit_compile)

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
    done = tf.zeros([batch], tf.bool)
    row_offsets = tf.range(batch)[:, None] * beam_size

    def body(index, alive_seq, alive_log_probs, finished_seq, finished_scores, finished_flags,
             done, state):
        flat_seq = tf.reshape(alive_seq, [rows, width])
        log_probs, state = stepper(flat_seq, index, state)
        vocab = tf.shape(log_probs)[-1]
        log_probs += _token_bias(vocab, index + 1 >= min_length)[None, :]
        candidates = alive_log_probs[:, :, None] + tf.reshape(log_probs, [batch, beam_size, vocab])
        top_log_probs, top_ids = tf.math.top_k(
            tf.reshape(candidates, [batch, beam_size * vocab]), k=2 * beam_size)
        parents, tokens = top_ids // vocab, top_ids % vocab
        candidate_seq = _write_column(
            tf.gather(alive_seq, parents, batch_dims=1), index + 1, tokens)

        active = (index < limits) & tf.logical_not(done)
        at_limit = index + 1 >= limits
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

        best_alive_bound = alive_log_probs[:, 0] / max_penalty
        settled = finished_flags[:, num_return - 1] & (
            finished_scores[:, num_return - 1] > best_alive_bound)
        done = done | at_limit | settled
        state = stepper.reorder(state, tf.reshape(alive_parents + row_offsets, [rows]))
        return (index + 1, alive_seq, alive_log_probs, finished_seq, finished_scores,
                finished_flags, done, state)

    def cond(index, *loop_vars):
        return tf.logical_not(tf.reduce_all(loop_vars[-2]))

    loop_vars = (tf.constant(0), alive_seq, alive_log_probs, finished_seq, finished_scores,
                 finished_flags, done, stepper.initial_state)
    outputs = tf.while_loop(cond, body, loop_vars, maximum_iterations=steps,
                            shape_invariants=_invariants(loop_vars))
    finished_seq, finished_scores = outputs[3], outputs[4]
    return _trim(finished_seq[:, :num_return, 1:]), finished_scores[:, :num_return]
