"""The shard files of a prepared corpus (:mod:`pipelines.prepared`): written with their
checksums, checked as they are read.

A shard is two files: ``.ids``, the token ids of its pairs one after the other (source
pieces, then target pieces), and ``.lengths``, int32 ``[pairs, 2]`` pieces of each source
and target; little-endian whatever the machine. The tokenizing pass (:func:`write_shards`)
computes each file's CRC-32 from the bytes as they are appended, so that a disk storing
other bytes is caught later (:meth:`pipelines.prepared.PreparedCorpus.verify`);
:func:`read_shard` checks, in the graph, that the ids are within the vocabulary and that
the lengths add up to them, and :func:`failed_check` reads such a failure back from the op
error.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm
import tensorflow as tf

from pipelines import storage
from pipelines.batch_plan import position_histogram
from pipelines.batching import tokenize_pairs
from pipelines.corpora import CorpusSplit, ParallelCorpus, batched_pairs, corpus_fingerprint
from pipelines.prepared_folder import (  # numpy alone; re-exported
    VALIDATION,
    failed_check_message,
    file_dtype,
    id_dtype,
)
from pipelines.tokenizer import SubwordTokenizer

__all__ = ["failed_check", "file_dtype", "id_dtype", "read_shard", "write_shards",
           "write_validation"]

_ENCODE_BATCH = 4096  # pairs per tokenizer call while preparing
_BUFFER_BYTES = 64 << 20  # write buffers of all shards together: flat as shards multiply
# Leads the data of the input pipeline's assertions, which `failed_check` recognizes in the
# op error's message: "[marker] [ids|lengths] [file] [n] [n] [n]" from a graph (tf.data),
# "b'marker'\nb'ids'\nb'file'\nn\nn\nn" (bytes literals) from an eager call.
_FAILED = "prepared shard failed its check:"
_FAILED_DATA = re.compile(re.escape(f"[{_FAILED}]") + r" \[(ids|lengths)\] \[(.+?)\] "
                          r"\[(-?\d+)\] \[(-?\d+)\] \[(-?\d+)\]")
_FAILED_EAGER = re.compile(re.escape(repr(_FAILED.encode())) + r"\nb'(ids|lengths)'\n(b'.*?'|"
                           r'b".*?")\n(-?\d+)\n(-?\d+)\n(-?\d+)')


def read_shard(ids_file: tf.Tensor, lengths_file: tf.Tensor, ids_dtype: tf.DType,
               vocab_size: int) -> tf.RaggedTensor:
    """A shard's token ids, one row per sentence (source, target, source, ...), in the graph.

    Before the ids are used they are checked: within ``[0, vocab_size)``, and the lengths
    not negative and adding up to the ids read. Damage the checksums could not see (files
    changed after they were verified, or a manifest without checksums) thus fails here,
    with an op error that :func:`failed_check` recognizes, instead of an id past the
    embedding table (an opaque error on CPUs, silent zeros on GPUs) or ``from_row_lengths``'
    opaque message. The lengths' check replaces ``from_row_lengths``' own validation, so a
    shard reads as fast as without any (BENCHMARKS.md).
    """
    lengths = tf.io.decode_raw(tf.io.read_file(lengths_file), tf.int32)
    raw = tf.io.decode_raw(tf.io.read_file(ids_file), ids_dtype)
    ids = tf.cast(raw, tf.int32)
    if ids_dtype.is_unsigned:  # uint16: none below 0; the narrow maximum is 3x faster
        lowest, highest = tf.constant(0), tf.cast(tf.reduce_max(raw), tf.int32)
    else:
        lowest, highest = tf.reduce_min(ids), tf.reduce_max(ids)  # of no ids: +max, -max
    count = tf.size(ids, out_type=tf.int64)
    pieces, shortest = tf.reduce_sum(tf.cast(lengths, tf.int64)), tf.reduce_min(lengths)
    checks = [
        tf.debugging.Assert((count == 0) | ((lowest >= 0) & (highest < vocab_size)),
                            [_FAILED, "ids", ids_file, tf.where(lowest < 0, lowest, highest),
                             count, vocab_size]),
        tf.debugging.Assert((pieces == count) & (shortest >= 0),
                            [_FAILED, "lengths", lengths_file, pieces, shortest, count]),
    ]
    with tf.control_dependencies(checks):  # nothing reads the ids before the checks pass
        ids, lengths = tf.identity(ids), tf.identity(lengths)
    return tf.RaggedTensor.from_row_lengths(ids, tf.cast(lengths, tf.int64), validate=False)


def failed_check(error: BaseException) -> str | None:
    """What a failed check of :func:`read_shard` found, as ``"<file>: <what>"``, if ``error``
    (e.g. the op error of an iterator, however wrapped) reports one; otherwise None."""
    text = str(error)
    if found := _FAILED_DATA.search(text):
        kind, file, *numbers = found.groups()
    elif found := _FAILED_EAGER.search(text):
        kind, file, *numbers = found.groups()
        with contextlib.suppress(ValueError, SyntaxError):  # else shown as the literal
            file = ast.literal_eval(file).decode("utf-8", "replace")
    else:
        return None
    first, second, third = (int(number) for number in numbers)
    return failed_check_message(kind, file, first, second, third)


def write_shards(split: CorpusSplit, tokenizer: SubwordTokenizer, folder: Path,
                 num_shards: int, max_length: int, seed: int,
                 expected_pairs: int, *, sampled_copies: int = 0,
                 sampling_alpha: float = 0.1) -> tuple[list[dict[str, Any]], int]:
    """The tokenizing pass: every kept pair appended to a seeded-random shard in ``folder``.

    Each file's CRC-32 is computed from the bytes as they are appended (not read back), so
    that a disk storing other bytes is caught by ``PreparedCorpus.verify``.

    With ``sampled_copies`` K > 0 (subword regularization), the split is tokenized K times,
    each time with a sampled segmentation (:func:`_sampled_batches`), copy ``c`` going to
    shards ``c * num_shards`` to ``(c + 1) * num_shards - 1``: K x ``num_shards`` shards.

    Returns:
      The shards' manifest entries (files, sizes, checksums, pairs, pieces, length
      histogram) and the number of pairs read (kept or not) per copy.

    Raises:
      StorageError: a write failed because of the storage; its ``needed`` is the size of
        all shards, extrapolated from ``expected_pairs`` and the bytes made so far.
    """
    ids_dtype = file_dtype(id_dtype(tokenizer.vocab_size))
    copies = max(sampled_copies, 1)
    shards_per_copy, num_shards = num_shards, num_shards * copies
    expected_pairs *= copies
    width = len(str(num_shards - 1))
    names = [f"shard-{i:0{max(width, 5)}d}-of-{num_shards:0{max(width, 5)}d}"
             for i in range(num_shards)]
    buffers: list[dict[str, list[bytes]]] = [{"ids": [], "lengths": []} for _ in names]
    buffered = np.zeros(num_shards, np.int64)
    flush_bytes = max(1 << 16, _BUFFER_BYTES // num_shards)
    histograms = np.zeros((num_shards, max_length + 1), np.int64)
    pairs = np.zeros(num_shards, np.int64)
    tokens = np.zeros((num_shards, 2), np.int64)
    checksums = [{"ids": 0, "lengths": 0} for _ in names]
    made = 0  # bytes of all shards so far, written or buffered

    def flush(shard: int) -> None:
        for kind in ("ids", "lengths"):
            path = folder / f"{names[shard]}.{kind}"
            with storage.errors_about(path, round(made * expected_pairs / max(seen, 1))), \
                    open(path, "ab") as handle:
                handle.writelines(buffers[shard][kind])
            buffers[shard][kind] = []
        buffered[shard] = 0

    seen = 0
    batches = (_tokenized_batches(split, tokenizer) if not sampled_copies else
               itertools.chain.from_iterable(
                   _sampled_batches(split, tokenizer.model_proto, sampling_alpha, [seed, copy])
                   for copy in range(copies)))
    for index, (copy, values, splits, source_lengths, target_lengths) in enumerate(batches):
        seen += len(source_lengths)
        positions = np.maximum(source_lengths, target_lengths) + 1
        keep = np.flatnonzero(positions <= max_length)
        shard_of = copy * shards_per_copy + np.random.default_rng([seed, index]).integers(
            shards_per_copy, size=len(keep))
        order = np.argsort(shard_of, kind="stable")
        rows, shard_of = keep[order], shard_of[order]
        # The kept pairs' ids, grouped by shard: one vectorised gather of ragged rows.
        starts, sizes = splits[rows], splits[rows + 1] - splits[rows]
        ids = values[np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
                     + np.arange(sizes.sum())].astype(ids_dtype)
        id_ends = np.cumsum(sizes)
        lengths = np.stack([source_lengths[rows], target_lengths[rows]], axis=1).astype(
            file_dtype("int32"))
        bounds = np.searchsorted(shard_of, np.arange(num_shards + 1))
        for shard in np.flatnonzero(np.diff(bounds)):
            first, last = bounds[shard], bounds[shard + 1]
            id_first = id_ends[first - 1] if first else 0
            for kind, data in (("ids", ids[id_first:id_ends[last - 1]].tobytes()),
                               ("lengths", lengths[first:last].tobytes())):
                buffers[shard][kind].append(data)
                checksums[shard][kind] = storage.checksum(data, checksums[shard][kind])
                made += len(data)
            buffered[shard] += len(buffers[shard]["ids"][-1])
            histograms[shard] += position_histogram(lengths[first:last, 0],
                                                    lengths[first:last, 1], max_length)
            pairs[shard] += last - first
            tokens[shard] += lengths[first:last].sum(axis=0)
            if buffered[shard] >= flush_bytes:
                flush(shard)
    shards = []
    for shard, name in enumerate(names):
        flush(shard)
        files = {kind: folder / f"{name}.{kind}" for kind in ("ids", "lengths")}
        for file in files.values():
            file.touch()  # an empty shard still has its (empty) files
        shards.append({
            "ids": files["ids"].name, "lengths": files["lengths"].name,
            "ids_bytes": files["ids"].stat().st_size,
            "lengths_bytes": files["lengths"].stat().st_size,
            "ids_crc32": f"{checksums[shard]['ids']:08x}",
            "lengths_crc32": f"{checksums[shard]['lengths']:08x}",
            "pairs": int(pairs[shard]), "source_pieces": int(tokens[shard, 0]),
            "target_pieces": int(tokens[shard, 1]), "histogram": histograms[shard].tolist(),
        })
    return shards, seen // copies


def write_validation(corpus: ParallelCorpus, tokenizer: SubwordTokenizer, folder: Path,
                     requested_split: str | None = None) -> dict[str, Any]:
    """The validation split's token ids, as one shard ``folder/validation.{ids,lengths}``:
    every pair, in corpus order, whatever its length, tokenized as
    :func:`pipelines.batching.make_batches` tokenizes it (:func:`tokenize_pairs`), so that
    :func:`pipelines.numpy_batches.validation_batches` can batch it as ``make_batches`` does,
    for any max_length. Written like the shards (``folder`` is fsynced and renamed into
    place as a whole), its CRC-32s computed from the bytes written. ``requested_split`` is
    the name the split was asked for by (e.g. ``"val"`` for a resolved ``"validation"``),
    recorded beside the resolved one (default: the same).

    Returns:
      The manifest's ``"validation"`` entry (:attr:`PreparedFolder.validation`).

    Raises:
      StorageError: a write failed because of the storage; ``needed``: both files' size.
    """
    source, target = tokenize_pairs(tokenizer, corpus.sources, corpus.targets)
    pairs = tf.concat([source, target], axis=1)
    lengths = np.stack([source.row_lengths().numpy(), target.row_lengths().numpy()], axis=1)
    data = {"ids": pairs.values.numpy().astype(file_dtype(id_dtype(tokenizer.vocab_size)))
            .tobytes(),
            "lengths": lengths.astype(file_dtype("int32")).tobytes()}
    entry: dict[str, Any] = {
        "split": corpus.split, "requested_split": requested_split or corpus.split,
        "origin": corpus.origin, "src_lang": corpus.src_lang,
        "tgt_lang": corpus.tgt_lang, "corpus_fingerprint": corpus_fingerprint(corpus),
        "pairs": len(corpus), "source_pieces": int(lengths[:, 0].sum()),
        "target_pieces": int(lengths[:, 1].sum())}
    needed = sum(len(content) for content in data.values())
    for kind, content in data.items():
        path = folder / f"{VALIDATION}.{kind}"
        with storage.errors_about(path, needed), open(path, "wb") as handle:
            handle.write(content)
        entry.update({kind: path.name, f"{kind}_bytes": len(content),
                      f"{kind}_crc32": f"{storage.checksum(content):08x}"})
    return entry


def _tokenized_batches(split: CorpusSplit, tokenizer: SubwordTokenizer) -> Iterator[tuple]:
    """Numpy batches ``(0, ids, row splits, source lengths, target lengths)`` (0: the copy):
    row ``i`` of ``ids`` is pair ``i``'s source pieces followed by its target pieces."""
    dataset = tf.data.Dataset.from_generator(
        lambda: batched_pairs(split.pairs(), _ENCODE_BATCH),
        output_signature=(tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.string)))

    @tf.autograph.experimental.do_not_convert  # plain TensorFlow: no AutoGraph conversion
    def encode(sources, targets):
        source, target = tokenizer.tokenize(sources), tokenizer.tokenize(targets)
        pairs = tf.concat([source, target], axis=1)
        return 0, pairs.values, pairs.row_splits, source.row_lengths(), target.row_lengths()

    dataset = dataset.map(encode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    yield from dataset.prefetch(4).as_numpy_iterator()


def _sampled_batches(split: CorpusSplit, model_proto: bytes, alpha: float,
                     seed: list[int]) -> Iterator[tuple]:
    """As :func:`_tokenized_batches`, for copy ``seed[1]``, each sentence segmented by
    sampling: BPE-dropout with probability ``alpha`` for a BPE model (Provilkov et al.
    2020), unigram sampling with smoothing ``alpha`` over all segmentations otherwise
    (Kudo 2018).

    Sampled here, in one thread of SentencePiece's own Python binding whose generator is
    seeded, rather than in the input pipeline's graph (tensorflow-text's op takes no
    seed): the copies, and so a run, are the same on every machine and every resume, and
    the batches are planned from the copies' lengths like any prepared shard's. Sampling
    runs at ~100k sentences/s a copy on one core (BENCHMARKS.md).
    """
    processor = spm.SentencePieceProcessor(model_proto=model_proto)
    # SentencePiece's generator is process-wide: seeded per copy, used by one thread only.
    spm.set_random_generator_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))

    def encode(texts: list[str]) -> list[list[int]]:
        return processor.encode(texts, enable_sampling=True, alpha=alpha, nbest_size=-1,
                                num_threads=1)

    for sources, targets in batched_pairs(split.pairs(), _ENCODE_BATCH):
        source, target = encode(sources), encode(targets)
        source_lengths = np.fromiter(map(len, source), np.int64, len(source))
        target_lengths = np.fromiter(map(len, target), np.int64, len(target))
        values = np.fromiter(itertools.chain.from_iterable(
            itertools.chain(s, t) for s, t in zip(source, target, strict=True)), np.int32)
        splits = np.concatenate([[0], np.cumsum(source_lengths + target_lengths)])
        yield seed[1], values, splits, source_lengths, target_lengths
