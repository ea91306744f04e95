"""The training input pipeline alone, no model (issue 13): prepared shards -> bucketed batches.

Reports, for each token budget, the median over --repeats runs of target tokens/s (real,
non-PAD label tokens) and the padding efficiency (real share of source and target slots);
the seconds to the first batch of a stream resumed after 10 and after 10,000 steps' worth
of batches (no replay: both read one shard); and, for the choice of the on-disk format,
pairs/s reading the same token ids back from our shard files, from
`tf.data.Dataset.save`/`load` (one element per pair) and from TFRecord files of
`tf.train.Example`s (two int64 lists per pair, parsed in batches of 4,096).

    python -m keras_transformer.prepare --data /tmp/scale/corpus-4500000 --src de --tgt en \
        --vocab-size 37000 --out /tmp/prepared-4.5M
    python benchmarks/input_pipeline.py --prepared /tmp/prepared-4.5M
"""

from __future__ import annotations

import argparse
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

from pipelines.constants import PAD_ID  # noqa: E402
from pipelines.prepared import PreparedCorpus  # noqa: E402


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
    args = parser.parse_args()
    prepared = PreparedCorpus.load(args.prepared)
    report: dict = {"pairs": prepared.pairs, "shards": prepared.num_shards}
    for budget in args.tokens_per_batch:
        runs = [throughput(prepared, budget, args.batches, seed) for seed in range(args.repeats)]
        report[f"budget_{budget}"] = {key: statistics.median(run[key] for run in runs)
                                      for key in runs[0]}
        per_epoch = sum(len(e) for e in prepared.shard_batches(budget, 128))
        report[f"budget_{budget}"]["batches_per_epoch"] = per_epoch
        report[f"budget_{budget}"]["first_batch_seconds"] = {
            f"after_{skip}": round(statistics.median(
                first_batch_seconds(prepared, budget, skip) for _ in range(args.repeats)), 3)
            for skip in (10, 10_000, 10 * per_epoch + 12_345)}
    report["format"] = format_read_rates(prepared, args.format_shards)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
