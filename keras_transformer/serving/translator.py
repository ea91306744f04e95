"""One home for loading a translator: a run directory (the Keras model and its tokenizer) or
a SavedModel, behind one interface (the `translate` and `evaluate` commands, `kt.Translator`).

    Translator.load(path).translate(texts)  # best strings
    Translator.load(path).translate_batch(texts, num_hypotheses=4)  # `Translation`s

It sits in `serving` because it loads what `serving` exports; `decoding` (which it calls for
run directories) never imports `serving`. A SavedModel is translated through its signatures
by `serving.saved_model_translation`, with the same results.
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
from keras_transformer.serving.loaded_export import Export, open_export
from keras_transformer.serving.saved_model import latest_version
from keras_transformer.serving.saved_model_translation import (
    translate_batch_with_saved_model,
    translate_texts_with_saved_model,
)

__all__ = ["ModelError", "Translator", "load_translator"]

Progress = Callable[[int], None]


class ModelError(Exception):
    """`--model` is not something that can translate (message says what was expected)."""


class Translator:
    """Translates lists of texts with a Keras model (run directory) or a SavedModel."""

    def __init__(self, path: Path, model=None, tokenizer=None, saved_model=None):
        self.path = path
        self.model, self.tokenizer, self.saved_model = model, tokenizer, saved_model
        self._export: Export | None = None

    @classmethod
    def load(cls, path: str | Path) -> Translator:
        """A run directory, a SavedModel or a `saved_models/<name>` folder (`load_translator`)."""
        return load_translator(path)

    @property
    def export(self) -> Export | None:
        """A SavedModel's limits and tokenizer (`serving.loaded_export`), read on
        first use; None for a run directory."""
        if self.saved_model is not None and self._export is None:
            self._export = open_export(self.path, self.saved_model)
        return self._export

    def translate(self, texts: Sequence[str | bytes], beam_size: int = DEFAULT_BEAM_SIZE,
                  alpha: float = DEFAULT_ALPHA, batch_size: int = 64,
                  progress: Progress | None = None) -> list[str]:
        """N translations of N texts, in order (long lines split into sentences)."""
        if self.saved_model is None:
            return translate_texts(self.model, self.tokenizer, texts, beam_size=beam_size,
                                   alpha=alpha, batch_size=batch_size, progress=progress)
        return self.translate_saved_model(texts, beam_size=beam_size, alpha=alpha,
                                          batch_size=batch_size, progress=progress)[0]

    def translate_batch(self, texts: Sequence[str | bytes], **options) -> list[Translation]:
        """`decoding.translator.translate_batch` with this model: n-best lists, scores,
        sampling, prefixes, alignments, long inputs. A SavedModel takes the same arguments
        and gives the same results through its signatures, except what its export fixes
        (`serving.saved_model_translation`: a `UsageError` says what)."""
        if self.saved_model is None:
            return translate_batch(self.model, self.tokenizer, texts, **options)
        return translate_batch_with_saved_model(self.export, texts, **options)

    def translate_saved_model(self, texts: Sequence[str | bytes],
                              **options) -> tuple[list[str], list[list[str]]]:
        """(N translations, each line's flags) from a SavedModel, faster than
        `translate_batch` (no pieces, token scores or alignments):
        `translate_texts_with_saved_model`'s options (beam_size, alpha, long_inputs,
        max_input_tokens, max_output_tokens, batch_size, batch_tokens, progress)."""
        if self.saved_model is None:
            raise ModelError(f"{self.path}: not a SavedModel.")
        return translate_texts_with_saved_model(self.export, texts, **options)


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
