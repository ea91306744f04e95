"""Damaged files and full disks never end a run with a traceback or a crash (issue 27).

One tiny run on the toy corpus is SIGKILLed after its second backup (steps 10 and 20 of 30);
each test damages a copy of it as storage misbehaves and runs the same command again: the
run either finishes every step from the newest intact state (saying from which), or stops
with one line naming the file. Then a full disk, and a SIGKILL in the middle of writing each
kind of file the run writes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli.test_train import REPO, TINY, cli_env, write_toy_corpus
from tests.storage_faults import small_filesystem
from tests.training.test_resume import KILLED_AFTER_A_MICRO_BATCH, in_this_process

STEPS, EVERY = 30, 10


def _command(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "keras_transformer.train", "--data", str(data), *TINY,
            "--max-steps", str(STEPS), "--checkpoint-every", str(EVERY), "--test-split",
            "none", "--no-export", "--out", str(out)]


@pytest.fixture
def same_command(capsys):
    """Runs a train command's `main` in this process (what `python -m` runs, without
    starting TensorFlow again: the tests share one process); returns it as a finished
    process, its stdout and stderr captured."""

    def run(command: list[str]) -> subprocess.CompletedProcess:
        return in_this_process(command, capsys)

    return run


def _output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def _assert_one_error_line(result: subprocess.CompletedProcess, status: int,
                           *names: str) -> str:
    """The command stopped with `status` and one `error:` line naming each of `names`."""
    output = _output(result)
    assert result.returncode == status, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


def _assert_finished(result: subprocess.CompletedProcess, out: Path) -> dict:
    output = _output(result)
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == STEPS
    assert results["export"] is None  # --no-export
    return results


def _averaging_candidates(results: dict) -> dict[str, list[int]]:
    return {candidate["name"]: candidate["steps"]
            for candidate in results["averaging"]["candidates"]}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, run) of a run SIGKILLed after 25 of its 30 steps: backups at 10 and 20."""
    root = tmp_path_factory.mktemp("interrupted")
    data = write_toy_corpus(root / "corpus")
    out = root / "run"
    command = _command(data, out)
    victim = subprocess.run([sys.executable, "-c", KILLED_AFTER_A_MICRO_BATCH, *command[3:]],
                            cwd=REPO, env=cli_env(KILL_AT="25"), capture_output=True,
                            text=True, timeout=300)
    assert victim.returncode == -signal.SIGKILL, _output(victim)[-3000:]
    assert sorted(p.name for p in (out / "backup").iterdir()) == ["step-00000010",
                                                                  "step-00000020"]
    return data, out


@pytest.fixture
def damaged_copy(interrupted, tmp_path) -> tuple[Path, Path]:
    data, out = interrupted
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    return data, copy


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _overwrite(path: Path, offset: int, count: int = 8) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        original = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(255 - byte for byte in original))


def test_truncated_newest_backup_resumes_from_the_one_before(damaged_copy, same_command):
    data, out = damaged_copy
    _truncate(out / "backup" / "step-00000020" / "model_and_optimizer.weights.h5")
    result = same_command(_command(data, out))
    _assert_finished(result, out)
    output = _output(result)
    assert "step-00000020 is damaged (model_and_optimizer.weights.h5 has" in output
    assert "resuming from the intact backup of step 10" in output
    assert "resuming at step 10, until 30 steps" in output
    assert (out / "backup" / "damaged-step-00000020").is_dir()


def test_truncated_newest_checkpoint_and_backup_resume_from_the_one_before(damaged_copy,
                                                                            same_command):
    data, out = damaged_copy
    _truncate(out / "backup" / "step-00000020" / "model_and_optimizer.weights.h5")
    _truncate(out / "checkpoints" / "ckpt-00000020.weights.h5")
    result = same_command(_command(data, out))
    results = _assert_finished(result, out)
    assert "resuming at step 10, until 30 steps" in _output(result)
    # ckpt-20, written after the state resumed from, was removed and written again.
    assert _averaging_candidates(results)["last"] == [10, 20, 30]


def test_unreadable_backup_state_is_named_and_a_damaged_checkpoint_is_not_averaged(
        damaged_copy, same_command):
    data, out = damaged_copy
    (out / "backup" / "step-00000020" / "state.json").write_text('{"step": 20,\n"best_')
    _overwrite(out / "checkpoints" / "ckpt-00000010.weights.h5", 3000)
    result = same_command(_command(data, out))
    results = _assert_finished(result, out)
    output = _output(result)
    assert "step-00000020 is damaged (state.json is not valid JSON)" in output
    assert "ckpt-00000010.weights.h5 is damaged (ckpt-00000010.weights.h5 fails its checksum)" \
        in output
    assert "resuming at step 10, until 30 steps" in output
    assert _averaging_candidates(results)["last"] == [20, 30]
    assert (out / "checkpoints" / "ckpt-00000010.weights.h5.damaged").is_file()


def test_no_intact_backup_left_refuses_naming_each(damaged_copy, same_command):
    data, out = damaged_copy
    _truncate(out / "backup" / "step-00000020" / "model_and_optimizer.weights.h5")
    _overwrite(out / "backup" / "step-00000010" / "model_and_optimizer.weights.h5", 5000)
    result = same_command(_command(data, out))
    _assert_one_error_line(result, 2, "no intact backup", "step-00000020", "step-00000010",
                           "--overwrite")


def test_truncated_shard_is_named(damaged_copy, same_command):
    data, out = damaged_copy
    shard = next((out / "prepared").glob("shard-*.ids"))
    _truncate(shard)
    _assert_one_error_line(same_command(_command(data, out)), 2, str(shard), "prepare it again")


def test_overwritten_shard_bytes_are_caught_by_the_checksum(damaged_copy, same_command):
    data, out = damaged_copy
    shard = next((out / "prepared").glob("shard-*.ids"))
    size = shard.stat().st_size
    _overwrite(shard, size // 2)
    assert shard.stat().st_size == size
    _assert_one_error_line(same_command(_command(data, out)), 2, str(shard), "checksum")


def test_unreadable_config_is_named(damaged_copy, same_command):
    data, out = damaged_copy
    (out / "config.json").write_text("{\n  \"identity\": ")
    _assert_one_error_line(same_command(_command(data, out)), 2, str(out / "config.json"),
                           "not JSON")


# The train command with a fault at the write of the file whose path contains FAULT_AT (its
# FAULT_NTH write): FAULT=nospace fails it as a full disk does (where no tmpfs can be
# mounted), FAULT=kill SIGKILLs the process in the middle of it (half the file on disk
# under its temporary name).
FAULT_AT_A_WRITE = textwrap.dedent(
    """
    import errno, os, signal, sys
    from pipelines import storage
    from keras_transformer.train import main

    seen = 0
    original = storage.sync_file

    def sync_file(path):
        global seen
        if os.environ["FAULT_AT"] in str(path):
            seen += 1
            if seen == int(os.environ["FAULT_NTH"]):
                if os.environ["FAULT"] == "kill":
                    os.truncate(path, os.path.getsize(path) // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        original(path)

    storage.sync_file = sync_file
    sys.exit(main(sys.argv[1:]))
    """
)


def fault_at_a_write(command: list[str], fault: str, pattern: str,
                     nth: int) -> subprocess.CompletedProcess:
    """Runs a train `command` with `fault` ("kill" or "nospace") at the `nth` write of a file
    whose path contains `pattern`."""
    return subprocess.run([sys.executable, "-c", FAULT_AT_A_WRITE, *command[3:]], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=cli_env(FAULT=fault, FAULT_AT=pattern, FAULT_NTH=str(nth)))


def test_full_disk_stops_with_one_line_then_the_same_command_finishes(interrupted, tmp_path,
                                                                      same_command):
    data, _ = interrupted
    with small_filesystem(tmp_path / "disk", 3 << 20) as mounted:
        out = tmp_path / "disk" / "run"
        command = _command(data, out)
        if mounted:
            full = same_command(command)
        else:  # the backup of step 20 fails as on a full disk
            full = fault_at_a_write(command, "nospace", "model_and_optimizer", 2)
        line = _assert_one_error_line(full, 4, str(out), "needed", "free space")
        assert "no space left" in line
        assert not list(out.rglob(".tmp-*")), "a temporary file was left behind"
        if mounted:  # free space
            subprocess.run(["mount", "-o", "remount,size=64m", str(tmp_path / "disk")],
                           check=True)
        finished = same_command(command)
        _assert_finished(finished, out)
        assert "resuming at step" in _output(finished)


def test_a_first_run_that_fails_after_training_keeps_what_it_trained(tmp_path, same_command,
                                                                    monkeypatch):
    """A fresh run that fails before it trains leaves nothing; one that fails after its first
    backup (a shard unreadable at hour 9, another worker's refusal: a ValueError inside
    training) keeps its backups, and the same command resumes it."""
    from keras_transformer.errors import UsageError
    from keras_transformer.training import run as run_module

    data, out = write_toy_corpus(tmp_path / "corpus"), tmp_path / "run"
    trained = run_module.train_model

    def train_then_fail(*args, **kwargs):
        trained(*args, **kwargs)
        raise UsageError("train data: a shard became unreadable (EIO)")

    command = [*_command(data, out), "--max-steps", str(EVERY)]  # one backup: enough
    monkeypatch.setattr(run_module, "train_model", train_then_fail)
    failed = same_command(command)
    _assert_one_error_line(failed, 2, "unreadable")
    assert (out / "backup" / f"step-{EVERY:08d}").is_dir() and (out / "config.json").is_file()
    monkeypatch.setattr(run_module, "train_model", trained)
    resumed = same_command(command)
    assert resumed.returncode == 0, _output(resumed)[-3000:]
    assert json.loads((out / "results.json").read_text())["steps"] == EVERY
