"""Back-translate monolingual text into synthetic training pairs (Sennrich et al. 2016):
`python -m keras_transformer.back_translate --model REVERSE_RUN --input MONO --out DIR
--src SRC --tgt TGT`.

`--src` and `--tgt` are the languages of the FORWARD model you will train: the monolingual
`--input` is in `--tgt`, and `--model` is a run directory of the REVERSE model, trained
`--tgt`→`--src` (e.g. an en→de run to make extra de→en pairs from English text). `--out`
becomes a corpus folder that `train --data DIR` (split train) reads: `train.SRC` (the
synthetic translations), `train.TGT` (the monolingual lines), `provenance.json` (model and
input fingerprints, every option, counts, speed, code version, `complete`) and
`progress.json`. Greedy search by default (best below ~100k real pairs, Edunov et al.
2018); `--sampling-topk 0` (or K > 1) with `--seed` samples instead, reproducibly.

Interrupted (Ctrl-C, a kill, a full disk)? Run the same command again: it checks that the
options match, drops what the last chunk half-wrote and goes on; the files come out
byte-identical to an uninterrupted run. A finished folder is left alone. `--max-lines N`
translates the first N lines only (a larger N later continues the folder).
docs/back_translation.md has the details.

Exit status: 0 done (or already done); 2 a bad flag, model, input or output folder, or
options other than the folder was made with (one `error:` line); 4 (`EXIT_STORAGE`) the disk
is full, over quota, read-only or failing (what was written stays: free space and run the
same command again); 130 interrupted (run the same command to resume).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keras_transformer.decoding.back_translation import (
    CLEANUPS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CHUNK_LINES,
    back_translate,
)
from keras_transformer.decoding.long_inputs import LONG_INPUT_MODES
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
)
from keras_transformer.decoding.translator import DEFAULT_BATCH_TOKENS
from keras_transformer.flags import (
    add_sampling_flags,
    add_verbose_flag,
    check_search_flags,
    storage_errors_as_status,
)
from keras_transformer.logs import show_project_logs
from keras_transformer.progress import ProgressBar

PROG = "back_translate"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.back_translate",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="--src/--tgt are the FORWARD model's languages; --model translates "
               "--tgt to --src. docs/back_translation.md")
    parser.add_argument("--model", required=True,
                        help="run directory of the REVERSE model (trained --tgt -> --src)")
    parser.add_argument("--input", required=True,
                        help="monolingual text in --tgt, one sentence per line (UTF-8, .gz ok)")
    parser.add_argument("--out", required=True,
                        help="output folder: train.SRC, train.TGT, provenance.json (resumed "
                             "if it exists)")
    parser.add_argument("--src", required=True,
                        help="source language of the forward model (the synthetic side), e.g. de")
    parser.add_argument("--tgt", required=True,
                        help="target language of the forward model (the monolingual input), "
                             "e.g. en")
    parser.add_argument("--cleanup", choices=CLEANUPS, default="none",
                        help="the monolingual lines, before translating: none; filter (drop "
                             "lines starting in lower case or without final punctuation); "
                             "normalize (upper-case the first letter, add a final '.')")
    parser.add_argument("--max-lines", type=int, default=None, metavar="N",
                        help="translate the first N lines only (again with a larger N: go on)")
    search = parser.add_argument_group("search (as translate's flags)")
    search.add_argument("--beam", type=int, default=1, help="beam size (1: greedy)")
    search.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help="length penalty exponent (beam search)")
    add_sampling_flags(search)
    limits = parser.add_argument_group("lengths, batches, chunks")
    limits.add_argument("--max-input-tokens", type=int, default=DEFAULT_MAX_INPUT_TOKENS,
                        help="subword tokens (EOS included) decoded at once")
    limits.add_argument("--long-inputs", choices=LONG_INPUT_MODES, default="split",
                        help="a line over --max-input-tokens: split into sentences, "
                             "truncated (flagged), or an error")
    limits.add_argument("--max-output-tokens", type=int, default=None,
                        help="output tokens at most (default: --max-input-tokens + "
                             f"{DEFAULT_EXTRA_LENGTH})")
    limits.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="sentences per batch (the output does not depend on it)")
    limits.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                        help="hypotheses x (source + output) tokens per batch (bounds memory)")
    limits.add_argument("--chunk-lines", type=int, default=DEFAULT_CHUNK_LINES,
                        help="lines written between two progress records (what a kill loses)")
    add_verbose_flag(parser)
    return parser


def _check(parser, args) -> None:
    check_search_flags(parser, args)
    if args.chunk_lines < 1:
        parser.error("--chunk-lines must be >= 1")
    if args.max_lines is not None and args.max_lines < 0:
        parser.error("--max-lines must be >= 0")
    if args.src == args.tgt:
        parser.error(f"--src and --tgt are both {args.src!r}: they name the forward model's "
                     "two languages")


def main(argv: Sequence[str] | None = None) -> int:
    """The back_translate command; returns the exit status."""
    show_project_logs()  # progress lines on stdout (a previous command may have moved them)
    return storage_errors_as_status(_back_translate, argv, f"{PROG}: error")


def _back_translate(argv: Sequence[str] | None) -> int:
    """The command's work; raises `StorageError` for a full or failing disk."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    bar: ProgressBar | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = ProgressBar(total)
        bar.update(done)

    print(f"{PROG}: {args.tgt}→{args.src} with {args.model}: {args.input} -> {args.out} "
          f"(train.{args.src} synthetic, train.{args.tgt} genuine)", file=sys.stderr)
    try:
        record = back_translate(
            args.model, args.input, args.out, src_lang=args.src, tgt_lang=args.tgt,
            beam_size=args.beam, alpha=args.alpha, sampling_topk=args.sampling_topk,
            sampling_topp=args.sampling_topp, sampling_temperature=args.sampling_temperature,
            seed=args.seed, max_input_tokens=args.max_input_tokens,
            max_output_tokens=args.max_output_tokens, long_inputs=args.long_inputs,
            cleanup=args.cleanup, max_lines=args.max_lines, chunk_lines=args.chunk_lines,
            batch_size=args.batch_size, batch_tokens=args.batch_tokens, progress=progress)
    except ValueError as error:  # UsageError (BackTranslationError), CorpusError, options
        if bar is not None:
            bar.close()
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print(f"{PROG}: interrupted; the chunks written are kept: run the same command to "
              "resume", file=sys.stderr)
        return 130
    if bar is not None:
        bar.close()
    for line in summary(record):
        print(f"{PROG}: {line}", file=sys.stderr)
    return 0


def summary(record: dict) -> list[str]:
    """What a run did, in a few lines (from `back_translate`'s record)."""
    session, counts = record["session"], record.get("counts") or {}
    lines = []
    if session["action"] in ("started", "resumed"):
        where = "" if session["action"] == "started" else f" from line {session['from_line']:,}"
        lines.append(f"{session['action']}{where}: translated {session['lines_translated']:,} "
                     "lines")
    else:
        lines.append(f"{session['action']}: nothing to do")
    if counts:
        dropped = [f"{counts[key]:,} {what}" for key, what in (
            ("empty_lines", "empty lines skipped"),
            ("cleanup_dropped", "dropped by --cleanup filter"),
            ("cleanup_changed", "changed by --cleanup normalize"),
            ("empty_translations", "empty translations dropped")) if counts.get(key)]
        flags = ", ".join(f"{count:,} {flag}" for flag, count in sorted(counts["flags"].items()))
        lines.append(f"{record['lines_done']:,} of {record['input']['lines']:,} lines done, "
                     f"{counts['pairs_written']:,} pairs written"
                     + (f" ({'; '.join(dropped)})" if dropped else "")
                     + (f"; flags: {flags}" if flags else ""))
    speed = record.get("throughput") or {}
    if speed.get("lines_per_second"):
        lines.append(f"{speed['lines_per_second']:,.1f} lines/s, "
                     f"{speed['output_tokens_per_second']:,.0f} output tokens/s "
                     f"({speed['decode_seconds']:,.1f} s decoding, all sessions)")
    state = "complete" if record.get("complete") else (
        "not complete (--max-lines: run again with a larger N, or without it, to go on)")
    lines.append(f"{state}: train.{record['src_lang']}, train.{record['tgt_lang']} and "
                 "provenance.json in the output folder")
    return lines


if __name__ == "__main__":
    sys.exit(main())
