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

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)

from keras_transformer.decoding.alignment import DEFAULT_ALIGNMENT_LAYER
from keras_transformer.decoding.batch_decoder import (
    BatchDecoder,
    DecodingOptions,
    clean_lines,
    count_tokens,
    encode_targets,
    length_batches,
    line_numbers,
)
from keras_transformer.decoding.long_inputs import Segment, segment_lines
from keras_transformer.decoding.results import Translation, line_translation
from keras_transformer.decoding.sampling import Sampling
from keras_transformer.decoding.scoring import score_translations
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
    encode_texts,
)
from pipelines import storage

__all__ = ["DecodingOptions", "decoding_options", "force_decode", "length_batches",
           "translate_and_score", "translate_batch", "translate_texts"]

Progress = Callable[[int], None]
DEFAULT_BATCH_SIZE = 64
# Bounds a batch's memory whatever its lines' lengths: hypotheses x (source + output) tokens.
DEFAULT_BATCH_TOKENS = 65_536


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
    return_attention: bool = False,
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
        return_alignment: fill `alignment` (word links).
        return_attention: also keep the attention behind it (`Hypothesis.attention`, one
            (T, S) matrix a hypothesis; not for split lines).
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
    options = decoding_options(
        texts, beam_size=beam_size, alpha=alpha, num_hypotheses=num_hypotheses,
        sampling_topk=sampling_topk, sampling_topp=sampling_topp,
        sampling_temperature=sampling_temperature, seed=seed, target_prefix=target_prefix,
        return_token_scores=return_token_scores, return_alignment=return_alignment,
        return_attention=return_attention, alignment_layer=alignment_layer,
        max_input_tokens=max_input_tokens, max_output_tokens=max_output_tokens,
        extra_length=extra_length, batch_size=batch_size, batch_tokens=batch_tokens,
        jit_compile=jit_compile)
    lines = clean_lines(texts)
    line_indices = line_numbers(line_indices, len(lines))
    segments, flags = segment_lines(lines, lambda items: count_tokens(tokenizer, items),
                                    max_input_tokens, long_inputs)
    decoded = BatchDecoder(model, tokenizer, options, target_prefix, line_indices).run(
        segments, max_input_tokens, batch_size, batch_tokens, progress, len(lines))
    return [line_translation(decoded.get(line, []), flags[line], options.alpha,
                             options.return_token_scores, options.return_alignment)
            for line in range(len(lines))]


def decoding_options(
    texts: Sequence, *, beam_size: int, alpha: float, num_hypotheses: int, sampling_topk: int,
    sampling_topp: float, sampling_temperature: float, seed: int,
    target_prefix: Sequence | None, return_token_scores: bool, return_alignment: bool,
    return_attention: bool, alignment_layer: int, max_input_tokens: int,
    max_output_tokens: int | None, extra_length: int, batch_size: int, batch_tokens: int,
    jit_compile: bool,
) -> DecodingOptions:
    """`translate_batch`'s arguments checked and gathered: one set of checks, and one set of
    `ValueError`s, for every engine that takes them (`serving.saved_model_translation`)."""
    options = DecodingOptions(
        beam_size=beam_size, alpha=alpha, num_hypotheses=num_hypotheses,
        sampling=_sampling(sampling_topk, sampling_topp, sampling_temperature, seed),
        max_output_tokens=(max_input_tokens + extra_length if max_output_tokens is None
                           else max_output_tokens),
        extra_length=extra_length, return_token_scores=return_token_scores,
        return_alignment=return_alignment or return_attention,
        return_attention=return_attention, alignment_layer=alignment_layer,
        jit_compile=jit_compile)
    if batch_size < 1 or batch_tokens < 1 or max_input_tokens < 2:
        raise ValueError("batch_size and batch_tokens must be >= 1, max_input_tokens >= 2.")
    if target_prefix is not None and len(target_prefix) != len(texts):
        raise ValueError(f"{len(target_prefix)} target prefixes for {len(texts)} lines.")
    return options


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


def translate_and_score(model, tokenizer, sources: Sequence[str], references: Sequence[str],
                        hypotheses_file: str | os.PathLike, beam_size: int = DEFAULT_BEAM_SIZE,
                        alpha: float = DEFAULT_ALPHA) -> tuple[list[str], dict[str, Any]]:
    """Translates `sources` (`translate_texts`), keeps the translations in `hypotheses_file`
    (one a line, written atomically, for `sacrebleu REF -i A B --paired-bs` later) and
    scores them against `references` (`decoding.scoring.score_translations`).

    Returns:
        (translations, scores): one translation per source; {"bleu", "chrf", ...}.
    """
    hypotheses = translate_texts(model, tokenizer, sources, beam_size=beam_size, alpha=alpha)
    storage.write_text(hypotheses_file, "".join(line + "\n" for line in hypotheses))
    return hypotheses, score_translations(hypotheses, references)


def force_decode(
    model,
    tokenizer,
    sources: Sequence[str | bytes],
    targets: Sequence[str | bytes | Sequence[str]],
    *,
    alpha: float = DEFAULT_ALPHA,
    return_alignment: bool = False,
    return_attention: bool = False,
    alignment_layer: int = DEFAULT_ALIGNMENT_LAYER,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    max_output_tokens: int = DEFAULT_MAX_INPUT_TOKENS + DEFAULT_EXTRA_LENGTH,
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
        max_output_tokens: target tokens scored at most (EOS included): a longer target is
            cut (its first tokens, then EOS) and flagged "target_truncated".
        Others as in `translate_batch`.

    Returns:
        N `Translation`s with one (finished) hypothesis: the target.
    """
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets.")
    if long_inputs not in ("error", "truncate"):
        raise ValueError("force_decode takes long_inputs 'error' or 'truncate'.")
    if max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}.")
    options = DecodingOptions(alpha=alpha, return_token_scores=True,
                              return_alignment=return_alignment or return_attention,
                              return_attention=return_attention,
                              alignment_layer=alignment_layer)
    lines = clean_lines(sources)
    segments, flags = segment_lines(lines, lambda items: count_tokens(tokenizer, items),
                                    max_input_tokens, long_inputs)
    for line in range(len(lines)):
        if not lines[line]:  # an empty source is still scored: the model reads [EOS]
            segments.append(Segment(line, ""))
    segments.sort(key=lambda segment: segment.line)
    decoder = BatchDecoder(model, tokenizer, options, None, list(range(len(lines))))
    source_ids = encode_texts(tokenizer, tf.constant([s.text for s in segments], tf.string),
                              max_input_tokens)
    target_ids, cut = encode_targets(tokenizer, [targets[s.line] for s in segments],
                                     max_output_tokens)
    for segment, target_cut in zip(segments, cut, strict=True):
        if target_cut:
            flags[segment.line].append("target_truncated")
    results = [None] * len(lines)
    lengths = np.maximum(source_ids.row_lengths().numpy(), target_ids.row_lengths().numpy())
    done = 0
    for rows in length_batches(lengths, batch_size, batch_tokens):
        source = tf.gather(source_ids, rows).to_tensor()
        ids = tf.gather(target_ids, rows).to_tensor()
        hypotheses, source_pieces = decoder.hypotheses(source, ids[:, None, :],
                                                       log_probs=None)
        for row, hypothesis, pieces in zip(rows, hypotheses, source_pieces, strict=True):
            line = segments[row].line
            results[line] = Translation(hypothesis, flags[line], pieces)
        done += len(rows)
        if progress is not None:
            progress(done)
    return results


