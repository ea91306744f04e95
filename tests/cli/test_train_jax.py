"""`train --backend jax`, checked on CPU: from a folder prepared here, a JAX run where
TensorFlow is installed finishes itself under TensorFlow; the same run in processes that
cannot import TensorFlow (as on the GPU machines), SIGKILLed mid-update and resumed, ends
with the very same weights (dropout's random state included), and the line it ends with is
the command that finishes it under TensorFlow.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from keras_transformer.flags import parse_train_args
from keras_transformer.prepare import main as prepare_main
from keras_transformer.training.backup import newest_step
from keras_transformer.training.config import config_from_flags
from tests.cli.test_train import REPO, cli_env, write_toy_corpus
from tests.training.test_resume import KILLED_AFTER_A_MICRO_BATCH

pytestmark = pytest.mark.slow

# The train command in a process where TensorFlow (and the tokenizer libraries) cannot be
# imported, as on the GPU machines: any import of them fails the run. It SIGKILLs itself after
# its KILL_AT-th micro-batch (test_resume's callback; KILL_AT=0: never).
WITHOUT_TENSORFLOW = textwrap.dedent(
    """
    import os, sys

    class NoTensorFlow:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tensorflow", "tensorflow_text", "tensorflow_datasets",
                                      "sentencepiece"):
                raise ImportError(f"{name} is blocked: this test's machine has no TensorFlow")

    sys.meta_path.insert(0, NoTensorFlow())
    os.environ["KERAS_BACKEND"] = "jax"  # as --backend jax would: the callback loads Keras
    """
) + KILLED_AFTER_A_MICRO_BATCH


STEPS, EVERY, ACCUMULATE = 4, 2, 2
# Sentences of 2 or 3 words: their micro-batches take 3 of the XLA bucket shapes (the default
# 3 to 8 words take 6), and every process compiles a step for each shape it meets.
SENTENCE_WORDS = (2, 3)


def _train(data, prepared, out, with_tensorflow: bool = False, kill_at: int = 0,
           extra: tuple[str, ...] = ()):
    flags = ["--backend", "jax", "--data", str(data), "--src", "xx", "--tgt", "yy",
             "--prepared", str(prepared), "--preset", "tiny", "--vocab-size", "300",
             "--max-length", "32", "--tokens-per-batch", "256", "--accumulate",
             str(ACCUMULATE), "--dropout", "0.3", "--precision", "float32",
             "--max-steps", str(STEPS), "--checkpoint-every", str(EVERY), "--average-last", "2",
             "--warmup-steps", "4", "--beam", "1", "--no-export", "--out", str(out), *extra]
    python = ["-m", "keras_transformer.train"] if with_tensorflow else ["-c", WITHOUT_TENSORFLOW]
    # Every run here compiles with the same flags (the suite's XLA_FLAGS: tests/conftest.py),
    # so the weights still match bit for bit.
    return subprocess.run([sys.executable, *python, *flags], cwd=REPO,
                          env=cli_env(JAX_PLATFORMS="cpu", KILL_AT=str(kill_at)),
                          capture_output=True, text=True, timeout=600)


def _weights(path) -> dict[str, np.ndarray]:
    found = {}

    def read(name, item) -> None:  # (visititems stops at the first non-None return)
        if isinstance(item, h5py.Dataset):
            found[name] = item[()]

    with h5py.File(path, "r") as file:
        file.visititems(read)
    return found


def test_jax_trains_without_tensorflow_resumes_exactly_and_names_its_finishing_command(
        tmp_path):
    data = write_toy_corpus(tmp_path / "corpus", sentence_words=SENTENCE_WORDS)
    prepared = tmp_path / "prepared"  # here, where TensorFlow is: the runs below read it
    assert prepare_main(["--data", str(data), "--src", "xx", "--tgt", "yy", "--vocab-size",
                         "300", "--max-length", "32", "--out", str(prepared)]) == 0
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"

    # Without TensorFlow, a folder prepared with other settings is refused as under
    # TensorFlow, before the run directory is made (ids past the model's vocabulary).
    refused = _train(data, prepared, tmp_path / "refused", extra=("--vocab-size", "400"))
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert "vocab_size: prepared with 300, wanted 400" in refused.stderr + refused.stdout
    assert not (tmp_path / "refused").exists()

    # Where TensorFlow is installed, the JAX run finishes itself under TensorFlow.
    uninterrupted = _train(data, prepared, reference, with_tensorflow=True)
    assert uninterrupted.returncode == 0, (uninterrupted.stdout[-3000:]
                                           + uninterrupted.stderr[-3000:])
    log = uninterrupted.stdout
    assert "Keras on JAX" in log and f"until {STEPS} steps" in log
    assert "averaging, scoring and exporting under TensorFlow" in log
    expected_results = json.loads((reference / "results.json").read_text())
    assert expected_results["steps"] == STEPS and "tok:13a" in expected_results["bleu_signature"]
    assert json.loads((reference / "config.json").read_text())["backend"] == "jax"

    # Without TensorFlow: killed after update 3 and the first micro-batch of update 4 (the
    # last backup is at 2), then resumed.
    victim = _train(data, prepared, resumed, kill_at=ACCUMULATE * (EVERY + 1) + 1)
    assert victim.returncode == -signal.SIGKILL, victim.stdout[-2000:] + victim.stderr[-3000:]
    assert newest_step(resumed / "backup") == EVERY
    finished = _train(data, prepared, resumed)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    assert f"resuming at step {EVERY}, until {STEPS} steps" in finished.stdout
    # The same weights, bit for bit: data position, optimizer state and dropout's seeds
    # restored (and the same as with TensorFlow installed: the same numpy batches).
    last = f"checkpoints/ckpt-{STEPS:08d}.weights.h5"
    expected, actual = _weights(reference / last), _weights(resumed / last)
    assert expected.keys() == actual.keys() and len(expected) > 10
    assert all(np.array_equal(expected[name], actual[name]) for name in expected)
    assert (resumed / "model.keras").is_file() and not (resumed / "results.json").exists()

    # It ended by naming the command that finishes it where TensorFlow is: the run's own
    # settings with --backend tensorflow and the steps trained (the same function built the
    # command that finished the reference run above, under TensorFlow).
    finish = [line for line in finished.stdout.splitlines() if line.startswith("python -m ")]
    assert len(finish) == 1, finished.stdout[-3000:]
    command = shlex.split(finish[0])
    assert command[:3] == ["python", "-m", "keras_transformer.train"]
    settings, _ = parse_train_args(command[3:])
    recorded = config_from_flags(json.loads((resumed / "config.json").read_text())["arguments"])
    assert settings.optimization.backend == "tensorflow"
    assert settings.optimization.max_steps == STEPS and not settings.output.overwrite
    changed = {"backend", "precision", "jit_compile"}
    assert {name: value for name, value in settings.flags().items() if name not in changed} == {
        name: value for name, value in recorded.flags().items() if name not in changed}
