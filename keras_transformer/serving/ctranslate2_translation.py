"""Translating with a CTranslate2 export as our Python API does: `Translation` objects with
the same scores (`decoding.results`), n-best lists, forced prefixes, sampling, alignments
and long inputs, and forced decoding through `score_batch`.

CTranslate2 divides a hypothesis' log-probability by length^penalty; ours by
((5 + length) / 6)^alpha, EOS counted. So beam search asks CTranslate2 for its `beam_size` best
hypotheses scored unnormalised (a 1e-9 penalty), with twice the finished hypotheses before it
stops (patience 2), and ranks them by ours (`translate_with_ctranslate2` in
`serving.ctranslate2`, measured to give our beam-4 strings). Its scores are then the summed
log-probabilities, EOS included (`return_end_token` tells finished from cut hypotheses).
CTranslate2's scores leave a forced target prefix out, where ours count it, so prefixed
hypotheses (and those cut at a line's limit) are scored again with `score_batch`; a prefix
longer than a line's length limit raises the limit, as ours does.
Alignments come from `return_attention`: the export's alignment layer, all its heads averaged
(`export_ctranslate2(alignment_layer=...)`), read as `decoding.alignment` reads ours; the
attention of the step after the last token (EOS) is not returned by CTranslate2, so with the
shift the last word uses its own step's row; the first step's row comes from one greedy step
(`_first_step_attention`: a batched beam search returns another source's there). Sampling
uses CTranslate2's own random generator (`seed` goes to `ctranslate2.set_random_seed`, but
its worker threads draw on their own, so samples are not reproducible across calls): its
strings differ from ours, as any two engines' samples do; its scores are still the model's
log-probabilities.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import numpy as np

from keras_transformer.decoding.alignment import DEFAULT_SHIFT, word_alignment
from keras_transformer.decoding.long_inputs import segment_lines
from keras_transformer.decoding.results import (
    Hypothesis,
    Translation,
    line_translation,
    penalized_score,
)
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
)
from keras_transformer.decoding.translator import decoding_options

__all__ = ["force_decode_with_ctranslate2", "translate_batch_with_ctranslate2"]

EOS = "</s>"


_FOLDED = {"Cc", "Zs", "Zl", "Zp"}  # `clean_texts`' [\p{Cc}\p{Z}]


def _clean(text: str | bytes) -> str:
    """What our cleaning does (`search.clean_texts`), in Python: invalid UTF-8 replaced,
    each run of control characters and Unicode spaces folded to one space, ends stripped."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    folded = "".join(" " if unicodedata.category(c) in _FOLDED else c for c in text)
    return " ".join(part for part in folded.split(" ") if part)


def translate_batch_with_ctranslate2(
    translator, processor, texts: Sequence[str | bytes], *,
    beam_size: int = DEFAULT_BEAM_SIZE, alpha: float = DEFAULT_ALPHA, num_hypotheses: int = 1,
    target_prefix: Sequence[str | None] | None = None, sampling_topk: int = 1,
    sampling_topp: float = 1.0, sampling_temperature: float = 1.0, seed: int = 0,
    return_alignment: bool = False, max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    extra_length: int = DEFAULT_EXTRA_LENGTH, long_inputs: str = "split",
    max_batch_size: int = 32,
) -> list[Translation]:
    """`decoding.translator.translate_batch` with a CTranslate2 `Translator`.

    Args:
        translator: a `ctranslate2.Translator` on an `export_ctranslate2` directory.
        processor: a `sentencepiece.SentencePieceProcessor` on its `sentencepiece.model`.
        Others: as `translate_batch` (token scores: `force_decode_with_ctranslate2`).
    """
    import ctranslate2

    # The checks (and messages) of our own engine's `translate_batch`.
    decoding_options(
        texts, beam_size=beam_size, alpha=alpha, num_hypotheses=num_hypotheses,
        sampling_topk=sampling_topk, sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature, seed=seed, target_prefix=target_prefix,
        return_token_scores=False, return_alignment=return_alignment, return_attention=False,
        alignment_layer=-1, max_input_tokens=max_input_tokens, max_output_tokens=None,
        extra_length=extra_length, batch_size=max_batch_size, batch_tokens=1,
        jit_compile=False)
    sampling = sampling_topk != 1
    lines = [_clean(text) for text in texts]
    segments, flags = segment_lines(
        lines, lambda items: [len(processor.encode(item)) for item in items],
        max_input_tokens, long_inputs)
    sources = [processor.encode(s.text, out_type=str)[: max_input_tokens - 1]
               for s in segments]
    prefixes = None
    if target_prefix is not None:
        first = {}
        for index, segment in enumerate(segments):
            first.setdefault(segment.line, index)
        prefixes = [processor.encode(_clean(target_prefix[s.line] or ""), out_type=str)
                    if first[s.line] == index and target_prefix[s.line] else None
                    for index, s in enumerate(segments)]
    if sampling:
        ctranslate2.set_random_seed(seed)
    # Our engine lets a forced prefix longer than a line's limit through whole
    # (`decoding.loops._limits`); CTranslate2's max_decoding_length counts the prefix and would
    # cut it.
    limits = [max(len(source) + 1 + extra_length,
                  len(prefixes[number]) + 1 if prefixes and prefixes[number] else 0)
              for number, source in enumerate(sources)]
    longest = max(limits, default=0)
    results = translator.translate_batch(
        sources, target_prefix=prefixes, beam_size=beam_size,
        num_hypotheses=beam_size if beam_size > 1 else 1,
        patience=2 if beam_size > 1 else 1, length_penalty=1e-9 if beam_size > 1 else 0.0,
        return_scores=True, return_end_token=True, return_attention=return_alignment,
        max_batch_size=max_batch_size, max_decoding_length=longest, min_decoding_length=0,
        sampling_topk=sampling_topk, sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature) if sources else []
    first_rows = (_first_step_attention(translator, sources, max_batch_size)
                  if return_alignment and beam_size > 1 and len(sources) > 1 else None)
    decoded: dict[int, list] = {}
    per_segment = []
    for number, (source, result) in enumerate(zip(sources, results, strict=True)):
        limit = limits[number]
        per_segment.append([_hypothesis(
            processor, tokens, score, alpha, limit, source,
            _attention(result.attention[k], first_rows, number) if return_alignment else None,
            prefixed=bool(prefixes and prefixes[number]))
            for k, (tokens, score) in enumerate(zip(result.hypotheses, result.scores,
                                                    strict=True))])
    _rescore_marked(translator, per_segment, sources, alpha, max_batch_size)
    for number, (segment, source, hypotheses) in enumerate(zip(segments, sources, per_segment,
                                                               strict=True)):
        hypotheses.sort(key=lambda h: -h.score)
        decoded.setdefault(segment.line, []).append(
            (number, hypotheses[:num_hypotheses], source))
    return [line_translation(decoded.get(line, []), flags[line], alpha, False,
                             return_alignment) for line in range(len(lines))]


def _first_step_attention(translator, sources, max_batch_size) -> list:
    """Each source's attention at the first decoding step (the step that reads BOS).

    CTranslate2 (4.x) returns a wrong first row of attention from a beam search over a batch
    of several sources (another batch entry's row; measured on 12 of 12 Multi30k sentences
    with beam 4): it runs the first step before expanding to the beam, then gathers that
    step's attention with beam-expanded indices. Every hypothesis of a source reads the same
    BOS first, so one greedy step gives the right row for all of them."""
    first = translator.translate_batch(sources, beam_size=1, max_decoding_length=1,
                                       min_decoding_length=0, return_attention=True,
                                       return_end_token=True, max_batch_size=max_batch_size)
    return [result.attention[0][0] if result.attention and result.attention[0] else None
            for result in first]


def _attention(attention, first_rows, number):
    """A hypothesis' attention rows, the first one replaced by `_first_step_attention`'s."""
    if first_rows is None or first_rows[number] is None or not attention:
        return attention
    return [first_rows[number], *attention[1:]]


def _hypothesis(processor, tokens, score, alpha, limit, source, attention,
                prefixed: bool = False) -> Hypothesis:
    """A CTranslate2 hypothesis as ours. CTranslate2's length limit is the batch's longest
    line's; one past this line's own limit is cut there, unfinished. CTranslate2 leaves a
    forced prefix out of its score, where ours counts it. The score of either is recomputed
    by `_rescore_marked`, marked by a NaN log_prob."""
    finished = bool(tokens) and tokens[-1] == EOS and len(tokens) <= limit
    pieces = list(tokens[:-1]) if finished else [t for t in tokens if t != EOS][:limit]
    if prefixed or (not finished and len(tokens) > limit):
        score = float("nan")
    length = len(pieces) + int(finished)
    hypothesis = Hypothesis(text=processor.decode(pieces), score=penalized_score(
        score, length, alpha), log_prob=float(score), finished=finished, pieces=pieces)
    if attention is not None:
        # Rows: the generated tokens' steps; columns: the source pieces (CTranslate2 leaves
        # out the source EOS's column that ours has).
        hypothesis.attention = np.asarray(attention, np.float32)
        hypothesis.alignment = word_alignment(hypothesis.attention, source, pieces,
                                              shift=DEFAULT_SHIFT)
    return hypothesis


def _rescore_marked(translator, per_segment, sources, alpha, max_batch_size: int) -> None:
    """The log-prob of the hypotheses marked by a NaN log_prob (cut at their line's limit, or
    after a forced prefix): all their pieces' log-probs from `score_batch`, the EOS it
    appends counted only where the hypothesis finished."""
    marked = [(hypothesis, source)
              for hypotheses, source in zip(per_segment, sources, strict=True)
              for hypothesis in hypotheses if hypothesis.log_prob != hypothesis.log_prob]
    if not marked:
        return
    scored = translator.score_batch([source for _, source in marked],
                                    [hypothesis.pieces for hypothesis, _ in marked],
                                    max_batch_size=max_batch_size, max_input_length=0)
    for (hypothesis, _), result in zip(marked, scored, strict=True):
        log_probs = result.log_probs if hypothesis.finished else result.log_probs[:-1]
        hypothesis.log_prob = float(sum(log_probs))
        hypothesis.score = penalized_score(
            hypothesis.log_prob, len(hypothesis.pieces) + int(hypothesis.finished), alpha)


def force_decode_with_ctranslate2(translator, processor, sources: Sequence[str | bytes],
                                  targets: Sequence[str | Sequence[str]], *,
                                  alpha: float = DEFAULT_ALPHA,
                                  max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
                                  max_batch_size: int = 32) -> list[Translation]:
    """`decoding.translator.force_decode` through CTranslate2's `score_batch`: each target
    (text, or a list of pieces) scored after its source, EOS included; a source over
    `max_input_tokens` is truncated and flagged "truncated"."""
    source_pieces = [processor.encode(_clean(source), out_type=str) for source in sources]
    flags = [["truncated"] if len(pieces) >= max_input_tokens else []
             for pieces in source_pieces]
    source_pieces = [pieces[: max_input_tokens - 1] for pieces in source_pieces]
    target_pieces = [processor.encode(_clean(target), out_type=str)
                     if isinstance(target, (str, bytes)) else list(target)
                     for target in targets]
    scored = translator.score_batch(source_pieces, target_pieces,
                                    max_batch_size=max_batch_size, max_input_length=0)
    results = []
    for source, pieces, result, line_flags in zip(source_pieces, target_pieces, scored, flags,
                                                  strict=True):
        log_prob = float(sum(result.log_probs))
        results.append(Translation([Hypothesis(
            text=processor.decode(pieces), score=penalized_score(log_prob, len(pieces) + 1,
                                                                 alpha),
            log_prob=log_prob, finished=True, pieces=pieces,
            token_log_probs=[float(value) for value in result.log_probs])], line_flags,
            source))
    return results
