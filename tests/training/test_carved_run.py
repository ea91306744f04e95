"""A run on a folder of train files alone: val and test are carved out of train
(`pipelines.carving`), `prepare` carves them as `train` does, and results.json reports it."""

from __future__ import annotations

import json

from keras_transformer.prepare import main as prepare_main
from keras_transformer.training.config import train_config
from keras_transformer.training.run import run_training
from tests.cli.test_train import write_toy_corpus
from tests.training.test_fine_tuning import TINY


def test_a_train_only_folder_trains_end_to_end(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=600)
    for split in ("val", "test"):
        for lang in ("xx", "yy"):
            (data / f"{split}.{lang}").unlink()
    prepared = tmp_path / "prepared"
    assert prepare_main(["--data", str(data), "--src", "xx", "--tgt", "yy", "--vocab-size",
                         "300", "--max-length", "32", "--clean-train", "--out",
                         str(prepared)]) == 0
    printed = capsys.readouterr().out
    assert "validation: the 60 pairs of" in printed  # 10% of 600 (toward 100)
    out = tmp_path / "run"
    # The prepared data match the run's carved, cleaned train split (same identity).
    results = run_training(train_config(data=str(data), out=str(out), max_steps=2,
                                        prepared=str(prepared), clean_train=True, **TINY))
    report = results["data_report"]
    assert (report["val"], report["test"], report["seed"]) == (60, 60, 0)
    assert report["clean"]["kept"] == report["train"] == 600 - 120 - sum(
        report["clean"][reason] for reason in ("empty", "length_ratio", "duplicate")) - (
        report["val_copies_dropped"] + report["test_copies_dropped"])
    assert json.loads((out / "results.json").read_text())["data_report"] == report
    assert results["test_sentences"] == 10 and results["test_split"] == "test"
