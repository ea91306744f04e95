"""The training input pipeline alone, no model (issues 13, 27): prepared shards -> bucketed batches.

Reports, for each token budget, the median over --repeats runs of target tokens/s (real,
non-PAD label tokens) and the padding efficiency (real share of source and target slots),
with the pipeline's checks of each shard read (ids within the vocabulary, lengths adding up:
`pipelines.shard_files.read_shard`), and that rate over a training step's consumption
(--train-tokens-per-sec: the `base` preset's step on the development machine); the seconds
to the first batch of a stream resumed after 10 and after 10,000 steps' worth of batches (no
replay: both read one shard); the seconds and GB/s of `PreparedCorpus.verify()` (every shard
file's CRC-32, what a run does once before training) with the files in the page cache and,
evicted first (posix_fadvise, these files only), read from the disk; and, for the choice of
the on-disk format, pairs/s reading the same token ids back from our shard files (with and
without the checks), from `tf.data.Dataset.save`/`load` (one element per pair) and from
TFRecord files of `tf.train.Example`s (two int64 lists per pair, parsed in batches of 4,096).
`--ab-checks` also runs each budget's throughput without the checks, alternating; the
reading of every shard is timed both ways in any case (`--format-shards 0`: no format
comparison).

    python benchmarks/synthetic_corpus.py --pairs 1000000 --out /tmp/corpus-1M
    python -m keras_transformer.prepare --data /tmp/corpus-1M --src de --tgt en \
        --vocab-size 8000 --out /tmp/prepared-1M
    python benchmarks/input_pipeline.py --prepared /tmp/prepared-1M --ab-checks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tensorflow as tf  # noqa: E402

from pipelines import shard_files  # noqa: E402
from pipelines.constants import PAD_ID  # noqa: E402
from pipelines.prepared import PreparedCorpus  # noqa: E402

# `python benchmarks/train_throughput.py --preset base --steps 5 --warmup 2` (bf16, length 32),
# BENCHMARKS.md's training throughput table: what one training step consumes.
BASE_TRAIN_TOKENS_PER_SEC = 974


def _unchecked_read_shard(ids_file, lengths_file, ids_dtype, vocab_size):
    """The A/B's other side: a shard read as before its checks (issue 27), where only
    `from_row_lengths` validated the lengths, with its own opaque message."""
    del vocab_size
    lengths = tf.io.decode_raw(tf.io.read_file(lengths_file), tf.int32)
    ids = tf.cast(tf.io.decode_raw(tf.io.read_file(ids_file), ids_dtype), tf.int32)
    return tf.RaggedTensor.from_row_lengths(ids, tf.cast(lengths, tf.int64))


@contextlib.contextmanager
def checks(on: bool):
    """Pipelines built inside read their shards with (on) or without the checks."""
    checked = shard_files.read_shard
    if not on:
        shard_files.read_shard = _unchecked_read_shard
    try:
        yield
    finally:
        shard_files.read_shard = checked


def throughput(prepared: PreparedCorpus, tokens_per_batch: int, batches: int,
               seed: int) -> dict:
    dataset = prepared.batches(tokens_per_batch=tokens_per_batch, seed=seed)
    # Counting happens inside the pipeline so that the Python loop costs one call per batch.
    counted = dataset.map(lambda f, labels: tf.stack([
        tf.math.count_nonzero(labels != PAD_ID, dtype=tf.int64),
        tf.math.count_nonzero(f["source"] != PAD_ID, dtype=tf.int64)
        + tf.math.count_nonzero(f["target"] != PAD_ID, dtype=tf.int64),
        tf.size(f["source"], out_type=tf.int64) + tf.size(f["target"], out_type=tf.int64)]))
    iterator = iter(counted)
    next(iterator)  # the first shard's read and sort is start-up, measured separately
    started = time.perf_counter()
    total = tf.zeros([3], tf.int64)
    for _ in range(batches):
        total += next(iterator)
    seconds = time.perf_counter() - started
    target, real, slots = total.numpy().tolist()
    return {"target_tokens_per_sec": target / seconds, "efficiency": real / slots,
            "batches_per_sec": batches / seconds}


def first_batch_seconds(prepared: PreparedCorpus, tokens_per_batch: int, skip: int) -> float:
    started = time.perf_counter()
    next(iter(prepared.batches(tokens_per_batch=tokens_per_batch, skip_batches=skip)))
    return time.perf_counter() - started


def verify_rates(prepared: PreparedCorpus, repeats: int) -> dict:
    """Seconds and GB/s of `verify()` over the whole corpus: cached, and from the disk."""
    files = [prepared.directory / shard[kind] for shard in prepared.manifest["shards"]
             for kind in ("ids", "lengths")]
    size = sum(file.stat().st_size for file in files)
    report: dict = {"bytes": size}
    for case in ("cached", "disk"):
        runs = []
        for _ in range(repeats):
            if case == "disk":
                for file in files:  # out of the page cache: these files only
                    descriptor = os.open(file, os.O_RDONLY)
                    os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(descriptor)
            else:
                prepared.verify()  # (into the cache)
            started = time.perf_counter()
            prepared.verify()
            runs.append(time.perf_counter() - started)
        report[f"{case}_seconds"] = round(statistics.median(runs), 3)
        report[f"{case}_gb_per_sec"] = round(size / statistics.median(runs) / 1e9, 2)
    return report


def shard_read_rates(prepared: PreparedCorpus, repeats: int) -> dict:
    """Pairs/s reading every shard into ragged ids (cached), with and without the checks
    (alternating, median of `repeats` passes each): what the checks cost per shard read."""
    directory = prepared.directory
    files = [(tf.constant(str(directory / shard["ids"])),
              tf.constant(str(directory / shard["lengths"])))
             for shard in prepared.manifest["shards"]]
    ids_dtype = tf.as_dtype(prepared.manifest["id_dtype"])
    vocab_size = prepared.manifest["tokenizer_vocab_size"]
    reads = {name: tf.function(lambda ids, lengths, read=read: read(ids, lengths, ids_dtype,
                                                                     vocab_size).flat_values)
             for name, read in (("checked", shard_files.read_shard),
                                ("unchecked", _unchecked_read_shard))}
    seconds: dict[str, list[float]] = {name: [] for name in reads}
    for repeat in range(repeats + 1):
        for name in sorted(reads, reverse=repeat % 2 == 1):
            started = time.perf_counter()
            for ids, lengths in files:
                reads[name](ids, lengths).numpy()
            if repeat:  # the first pass traces and fills the page cache
                seconds[name].append(time.perf_counter() - started)
    return {f"{name}_pairs_per_sec": round(prepared.pairs / statistics.median(times))
            for name, times in seconds.items()}


def format_read_rates(prepared: PreparedCorpus, shards: int) -> dict:
    """Pairs/s reading `shards` shards: our files vs tf.data save/load of per-pair elements."""
    pairs = sum(prepared.manifest["shards"][i]["pairs"] for i in range(shards))
    # Our format: the ragged ids of whole shards (the part of the pipeline that reads).
    directory = prepared.directory
    started = time.perf_counter()
    for shard in prepared.manifest["shards"][:shards]:
        lengths = tf.io.decode_raw(tf.io.read_file(str(directory / shard["lengths"])), tf.int32)
        ids = tf.io.decode_raw(tf.io.read_file(str(directory / shard["ids"])),
                               tf.as_dtype(prepared.manifest["id_dtype"]))
        tf.RaggedTensor.from_row_lengths(tf.cast(ids, tf.int32), tf.cast(lengths, tf.int64))
    ours = pairs / (time.perf_counter() - started)
    # tf.data.Dataset.save of the same pairs, one (source, target) element per pair.
    elements = prepared.batches(tokens_per_batch=4096, shuffle=False, repeat=False).unbatch()
    elements = elements.map(lambda f, labels: (f["source"][f["source"] != PAD_ID],
                                               labels[labels != PAD_ID])).take(pairs)
    with tempfile.TemporaryDirectory() as folder:
        elements.save(folder)
        started = time.perf_counter()
        for _ in tf.data.Dataset.load(folder).ragged_batch(4096):
            pass
        saved = pairs / (time.perf_counter() - started)
    # TFRecord, the format of tensor2tensor and OpenNMT-tf's examples: one Example per pair.
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "pairs.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for source, target in elements.as_numpy_iterator():
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "source": tf.train.Feature(int64_list=tf.train.Int64List(value=source)),
                    "target": tf.train.Feature(int64_list=tf.train.Int64List(value=target)),
                })).SerializeToString())
        features = {name: tf.io.RaggedFeature(tf.int64) for name in ("source", "target")}
        started = time.perf_counter()
        for _ in tf.data.TFRecordDataset(path).batch(4096).map(
                lambda records: tf.io.parse_example(records, features)):
            pass
        records = pairs / (time.perf_counter() - started)
    return {"ours_pairs_per_sec": ours, "dataset_load_pairs_per_sec": saved,
            "tfrecord_pairs_per_sec": records, "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepared", type=Path, required=True)
    parser.add_argument("--tokens-per-batch", type=int, nargs="+", default=[4096, 25000])
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--format-shards", type=int, default=1)
    parser.add_argument("--train-tokens-per-sec", type=float, default=BASE_TRAIN_TOKENS_PER_SEC,
                        help="target tokens/s a training step consumes (default: base preset)")
    parser.add_argument("--ab-checks", action="store_true",
                        help="also measure each budget without the shard checks, alternating")
    args = parser.parse_args()
    prepared = PreparedCorpus.load(args.prepared)
    report: dict = {"pairs": prepared.pairs, "shards": prepared.num_shards,
                    "verify": verify_rates(prepared, args.repeats)}
    for budget in args.tokens_per_batch:
        runs, unchecked = [], []
        for seed in range(args.repeats):
            for on in (True, False)[::1 if seed % 2 == 0 else -1]:  # alternating which first
                if on or args.ab_checks:
                    with checks(on):
                        (runs if on else unchecked).append(
                            throughput(prepared, budget, args.batches, seed))
        report[f"budget_{budget}"] = {key: statistics.median(run[key] for run in runs)
                                      for key in runs[0]}
        report[f"budget_{budget}"]["over_training_step"] = round(
            report[f"budget_{budget}"]["target_tokens_per_sec"] / args.train_tokens_per_sec)
        if unchecked:
            report[f"budget_{budget}"]["unchecked_target_tokens_per_sec"] = statistics.median(
                run["target_tokens_per_sec"] for run in unchecked)
        per_epoch = sum(len(e) for e in prepared.shard_batches(budget, 128))
        report[f"budget_{budget}"]["batches_per_epoch"] = per_epoch
        report[f"budget_{budget}"]["first_batch_seconds"] = {
            f"after_{skip}": round(statistics.median(
                first_batch_seconds(prepared, budget, skip) for _ in range(args.repeats)), 3)
            for skip in (10, 10_000, 10 * per_epoch + 12_345)}
    report["shard_reads"] = shard_read_rates(prepared, args.repeats)
    if args.format_shards:
        report["format"] = format_read_rates(prepared, args.format_shards)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
