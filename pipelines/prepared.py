"""A prepared training split: the shared tokenizer and the token ids of every pair, on disk.

A corpus is prepared once (``python -m keras_transformer.prepare``, or by the first
``train``): one validating pass counts, fingerprints and samples it; SentencePiece is
trained on the sample; a second pass tokenizes every pair into shards. Training then
reads the shards, never the text, so start-up and resume cost the same at any corpus
size and any step. The directory is self-contained: prepare on one machine, copy it (or
share its path), train on others.

Layout::

    DIR/manifest.json                 written last: what was prepared, how, and the shards
                                      (sizes and CRC-32s of their files)
    DIR/tokenizer/                    the SentencePiece model (pipelines.tokenizer)
    DIR/shard-00000-of-00045.ids      token ids, pair after pair: source pieces, target pieces
    DIR/shard-00000-of-00045.lengths  int32 [pairs, 2]: pieces of the source and the target
                                      (both written and read by pipelines.shard_files)

Pairs go to a shard chosen at random (seeded), so every shard is a uniform sample of the
corpus (no shard holds one domain of a concatenated corpus), and workers read whole
shards (sharding by file). A directory is built under a hidden temporary name beside
``DIR``, fsynced and renamed into place when complete (:mod:`pipelines.storage`): a killed
preparation leaves no ``DIR``, only a temporary folder that the next preparation removes,
and a full disk leaves neither (:class:`~pipelines.storage.StorageError`).

Damage is found before it reaches a model: :meth:`PreparedCorpus.load` checks every shard
file's size, :meth:`PreparedCorpus.verify` its CRC-32 (recorded in the manifest as the
bytes were written), and the input pipeline checks, as it reads a shard, that its ids are
within the vocabulary and its lengths add up to them; :func:`damaged_shard` turns a failure
of that check into one line naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from pipelines import DEFAULT_SHARD_PAIRS, DEFAULT_TOKENIZER_SAMPLE, shard_files, storage
from pipelines.batching import StreamPosition, check_budget, chunk_stream, plan_batches
from pipelines.batching import static_shapes as planned_static_shapes
from pipelines.corpora import CorpusScan, CorpusSplit, log_dropped, scan_corpus
from pipelines.storage import StorageError
from pipelines.tokenizer import SubwordTokenizer, train_tokenizer

__all__ = ["MANIFEST_FILE", "PreparedCorpus", "PreparedError", "damaged_shard", "prepare_corpus",
           "sampling_settings"]

MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
FORMAT_VERSION = 1
_STAGING_PREFIX = ".tmp-prepare-"
_LOG = logging.getLogger("pipelines")
_DAMAGED_ADVICE = ("the prepared corpus is damaged (a failing disk or an incomplete copy); "
                   "prepare it again, or copy it again from where it was prepared")


class PreparedError(ValueError):
    """A prepared directory is missing, incomplete, damaged, or made with other settings."""


@dataclasses.dataclass(frozen=True)
class PreparedCorpus:
    """A complete prepared directory (see the module docstring); :meth:`load` opens one."""

    directory: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> PreparedCorpus:
        """Opens ``directory`` and checks that every shard file has its recorded size.

        Raises:
          PreparedError: no manifest (not prepared, or a preparation that did not finish),
            an unreadable manifest, or a missing or truncated shard.
        """
        directory = Path(directory)
        path = directory / MANIFEST_FILE
        if not path.is_file():
            raise PreparedError(f"{directory}: not a prepared corpus (no {MANIFEST_FILE}); "
                                "prepare it with `python -m keras_transformer.prepare`")
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise PreparedError(f"{path}: unreadable ({error}); prepare the corpus again") from None
        if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
            version = manifest.get("format_version") if isinstance(manifest, dict) else None
            raise PreparedError(f"{path}: format {version!r}, this version reads "
                                f"{FORMAT_VERSION}; prepare the corpus again")
        try:
            for shard in manifest["shards"]:
                for kind in ("ids", "lengths"):
                    file = directory / shard[kind]
                    size = file.stat().st_size if file.is_file() else None
                    if size != shard[f"{kind}_bytes"]:
                        raise PreparedError(
                            f"{file}: {'missing' if size is None else f'{size} bytes'}, the "
                            f"manifest says {shard[f'{kind}_bytes']}: the prepared corpus is "
                            "damaged; prepare it again (or copy it again from where it was "
                            "prepared)")
            for key in ("settings", "corpus", "corpus_fingerprint", "pairs_kept", "id_dtype"):
                manifest[key]  # noqa: B018 (presence check)
        except (KeyError, TypeError) as error:
            raise PreparedError(f"{path}: incomplete manifest ({type(error).__name__}: {error}); "
                                "prepare the corpus again") from None
        if not (directory / TOKENIZER_DIR).is_dir():
            raise PreparedError(f"{directory / TOKENIZER_DIR}: missing; prepare the corpus again")
        return cls(directory, manifest)

    def verify(self, shards: Sequence[int] | None = None) -> None:
        """Recomputes the CRC-32 of every file of ``shards`` (default: all) and compares it
        with the manifest's: what :meth:`load`'s size checks miss, bytes changed in place.

        Reads every byte (0.8 GB/s from the development machine's disk, 1.2 GB/s from the
        page cache: BENCHMARKS.md): a training run does it once before its first step. A
        manifest written before checksums were recorded has none: its files are not
        verified.

        Raises:
          PreparedError: the first file whose checksum differs, or that cannot be read.
        """
        for index in range(self.num_shards) if shards is None else shards:
            shard = self.manifest["shards"][index]
            for kind in ("ids", "lengths"):
                recorded = shard.get(f"{kind}_crc32")
                if recorded is None:
                    continue
                file = self.directory / shard[kind]
                try:
                    found = f"{storage.file_checksum(file):08x}"
                except OSError as error:
                    raise PreparedError(f"{file}: unreadable ({error.strerror or error}); "
                                        f"{_DAMAGED_ADVICE}") from None
                if found != recorded:
                    raise PreparedError(f"{file}: checksum {found}, the manifest says "
                                        f"{recorded}: {_DAMAGED_ADVICE}")

    @property
    def settings(self) -> dict[str, Any]:
        """How it was prepared: languages, vocab_size, max_length, tokenizer_sample, seed."""
        return dict(self.manifest["settings"])

    @property
    def pairs(self) -> int:
        """Pairs kept (those within max_length)."""
        return int(self.manifest["pairs_kept"])

    def describe_pairs(self) -> str:
        """E.g. "29,000 pairs", or "580,000 pairs (29,000 in 20 sampled segmentations)"."""
        copies = int(self.settings.get("subword_samples") or 1)
        return f"{self.pairs:,} pairs" + (
            f" ({self.pairs // copies:,} in {copies} sampled segmentations)" if copies > 1
            else "")

    @property
    def num_shards(self) -> int:
        """Number of shard files (pairs of .ids/.lengths)."""
        return len(self.manifest["shards"])

    def tokenizer(self) -> SubwordTokenizer:
        """The SentencePiece tokenizer the shards were made with."""
        return SubwordTokenizer.load(self.directory / TOKENIZER_DIR)

    def check_settings(self, wanted: Mapping[str, Any]) -> None:
        """Raises :class:`PreparedError` naming every setting that differs from ``wanted``."""
        recorded = {**sampling_settings(0, 0.0), **self.settings}  # older manifests: no sampling
        differences = [f"{key}: prepared with {recorded.get(key)!r}, wanted {value!r}"
                       for key, value in wanted.items() if recorded.get(key) != value]
        if differences:
            raise PreparedError(
                f"{self.directory} was prepared differently ({'; '.join(differences)}); use "
                "matching flags, another directory, or delete it to prepare again")

    def check_source(self, split: CorpusSplit) -> None:
        """Raises :class:`PreparedError` if ``split``'s files changed since preparation.

        Only the same files (same resolved paths) are compared, by size and modification
        time: a copy of the corpus elsewhere, or on another machine, is not judged.
        """
        recorded = self.manifest["corpus"]
        current = split.identity()
        for old, new in zip(recorded.get("files", []), current.get("files", []), strict=False):
            if old["path"] == new["path"] and (old["bytes"], old["mtime_ns"]) != (
                    new["bytes"], new["mtime_ns"]):
                raise PreparedError(
                    f"{new['path']} changed since {self.directory} was prepared from it; "
                    "delete the prepared directory to prepare again, or restore the file")

    def shard_batches(self, tokens_per_batch: int, max_length: int, num_replicas: int = 1,
                      bucket_boundaries: Sequence[int] | None = None) -> list[np.ndarray]:
        """Per shard, the end offsets of its batches (:func:`pipelines.batching.plan_batches`)."""
        budget, boundaries = check_budget(tokens_per_batch, max_length, num_replicas,
                                          bucket_boundaries)
        return [self._plan(shard, boundaries, budget, max_length)
                for shard in range(self.num_shards)]

    def _histogram(self, shard: int, max_length: int) -> np.ndarray:
        """Pairs of one shard per length (positions), up to max_length."""
        return np.asarray(self.manifest["shards"][shard]["histogram"][:max_length + 1])

    def _plan(self, shard: int, boundaries: Sequence[int], budget: int,
              max_length: int) -> np.ndarray:
        """The batch end offsets of one shard, from its length histogram."""
        return plan_batches(self._histogram(shard, max_length), boundaries, budget)

    def batches(
        self,
        *,
        tokens_per_batch: int,
        max_length: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        repeat: bool = True,
        input_context: tf.distribute.InputContext | None = None,
        skip_batches: int = 0,
        bucket_boundaries: Sequence[int] | None = None,
        static_shapes: bool = False,
    ) -> tf.data.Dataset:
        """Token-budget batches of the prepared pairs (format of :mod:`pipelines.batching`).

        Args:
          tokens_per_batch: global token budget of one batch, split over the replicas of
            ``input_context``.
          max_length: longest pair kept, in positions; at most the prepared one (default).
          seed: seeds the shuffling of each epoch.
          shuffle, repeat: as :func:`pipelines.batching.make_batches`.
          input_context: under ``distribute_datasets_from_function``; pipeline ``i`` of
            ``n`` reads shards ``i, i + n, ...`` only (sharding by file).
          skip_batches: start after this many batches of this pipeline's stream, at the
            cost of reading one shard (no replay): how a resumed run continues.
          bucket_boundaries, static_shapes: as :func:`pipelines.batching.make_batches`.

        Raises:
          PreparedError: fewer shards than input pipelines, or a max_length above the
            prepared one.
          ValueError: invalid budget arguments.
        """
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        prepared_length = int(self.settings["max_length"])
        max_length = prepared_length if max_length is None else max_length
        if max_length > prepared_length:
            raise PreparedError(f"max_length {max_length} exceeds the {prepared_length} that "
                                f"{self.directory} was prepared with; prepare it again with "
                                f"--max-length {max_length}")
        pipelines, pipeline = 1, 0
        replicas = 1
        if input_context is not None:
            pipelines, pipeline = input_context.num_input_pipelines, input_context.input_pipeline_id
            replicas = input_context.num_replicas_in_sync
        if self.num_shards < pipelines:
            raise PreparedError(
                f"{self.directory} has {self.num_shards} shard(s) for {pipelines} input "
                f"pipelines (workers); prepare it with --shards {pipelines} or more")
        budget, boundaries = check_budget(tokens_per_batch, max_length, replicas,
                                          bucket_boundaries)
        mine = list(range(pipeline, self.num_shards, pipelines))
        ends = [self._plan(i, boundaries, budget, max_length) for i in mine]
        if not any(len(e) for e in ends):
            raise PreparedError(
                f"{self.directory}: input pipeline {pipeline} of {pipelines} has no pair within "
                f"max_length {max_length} in its shards {mine}; prepare more pairs or fewer shards")
        stream_seed = seed + 7919 * pipeline
        start = StreamPosition.after(skip_batches, [len(e) for e in ends], seed=stream_seed,
                                     shuffle=shuffle) if skip_batches else StreamPosition()
        shards = [self.manifest["shards"][i] for i in mine]
        ids_files = tf.constant([str(self.directory / s["ids"]) for s in shards])
        lengths_files = tf.constant([str(self.directory / s["lengths"]) for s in shards])
        id_dtype = tf.as_dtype(self.manifest["id_dtype"])
        vocab_size = int(self.manifest.get("tokenizer_vocab_size", self.settings["vocab_size"]))

        def load_shard(index: tf.Tensor) -> tuple[tf.RaggedTensor, tf.RaggedTensor]:
            rows = shard_files.read_shard(ids_files[index], lengths_files[index], id_dtype,
                                          vocab_size)
            sources = tf.range(rows.nrows() // 2) * 2  # rows 0, 2, 4, ...
            return tf.gather(rows, sources), tf.gather(rows, sources + 1)

        return chunk_stream(len(mine), load_shard, ends, boundaries, seed=stream_seed,
                            shuffle=shuffle, repeat=repeat, start=start,
                            static_budget=budget if static_shapes else None)

    def static_shapes(self, tokens_per_batch: int, max_length: int, num_replicas: int = 1,
                      bucket_boundaries: Sequence[int] | None = None) -> set[tuple[int, int]]:
        """The distinct ``(B, width)`` batch shapes of an epoch with ``static_shapes=True``
        (:func:`pipelines.batching.static_shapes`): what an XLA-compiled step compiles."""
        budget, boundaries = check_budget(tokens_per_batch, max_length, num_replicas,
                                          bucket_boundaries)
        plans = self.shard_batches(tokens_per_batch, max_length, num_replicas, boundaries)
        found: set[tuple[int, int]] = set()
        for shard, ends in enumerate(plans):
            found |= planned_static_shapes(ends, self._histogram(shard, max_length), boundaries,
                                           budget)
        return found


def sampling_settings(subword_samples: int, subword_alpha: float) -> dict[str, Any]:
    """How a prepared directory's training pairs were segmented, as
    :meth:`PreparedCorpus.check_settings` compares it (a manifest records it only with
    sampled copies): the alpha only matters when there are some."""
    return {"subword_samples": subword_samples,
            "subword_alpha": subword_alpha if subword_samples else None}


def damaged_shard(error: BaseException) -> PreparedError | None:
    """The one-line :class:`PreparedError` naming the shard file that failed the input
    pipeline's checks, if ``error`` (raised while iterating :meth:`PreparedCorpus.batches`,
    e.g. by ``model.fit``) is such a failure; otherwise None."""
    found = shard_files.failed_check(error)
    return None if found is None else PreparedError(f"{found}: {_DAMAGED_ADVICE}")


def prepare_corpus(
    split: CorpusSplit,
    directory: str | os.PathLike,
    *,
    vocab_size: int = 8000,
    max_length: int = 128,
    tokenizer_sample: int = DEFAULT_TOKENIZER_SAMPLE,
    shard_pairs: int = DEFAULT_SHARD_PAIRS,
    min_shards: int = 1,
    seed: int = 0,
    scan: CorpusScan | None = None,
    subword_samples: int = 0,
    subword_alpha: float = 0.1,
) -> PreparedCorpus:
    """Prepare a training split into ``directory`` (see the module docstring).

    Args:
      split: the training split (:func:`pipelines.corpora.open_corpus`).
      directory: where the prepared corpus goes; must not exist yet (or be empty).
      vocab_size: SentencePiece vocabulary size (shared by both languages).
      max_length: longest pair kept, in positions (pieces + EOS); longer pairs are
        dropped and counted in a log line.
      tokenizer_sample: pairs sampled (uniformly, seeded) to train SentencePiece on.
      shard_pairs: about this many pairs per shard.
      min_shards: at least this many shards (one per worker that will read them).
      seed: seeds the sample, SentencePiece and the assignment of pairs to shards.
      scan: the result of :func:`pipelines.corpora.scan_corpus` with the same
        ``tokenizer_sample`` and ``seed``, if the split was already validated.
      subword_samples: subword regularization: 0 tokenizes each pair once, the
        deterministic segmentation; K > 0 writes K copies of the split instead, each pair
        segmented by seeded sampling (:func:`pipelines.shard_files.write_shards`), so that
        one pass over the shards is K epochs, each with its own segmentation of every pair.
      subword_alpha: the sampling's alpha (BPE-dropout's probability for a BPE model).

    Returns:
      The :class:`PreparedCorpus`.

    Raises:
      CorpusError: the corpus is invalid (before anything is written).
      PreparedError: ``directory`` exists and is not empty.
      ValueError: bad arguments, or SentencePiece cannot train on the sample.
      StorageError: the storage failed (full, over quota, read-only, failing), naming
        ``directory`` and the bytes it needs (estimated from the shards written, once
        known); nothing is left behind, neither ``directory`` nor a temporary folder.
    """
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise PreparedError(f"{directory}: exists and is not an empty directory; choose "
                            "another one or delete it")
    if shard_pairs < 1 or min_shards < 1:
        raise ValueError(f"shard_pairs and min_shards must be positive, got {shard_pairs}, "
                         f"{min_shards}")
    started = time.perf_counter()
    if scan is None:
        scan = scan_corpus(split, sample_pairs=tokenizer_sample, seed=seed)
    with storage.errors_about(directory):  # a full disk may refuse even a folder
        directory.parent.mkdir(parents=True, exist_ok=True)
        # Temporary folders of killed preparations of DIR on this host (other hosts' are
        # alive or not: their processes cannot be seen from here).
        storage.remove_stale_temporaries(directory.parent, prefix=_staging_prefix(directory))
        staging = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(directory)}{os.getpid()}-",
                                        dir=directory.parent))
    needed = failure = None  # the bytes DIR needs, once known; a failure of the storage
    try:
        settings = {"src_lang": split.src_lang, "tgt_lang": split.tgt_lang,
                    "vocab_size": vocab_size, "max_length": max_length,
                    "tokenizer_sample": tokenizer_sample, "seed": seed}
        if subword_samples:  # recorded only then: manifests without sampling are unchanged
            settings.update(sampling_settings(subword_samples, subword_alpha))
        sample = scan.sample
        tokenizer = train_tokenizer(
            [*sample.sources, *sample.targets], staging / TOKENIZER_DIR, vocab_size=vocab_size,
            seed=seed, extra_settings={"corpus_fingerprint": scan.fingerprint,
                                       "sample_pairs": len(sample),
                                       "corpus": f"{split.origin} [{split.split}] "
                                                 f"{split.src_lang}-{split.tgt_lang}"})
        num_shards = max(min_shards, math.ceil(scan.pairs / shard_pairs))
        try:
            shards, seen = shard_files.write_shards(
                split, tokenizer, staging, num_shards, max_length, seed, scan.pairs,
                sampled_copies=subword_samples, sampling_alpha=subword_alpha)
            num_shards = len(shards)
        except tf.errors.OpError as error:  # e.g. a CorpusError raised inside from_generator
            raise PreparedError(f"{split.origin} [{split.split}]: reading failed while "
                                f"tokenizing: {error.message}") from None
        except StorageError as error:
            needed = error.needed  # the shards' size, extrapolated from those written
            raise
        needed = storage.folder_bytes(staging)
        if seen != scan.pairs or split.identity() != scan.identity:
            raise PreparedError(f"{split.origin} [{split.split}] changed during preparation "
                                f"({scan.pairs} pairs validated, {seen} tokenized); prepare again")
        kept = sum(shard["pairs"] for shard in shards)
        log_dropped(f"{split.origin} [{split.split}] {split.src_lang}-{split.tgt_lang}", kept,
                    scan.pairs * max(subword_samples, 1), max_length,
                    "positions (subword pieces + EOS)")
        if kept == 0:
            raise ValueError(f"no pair of {split.origin} [{split.split}] fits max_length="
                             f"{max_length}; raise it")
        manifest = {
            "format_version": FORMAT_VERSION,
            "settings": settings,
            "corpus": scan.identity,
            "corpus_fingerprint": scan.fingerprint,
            "pairs_total": scan.pairs,
            "pairs_kept": kept,
            "id_dtype": shard_files.id_dtype(tokenizer.vocab_size),
            "tokenizer_vocab_size": tokenizer.vocab_size,
            "shards": shards,
            "seconds": round(time.perf_counter() - started, 1),
        }
        storage.write_json(staging / MANIFEST_FILE, manifest, indent=1)
        storage.replace_folder(staging, directory)  # fsyncs every file, then renames
    except OSError as error:
        failure = storage.storage_error(error, directory)
        if failure is None:
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if failure is not None:  # made again now that the staging folder's space is free
        raise StorageError(failure.errno, directory, needed) from None
    _LOG.info("prepared %d pairs into %d shards in %s (%.0f s)", kept, num_shards, directory,
              time.perf_counter() - started)
    return PreparedCorpus.load(directory)


def _staging_prefix(directory: Path) -> str:
    """Name prefix of ``directory``'s temporary folders made on this host."""
    return f".{directory.name}{_STAGING_PREFIX}{socket.gethostname()}-"
