"""Translating with a SavedModel as the Python API translates with a run directory: the same
`Translation`s (hypotheses, scores, flags, token log-probs, alignments: `decoding.results`),
decoded by the export's signatures (`serving.detailed_signatures`).

    export = open_export(path, tf.saved_model.load(str(path)))  # serving.loaded_export
    translate_batch_with_saved_model(export, texts, beam_size=4, num_hypotheses=2)
    translate_texts_with_saved_model(export, texts)  # (best strings, line flags): fast

Python does what a signature cannot. Lines are cleaned, then split, truncated or refused as
`decoding.long_inputs` says, with the export's own tokenizer (the sentencepiece model its
graph holds), so a long line gets the segments it gets from the run directory. Segments are
sent in requests of similar length (`length_batches`, as `BatchDecoder` batches) to:
- `translate_details` for beam and greedy search (its beam_size hypotheses, the first
  `num_hypotheses` kept); the strings-only path uses `translate_prefix` with empty prefixes
  (no forced pass: faster);
- `translate_prefix` for a line's first segment with a forced prefix (one hypothesis);
- `sample` for sampling, seeded per (line, segment) as `decoding.translator` seeds them.
The last two return text, not token ids, so their outputs' pieces, token log-probs and
alignments come from `score` (forced decoding) of the text tokenized again. That gives the
search's own pieces whenever its log-prob is the search's (checked); when it is not (a model
may emit a segmentation the tokenizer would not produce), the line is flagged `retokenized`:
its pieces, token log-probs and alignment are those of the text tokenized again, while text,
score, log_prob and finished stay the search's.

What the export fixes is refused with a `UsageError` (`serving.loaded_export`), never
silently different: max_input_tokens above the export's (or below it where a segment is to
be truncated: the signatures truncate at the export's limit), extra_length
other than its max_extra_length, max_output_tokens below max_input_tokens + extra_length,
beam_size above its max_beam_size or alpha above 10 (its signatures would clip them),
another alignment layer, `return_attention` (no attention output), n-best lists with a
forced prefix, sampling with a forced prefix, a prefix over its output limit. jit_compile is
the export's own setting (it changes no result).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)

from keras_transformer.decoding.alignment import DEFAULT_ALIGNMENT_LAYER
from keras_transformer.decoding.batch_decoder import (
    clean_lines,
    count_tokens,
    length_batches,
    line_numbers,
)
from keras_transformer.decoding.long_inputs import segment_lines
from keras_transformer.decoding.results import (
    Hypothesis,
    Translation,
    line_translation,
    penalized_score,
)
from keras_transformer.decoding.sampling import line_seeds_numpy
from keras_transformer.decoding.search import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE, encode_texts
from keras_transformer.decoding.translator import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BATCH_TOKENS,
    decoding_options,
)
from keras_transformer.serving.loaded_export import (
    DETAILED_SIGNATURES,
    Export,
    check_prefixes,
    check_segments,
    check_supported,
    resolve_limits,
)

__all__ = ["translate_batch_with_saved_model", "translate_texts_with_saved_model"]

Progress = Callable[[int], None]


def _source_pieces(tokenizer, source_ids) -> list[list[str]]:
    """Each source's pieces, EOS left out."""
    pieces = tokenizer.id_to_piece(source_ids.flat_values).numpy()
    splits = source_ids.row_splits.numpy()
    return [[piece.decode("utf-8", "replace") for piece in pieces[start: end - 1]]
            for start, end in zip(splits[:-1], splits[1:], strict=True)]


def _strings(values) -> list[str]:
    return [value.decode("utf-8", "replace") for value in values]


def _links(pharaoh: bytes) -> list[tuple[int, int]]:
    return [tuple(int(part) for part in link.split("-")) for link in pharaoh.decode().split()]


class _Segments:
    """The segments of the lines and what decoding each needs: the text, the prefix
    (a line's first segment only), the sampling seed and index, the source pieces."""

    def __init__(self, export: Export, segments, target_prefix, options, line_indices,
                 max_input_tokens: int):
        self.segments, self.options = segments, options
        self.texts = [segment.text.encode("utf-8") for segment in segments]
        numbers, seen = [], {}
        for segment in segments:
            seen[segment.line] = seen.get(segment.line, -1) + 1
            numbers.append(seen[segment.line])
        raw = [target_prefix[s.line] if target_prefix is not None and number == 0 else None
               for s, number in zip(segments, numbers, strict=True)]
        self.prefixes = clean_lines([prefix or "" for prefix in raw])
        sampling = options.sampling
        # (seed, index) of each segment: a line's first from the seed and its index in the
        # input, the next ones from the line's seed and their number (`BatchDecoder._seeds`).
        self.seeds = [] if sampling is None else [
            (sampling.seed, line_indices[s.line]) if number == 0 else
            (int(line_seeds_numpy(sampling.seed, [line_indices[s.line]])[0]), number)
            for s, number in zip(segments, numbers, strict=True)]
        sources = encode_texts(export.tokenizer, tf.constant(self.texts, tf.string),
                               max_input_tokens) if segments else None
        self.source_pieces = [] if sources is None else _source_pieces(export.tokenizer,
                                                                       sources)
        lengths = np.zeros(0, np.int64) if sources is None else sources.row_lengths().numpy()
        # A hypothesis' memory: its source and its longest possible output (`BatchDecoder`).
        self.costs = options.beam_size * (2 * lengths + options.extra_length)

    def groups(self) -> dict[tuple, list[int]]:
        """Segment rows by the signature (and scalar inputs) that decodes them."""
        groups: dict[tuple, list[int]] = {}
        for row in range(len(self.segments)):
            key = (("sample", self.seeds[row][0]) if self.seeds
                   else ("translate_prefix",) if self.prefixes[row] else ("translate_details",))
            groups.setdefault(key, []).append(row)
        return groups


def translate_batch_with_saved_model(
    export: Export, texts: Sequence[str | bytes], *, beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA, num_hypotheses: int = 1, sampling_topk: int = 1,
    sampling_topp: float = 1.0, sampling_temperature: float = 1.0, seed: int = 0,
    target_prefix: Sequence[str | bytes | None] | None = None,
    return_token_scores: bool = False, return_alignment: bool = False,
    return_attention: bool = False, alignment_layer: int = DEFAULT_ALIGNMENT_LAYER,
    max_input_tokens: int | None = None, max_output_tokens: int | None = None,
    extra_length: int | None = None, long_inputs: str = "split",
    batch_size: int = DEFAULT_BATCH_SIZE, batch_tokens: int = DEFAULT_BATCH_TOKENS,
    line_indices: Sequence[int] | None = None, progress: Progress | None = None,
    jit_compile: bool = False,
) -> list[Translation]:
    """`decoding.translator.translate_batch` with a SavedModel (the module docstring).

    Args:
        export: `open_export`'s.
        max_input_tokens, extra_length: default: the export's (max_input_tokens may be lower:
            long lines are split at it).
        Others: as `translate_batch`.

    Raises:
        ValueError: what `translate_batch` refuses (the same checks and messages).
        UsageError: what the export cannot do (the module docstring).
        InputTooLong: a line over max_input_tokens with long_inputs "error".
    """
    max_input_tokens, extra_length = resolve_limits(export, max_input_tokens,
                                                    max_output_tokens, extra_length)
    options = decoding_options(
        texts, beam_size=beam_size, alpha=alpha, num_hypotheses=num_hypotheses,
        sampling_topk=sampling_topk, sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature, seed=seed, target_prefix=target_prefix,
        return_token_scores=return_token_scores, return_alignment=return_alignment,
        return_attention=return_attention, alignment_layer=alignment_layer,
        max_input_tokens=max_input_tokens, max_output_tokens=max_output_tokens,
        extra_length=extra_length, batch_size=batch_size, batch_tokens=batch_tokens,
        jit_compile=jit_compile)
    check_supported(export, options, DETAILED_SIGNATURES)
    lines = clean_lines(texts)
    line_indices = line_numbers(line_indices, len(lines))
    segments, flags = segment_lines(lines, lambda items: count_tokens(export.tokenizer, items),
                                    max_input_tokens, long_inputs)
    check_segments(export, segments, max_input_tokens)
    plan = _Segments(export, segments, target_prefix, options, line_indices, max_input_tokens)
    check_prefixes(export, plan.prefixes, options)
    decoded: dict[int, list] = {}
    lengths = {}  # a search's own output length (EOS included) per segment
    tracker = _Progress(progress, segments, len(lines))
    for key, rows in plan.groups().items():
        for batch in length_batches(plan.costs[rows], batch_size, batch_tokens):
            batch_rows = [rows[index] for index in batch]
            for row, (hypotheses, retokenized, length) in zip(
                    batch_rows, _decode(export, plan, key, batch_rows), strict=True):
                line = segments[row].line
                if retokenized and "retokenized" not in flags[line]:
                    flags[line].append("retokenized")
                decoded.setdefault(line, []).append((row, hypotheses, plan.source_pieces[row]))
                lengths[row] = length
            tracker.done(segments[row].line for row in batch_rows)
    results = [line_translation(decoded.get(line, []), flags[line], options.alpha,
                                options.return_token_scores, options.return_alignment)
               for line in range(len(lines))]
    for line, result in enumerate(results):
        if "split" in result.flags and "retokenized" in result.flags:
            # The joined score's length is the searches' own, not the pieces tokenized again.
            best = result.hypotheses[0]
            best.score = penalized_score(best.log_prob, sum(
                lengths[row] for row, _, _ in decoded[line]), options.alpha)
    return results


class _Progress:
    """Calls `progress` with the number of lines finished (every segment decoded)."""

    def __init__(self, progress: Progress | None, segments, line_count: int):
        self.progress = progress
        self.remaining = np.bincount([s.line for s in segments], minlength=line_count)
        self.finished = line_count - int((self.remaining > 0).sum())  # empty lines
        if progress is not None and not segments:
            progress(line_count)

    def done(self, lines) -> None:
        for line in lines:
            self.remaining[line] -= 1
            self.finished += int(self.remaining[line] == 0)
        if self.progress is not None:
            self.progress(self.finished)


def _decode(export: Export, plan: _Segments, key: tuple, rows: list[int]):
    """Each row's (hypotheses best first, whether its pieces are of the text tokenized again
    rather than the search's, the search's output length), from the signature `key` names."""
    options = plan.options
    inputs = tf.constant([plan.texts[row] for row in rows], tf.string)
    alpha = tf.constant(options.alpha, tf.float32)
    beam_size = tf.constant(options.beam_size, tf.int32)
    if key[0] == "translate_details":
        out = export.call("translate_details", inputs=inputs, beam_size=beam_size, alpha=alpha)
        results = []
        for i in range(len(rows)):
            hypotheses = [_detailed(out, i, k, options) for k in range(options.num_hypotheses)]
            results.append((hypotheses, False,
                            len(hypotheses[0].pieces) + int(hypotheses[0].finished)))
        return results
    if key[0] == "translate_prefix":
        out = export.call("translate_prefix", inputs=inputs, beam_size=beam_size, alpha=alpha,
                          prefixes=tf.constant([plan.prefixes[row] for row in rows]))
    else:
        sampling = options.sampling
        out = export.call(
            "sample", inputs=inputs, alpha=alpha, seed=tf.constant(key[1], tf.int64),
            line_indices=tf.constant([plan.seeds[row][1] for row in rows], tf.int64),
            top_k=tf.constant(sampling.top_k, tf.int32),
            top_p=tf.constant(sampling.top_p, tf.float32),
            temperature=tf.constant(sampling.temperature, tf.float32))
    scored = export.call("score", inputs=inputs, targets=tf.constant(out["outputs"]),
                         alpha=alpha)
    results = []
    for i in range(len(rows)):
        hypothesis, retokenized = _searched(out, scored, i, options)
        length = len(hypothesis.pieces) + int(hypothesis.finished)
        if retokenized:
            length = _search_length(hypothesis.log_prob, hypothesis.score, options.alpha, length)
        results.append(([hypothesis], retokenized, length))
    return results


def _search_length(log_prob: float, score: float, alpha: float, fallback: int) -> int:
    """A search's output length (EOS included), read from its score's length penalty:
    score = log_prob / ((5 + length) / 6) ** alpha. Without a penalty to read (alpha 0, a
    zero log-prob), `fallback` (the length then changes no score)."""
    if alpha <= 0 or not log_prob < 0 or not score < 0:
        return fallback
    try:
        length = 6.0 * (log_prob / score) ** (1.0 / alpha) - 5.0
    except OverflowError:
        return fallback
    return round(length) if 0 <= length < 1e6 else fallback


def _detailed(out, i: int, k: int, options) -> Hypothesis:
    """Hypothesis k of row i of `translate_details`' outputs."""
    pieces = _strings(out["pieces"][i, k])
    length = pieces.index("") if "" in pieces else len(pieces)  # tokens, EOS included
    finished = bool(out["finished"][i, k])
    log_prob = float(out["log_probs"][i, k])
    hypothesis = Hypothesis(
        text=out["outputs"][i, k].decode("utf-8", "replace"),
        score=penalized_score(log_prob, length, options.alpha), log_prob=log_prob,
        finished=finished, pieces=pieces[: length - 1] if finished else pieces[:length])
    if options.return_token_scores:
        hypothesis.token_log_probs = out["token_log_probs"][i, k, :length].tolist()
    if options.return_alignment:
        hypothesis.alignment = _links(out["alignments"][i, k])
    return hypothesis


def _searched(out, scored, i: int, options) -> tuple[Hypothesis, bool]:
    """Row i of `translate_prefix`' or `sample`'s outputs, completed by `score`'s of its text;
    and whether the text tokenized again is not what the search produced (its forced
    log-prob is not the search's)."""
    finished = bool(out["finished"][i])
    pieces = _strings(scored["pieces"][i])
    length = pieces.index("") if "" in pieces else len(pieces)  # EOS appended by `score`
    tokens = length if finished else length - 1
    token_log_probs = scored["token_log_probs"][i, :tokens].astype(np.float64)
    log_prob = float(out["log_probs"][i])
    same = (not scored["target_truncated"][i]
            and math.isclose(float(token_log_probs.sum()), log_prob, rel_tol=1e-4,
                             abs_tol=1e-3))
    hypothesis = Hypothesis(
        text=out["outputs"][i].decode("utf-8", "replace"), score=float(out["scores"][i]),
        log_prob=log_prob, finished=finished, pieces=pieces[: length - 1])
    if options.return_token_scores:
        hypothesis.token_log_probs = token_log_probs.astype(np.float32).tolist()
    if options.return_alignment:
        hypothesis.alignment = _links(scored["alignments"][i])
    return hypothesis, not same


def translate_texts_with_saved_model(
    export: Export, texts: Sequence[str | bytes], *, beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA, max_input_tokens: int | None = None,
    max_output_tokens: int | None = None, long_inputs: str = "split",
    batch_size: int = DEFAULT_BATCH_SIZE, batch_tokens: int = DEFAULT_BATCH_TOKENS,
    progress: Progress | None = None,
) -> tuple[list[str], list[list[str]]]:
    """(the best translation of each text, each line's flags): the strings of
    `translate_batch_with_saved_model`, by the `translate_prefix` signature (no forced pass,
    no pieces); long lines split, truncated or refused alike, flags alike."""
    max_input_tokens, extra_length = resolve_limits(export, max_input_tokens,
                                                    max_output_tokens, None)
    options = decoding_options(
        texts, beam_size=beam_size, alpha=alpha, num_hypotheses=1, sampling_topk=1,
        sampling_topp=1.0, sampling_temperature=1.0, seed=0, target_prefix=None,
        return_token_scores=False, return_alignment=False, return_attention=False,
        alignment_layer=DEFAULT_ALIGNMENT_LAYER, max_input_tokens=max_input_tokens,
        max_output_tokens=max_output_tokens, extra_length=extra_length,
        batch_size=batch_size, batch_tokens=batch_tokens, jit_compile=False)
    # An export older than `translate_prefix`: `translate` (no `finished`: no length_limit).
    flagged = "translate_prefix" in export.signatures
    check_supported(export, options, ["translate_prefix" if flagged else "translate"])
    lines = clean_lines(texts)
    segments, flags = segment_lines(lines, lambda items: count_tokens(export.tokenizer, items),
                                    max_input_tokens, long_inputs)
    check_segments(export, segments, max_input_tokens)
    plan = _Segments(export, segments, None, options, [], max_input_tokens)
    parts: list[list[str]] = [[] for _ in lines]
    unfinished = set()
    tracker = _Progress(progress, segments, len(lines))
    for batch in length_batches(plan.costs, batch_size, batch_tokens):
        rows = sorted(batch)  # text order within a line
        inputs = {"inputs": tf.constant([plan.texts[row] for row in rows]),
                  "alpha": tf.constant(alpha, tf.float32),
                  "beam_size": tf.constant(beam_size, tf.int32)}
        if flagged:
            inputs["prefixes"] = tf.constant([b""] * len(rows))
        out = export.call("translate_prefix" if flagged else "translate", **inputs)
        ended = out["finished"] if flagged else [True] * len(rows)
        for row, text, finished in zip(rows, _strings(out["outputs"]), ended, strict=True):
            parts[segments[row].line].append((row, text))
            if not finished:
                unfinished.add(segments[row].line)
        tracker.done(segments[row].line for row in rows)
    results = [" ".join(text for _, text in sorted(line_parts) if text)
               for line_parts in parts]
    for line in sorted(unfinished):
        flags[line].append("length_limit")
    return results, flags
