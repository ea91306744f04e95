"""The path a GPU user takes, exercised on CPU with the same code: mixed_float16 with dynamic
loss scaling (skipped updates still count as steps; all replicas skip together), float16-safe
masks, XLA-compiled steps on bounded batch shapes, and the TensorFlow-ops path (fused CPU
kernels off), through the train command."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.cli.test_train import REPO, cli_env, write_toy_corpus

TF_OPS = {"KERAS_TRANSFORMER_FUSED_KERNELS": "off"}
TOY = ["--src", "xx", "--tgt", "yy", "--preset", "tiny", "--vocab-size", "300",
       "--tokens-per-batch", "512", "--max-length", "32"]

# Two logical CPUs under MirroredStrategy; replica `bad` gets an infinite gradient. Keras'
# own LossScaleOptimizer takes the first replica's verdict for all (its gradients are not
# yet all-reduced when it checks them), ours skips the update on every replica.
SKIPS = textwrap.dedent(
    """
    import json
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from keras_transformer.training.loss_scaling import LossScaleOptimizer

    found = {}
    for name, cls in (("keras", keras.optimizers.LossScaleOptimizer),
                      ("ours", LossScaleOptimizer)):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            weights = keras.Variable(np.ones(3, "float32"))
            optimizer = cls(keras.optimizers.SGD(0.1))
            optimizer.build([weights])

        @tf.function
        def step(bad):
            def replica_step():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                gradient = tf.where(tf.equal(replica, bad), tf.fill([3], np.inf), tf.ones([3]))
                optimizer.apply([gradient * optimizer.dynamic_scale], [weights])
            strategy.run(replica_step)

        for bad in (1, 0, -1):  # an overflow on replica 1, then on replica 0, then none
            step(tf.constant(bad))
        found[name] = {"weights": [float(w) for w in weights.numpy()],
                       "steps": int(optimizer.iterations.numpy()),
                       "scale": float(optimizer.dynamic_scale.numpy()),
                       "skipped": int(optimizer.skipped_updates.numpy())
                       if name == "ours" else None}
    print(json.dumps(found))
    """
)


def test_an_overflow_on_any_replica_skips_the_update_everywhere_and_still_counts():
    result = subprocess.run([sys.executable, "-c", SKIPS], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    ours = found["ours"]
    # Two skipped updates, one applied: 1 - 0.1 * (1 + 1) (gradients summed over replicas).
    assert ours["weights"] == pytest.approx([0.8] * 3)
    assert ours["steps"] == 3 and ours["skipped"] == 2
    assert ours["scale"] == 2.0**15 / 4
    # Keras' own lets replica 1's inf through (the test can tell).
    assert not np.all(np.isfinite(found["keras"]["weights"]))


# One process per worker (TF_CONFIG), one replica each; worker `bad` gets an infinite gradient.
# Both must skip that update together: a worker that applied it would wait forever in the
# update's all-reduce for the other.
WORKER_SKIPS = textwrap.dedent(
    """
    import json, os
    import numpy as np
    import tensorflow as tf
    from keras_transformer.cluster.strategy import select_strategy
    strategy = select_strategy()
    import keras
    from keras_transformer.training.loss_scaling import LossScaleOptimizer

    with strategy.scope():
        weights = keras.Variable(np.ones(3, "float32"))
        optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
        optimizer.build([weights])
    me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]

    @tf.function
    def step(bad):
        def replica_step():
            gradient = tf.fill([3], np.inf) if bad == me else tf.ones([3])
            optimizer.apply([gradient * optimizer.dynamic_scale], [weights])
        strategy.run(replica_step)

    for bad in (1, 0, -1):
        step(bad)
    print(json.dumps({"weights": [float(w) for w in weights.numpy()],
                      "steps": int(optimizer.iterations.numpy()),
                      "skipped": int(optimizer.skipped_updates.numpy())}))
    """
)


@pytest.mark.slow
def test_workers_skip_an_overflow_on_either_of_them_together(tmp_path):
    from tests.cluster.test_workers import run_on_two_workers

    for output in run_on_two_workers(WORKER_SKIPS, timeout=180):
        found = json.loads(output.strip().splitlines()[-1])
        assert found == {"weights": pytest.approx([0.8] * 3), "steps": 3, "skipped": 2}


def test_a_float16_model_compiles_with_the_step_counting_loss_scaling():
    from keras_transformer.training.loss_scaling import LossScaleOptimizer
    from keras_transformer.training.losses import LabelSmoothedCrossEntropy
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    model = build_trainer("tiny", vocab_size=40, dtype="mixed_float16")
    model.compile(paper_adam(32), loss=LabelSmoothedCrossEntropy(0.1), accumulate_steps=2)
    assert isinstance(model.optimizer, LossScaleOptimizer)
    own = LossScaleOptimizer(paper_adam(32), initial_scale=8.0)
    model.compile(optimizer=own, loss=LabelSmoothedCrossEntropy(0.1))
    assert model.optimizer is own


def test_masks_stay_finite_in_float16():
    import keras

    from keras_transformer.layers.attention import MultiHeadAttention

    layer = MultiHeadAttention(8, 2, dtype="mixed_float16")
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")
    mask = np.zeros((2, 3, 3), bool)
    mask[0, :, :2] = True  # row 0: two keys visible; row 1: none (a padding-only sentence)
    output = keras.ops.convert_to_numpy(layer(x, x, attention_mask=mask))
    assert output.dtype == np.float16 and np.all(np.isfinite(output))


def _command(data, out, *flags) -> list[str]:
    return [sys.executable, "-m", "keras_transformer.train", "--data", str(data), *TOY,
            "--out", str(out), *flags]


@pytest.fixture
def train_on_tf_ops(capsys, monkeypatch):
    """Runs a train command's `main` in this process (what `python -m` runs, without starting
    TensorFlow again) on the TF ops path: the fused kernels' switch is read at each run."""
    from tests.training.test_resume import in_this_process

    for name, value in TF_OPS.items():
        monkeypatch.setenv(name, value)
    return lambda command: in_this_process(command, capsys)


@pytest.mark.slow
def test_mixed_float16_with_forced_overflow_keeps_the_step_cadence_resumes_and_exports(
        tmp_path, train_on_tf_ops):
    import tensorflow as tf
    import tensorflow_text  # noqa: F401 (registers the SavedModel's tokenizer ops)

    # Both runs in this process.
    data = write_toy_corpus(tmp_path / "corpus")
    out, export = tmp_path / "run", tmp_path / "export"
    # A loss scale of 2^100 overflows float16 for ~85 halvings: every update here is skipped.
    # No test split: nothing here checks a test decode (the export is checked).
    flags = ["--precision", "mixed_float16", "--initial-loss-scale", str(2.0**100),
             "--checkpoint-every", "2", "--average-last", "3", "--beam", "1",
             "--test-split", "none", "--export-dir", str(export)]
    first = train_on_tf_ops(_command(data, out, *flags, "--max-steps", "4", "--no-export"))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    # The same run, allowed further: resumed from its backup at step 4.
    (out / "results.json").unlink()
    second = train_on_tf_ops(_command(data, out, *flags, "--max-steps", "6"))
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resuming at step 4, until 6 steps" in second.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 6 and results["skipped_updates"] == 6
    assert results["loss_scale"] == 2.0**94
    assert (results["precision"], results["fused_kernels"], results["jit_compile"]) == (
        "mixed_float16", False, False)
    assert results["replicas"] == 1 and results["workers"] == 1
    # Checkpoints every 2 batches although no update was applied.
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*")) == [
        "ckpt-00000002.weights.h5", "ckpt-00000004.weights.h5", "ckpt-00000006.weights.h5"]
    assert results["averaged_steps"] == [2, 4, 6]
    exported = tf.saved_model.load(results["export"])  # kept: it owns the variables
    assert {v.dtype for v in exported.signatures["serving_default"].variables} == {tf.float32}


@pytest.mark.slow
def test_xla_with_float16_loss_scaling_on_the_tf_ops_path_trains_on_bounded_batch_shapes(
        tmp_path, train_on_tf_ops):
    # What `auto` picks on a V100 or T4: mixed_float16 with loss scaling, XLA, TF ops. The
    # scale starts high enough (2^24) that the first updates overflow and are skipped. Short
    # sentences: their batches come in 2 shapes, and each shape costs an XLA compile.
    data = write_toy_corpus(tmp_path / "corpus", pairs=120, sentence_words=(3, 4))
    out = tmp_path / "run"
    result = train_on_tf_ops(_command(
        data, out, "--jit-compile", "on", "--precision", "mixed_float16",
        "--initial-loss-scale", str(2.0**24), "--max-steps", "4", "--checkpoint-every", "2",
        "--test-split", "none", "--no-export"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert results["steps"] == 4 and results["jit_compile"] is True
    assert (results["precision"], results["fused_kernels"]) == ("mixed_float16", False)
    skipped = results["skipped_updates"]
    assert 1 <= skipped <= 4 and results["loss_scale"] == 2.0**24 / 2**skipped, results
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*")) == [
        "ckpt-00000002.weights.h5", "ckpt-00000004.weights.h5"]
    # max_length 32: buckets of 4, 8, ..., 32 positions, one shape each at most.
    assert 1 <= config["train_batch_shapes"] <= 8
    assert f"come in {config['train_batch_shapes']} shapes" in result.stdout
