"""Translate text with a trained model: `python -m keras_transformer.translate --model DIR`.

`--model` may be:
    a SavedModel folder (holds saved_model.pb, from `keras_transformer.export`);
    a `saved_models/<name>` folder: its highest integer version is used;
    a run directory (model.keras + tokenizer/, see `keras_transformer.run_directory`).
Input lines come from `--input FILE` (with a progress bar on stderr) or stdin; one
translation per input line goes to stdout (or `--output`), in order, decoded in batches.
`--plot-attention OUT_DIR` also writes encoder-decoder attention heat maps for each line
(run directories only: a SavedModel does not expose attention).

Exit status: 0 translated; 1 a bad model or input file, or no attention to plot (one `error:`
line); 2 a malformed or invalid flag (argparse); 4 (`EXIT_STORAGE`) the disk is full, over
quota, read-only or failing while writing `--output` (one `error:` line naming the file;
nothing half-written): free space and run the same command again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_transformer.decoding.attention_plots import plot_attention
from keras_transformer.decoding.search import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.decoding.translator import ModelError, load_translator
from keras_transformer.flags import add_verbose_flag, storage_errors_as_status
from keras_transformer.progress import ProgressBar
from pipelines import storage


def _read_lines(source: str | None) -> list[bytes]:
    """Input lines as bytes (the model copes with any encoding), without line ends."""
    if source is None:
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as error:
            raise ModelError(f"cannot read --input {source}: {error.strerror}") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r") for line in lines]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.translate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="SavedModel folder, saved_models/<name>, or run directory")
    parser.add_argument("--input", help="text file, one sentence per line (default: stdin)")
    parser.add_argument("--output", help="write translations here (default: stdout)")
    parser.add_argument("--beam", type=int, default=DEFAULT_BEAM_SIZE, help="beam size (1: greedy)")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="length penalty")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    parser.add_argument("--plot-attention", metavar="OUT_DIR",
                        help="write attention heat maps (PNG) per line to OUT_DIR/line_<n>/")
    add_verbose_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The translate command; returns the exit status."""
    return storage_errors_as_status(_translate, argv, "translate: error")


def _translate(argv: Sequence[str] | None) -> int:
    """The command's work; raises `StorageError` for a full or failing disk."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.beam < 1 or args.batch_size < 1 or args.alpha < 0:
        parser.error("--beam and --batch-size must be >= 1, --alpha >= 0")
    try:
        lines = _read_lines(args.input)
        translator = load_translator(args.model)
        if args.plot_attention and translator.model is None:
            raise ModelError("--plot-attention needs a run directory (the Keras model); a "
                             "SavedModel does not expose attention weights.")
    except ModelError as error:
        print(f"translate: error: {error}", file=sys.stderr)
        return 1
    bar = ProgressBar(len(lines), enabled=args.input is not None)
    translations = translator.translate(lines, beam_size=args.beam, alpha=args.alpha,
                                        batch_size=args.batch_size, progress=bar.update)
    bar.close()
    # A translation must stay on one line, or the output would lose its alignment.
    text = "".join(" ".join(t.splitlines()) + "\n" for t in translations)
    if args.output:
        storage.write_text(args.output, text)  # the old file or all of the new one
    else:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
    if args.plot_attention:
        try:
            for number, line in enumerate(lines, start=1):
                plot_attention(translator.model, translator.tokenizer, line,
                               Path(args.plot_attention) / f"line_{number}",
                               beam_size=args.beam, alpha=args.alpha)
        except (ImportError, OSError) as error:  # matplotlib missing, OUT_DIR not writable
            print(f"translate: error: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
