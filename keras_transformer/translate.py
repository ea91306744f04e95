"""Translate text with a trained model: `python -m keras_transformer.translate --model DIR`.

`--model` may be:
    a SavedModel folder (holds saved_model.pb, from `keras_transformer.export`);
    a `saved_models/<name>` folder: its highest integer version is used;
    a run directory (model.keras + tokenizer/, see `keras_transformer.artifacts`).
Input lines come from `--input FILE` (with a progress bar on stderr) or stdin; one
translation per input line goes to stdout (or `--output`), in order, decoded in batches.
`--plot-attention OUT_DIR` also writes encoder-decoder attention heat maps for each line
(run directories only: a SavedModel does not expose attention).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from keras_transformer.decoding import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.export import latest_version

__all__ = ["ModelError", "ProgressBar", "Translator", "load_translator", "main"]

Progress = Callable[[int], None]


class ModelError(Exception):
    """`--model` is not something that can translate (message says what was expected)."""


class Translator:
    """Translates lists of texts with a Keras model (run directory) or a SavedModel."""

    def __init__(self, path: Path, model=None, tokenizer=None, saved_model=None):
        self.path = path
        self.model, self.tokenizer, self.saved_model = model, tokenizer, saved_model

    def translate(self, texts: Sequence[str | bytes], beam_size: int = DEFAULT_BEAM_SIZE,
                  alpha: float = DEFAULT_ALPHA, batch_size: int = 64,
                  progress: Progress | None = None) -> list[str]:
        """N translations of N texts, in order."""
        if self.saved_model is None:
            from keras_transformer.evaluate import translate_texts

            return translate_texts(self.model, self.tokenizer, texts, beam_size=beam_size,
                                   alpha=alpha, batch_size=batch_size, progress=progress)
        return self._translate_saved_model(texts, beam_size, alpha, batch_size, progress)

    def _translate_saved_model(self, texts, beam_size, alpha, batch_size, progress):
        import tensorflow as tf

        signature = self.saved_model.signatures["translate"]
        # Similar lengths per request: the server pads each request to its longest line.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        results = [""] * len(texts)
        for start in range(0, len(order), batch_size):
            rows = order[start: start + batch_size]
            outputs = signature(inputs=tf.constant([texts[i] for i in rows], tf.string),
                                beam_size=tf.constant(beam_size, tf.int32),
                                alpha=tf.constant(alpha, tf.float32))["outputs"]
            for row, text in zip(rows, outputs.numpy(), strict=True):
                results[row] = text.decode("utf-8", errors="replace")
            if progress is not None:
                progress(start + len(rows))
        return results


def _saved_model_dir(path: Path) -> Path | None:
    """`path` if it is a SavedModel, else its highest integer version, else None."""
    if (path / "saved_model.pb").is_file():
        return path
    version = latest_version(path)
    return None if version is None else path / str(version)


def load_translator(path: str | Path) -> Translator:
    """A `Translator` for a SavedModel, a saved_models/<name> folder or a run directory.

    Raises:
        ModelError: if `path` is none of these (or cannot be loaded).
    """
    from keras_transformer import artifacts

    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: no such directory; pass a run directory or a SavedModel.")
    saved = _saved_model_dir(path)
    try:
        if saved is not None:
            import tensorflow as tf
            import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)

            loaded = tf.saved_model.load(str(saved))
            if "translate" not in loaded.signatures:
                raise ModelError(f"{saved}: a SavedModel without a 'translate' signature; "
                                 "export it with keras_transformer.export.")
            return Translator(saved, saved_model=loaded)
        if artifacts.is_run_dir(path):
            model, tokenizer = artifacts.load_run(path)
            return Translator(path, model=model, tokenizer=tokenizer)
    except ModelError:
        raise
    except Exception as error:  # a corrupt file: report it, no traceback
        raise ModelError(f"{path}: cannot be loaded ({type(error).__name__}: {error})") from None
    raise ModelError(
        f"{path}: not a model directory: expected a SavedModel (saved_model.pb), a "
        f"saved_models/<name> folder with integer versions, or a run directory "
        f"({artifacts.MODEL_FILE} and {artifacts.TOKENIZER_DIR}/).")


class ProgressBar:
    """A one-line progress bar on stderr (nothing when `total` is 0 or `enabled` is False)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.enabled, self.width = total, enabled and total > 0, width

    def update(self, done: int) -> None:
        if self.enabled:
            filled = self.width * done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                             f"{done}/{self.total} sentences")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The translate command; returns the exit status."""
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
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
    if args.plot_attention:
        from keras_transformer.plots import plot_attention

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
