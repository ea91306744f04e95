"""A SIGKILL in the middle of writing each kind of file a run writes leaves a run that the
same command resumes (issue 27): one run killed at each write in turn, then finished."""

from __future__ import annotations

import signal

from tests.cli.test_train import write_toy_corpus
from tests.training.test_damaged_runs import (
    _assert_finished,
    _command,
    _output,
    fault_at_a_write,
)
from tests.training.test_resume import in_this_process

# Each kind of file a run writes, by its writer and its moment in the run, in the order a
# run writes them, with what the run killed there must have said first (how it resumed
# from the kill before): the run's config (a fresh run's first file: the run directory then
# holds only its temporary); a prepared shard, inside the prepared data's staging folder
# (the manifest and the tokenizer's files go the same way, renamed with it); a periodic
# checkpoint (best.weights.h5 has the same writer; killed at step 10, before any backup:
# the next run has nothing to resume); the backup's weights of step 20 (the 2nd in that
# run); its state.json of step 30 (the 2nd in a run resumed at 10). model.keras and
# results.json, written at the end by the same `pipelines.storage.replacing`, are redone by
# the same command while no results.json exists (tests/pipelines/test_storage.py has the
# writer's own kill-safety).
WRITES = [("config.json", 1, None), ("shard-", 1, None), ("ckpt-", 1, None),
          ("model_and_optimizer", 2, None),
          ("state.json", 2, "resuming at step 10, until 30 steps")]


def test_sigkill_while_writing_each_kind_of_file_leaves_a_run_that_resumes(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    command = _command(data, out)
    for pattern, nth, resumed in WRITES:
        killed = fault_at_a_write(command, "kill", pattern, nth)
        output = _output(killed)
        assert killed.returncode == -signal.SIGKILL, (pattern, output[-3000:])
        assert "Traceback" not in output and "damaged" not in output, output[-3000:]
        if resumed is not None:
            assert resumed in output, (pattern, output[-3000:])
    # The killed runs need processes of their own; the one that finishes does not.
    finished = in_this_process(command, capsys)
    _assert_finished(finished, out)
    assert "resuming at step 20, until 30 steps" in _output(finished)
