"""Decoding lines in batches: the machinery behind `decoding.translator`'s functions.

`DecodingOptions` holds how lines are decoded; `BatchDecoder` cleans, batches (bounded in
lines and in tokens, longest first), searches, and turns ids into `Hypothesis` objects with
their scores, pieces, token log-probs and alignments (a forced pass, `decoding.forced`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from keras_transformer.decoding.alignment import (
    DEFAULT_ALIGNMENT_LAYER,
    DEFAULT_SHIFT,
    word_alignment,
)
from keras_transformer.decoding.forced import forced_log_probs
from keras_transformer.decoding.results import Hypothesis, penalized_score
from keras_transformer.decoding.sampling import Sampling, line_seeds_numpy
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    beam_search,
    clean_texts,
    encode_texts,
    greedy_search,
)
from pipelines.constants import EOS_ID, PAD_ID

__all__ = ["BatchDecoder", "DecodingOptions", "clean_lines", "count_tokens", "length_batches",
           "encode_targets"]

# Lines are cleaned whole (a long line is split or refused, never cut by the cleaning).
WHOLE_LINE = 2**31 - 1


@dataclass(frozen=True)
class DecodingOptions:
    """How lines are decoded (see `translate_batch` for each argument)."""

    beam_size: int = DEFAULT_BEAM_SIZE
    alpha: float = DEFAULT_ALPHA
    num_hypotheses: int = 1
    sampling: Sampling | None = None
    max_output_tokens: int | None = None
    extra_length: int = DEFAULT_EXTRA_LENGTH
    return_token_scores: bool = False
    return_alignment: bool = False
    return_attention: bool = False
    alignment_layer: int = DEFAULT_ALIGNMENT_LAYER
    jit_compile: bool = False

    def __post_init__(self):
        if self.beam_size < 1 or self.num_hypotheses < 1 or self.extra_length < 0:
            raise ValueError("beam_size and num_hypotheses must be >= 1, extra_length >= 0.")
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}.")
        if self.num_hypotheses > self.beam_size:
            raise ValueError(f"num_hypotheses={self.num_hypotheses} needs beam_size >= it "
                             f"(beam_size={self.beam_size}): beam search returns its beams.")
        if self.sampling is not None and self.beam_size != 1:
            raise ValueError("sampling draws one token a step: use beam_size 1.")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}.")


def length_batches(costs, batch_size: int, batch_tokens: int) -> list[np.ndarray]:
    """Row indices in batches of similar cost, costliest first: at most `batch_size` rows and
    rows x the batch's highest cost <= `batch_tokens` (a row over it alone). Longest first,
    so that a batch too large for memory fails at once rather than at the end."""
    order = np.argsort(-np.asarray(costs), kind="stable")
    batches, start = [], 0
    while start < len(order):
        widest = max(int(costs[order[start]]), 1)
        rows = max(1, min(batch_size, batch_tokens // widest))
        batches.append(order[start: start + rows])
        start += rows
    return batches


def clean_lines(texts: Sequence[str | bytes]) -> list[str]:
    if not texts:
        return []
    raw = [text.encode("utf-8") if isinstance(text, str) else bytes(text) for text in texts]
    return [line.decode("utf-8") for line in
            clean_texts(tf.constant(raw, tf.string), WHOLE_LINE).numpy()]


def line_numbers(line_indices: Sequence[int] | None, count: int) -> list[int]:
    """Each of `count` lines' number in its file (its sampling seed comes from it): the
    given `line_indices`, or 0 to count - 1.

    Raises:
        ValueError: as many indices as lines are needed.
    """
    numbers = list(range(count) if line_indices is None else line_indices)
    if len(numbers) != count:
        raise ValueError(f"{len(numbers)} line indices for {count} lines.")
    return numbers


def count_tokens(tokenizer, texts: Sequence[str]) -> list[int]:
    if not texts:
        return []
    return tokenizer.tokenize(tf.constant(list(texts), tf.string)).row_lengths().numpy().tolist()


def encode_targets(tokenizer, targets, max_tokens: int) -> tuple[tf.RaggedTensor, list[bool]]:
    """(target ids with EOS, each cut to `max_tokens` tokens with EOS; whether it was cut):
    texts are tokenized (in one call), piece lists looked up."""
    texts = [i for i, target in enumerate(targets) if isinstance(target, (str, bytes))]
    rows: list[list[int]] = [[] for _ in targets]
    if texts:
        raw = [targets[i].encode("utf-8") if isinstance(targets[i], str) else targets[i]
               for i in texts]
        tokens = tokenizer.tokenize(clean_texts(tf.constant(raw, tf.string), WHOLE_LINE))
        for i, ids in zip(texts, tokens.to_list(), strict=True):
            rows[i] = ids
    for i, target in enumerate(targets):
        if not isinstance(target, (str, bytes)) and len(target):
            rows[i] = tokenizer.piece_to_id(tf.constant(list(target), tf.string)).numpy().tolist()
    cut = [len(ids) + 1 > max_tokens for ids in rows]
    rows = [[*ids[: max_tokens - 1], EOS_ID] for ids in rows]
    return tf.ragged.constant(rows, dtype=tf.int32, ragged_rank=1), cut


class BatchDecoder:
    """Decodes segments batch by batch and turns ids into `Hypothesis` objects."""

    def __init__(self, model, tokenizer, options: DecodingOptions, target_prefix, line_indices):
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.target_prefix, self.line_indices = target_prefix, line_indices

    def run(self, segments, max_input_tokens, batch_size, batch_tokens, progress, line_count):
        """{line: [(segment number, hypotheses, source pieces)]} for every segment."""
        decoded: dict[int, list] = {}
        if not segments:
            if progress is not None:
                progress(line_count)
            return decoded
        sources = encode_texts(self.tokenizer,
                               tf.constant([s.text for s in segments], tf.string),
                               max_input_tokens)
        prefixes = self._prefixes(segments)
        seeds = self._seeds(segments)
        options = self.options
        source_lengths = sources.row_lengths().numpy()
        # A hypothesis' memory: its source and its longest possible output.
        costs = options.beam_size * (2 * source_lengths + options.extra_length)
        remaining = np.bincount([s.line for s in segments], minlength=line_count)
        done = line_count - int((remaining > 0).sum())  # empty lines are done already
        for rows in length_batches(costs, batch_size, batch_tokens):
            source = tf.gather(sources, rows).to_tensor()
            prefix = None if prefixes is None else tf.gather(prefixes, rows).to_tensor()
            ids, log_probs = self._search(source, prefix,
                                          None if seeds is None else seeds[rows])
            hypotheses, source_pieces = self.hypotheses(source, ids, log_probs)
            for row, row_hypotheses, row_pieces in zip(rows, hypotheses, source_pieces,
                                                       strict=True):
                segment = segments[row]
                decoded.setdefault(segment.line, []).append((row, row_hypotheses, row_pieces))
                remaining[segment.line] -= 1
                done += int(remaining[segment.line] == 0)
            if progress is not None:
                progress(done)
        return decoded

    def _prefixes(self, segments):
        """Ragged int32 prefix ids per segment (the first segment of a line only), or None."""
        if self.target_prefix is None or not any(self.target_prefix):
            return None
        first = set()
        texts = []
        for segment in segments:
            prefix = self.target_prefix[segment.line] if segment.line not in first else None
            first.add(segment.line)
            if isinstance(prefix, bytes):
                prefix = prefix.decode("utf-8", "replace")
            texts.append((prefix or "").encode("utf-8"))
        cleaned = clean_texts(tf.constant(texts, tf.string), WHOLE_LINE)
        return tf.cast(self.tokenizer.tokenize(cleaned), tf.int32)

    def _seeds(self, segments):
        """uint32 per-segment seeds from (seed, line index, segment number), or None."""
        if self.options.sampling is None:
            return None
        seed = self.options.sampling.seed
        seeds, count = [], {}
        for segment in segments:
            number = count[segment.line] = count.get(segment.line, -1) + 1
            line_seed = int(line_seeds_numpy(seed, [self.line_indices[segment.line]])[0])
            seeds.append(line_seed if number == 0
                         else int(line_seeds_numpy(line_seed, [number])[0]))
        return np.asarray(seeds, np.uint32)

    def _search(self, source, prefix, seeds):
        """ids (n, k, T) and log-probs (n, k) (None: beam scores, converted later)."""
        options = self.options
        common = {"extra_length": options.extra_length, "max_length": options.max_output_tokens,
                  "jit_compile": options.jit_compile, "prefix_ids": prefix}
        if options.beam_size == 1:
            ids, log_probs = greedy_search(self.model, source, sampling=options.sampling,
                                           seeds=seeds, **common)
            return ids[:, None, :], log_probs[:, None]
        ids, scores = beam_search(self.model, source, beam_size=options.beam_size,
                                  alpha=options.alpha, num_return=options.num_hypotheses,
                                  **common)
        if options.num_hypotheses == 1:
            ids, scores = ids[:, None, :], scores[:, None]
        return ids, _unpenalized(ids, scores, options.alpha)

    def piece_rows(self, ids) -> list[list[str]]:
        """The subword pieces of each row of ids (n, T), PAD and EOS left out (one lookup)."""
        ids = np.asarray(ids)
        if not ids.size:
            return [[] for _ in range(len(ids))]
        strings = self.tokenizer.id_to_piece(ids).numpy()
        keep = (ids != PAD_ID) & (ids != EOS_ID)
        return [[piece.decode("utf-8", "replace") for piece in row[mask]]
                for row, mask in zip(strings, keep, strict=True)]

    def hypotheses(self, source, ids, log_probs) -> tuple[list[list[Hypothesis]],
                                                          list[list[str]]]:
        """Per row of `source` (n, S): its hypotheses from ids (n, k, T), best first, and its
        source pieces. `log_probs` (n, k) from the search; None: computed by forcing (the ids
        end with EOS)."""
        options = self.options
        count, beams = ids.shape[0], ids.shape[1]
        flat = tf.reshape(ids, [count * beams, -1])
        lengths = tf.reduce_sum(tf.cast(flat != PAD_ID, tf.int32), axis=1).numpy()
        flat_np = flat.numpy()
        finished = np.array([length > 0 and flat_np[i, length - 1] == EOS_ID
                             for i, length in enumerate(lengths)])
        forced = None
        if options.return_token_scores or options.return_alignment or log_probs is None:
            forced = forced_log_probs(
                self.model, tf.repeat(source, beams, axis=0), flat,
                attention_layer=options.alignment_layer if options.return_alignment else None)
        if log_probs is None:
            log_probs = tf.reduce_sum(forced.token_log_probs, axis=1)
        log_probs = np.reshape(np.asarray(log_probs), [-1])
        texts = self.tokenizer.detokenize(flat).numpy() if flat.shape[1] else [b""] * len(flat_np)
        pieces = self.piece_rows(flat_np)
        source_pieces = self.piece_rows(source.numpy())
        result = []
        for index in range(count * beams):
            hypothesis = Hypothesis(
                text=texts[index].decode("utf-8", "replace"),
                score=penalized_score(log_probs[index], int(lengths[index]), options.alpha),
                log_prob=float(log_probs[index]), finished=bool(finished[index]),
                pieces=pieces[index])
            length = int(lengths[index])
            if forced is not None and options.return_token_scores:
                hypothesis.token_log_probs = forced.token_log_probs[index, :length].numpy().tolist()
            if options.return_alignment:
                sources = source_pieces[index // beams]
                # Rows: the output's tokens (EOS included); columns: the source's (EOS too).
                attention = forced.attention[index, :length, : len(sources) + 1].numpy()
                if options.return_attention:  # (T, S) floats a hypothesis: only if asked
                    hypothesis.attention = attention
                hypothesis.alignment = word_alignment(attention, sources, hypothesis.pieces,
                                                      shift=DEFAULT_SHIFT)
            result.append(hypothesis)
        return ([result[row * beams: (row + 1) * beams] for row in range(count)],
                source_pieces)


def _unpenalized(ids, scores, alpha):
    """log-probs (n, k) from beam search's penalized scores and the ids' lengths."""
    lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.float32), axis=-1)
    return scores * tf.pow((5.0 + lengths) / 6.0, alpha)
