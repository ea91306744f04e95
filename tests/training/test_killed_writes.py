"""A SIGKILL in the middle of writing each kind of file a run writes leaves a run that the
same command resumes (issue 27): one run killed at each write in turn, then finished."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from tests.cli.test_train import REPO, cli_env, write_toy_corpus
from tests.training.test_damaged_runs import _assert_finished, _command, _output, _run

# The train command, SIGKILLed in the middle of writing the file whose path contains KILL_AT
# (its KILL_NTH time): half the file is on disk under its temporary name.
KILLED_DURING_A_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from pipelines import storage
    from keras_transformer.train import main

    seen = 0
    original = storage.sync_file

    def sync_file(path):
        global seen
        if os.environ["KILL_AT"] in str(path):
            seen += 1
            if seen == int(os.environ["KILL_NTH"]):
                os.truncate(path, os.path.getsize(path) // 2)
                os.kill(os.getpid(), signal.SIGKILL)
        original(path)

    storage.sync_file = sync_file
    sys.exit(main(sys.argv[1:]))
    """
)

# Each kind of file a run writes, by its writer and its moment in the run, in the order a
# run writes them, with what the run killed there must have said first (how it resumed
# from the kill before): the run's config (a fresh run's first file); a prepared shard,
# inside the prepared data's staging folder (the manifest and the tokenizer's files go the
# same way, renamed with it); a periodic checkpoint (best.weights.h5 has the same writer;
# killed at step 10, before any backup: the next run has nothing to resume); the backup's
# weights of step 20 (the 2nd in that run); its state.json of step 30 (the 2nd in a run
# resumed at 10); model.keras at the end (results.json has config.json's writer).
WRITES = [("config.json", 1, None), ("shard-", 1, None), ("ckpt-", 1, None),
          ("model_and_optimizer", 2, None),
          ("state.json", 2, "resuming at step 10, until 30 steps"),
          ("model.keras", 1, "resuming at step 20, until 30 steps")]


def test_sigkill_while_writing_each_kind_of_file_leaves_a_run_that_resumes(tmp_path):
    data = write_toy_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    command = _command(data, out)
    for pattern, nth, resumed in WRITES:
        killed = subprocess.run([sys.executable, "-c", KILLED_DURING_A_WRITE, *command[3:]],
                                cwd=REPO, capture_output=True, text=True, timeout=300,
                                env=cli_env(KILL_AT=pattern, KILL_NTH=str(nth)))
        output = _output(killed)
        assert killed.returncode == -signal.SIGKILL, (pattern, output[-3000:])
        assert "Traceback" not in output and "damaged" not in output, output[-3000:]
        if resumed is not None:
            assert resumed in output, (pattern, output[-3000:])
    finished = _run(command)
    _assert_finished(finished, out)
    assert "resuming at step 30, until 30 steps" in _output(finished)
