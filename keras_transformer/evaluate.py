"""Translate a test set and score it with sacreBLEU: BLEU (13a, cased, detokenized) and chrF.

Library (used by training at the end of a run):
    translate_texts(model, tokenizer, texts, beam_size=4, alpha=0.6, batch_size=64)
    score(hypotheses, references) -> {"bleu", "chrf", "bleu_signature", "chrf_signature", ...}

Command line:
    python -m keras_transformer.evaluate --model DIR --src-file F --ref-file F [--json]
    python -m keras_transformer.evaluate --model DIR --data FOLDER --split test_2016_flickr \\
        --src de --tgt en
`--model` is a run directory, a SavedModel version folder, or a `saved_models/<name>` folder
(its highest version). Problems with the inputs print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from keras_transformer.decoding import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
    beam_search,
    encode_texts,
    greedy_search,
)

__all__ = ["score", "translate_texts", "main"]


def _as_text(value: bytes) -> str:
    # Byte pieces can decode to invalid UTF-8; never fail on a model's output.
    return value.decode("utf-8", errors="replace")


def translate_texts(
    model,
    tokenizer,
    texts: Sequence[str | bytes],
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    batch_size: int = 64,
    extra_length: int = DEFAULT_EXTRA_LENGTH,
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
    progress: Callable[[int], None] | None = None,
    jit_compile: bool = False,
) -> list[str]:
    """Translations of `texts`, in order, decoded in batches of similar length.

    Args:
        model: a `Transformer` (float32 or mixed precision).
        tokenizer: its `SubwordTokenizer`.
        texts: N sentences (str, or bytes in any encoding: invalid UTF-8 is replaced).
        beam_size: 1 uses greedy decoding (alpha is then unused).
        alpha: length penalty exponent.
        batch_size: sentences per decoding batch.
        extra_length: output tokens allowed beyond the source length.
        max_input_tokens: longer sources are truncated (EOS included).
        progress: called with the number of sentences finished after each batch.
        jit_compile: XLA-compile the decoder step (see `decoding.greedy_search`).

    Returns:
        N translated strings.
    """
    if batch_size < 1 or beam_size < 1:
        raise ValueError("batch_size and beam_size must be >= 1.")
    if not texts:
        return []
    sources = encode_texts(tokenizer, tf.constant(list(texts), tf.string), max_input_tokens)
    # Longest first: similar lengths share a batch (little padding, similar step counts),
    # and a batch too large for memory fails at once rather than at the end.
    order = np.argsort(-sources.row_lengths().numpy(), kind="stable")
    results: list[str] = [""] * len(texts)
    done = 0
    for start in range(0, len(order), batch_size):
        rows = order[start: start + batch_size]
        batch = tf.gather(sources, rows).to_tensor()
        if beam_size == 1:
            ids, _ = greedy_search(model, batch, extra_length=extra_length,
                                   jit_compile=jit_compile)
        else:
            ids, _ = beam_search(model, batch, beam_size=beam_size, alpha=alpha,
                                 extra_length=extra_length, jit_compile=jit_compile)
        for row, text in zip(rows, tokenizer.detokenize(ids).numpy(), strict=True):
            results[row] = _as_text(text)
        done += len(rows)
        if progress is not None:
            progress(done)
    return results


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU (sacreBLEU defaults: 13a tokenization, cased) and chrF, with signatures.

    Both sides are detokenized text; one reference per hypothesis.

    Returns:
        {"bleu": float, "chrf": float, "bleu_signature": str, "chrf_signature": str,
         "bleu_details": str (n-gram precisions, brevity penalty), "sentences": int}

    Raises:
        ValueError: if the lists differ in length or are empty.
    """
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references.")
    if not hypotheses:
        raise ValueError("nothing to score: no sentences.")
    bleu, chrf = BLEU(), CHRF()
    bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
    chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": float(bleu_score.score),
        "chrf": float(chrf_score.score),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_details": str(bleu_score),
        "sentences": len(hypotheses),
    }


class UsageError(Exception):
    """A bad command-line input: printed as one line, exit status 1."""


def _read_pair(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    from pipelines.textfiles import CorpusError, read_text_file

    try:
        if args.data:
            from pipelines.corpora import load_corpus

            corpus = load_corpus(args.data, args.split, args.src, args.tgt)
            return list(corpus.sources), list(corpus.targets)
        sources, references = read_text_file(args.src_file), read_text_file(args.ref_file)
    except CorpusError as error:
        raise UsageError(str(error)) from None
    if len(sources) != len(references):
        raise UsageError(
            f"{args.src_file} has {len(sources)} lines but {args.ref_file} has "
            f"{len(references)}; line i of the references must translate line i of the source.")
    return sources, references


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="run directory, SavedModel folder or saved_models/<name>")
    parser.add_argument("--src-file", help="source sentences, one per line (.gz ok)")
    parser.add_argument("--ref-file", help="reference translations, aligned with --src-file")
    parser.add_argument("--data", help="corpus folder ({split}.{lang}[.gz]) or tfds:NAME")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--src", help="source language code (with --data)")
    parser.add_argument("--tgt", help="target language code (with --data)")
    parser.add_argument("--beam", type=int, default=DEFAULT_BEAM_SIZE, help="beam size (1: greedy)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="length penalty")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", help="also write the translations to this file")
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The evaluate command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data:
        if not (args.src and args.tgt):
            parser.error("--data needs --src and --tgt")
    elif not (args.src_file and args.ref_file):
        parser.error("give --src-file and --ref-file, or --data with --src and --tgt")
    if args.beam < 1 or args.batch_size < 1 or args.alpha < 0:
        parser.error("--beam and --batch-size must be >= 1, --alpha >= 0")
    from keras_transformer.translate import ModelError, ProgressBar, load_translator

    try:
        sources, references = _read_pair(args)
        translator = load_translator(args.model)
    except (UsageError, ModelError) as error:
        print(f"evaluate: error: {error}", file=sys.stderr)
        return 1
    bar = ProgressBar(len(sources))
    hypotheses = translator.translate(sources, beam_size=args.beam, alpha=args.alpha,
                                      batch_size=args.batch_size, progress=bar.update)
    bar.close()
    if args.output:
        Path(args.output).write_text("".join(line + "\n" for line in hypotheses),
                                     encoding="utf-8")
    result = score(hypotheses, references)
    result.update(model=str(args.model), beam_size=args.beam, alpha=args.alpha)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"BLEU = {result['bleu']:.2f}  ({result['bleu_signature']})")
        print(f"       {result['bleu_details']}")
        print(f"chrF = {result['chrf']:.2f}  ({result['chrf_signature']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
