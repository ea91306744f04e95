"""A run's data: a run is resumed only on the data, precision and XLA mode it was trained
with."""

from __future__ import annotations

import json

import pytest

from keras_transformer.errors import UsageError


def test_a_run_started_with_a_global_tokens_per_batch_on_replicas_is_not_resumed(tmp_path):
    from keras_transformer.training.run_data import check_resumed_data

    prepared = {"directory": "p", "corpus_fingerprint": "f", "shards": 1}
    (tmp_path / "config.json").write_text(json.dumps({"replicas": 2, "prepared": prepared}))
    with pytest.raises(UsageError, match="global budget"):
        check_resumed_data(tmp_path, {"replicas": 2, "prepared": prepared})
    (tmp_path / "config.json").write_text(json.dumps({"replicas": 1, "prepared": prepared}))
    check_resumed_data(tmp_path, {"replicas": 1, "prepared": prepared})


def test_a_run_is_not_resumed_in_another_precision_or_xla_mode(tmp_path):
    from keras_transformer.training.run_data import check_resumed_data

    prepared = {"directory": "p", "corpus_fingerprint": "f", "shards": 1}
    recorded = {"replicas": 1, "prepared": prepared, "step_budget": {}, "jit_compile": False,
                "precision": "mixed_float16"}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(UsageError, match="--precision mixed_float16"):
        check_resumed_data(tmp_path, {**recorded, "precision": "mixed_bfloat16"})
    with pytest.raises(UsageError, match="--jit-compile off"):
        check_resumed_data(tmp_path, {**recorded, "jit_compile": True})
    check_resumed_data(tmp_path, recorded)
