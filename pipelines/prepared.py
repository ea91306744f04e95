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
    DIR/validation.ids, .lengths      the validation split's pairs, all, in corpus order, in
                                      the same format (manifest: "validation"), when it was
                                      given: validation without TensorFlow reads them
                                      (pipelines.numpy_batches.validation_batches)

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
import hashlib
import logging
import math
import os
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import tensorflow as tf

from pipelines import DEFAULT_SHARD_PAIRS, DEFAULT_TOKENIZER_SAMPLE, shard_files, storage
from pipelines.batching import chunk_stream
from pipelines.corpora import CorpusScan, CorpusSplit, ParallelCorpus, log_dropped, scan_corpus
from pipelines.prepared_folder import (  # numpy alone; re-exported for every existing import
    DAMAGED_ADVICE,
    FORMAT_VERSION,
    MANIFEST_FILE,
    TOKENIZER_DIR,
    VALIDATION,
    PreparedError,
    PreparedFolder,
    sampling_settings,
)
from pipelines.storage import StorageError
from pipelines.tokenizer import UNK_ID, SubwordTokenizer, train_tokenizer

__all__ = ["MANIFEST_FILE", "PreparedCorpus", "PreparedError", "damaged_shard", "prepare_corpus",
           "sampling_settings"]

_STAGING_PREFIX = ".tmp-prepare-"
_LOG = logging.getLogger("pipelines")


@dataclasses.dataclass(frozen=True)
class PreparedCorpus(PreparedFolder):
    """A complete prepared directory (see the module docstring); :meth:`load` opens one.

    :class:`~pipelines.prepared_folder.PreparedFolder` (numpy alone: manifest, checks,
    batch plans) with the tokenizer and the ``tf.data`` batches."""

    def tokenizer(self) -> SubwordTokenizer:
        """The SentencePiece tokenizer the shards were made with."""
        return SubwordTokenizer.load(self.directory / TOKENIZER_DIR)

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
        pipelines = {}
        if input_context is not None:
            pipelines = dict(num_input_pipelines=input_context.num_input_pipelines,
                             input_pipeline_id=input_context.input_pipeline_id,
                             num_replicas=input_context.num_replicas_in_sync)
        plan = self.stream_plan(tokens_per_batch=tokens_per_batch, max_length=max_length,
                                seed=seed, shuffle=shuffle, skip_batches=skip_batches,
                                bucket_boundaries=bucket_boundaries, **pipelines)
        shards = [self.manifest["shards"][i] for i in plan.shards]
        ids_files = tf.constant([str(self.directory / s["ids"]) for s in shards])
        lengths_files = tf.constant([str(self.directory / s["lengths"]) for s in shards])
        id_dtype = tf.as_dtype(self.manifest["id_dtype"])
        vocab_size = self.vocab_size

        def load_shard(index: tf.Tensor) -> tuple[tf.RaggedTensor, tf.RaggedTensor]:
            rows = shard_files.read_shard(ids_files[index], lengths_files[index], id_dtype,
                                          vocab_size)
            sources = tf.range(rows.nrows() // 2) * 2  # rows 0, 2, 4, ...
            return tf.gather(rows, sources), tf.gather(rows, sources + 1)

        return chunk_stream(len(plan.shards), load_shard, plan.ends, plan.boundaries,
                            seed=plan.seed, shuffle=shuffle, repeat=repeat, start=plan.start,
                            static_budget=plan.budget if static_shapes else None)


def damaged_shard(error: BaseException) -> PreparedError | None:
    """The one-line :class:`PreparedError` naming the shard file that failed the input
    pipeline's checks, if ``error`` (raised while iterating :meth:`PreparedCorpus.batches`,
    e.g. by ``model.fit``) is such a failure; otherwise None."""
    found = shard_files.failed_check(error)
    return None if found is None else PreparedError(f"{found}: {DAMAGED_ADVICE}")


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
    validation: ParallelCorpus | None = None,
    validation_split: str | None = None,
    tokenizer: SubwordTokenizer | None = None,
    tokenizer_data: Sequence[CorpusSplit] = (),
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
      validation: the validation split, if known: its token ids are prepared too (every
        pair, deterministic segmentation: :func:`pipelines.shard_files.write_validation`),
        for :func:`pipelines.numpy_batches.validation_batches` (training without
        TensorFlow). Without it the manifest has no ``"validation"`` entry.
      validation_split: the name ``validation`` was asked for by (``--val-split``),
        recorded beside its resolved name; default: the resolved one.
      tokenizer: the tokenizer to use instead of training one (fine-tuning a trained model
        keeps its vocabulary); its vocabulary size must be ``vocab_size``. Without it, one
        is trained on the sample, with the split's source tags
        (:meth:`~pipelines.corpora.CorpusSplit.source_tags`) reserved as single pieces.
      tokenizer_data: more splits whose text trains the tokenizer too (``tokenizer_sample``
        pairs sampled from each, seeded), not the model: one vocabulary for two domains from
        the start, for a model that will be fine-tuned on the second. Refused with a
        ``tokenizer`` (which is not trained).

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
    if tokenizer is not None and tokenizer_data:
        raise ValueError("tokenizer_data trains a new tokenizer; a given tokenizer (fine-tuning "
                         "keeps its vocabulary) trains none: give one or the other")
    if tokenizer is not None:
        check_tags_are_pieces(tokenizer, split.source_tags())
    started = time.perf_counter()
    if scan is None:
        scan = scan_corpus(split, sample_pairs=tokenizer_sample, seed=seed)
    with storage.errors_about(directory):  # a full disk may refuse even a folder
        directory.parent.mkdir(parents=True, exist_ok=True)
        # Temporary folders of killed preparations of DIR on this host (other hosts' are
        # alive or not: their processes cannot be seen from here).
        storage.remove_stale_temporaries(directory.parent, prefix=_staging_prefix(directory))
        staging = storage.staging_folder(directory.parent,
                                         f"{_staging_prefix(directory)}{os.getpid()}-")
    needed = failure = None  # the bytes DIR needs, once known; a failure of the storage
    try:
        settings = {"src_lang": split.src_lang, "tgt_lang": split.tgt_lang,
                    "vocab_size": vocab_size, "max_length": max_length,
                    "tokenizer_sample": tokenizer_sample, "seed": seed}
        if subword_samples:  # recorded only then: manifests without sampling are unchanged
            settings.update(sampling_settings(subword_samples, subword_alpha))
        sample = scan.sample
        if tokenizer is not None:
            if tokenizer.vocab_size != vocab_size:
                raise ValueError(f"the given tokenizer has {tokenizer.vocab_size} pieces, not "
                                 f"vocab_size={vocab_size}")
            settings["tokenizer_given"] = hashlib.sha256(tokenizer.model_proto).hexdigest()
            tokenizer.save(staging / TOKENIZER_DIR)
        else:
            texts = [*sample.sources, *sample.targets]
            for extra in tokenizer_data:
                extra_sample = scan_corpus(extra, sample_pairs=tokenizer_sample, seed=seed).sample
                texts += [*extra_sample.sources, *extra_sample.targets]
            if tokenizer_data:  # recorded only then: other manifests are unchanged
                settings["tokenizer_data"] = [extra.origin for extra in tokenizer_data]
            tokenizer = train_tokenizer(
                texts, staging / TOKENIZER_DIR,
                vocab_size=vocab_size, seed=seed, reserved_symbols=split.source_tags(),
                extra_settings={"corpus_fingerprint": scan.fingerprint,
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
        validation_entry = {}  # manifests without validation data are unchanged
        if validation is not None:
            try:
                validation_entry[VALIDATION] = shard_files.write_validation(
                    validation, tokenizer, staging, validation_split)
            except StorageError as error:
                needed += error.needed or 0
                raise
            needed = storage.folder_bytes(staging)
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
            **validation_entry,
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


def check_tags_are_pieces(tokenizer: SubwordTokenizer, tags: Sequence[str]) -> None:
    """Refuses source tags that a given tokenizer (fine-tuning keeps the old run's) does not
    hold as single pieces: a new tokenizer reserves them, an old one would split ``<BT>``
    into ``<``, ``B``, ``T``, ``>`` and the model would learn the tag from scratch.

    Raises:
        PreparedError: naming the tags and what to do.
    """
    if not tags:
        return
    boundary = int(tokenizer.piece_to_id(tf.constant("▁")))  # a word's start, its own piece
    split_tags = []
    for tag, ids in zip(tags, tokenizer.tokenize(tf.constant(list(tags))).to_list(),
                        strict=True):
        ids = ids[1:] if ids[:1] == [boundary] else ids
        if len(ids) != 1 or ids[0] == UNK_ID:
            split_tags.append(tag)
    if split_tags:
        raise PreparedError(
            f"the tag {split_tags[0]!r} is not one piece of the given tokenizer (the run "
            "fine-tuned from was trained without it): give --synthetic-tag '' (no tag), or "
            "a tag that tokenizer holds, or train from scratch with a new vocabulary")
