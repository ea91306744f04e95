"""Translating text with a trained model: in a Python session, at the end of training, and
behind the `translate` and `evaluate` commands.

    translate_texts(model, tokenizer, texts, beam_size=4, alpha=0.6)  # a Keras model
    Translator.load(path).translate(texts)  # a run directory or a SavedModel
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece ops)

from keras_transformer import run_directory
from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
    beam_search,
    encode_texts,
    greedy_search,
)
from keras_transformer.serving.saved_model import latest_version

__all__ = ["ModelError", "Translator", "load_translator", "translate_texts"]

Progress = Callable[[int], None]


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
        jit_compile: XLA-compiled decoding (see `decoding.greedy_search`).

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
        return self._translate_saved_model(texts, beam_size, alpha, batch_size, progress)

    def _translate_saved_model(self, texts, beam_size, alpha, batch_size, progress):
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
