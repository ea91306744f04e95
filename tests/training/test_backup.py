"""Backup generations (`keras_transformer.training.backup`): written whole or not at all, the
newest `KEEP` kept, restored from the newest intact one; checkpoints made to agree with it."""

from __future__ import annotations

import os
import warnings

import pytest

from keras_transformer.errors import UsageError
from keras_transformer.training import backup
from keras_transformer.training.checkpoints import checkpoint_path, save_model_weights
from pipelines import storage
from tests.training.test_callbacks import _compiled_tiny_model


def _write(model, run, step: int, checkpoints=None) -> None:
    model.optimizer.iterations.assign(step)
    backup.write_backup(model, run / "backup", {"step": step, "best_step": step},
                        checkpoints or {})


def test_generations_keep_the_newest_two_and_restore_the_newest(tmp_path):
    model = _compiled_tiny_model()
    for step in (10, 20, 30):
        _write(model, tmp_path, step)
    assert [step for step, _ in backup.list_generations(tmp_path / "backup")] == [30, 20]
    restored = _compiled_tiny_model()
    state = backup.restore_backup(restored, tmp_path)
    assert state["step"] == 30 and int(restored.optimizer.iterations.numpy()) == 30
    assert state["weights"]["bytes"] == (tmp_path / "backup" / "step-00000030" /
                                         "model_and_optimizer.weights.h5").stat().st_size


def test_a_generation_that_fails_midway_leaves_no_folder_and_the_older_ones_intact(
        tmp_path, monkeypatch):
    model = _compiled_tiny_model()
    _write(model, tmp_path, 10)

    def no_space(path, data):
        raise storage.StorageError(28, path, len(data))

    monkeypatch.setattr(storage, "write_bytes", no_space)
    with pytest.raises(storage.StorageError):
        _write(model, tmp_path, 20)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == ["step-00000010"]
    assert backup.restore_backup(_compiled_tiny_model(), tmp_path)["step"] == 10


def test_a_damaged_newest_generation_is_set_aside_and_the_previous_restored(tmp_path):
    model = _compiled_tiny_model()
    _write(model, tmp_path, 10)
    _write(model, tmp_path, 20)
    weights = tmp_path / "backup" / "step-00000020" / "model_and_optimizer.weights.h5"
    with open(weights, "r+b") as handle:  # same size, other bytes
        handle.seek(weights.stat().st_size // 2)
        handle.write(b"\xff" * 8)
    restored = _compiled_tiny_model()
    assert backup.restore_backup(restored, tmp_path)["step"] == 10
    assert int(restored.optimizer.iterations.numpy()) == 10
    assert (tmp_path / "backup" / "damaged-step-00000020").is_dir()


def test_nothing_intact_refuses_and_no_backup_starts_at_zero(tmp_path):
    model = _compiled_tiny_model()
    assert backup.restore_backup(model, tmp_path) == {}  # a fresh run
    _write(model, tmp_path, 10)
    (tmp_path / "checkpoints").mkdir()
    save_model_weights(model, checkpoint_path(tmp_path / "checkpoints", 10))
    os.truncate(tmp_path / "backup" / "step-00000010" / "model_and_optimizer.weights.h5", 100)
    for _ in range(2):  # the refusal stands: nothing was moved, nothing removed
        with pytest.raises(UsageError, match="no intact backup .*step-00000010: "
                                             "model_and_optimizer.weights.h5 has 100"):
            backup.restore_backup(_compiled_tiny_model(), tmp_path)
        assert [p.name for p in (tmp_path / "backup").iterdir()] == ["step-00000010"]
        assert checkpoint_path(tmp_path / "checkpoints", 10).is_file()


def test_an_intact_backup_of_other_settings_is_refused_not_set_aside(tmp_path):
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    _write(_compiled_tiny_model(), tmp_path, 10)
    other = build_trainer("tiny", vocab_size=30)  # another vocabulary: other shapes
    other.compile(paper_adam(32, 10), loss="sparse_categorical_crossentropy")
    other.optimizer.build(other.trainable_variables)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(UsageError, match="does not match this run's settings"):
            backup.restore_backup(other, tmp_path)
    # The refusal alone: not Keras' warnings about the layers it would have left fresh.
    assert not [str(w.message) for w in warned if issubclass(w.category, UserWarning)]
    assert [p.name for p in (tmp_path / "backup").iterdir()] == ["step-00000010"]


def test_warnings_of_weights_that_load_are_shown_and_an_error_filter_refuses_them(tmp_path):
    _write(_compiled_tiny_model(), tmp_path, 10)

    def warning_load(model):
        load = model.load_weights

        def load_weights(path):
            warnings.warn("kept a layer fresh", UserWarning, stacklevel=2)
            load(path)
        model.load_weights = load_weights
        return model

    with pytest.warns(UserWarning, match="kept a layer fresh"):
        assert backup.restore_backup(warning_load(_compiled_tiny_model()), tmp_path)[
            "step"] == 10
    # The caller's filters judge it where it is raised: as an error it fails the load, and
    # an intact backup that does not load is refused (nothing moved).
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UsageError, match="does not load .*kept a layer fresh"):
            backup.restore_backup(warning_load(_compiled_tiny_model()), tmp_path)
    assert [p.name for p in (tmp_path / "backup").iterdir()] == ["step-00000010"]


def test_checkpoints_agree_with_the_restored_state(tmp_path):
    model = _compiled_tiny_model()
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    record = {}
    for step in (10, 20):
        record[checkpoint_path(checkpoints, step).name] = save_model_weights(
            model, checkpoint_path(checkpoints, step))
    record["best.weights.h5"] = save_model_weights(model, checkpoints / "best.weights.h5")
    _write(model, tmp_path, 20, record)
    save_model_weights(model, checkpoint_path(checkpoints, 30))  # after the backup of 20
    with open(checkpoint_path(checkpoints, 10), "r+b") as handle:
        handle.seek(2000)
        handle.write(b"\x00" * 8)
    (tmp_path / "checkpoints" / ".tmp-999999-ckpt-00000040.weights.h5").write_bytes(b"half")
    backup.restore_backup(_compiled_tiny_model(), tmp_path)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "best.weights.h5", "ckpt-00000010.weights.h5.damaged", "ckpt-00000020.weights.h5"]


def test_the_single_backup_of_an_earlier_version_still_resumes(tmp_path):
    model = _compiled_tiny_model()
    model.optimizer.iterations.assign(10)
    (tmp_path / "backup").mkdir()
    model.save_weights(tmp_path / "backup" / "latest.weights.h5")
    storage.write_json(tmp_path / "backup" / "state.json", {"step": 10, "best_step": 10})
    restored = _compiled_tiny_model()
    assert backup.restore_backup(restored, tmp_path)["step"] == 10
    assert int(restored.optimizer.iterations.numpy()) == 10
