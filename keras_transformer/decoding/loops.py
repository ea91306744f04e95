"""The graph-mode search loops behind `keras_transformer.decoding.search` (paper 6.1).

Both loops are plain TensorFlow (`tf.while_loop`) so they trace into a `tf.function` and export
into a SavedModel. A float32 `Transformer` (or its `InferenceModel`) runs its steps in the
serving layout (`inference_decoder`); any other object with `encode`, `initial_cache` and
`decode` (with `Transformer.decode`'s `grow_cache` argument), such as a hand-made test model or
a mixed-precision Transformer, is searched through those methods.

Finished sentences leave the batch (`stepper`). With `jit_compile` the steps run inside
XLA, a segment of steps per launch, and the batch shrinks between segments.

Conventions: token buffers hold BOS in column 0 and the generated token of step `i` in column
`i + 1`; the batch*beam axis is batch-major (row `b * beam_size + k`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.decoding.sampling import NEG_INF, Sampling, choose_tokens, step_uniforms
from keras_transformer.decoding.stepper import (
    JIT_LENGTH_BUCKET,
    Stepper,
    encode,
    kept_sentences,
    round_up,
    write_column,
)
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = ["BOS_ID", "EOS_ID", "NEG_INF", "PAD_ID", "UNK_ID", "beam_loop", "greedy_loop",
           "length_penalty"]
# NEG_INF (`decoding.sampling`): finite rather than -inf: dead hypotheses keep getting
# log-probs added, and -inf arithmetic (-inf - -inf) would produce NaNs that top_k orders
# arbitrarily.


def length_penalty(length, alpha):
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016), float32."""
    return tf.pow((5.0 + tf.cast(length, tf.float32)) / 6.0, tf.cast(alpha, tf.float32))


def _token_biases(vocab_size):
    """Additive log-prob biases (2, vocab): row 1 forbids PAD and BOS, row 0 EOS as well
    (before `min_length`). Built once per search; a step picks its row.

    Emitting PAD would make the 0-padded output ambiguous; BOS is never a target token.
    """
    ids = tf.range(vocab_size)
    forbidden = (ids == PAD_ID) | (ids == BOS_ID)
    forbidden = tf.stack([forbidden | (ids == EOS_ID), forbidden])
    return tf.where(forbidden, tf.constant(NEG_INF, tf.float32), 0.0)


def _token_bias(biases, log_probs, index, min_length):
    """The row of `biases` (from `_token_biases`, or None to build them for `log_probs`'
    width) for the token at step `index`: (1, vocab)."""
    if biases is None:
        biases = _token_biases(tf.shape(log_probs)[-1])
    return tf.gather(biases, tf.cast(index + 1 >= min_length, tf.int32))[None, :]


def _prefix_steps(prefix):
    """The steps that may force a token: one past the last non-PAD column of `prefix`
    (batch, P), int32 scalar (0 for an all-PAD prefix: a search given no prefix at all)."""
    columns = tf.range(1, tf.shape(prefix)[1] + 1)[None, :]
    return tf.reduce_max(tf.concat([
        tf.reshape(tf.where(prefix != PAD_ID, columns, 0), [-1]), [0]], 0))


def _force_prefix(log_probs, prefix, index, prefix_steps, repeats=1):
    """`log_probs` (rows, vocab) with every token but the prefix's forbidden on the rows whose
    forced prefix (rows / repeats, P) int32, 0-padded, P >= 1, reaches step `index` (each
    prefix row serves `repeats` consecutive rows: a sentence's beams). The prefix token keeps
    its own log-probability: forcing it costs the hypothesis exactly that much.

    Past `prefix_steps` (`_prefix_steps`) no row is forced and the step skips the masking, so
    a search given an all-PAD prefix (the SavedModel's shared searches, when a request has
    none) does no masking work beyond one `tf.cond` a step, and gives the same tokens.
    """
    def force():
        rows = prefix if isinstance(repeats, int) and repeats == 1 else tf.repeat(
            prefix, repeats, axis=0)
        width = tf.shape(rows)[1]
        column = tf.gather(rows, tf.minimum(index, width - 1), axis=1)
        forced = tf.where(index < width, column, PAD_ID)[:, None]
        allowed = (forced == PAD_ID) | (tf.range(tf.shape(log_probs)[-1])[None, :] == forced)
        return tf.where(allowed, log_probs, NEG_INF)
    return tf.cond(index < prefix_steps, force, lambda: log_probs)


def _limits(source_ids, extra_length, max_length, force_length, prefix=None):
    """Per-sentence number of target tokens allowed (batch,) int32, at least 1 (and at
    least one more than a forced prefix)."""
    source_length = tf.reduce_sum(tf.cast(source_ids != PAD_ID, tf.int32), axis=1)
    limits = tf.minimum(source_length + extra_length, max_length)
    if prefix is not None:
        prefix_length = tf.reduce_sum(tf.cast(prefix != PAD_ID, tf.int32), axis=1)
        limits = tf.maximum(limits, prefix_length + 1)
    limits = tf.where(force_length > 0, force_length, limits)
    return tf.maximum(limits, 1)


def _trim(ids):
    """Drops the all-PAD trailing columns of ids (..., T)."""
    lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.int32), axis=-1)
    return ids[..., : tf.reduce_max(tf.concat([tf.reshape(lengths, [-1]), [0]], 0))]


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


def _scatter_rows(outputs, sentences, which, values):
    """`outputs` (tuple of (batch, ...)) with the rows `which` (n,) bool of `values` (tuple of
    (n, ...)) written at their sentences (n,)."""
    picked = tf.where(which)[:, 0]
    at = tf.gather(sentences, picked)[:, None]
    return tuple(tf.tensor_scatter_nd_update(output, at, tf.gather(value, picked))
                 for output, value in zip(outputs, values, strict=True))


def _shrink(stepper, rows, state, kept, parents, beam_size):
    """Keeps the sentences `kept` of the per-sentence `rows` and of the stepper state; each
    kept hypothesis continues its cache row in `parents` (n * beam_size,)."""
    kept_rows = tf.reshape(kept[:, None] * beam_size + tf.range(beam_size)[None, :], [-1])
    rows = tuple(tf.gather(tensor, kept) for tensor in rows)
    return rows, stepper.select(state, tf.gather(parents, kept_rows), kept_rows)


def _search(step, results, rows, outputs, stepper, steps, beam_size, jit_compile):
    """Runs `step` until every sentence has stopped, the finished ones leaving the batch.

    Args:
        step: (index, rows, state) -> (rows, stopped (n,) bool, parents (n * beam_size,)
            int32, state): one step; `stopped` are the sentences that stopped at it, and
            hypothesis i of the next step continues the cache row `parents[i]`.
        results: rows -> tuple of per-sentence tensors (n, ...), written to `outputs` when a
            sentence stops.
        rows: per-sentence tensors (n, ...), the first two `sentences` (n,) int32 (the batch
            index of each row) and `active` (n,) bool. Inactive rows are finished sentences
            kept as padding, whose results are already out.
        outputs: tuple of (batch, ...) tensors.
        stepper: the `Stepper` whose state `step` advances.
        steps: the most steps any sentence may take.
        beam_size: hypotheses per sentence.
        jit_compile: run the steps as XLA-compiled segments.

    Returns:
        `outputs` with every sentence's results.
    """
    if jit_compile:
        return _search_compiled(step, results, rows, outputs, stepper, steps, beam_size)

    def body(index, rows, outputs, state):
        rows, stopped, parents, state = step(index, rows, state)
        outputs = _scatter_rows(outputs, rows[0], stopped, results(rows))
        kept = kept_sentences(rows[1], powers_of_two=False)
        rows, state = tf.cond(
            tf.size(kept) < tf.size(rows[1]),
            lambda: _shrink(stepper, rows, state, kept, parents, beam_size),
            lambda: (rows, stepper.select(state, parents)))
        return index + 1, rows, outputs, state

    loop_vars = (tf.constant(0), rows, outputs, stepper.initial_state)
    return tf.while_loop(lambda index, rows, *_: tf.reduce_any(rows[1]), body, loop_vars,
                         maximum_iterations=steps, shape_invariants=_invariants(loop_vars))[2]


def _search_compiled(step, results, rows, outputs, stepper, steps, beam_size):
    """`_search` with the steps run inside XLA, a segment at a time.

    A TF graph executes each of the few hundred small ops of a step separately, which costs
    more than their arithmetic at serving batch sizes; one XLA computation per segment of
    steps does not. A segment ends once half of its sentences have stopped: the batch then
    shrinks (outside XLA) to the next power of two, so the compiled shapes stay a handful.
    """
    @tf.function(jit_compile=True, autograph=False)
    def segment(index, rows, state):
        half = tf.shape(rows[1])[0] // 2

        def go_on(index, rows, state):
            return (index < steps) & (tf.reduce_sum(tf.cast(rows[1], tf.int32)) > half)

        def body(index, rows, state):
            rows, _, parents, state = step(index, rows, state)
            return index + 1, rows, stepper.select(state, parents)

        return tf.while_loop(go_on, body, (index, rows, stepper.settle(state)))

    def body(index, rows, outputs, state):
        index, rows, state = segment(index, rows, state)
        active = rows[1]
        # Idempotent for sentences written after an earlier segment: their results are final.
        outputs = _scatter_rows(outputs, rows[0], tf.logical_not(active), results(rows))
        kept = kept_sentences(active, powers_of_two=True)
        rows, state = tf.cond(
            (tf.size(kept) < tf.size(active)) & tf.reduce_any(active),
            lambda: _shrink(stepper, rows, state, kept, stepper.pending_rows(state), beam_size),
            lambda: (rows, state))
        return index, rows, outputs, state

    loop_vars = (tf.constant(0), rows, outputs, stepper.initial_state)
    return tf.while_loop(
        lambda index, rows, *_: tf.reduce_any(rows[1]) & (index < steps), body, loop_vars,
        shape_invariants=_invariants(loop_vars))[2]


def _setup(model, source_ids, beam_size, extra_length, max_length, force_length, use_cache,
           jit_compile, reorders=True, prefix=None):
    """(limits (batch,), steps, token buffer width, stepper) of one search."""
    limits = _limits(source_ids, extra_length, max_length, force_length, prefix)
    steps = tf.reduce_max(limits)
    # Under XLA the cache and the token buffers have a bucketed length (fewer shapes).
    length = round_up(steps, JIT_LENGTH_BUCKET) if jit_compile else steps
    encoder_output, source_mask = encode(model, source_ids, bucketed=jit_compile)
    stepper = Stepper(model, encoder_output, source_mask, beam_size, length, use_cache,
                      fixed_length=jit_compile, reorders=reorders)
    return limits, steps, length + 1, stepper


def greedy_loop(model, source_ids, extra_length, max_length, min_length, force_length, use_cache,
                jit_compile=False, prefix=None, sampling: Sampling | None = None, seeds=None):
    """Greedy decoding, or random sampling. Returns ids (batch, T) int32 and summed
    log-probs (batch,) float32 (the model's, whatever the sampling temperature).

    Arguments as in `decoding.greedy_search`, all tensors; `force_length > 0` masks EOS and
    stops every sentence at exactly that many tokens. A sentence leaves the batch at the step
    it ends (EOS or its length limit): later steps compute only the sentences still going.
    `prefix` (batch, P >= 1) int32, 0-padded: tokens forced at the first steps. `sampling`
    draws each token (`decoding.sampling`) with the uniforms of `seeds` (batch,) uint32.
    """
    jit_compile = jit_compile and use_cache
    batch = tf.shape(source_ids)[0]
    min_length = tf.where(force_length > 0, force_length + 1, min_length)
    limits, steps, width, stepper = _setup(model, source_ids, 1, extra_length, max_length,
                                           force_length, use_cache, jit_compile, reorders=False,
                                           prefix=prefix)

    vocab_size = stepper.vocab_size
    biases = None if vocab_size is None else _token_biases(vocab_size)
    prefix_steps = None if prefix is None else _prefix_steps(prefix)

    def step(index, rows, state):
        sentences, active, sequences, scores, sentence_limits, *extras = rows
        log_probs, state = stepper(sequences, index, state)
        log_probs += _token_bias(biases, log_probs, index, min_length)
        if prefix is not None:
            log_probs = _force_prefix(log_probs, extras[0], index, prefix_steps)
        if sampling is None:
            chosen = tf.argmax(log_probs, axis=-1, output_type=tf.int32)
        else:
            # The uniforms are computed only where a token is drawn (not at top_k 1).
            chosen = choose_tokens(log_probs, lambda: step_uniforms(extras[-1], index), sampling,
                                   compiled=jit_compile)
        tokens = tf.where(active, chosen, PAD_ID)
        scores += tf.where(active, tf.gather(log_probs, tokens, batch_dims=1), 0.0)
        sequences = write_column(sequences, index + 1, tokens)
        ends = active & ((tokens == EOS_ID) | (index + 1 >= sentence_limits))
        rows = (sentences, active & tf.logical_not(ends), sequences, scores, sentence_limits,
                *extras)
        return rows, ends, tf.range(tf.shape(sentences)[0]), state

    sequences = write_column(tf.zeros([batch, width], tf.int32), 0, tf.fill([batch], BOS_ID))
    extras = (() if prefix is None else (prefix,)) + (() if sampling is None else (seeds,))
    rows = (tf.range(batch), tf.ones([batch], tf.bool), sequences, tf.zeros([batch]), limits,
            *extras)
    outputs = (tf.zeros_like(sequences), tf.zeros([batch]))
    output, output_scores = _search(step, lambda rows: rows[2:4], rows, outputs, stepper, steps,
                                    1, jit_compile)
    return _trim(output[:, 1:]), output_scores


def beam_loop(model, source_ids, beam_size, alpha, extra_length, max_length, min_length,
              force_length, num_return, use_cache, jit_compile=False, prefix=None):
    """Beam search with finished hypotheses kept apart (as tensor2tensor's `beam_search`).

    Each step expands the alive beams into 2*beam_size candidates: those ending in EOS (or
    reaching the sentence's length limit) compete with the finished pool on length-penalized
    score, the others become the next alive beams on raw log-prob. So a finished hypothesis is
    only ever displaced by a better-scoring finished one. A sentence stops when its limit is
    reached or when its `num_return`-th best finished score beats the best score any alive
    beam could still reach (log-probs only fall, and alpha >= 0 makes the penalty largest at
    the limit). A stopped sentence's pool goes to the output and the sentence leaves the
    batch: later steps compute only the sentences still searching (as CTranslate2 does).

    `num_return` is an int, None (all beam_size) or a scalar int32 tensor in [1, beam_size]
    (the SavedModel's one beam search serves 1-best and n-best signatures alike).

    Returns:
        ids (batch, num_return, T) int32 and length-penalized scores (batch, num_return).
    """
    jit_compile = jit_compile and use_cache
    batch = tf.shape(source_ids)[0]
    min_length = tf.where(force_length > 0, force_length + 1, min_length)
    limits, steps, width, stepper = _setup(model, source_ids, beam_size, extra_length,
                                           max_length, force_length, use_cache, jit_compile,
                                           prefix=prefix)

    vocab_size = stepper.vocab_size
    biases = None if vocab_size is None else _token_biases(vocab_size)
    prefix_steps = None if prefix is None else _prefix_steps(prefix)
    # The length penalty of a hypothesis ending at each step (index + 1 tokens).
    penalties = length_penalty(tf.range(1, steps + 1), alpha)

    def step(index, rows, state):
        (sentences, active, alive_seq, alive_log_probs, finished_seq, finished_scores,
         finished_flags, sentence_limits, max_penalty, *extras) = rows
        # From shapes, so that under XLA the beam size is a compile-time constant (top_k's k).
        count, beams = tf.shape(alive_log_probs)[0], tf.shape(alive_log_probs)[1]
        log_probs, state = stepper(tf.reshape(alive_seq, [count * beams, width]), index, state)
        vocab = tf.shape(log_probs)[-1]
        log_probs += _token_bias(biases, log_probs, index, min_length)
        if prefix is not None:
            log_probs = _force_prefix(log_probs, extras[0], index, prefix_steps, beams)
        candidates = alive_log_probs[:, :, None] + tf.reshape(log_probs, [count, beams, vocab])
        top_log_probs, top_ids = tf.math.top_k(
            tf.reshape(candidates, [count, beams * vocab]), k=2 * beams)
        parents, tokens = top_ids // vocab, top_ids % vocab
        candidate_seq = write_column(
            tf.gather(alive_seq, parents, batch_dims=1), index + 1, tokens)

        at_limit = index + 1 >= sentence_limits
        is_eos = tokens == EOS_ID
        ends = ((is_eos | at_limit[:, None]) & active[:, None]
                & (top_log_probs > NEG_INF / 2))

        # Alive: the best beam_size candidates not ending in EOS (there are always enough:
        # each beam contributes at most one EOS candidate to the 2*beam_size).
        _, keep = tf.math.top_k(tf.where(is_eos, NEG_INF, top_log_probs), k=beams)
        alive_seq = tf.gather(candidate_seq, keep, batch_dims=1)
        alive_log_probs = tf.gather(top_log_probs, keep, batch_dims=1)
        alive_parents = tf.gather(parents, keep, batch_dims=1)

        # Finished: merge the pool with the candidates that end here, keep the best.
        candidate_scores = tf.where(
            ends, top_log_probs / penalties[index], NEG_INF)
        pool_scores = tf.concat([finished_scores, candidate_scores], axis=1)
        pool_seq = tf.concat([finished_seq, candidate_seq], axis=1)
        pool_flags = tf.concat([finished_flags, ends], axis=1)
        finished_scores, best = tf.math.top_k(pool_scores, k=beams)
        finished_seq = tf.gather(pool_seq, best, batch_dims=1)
        finished_flags = tf.gather(pool_flags, best, batch_dims=1)

        last = (beams if num_return is None else num_return) - 1
        best_alive_bound = alive_log_probs[:, 0] / max_penalty
        settled = (tf.gather(finished_flags, last, axis=1)
                   & (tf.gather(finished_scores, last, axis=1) > best_alive_bound))
        stops = active & (at_limit | settled)
        rows = (sentences, active & tf.logical_not(stops), alive_seq, alive_log_probs,
                finished_seq, finished_scores, finished_flags, sentence_limits, max_penalty,
                *extras)
        # The next step's cache rows: each surviving beam's parent row.
        parent_rows = alive_parents + tf.range(count)[:, None] * beams
        return rows, stops, tf.reshape(parent_rows, [-1]), state

    alive_seq = write_column(tf.zeros([batch, beam_size, width], tf.int32), 0,
                             tf.fill([batch, beam_size], BOS_ID))
    # Only beam 0 is live at first, so the first expansion does not repeat one prefix K times.
    alive_log_probs = tf.tile(
        tf.concat([[0.0], tf.fill([beam_size - 1], NEG_INF)], 0)[None, :], [batch, 1])
    finished_scores = tf.fill([batch, beam_size], NEG_INF)
    rows = (tf.range(batch), tf.ones([batch], tf.bool), alive_seq, alive_log_probs,
            tf.zeros_like(alive_seq), finished_scores, tf.zeros([batch, beam_size], tf.bool),
            limits, length_penalty(limits, alpha), *(() if prefix is None else (prefix,)))
    outputs = (tf.zeros_like(alive_seq), finished_scores)
    output, output_scores = _search(step, lambda rows: rows[4:6], rows, outputs, stepper,
                                    steps, beam_size, jit_compile)
    keep = beam_size if num_return is None else num_return
    return _trim(output[:, :keep, 1:]), output_scores[:, :keep]
