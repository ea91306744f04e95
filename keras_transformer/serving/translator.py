"""One home for loading a translator: a run directory (the Keras model and its tokenizer) or
a SavedModel, behind one interface (the `translate` and `evaluate` commands, `kt.Translator`).

    Translator.load(path).translate(texts)  # best strings
    Translator.load(run_dir).translate_batch(texts, num_hypotheses=4)  # `Translation`s

It sits in `serving` because it loads what `serving` exports; `decoding` (which it calls for
run directories) never imports `serving`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)

from keras_transformer import run_directory
from keras_transformer.decoding.results import Translation
from keras_transformer.decoding.search import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.decoding.translator import translate_batch, translate_texts
from keras_transformer.serving.saved_model import latest_version

__all__ = ["ModelError", "Translator", "load_translator"]

Progress = Callable[[int], None]


class ModelError(Exception):
    """`--model` is not something that can translate (message says what was expected)."""


class Translator:
    """Translates lists of texts with a Keras model (run directory) or a SavedModel."""

    def __init__(self, path: Path, model=None, tokenizer=None, saved_model=None):
        self.path = path
        self.model, self.tokenizer, self.saved_model = model, tokenizer, saved_model

    @classmethod
    def load(cls, path: str | Path) -> Translator:
        """A run directory, a SavedModel or a `saved_models/<name>` folder (`load_translator`)."""
        return load_translator(path)

    def translate(self, texts: Sequence[str | bytes], beam_size: int = DEFAULT_BEAM_SIZE,
                  alpha: float = DEFAULT_ALPHA, batch_size: int = 64,
                  progress: Progress | None = None) -> list[str]:
        """N translations of N texts, in order."""
        if self.saved_model is None:
            return translate_texts(self.model, self.tokenizer, texts, beam_size=beam_size,
                                   alpha=alpha, batch_size=batch_size, progress=progress)
        return self.translate_saved_model(texts, beam_size, alpha, batch_size, progress)[0]

    def translate_batch(self, texts: Sequence[str | bytes], **options) -> list[Translation]:
        """`decoding.translator.translate_batch` with this run's model and tokenizer: n-best
        lists, scores, sampling, prefixes, alignments, long inputs.

        Raises:
            ModelError: for a SavedModel (its `translate` and `translate_nbest` signatures
                give strings and scores only).
        """
        if self.saved_model is not None:
            raise ModelError(
                f"{self.path}: a SavedModel gives strings and scores through its 'translate' "
                "and 'translate_nbest' signatures; n-best lists with token scores, sampling, "
                "prefixes and alignments need the run directory.")
        return translate_batch(self.model, self.tokenizer, texts, **options)

    def translate_saved_model(self, texts: Sequence[str | bytes], beam_size: int,
                              alpha: float, batch_size: int = 64,
                              progress: Progress | None = None) -> tuple[list[str], list[int]]:
        """(N translations, the indices of the lines the SavedModel truncated) from a
        SavedModel. Truncation is reported by the `translate_prefix` signature (empty
        prefixes: the same search as `translate`); an export without it (older than the
        signature) reports none."""
        signatures = self.saved_model.signatures
        flagged = "translate_prefix" in signatures
        signature = signatures["translate_prefix" if flagged else "translate"]
        # Similar lengths per request: the server pads each request to its longest line.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
        results, truncated = [""] * len(texts), []
        for start in range(0, len(order), batch_size):
            rows = order[start: start + batch_size]
            inputs = {"inputs": tf.constant([texts[i] for i in rows], tf.string),
                      "beam_size": tf.constant(beam_size, tf.int32),
                      "alpha": tf.constant(alpha, tf.float32)}
            if flagged:
                inputs["prefixes"] = tf.constant([""] * len(rows))
            outputs = signature(**inputs)
            for row, text in zip(rows, outputs["outputs"].numpy(), strict=True):
                results[row] = text.decode("utf-8", errors="replace")
            if flagged:
                truncated += [row for row, cut in zip(rows, outputs["truncated"].numpy(),
                                                      strict=True) if cut]
            if progress is not None:
                progress(start + len(rows))
        return results, sorted(truncated)


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
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"{path}: no such directory; pass a run directory or a SavedModel.")
    saved = _saved_model_dir(path)
    try:
        if saved is not None:
            loaded = tf.saved_model.load(str(saved))
            if "translate" not in loaded.signatures:
                raise ModelError(f"{saved}: a SavedModel without a 'translate' signature; "
                                 "export it with `python -m keras_transformer.export`.")
            return Translator(saved, saved_model=loaded)
        if run_directory.is_run_dir(path):
            model, tokenizer = run_directory.load_run(path)
            return Translator(path, model=model, tokenizer=tokenizer)
    except ModelError:
        raise
    except Exception as error:  # a corrupt file: report it, no traceback
        raise ModelError(f"{path}: cannot be loaded ({type(error).__name__}: {error})") from None
    raise ModelError(
        f"{path}: not a model directory: expected a SavedModel (saved_model.pb), a "
        f"saved_models/<name> folder with integer versions, or a run directory "
        f"({run_directory.MODEL_FILE} and {run_directory.TOKENIZER_DIR}/).")
