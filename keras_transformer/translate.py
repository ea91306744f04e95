"""Translate text with a trained model: `python -m keras_transformer.translate --model DIR`.

`--model` may be:
    a SavedModel folder (holds saved_model.pb, from `keras_transformer.export`);
    a `saved_models/<name>` folder: its highest integer version is used;
    a run directory (model.keras + tokenizer/, see `keras_transformer.run_directory`).
Input lines come from `--input FILE` (with a progress bar on stderr) or stdin; one result per
input line goes to stdout (or `--output`), in order, decoded in batches.

Output formats (docs/translating.md): `--format text` (default) writes the best translation
per line (`--alignment`: `TRANSLATION ||| i-j ...`, Pharaoh word links); with `--n-best N`
(N > 1) the N best as Marian writes n-best lists,
`LINE ||| TRANSLATION [||| ALIGNMENT] ||| F0= LOG_PROB ||| SCORE` (LINE counted from 0). `--format jsonl` writes one JSON object
per input line: translation, score, log_prob, finished, pieces, flags, source pieces, and the
n-best list, token log-probs and alignment when asked. Lines that were split, truncated or
cut at the output limit are flagged (in JSONL) and counted on stderr (text).
Sampling (`--sampling-topk 0` or k > 1, `--sampling-topp`, `--sampling-temperature`,
`--seed`), forced prefixes (`--prefix FILE`, one per input line), token scores and alignments
work with a run directory and with a SavedModel (its signatures, the same results; what its
export fixes, e.g. a higher --max-input-tokens, an n-best list with a prefix, is an error).
`--plot-attention OUT_DIR` also writes encoder-decoder attention heat maps of each line's
output (run directories only; not for a line split into sentences or an empty one).

Exit status: 0 translated; 1 a bad model or input file, a line over --max-input-tokens with
`--long-inputs error`, or no attention to plot (one `error:` line); 2 a malformed or invalid
flag (argparse); 4 (`EXIT_STORAGE`) the disk is full, over quota, read-only or failing while
writing `--output` (one `error:` line naming the file; nothing half-written): free space and
run the same command again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_transformer.decoding.alignment import format_pharaoh
from keras_transformer.decoding.attention_plots import plot_attention
from keras_transformer.decoding.long_inputs import LONG_INPUT_MODES, InputTooLong
from keras_transformer.decoding.results import FLAGS, Translation
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
)
from keras_transformer.decoding.translator import DEFAULT_BATCH_SIZE, DEFAULT_BATCH_TOKENS
from keras_transformer.errors import UsageError
from keras_transformer.flags import (
    add_sampling_flags,
    add_verbose_flag,
    check_search_flags,
    storage_errors_as_status,
)
from keras_transformer.logs import show_project_logs
from keras_transformer.progress import ProgressBar
from keras_transformer.serving.translator import ModelError, Translator, load_translator
from keras_transformer.text_lines import LineError, jsonl, read_lines, single_line, write_lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.translate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="SavedModel folder, saved_models/<name>, or run directory")
    parser.add_argument("--input", help="text file, one sentence per line (default: stdin)")
    parser.add_argument("--output", help="write translations here (default: stdout)")
    parser.add_argument("--format", choices=("text", "jsonl"), default="text",
                        help="text: translations (n-best: Marian's format); jsonl: one JSON "
                             "object per line with scores and flags (docs/translating.md)")
    search = parser.add_argument_group("search")
    search.add_argument("--beam", type=int, default=None,
                        help="beam size (1: greedy; default: the model's own, chosen on val "
                             "when it trained (a SavedModel: its serving_default's), else "
                             f"{DEFAULT_BEAM_SIZE}; 1 when sampling; at least --n-best)")
    search.add_argument("--alpha", type=float, default=None,
                        help="length penalty exponent of the score (default: the model's "
                             f"own, as --beam, else {DEFAULT_ALPHA})")
    search.add_argument("--n-best", type=int, default=1, metavar="N",
                        help="hypotheses per line, best first (at most --beam; without "
                             "--beam, the beam is widened to hold them)")
    add_sampling_flags(search)
    search.add_argument("--prefix", metavar="FILE",
                        help="one target prefix per input line (empty: none), forced")
    outputs = parser.add_argument_group("what each line reports")
    outputs.add_argument("--token-scores", action="store_true",
                         help="per-token log-probabilities (jsonl)")
    outputs.add_argument("--alignment", action="store_true",
                         help="source-target word alignment (Pharaoh i-j)")
    limits = parser.add_argument_group("lengths and batches")
    limits.add_argument("--max-input-tokens", type=int, default=None,
                        help="subword tokens (EOS included) decoded at once (default: "
                             f"{DEFAULT_MAX_INPUT_TOKENS}; a SavedModel's own limit)")
    limits.add_argument("--long-inputs", choices=LONG_INPUT_MODES, default="split",
                        help="a line over --max-input-tokens: split into sentences, "
                             "truncated (flagged), or an error")
    limits.add_argument("--max-output-tokens", type=int, default=None,
                        help="output tokens at most (default: --max-input-tokens + "
                             f"{DEFAULT_EXTRA_LENGTH}; a SavedModel's: + its extra length)")
    limits.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                        help="sentences per batch")
    limits.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                        help="hypotheses x (source + output) tokens per batch (bounds memory)")
    parser.add_argument("--plot-attention", metavar="OUT_DIR",
                        help="write attention heat maps (PNG) of each line's output to "
                             "OUT_DIR/line_<n>/ (not for a line split into sentences)")
    add_verbose_flag(parser)
    return parser


def _check(parser, args) -> None:
    check_search_flags(parser, args)
    if args.n_best < 1 or (args.beam is not None and args.n_best > args.beam):
        parser.error(f"--n-best must be >= 1 and at most --beam (given: --n-best {args.n_best}"
                     f"{'' if args.beam is None else f', --beam {args.beam}'})")
    if args.n_best > 1 and args.sampling_topk != 1:
        parser.error("--n-best needs a beam search: sampling draws one hypothesis a line")
    if args.token_scores and args.format != "jsonl":
        parser.error("--token-scores needs --format jsonl")


def _needs_details(args) -> bool:
    """Whether the options go beyond the best strings of a search (a SavedModel gives those
    faster: `Translator.translate_saved_model`)."""
    return (args.format == "jsonl" or args.n_best > 1 or args.sampling_topk != 1
            or args.prefix is not None or args.token_scores or args.alignment)


def _limits(args) -> dict:
    """The length options given (a run directory's defaults, or a SavedModel's)."""
    limits = {"long_inputs": args.long_inputs, "max_output_tokens": args.max_output_tokens}
    if args.max_input_tokens is not None:
        limits["max_input_tokens"] = args.max_input_tokens
    return limits


def main(argv: Sequence[str] | None = None) -> int:
    """The translate command; returns the exit status."""
    show_project_logs(to_stderr=True)  # stdout holds the results
    return storage_errors_as_status(_translate, argv, "translate: error")


def _translate(argv: Sequence[str] | None) -> int:
    """The command's work; raises `StorageError` for a full or failing disk."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    try:
        lines = read_lines(args.input)
        prefixes = None
        if args.prefix is not None:
            prefixes = read_lines(args.prefix, "--prefix")
            if len(prefixes) != len(lines):
                raise LineError(f"--prefix {args.prefix} has {len(prefixes)} lines, the input "
                                f"{len(lines)}: one prefix (or an empty line) per input line.")
        translator = load_translator(args.model)
        args.beam, args.alpha = translator.resolve_search(
            args.beam, args.alpha, sampling_topk=args.sampling_topk, num_hypotheses=args.n_best)
        if args.plot_attention and translator.model is None:
            raise ModelError("--plot-attention needs a run directory (the Keras model); a "
                             "SavedModel does not expose attention weights.")
        bar = ProgressBar(len(lines), enabled=args.input is not None)
        if translator.saved_model is not None and not _needs_details(args):
            results = None
            translations, flags = translator.translate_saved_model(
                lines, beam_size=args.beam, alpha=args.alpha, batch_size=args.batch_size,
                batch_tokens=args.batch_tokens, progress=bar.update, **_limits(args))
        else:
            results = _translate_batch(translator, lines, prefixes, args, bar)
        bar.close()
    except (ModelError, LineError, InputTooLong, UsageError) as error:
        print(f"translate: error: {error}", file=sys.stderr)
        return 1
    if results is None:
        write_lines([single_line(text) for text in translations], args.output)
        _report_flags(flags, args)
    else:
        write_lines(_formatted(results, args), args.output)
        if args.format == "text":
            _report_flags([result.flags for result in results], args)
    if args.plot_attention:
        try:
            _plot(translator, lines, results, Path(args.plot_attention))
        except (ImportError, OSError) as error:  # matplotlib missing, OUT_DIR not writable
            print(f"translate: error: {error}", file=sys.stderr)
            return 1
    return 0


# A line's flags that leave it without attention maps, and why (`_plot`).
_NOT_PLOTTED = {"split": "was split into sentences (give its sentences as lines of their own)",
                "empty_input": "is empty (nothing was decoded)"}


def _plot(translator: Translator, lines, results: list[Translation], out: Path) -> None:
    """Attention maps of each line's best output as written, over the source pieces it was
    decoded from (both forced, not searched again: a sampled, prefixed or truncated line
    too), in out/line_<n>/. A line split into sentences was decoded a sentence at a time,
    which one map of the whole line would misrepresent, and an empty line not at all."""
    for number, (line, result) in enumerate(zip(lines, results, strict=True), start=1):
        reasons = [reason for flag, reason in _NOT_PLOTTED.items() if flag in result.flags]
        if reasons:
            print(f"translate: line {number} {reasons[0]}: no attention plot", file=sys.stderr)
            continue
        best = result.hypotheses[0]
        plot_attention(translator.model, translator.tokenizer, line, out / f"line_{number}",
                       output_pieces=best.pieces, finished=best.finished,
                       source_pieces=result.source_pieces)


def _translate_batch(translator: Translator, lines, prefixes, args, bar) -> list[Translation]:
    return translator.translate_batch(
        lines, beam_size=args.beam, alpha=args.alpha, num_hypotheses=args.n_best,
        sampling_topk=args.sampling_topk, sampling_topp=args.sampling_topp,
        sampling_temperature=args.sampling_temperature, seed=args.seed,
        target_prefix=prefixes, return_token_scores=args.token_scores,
        return_alignment=args.alignment, batch_size=args.batch_size,
        batch_tokens=args.batch_tokens, progress=bar.update, **_limits(args))


def _formatted(results: list[Translation], args) -> list[str]:
    """The output lines: JSONL records, n-best lines (Marian's format), or translations."""
    if args.format == "jsonl":
        return jsonl([result.as_json(line, nbest=args.n_best > 1)
                      for line, result in enumerate(results)])
    out = []
    for line, result in enumerate(results):
        hypotheses = result.hypotheses if args.n_best > 1 else result.hypotheses[:1]
        for hypothesis in hypotheses:
            fields = [single_line(hypothesis.text)]
            if args.alignment:
                fields.append(format_pharaoh(hypothesis.alignment))
            if args.n_best > 1:  # Marian's n-best lines: the total score last
                fields = [str(line), *fields, f"F0= {hypothesis.log_prob:.6f}",
                          f"{hypothesis.score:.6f}"]
            out.append(" ||| ".join(fields))
    return out


def _report_flags(flags: list[list[str]], args) -> None:
    """One stderr line per flag that some lines carry (text output has no room for them);
    "retokenized" only with --alignment (the only text output made from the pieces)."""
    quiet = {"empty_input"} | (set() if args.alignment else {"retokenized"})
    for flag, meaning in FLAGS.items():
        lines = [number for number, line_flags in enumerate(flags, start=1)
                 if flag in line_flags]
        if lines and flag not in quiet:
            _report(len(lines), flag, meaning, lines)


def _report(count: int, flag: str, meaning: str, lines: list[int]) -> None:
    shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
    print(f"translate: {count} line(s) {flag} ({meaning}): line {shown}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
