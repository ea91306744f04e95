"""A shared source/target subword vocabulary: trained with sentencepiece, applied in the graph.

Training uses the ``sentencepiece`` package; tokenizing and detokenizing use
``tensorflow_text.SentencepieceTokenizer`` built from the serialized model, so the same
:class:`SubwordTokenizer` (a ``tf.Module``) runs eagerly, inside ``tf.data``, inside
``tf.function`` and in an exported SavedModel.

Settings are chosen so that ``detokenize(tokenize(text)) == text`` exactly: identity
normalization, no whitespace collapsing, full character coverage and byte fallback (so
characters never seen in training round-trip through byte pieces instead of ``<unk>``).
One exception: the in-graph decoder drops *leading* spaces, which is why corpora strip
the whitespace around each sentence (casing, inner and trailing whitespace, tabs and
unseen characters all round-trip; measured exact on all of Multi30k val).

On disk a tokenizer is a directory holding ``spm.model``, ``spm.vocab`` and
``tokenizer.json`` (settings and, from :func:`train_or_load_tokenizer`, the corpus
fingerprint). Directories are written to a temporary sibling, fsynced and renamed into
place, so a crash never leaves a half-written tokenizer, and a full (or read-only, or
failing) disk raises :class:`~pipelines.storage.StorageError` and leaves none either.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
import tensorflow as tf
import tensorflow_text as tf_text

from pipelines import storage
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from pipelines.corpora import ParallelCorpus, corpus_fingerprint

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "SubwordTokenizer",
    "TokenizerMismatchError",
    "train_or_load_tokenizer",
    "train_tokenizer",
]

MODEL_FILE, VOCAB_FILE, CONFIG_FILE = "spm.model", "spm.vocab", "tokenizer.json"
_FORMAT_VERSION = 1
# Unigram training results depend on the thread count (BPE's do not); a fixed count keeps
# the vocabulary identical on every machine.
_NUM_THREADS = 2
# Caps the sentences sentencepiece loads (sampled with the seed) on very large corpora.
_INPUT_SENTENCE_SIZE = 2_000_000

_LOG = logging.getLogger("pipelines")


class TokenizerMismatchError(ValueError):
    """An existing tokenizer directory was made with other settings or another corpus.

    It is never silently retrained: a model trained with the old vocabulary would then
    read the wrong ids. Delete the directory to retrain, or choose another one.
    """


class SubwordTokenizer(tf.Module):
    """Sentencepiece subword tokenizer usable eagerly, in tf.data and in SavedModels.

    Special ids are fixed: ``PAD_ID=0, UNK_ID=1, BOS_ID=2, EOS_ID=3``.

    Args:
      model_proto: the serialized sentencepiece ``ModelProto`` (the bytes of spm.model).
      settings: optional training settings, saved to ``tokenizer.json`` by :meth:`save`.
    """

    def __init__(self, model_proto: bytes, *, settings: Mapping[str, Any] | None = None):
        super().__init__(name="subword_tokenizer")
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model_proto)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"not a serialized sentencepiece model: {error}") from None
        specials = (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id())
        if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(
                f"sentencepiece model has special ids pad/unk/bos/eos={specials}; this project "
                f"needs {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}: retrain it with train_tokenizer"
            )
        self._model_proto = bytes(model_proto)
        self._vocab_size = int(processor.get_piece_size())
        # Kept as JSON text: a dict attribute would become a tracked tf.Module structure.
        self._settings_json = json.dumps(dict(settings or {}), sort_keys=True)
        self._sentencepiece = tf_text.SentencepieceTokenizer(model=self._model_proto)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special ids and byte pieces included (a python int)."""
        return self._vocab_size

    @property
    def model_proto(self) -> bytes:
        """The serialized sentencepiece model."""
        return self._model_proto

    @property
    def settings(self) -> dict[str, Any]:
        """The training settings recorded with this tokenizer (may be empty)."""
        return json.loads(self._settings_json)

    def tokenize(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """Subword ids of each text, without BOS/EOS; works eagerly and in graphs.

        Not a ``tf.function`` itself: callers' functions and tf.data maps inline the op
        instead of paying a nested-function call on every iterator.

        Args:
          texts: tf.string ``[N]`` (a list of str is converted).

        Returns:
          int32 RaggedTensor ``[N, (pieces)]``.
        """
        texts = tf.convert_to_tensor(texts, dtype=tf.string)
        if texts.shape.rank is not None and texts.shape.rank != 1:
            raise ValueError(f"tokenize expects a vector of strings ([N]), got shape {texts.shape}")
        return self._live().tokenize(texts)

    def detokenize(self, ids: tf.Tensor | tf.RaggedTensor) -> tf.Tensor:
        """Texts of id sequences; works eagerly and in graphs.

        Each row is cut at its first ``EOS_ID``; ``PAD_ID`` and ``BOS_ID`` are dropped, so
        padded model outputs (``[BOS] ... [EOS] [PAD]...``) decode cleanly.

        Args:
          ids: integer ``[N, L]`` dense tensor or ``[N, (L)]`` RaggedTensor.

        Returns:
          tf.string ``[N]``.
        """
        if isinstance(ids, tf.RaggedTensor):
            dense = ids.to_tensor(default_value=PAD_ID)
        else:
            dense = tf.convert_to_tensor(ids)
        dense = tf.cast(dense, tf.int32)
        if dense.shape.rank != 2:
            raise ValueError(f"detokenize expects ids of rank 2 ([N, L]), got shape {dense.shape}")
        after_eos = tf.cumsum(tf.cast(dense == EOS_ID, tf.int32), axis=1) > 0
        keep = ~after_eos & (dense != PAD_ID) & (dense != BOS_ID)
        return self._live().detokenize(tf.ragged.boolean_mask(dense, keep))

    def id_to_piece(self, ids: tf.Tensor) -> tf.Tensor:
        """The subword string of each id (e.g. for attention plot labels); same shape as ids."""
        return self._live().id_to_string(tf.cast(ids, tf.int32))

    def piece_to_id(self, pieces: tf.Tensor) -> tf.Tensor:
        """The id of each subword string (the unknown id for a string not in the vocabulary);
        same shape as pieces."""
        return self._live().string_to_id(pieces)

    def _live(self) -> tf_text.SentencepieceTokenizer:
        """The tf-text tokenizer, rebuilt if its sentencepiece resource has been destroyed.

        The resource is owned by an eager kernel, and ``tf.random.set_seed`` (so also
        ``keras.utils.set_random_seed``) clears the eager kernel cache; without this check
        a tokenizer made before seeding fails with NotFoundError. Checked eagerly, also
        while a graph is traced, so new graphs and pipelines capture a live resource
        (graphs traced *before* the reset cannot be repaired: seed first).
        """
        with tf.init_scope():
            if tf.executing_eagerly():
                try:
                    self._sentencepiece.vocab_size()
                except tf.errors.NotFoundError:
                    self._sentencepiece = tf_text.SentencepieceTokenizer(model=self._model_proto)
        return self._sentencepiece

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``spm.model``, ``spm.vocab`` and ``tokenizer.json`` to ``directory``, atomically.

        An existing tokenizer directory is replaced; a directory holding other files is
        refused (it is probably not a tokenizer directory).

        Raises:
          FileExistsError: ``directory`` is a file, or holds other files.
          StorageError: the storage failed; ``directory`` is as it was.
        """
        config = {
            "format_version": _FORMAT_VERSION,
            "vocab_size": self.vocab_size,
            "special_ids": {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID},
            "sentencepiece_version": spm.__version__,
            "settings": self.settings,
        }
        files = {
            MODEL_FILE: self._model_proto,
            VOCAB_FILE: _vocab_text(self._model_proto).encode("utf-8"),
            CONFIG_FILE: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"),
        }
        _write_directory_atomically(Path(directory), files)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> SubwordTokenizer:
        """Load a tokenizer saved by :meth:`save` (``tokenizer.json`` is optional)."""
        directory = Path(directory)
        model_path = directory / MODEL_FILE
        if not model_path.is_file():
            raise FileNotFoundError(
                f"{model_path}: no tokenizer model; train one with train_tokenizer"
            )
        return cls(model_path.read_bytes(), settings=_read_config(directory).get("settings"))


def train_tokenizer(
    texts: Iterable[str],
    directory: str | os.PathLike,
    *,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    seed: int = 0,
    extra_settings: Mapping[str, Any] | None = None,
    reserved_symbols: Sequence[str] = (),
) -> SubwordTokenizer:
    """Train a sentencepiece model on ``texts`` and save it to ``directory`` (replacing it).

    Args:
      texts: training sentences, e.g. both sides of the training split.
      directory: where to save (see :meth:`SubwordTokenizer.save`).
      vocab_size: total number of ids, including the 4 special ids and 256 byte pieces.
      model_type: ``"bpe"`` or ``"unigram"``.
      seed: seeds sentencepiece's sampling of sentences on very large corpora.
      extra_settings: recorded in ``tokenizer.json`` beside the training settings.
      reserved_symbols: tokens that are always one piece wherever they occur (e.g. the tag
        before back-translated sources, ``<BT>``): SentencePiece's user-defined symbols.

    Raises:
      ValueError: bad arguments, or a vocabulary too large for the corpus.
      StorageError: saving failed because of the storage (see :meth:`SubwordTokenizer.save`).
    """
    settings = _training_settings(vocab_size, model_type, seed)
    if reserved_symbols:  # recorded only then: other tokenizers' settings are unchanged
        settings["user_defined_symbols"] = list(reserved_symbols)
    texts = list(texts)
    if not texts:
        raise ValueError("cannot train a tokenizer on no text")
    started = time.perf_counter()
    writer = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=writer,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            minloglevel=2,
            **{k: v for k, v in settings.items() if k != "seed"},
        )
    except RuntimeError as error:
        # e.g. "Vocabulary size too high (8000). Please set it to a value <= 1234."
        raise ValueError(
            f"sentencepiece training failed on {len(texts)} sentences: {error}"
        ) from None
    tokenizer = SubwordTokenizer(
        writer.getvalue(), settings={**settings, **dict(extra_settings or {})}
    )
    tokenizer.save(directory)
    # (No path: a preparation saves it into a staging folder that is then renamed.)
    _LOG.info(
        "trained a %d-piece %s tokenizer on %d sentences in %.2fs",
        tokenizer.vocab_size,
        model_type,
        len(texts),
        time.perf_counter() - started,
    )
    return tokenizer


def train_or_load_tokenizer(
    corpus: ParallelCorpus,
    directory: str | os.PathLike,
    *,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    seed: int = 0,
) -> SubwordTokenizer:
    """The shared tokenizer of ``corpus`` (sources then targets), trained once and reused.

    If ``directory`` already holds a tokenizer made from the same corpus content
    (:func:`pipelines.corpora.corpus_fingerprint`) with the same settings, it is loaded,
    not retrained. If it holds one made differently, :class:`TokenizerMismatchError` is
    raised rather than retraining, because models trained with the old vocabulary would
    silently break; delete the directory (or pick another) to retrain.
    """
    directory = Path(directory)
    fingerprint = corpus_fingerprint(corpus)
    wanted = {**_training_settings(vocab_size, model_type, seed), "corpus_fingerprint": fingerprint}
    if (directory / MODEL_FILE).exists():
        recorded = _read_config(directory).get("settings", {})
        differences = {
            key: (recorded.get(key), value)
            for key, value in wanted.items()
            if recorded.get(key) != value
        }
        if differences:
            listing = "; ".join(
                f"{k}: saved {old!r}, wanted {new!r}" for k, (old, new) in differences.items()
            )
            raise TokenizerMismatchError(
                f"{directory}: existing tokenizer differs ({listing}); delete the directory to "
                "retrain (models trained with it will no longer match) or use another directory"
            )
        _LOG.info("reusing tokenizer %s (corpus fingerprint %s)", directory, fingerprint[:12])
        return SubwordTokenizer.load(directory)
    return train_tokenizer(
        [*corpus.sources, *corpus.targets],
        directory,
        vocab_size=vocab_size,
        model_type=model_type,
        seed=seed,
        extra_settings={
            "corpus_fingerprint": fingerprint,
            "corpus": f"{corpus.origin} [{corpus.split}] {corpus.src_lang}-{corpus.tgt_lang}",
        },
    )


def _training_settings(vocab_size: int, model_type: str, seed: int) -> dict[str, Any]:
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if not isinstance(vocab_size, int) or vocab_size < 300:
        # 4 special ids + 256 byte-fallback pieces leave too few real subwords below this.
        raise ValueError(f"vocab_size must be an int >= 300, got {vocab_size!r}")
    return {
        "vocab_size": vocab_size,
        "model_type": model_type,
        "seed": seed,
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "character_coverage": 1.0,
        "byte_fallback": True,
        "num_threads": _NUM_THREADS,
        "input_sentence_size": _INPUT_SENTENCE_SIZE,
        "shuffle_input_sentence": True,
    }


def _vocab_text(model_proto: bytes) -> str:
    processor = spm.SentencePieceProcessor(model_proto=model_proto)
    return "".join(
        f"{processor.id_to_piece(i)}\t{processor.get_score(i)}\n"
        for i in range(processor.get_piece_size())
    )


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: not valid JSON ({error}); delete the tokenizer directory"
        ) from None


def _write_directory_atomically(directory: Path, files: Mapping[str, bytes]) -> None:
    """Create ``directory`` with exactly ``files``, via a temporary sibling and rename."""
    if directory.exists():
        if not directory.is_dir():
            raise FileExistsError(f"{directory}: exists and is not a directory")
        foreign = sorted(p.name for p in directory.iterdir() if p.name not in files)
        if foreign:
            raise FileExistsError(
                f"{directory}: holds other files ({', '.join(foreign[:5])}); refusing to replace "
                "it with a tokenizer: choose a dedicated directory"
            )
    staging = retired = None
    with storage.errors_about(directory, sum(map(len, files.values()))):
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            staging = storage.staging_folder(directory.parent, f".{directory.name}.tmp-")
            for name, content in files.items():
                with open(staging / name, "wb") as handle:
                    handle.write(content)
            if directory.exists():
                # Two renames are not one atomic step, but at every instant either the old
                # or the new complete directory exists under some name.
                retired = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-",
                                                dir=directory.parent))
                os.replace(directory, retired / directory.name)
            storage.replace_folder(staging, directory)  # fsyncs every file, then renames
        except OSError:
            if retired is not None and not directory.exists():
                os.replace(retired / directory.name, directory)  # the old one back in place
            raise
        finally:
            for folder in (staging, retired):
                if folder is not None and folder.exists():
                    shutil.rmtree(folder, ignore_errors=True)
