"""The SavedModel's signatures beyond strings: n-best details, forced prefixes, sampling and
scoring given pairs (forced decoding), with the meaning of `decoding.results`.

TF2 signatures have no optional inputs, so each capability is a signature of its own (the
three original ones, `serving_default`, `translate` and `translate_nbest`, are unchanged):

    translate_details: inputs (N,), beam_size, alpha -> outputs (N, K), scores, log_probs,
        finished (N, K); pieces string and token_log_probs float32 (N, K, T) (EOS included
        as "</s>" when finished, "" and 0 after the end); alignments string (N, K); truncated
        bool (N,). K = beam_size (1: greedy).
    translate_prefix: inputs (N,), prefixes (N,) (text the output must start with; "" for
        none), beam_size, alpha -> outputs, scores, log_probs, finished (N,), truncated (N,).
    sample: inputs (N,), line_indices int64 (N,), seed int64, top_k int32, top_p float32,
        temperature float32, alpha -> outputs, scores, log_probs, finished, truncated (N,);
        seeded per line as `decoding.sampling` (top_k 0: the whole vocabulary).
    score: inputs (N,), targets (N,), alpha -> log_probs, scores (N,), pieces,
        token_log_probs (N, T), alignments (N,), truncated, target_truncated (N,).

Inputs over `max_input_tokens` are truncated and flagged (`truncated`); splitting long lines
into sentences is the Python API's and the command line's job. Empty inputs give empty
outputs, score 0.
"""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.decoding.alignment import DEFAULT_SHIFT, DEFAULT_TENSION
from keras_transformer.decoding.forced import forced_pass
from keras_transformer.decoding.loops import length_penalty
from keras_transformer.decoding.sampling import Sampling, line_seeds
from keras_transformer.decoding.search import (
    CHARS_PER_TOKEN,
    DEFAULT_ALPHA,
    beam_search,
    clean_texts,
    encode_texts,
    greedy_search,
)
from keras_transformer.serving.signature_ops import (
    map_chunks,
    pad_last,
    pieces_of,
    word_alignments,
)
from pipelines.constants import EOS_ID, PAD_ID

__all__ = ["DetailedSignatures"]

MAX_BEAM_SIZE = 16
MAX_ALPHA = 10.0
_STRINGS = tf.TensorSpec([None], tf.string, name="inputs")
_PREFIXES = tf.TensorSpec([None], tf.string, name="prefixes")
_TARGETS = tf.TensorSpec([None], tf.string, name="targets")
_LINES = tf.TensorSpec([None], tf.int64, name="line_indices")
_SEED = tf.TensorSpec([], tf.int64, name="seed")
_TOP_K = tf.TensorSpec([], tf.int32, name="top_k")
_TOP_P = tf.TensorSpec([], tf.float32, name="top_p")
_TEMPERATURE = tf.TensorSpec([], tf.float32, name="temperature")
_BEAM = tf.TensorSpec([], tf.int32, name="beam_size")
_ALPHA = tf.TensorSpec([], tf.float32, name="alpha")
_SOURCE = tf.TensorSpec([None, None], tf.int32, name="source_ids")
_PREFIX_IDS = tf.TensorSpec([None, None], tf.int32, name="prefix_ids")
_NUM_RETURN = tf.TensorSpec([], tf.int32, name="num_return")
_TARGET_IDS = tf.TensorSpec([None, None], tf.int32, name="target_ids")
_SEEDS = tf.TensorSpec([None], tf.uint32, name="seeds")


def clip_beam_and_alpha(beam_size, alpha):
    """beam_size in [1, MAX_BEAM_SIZE]; alpha in [0, MAX_ALPHA] (NaN/inf: the default)."""
    beam_size = tf.clip_by_value(beam_size, 1, MAX_BEAM_SIZE)
    alpha = tf.where(tf.math.is_finite(alpha), tf.clip_by_value(alpha, 0.0, MAX_ALPHA),
                     DEFAULT_ALPHA)
    return beam_size, alpha


class DetailedSignatures:
    """Mixed into `serving.saved_model.TranslationModule` (which holds `model` (the model or
    its `InferenceModel`), `tokenizer`, `max_input_tokens`, `max_extra_length`,
    `max_output_tokens`, `chunk_size`, `jit_compile` and `alignment_layer`)."""

    @tf.function(input_signature=[_STRINGS, _BEAM, _ALPHA], autograph=False)
    def translate_details(self, inputs, beam_size, alpha):
        """The beam_size best hypotheses per text with scores, pieces, token log-probs and
        alignments."""
        beam_size, alpha = clip_beam_and_alpha(beam_size, alpha)

        def search(source, rows):
            return tf.cond(tf.equal(beam_size, 1),
                           lambda: self._greedy_ids(source),
                           lambda: self._beam_ids(source, beam_size, alpha))
        return self._decode(inputs, search, beam_size, alpha, details=True)

    @tf.function(input_signature=[_STRINGS, _PREFIXES, _BEAM, _ALPHA], autograph=False)
    def translate_prefix(self, inputs, prefixes, beam_size, alpha):
        """The best translation starting with each prefix (forced), with its scores."""
        beam_size, alpha = clip_beam_and_alpha(beam_size, alpha)
        prefix_ids = tf.cast(self.tokenizer.tokenize(
            clean_texts(tf.reshape(prefixes, [-1]), CHARS_PER_TOKEN * self.max_output_tokens)
        )[:, : self.max_output_tokens - 1], tf.int32)

        def search(source, rows):
            prefix = tf.gather(prefix_ids, rows).to_tensor()
            return tf.cond(tf.equal(beam_size, 1),
                           lambda: self._greedy_ids(source, prefix=prefix),
                           lambda: self._beam_ids(source, beam_size, alpha, 1, prefix))
        return self._best(self._decode(inputs, search, 1, alpha))

    @tf.function(input_signature=[_STRINGS, _LINES, _SEED, _TOP_K, _TOP_P, _TEMPERATURE,
                                  _ALPHA], autograph=False)
    def sample(self, inputs, line_indices, seed, top_k, top_p, temperature, alpha):
        """A random translation per text, drawn with the line's seed."""
        _, alpha = clip_beam_and_alpha(tf.constant(1), alpha)
        sampling = Sampling(
            top_k=tf.maximum(top_k, 0),
            top_p=tf.where(tf.math.is_finite(top_p), tf.clip_by_value(top_p, 1e-6, 1.0), 1.0),
            temperature=tf.where(tf.math.is_finite(temperature) & (temperature > 0),
                                 temperature, 1.0), seed=seed)
        seeds = line_seeds(seed, line_indices)

        def search(source, rows):
            return self._greedy_ids(source, sampling=sampling, seeds=tf.gather(seeds, rows))
        return self._best(self._decode(inputs, search, 1, alpha))

    @tf.function(input_signature=[_STRINGS, _TARGETS, _ALPHA], autograph=False)
    def score(self, inputs, targets, alpha):
        """The model's scores of given translations (forced decoding, EOS included)."""
        _, alpha = clip_beam_and_alpha(tf.constant(1), alpha)
        cleaned = clean_texts(tf.reshape(targets, [-1]),
                              CHARS_PER_TOKEN * self.max_output_tokens + 1)
        pieces = self.tokenizer.tokenize(cleaned)
        target_truncated = pieces.row_lengths() + 1 > self.max_output_tokens
        eos = tf.RaggedTensor.from_tensor(tf.fill([pieces.nrows(), 1], EOS_ID))
        target_ids = tf.concat([tf.cast(pieces[:, : self.max_output_tokens - 1], tf.int32),
                                eos], axis=1)
        max_length = tf.cast(tf.reduce_max(tf.concat([target_ids.row_lengths(), [0]], 0)),
                             tf.int32)

        def search(source, rows):
            ids = tf.gather(target_ids, rows).to_tensor()
            return ids[:, None, :], None
        results = self._decode(inputs, search, 1, alpha, details=True, forced=True,
                               max_length=max_length, blank_empty=False)
        return {"log_probs": results["log_probs"][:, 0], "scores": results["scores"][:, 0],
                "pieces": results["pieces"][:, 0], "alignments": results["alignments"][:, 0],
                "token_log_probs": results["token_log_probs"][:, 0],
                "truncated": results["truncated"],
                "target_truncated": target_truncated | (tf.strings.length(
                    cleaned, unit="UTF8_CHAR") > CHARS_PER_TOKEN * self.max_output_tokens)}

    # --- shared ---

    # The searches that several signatures run alike are functions of their own, which each
    # of those signatures calls: traced once per export, not once per signature (tracing is
    # most of an export's time), and stored once: one greedy search (translate,
    # translate_nbest, translate_details, translate_prefix at beam size 1, and sample: greedy
    # search is sampling with top_k 1), one beam search (the same four signatures; 1-best or
    # all beam_size hypotheses) and one forced pass (translate_details, score). The searches
    # take a forced prefix, all PAD when a request has none (a search then skips the
    # prefix's masking: the same tokens; serving speed measured unchanged, BENCHMARKS.md).
    # Each is also kept a function of its own after a load (`_noinline`): TensorFlow
    # optimizes a function when it first runs it, and an inlined search would be optimized
    # again inside each signature that a process calls; kept apart, it is optimized once
    # per process (the first calls of all seven signatures after a load: 30% less CPU time,
    # the steady speed no slower; BENCHMARKS.md).

    @tf.function(input_signature=[_SOURCE, _PREFIX_IDS, _SEEDS, _TOP_K, _TOP_P, _TEMPERATURE],
                 autograph=False, experimental_attributes={"_noinline": True})
    def _greedy_search(self, source_ids, prefix_ids, seeds, top_k, top_p, temperature):
        """greedy_search (top_k 1) or sampling of a 0-padded chunk (n, S) with forced prefixes
        (n, P) (0-padded; all PAD: none) and per-sentence seeds (n,) uint32: ids (n, T),
        summed log-probs (n,). `decoding.sampling.choose_tokens` takes the argmax at top_k 1,
        so greedy search is sampling with top_k 1, the same tokens as without sampling."""
        sampling = Sampling(top_k=top_k, top_p=top_p, temperature=temperature,
                            seed=tf.constant(0, tf.int64))
        return greedy_search(self.model, source_ids, extra_length=self.max_extra_length,
                             max_length=self.max_output_tokens, jit_compile=self.jit_compile,
                             prefix_ids=prefix_ids, sampling=sampling, seeds=seeds)

    @tf.function(input_signature=[_SOURCE, _BEAM, _ALPHA, _PREFIX_IDS, _NUM_RETURN],
                 autograph=False, experimental_attributes={"_noinline": True})
    def _beam_search(self, source_ids, beam_size, alpha, prefix_ids, num_return):
        """beam_search of a 0-padded chunk (n, S) with forced prefixes (n, P) (all PAD: none)
        returning the num_return (in [1, beam_size]) best hypotheses: ids (n, num_return, T)
        and length-penalized scores (n, num_return), best first."""
        return beam_search(self.model, source_ids, beam_size=beam_size, alpha=alpha,
                           extra_length=self.max_extra_length,
                           max_length=self.max_output_tokens,
                           num_return=tf.clip_by_value(num_return, 1, beam_size),
                           jit_compile=self.jit_compile, prefix_ids=prefix_ids)

    @tf.function(input_signature=[_SOURCE, _TARGET_IDS], autograph=False,
                 experimental_attributes={"_noinline": True})
    def _forced_pass(self, source_ids, target_ids):
        """forced_pass of sources (n, S) and target ids (n, T) (EOS included, 0-padded):
        token log-probs (n, T) and the alignment layer's attention (n, T, S)."""
        model = getattr(self.model, "model", self.model)  # the Transformer of an InferenceModel
        layer = self.alignment_layer % len(model.decoder_layers)
        return forced_pass(model, source_ids, target_ids, layer)

    @staticmethod
    def _no_prefix(source):
        """The prefix (n, 1) of a search that forces none: all PAD."""
        return tf.zeros([tf.shape(source)[0], 1], tf.int32)

    def _greedy_ids(self, source, prefix=None, sampling=None, seeds=None):
        """ids (n, 1, T) and summed log-probs (n, 1) of greedy search, or of `sampling` with
        `seeds` (n,)."""
        prefix = self._no_prefix(source) if prefix is None else prefix
        if sampling is None:
            ids, log_probs = self._greedy_search(
                source, prefix, tf.zeros([tf.shape(source)[0]], tf.uint32), tf.constant(1),
                tf.constant(1.0), tf.constant(1.0))
        else:
            ids, log_probs = self._greedy_search(source, prefix, seeds, sampling.top_k,
                                                 sampling.top_p, sampling.temperature)
        return ids[:, None, :], log_probs[:, None]

    def _beam_ids(self, source, beam_size, alpha, num_return=None, prefix=None):
        """ids (n, K, T) and summed log-probs (n, K), best first; K = num_return (default
        beam_size)."""
        ids, scores = self._beam_search(
            source, beam_size, alpha, self._no_prefix(source) if prefix is None else prefix,
            beam_size if num_return is None else tf.constant(num_return, tf.int32))
        lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.int32), axis=-1)
        return ids, scores * length_penalty(lengths, alpha)

    def _truncated(self, texts):
        """bool (N,): the text has more than max_input_tokens tokens (EOS included) or more
        characters than the cleaning keeps."""
        limit = CHARS_PER_TOKEN * self.max_input_tokens
        kept = clean_texts(texts, limit)  # what `encode_texts` tokenizes
        lost_chars = kept != clean_texts(texts, 2**31 - 1)
        tokens = self.tokenizer.tokenize(kept).row_lengths() + 1
        return lost_chars | (tokens > self.max_input_tokens)

    def _decode(self, inputs, search, width, alpha, details=False, forced=False,
                max_length=None, blank_empty=True):
        """Decodes `inputs` in chunks with `search(source, rows) -> (ids (n, K, T),
        log_probs (n, K) or None: forced)`; K = `width`. Returns the signature's outputs;
        `blank_empty`: empty inputs give empty outputs, score 0 (not when scoring pairs)."""
        texts = tf.reshape(inputs, [-1])
        sources = encode_texts(self.tokenizer, texts, self.max_input_tokens)
        order = tf.argsort(sources.row_lengths(), stable=True)
        length = self.max_output_tokens if max_length is None else max_length

        def compute(rows):
            source = tf.gather(sources, rows).to_tensor()
            ids, log_probs = search(source, rows)
            count, hypotheses = tf.shape(ids)[0], tf.shape(ids)[1]
            flat = tf.reshape(ids, [count * hypotheses, -1])
            outputs = [tf.reshape(tf.strings.unicode_transcode(
                self.tokenizer.detokenize(flat), "UTF-8", "UTF-8", errors="replace"),
                [count, hypotheses])]
            if details:
                hypothesis_sources = tf.repeat(source, hypotheses, axis=0)  # (n * K, S)
                token_log_probs, attention = self._forced_pass(hypothesis_sources, flat)
                alignments = word_alignments(self.tokenizer, attention, hypothesis_sources,
                                             flat, DEFAULT_SHIFT, DEFAULT_TENSION)
                if forced:
                    log_probs = tf.reshape(tf.reduce_sum(token_log_probs, axis=1),
                                           [count, hypotheses])
                outputs += [
                    tf.reshape(pad_last(pieces_of(self.tokenizer, flat), length),
                               [count, hypotheses, length]),
                    tf.reshape(pad_last(token_log_probs, length), [count, hypotheses, length]),
                    tf.reshape(alignments, [count, hypotheses])]
            lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.int32), axis=-1)
            last = tf.gather(ids, tf.maximum(lengths - 1, 0), batch_dims=2)
            return (*outputs, log_probs, tf.cast(lengths, tf.float32), last == EOS_ID)

        trailing = [[width]] + ([[width, length], [width, length], [width]] if details else [])
        trailing += [[width], [width], [width]]
        dtypes = [tf.string] + ([tf.string, tf.float32, tf.string] if details else [])
        dtypes += [tf.float32, tf.float32, tf.bool]
        values = map_chunks(order, self.chunk_size, compute, trailing, dtypes)
        outputs, *rest = values
        log_probs, lengths, finished = rest[-3:]
        blank = tf.equal(sources.row_lengths(), 1) & blank_empty  # nothing but EOS
        wide = blank[:, None]
        results = {
            "outputs": tf.where(wide, tf.constant(""), outputs),
            "log_probs": tf.where(wide, 0.0, log_probs),
            "scores": tf.where(wide, 0.0, log_probs / length_penalty(lengths, alpha)),
            "finished": wide | finished,
            "truncated": self._truncated(texts),
        }
        if details:
            pieces, token_log_probs, alignments = rest[:3]
            used = tf.cast(tf.reduce_max(tf.concat([tf.reshape(tf.where(
                wide, 0.0, lengths), [-1]), [0.0]], 0)), tf.int32)
            results["pieces"] = tf.where(wide[:, :, None], tf.constant(""), pieces)[..., :used]
            results["token_log_probs"] = tf.where(
                wide[:, :, None], 0.0, token_log_probs)[..., :used]
            results["alignments"] = tf.where(wide, tf.constant(""), alignments)
        return results

    @staticmethod
    def _best(results):
        """The (N, 1) outputs of a one-hypothesis signature as (N,)."""
        return {name: value if name == "truncated" else value[:, 0]
                for name, value in results.items()}
