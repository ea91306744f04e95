"""A run's data: a run is resumed only on the data, precision and XLA mode it was trained
with; the data a run prepares hold its val split's token ids."""

from __future__ import annotations

import json

import pytest

from keras_transformer.errors import UsageError


def test_a_run_started_with_a_global_tokens_per_batch_on_replicas_is_not_resumed(tmp_path):
    from keras_transformer.run_directory import check_resumed_data

    prepared = {"directory": "p", "corpus_fingerprint": "f", "shards": 1}
    (tmp_path / "config.json").write_text(json.dumps({"replicas": 2, "prepared": prepared}))
    with pytest.raises(UsageError, match="global budget"):
        check_resumed_data(tmp_path, {"replicas": 2, "prepared": prepared})
    (tmp_path / "config.json").write_text(json.dumps({"replicas": 1, "prepared": prepared}))
    check_resumed_data(tmp_path, {"replicas": 1, "prepared": prepared})


def test_a_run_is_not_resumed_in_another_precision_or_xla_mode(tmp_path):
    from keras_transformer.run_directory import check_resumed_data

    prepared = {"directory": "p", "corpus_fingerprint": "f", "shards": 1}
    recorded = {"replicas": 1, "prepared": prepared, "step_budget": {}, "jit_compile": False,
                "precision": "mixed_float16"}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(UsageError, match="--precision mixed_float16"):
        check_resumed_data(tmp_path, {**recorded, "precision": "mixed_bfloat16"})
    with pytest.raises(UsageError, match="--jit-compile off"):
        check_resumed_data(tmp_path, {**recorded, "jit_compile": True})
    check_resumed_data(tmp_path, recorded)


def test_the_data_a_run_prepares_hold_its_val_split(tmp_path):
    from keras_transformer.cluster.workers import Cluster
    from keras_transformer.training.config import train_config
    from keras_transformer.training.run_data import load_corpora, scan_training_text, training_data
    from pipelines.corpora import corpus_fingerprint
    from tests.cli.test_train import write_toy_corpus

    data = write_toy_corpus(tmp_path / "corpus", pairs=40)
    config = train_config(data=str(data), src="xx", tgt="yy", vocab_size=300, max_length=32,
                          out=str(tmp_path / "run"), prepared=str(tmp_path / "prepared"))
    corpora = load_corpora(config)
    scan = scan_training_text(config, corpora["train"], print)
    prepared = training_data(config, corpora["train"], None, scan, Cluster(), print,
                             validation=corpora["val"])
    entry = prepared.check_validation(config.data.val_split)
    assert entry["pairs"] == len(corpora["val"]) == 20
    assert entry["corpus_fingerprint"] == corpus_fingerprint(corpora["val"])
    # Trained again from it with a lower --max-length: the pairs left out are counted.
    import logging

    from keras_transformer.training.prepared_checks import check_prepared

    lengths = [length for shard in prepared.manifest["shards"]
               for length, count in enumerate(shard["histogram"]) for _ in range(count)]
    cut = sorted(lengths)[len(lengths) // 2]
    shorter = train_config(data=str(data), src="xx", tgt="yy", vocab_size=300, max_length=cut,
                           out=str(tmp_path / "run"), prepared=str(tmp_path / "prepared"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("keras_transformer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        check_prepared(shorter, prepared)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    longer = sum(length > cut for length in lengths)
    assert 0 < longer < len(lengths)
    assert [record.getMessage() for record in records] == [
        f"{longer:,} of the {len(lengths):,} prepared pairs ({100 * longer / len(lengths):.2f}%) "
        f"are longer than --max-length {cut} positions (prepared with 32): left out of the "
        "batches"]
