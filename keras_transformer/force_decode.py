"""Score given translations with a trained model (forced decoding):
`python -m keras_transformer.force_decode --model RUN_DIR --source FILE --target FILE`.

What `marian-scorer`, `fairseq-generate --score-reference` and CTranslate2's `score_batch` do:
each target line is forced through the decoder after its source line, and the model's
log-probability of it (EOS included) is reported, as `translate` reports a hypothesis'
(docs/translating.md: scores). Text output: one `LOG_PROB<TAB>SCORE` line per pair
(SCORE = LOG_PROB / ((5 + tokens) / 6) ** alpha); `--format jsonl`: one object per pair with
the pieces, token log-probabilities and flags (and `--alignment`'s word links).
`--pieces`: the target lines are subword pieces separated by spaces (a `translate` JSONL
`pieces` list joined), scored exactly as given instead of tokenized again.

Exit status: 0 scored; 1 a bad model or input file, files of different lengths, or a source
over --max-input-tokens with `--long-inputs error`; 2 a malformed flag; 4 a full or failing
disk while writing --output (nothing half-written).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keras_transformer.decoding.long_inputs import InputTooLong
from keras_transformer.decoding.search import DEFAULT_ALPHA, DEFAULT_MAX_INPUT_TOKENS
from keras_transformer.decoding.translator import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_BATCH_TOKENS,
    force_decode,
)
from keras_transformer.errors import UsageError
from keras_transformer.flags import add_verbose_flag, storage_errors_as_status
from keras_transformer.logs import show_project_logs
from keras_transformer.progress import ProgressBar
from keras_transformer.serving.translator import ModelError, load_translator
from keras_transformer.text_lines import LineError, jsonl, read_lines, write_lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.force_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="run directory")
    parser.add_argument("--source", required=True, help="source lines")
    parser.add_argument("--target", required=True, help="target lines, one per source line")
    parser.add_argument("--pieces", action="store_true",
                        help="target lines are space-separated subword pieces")
    parser.add_argument("--output", help="write the scores here (default: stdout)")
    parser.add_argument("--format", choices=("text", "jsonl"), default="text")
    parser.add_argument("--alpha", type=float, default=None,
                        help="length penalty exponent of SCORE (default: the run's own, as "
                             f"translate decodes with, else {DEFAULT_ALPHA})")
    parser.add_argument("--alignment", action="store_true",
                        help="word alignment of each pair (jsonl)")
    parser.add_argument("--max-input-tokens", type=int, default=DEFAULT_MAX_INPUT_TOKENS,
                        help="source subword tokens (EOS included) at most")
    parser.add_argument("--long-inputs", choices=("error", "truncate"), default="error",
                        help="a source over --max-input-tokens: an error, or truncated "
                             "(flagged)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS)
    add_verbose_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The force_decode command; returns the exit status."""
    show_project_logs(to_stderr=True)  # stdout holds the results
    return storage_errors_as_status(_score, argv, "force_decode: error")


def _score(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.batch_tokens < 1 or args.max_input_tokens < 2 or (
            args.alpha is not None and not 0 <= args.alpha < float("inf")):
        parser.error("--batch-size, --batch-tokens >= 1, --alpha >= 0, --max-input-tokens >= 2")
    if args.alignment and args.format != "jsonl":
        parser.error("--alignment needs --format jsonl")
    try:
        sources = read_lines(args.source, "--source")
        targets = read_lines(args.target, "--target")
        if len(sources) != len(targets):
            raise LineError(f"--source has {len(sources)} lines, --target {len(targets)}: "
                            "one target per source line.")
        if args.pieces:
            targets = [line.decode("utf-8", "replace").split() for line in targets]
        translator = load_translator(args.model)
        if translator.model is None:
            raise ModelError(f"{translator.path}: forced decoding needs a run directory (the "
                             "Keras model), not a SavedModel.")
        _, alpha = translator.resolve_search(1, args.alpha)
        bar = ProgressBar(len(sources), enabled=True)
        results = force_decode(
            translator.model, translator.tokenizer, sources, targets, alpha=alpha,
            return_alignment=args.alignment, max_input_tokens=args.max_input_tokens,
            long_inputs=args.long_inputs, batch_size=args.batch_size,
            batch_tokens=args.batch_tokens, progress=bar.update)
        bar.close()
    except (ModelError, LineError, InputTooLong, UsageError) as error:
        print(f"force_decode: error: {error}", file=sys.stderr)
        return 1
    if args.format == "jsonl":
        write_lines(jsonl([result.as_json(line) for line, result in enumerate(results)]),
                    args.output)
    else:
        write_lines([f"{result.hypotheses[0].log_prob:.6f}\t{result.hypotheses[0].score:.6f}"
                     for result in results], args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
