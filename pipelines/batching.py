"""Token-budget batches of sentence pairs of similar length (paper, section 5.1).

The pairs are processed in *chunks* (a shard of a prepared corpus, or a whole in-memory
corpus): each epoch visits the chunks in a seeded random order; within a chunk the pairs
are shuffled, stably sorted by length bucket, cut into batches by a greedy token budget
(:func:`plan_batches`), and the chunk's batches are shuffled. Everything per pair is one
vectorised op per chunk; per batch, a few dense gathers and selects. Because a chunk's batch
boundaries depend only on its length histogram, the number of batches of every chunk is
known in advance, so a stream can start at any batch without replaying the ones before
(:class:`StreamPosition`). The plan and the orders are numpy (:mod:`pipelines.batch_plan`,
re-exported here), so :mod:`pipelines.numpy_batches` yields the same batches without TensorFlow.

Batch format (what the model consumes)::

    ({"source": int32 [B, S], "target": int32 [B, T]}, labels int32 [B, T])

    source = pieces(src) + [EOS]
    target = [BOS] + pieces(tgt)      (decoder input, for teacher forcing)
    labels = pieces(tgt) + [EOS]      (target shifted left by one)

with ``PAD_ID = 0`` padding everywhere.

Bucketing: a pair's length is ``max(S, T)`` positions and its bucket the smallest boundary
``b`` >= that length; a batch whose longest pair is in bucket ``b`` holds at most
``tokens_per_batch // b`` pairs, so **B * max(S, T) <= tokens_per_batch** always holds
(S and T count padding). Each side is padded to the smallest boundary that fits its own
longest sequence in the batch, so shapes come from the small boundary grid. The default
grid (step 1 up to 24, step 2 up to 48, then x1.1) gives about 94% real tokens on Multi30k
de-en with 4096 tokens per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from pipelines.batch_plan import (  # numpy alone; re-exported: the plan is part of this API
    CHUNK_SEED_STRIDE,
    StreamPosition,
    check_budget,
    default_bucket_boundaries,
    plan_batches,
    position_histogram,
    static_shapes,
    xla_bucket_boundaries,
)
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID
from pipelines.corpora import ParallelCorpus, log_dropped
from pipelines.tokenizer import SubwordTokenizer

__all__ = [
    "StreamPosition",
    "check_budget",
    "chunk_stream",
    "default_bucket_boundaries",
    "xla_bucket_boundaries",
    "static_shapes",
    "make_batches",
    "padding_efficiency",
    "plan_batches",
    "position_histogram",
    "tokenize_pairs",
]

_LOG = logging.getLogger("pipelines")
_TOKENIZE_CHUNK = 8192  # sentences tokenized per op call: amortises per-call overhead
# One fixed algorithm: "auto_select" may differ by device, and pipelines.philox reproduces
# Philox's draws in numpy (StreamPosition.after, pipelines.numpy_batches).
_RNG = "philox"
# tf.data traces the functions given to `map` and `flat_map` through AutoGraph unless told not
# to; these are plain TensorFlow (as the searches and signatures, traced with autograph=False).
# Functions traced inside them are traced as written too.
_as_written = tf.autograph.experimental.do_not_convert


def chunk_stream(
    num_chunks: int,
    load_chunk: Callable[[tf.Tensor], tuple[tf.RaggedTensor, tf.RaggedTensor]],
    chunk_ends: Sequence[np.ndarray],
    boundaries: Sequence[int],
    *,
    seed: int,
    shuffle: bool,
    repeat: bool,
    start: StreamPosition = StreamPosition(),  # noqa: B008 (immutable)
    epoch_seeds: tf.data.Dataset | None = None,
    static_budget: int | None = None,
) -> tf.data.Dataset:
    """Batches of a sequence of chunks (see the module docstring).

    Args:
      num_chunks: how many chunks there are.
      load_chunk: maps a chunk index (int64 scalar tensor) to its ``(source pieces,
        target pieces)``, int32 RaggedTensors ``[n, (pieces)]``, without EOS/BOS.
      chunk_ends: per chunk, :func:`plan_batches` of its histogram.
      boundaries: the bucket boundaries used for ``chunk_ends``.
      seed: seeds every shuffle (chunk order, pairs, batch order), per epoch.
      shuffle: shuffle; otherwise chunks in order, pairs sorted by bucket, batches in order.
      repeat: endless epochs; otherwise one.
      start: the first batch (for resuming: :meth:`StreamPosition.after`).
      epoch_seeds: optional int64 scalars to use as epoch numbers for shuffling instead
        of ``start.epoch, start.epoch + 1, ...`` (with ``tf.data.Dataset.random`` each
        pass over a finite dataset is reshuffled).
      static_budget: the per-replica token budget, for static shapes (XLA): every batch
        is padded to ``static_budget // b`` rows (all-PAD rows added) of ``b`` positions on
        both sides, ``b`` the bucket of its longest pair; see :func:`static_shapes`.

    Returns:
      ``({"source", "target"}, labels)`` batches as in the module docstring.
    """
    boundary_table = tf.constant(boundaries, dtype=tf.int64)
    ends_table = tf.RaggedTensor.from_row_lengths(
        np.concatenate([np.asarray(e, np.int64) for e in chunk_ends] or [np.zeros(0, np.int64)]),
        np.asarray([len(e) for e in chunk_ends], np.int64))
    if epoch_seeds is None:
        epoch_seeds = tf.data.Dataset.counter(start.epoch) if repeat else (
            tf.data.Dataset.from_tensors(tf.constant(start.epoch, tf.int64)))
    elif not repeat:
        epoch_seeds = epoch_seeds.take(1)
    if not repeat and start.epoch > 0:  # started past the end of the only epoch
        epoch_seeds = epoch_seeds.take(0)

    # The functions below are traced as written (no AutoGraph: no tensor decides any Python
    # `if`): converting them cost ~0.8 s of every process's first pipeline (BENCHMARKS.md).
    @_as_written
    def chunks_of_epoch(epoch):
        order = _chunk_order(num_chunks, seed, epoch, shuffle)
        return tf.data.Dataset.from_tensor_slices(order).map(lambda chunk: (epoch, chunk))

    items = epoch_seeds.flat_map(chunks_of_epoch).skip(start.chunk).enumerate()

    @_as_written
    def order_chunk(index, item):
        epoch, chunk = item
        source, target = load_chunk(chunk)
        positions = tf.maximum(source.row_lengths(), target.row_lengths()) + 1
        # Too-long pairs get key len(boundaries): they sort last, past every batch's end.
        keys = tf.searchsorted(boundary_table, positions, side="left")
        pairs = tf.shape(keys, out_type=tf.int64)[0]
        ends = ends_table[chunk]
        batches = tf.shape(ends, out_type=tf.int64)[0]
        if shuffle:
            chunk_seed = tf.stack([seed + CHUNK_SEED_STRIDE * (chunk + 1), epoch])
            shuffled = tf.random.experimental.stateless_shuffle(tf.range(pairs), chunk_seed,
                                                                alg=_RNG)
            order = tf.gather(shuffled, tf.argsort(tf.gather(keys, shuffled), stable=True))
            batch_order = tf.random.experimental.stateless_shuffle(
                tf.range(batches), chunk_seed + [0, CHUNK_SEED_STRIDE], alg=_RNG)
        else:
            order = tf.argsort(keys, stable=True)
            batch_order = tf.range(batches)
        skip = tf.where(index == 0, tf.constant(start.batch, tf.int64), 0)
        return (source.values, source.row_splits, target.values, target.row_splits,
                tf.cast(order, tf.int64), ends, batch_order[skip:])

    @_as_written
    def batches_of_chunk(*chunk):
        *tensors, ends, batch_order = chunk
        starts = tf.concat([[0], ends[:-1]], axis=0)
        ranges = tf.data.Dataset.from_tensor_slices(
            (tf.gather(starts, batch_order), tf.gather(ends, batch_order)))
        return tf.data.Dataset.zip(tf.data.Dataset.from_tensors(tuple(tensors)).repeat(), ranges)

    @_as_written
    def assemble(tensors, batch_range):
        source_values, source_splits, target_values, target_splits, order = tensors
        rows = order[batch_range[0]:batch_range[1]]
        # The batch's rows gathered, then dense ops: the ragged concat and pad they replace
        # built ~10x the graph, traced again at every pipeline's start (BENCHMARKS.md).
        source_ids, source_starts, source_lengths = _rows_of(source_values, source_splits, rows)
        target_ids, target_starts, target_lengths = _rows_of(target_values, target_splits, rows)
        # One marker (EOS or BOS) per sequence: S = longest source + 1, T = longest target + 1.
        source_longest = tf.reduce_max(source_lengths) + 1
        target_longest = tf.reduce_max(target_lengths) + 1
        if static_budget is not None:
            width = _boundary_for(tf.maximum(source_longest, target_longest), boundary_table)
            source_width = target_width = width
        else:
            source_width = _boundary_for(source_longest, boundary_table)
            target_width = _boundary_for(target_longest, boundary_table)
        source_in = _with_marker(source_ids, source_starts, source_lengths, source_width,
                                 EOS_ID, first=False)
        target_in = _with_marker(target_ids, target_starts, target_lengths, target_width,
                                 BOS_ID, first=True)
        labels = _with_marker(target_ids, target_starts, target_lengths, target_width,
                              EOS_ID, first=False)
        if static_budget is not None:  # all-PAD rows up to budget // width
            missing = static_budget // width - tf.shape(rows, out_type=tf.int64)[0]
            source_in, target_in, labels = (
                tf.pad(ids, [[0, missing], [0, 0]], constant_values=PAD_ID)
                for ids in (source_in, target_in, labels))
        return {"source": source_in, "target": target_in}, labels

    dataset = items.map(order_chunk, num_parallel_calls=2, deterministic=True)
    dataset = dataset.flat_map(batches_of_chunk)
    dataset = dataset.map(assemble, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if repeat:
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(
            tf.data.INFINITE_CARDINALITY))
    options = tf.data.Options()
    options.deterministic = True
    # No autotuning thread: freeing an iterator waits for its thread, which sleeps up to 60 s
    # between tuning rounds, and an iterator that Keras or a test leaves in a reference cycle
    # is freed by Python's garbage collector, holding the GIL, at whatever line runs then
    # (measured in the test suite: 20-60 s stalls with no CPU used, in ~RootDataset::Iterator).
    # Without autotuning, AUTOTUNE maps run min(16, cores) calls at once and prefetching still
    # grows its buffer when the consumer waits (tf.data's legacy prefetch autotuner).
    options.autotune.enabled = False
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def tokenize_pairs(tokenizer: SubwordTokenizer, sources: Sequence[str],
                   targets: Sequence[str]) -> tuple[tf.RaggedTensor, tf.RaggedTensor]:
    """Subword ids of both sides, eagerly, in large chunks: two int32 ``[n, (pieces)]``."""
    def pieces(texts: Sequence[str]) -> tf.RaggedTensor:
        parts = [tokenizer.tokenize(tf.constant(list(texts[i:i + _TOKENIZE_CHUNK]), tf.string))
                 for i in range(0, len(texts), _TOKENIZE_CHUNK)]
        if not parts:
            return tf.RaggedTensor.from_row_lengths(tf.zeros([0], tf.int32),
                                                    tf.zeros([0], tf.int64))
        return tf.concat(parts, axis=0)

    return pieces(sources), pieces(targets)


def make_batches(
    corpus: ParallelCorpus,
    tokenizer: SubwordTokenizer,
    *,
    tokens_per_batch: int = 4096,
    max_length: int = 128,
    shuffle: bool = True,
    seed: int = 0,
    repeat: bool = False,
    input_context: tf.distribute.InputContext | None = None,
    bucket_boundaries: Sequence[int] | None = None,
    static_shapes: bool = False,
) -> tf.data.Dataset:
    """Batches of an in-memory ``corpus`` (validation, tests, notebooks).

    The corpus is tokenized once, here; the pipeline then only shuffles, batches and pads.
    For a large training corpus, prepare it once instead (:mod:`pipelines.prepared`).

    Args:
      corpus: the sentence pairs.
      tokenizer: the shared subword tokenizer.
      tokens_per_batch: global token budget of one batch: ``B * max(S, T)`` (padded
        lengths, i.e. the larger of the two tensor widths) never exceeds it. Under
        ``input_context`` each replica gets ``tokens_per_batch // num_replicas_in_sync``.
      max_length: the longest sequence kept, in tensor positions (subword pieces + 1 for
        EOS/BOS): pairs with more than ``max_length - 1`` pieces on either side are
        dropped (and counted in a log line). ``S`` and ``T`` never exceed it.
      shuffle: shuffle pairs and batches; otherwise one epoch yields batches in a fixed
        order (by length).
      seed: makes shuffling reproducible: a fresh pipeline with the same seed yields the
        same batches in the same order; each further pass over the same dataset (epoch)
        reshuffles into a different, equally reproducible order.
      repeat: repeat forever (epochs reshuffled), for step-based training.
      input_context: from ``strategy.distribute_datasets_from_function``; the pairs are
        sharded by ``input_pipeline_id`` out of ``num_input_pipelines``.
      bucket_boundaries: increasing bucket upper bounds (positions) at most
        ``max_length``; ``max_length`` is appended if missing. Default:
        :func:`default_bucket_boundaries`.
      static_shapes: pad every batch to ``budget // b`` rows of ``b`` positions on both
        sides (``b`` its bucket): one shape per bucket, for XLA (see ``chunk_stream``).

    Returns:
      A ``tf.data.Dataset`` of ``({"source": int32 [B, S], "target": int32 [B, T]},
      labels int32 [B, T])``, deterministic for a given seed. Without ``repeat`` its
      cardinality is unknown (token-budget batches are counted only by making them): as
      Keras validation data, count it once and ``assert_cardinality``, or Keras warns at each
      validation that the input ran out of data.

    Raises:
      ValueError: invalid arguments, or no pair short enough to keep.
    """
    num_replicas = input_context.num_replicas_in_sync if input_context is not None else 1
    budget, boundaries = check_budget(tokens_per_batch, max_length, num_replicas,
                                      bucket_boundaries)
    sources, targets = corpus.sources, corpus.targets
    if input_context is not None and input_context.num_input_pipelines > 1:
        step, first = input_context.num_input_pipelines, input_context.input_pipeline_id
        sources, targets = sources[first::step], targets[first::step]
    source, target = tokenize_pairs(tokenizer, sources, targets)
    source_pieces, target_pieces = source.row_lengths().numpy(), target.row_lengths().numpy()
    keep = np.maximum(source_pieces, target_pieces) + 1 <= max_length
    log_dropped(f"{corpus.origin} [{corpus.split}] {corpus.src_lang}-{corpus.tgt_lang}",
                int(keep.sum()), len(keep), max_length, "positions (subword pieces + EOS)")
    if not keep.any():
        raise ValueError(
            f"no pair of {corpus.origin} [{corpus.split}] fits max_length={max_length}; raise it"
        )
    if not keep.all():
        source, target = tf.ragged.boolean_mask(source, keep), tf.ragged.boolean_mask(target, keep)
    ends = plan_batches(position_histogram(source_pieces, target_pieces, max_length),
                        boundaries, budget)
    chunk = (source, target)
    epoch_seeds = (tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
                   if shuffle else None)
    return chunk_stream(1, lambda index: chunk, [ends], boundaries, seed=seed, shuffle=shuffle,
                        repeat=repeat, epoch_seeds=epoch_seeds,
                        static_budget=budget if static_shapes else None)


def padding_efficiency(dataset: tf.data.Dataset, max_batches: int | None = None) -> float:
    """Share of real (non-PAD) tokens among all token slots of source and target.

    Args:
      dataset: batches in the :func:`make_batches` format.
      max_batches: look at the first batches only; required for an infinite dataset.

    Returns:
      ``non_pad(source) + non_pad(target)`` over ``size(source) + size(target)``.
    """
    if max_batches is None:
        if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ValueError("dataset is infinite (repeat=True): pass max_batches")
    else:
        if max_batches < 1:
            raise ValueError(f"max_batches must be positive, got {max_batches}")
        dataset = dataset.take(max_batches)
    real = slots = 0
    for features, _ in dataset:
        for name in ("source", "target"):
            ids = features[name].numpy()
            real += int(np.count_nonzero(ids != PAD_ID))
            slots += ids.size
    if slots == 0:
        raise ValueError("dataset yielded no tokens")
    return real / slots


def _chunk_order(num_chunks: int, seed: int, epoch, shuffle: bool) -> tf.Tensor:
    """The order of the chunks in ``epoch``: int64 ``[num_chunks]`` (same eagerly and in graphs)."""
    chunks = tf.range(num_chunks, dtype=tf.int64)
    if not shuffle:
        return chunks
    epoch = tf.cast(epoch, tf.int64)
    return tf.random.experimental.stateless_shuffle(
        chunks, tf.stack([tf.constant(seed, tf.int64), epoch]), alg=_RNG)


def _rows_of(values: tf.Tensor, splits: tf.Tensor, rows: tf.Tensor
             ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The ids of ``rows`` of a ragged tensor (its ``values`` and ``splits``), one row after
    another, with where each row starts among them and its length (int64 ``[B]``): the
    batch's ids only, so that the dense ops after it never copy the whole chunk's."""
    batch = tf.gather(tf.RaggedTensor.from_row_splits(values, splits, validate=False), rows)
    return batch.values, batch.row_starts(), batch.row_lengths()


def _boundary_for(positions: tf.Tensor, boundary_table: tf.Tensor) -> tf.Tensor:
    """The smallest boundary >= ``positions`` (an int64 scalar)."""
    return boundary_table[tf.searchsorted(boundary_table, tf.reshape(positions, [1]))[0]]


def _with_marker(values: tf.Tensor, starts: tf.Tensor, lengths: tf.Tensor, width: tf.Tensor,
                 marker: int, *, first: bool) -> tf.Tensor:
    """Dense ``[B, width]`` of the values' dtype: each row's ids (``values[start:start +
    length]``) with ``marker`` before them (``first``) or after them, then PAD."""
    positions = tf.range(width, dtype=tf.int64)[tf.newaxis, :]
    lengths = lengths[:, tf.newaxis]
    offsets = positions - 1 if first else positions  # the row's id at each position
    inside = (offsets >= 0) & (offsets < lengths)
    # Index len(values) is the PAD appended here: positions past a row read it.
    index = tf.where(inside, starts[:, tf.newaxis] + offsets, tf.size(values, out_type=tf.int64))
    ids = tf.gather(tf.concat([values, tf.constant([PAD_ID], values.dtype)], 0), index)
    at_marker = positions == (0 if first else lengths)
    return tf.where(at_marker, tf.constant(marker, values.dtype), ids)
