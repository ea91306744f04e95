"""The batches of a prepared corpus with numpy alone: for machines without TensorFlow
(Keras' JAX backend), the same batches in the same order as the ``tf.data`` pipeline.

:func:`prepared_batches` yields, for the same arguments, what
:meth:`pipelines.prepared.PreparedCorpus.batches` yields, array for array (format and
bucketing: :mod:`pipelines.batching`)::

    ({"source": int32 [B, S], "target": int32 [B, T]}, labels int32 [B, T])

:func:`validation_batches` gives, from the validation split's ids prepared beside the
shards, what :func:`pipelines.batching.make_batches` gives with ``shuffle=False`` from its
text and the tokenizer: the validation batches.

The plan (token budget, buckets, where a resumed stream starts) is
:mod:`pipelines.batch_plan`; the seeded orders of chunks, pairs and batches are TensorFlow's
stateless Philox shuffles reproduced in numpy (:mod:`pipelines.philox`); a shard is read
and checked (ids within the vocabulary, lengths adding up) as
:func:`pipelines.shard_files.read_shard` does, a damaged one raising the same one-line
:class:`~pipelines.prepared_folder.PreparedError`. Checksums are
:meth:`PreparedFolder.verify`'s, once before training, as with TensorFlow.

Nothing here imports TensorFlow or SentencePiece (tests/pipelines/test_numpy_batches.py
imports it with both blocked).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from pipelines.batch_plan import (
    StreamPosition,
    check_budget,
    chunk_order,
    log_dropped,
    pair_and_batch_order,
    plan_batches,
    position_histogram,
)
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID
from pipelines.prepared_folder import (
    DAMAGED_ADVICE,
    PreparedError,
    PreparedFolder,
    failed_check_message,
    file_dtype,
)

__all__ = ["Batch", "chunk_batches", "prepared_batches", "read_shard", "validation_batches"]

Batch = tuple[dict[str, np.ndarray], np.ndarray]  # ({"source", "target"}, labels)


def read_shard(folder: PreparedFolder, shard: int) -> tuple[np.ndarray, np.ndarray]:
    """Shard ``shard``'s token ids and lengths, checked.

    Returns:
      int32 ``[ids]``, every pair's source pieces then its target pieces, and int64
      ``[pairs, 2]``, the pieces of each pair's source and target.

    Raises:
      PreparedError: a file that cannot be read, an id outside the vocabulary, or lengths
        that do not add up to the ids (the message of
        :func:`pipelines.prepared.damaged_shard`).
    """
    return _read_files(folder, folder.manifest["shards"][shard])


def _read_files(folder: PreparedFolder, entry: dict) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_shard` of the files of a manifest entry (a shard, or the validation's)."""
    ids_file, lengths_file = folder.directory / entry["ids"], folder.directory / entry["lengths"]
    raw = _read(ids_file, file_dtype(folder.manifest["id_dtype"]))
    lengths = _read(lengths_file, file_dtype("int32"), group=2)
    vocab_size = folder.vocab_size
    if raw.size and (raw.min() < 0 or raw.max() >= vocab_size):
        found = raw.min() if raw.min() < 0 else raw.max()
        _damaged("ids", ids_file, int(found), raw.size, vocab_size)
    pieces = int(lengths.sum(dtype=np.int64))
    if pieces != raw.size or (lengths.size and lengths.min() < 0):
        shortest = int(lengths.min()) if lengths.size else np.iinfo(np.int32).max
        _damaged("lengths", lengths_file, pieces, shortest, raw.size)
    return raw.astype(np.int32), lengths.astype(np.int64).reshape(-1, 2)


def prepared_batches(
    folder: PreparedFolder | str | os.PathLike,
    *,
    tokens_per_batch: int,
    max_length: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    repeat: bool = True,
    num_input_pipelines: int = 1,
    input_pipeline_id: int = 0,
    num_replicas: int = 1,
    skip_batches: int = 0,
    bucket_boundaries: Sequence[int] | None = None,
    static_shapes: bool = False,
) -> Iterator[Batch]:
    """Token-budget batches of a prepared folder: what ``PreparedCorpus.batches`` yields
    with the same arguments (``input_context`` given as its three numbers).

    Args:
      folder: a :class:`PreparedFolder` (or :class:`~pipelines.prepared.PreparedCorpus`),
        or its directory (then opened with :meth:`PreparedFolder.load`; verify it first).
      tokens_per_batch: global token budget of one batch, split over ``num_replicas``.
      max_length: longest pair kept, in positions; at most the prepared one (default).
      seed: seeds the shuffling of each epoch.
      shuffle, repeat: as :func:`pipelines.batching.make_batches`.
      num_input_pipelines, input_pipeline_id, num_replicas: those of a
        ``tf.distribute.InputContext``: pipeline ``i`` of ``n`` reads shards ``i, i + n,
        ...`` only, and each batch holds ``tokens_per_batch // num_replicas`` tokens.
      skip_batches: start after this many batches of this pipeline's stream, at the cost
        of reading one shard (no replay): how a resumed run continues.
      bucket_boundaries, static_shapes: as :func:`pipelines.batching.make_batches`.

    Returns:
      An iterator of ``({"source", "target"}, labels)`` numpy batches; the arguments are
      checked here, the shards read (one at a time) as it is iterated.

    Raises:
      PreparedError, ValueError: as ``PreparedCorpus.batches``; while iterating, a
        damaged shard (:func:`read_shard`).
    """
    if not isinstance(folder, PreparedFolder):
        folder = PreparedFolder.load(folder)
    plan = folder.stream_plan(
        tokens_per_batch=tokens_per_batch, max_length=max_length, seed=seed, shuffle=shuffle,
        num_input_pipelines=num_input_pipelines, input_pipeline_id=input_pipeline_id,
        num_replicas=num_replicas, skip_batches=skip_batches,
        bucket_boundaries=bucket_boundaries)
    return chunk_batches(len(plan.shards), lambda chunk: read_shard(folder, plan.shards[chunk]),
                         plan.ends, plan.boundaries, seed=plan.seed, shuffle=shuffle,
                         repeat=repeat, start=plan.start,
                         static_budget=plan.budget if static_shapes else None)


def validation_batches(
    folder: PreparedFolder | str | os.PathLike,
    *,
    tokens_per_batch: int,
    max_length: int | None = None,
    seed: int = 0,
    num_input_pipelines: int = 1,
    input_pipeline_id: int = 0,
    num_replicas: int = 1,
    bucket_boundaries: Sequence[int] | None = None,
    static_shapes: bool = False,
) -> list[Batch]:
    """One pass over the validation split of a prepared folder: the batches that
    ``pipelines.batching.make_batches(val, tokenizer, shuffle=False, ...)`` yields with the
    same arguments (``input_context`` given as its three numbers), array for array, in the
    same order, read from the token ids prepared with the training shards
    (:func:`pipelines.shard_files.write_validation`) instead of tokenizing the text.

    As ``make_batches``: pipeline ``i`` of ``n`` takes pairs ``i, i + n, ...``; pairs longer
    than ``max_length`` positions are dropped (and counted in the same log line); the rest
    are sorted by bucket (stably: corpus order within one) and cut by the token budget
    (``tokens_per_batch // num_replicas`` a batch), the batches in that order. Nothing is
    shuffled, so ``seed`` changes nothing (taken for the same arguments).

    Args:
      folder: a :class:`PreparedFolder` (or :class:`~pipelines.prepared.PreparedCorpus`),
        or its directory (then opened with :meth:`PreparedFolder.load`; verify it first).
      tokens_per_batch: global token budget of one batch, split over ``num_replicas``.
      max_length: longest pair kept, in positions; default: the prepared one. (Unlike the
        training shards' the validation ids hold every pair, so any max_length works.)
      seed: unused (no shuffling); as ``make_batches``.
      num_input_pipelines, input_pipeline_id, num_replicas: those of a
        ``tf.distribute.InputContext``.
      bucket_boundaries, static_shapes: as :func:`pipelines.batching.make_batches`.

    Returns:
      The ``({"source", "target"}, labels)`` numpy batches of one pass.

    Raises:
      PreparedError: the folder holds no validation split (prepared by an earlier version,
        or without one), or its files are damaged (:func:`read_shard`'s messages).
      ValueError: invalid budget arguments, or no pair within max_length (as
        ``make_batches``).
    """
    del seed  # make_batches(shuffle=False) draws nothing
    if not isinstance(folder, PreparedFolder):
        folder = PreparedFolder.load(folder)
    entry = folder.check_validation()
    if max_length is None:
        max_length = int(folder.settings["max_length"])
    budget, boundaries = check_budget(tokens_per_batch, max_length, num_replicas,
                                      bucket_boundaries)
    ids, lengths = _read_files(folder, entry)
    starts = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))])[:-1]  # of each pair's ids
    if num_input_pipelines > 1:
        starts, lengths = (starts[input_pipeline_id::num_input_pipelines],
                           lengths[input_pipeline_id::num_input_pipelines])
    keep = lengths.max(axis=1, initial=0) + 1 <= max_length
    name = f"{entry['origin']} [{entry['split']}] {entry['src_lang']}-{entry['tgt_lang']}"
    log_dropped(name, int(keep.sum()), len(keep), max_length, "positions (subword pieces + EOS)")
    if not keep.any():
        raise ValueError(f"no pair of {entry['origin']} [{entry['split']}] fits max_length="
                         f"{max_length}; raise it")
    starts, lengths = starts[keep], lengths[keep]
    # The kept pairs' ids, one after the other: a chunk as read_shard returns one.
    sizes = lengths.sum(axis=1)
    chunk_ids = ids[np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
                    + np.arange(sizes.sum())]
    ends = plan_batches(position_histogram(lengths[:, 0], lengths[:, 1], max_length),
                        boundaries, budget)
    return list(chunk_batches(1, lambda chunk: (chunk_ids, lengths), [ends], boundaries,
                              seed=0, shuffle=False, repeat=False,
                              static_budget=budget if static_shapes else None))


def chunk_batches(
    num_chunks: int,
    load_chunk: Callable[[int], tuple[np.ndarray, np.ndarray]],
    chunk_ends: Sequence[np.ndarray],
    boundaries: Sequence[int],
    *,
    seed: int,
    shuffle: bool,
    repeat: bool,
    start: StreamPosition = StreamPosition(),  # noqa: B008 (immutable)
    static_budget: int | None = None,
) -> Iterator[Batch]:
    """Batches of a sequence of chunks: :func:`pipelines.batching.chunk_stream` (with its
    default epoch numbers) in numpy.

    Args:
      num_chunks: how many chunks there are.
      load_chunk: maps a chunk index to its ``(ids, lengths)`` (:func:`read_shard`).
      chunk_ends, boundaries, seed, shuffle, repeat, start, static_budget: as
        :func:`pipelines.batching.chunk_stream`.
    """
    boundary_table = np.asarray(boundaries, np.int64)

    def items() -> Iterator[tuple[int, int]]:  # (epoch, chunk), as chunk_stream's flat_map
        if not repeat and start.epoch > 0:  # started past the end of the only epoch
            return
        epochs = itertools.count(start.epoch) if repeat else [start.epoch]
        for epoch in epochs:
            for chunk in chunk_order(num_chunks, seed, epoch, shuffle).tolist():
                yield epoch, chunk

    for index, (epoch, chunk) in enumerate(itertools.islice(items(), start.chunk, None)):
        ids, lengths = load_chunk(chunk)
        keys = np.searchsorted(boundary_table, lengths.max(axis=1, initial=0) + 1, side="left")
        ends = np.asarray(chunk_ends[chunk], np.int64)
        order, batch_order = pair_and_batch_order(keys, len(ends), seed=seed, chunk=chunk,
                                                  epoch=epoch, shuffle=shuffle)
        splits = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])
        starts = splits[:-1].reshape(-1, 2)
        firsts = np.concatenate([[0], ends[:-1]])
        for batch in batch_order[start.batch if index == 0 else 0:].tolist():
            rows = order[firsts[batch]:ends[batch]]
            yield _assemble(ids, starts[rows], lengths[rows], boundary_table, static_budget)


def _assemble(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
              boundary_table: np.ndarray, static_budget: int | None) -> Batch:
    """One batch of the pairs at ``starts`` (int64 [B, 2]) with ``lengths`` (int64 [B, 2]):
    source + EOS, BOS + target, target + EOS, each padded to its bucket's boundary (or all
    three to ``static_budget // b`` rows of ``b``, ``b`` the bucket of the longest)."""
    def width(longest: int) -> int:
        return int(boundary_table[np.searchsorted(boundary_table, longest, side="left")])

    source_width = width(int(lengths[:, 0].max()) + 1)
    target_width = width(int(lengths[:, 1].max()) + 1)
    rows = len(lengths)
    if static_budget is not None:
        source_width = target_width = width(int(lengths.max()) + 1)
        rows = static_budget // source_width
    source = _padded(ids, starts[:, 0], lengths[:, 0], rows, source_width, 0, EOS_ID)
    target = _padded(ids, starts[:, 1], lengths[:, 1], rows, target_width, 1, None)
    labels = _padded(ids, starts[:, 1], lengths[:, 1], rows, target_width, 0, EOS_ID)
    target[:len(lengths), 0] = BOS_ID
    return {"source": source, "target": target}, labels


def _padded(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, rows: int, width: int,
            lead: int, end: int | None) -> np.ndarray:
    """int32 ``[rows, width]``, PAD-filled: row ``i`` holds ``ids[starts[i]:][:lengths[i]]``
    from column ``lead``, then ``end`` if given."""
    columns = np.arange(width, dtype=np.int64) - lead
    inside = (columns >= 0) & (columns < lengths[:, None])
    out = np.full((rows, width), PAD_ID, np.int32)
    pairs = out[:len(lengths)]
    pairs[inside] = ids[(starts[:, None] + columns)[inside]]
    if end is not None:
        pairs[np.arange(len(lengths)), lengths + lead] = end
    return out


def _read(file: Path, dtype: np.dtype, group: int = 1) -> np.ndarray:
    """A shard file's values, read whole; a :class:`PreparedError` naming the file if it
    cannot be read or does not hold whole groups of ``group`` values."""
    try:
        data = file.read_bytes()
    except OSError as error:
        raise PreparedError(f"{file}: unreadable ({error.strerror or error}); "
                            f"{DAMAGED_ADVICE}") from None
    if len(data) % (dtype.itemsize * group):
        raise PreparedError(f"{file}: {len(data)} bytes, not a whole number of {group} x "
                            f"{dtype.name}; {DAMAGED_ADVICE}")
    return np.frombuffer(data, dtype)


def _damaged(kind: str, file: Path, first: int, second: int, third: int) -> None:
    raise PreparedError(f"{failed_check_message(kind, file, first, second, third)}: "
                        f"{DAMAGED_ADVICE}")
