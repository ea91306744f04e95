"""A prepared corpus's folder read with numpy alone: its manifest, the checks of its shard
files, their format, and the batch plan of a stream over them.

What both readers of a prepared corpus share (the layout: :mod:`pipelines.prepared`):
:class:`pipelines.prepared.PreparedCorpus` (TensorFlow: tokenizer, ``tf.data`` batches)
extends :class:`PreparedFolder`, and :mod:`pipelines.numpy_batches` reads its batches
where TensorFlow is not installed (Keras' JAX backend). Nothing here imports TensorFlow or
SentencePiece.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines import storage
from pipelines.batch_plan import StreamPosition, check_budget, plan_batches
from pipelines.batch_plan import static_shapes as planned_static_shapes

if TYPE_CHECKING:
    from pipelines.corpora import CorpusSplit

__all__ = ["DAMAGED_ADVICE", "FORMAT_VERSION", "MANIFEST_FILE", "TOKENIZER_DIR", "VALIDATION",
           "PreparedError", "PreparedFolder", "StreamPlan", "failed_check_message",
           "file_dtype", "id_dtype", "sampling_settings"]

MANIFEST_FILE = "manifest.json"
TOKENIZER_DIR = "tokenizer"
VALIDATION = "validation"  # the manifest's key, and the name of its .ids/.lengths files
FORMAT_VERSION = 1
DAMAGED_ADVICE = ("the prepared corpus is damaged (a failing disk or an incomplete copy); "
                  "prepare it again, or copy it again from where it was prepared")
_LOG = logging.getLogger(__name__)
_PIPELINE_SEED_STRIDE = 7919  # input pipeline i shuffles with seed + 7919 * i


class PreparedError(ValueError):
    """A prepared directory is missing, incomplete, damaged, or made with other settings."""


def id_dtype(vocab_size: int) -> str:
    """The dtype of the ids on disk: uint16 while the vocabulary fits."""
    return "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "int32"


def file_dtype(name: str) -> np.dtype:
    """Little-endian on disk whatever the machine (``tf.io.decode_raw`` reads it so)."""
    return np.dtype(name).newbyteorder("<")


def failed_check_message(kind: str, file: str | os.PathLike, first: int, second: int,
                         third: int) -> str:
    """What a failed check of a shard's files found, as ``"<file>: <what>"``.

    Args:
      kind: "ids": an id outside the vocabulary; ``first`` is that id, ``second`` the
        number of ids, ``third`` the vocabulary size. "lengths": lengths that do not add
        up; ``first`` is their sum, ``second`` the shortest, ``third`` the number of ids.
    """
    if kind == "ids":
        return (f"{file}: token id {first} among its {second} ids, outside the vocabulary "
                f"(0 to {third - 1})")
    return (f"{file}: lengths adding up to {first} pieces (the shortest {second}) where its "
            f".ids file holds {third}")


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """What one input pipeline reads of a prepared folder, and how it batches it
    (:meth:`PreparedFolder.stream_plan`)."""

    shards: list[int]  # the shards it reads, by index in the manifest: its chunks, in order
    ends: list[np.ndarray]  # per chunk, the end offsets of its batches (plan_batches)
    boundaries: list[int]  # the bucket boundaries
    budget: int  # tokens per batch of one replica
    max_length: int  # longest pair kept, in positions
    seed: int  # the stream's seed: this pipeline's own
    start: StreamPosition  # where the stream starts


@dataclasses.dataclass(frozen=True)
class PreparedFolder:
    """A complete prepared directory, without its tokenizer; :meth:`load` opens one."""

    directory: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, directory: str | os.PathLike) -> PreparedFolder:
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
            files = [*manifest["shards"], *([manifest[VALIDATION]] if VALIDATION in manifest
                                            else [])]
            for shard in files:
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
        """Recomputes the CRC-32 of every file of ``shards`` (default: all, and the
        validation split's files if any) and compares it with the manifest's: what
        :meth:`load`'s size checks miss, bytes changed in place.

        Reads every byte (0.8 GB/s from the development machine's disk, 1.2 GB/s from the
        page cache: BENCHMARKS.md): a training run does it once before its first step. A
        manifest written before checksums were recorded has none: its files are not
        verified.

        Raises:
          PreparedError: the first file whose checksum differs, or that cannot be read.
        """
        entries = [self.manifest["shards"][index]
                   for index in (range(self.num_shards) if shards is None else shards)]
        if shards is None and self.validation is not None:
            entries.append(self.validation)
        for shard in entries:
            for kind in ("ids", "lengths"):
                recorded = shard.get(f"{kind}_crc32")
                if recorded is None:
                    continue
                file = self.directory / shard[kind]
                try:
                    found = f"{storage.file_checksum(file):08x}"
                except OSError as error:
                    raise PreparedError(f"{file}: unreadable ({error.strerror or error}); "
                                        f"{DAMAGED_ADVICE}") from None
                if found != recorded:
                    raise PreparedError(f"{file}: checksum {found}, the manifest says "
                                        f"{recorded}: {DAMAGED_ADVICE}")

    @property
    def settings(self) -> dict[str, Any]:
        """How it was prepared: languages, vocab_size, max_length, tokenizer_sample, seed."""
        return dict(self.manifest["settings"])

    @property
    def validation(self) -> dict[str, Any] | None:
        """The validation split's entry in the manifest, or None (prepared without one, or
        by a version that did not prepare it): its ``split`` (the name it was opened with,
        ``requested_split`` the one asked for), ``origin``, ``src_lang``, ``tgt_lang``,
        ``corpus_fingerprint`` and ``pairs`` (all of them, in corpus order, whatever their
        length), and its files as a shard's (``ids``, ``lengths``, their ``_bytes`` and
        ``_crc32``, ``source_pieces``, ``target_pieces``)."""
        return self.manifest.get(VALIDATION)

    def check_validation(self, split: str | None = None) -> dict[str, Any]:
        """The validation split's entry (:attr:`validation`), checked to be there and, if
        ``split`` is given, to be that split (by the name asked for or the one opened).

        Raises:
          PreparedError: no validation data, or another split's, saying how to prepare them.
        """
        entry = self.validation
        advice = ("prepare the corpus again with this version, into a new folder "
                  f"(`python -m keras_transformer.prepare ... --val-split {split or 'SPLIT'} "
                  "--out NEW`, then --prepared NEW)")
        if entry is None:
            raise PreparedError(f"{self.directory} holds no validation split (prepared by an "
                                f"earlier version, or without one); {advice}")
        if split is not None and split not in (entry.get("requested_split"), entry["split"]):
            raise PreparedError(f"{self.directory} holds the validation split "
                                f"{entry['split']!r} of {entry['origin']}, not {split!r}; "
                                f"{advice}")
        return entry

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

    @property
    def vocab_size(self) -> int:
        """The ids are below this: the tokenizer's vocabulary size."""
        return int(self.manifest.get("tokenizer_vocab_size", self.settings["vocab_size"]))

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

        Only the same files (same resolved paths) are compared: a copy of the corpus
        elsewhere, or on another machine, is not judged. A file of another size has changed.
        A file of the same size with another modification time (data copied again, a
        volume mounted again, ``touch``) is judged by its content: the split is read once
        and its fingerprint compared with the one recorded at preparation; when they agree,
        the new times are recorded, so the next check is cheap again.
        """
        recorded = self.manifest["corpus"]
        current = split.identity()
        if corpus_mix(recorded) != corpus_mix(current):
            # The files match one by one, but not how they are combined: another
            # --synthetic, --add-data, --upsample-real or tag is another corpus.
            then, now = describe_mix(recorded), describe_mix(current)
            if then == now:
                now = "the same files, carved (or cleaned) otherwise"
            raise PreparedError(
                f"{self.directory} was prepared from another mix of corpora "
                f"({then}; this run's: {now}); use the "
                "same --data/--add-data/--synthetic/--upsample-real/--synthetic-tag (and, "
                "for carved splits, --seed/--carve-pairs/--clean-train), another directory, "
                "or delete it to prepare again")
        touched = []
        for old, new in zip(recorded.get("files", []), current.get("files", []), strict=False):
            if old["path"] != new["path"] or (
                    old["bytes"], old["mtime_ns"]) == (new["bytes"], new["mtime_ns"]):
                continue
            if old["bytes"] != new["bytes"]:
                raise PreparedError(
                    f"{new['path']} changed since {self.directory} was prepared from it "
                    f"({new['bytes']:,} bytes, then {old['bytes']:,}); delete the prepared "
                    "directory to prepare again, or restore the file")
            touched.append(new["path"])
        if not touched:
            return
        from pipelines.corpora import corpus_fingerprint  # TensorFlow: only with a CorpusSplit

        if corpus_fingerprint(split) != self.manifest["corpus_fingerprint"]:
            raise PreparedError(
                f"{touched[0]} changed since {self.directory} was prepared from it (same "
                "size, other content); delete the prepared directory to prepare again, or "
                "restore the file")
        _LOG.info(f"{', '.join(touched)}: modified since {self.directory} was prepared, "
                  "the same content; recording the new times")
        self.manifest["corpus"] = current
        try:
            storage.write_json(self.directory / MANIFEST_FILE, self.manifest, indent=1)
        except OSError as error:  # a read-only --prepared folder: check again next time
            _LOG.warning(f"could not record the new times in {self.directory} ({error})")

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

    def stream_plan(
        self,
        *,
        tokens_per_batch: int,
        max_length: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas: int = 1,
        skip_batches: int = 0,
        bucket_boundaries: Sequence[int] | None = None,
    ) -> StreamPlan:
        """The checked arguments of a stream of batches (``PreparedCorpus.batches``,
        :func:`pipelines.numpy_batches.prepared_batches`): its shards, their plans, its seed
        and its start.

        Args:
          tokens_per_batch: global token budget of one batch, split over ``num_replicas``.
          max_length: longest pair kept, in positions; at most the prepared one (default).
          seed: seeds the shuffling of each epoch.
          shuffle: whether the stream shuffles (the start depends on it).
          num_input_pipelines, input_pipeline_id: pipeline ``i`` of ``n`` reads shards
            ``i, i + n, ...`` only (sharding by file), with its own seed.
          num_replicas: replicas in sync: each batch holds one replica's share of the budget.
          skip_batches: the stream starts after this many of its batches (no replay).
          bucket_boundaries: as :func:`pipelines.batching.make_batches`.

        Raises:
          PreparedError: fewer shards than input pipelines, a max_length above the
            prepared one, or no pair within max_length in the pipeline's shards.
          ValueError: invalid budget arguments or a negative skip_batches.
        """
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        prepared_length = int(self.settings["max_length"])
        max_length = prepared_length if max_length is None else max_length
        if max_length > prepared_length:
            raise PreparedError(f"max_length {max_length} exceeds the {prepared_length} that "
                                f"{self.directory} was prepared with; prepare it again with "
                                f"--max-length {max_length}")
        pipelines, pipeline = num_input_pipelines, input_pipeline_id
        if self.num_shards < pipelines:
            raise PreparedError(
                f"{self.directory} has {self.num_shards} shard(s) for {pipelines} input "
                f"pipelines (workers); prepare it with --shards {pipelines} or more")
        budget, boundaries = check_budget(tokens_per_batch, max_length, num_replicas,
                                          bucket_boundaries)
        mine = list(range(pipeline, self.num_shards, pipelines))
        ends = [self._plan(i, boundaries, budget, max_length) for i in mine]
        if not any(len(e) for e in ends):
            raise PreparedError(
                f"{self.directory}: input pipeline {pipeline} of {pipelines} has no pair within "
                f"max_length {max_length} in its shards {mine}; prepare more pairs or fewer shards")
        stream_seed = seed + _PIPELINE_SEED_STRIDE * pipeline
        start = StreamPosition.after(skip_batches, [len(e) for e in ends], seed=stream_seed,
                                     shuffle=shuffle) if skip_batches else StreamPosition()
        return StreamPlan(mine, ends, boundaries, budget, max_length, stream_seed, start)


def sampling_settings(subword_samples: int, subword_alpha: float) -> dict[str, Any]:
    """How a prepared directory's training pairs were segmented, as
    :meth:`PreparedFolder.check_settings` compares it (a manifest records it only with
    sampled copies): the alpha only matters when there are some."""
    return {"subword_samples": subword_samples,
            "subword_alpha": subword_alpha if subword_samples else None}


def corpus_mix(identity: Mapping[str, Any]) -> dict[str, Any]:
    """How a corpus identity (:meth:`pipelines.corpora.CorpusSplit.identity`) combines its
    files, without where they are: the number of files, each part's repeat, tag and
    selection. Two identities of one mix agree here even when their files were moved or
    copied; another --synthetic, --add-data, --upsample-real or tag does not."""
    return {"files": len(identity.get("files", [])), "repeat": identity.get("repeat", 1),
            "source_tag": identity.get("source_tag"), "selection": identity.get("selection"),
            "parts": [corpus_mix(part) for part in identity.get("parts", [])]}


def describe_mix(identity: Mapping[str, Any]) -> str:
    """E.g. "3 parts: train ×5, train, train tagged <BT>" or "one corpus of 2 files"."""
    def part(mix: Mapping[str, Any], name: str) -> str:
        return (name + (f" ×{mix['repeat']}" if mix["repeat"] != 1 else "")
                + (f" tagged {mix['source_tag']}" if mix["source_tag"] else "")
                + (f" ({describe_selection(mix['selection'])})" if mix["selection"]
                   else ""))

    mix = corpus_mix(identity)
    if not mix["parts"]:
        return part(mix, f"one corpus of {mix['files']} files")
    names = [str(p.get("origin", "?")) for p in identity["parts"]]
    return f"{len(names)} parts: " + ", ".join(
        part(m, name) for m, name in zip(mix["parts"], names, strict=True))


def describe_selection(selection: Mapping[str, Any]) -> str:
    """A training selection's identity (:meth:`pipelines.pair_selection.TrainSelection.identity`)
    in words: "seed 0, val and test carved out, noise dropped"."""
    held_out = " and ".join(str(band[0]) for band in selection.get("bands") or [])
    return ", ".join([f"seed {selection.get('seed')}"]
                     + ([f"{held_out} carved out"] if held_out else [])
                     + (["noise dropped"] if selection.get("clean") else []))
