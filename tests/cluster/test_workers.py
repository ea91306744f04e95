"""Multi-worker runs that never hang (`keras_transformer.cluster.workers`): TF_CONFIG checks, a cluster
that cannot start, stops taken by every worker at the same step, a worker killed mid-run,
and the restart that resumes the run. Workers are processes on 127.0.0.1, always killed at
the end of their test, whatever happened.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_transformer.cluster.workers import (
    LOST_WORKER_SECONDS,
    Cluster,
    ClusterConfigError,
    ClusterFailure,
    PeerRefused,
    cluster_error,
    read_cluster,
)
from keras_transformer.training.backup import newest_step
from keras_transformer.training.callbacks import AgreedStop, StopAt
from tests.cli.test_train import REPO, cli_env, write_toy_corpus
from tests.training.test_resume import in_this_process

TWO = {"worker": ["127.0.0.1:1001", "127.0.0.1:1002"]}


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (the OS picks them)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(cluster: dict, task_type: str = "worker", index: int = 0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def run_on_two_workers(script: str, timeout: float = 240) -> list[str]:
    """Runs a Python `script` as worker 0 and worker 1 of a cluster on 127.0.0.1 (TF_CONFIG);
    returns each one's stdout, after asserting that both exited 0."""
    workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = [subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=cli_env(TF_CONFIG=tf_config({"worker": workers}, index=index)))
        for index in range(2)]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, err) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
    return [out for out, _ in outputs]


# --- TF_CONFIG, checked before TensorFlow starts ----------------------------------------


def test_no_tf_config_is_one_process():
    cluster = read_cluster("")
    assert cluster == Cluster() and cluster.num_workers == 1
    assert cluster.is_chief and not cluster.is_multi_worker


def test_chief_is_the_chief_task_or_worker_0():
    assert read_cluster(tf_config(TWO, index=0)).is_chief
    second = read_cluster(tf_config(TWO, index=1))
    assert not second.is_chief and second.num_workers == 2 and second.is_multi_worker
    assert second.describe() == "worker 1 (127.0.0.1:1002)"
    with_chief = {**TWO, "chief": ["127.0.0.1:1000"]}
    assert not read_cluster(tf_config(with_chief, index=0)).is_chief
    chief = read_cluster(tf_config(with_chief, "chief", 0))
    assert chief.is_chief and chief.num_workers == 3 and chief.chief_task() == ("chief", 0)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"cluster": {"worker": ["a:1"]', "not valid JSON"),
        ('["a:1"]', 'no "cluster"'),
        (tf_config({**TWO, "ps": ["127.0.0.1:1003"]}), r"\['ps'\] tasks"),
        (tf_config({"worker": ["127.0.0.1"]}), "is not \"host:port\""),
        (tf_config({"worker": ["127.0.0.1:99999"]}), "port from 1 to 65535"),
        (tf_config({"worker": "127.0.0.1:1001"}), "must be a list"),
        (tf_config({"worker": ["127.0.0.1:1001", "127.0.0.1:1001"]}), "address twice"),
        (tf_config({**TWO, "chief": ["c:1", "d:2"]}, "chief"), "2 chiefs"),
        (tf_config(TWO, "evaluator"), "task type 'evaluator' is not among"),
        (tf_config(TWO, index=2), "index 2 is out of range.*indices 0 to 1"),
        (tf_config(TWO, index=-1), "index -1 is out of range"),
        (json.dumps({"cluster": TWO, "task": {"type": "worker", "index": "1"}}), "'1' is out"),
    ],
)
def test_malformed_tf_config_is_refused_with_what_to_fix(raw, message):
    with pytest.raises(ClusterConfigError, match=message):
        read_cluster(raw)


def test_tensorflow_errors_become_one_message_naming_the_worker():
    import tensorflow as tf

    three = read_cluster(tf_config({"worker": ["127.0.0.1:1001", "127.0.0.1:10012",
                                               "127.0.0.1:1003"]}, index=0))

    def explain(error_class, message):
        return cluster_error(error_class(None, None, message), three)

    silent = explain(tf.errors.UnavailableError, "Collective ops is aborted by: The following "
                     "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/"
                     "task:2\nThe tasks have crashed.")
    assert isinstance(silent, ClusterFailure)
    assert str(silent).startswith("worker 0 (127.0.0.1:1001): the cluster lost a worker (worker "
                                  "2 (127.0.0.1:1003) stopped sending heartbeats)")
    assert "Restart every worker with the same command" in str(silent)
    reset = explain(tf.errors.UnavailableError, "recvmsg:Connection reset by peer\nAdditional "
                    "GRPC error information from remote target /job:worker/replica:0/task:1 "
                    "while calling /tensorflow.WorkerService/RecvBuf")
    assert "(worker 1 (127.0.0.1:10012) is unreachable)" in str(reset)
    # An address is matched whole: 127.0.0.1:1001 (this worker) is not 127.0.0.1:10012.
    refused = explain(tf.errors.UnavailableError, "ipv4:127.0.0.1:10012: Connection refused")
    assert "(worker 1 (127.0.0.1:10012) is unreachable)" in str(refused)
    refusal = explain(tf.errors.InvalidArgumentError, "Barrier failed because: task is set to "
                      "ERROR: INVALID_ARGUMENT: [keras_transformer refusal] worker 2 (127.0.0.1:"
                      "1003) refused to train: --data x: no such folder [type.googleapis.com/x]")
    assert isinstance(refusal, PeerRefused)
    assert str(refusal) == "worker 2 (127.0.0.1:1003) refused to train: --data x: no such folder"
    assert explain(tf.errors.InvalidArgumentError, "Incompatible shapes: [2] vs. [3]") is None
    one = read_cluster("")
    assert cluster_error(tf.errors.UnavailableError(None, None, "down"), one) is None


# --- every stop agreed, between optimizer updates ----------------------------------------


class FakeModel:
    """What AgreedStop reads of a model: the stop flag and the accumulation state."""

    stop_training = False
    pending_micro_batches = 0


def agreed_stop(others_wish: list[bool]):
    """An AgreedStop on a FakeModel whose `agree` records this worker's votes and ORs them
    with the other worker's (`others_wish[0]`)."""
    votes: list[bool] = []

    def agree(wish: bool) -> bool:
        votes.append(wish)
        return wish or others_wish[0]

    stopper = StopAt(max_steps=10**9, max_seconds=60.0)
    callback = AgreedStop(agree, stopper)
    model = FakeModel()
    callback.set_model(model)
    return callback, model, votes, stopper


def test_a_stop_wished_between_micro_batches_waits_for_the_update_end():
    callback, model, votes, stopper = agreed_stop([False])
    model.pending_micro_batches, model.stop_training = 1, True  # e.g. TerminateOnNaN
    callback.on_train_batch_end(0)
    assert not model.stop_training and votes == []  # no vote, no stop mid-update
    model.pending_micro_batches = 0
    callback.on_train_batch_end(1)  # the update's last micro-batch: the wish is voted
    assert model.stop_training and votes == [True]
    callback.on_epoch_end(0)  # the interval's end votes again, still stopping
    assert model.stop_training and votes == [True, True] and stopper.reason == ""


def test_another_workers_stop_stops_this_one_with_the_reason():
    others_wish = [False]
    callback, model, votes, stopper = agreed_stop(others_wish)
    callback.on_train_batch_end(0)
    assert not model.stop_training and votes == [False]
    others_wish[0] = True
    callback.on_train_batch_end(1)
    assert model.stop_training and votes == [False, False]
    assert stopper.reason == "stopped with another worker (its --max-minutes or --max-steps)"


# --- clusters that cannot start: one error, bounded, nothing created -----------------------


def train_command(data: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "keras_transformer.train", "--data", str(data), "--src", "xx",
            "--tgt", "yy", "--preset", "tiny", "--vocab-size", "300", "--tokens-per-batch",
            "512", "--max-length", "32", "--beam", "1", "--out", str(out), *flags]


@pytest.fixture
def launch():
    """Starts processes (TF_CONFIG, flags) and kills every one still running at the end."""
    started: list[subprocess.Popen] = []

    def start(config: str, command: list[str], **extra: str) -> subprocess.Popen:
        env = cli_env(TF_CONFIG=config, **extra)
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # what a user sees: the command's own default
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate()


def error_lines(stderr: str) -> list[str]:
    """stderr without TensorFlow's C++ log lines (its start-up banners)."""
    return [line for line in stderr.splitlines()
            if line.strip() and not re.match(r"[IWE]\d{4} |WARNING: All log messages", line)]


@pytest.mark.slow
def test_a_cluster_that_cannot_start_fails_with_one_clear_error_in_bounded_time(
        tmp_path, launch, capsys, monkeypatch):
    data = write_toy_corpus(tmp_path / "corpus", pairs=40)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = free_ports(6)
    pair = [f"127.0.0.1:{port}" for port in ports[:2]]
    join = ["--join-timeout", "4"]
    cases = {
        # Worker 0 alone; the corpus is a tfds dataset that is not there: the strategy comes
        # first, so the error is the missing peer's, after --join-timeout.
        "peer never comes up": (
            tf_config({"worker": pair}, index=0),
            ["--data", "tfds:no_such_dataset_xyz", "--data-dir", str(tmp_path / "tfds")],
            r"^error: the cluster did not come up within 4 s \(--join-timeout\): worker 1 "
            rf"\(127\.0\.0\.1:{ports[1]}\) never started"),
        "chief never comes up": (
            tf_config({"worker": [f"127.0.0.1:{ports[2]}", f"127.0.0.1:{ports[3]}"]}, index=1),
            [], rf"^error: could not join the cluster within 4 s .* worker 0 \(127\.0\.0\.1:"
            rf"{ports[2]}\) did not answer"),
        "port in use": (
            tf_config({"worker": [f"127.0.0.1:{busy.getsockname()[1]}",
                                  f"127.0.0.1:{ports[4]}"]}, index=0),
            [], rf"^error: this task is worker 0 .* port {busy.getsockname()[1]} is already in "
            "use on this machine"),
    }
    # TF_CONFIG itself refused: the same command's `main` in this process (no cluster, no
    # TensorFlow start is needed to tell).
    refused_here = {
        "index out of range": (tf_config({"worker": pair}, index=2),
                               r"^error: TF_CONFIG task index 2 is out of range"),
        "malformed": ('{"cluster": {"worker": [', r"^error: TF_CONFIG is not valid JSON"),
    }
    started = time.monotonic()
    processes = {}
    for name, (config, flags, _) in cases.items():
        command = train_command(data, tmp_path / name.replace(" ", "-"), *join)
        if flags:  # another --data
            at = command.index("--data")
            command[at:at + 2] = flags
        processes[name] = launch(config, command)
    try:
        for name, (config, expected) in refused_here.items():
            monkeypatch.setenv("TF_CONFIG", config)
            refused = in_this_process(train_command(data, tmp_path / name.replace(" ", "-"),
                                                    *join), capsys)
            stdout, stderr = refused.stdout, refused.stderr
            lines = error_lines(stderr)
            assert refused.returncode == 2, (name, stdout[-2000:], stderr[-3000:])
            assert len(lines) == 1 and re.search(expected, lines[0]), (name, lines)
            assert not (tmp_path / name.replace(" ", "-")).exists(), name
        for name, (_, _, expected) in cases.items():
            stdout, stderr = processes[name].communicate(timeout=120)
            lines = error_lines(stderr)
            assert processes[name].returncode == 2, (name, stdout[-2000:], stderr[-3000:])
            assert len(lines) == 1 and re.search(expected, lines[0]), (name, lines)
            assert not (tmp_path / name.replace(" ", "-")).exists(), name
    finally:
        busy.close()
    # All ran side by side on 2 cores: TensorFlow's start, then at most the 4 s wait.
    assert time.monotonic() - started < 120


# --- two workers training --------------------------------------------------------------------


def two_workers(launch, data: Path, out: Path, flags: list[list[str]], ports: list[int],
                tmp_path: Path, scratch: str = "tmp") -> list[subprocess.Popen]:
    """Workers 0 and 1 with their flags; worker i's TMPDIR is tmp_path / f"{scratch}{i}"."""
    workers = [f"127.0.0.1:{port}" for port in ports]
    processes = []
    for index in range(2):
        folder = tmp_path / f"{scratch}{index}"
        folder.mkdir(exist_ok=True)
        processes.append(launch(tf_config({"worker": workers}, index=index),
                                train_command(data, out, *flags[index]), TMPDIR=str(folder)))
    return processes


def finish(processes: list[subprocess.Popen], timeout: float = 300) -> list[str]:
    """Each process's stdout + stderr, after asserting that it exited 0."""
    logs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0, (stdout[-3000:], stderr[-3000:])
        logs.append(stdout + stderr)
    return logs


@pytest.mark.slow
def test_two_workers_with_different_clocks_stop_together(tmp_path, launch):
    """--max-minutes runs out on worker 1 long before the chief: both stop at its step."""
    data = write_toy_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    common = ["--max-steps", "100000", "--checkpoint-every", "5", "--test-split", "none",
              "--no-export", "--precision", "float32"]
    processes = two_workers(launch, data, out, [common + ["--max-minutes", "10"],
                                                common + ["--max-minutes", "0.1"]],
                            free_ports(2), tmp_path)
    logs = finish(processes, timeout=240)
    results = json.loads((out / "results.json").read_text())
    assert results["workers"] == 2
    assert results["stop_reason"] == "stopped with another worker (its --max-minutes or --max-steps)"
    worker = re.search(r"worker 1 \(\S+\): trained to step (\d+) \((.*)\)", logs[1])
    assert worker, logs[1][-2000:]
    assert int(worker[1]) == results["steps"] > 0
    assert worker[2].startswith("used the --max-minutes budget (0.1 min)")
    # Only the chief prepared the data and trained the tokenizer; worker 1 read them.
    assert "preparing" in logs[0] and re.search(r"trained a \d+-piece \w+ tokenizer", logs[0])
    assert "preparing" not in logs[1] and "tokenizer on" not in logs[1], logs[1][-2000:]
    assert "waiting for the chief to prepare" in logs[1], logs[1][-2000:]
    # The final step's checkpoint is written (on or off the --checkpoint-every cadence).
    assert (out / "checkpoints" / f"ckpt-{results['steps']:08d}.weights.h5").is_file()


@pytest.mark.slow
def test_a_worker_with_other_settings_makes_every_worker_refuse_at_once(tmp_path, launch):
    data = write_toy_corpus(tmp_path / "corpus", pairs=100)
    out = tmp_path / "run"
    common = ["--max-steps", "5", "--precision", "float32", "--test-split", "none"]
    processes = two_workers(launch, data, out, [common + ["--checkpoint-every", "5"],
                                                common + ["--checkpoint-every", "4"]],
                            free_ports(2), tmp_path)
    lines = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 2, (stdout[-2000:], stderr[-3000:])
        assert "Traceback" not in stderr
        lines.append(error_lines(stderr)[-1])
    difference = (r"settings differ from the chief's \(worker 0 \(127\.0\.0\.1:\d+\)\): "
                  r"checkpoint_every 4 on worker 1 \(127\.0\.0\.1:\d+\), 5 on the chief; "
                  r"validate_every 4 on worker 1 .*, 5 on the chief\. Run the same command")
    assert re.match(r"error: worker 1 \(127\.0\.0\.1:\d+\) refused to train: " + difference,
                    lines[0]), lines[0]
    assert re.match("error: " + difference, lines[1]), lines[1]
    assert not out.exists()  # the chief's fresh run directory is gone


@pytest.mark.slow
def test_a_killed_worker_stops_the_other_in_bounded_time_and_a_restart_resumes(
        tmp_path, launch):
    data = write_toy_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    flags = ["--max-steps", "24", "--checkpoint-every", "4", "--tokens-per-step", "2048",
             # 2 workers x 2 accumulated micro-batches of 512 tokens, float16 loss scaling
             # from a scale that overflows the first updates (2^24: any gradient > 0.004)
             "--precision", "mixed_float16", "--initial-loss-scale", str(2.0**24),
             "--no-export"]
    ports = free_ports(2)
    processes = two_workers(launch, data, out, [flags, flags], ports, tmp_path)
    deadline = time.monotonic() + 180
    while newest_step(out / "backup") < 4:
        assert time.monotonic() < deadline and processes[0].poll() is None, "no backup"
        time.sleep(0.2)
    processes[1].kill()
    killed = time.monotonic()
    stdout, stderr = processes[0].communicate(timeout=LOST_WORKER_SECONDS + 60)
    waited = time.monotonic() - killed
    assert processes[0].returncode == 3, (stdout[-2000:], stderr[-3000:])
    assert waited <= LOST_WORKER_SECONDS, waited
    # One error, the last line (no traceback), naming the lost worker and what to do.
    last = error_lines(stderr)[-1]
    assert "Traceback" not in stderr and last.startswith("error: worker 0 (127.0.0.1:"), last
    assert "the cluster lost a worker (worker 1 (127.0.0.1:" in last, last
    assert "Restart every worker with the same command" in last
    assert not (out / "results.json").exists()
    backed_up = newest_step(out / "backup")
    assert 4 <= backed_up < 24

    # The same two commands again: the run resumes from the backup and finishes.
    logs = finish(two_workers(launch, data, out, [flags, flags], ports, tmp_path, "again"))
    assert f"resuming at step {backed_up}, until 24 steps" in logs[0]
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 24 and results["replicas"] == 2 and results["workers"] == 2
    # Skips agreed by both workers and kept across the restart: each one halved the scale
    # (it grows back only after 2,000 finite updates).
    skipped = results["skipped_updates"]
    assert results["precision"] == "mixed_float16" and 1 <= skipped < 24, skipped
    assert results["loss_scale"] == 2.0**24 / 2**skipped, (results["loss_scale"], skipped)
    budget = json.loads((out / "config.json").read_text())["step_budget"]
    assert budget == {"micro_batch": 512, "replicas": 2, "accumulate": 2, "tokens_per_step": 2048}
    # The last 5 (and those up to the best validation step, kept for averaging).
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*"))[-5:] == [
        f"ckpt-{step:08d}.weights.h5" for step in (8, 12, 16, 20, 24)]
    assert (out / "model.keras").is_file()
    # Only the chief wrote: the other worker's scratch folder is gone.
    assert not any((tmp_path / "again1").iterdir()), list((tmp_path / "again1").iterdir())
    assert "BLEU" in logs[0] and "BLEU" not in logs[1]
    assert "worker 1 (127.0.0.1:" in logs[1] and "trained to step 24" in logs[1]
