"""Translating text with a Keras model: n-best lists with scores, sampling, forced prefixes,
alignments and long inputs (paper 6.1's beam search underneath).

    translate_batch(model, tokenizer, texts, beam_size=4, num_hypotheses=4)  # Translations
    translate_texts(model, tokenizer, texts)  # the best strings only
    force_decode(model, tokenizer, sources, targets)  # the model's score of given pairs

The decoding options are plain arguments with CTranslate2's names where it has one. Score
definitions: `decoding.results`; long inputs: `decoding.long_inputs`; alignments:
`decoding.alignment`; sampling: `decoding.sampling`. Lines are decoded in batches of similar
length, bounded in sentences and in tokens, and every line's output is independent of the
batch it lands in. Loading a run directory or a SavedModel: `serving.translator`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)

from keras_transformer.decoding.alignment import (
    DEFAULT_ALIGNMENT_LAYER,
    DEFAULT_SHIFT,
    piece_words,
    word_alignment,
)
from keras_transformer.decoding.forced import forced_log_probs
from keras_transformer.decoding.long_inputs import Segment, segment_lines
from keras_transformer.decoding.results import Hypothesis, Translation, penalized_score
from keras_transformer.decoding.sampling import Sampling, line_seeds_numpy
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
    beam_search,
    clean_texts,
    encode_texts,
    greedy_search,
)
from pipelines.constants import EOS_ID, PAD_ID

__all__ = ["DecodingOptions", "force_decode", "translate_batch", "translate_texts"]

Progress = Callable[[int], None]
DEFAULT_BATCH_SIZE = 64
# Bounds a batch's memory whatever its lines' lengths: hypotheses x (source + output) tokens.
DEFAULT_BATCH_TOKENS = 65_536
# Lines are cleaned whole (a long line is split or refused, never cut by the cleaning).
_WHOLE_LINE = 2**31 - 1


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


def _sampling(topk: int, topp: float, temperature: float, seed: int) -> Sampling | None:
    """CTranslate2's convention: sampling_topk 1 is greedy search (no sampling)."""
    if topk == 1:
        if topp != 1.0 or temperature != 1.0:
            raise ValueError("sampling_topp and sampling_temperature apply to sampling: set "
                             "sampling_topk to 0 (the whole vocabulary) or to k > 1.")
        return None
    return Sampling(top_k=topk, top_p=topp, temperature=temperature, seed=seed)


def translate_batch(
    model,
    tokenizer,
    texts: Sequence[str | bytes],
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    num_hypotheses: int = 1,
    sampling_topk: int = 1,
    sampling_topp: float = 1.0,
    sampling_temperature: float = 1.0,
    seed: int = 0,
    target_prefix: Sequence[str | None] | None = None,
    return_token_scores: bool = False,
    return_alignment: bool = False,
    alignment_layer: int = DEFAULT_ALIGNMENT_LAYER,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    max_output_tokens: int | None = None,
    extra_length: int = DEFAULT_EXTRA_LENGTH,
    long_inputs: str = "split",
    batch_size: int = DEFAULT_BATCH_SIZE,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    line_indices: Sequence[int] | None = None,
    progress: Progress | None = None,
    jit_compile: bool = False,
) -> list[Translation]:
    """Translations of `texts`, in order, each with its hypotheses, scores and flags.

    Args:
        model: a `Transformer` (float32 or mixed precision).
        tokenizer: its `SubwordTokenizer`.
        texts: N lines (str, or bytes in any encoding: invalid UTF-8 is replaced).
        beam_size: hypotheses kept per line; 1 is greedy search (or sampling).
        alpha: length penalty exponent of the score (`decoding.results`).
        num_hypotheses: hypotheses returned per line, best first (at most beam_size).
        sampling_topk: 1 (default) decodes by search; 0 samples from the whole vocabulary,
            k > 1 from the k most likely tokens (beam_size must be 1).
        sampling_topp: nucleus sampling: the smallest set of tokens with this much mass.
        sampling_temperature: divides the log-probs before sampling.
        seed: with each line's index, fixes the line's random draws.
        target_prefix: per line, text its output must start with (None or "" for none);
            forced during decoding, its tokens' log-probs count in the score.
        return_token_scores: fill `token_log_probs`.
        return_alignment: fill `alignment` (word links) and `attention`.
        alignment_layer: the decoder layer alignments are read from.
        max_input_tokens: the most subword tokens (EOS included) decoded at once; longer
            lines are handled as `long_inputs` says.
        max_output_tokens: the most output tokens (EOS included); default max_input_tokens +
            extra_length.
        extra_length: an output may have its source's tokens plus this many (paper: 50).
        long_inputs: "split", "truncate" or "error" (`decoding.long_inputs`).
        batch_size: the most lines (or segments) decoded together.
        batch_tokens: the most hypotheses x (source + output) tokens decoded together.
        line_indices: each line's index in its input, for the sampling seeds (default
            0..N-1; give the file's line numbers when translating a file in parts).
        progress: called with the number of lines finished after each batch.
        jit_compile: XLA-compiled decoding (see `decoding.greedy_search`).

    Returns:
        N `Translation`s.

    Raises:
        InputTooLong: a line over max_input_tokens with long_inputs "error".
    """
    options = DecodingOptions(
        beam_size=beam_size, alpha=alpha, num_hypotheses=num_hypotheses,
        sampling=_sampling(sampling_topk, sampling_topp, sampling_temperature, seed),
        max_output_tokens=max_output_tokens or max_input_tokens + extra_length,
        extra_length=extra_length, return_token_scores=return_token_scores,
        return_alignment=return_alignment, alignment_layer=alignment_layer,
        jit_compile=jit_compile)
    if batch_size < 1 or batch_tokens < 1 or max_input_tokens < 2:
        raise ValueError("batch_size and batch_tokens must be >= 1, max_input_tokens >= 2.")
    if target_prefix is not None and len(target_prefix) != len(texts):
        raise ValueError(f"{len(target_prefix)} target prefixes for {len(texts)} lines.")
    lines = _clean(texts)
    line_indices = list(range(len(lines)) if line_indices is None else line_indices)
    segments, flags = segment_lines(lines, lambda items: _count_tokens(tokenizer, items),
                                    max_input_tokens, long_inputs)
    decoded = _Decoder(model, tokenizer, options, target_prefix, line_indices).run(
        segments, max_input_tokens, batch_size, batch_tokens, progress, len(lines))
    return [_line_result(decoded.get(line, []), flags[line], options)
            for line in range(len(lines))]


def translate_texts(
    model,
    tokenizer,
    texts: Sequence[str | bytes],
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    batch_size: int = DEFAULT_BATCH_SIZE,
    extra_length: int = DEFAULT_EXTRA_LENGTH,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    progress: Progress | None = None,
    jit_compile: bool = False,
) -> list[str]:
    """The best translation of each of `texts` (`translate_batch`'s strings; long lines are
    split into sentences)."""
    if batch_size < 1 or beam_size < 1:
        raise ValueError("batch_size and beam_size must be >= 1.")
    return [result.text for result in translate_batch(
        model, tokenizer, texts, beam_size=beam_size, alpha=alpha, batch_size=batch_size,
        extra_length=extra_length, max_input_tokens=max_input_tokens, progress=progress,
        jit_compile=jit_compile)]


def force_decode(
    model,
    tokenizer,
    sources: Sequence[str | bytes],
    targets: Sequence[str | bytes | Sequence[str]],
    *,
    alpha: float = DEFAULT_ALPHA,
    return_alignment: bool = False,
    alignment_layer: int = DEFAULT_ALIGNMENT_LAYER,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    long_inputs: str = "error",
    batch_size: int = DEFAULT_BATCH_SIZE,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: Progress | None = None,
) -> list[Translation]:
    """The model's scores of given translations (forced decoding), as `translate_batch`
    reports them: `log_prob` with EOS, `score`, `token_log_probs`.

    Args:
        sources: N source lines.
        targets: N translations: text (tokenized as in training), or lists of subword
            pieces (a search's `pieces`, for the exact tokens it produced).
        long_inputs: "error" or "truncate" (a source cannot be split against one target).
        Others as in `translate_batch`.

    Returns:
        N `Translation`s with one (finished) hypothesis: the target.
    """
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets.")
    if long_inputs not in ("error", "truncate"):
        raise ValueError("force_decode takes long_inputs 'error' or 'truncate'.")
    options = DecodingOptions(alpha=alpha, return_token_scores=True,
                              return_alignment=return_alignment,
                              alignment_layer=alignment_layer)
    lines = _clean(sources)
    segments, flags = segment_lines(lines, lambda items: _count_tokens(tokenizer, items),
                                    max_input_tokens, long_inputs)
    for line in range(len(lines)):
        if not lines[line]:  # an empty source is still scored: the model reads [EOS]
            segments.append(Segment(line, ""))
    segments.sort(key=lambda segment: segment.line)
    decoder = _Decoder(model, tokenizer, options, None, list(range(len(lines))))
    source_ids = encode_texts(tokenizer, tf.constant([s.text for s in segments], tf.string),
                              max_input_tokens)
    target_ids = _target_ids(tokenizer, [targets[s.line] for s in segments])
    results = [None] * len(lines)
    lengths = np.maximum(source_ids.row_lengths().numpy(), target_ids.row_lengths().numpy())
    done = 0
    for rows in length_batches(lengths, batch_size, batch_tokens):
        source = tf.gather(source_ids, rows).to_tensor()
        ids = tf.gather(target_ids, rows).to_tensor()
        hypotheses = decoder.hypotheses(source, ids[:, None, :], log_probs=None)
        for row, hypothesis in zip(rows, hypotheses, strict=True):
            line = segments[row].line
            results[line] = Translation(hypothesis, flags[line],
                                        decoder.pieces(source_ids[row]))
        done += len(rows)
        if progress is not None:
            progress(done)
    return results


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


def _clean(texts: Sequence[str | bytes]) -> list[str]:
    if not texts:
        return []
    raw = [text.encode("utf-8") if isinstance(text, str) else bytes(text) for text in texts]
    return [line.decode("utf-8") for line in
            clean_texts(tf.constant(raw, tf.string), _WHOLE_LINE).numpy()]


def _count_tokens(tokenizer, texts: Sequence[str]) -> list[int]:
    if not texts:
        return []
    return tokenizer.tokenize(tf.constant(list(texts), tf.string)).row_lengths().numpy().tolist()


def _target_ids(tokenizer, targets) -> tf.RaggedTensor:
    """Target ids with EOS: texts tokenized, piece lists looked up."""
    rows = []
    for target in targets:
        if isinstance(target, (str, bytes)):
            text = target.decode("utf-8", "replace") if isinstance(target, bytes) else target
            ids = _tokenize_text(tokenizer, text)
        else:
            ids = tokenizer.piece_to_id(tf.constant(list(target), tf.string)).numpy().tolist() \
                if len(target) else []
        rows.append([*ids, EOS_ID])
    return tf.ragged.constant(rows, dtype=tf.int32, ragged_rank=1)


def _tokenize_text(tokenizer, text: str) -> list[int]:
    cleaned = clean_texts(tf.constant([text.encode("utf-8")]), _WHOLE_LINE)
    return tokenizer.tokenize(cleaned)[0].numpy().tolist()


class _Decoder:
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
            for row, hypotheses in zip(rows, self.hypotheses(source, ids, log_probs),
                                       strict=True):
                segment = segments[row]
                decoded.setdefault(segment.line, []).append(
                    (row, hypotheses, self.pieces(sources[row])))
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
        cleaned = clean_texts(tf.constant(texts, tf.string), _WHOLE_LINE)
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

    def pieces(self, ids) -> list[str]:
        """The subword pieces of ids (n,), PAD and EOS left out."""
        ids = np.asarray(ids)
        ids = ids[(ids != PAD_ID) & (ids != EOS_ID)]
        if not ids.size:
            return []
        return [piece.decode("utf-8", "replace")
                for piece in self.tokenizer.id_to_piece(ids).numpy()]

    def hypotheses(self, source, ids, log_probs) -> list[list[Hypothesis]]:
        """Per row of `source` (n, S), its hypotheses from ids (n, k, T), best first.
        `log_probs` (n, k) from the search; None: computed by forcing (the ids end with EOS)."""
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
        pieces = [self.pieces(row) for row in flat_np]
        source_pieces = [self.pieces(row) for row in source.numpy()]
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
                hypothesis.attention = attention
                hypothesis.alignment = word_alignment(attention, sources, hypothesis.pieces,
                                                      shift=DEFAULT_SHIFT)
            result.append(hypothesis)
        return [result[row * beams: (row + 1) * beams] for row in range(count)]


def _unpenalized(ids, scores, alpha):
    """log-probs (n, k) from beam search's penalized scores and the ids' lengths."""
    lengths = tf.reduce_sum(tf.cast(ids != PAD_ID, tf.float32), axis=-1)
    return scores * tf.pow((5.0 + lengths) / 6.0, alpha)


def _line_result(parts, flags: list[str], options: DecodingOptions) -> Translation:
    """One line's `Translation` from its decoded segments (none: an empty line)."""
    parts = sorted(parts, key=lambda part: part[0])  # decoded by length: back in text order
    if not parts:
        empty = Hypothesis("", 0.0, 0.0, True, [],
                           [] if options.return_token_scores else None,
                           [] if options.return_alignment else None)
        return Translation([empty], list(flags), [])
    if len(parts) == 1:
        _, hypotheses, source_pieces = parts[0]
        best = hypotheses[0]
        flags = list(flags) + ([] if best.finished else ["length_limit"])
        return Translation(hypotheses, flags, source_pieces)
    return _joined(parts, flags, options)


def _joined(parts, flags, options: DecodingOptions) -> Translation:
    """A split line: the best hypotheses of its segments, one after another."""
    bests = [hypotheses[0] for _, hypotheses, _ in parts]
    length = sum(len(best.pieces) + int(best.finished) for best in bests)
    log_prob = sum(best.log_prob for best in bests)
    joined = Hypothesis(
        text=" ".join(best.text for best in bests if best.text),
        score=penalized_score(log_prob, length, options.alpha), log_prob=log_prob,
        finished=all(best.finished for best in bests),
        pieces=[piece for best in bests for piece in best.pieces])
    if options.return_token_scores:
        joined.token_log_probs = [value for best in bests for value in best.token_log_probs]
    if options.return_alignment:
        links, source_offset, target_offset = [], 0, 0
        for (_, _, source_pieces), best in zip(parts, bests, strict=True):
            links += [(i + source_offset, j + target_offset) for i, j in best.alignment]
            source_offset += len(set(piece_words(source_pieces)))
            target_offset += len(set(piece_words(best.pieces)))
        joined.alignment = links
    flags = list(flags) + ([] if joined.finished else ["length_limit"])
    return Translation([joined], flags, [p for _, _, pieces in parts for p in pieces])
