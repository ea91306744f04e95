"""The averaging command: `python -m keras_transformer.averaging` writes model.keras from the
last N checkpoints."""

from __future__ import annotations

import subprocess

import keras
import numpy as np

from keras_transformer import run_directory
from keras_transformer.averaging import main as averaging_main
from keras_transformer.errors import EXIT_STORAGE
from keras_transformer.training.checkpoints import checkpoint_path, save_model_weights
from pipelines import storage
from tests.storage_faults import fill, no_space_at_sync, small_filesystem
from tests.training.test_checkpoints import _model_with_constant_weights


def test_averaging_command_writes_model_keras_from_the_last_n(tmp_path):
    config = {"model": {"preset": "tiny", "vocab_size": 20}}
    storage.write_json(tmp_path / run_directory.CONFIG_FILE, config)
    checkpoints = tmp_path / run_directory.CHECKPOINT_DIR
    checkpoints.mkdir()
    for step, value in ((100, 50.0), (200, 1.0), (300, 2.0), (400, 6.0)):
        save_model_weights(_model_with_constant_weights(value), checkpoint_path(checkpoints, step))
    assert averaging_main(["--run", str(tmp_path), "--last", "3"]) == 0
    model = keras.models.load_model(tmp_path / run_directory.MODEL_FILE, compile=False)
    for weights in model.get_weights():
        np.testing.assert_allclose(weights, 3.0)  # mean of 1, 2, 6 (not the step-100 one)


def test_a_full_disk_exits_4_with_one_line_and_keeps_the_old_model(tmp_path, capsys,
                                                                   monkeypatch):
    run = tmp_path / "run"
    checkpoints = run / run_directory.CHECKPOINT_DIR
    checkpoints.mkdir(parents=True)
    storage.write_json(run / run_directory.CONFIG_FILE,
                       {"model": {"preset": "tiny", "vocab_size": 20}})
    for step, value in ((100, 1.0), (200, 3.0)):
        save_model_weights(_model_with_constant_weights(value), checkpoint_path(checkpoints, step))
    disk = tmp_path / "disk"
    with small_filesystem(disk, 64 * 1024) as mounted:
        output = disk / "model.keras"
        output.write_bytes(b"the earlier model")
        if mounted:
            fill(disk)
        else:
            no_space_at_sync(monkeypatch, disk)
        assert averaging_main(["--run", str(run), "--output", str(output)]) == EXIT_STORAGE
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert len(err.splitlines()) == 1 and err.startswith("error: no space left")
        assert str(output) in err and "needed" in err
        assert output.read_bytes() == b"the earlier model"
        assert not list(disk.glob(".tmp-*"))
        # Free space (or no failure any more), run the same command again.
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        monkeypatch.undo()
        assert averaging_main(["--run", str(run), "--output", str(output)]) == 0
        model = keras.models.load_model(output, compile=False)
        np.testing.assert_allclose(model.get_weights()[0], 2.0)
