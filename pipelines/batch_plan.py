"""The plan of token-budget batches, in numpy alone: bucket boundaries, the greedy budget
per chunk, the seeded orders of chunks, pairs and batches, and where a stream resumes.

Both readers of a prepared corpus follow it: the ``tf.data`` pipeline
(:mod:`pipelines.batching`, which re-exports these names) and the numpy reader
(:mod:`pipelines.numpy_batches`, for machines without TensorFlow). The orders are drawn by
:func:`pipelines.philox.stateless_shuffle`, which equals TensorFlow's stateless shuffle
with the Philox algorithm, so the two readers yield the same batches in the same order.
See :mod:`pipelines.batching` for the batch format and the bucketing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from pipelines.philox import stateless_shuffle

__all__ = [
    "CHUNK_SEED_STRIDE",
    "StreamPosition",
    "check_budget",
    "chunk_order",
    "default_bucket_boundaries",
    "log_dropped",
    "pair_and_batch_order",
    "plan_batches",
    "position_histogram",
    "static_shapes",
    "xla_bucket_boundaries",
]

CHUNK_SEED_STRIDE = 1_000_003  # keeps the seeds of chunks, epochs and batch orders apart
_LOG = logging.getLogger("pipelines")


def _bucket_grid(max_length: int, first: int, fine: Sequence[tuple[int, int]], growth: float,
                 multiple: int = 1) -> list[int]:
    """Boundaries from ``first``: a fixed ``step`` while below each ``(limit, step)`` of
    ``fine``, then x``growth`` rounded up to a multiple of ``multiple``, then max_length."""
    boundaries, length = [], first
    while length < max_length:
        boundaries.append(length)
        step = next((step for limit, step in fine if length < limit), None)
        length = length + step if step else int(np.ceil(length * growth / multiple) * multiple)
    return [*boundaries, max_length]


def default_bucket_boundaries(max_length: int) -> list[int]:
    """Bucket upper bounds: every length up to 24, every 2nd up to 48, then x1.1, then max_length.

    Fine steps where most sentences are keep padding low; geometric growth keeps the
    number of buckets (and distinct batch shapes) small for long sentences.
    """
    return _bucket_grid(max_length, 1, ((24, 1), (48, 2)), 1.1)


def xla_bucket_boundaries(max_length: int) -> list[int]:
    """Coarser buckets for XLA-compiled steps: every 4th length up to 32, every 8th up to 64,
    then x1.25 (multiples of 8), then max_length. With ``static_shapes`` every batch of a
    bucket has one shape, so an epoch compiles at most ``len(boundaries)`` step shapes (15
    for max_length 128; Multi30k's train split: 10, against 25 with the default buckets).
    """
    return _bucket_grid(max_length, 4, ((32, 4), (64, 8)), 1.25, multiple=8)


def static_shapes(ends: np.ndarray, histogram: np.ndarray, boundaries: Sequence[int],
                  budget: int) -> set[tuple[int, int]]:
    """The ``(B, width)`` shapes of planned batches padded to static shapes: each batch is
    ``budget // b`` rows of ``b`` positions, ``b`` the bucket of its longest pair.

    Args:
      ends: :func:`plan_batches` of ``histogram``.
      histogram: pairs per length (:func:`position_histogram`).
      boundaries, budget: as given to :func:`plan_batches`.
    """
    if not len(ends):
        return set()
    cumulative = np.cumsum(np.asarray(histogram, np.int64))
    per_bucket = cumulative[np.minimum(np.asarray(boundaries), len(cumulative) - 1)]
    buckets = np.searchsorted(per_bucket, np.asarray(ends) - 1, side="right")
    widths = np.asarray(boundaries)[buckets]
    return {(budget // int(w), int(w)) for w in widths}


def check_budget(
    tokens_per_batch: int,
    max_length: int,
    num_replicas: int,
    bucket_boundaries: Sequence[int] | None = None,
) -> tuple[int, list[int]]:
    """Validate batching arguments; return the per-replica token budget and the boundaries.

    Raises:
      ValueError: naming the argument and the smallest valid value where there is one.
    """
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an int >= 2 (a piece and EOS), got {max_length!r}")
    if not isinstance(tokens_per_batch, int) or tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch must be a positive int, got {tokens_per_batch!r}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas_in_sync must be positive, got {num_replicas}")
    budget = tokens_per_batch // num_replicas
    if budget < max_length:
        raise ValueError(
            f"tokens_per_batch={tokens_per_batch} over {num_replicas} replica(s) leaves {budget} "
            f"tokens per replica batch, fewer than max_length={max_length}: a longest pair "
            f"would not fit; use tokens_per_batch >= {max_length * num_replicas} or lower max_length"
        )
    if bucket_boundaries is None:
        return budget, default_bucket_boundaries(max_length)
    boundaries = [int(b) for b in bucket_boundaries]
    if any(b != original for b, original in zip(boundaries, bucket_boundaries, strict=True)):
        raise ValueError(f"bucket_boundaries must be integers, got {list(bucket_boundaries)}")
    if (
        not boundaries
        or boundaries[0] < 1
        or any(a >= b for a, b in zip(boundaries, boundaries[1:], strict=False))
    ):
        raise ValueError(
            f"bucket_boundaries must be strictly increasing positive ints, got {boundaries}"
        )
    if boundaries[-1] > max_length:
        raise ValueError(
            f"bucket_boundaries go up to {boundaries[-1]} but max_length is {max_length}: no "
            "sequence is longer than max_length, drop the larger boundaries"
        )
    if boundaries[-1] < max_length:
        boundaries.append(max_length)
    return budget, boundaries


def position_histogram(source_pieces: np.ndarray, target_pieces: np.ndarray,
                       max_length: int) -> np.ndarray:
    """Counts of pairs by length in positions, ``max(pieces) + 1``: int64 ``[max_length + 1]``.

    Pairs longer than ``max_length`` positions are not counted.
    """
    positions = np.maximum(source_pieces, target_pieces).astype(np.int64) + 1
    return np.bincount(positions[positions <= max_length], minlength=max_length + 1)


def log_dropped(name: str, kept: int, total: int, max_length: int, unit: str) -> None:
    """The one log line that counts pairs dropped for length (INFO if any were, else DEBUG:
    evaluation re-batches its splits several times, and "dropped 0" each time is noise)."""
    dropped = total - kept
    _LOG.log(logging.INFO if dropped else logging.DEBUG,
             "%s: kept %d of %d pairs, dropped %d (%.2f%%) longer than %d %s", name, kept,
             total, dropped, 100.0 * dropped / max(total, 1), max_length, unit)


def plan_batches(histogram: np.ndarray, boundaries: Sequence[int], budget: int) -> np.ndarray:
    """End offsets of a chunk's batches, its pairs sorted by bucket: int64 ``[batches]``.

    Greedy: batches fill in bucket order; a batch holds at most ``budget // b`` pairs where
    ``b`` is the boundary of its longest pair's bucket. Only the last batch of a chunk
    (and a batch that reaches into a longer bucket) can hold fewer. Pairs beyond the
    last boundary are not batched.

    Args:
      histogram: pairs per length in positions (:func:`position_histogram`).
      boundaries: increasing bucket upper bounds.
      budget: tokens per batch (per replica).
    """
    histogram = np.asarray(histogram, dtype=np.int64)
    edges = np.concatenate([[0], np.asarray(boundaries, dtype=np.int64)])
    cumulative = np.concatenate([[0], np.cumsum(histogram)])
    upper = np.minimum(edges + 1, len(histogram))
    counts = np.diff(cumulative[upper])  # pairs with boundary[i-1] < length <= boundary[i]
    ends: list[int] = []
    position = open_size = 0
    for count, boundary in zip(counts.tolist(), boundaries, strict=True):
        if count == 0:
            continue
        capacity = budget // boundary
        if open_size >= capacity:  # the open batch cannot take a longer pair: close it
            ends.append(position)
            open_size = 0
        take = min(count, capacity - open_size)
        position, open_size, count = position + take, open_size + take, count - take
        if open_size < capacity:  # the bucket fitted into the open batch
            continue
        ends.append(position)
        full, rest = divmod(count, capacity)
        ends.extend(position + capacity * np.arange(1, full + 1))
        position += capacity * full + rest
        open_size = rest
    if open_size:
        ends.append(position)
    return np.asarray(ends, dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class StreamPosition:
    """Where a chunk stream starts: epoch, position in that epoch's chunk order, batches
    to skip in that chunk. ``StreamPosition()`` is the beginning."""

    epoch: int = 0
    chunk: int = 0
    batch: int = 0

    @classmethod
    def after(cls, batches: int, chunk_batches: Sequence[int], *, seed: int,
              shuffle: bool = True) -> StreamPosition:
        """The position after ``batches`` batches of a stream from the beginning.

        Arithmetic on the chunks' batch counts: the cost does not grow with ``batches``.
        """
        per_epoch = int(np.sum(chunk_batches))
        if per_epoch == 0:
            raise ValueError("the stream has no batches")
        epoch, rest = divmod(int(batches), per_epoch)
        order = chunk_order(len(chunk_batches), seed, epoch, shuffle)
        for position, chunk in enumerate(order):
            if rest < chunk_batches[chunk]:
                return cls(epoch, position, rest)
            rest -= int(chunk_batches[chunk])
        raise AssertionError("unreachable: rest < per_epoch")


def chunk_order(num_chunks: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of the chunks in ``epoch``: int64 ``[num_chunks]``, the order
    ``pipelines.batching._chunk_order`` draws in the input pipeline's graph."""
    if not shuffle:
        return np.arange(num_chunks, dtype=np.int64)
    return stateless_shuffle(num_chunks, (seed, epoch))


def pair_and_batch_order(keys: np.ndarray, batches: int, *, seed: int, chunk: int, epoch: int,
                         shuffle: bool) -> tuple[np.ndarray, np.ndarray]:
    """The order of a chunk's pairs and of its batches in ``epoch``, as the input pipeline
    draws them (``order_chunk`` in :func:`pipelines.batching.chunk_stream`).

    Args:
      keys: per pair, its bucket: the index of the smallest boundary >= its length in
        positions (``len(boundaries)`` for a pair beyond the last).
      batches: how many batches the chunk's plan has (:func:`plan_batches`).
      seed, epoch: of the stream; chunk: the chunk's index among the stream's chunks.
      shuffle: shuffle the pairs (then stably sort them by bucket) and the batches;
        otherwise pairs sorted by bucket, batches in order.

    Returns:
      int64 pair indices sorted by bucket (batch ``i`` holds those from its plan's end
      ``i - 1`` to end ``i``), and int64 ``[batches]``, the order the batches are yielded in.
    """
    keys = np.asarray(keys)
    if not shuffle:
        return np.argsort(keys, kind="stable"), np.arange(batches, dtype=np.int64)
    first = seed + CHUNK_SEED_STRIDE * (chunk + 1)
    shuffled = stateless_shuffle(len(keys), (first, epoch))
    order = shuffled[np.argsort(keys[shuffled], kind="stable")]
    return order, stateless_shuffle(batches, (first, epoch + CHUNK_SEED_STRIDE))
