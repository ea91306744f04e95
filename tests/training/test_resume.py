"""A training process killed with SIGKILL resumes with the same command and ends like an
uninterrupted run: the same number of steps and, with a fixed seed, the same losses."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from keras_transformer.train import main
from keras_transformer.training.backup import newest_step
from tests.cli.test_train import REPO, TINY, cli_env, write_toy_corpus

STEPS, EVERY = 30, 10


def _command(data: Path, out: Path, *extra: str, steps: int = STEPS,
             every: int = EVERY) -> list[str]:
    return [sys.executable, "-m", "keras_transformer.train", "--data", str(data), *TINY,
            "--max-steps", str(steps), "--checkpoint-every", str(every), "--test-split", "none",
            "--no-export", "--out", str(out), *extra]


def in_this_process(command: list[str], capsys) -> subprocess.CompletedProcess:
    """Runs a train `command`'s `main` in this process (what `python -m` runs, without
    starting TensorFlow again), as a finished process with its stdout and stderr (`capsys`).
    For the runs a test does not kill: only a killed run needs a process of its own."""
    capsys.readouterr()
    status = main(command[3:])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(command, status, captured.out, captured.err)


def _losses(out: Path) -> dict[int, float]:
    """Training loss of each interval from logs/metrics.csv, by the step it ended at
    (a resumed run may log an interval twice: the last row wins)."""
    with open(out / "logs" / "metrics.csv") as handle:
        return {int(float(row["step"])): float(row["loss"]) for row in csv.DictReader(handle)}


@pytest.mark.slow
def test_sigkill_mid_run_then_same_command_resumes_to_the_same_result(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    victim = subprocess.Popen(_command(data, resumed), cwd=REPO, env=cli_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = {}

    def kill_inside_the_second_interval():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and victim.poll() is None:
            if newest_step(resumed / "backup") >= EVERY:
                break
            time.sleep(0.05)
        killed["alive"] = victim.poll() is None
        time.sleep(0.3)  # somewhere inside the next interval
        victim.send_signal(signal.SIGKILL)
        victim.wait()

    # The uninterrupted reference runs here while the other process is started and killed.
    killer = threading.Thread(target=kill_inside_the_second_interval)
    killer.start()
    try:
        uninterrupted = in_this_process(_command(data, reference), capsys)
    finally:
        killer.join()
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-2000:] + uninterrupted.stderr[
        -3000:]
    assert killed["alive"], "the run ended before it could be killed"
    killed_at = newest_step(resumed / "backup")
    assert EVERY <= killed_at < STEPS
    assert not (resumed / "results.json").exists()

    finished = in_this_process(_command(data, resumed), capsys)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    assert f"resuming at step {killed_at}, until {STEPS} steps" in finished.stdout

    expected = json.loads((reference / "results.json").read_text())
    actual = json.loads((resumed / "results.json").read_text())
    assert actual["steps"] == expected["steps"] == STEPS
    assert actual["averaged_steps"] == expected["averaged_steps"]
    # Same seed, same data stream position, restored optimizer state: the same losses up to
    # float round-off (CPU kernels are deterministic here; 1e-4 leaves room for oneDNN).
    assert _losses(resumed) == pytest.approx(_losses(reference), rel=1e-4)
    assert actual["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-4)


# The train command, SIGKILLing itself right after its KILL_AT-th micro-batch (a callback
# placed there by this test only): a kill at an exactly known point inside an update.
KILLED_AFTER_A_MICRO_BATCH = textwrap.dedent(
    """
    import os, signal, sys
    from keras_transformer.training import callbacks
    from keras_transformer.train import main

    trained = 0
    original = callbacks.FirstStepTimer.on_train_batch_end

    def on_train_batch_end(self, batch, logs=None):
        global trained
        original(self, batch, logs)
        trained += 1
        if trained == int(os.environ["KILL_AT"]):
            os.kill(os.getpid(), signal.SIGKILL)

    callbacks.FirstStepTimer.on_train_batch_end = on_train_batch_end
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_killed_between_micro_batches_of_one_update_resumes_without_half_or_double_updates(
        tmp_path, capsys, monkeypatch):
    # On the TensorFlow-ops path (the fused CPU kernels off), as on a GPU.
    accumulate, tf_ops = 2, {"KERAS_TRANSFORMER_FUSED_KERNELS": "off"}
    monkeypatch.setenv("KERAS_TRANSFORMER_FUSED_KERNELS", "off")  # for the runs in this process
    steps, every = 12, 4
    data = write_toy_corpus(tmp_path / "corpus")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    flags = ("--accumulate", str(accumulate))
    sized = {"steps": steps, "every": every}
    # Killed after update 6 and the first micro-batch of update 7; the last backup is at 4.
    kill_at = accumulate * (every + 2) + 1
    command = _command(data, resumed, *flags, **sized)
    victim = subprocess.Popen([sys.executable, "-c", KILLED_AFTER_A_MICRO_BATCH, *command[3:]],
                              cwd=REPO, env=cli_env(KILL_AT=str(kill_at), **tf_ops),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The uninterrupted reference runs here meanwhile.
        uninterrupted = in_this_process(_command(data, reference, *flags, **sized), capsys)
    finally:
        victim_out, victim_err = victim.communicate(timeout=300)
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-2000:] + uninterrupted.stderr[
        -3000:]
    assert victim.returncode == -signal.SIGKILL, victim_out[-2000:] + victim_err[-3000:]
    assert newest_step(resumed / "backup") == every

    finished = in_this_process(command, capsys)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    assert f"resuming at step {every}, until {steps} steps" in finished.stdout
    expected = json.loads((reference / "results.json").read_text())
    actual = json.loads((resumed / "results.json").read_text())
    assert actual["steps"] == expected["steps"] == steps
    assert (expected["fused_kernels"], actual["fused_kernels"]) == (False, False)
    # Neither the half-accumulated update 7 nor updates 5-6 leaked into the resumed run:
    # it trained the same updates on the same micro-batches as the uninterrupted one.
    assert _losses(resumed) == pytest.approx(_losses(reference), rel=1e-4)
    assert actual["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-4)
