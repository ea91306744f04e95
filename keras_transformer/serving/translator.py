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
        self._decoding: tuple[int, float] | None = None

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

    @property
    def decoding(self) -> tuple[int, float]:
        """(beam size, alpha) this model decodes with unless told otherwise: a run's, chosen
        on val (`run_directory.run_decoding`); a SavedModel's `serving_default` (what TF
        Serving gives); the paper's (4, 0.6) where neither recorded them."""
        if self.saved_model is not None:
            return self.export.beam_size, self.export.alpha
        if self._decoding is None:
            self._decoding = run_directory.run_decoding(self.path)
        return self._decoding

    def translate(self, texts: Sequence[str | bytes], beam_size: int | None = None,
                  alpha: float | None = None, batch_size: int = 64,
                  progress: Progress | None = None) -> list[str]:
        """N translations of N texts, in order (long lines split into sentences); beam_size
        and alpha default to the model's own (`decoding`)."""
        beam_size, alpha = self.resolve_search(beam_size, alpha)
        if self.saved_model is None:
            return translate_texts(self.model, self.tokenizer, texts, beam_size=beam_size,
                                   alpha=alpha, batch_size=batch_size, progress=progress)
        return self.translate_saved_model(texts, beam_size=beam_size, alpha=alpha,
                                          batch_size=batch_size, progress=progress)[0]

    def resolve_search(self, beam_size: int | None = None, alpha: float | None = None, *,
                       sampling_topk: int = 1, num_hypotheses: int = 1) -> tuple[int, float]:
        """(beam size, alpha) to decode with: those given, else the model's own (`decoding`);
        left out, the beam is 1 for sampling (`sampling_topk` other than 1: one token drawn a
        step) and holds at least `num_hypotheses`."""
        if beam_size is None and sampling_topk != 1:
            beam_size = 1
        if beam_size is not None and alpha is not None:
            return beam_size, alpha  # nothing of the model's is read
        own_beam, own_alpha = self.decoding
        if beam_size is None:
            beam_size = max(own_beam, num_hypotheses)
        return beam_size, own_alpha if alpha is None else alpha

    def translate_batch(self, texts: Sequence[str | bytes], **options) -> list[Translation]:
        """`decoding.translator.translate_batch` with this model: n-best lists, scores,
        sampling, prefixes, alignments, long inputs; beam_size and alpha default to the
        model's own (`decoding`). A SavedModel takes the same arguments and gives the same
        results through its signatures, except what its export fixes
        (`serving.saved_model_translation`: a `UsageError` says what)."""
        options["beam_size"], options["alpha"] = self.resolve_search(
            options.get("beam_size"), options.get("alpha"),
            sampling_topk=options.get("sampling_topk", 1),
            num_hypotheses=options.get("num_hypotheses", 1))
        if self.saved_model is None:
            return translate_batch(self.model, self.tokenizer, texts, **options)
        return translate_batch_with_saved_model(self.export, texts, **options)

    def translate_saved_model(self, texts: Sequence[str | bytes],
                              **options) -> tuple[list[str], list[list[str]]]:
        """(N translations, each line's flags) from a SavedModel, faster than
        `translate_batch` (no pieces, token scores or alignments):
        `translate_texts_with_saved_model`'s options (beam_size, alpha: the export's own
        unless given; long_inputs, max_input_tokens, max_output_tokens, batch_size,
        batch_tokens, progress)."""
        if self.saved_model is None:
            raise ModelError(f"{self.path}: not a SavedModel.")
        options["beam_size"], options["alpha"] = self.resolve_search(
            options.get("beam_size"), options.get("alpha"))
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
