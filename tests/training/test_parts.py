"""Pieces of training: checkpoint averaging (numerically), precision choice, the token
counter, the step/time limit, the global-token loss on one device, strategy selection."""

from __future__ import annotations

import json

import numpy as np
import pytest

from keras_transformer import run_directory
from keras_transformer.averaging import main as averaging_main
from keras_transformer.errors import UsageError
from keras_transformer.model.transformer import build_transformer
from keras_transformer.training.callbacks import StopAt, TokenCount, save_model_weights
from keras_transformer.training.checkpoints import (
    average_weight_files,
    averaging_windows,
    checkpoint_path,
    list_checkpoints,
    steps_to_keep,
)
from keras_transformer.training.config import BatchConfig
from keras_transformer.training.losses import GlobalTokenCrossEntropy, LabelSmoothedCrossEntropy
from keras_transformer.training.precision import resolve_jit, resolve_precision


def _model_with_constant_weights(value: float):
    model = build_transformer("tiny", vocab_size=20)
    model.set_weights([np.full(w.shape, value, w.dtype) for w in model.get_weights()])
    return model


def test_average_of_weight_files_is_the_elementwise_mean(tmp_path):
    rng = np.random.default_rng(0)
    model = build_transformer("tiny", vocab_size=20)
    versions = []
    for step in (1, 2, 3):
        weights = [rng.normal(size=w.shape).astype("float32") for w in model.get_weights()]
        model.set_weights(weights)
        save_model_weights(model, checkpoint_path(tmp_path, step))
        versions.append(weights)
    paths = [path for _, path in list_checkpoints(tmp_path)]
    average_weight_files(paths[-2:], tmp_path / "avg.weights.h5")
    model.load_weights(tmp_path / "avg.weights.h5")
    for got, second, third in zip(model.get_weights(), versions[1], versions[2], strict=True):
        np.testing.assert_allclose(got, (second + third) / 2, rtol=1e-6, atol=1e-7)


def test_averaging_command_writes_model_keras_from_the_last_n(tmp_path):
    config = {"model": {"preset": "tiny", "vocab_size": 20}}
    run_directory.write_json_atomic(tmp_path / run_directory.CONFIG_FILE, config)
    checkpoints = tmp_path / run_directory.CHECKPOINT_DIR
    checkpoints.mkdir()
    for step, value in ((100, 50.0), (200, 1.0), (300, 2.0), (400, 6.0)):
        save_model_weights(_model_with_constant_weights(value), checkpoint_path(checkpoints, step))
    assert averaging_main(["--run", str(tmp_path), "--last", "3"]) == 0
    import keras

    model = keras.models.load_model(tmp_path / run_directory.MODEL_FILE, compile=False)
    for weights in model.get_weights():
        np.testing.assert_allclose(weights, 3.0)  # mean of 1, 2, 6 (not the step-100 one)


def test_averaging_refuses_different_architectures(tmp_path):
    save_model_weights(build_transformer("tiny", vocab_size=20), tmp_path / "a.weights.h5")
    save_model_weights(build_transformer("tiny", vocab_size=30), tmp_path / "b.weights.h5")
    with pytest.raises(ValueError, match="different"):
        average_weight_files([tmp_path / "a.weights.h5", tmp_path / "b.weights.h5"],
                             tmp_path / "avg.weights.h5")


@pytest.mark.parametrize(
    ("flags", "gpus", "choice", "expected"),
    [
        ("fpu avx512f avx512_bf16 amx_tile", [], "auto", "mixed_bfloat16"),
        ("fpu avx2 amx_bf16", [], "auto", "mixed_bfloat16"),
        ("fpu avx2 avx512f", [], "auto", "float32"),
        ("fpu avx2", [(7, 0), (7, 0)], "auto", "mixed_float16"),  # V100: float16 + loss scaling
        ("fpu avx2", [(8, 0)], "auto", "mixed_bfloat16"),  # A100
        ("fpu avx2", [(9, 0)] * 8, "auto", "mixed_bfloat16"),  # H100
        ("fpu avx2", [(8, 6), (7, 5)], "auto", "mixed_float16"),  # mixed: the older decides
        ("fpu avx512_bf16", [], "float32", "float32"),
        ("fpu avx2", [(9, 0)], "mixed_float16", "mixed_float16"),
    ],
)
def test_precision_auto_follows_the_hardware(tmp_path, flags, gpus, choice, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert resolve_precision(choice, gpus, cpuinfo) == expected
    assert resolve_precision("auto", [], tmp_path / "missing") == "float32"


def test_jit_auto_is_on_with_gpus_and_off_on_cpus():
    assert resolve_jit("auto", 0) is False and resolve_jit("auto", 8) is True
    assert resolve_jit("on", 0) is True and resolve_jit("off", 8) is False
    with pytest.raises(ValueError):
        resolve_jit("maybe", 0)


def test_token_count_and_global_loss_on_one_device():
    labels = np.array([[5, 6, 0, 0], [7, 0, 0, 0]], "int32")
    logits = np.random.default_rng(0).normal(size=(2, 4, 10)).astype("float32")
    counter = TokenCount()
    counter.update_state(labels, logits)
    counter.update_state(labels, logits)
    assert float(counter.result()) == 6.0
    # Outside a multi-replica context the global-token loss is the ordinary masked mean.
    np.testing.assert_allclose(float(GlobalTokenCrossEntropy(0.1)(labels, logits)),
                               float(LabelSmoothedCrossEntropy(0.1)(labels, logits)), rtol=1e-6)


def test_stop_at_max_steps_and_time_budget():
    class _Model:
        stop_training = False

        class optimizer:  # noqa: N801
            class iterations:  # noqa: N801
                value = 0

                @classmethod
                def numpy(cls):
                    return cls.value

    stopper = StopAt(max_steps=5, max_seconds=None)
    stopper.set_model(_Model)
    _Model.optimizer.iterations.value = 4
    stopper.on_train_batch_end(0)
    assert not _Model.stop_training
    _Model.optimizer.iterations.value = 5
    stopper.on_train_batch_end(0)
    assert _Model.stop_training and "step limit 5" in stopper.reason
    _Model.stop_training = False
    budget = StopAt(max_steps=100, max_seconds=60, elapsed_before=61)  # resumed, budget used
    budget.set_model(_Model)
    budget.on_train_begin()
    budget.on_train_batch_end(0)
    assert _Model.stop_training and "max-minutes" in budget.reason


def _compiled_tiny_model():
    """A tiny model compiled with the paper's Adam, its optimizer state built (saveable)."""
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    model = build_trainer("tiny", vocab_size=20)
    model.compile(paper_adam(32, 10), loss=LabelSmoothedCrossEntropy())
    model.optimizer.build(model.trainable_variables)
    return model


def test_checkpointer_keeps_the_newest_the_best_and_stops_early(tmp_path):
    from keras_transformer.training.callbacks import RunCheckpointer

    model = _compiled_tiny_model()
    stopper = StopAt(max_steps=1000, max_seconds=None)
    checkpointer = RunCheckpointer(tmp_path / "ckpt", tmp_path / "backup", checkpoint_every=10,
                                   keep=2, patience=2, stopper=stopper)
    checkpointer.set_model(model)
    for epoch, val_loss in enumerate([5.0, 4.0, 4.5, 4.2]):
        model.optimizer.iterations.assign((epoch + 1) * 10)
        checkpointer.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val_loss})
    # The newest 2, and those up to and around the best step (20), for averaging.
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [10, 20, 30, 40]
    assert (tmp_path / "ckpt" / "best.weights.h5").is_file()
    assert checkpointer.best_step == 20 and model.stop_training
    assert "early stopping" in stopper.reason
    state = json.loads((tmp_path / "backup" / "state.json").read_text())
    assert state["step"] == 40 and state["best_val_loss"] == 4.0 and state["stopped_early"]
    # NaN losses are never checkpointed.
    model.stop_training = False
    model.optimizer.iterations.assign(50)
    checkpointer.on_epoch_end(4, {"loss": float("nan")})
    assert checkpointer.diverged and not checkpoint_path(tmp_path / "ckpt", 50).exists()


@pytest.mark.parametrize("killed_after", ["state.next.json", "latest.weights.h5"])
def test_a_backup_killed_between_its_files_still_pairs_weights_and_state(
        tmp_path, monkeypatch, killed_after):
    from keras_transformer.training import callbacks

    model = _compiled_tiny_model()
    backup = tmp_path / "backup"
    backup.mkdir()
    model.optimizer.iterations.assign(10)
    callbacks.write_backup(model, backup, {"step": 10, "best_step": 10})

    # The next backup (step 20) is killed right after writing `killed_after`.
    class Killed(Exception):
        pass

    def dies_after(write):
        def wrapped(*args):
            write(*args)
            raise Killed

        return wrapped

    if killed_after == "state.next.json":
        monkeypatch.setattr(callbacks.run_directory, "write_json_atomic",
                            dies_after(run_directory.write_json_atomic))
    else:
        monkeypatch.setattr(callbacks, "save_training_state",
                            dies_after(callbacks.save_training_state))
    model.optimizer.iterations.assign(20)
    with pytest.raises(Killed):
        callbacks.write_backup(model, backup, {"step": 20, "best_step": 20})
    monkeypatch.undo()

    restored = _compiled_tiny_model()
    restored.load_weights(backup / "latest.weights.h5")
    step = int(restored.optimizer.iterations.numpy())
    assert step == (10 if killed_after == "state.next.json" else 20)
    assert callbacks.read_backup_state(backup, step) == {"step": step, "best_step": step}
    assert callbacks.read_backup_state(backup, 30) is None


def test_averaging_windows_follow_the_best_step():
    steps = list(range(100, 1100, 100))
    # Best at the end: only the last 5.
    assert averaging_windows(steps, 1000, 5) == {"last": [600, 700, 800, 900, 1000]}
    # Best earlier (an early-stopped or overfitting run): also up to it, and around it.
    assert averaging_windows(steps, 400, 5) == {
        "last": [600, 700, 800, 900, 1000], "up to the best step": [100, 200, 300, 400],
        "around the best step": [200, 300, 400, 500, 600]}
    assert averaging_windows(steps, None, 3) == {"last": [800, 900, 1000]}
    # A run keeps what every window needs, and only that.
    assert steps_to_keep(steps, 400, 2) == {300, 400, 900, 1000}


@pytest.mark.parametrize(
    ("flags", "replicas", "expected"),
    [
        # The paper's step on 1, 2 and 8 devices with the same flags: ~25,000 tokens.
        (dict(tokens_per_step=25000), 1, (3571, 7, 24997)),
        (dict(tokens_per_step=25000), 2, (3125, 4, 25000)),
        (dict(tokens_per_step=25000), 8, (3125, 1, 25000)),
        (dict(accumulate=4), 2, (4096, 4, 32768)),
        (dict(), 8, (4096, 1, 32768)),
    ],
)
def test_step_budget_spreads_a_step_over_replicas_and_micro_batches(flags, replicas, expected):
    batches = BatchConfig(**{"tokens_per_batch": 4096, "tokens_per_step": None,
                             "accumulate": None, **flags})
    budget = batches.budget(replicas, max_length=128)
    assert (budget.micro_batch, budget.accumulate, budget.tokens_per_step) == expected
    assert budget.replicas == replicas
    assert budget.global_micro_batch == budget.micro_batch * replicas


def test_step_budget_refuses_micro_batches_below_max_length_naming_the_smallest_step():
    batches = BatchConfig(tokens_per_batch=4096, tokens_per_step=200, accumulate=None)
    with pytest.raises(UsageError, match="from 200 up on 2 replica.s. is 256"):
        batches.budget(2, max_length=128)
    batches.tokens_per_step = 256
    assert batches.budget(2, max_length=128).micro_batch == 128


def test_a_run_started_with_a_global_tokens_per_batch_on_replicas_is_not_resumed(tmp_path):
    from keras_transformer.training.run_data import check_resumed_data

    prepared = {"directory": "p", "corpus_fingerprint": "f", "shards": 1}
    (tmp_path / "config.json").write_text(json.dumps({"replicas": 2, "prepared": prepared}))
    with pytest.raises(UsageError, match="global budget"):
        check_resumed_data(tmp_path, {"replicas": 2, "prepared": prepared})
    (tmp_path / "config.json").write_text(json.dumps({"replicas": 1, "prepared": prepared}))
    check_resumed_data(tmp_path, {"replicas": 1, "prepared": prepared})


def test_a_run_is_not_resumed_in_another_precision_or_xla_mode(tmp_path):
    from keras_transformer.training.run_data import check_resumed_data

    prepared = {"directory": "p", "corpus_fingerprint": "f", "shards": 1}
    recorded = {"replicas": 1, "prepared": prepared, "step_budget": {}, "jit_compile": False,
                "precision": "mixed_float16"}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(UsageError, match="--precision mixed_float16"):
        check_resumed_data(tmp_path, {**recorded, "precision": "mixed_bfloat16"})
    with pytest.raises(UsageError, match="--jit-compile off"):
        check_resumed_data(tmp_path, {**recorded, "jit_compile": True})
    check_resumed_data(tmp_path, recorded)


def test_final_weights_follow_the_best_step_of_an_overfitting_run(tmp_path):
    """Checkpoints whose weights are all `step / 100`; the validation loss is lowest at
    weights 0.4 (the best step, 400), as in a run that overfits after step 400."""
    from keras_transformer.training.final_weights import choose_final_weights

    model = _model_with_constant_weights(0.0)
    for step in range(100, 1100, 100):
        save_model_weights(_model_with_constant_weights(step / 100), checkpoint_path(tmp_path, step))
    save_model_weights(_model_with_constant_weights(4.0), tmp_path / "best.weights.h5")

    def val_loss(candidate):
        return abs(float(candidate.get_weights()[0].flat[0]) - 4.0)

    choice = choose_final_weights(model, tmp_path, best_step=400, count=3, val_loss=val_loss)
    # The 3 around step 400 average to exactly 4.0, as good as the best checkpoint: an
    # average wins the tie; the last 3 (8, 9, 10) lose.
    assert choice["chosen"] == "around the best step" and choice["steps"] == [300, 400, 500]
    assert {c["name"]: c["val_loss"] for c in choice["candidates"]} == pytest.approx({
        "last": 5.0, "up to the best step": 1.0, "around the best step": 0.0,
        "best checkpoint": 0.0})
    assert "before the last checkpoints" in choice["reason"]
    np.testing.assert_allclose(model.get_weights()[0], 4.0)
    assert sorted(p.name for p in tmp_path.glob("averaged*")) == []  # temporaries removed
    # A run whose best step is its last: only the last checkpoints (and the best) compete.
    choice = choose_final_weights(model, tmp_path, best_step=1000, count=3, val_loss=val_loss)
    assert [c["name"] for c in choice["candidates"]] == ["last", "best checkpoint"]
