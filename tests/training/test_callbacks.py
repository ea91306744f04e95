"""Training callbacks: the token counter, the step/time limit, the checkpointer (newest, best,
early stopping) and the crash-safe backup."""

from __future__ import annotations

import csv
import json

import numpy as np

from keras_transformer.training.callbacks import MetricsLog, StopAt, TokenCount
from keras_transformer.training.checkpoints import (
    checkpoint_path,
    list_checkpoints,
)
from keras_transformer.training.losses import GlobalTokenCrossEntropy, LabelSmoothedCrossEntropy


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
    state = json.loads((tmp_path / "backup" / "step-00000040" / "state.json").read_text())
    assert state["step"] == 40 and state["best_val_loss"] == 4.0 and state["stopped_early"]
    # NaN losses are never checkpointed.
    model.stop_training = False
    model.optimizer.iterations.assign(50)
    checkpointer.on_epoch_end(4, {"loss": float("nan")})
    assert checkpointer.diverged and not checkpoint_path(tmp_path / "ckpt", 50).exists()


def test_checkpointer_keeps_the_best_window_before_the_cooldown_across_a_resume(tmp_path):
    """A run whose cooldown begins after step 45: its best step moves into the cooldown, and
    the checkpoints around its best step before the cooldown (30) stay, a restart included."""
    from keras_transformer.training.callbacks import RunCheckpointer

    model = _compiled_tiny_model()

    def checkpointer(state=None):
        made = RunCheckpointer(tmp_path / "ckpt", tmp_path / "backup", checkpoint_every=10,
                               keep=2, patience=0, stopper=StopAt(1000, None), state=state,
                               cooldown_from=45.0)
        made.set_model(model)
        return made

    def train(callback, losses, first_epoch):
        for epoch, val_loss in enumerate(losses, first_epoch):
            model.optimizer.iterations.assign((epoch + 1) * 10)
            callback.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val_loss})

    first = checkpointer()
    train(first, [5.0, 4.5, 4.0, 4.1, 3.0, 2.9], 0)  # best 30 before 45; 60 after it
    assert (first.best_step, first.best_before_cooldown) == (60, 30)
    # The newest 2, up to and around the best step (50 when step 60 was written), and the
    # 2 nearest the best step before the cooldown (20 and 30, the earlier on ties).
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [20, 30, 40, 50, 60]
    state = json.loads((tmp_path / "backup" / "step-00000060" / "state.json").read_text())
    assert state["best_step_before_cooldown"] == 30
    # Resumed from the backup's state: still known, so still kept.
    resumed = checkpointer(state)
    train(resumed, [2.8, 2.7], 6)
    assert resumed.best_before_cooldown == 30
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [20, 30, 60, 70, 80]


def test_metrics_log_appends_under_the_header_already_in_the_file(tmp_path):
    # The first run logs an interval without validation (Keras then adds every val_ column),
    # the resumed one starts at an interval with it: its rows must fit the first header.
    path = tmp_path / "metrics.csv"
    first = MetricsLog(str(path), append=True)
    first.on_train_begin()
    first.on_epoch_end(0, {"loss": 5.0, "step": 100, "learning_rate": 1e-4})
    first.on_train_end()
    resumed = MetricsLog(str(path), append=True)
    resumed.on_train_begin()
    resumed.on_epoch_end(1, {"loss": 4.0, "step": 200, "learning_rate": 2e-4,
                             "val_loss": 4.5, "val_accuracy": 0.25})
    resumed.on_epoch_end(2, {"loss": 3.5, "step": 300, "learning_rate": 3e-4})
    resumed.on_train_end()
    with path.open(newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert [row["step"] for row in rows] == ["100", "200", "300"]
    assert all(None not in row and None not in row.values() for row in rows)
    assert [row["val_loss"] for row in rows] == ["NA", "4.5", "NA"]
    assert rows[1]["val_learning_rate"] == "NA"  # a column no validation logs


def test_a_run_resumed_off_the_checkpoint_grid_still_checkpoints_every_interval(tmp_path):
    """Stopped at step 45 (--max-minutes) and resumed with a larger limit: its intervals of
    10 now end at 55, 65, ...; each passes a multiple of 10, so each is checkpointed."""
    from keras_transformer.training.callbacks import RunCheckpointer

    model = _compiled_tiny_model()
    checkpointer = RunCheckpointer(tmp_path / "ckpt", tmp_path / "backup", checkpoint_every=10,
                                   keep=5, patience=0, stopper=StopAt(1000, None),
                                   state={"step": 45})
    checkpointer.set_model(model)
    for epoch, step in enumerate((55, 65, 75), 4):
        model.optimizer.iterations.assign(step)
        checkpointer.on_epoch_end(epoch, {"loss": 1.0})
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [55, 65, 75]
    # On the grid, an interval shorter than the cadence checkpoints at its multiples only.
    model.optimizer.iterations.assign(80)
    checkpointer.on_epoch_end(7, {"loss": 1.0})
    model.optimizer.iterations.assign(85)
    checkpointer.on_epoch_end(8, {"loss": 1.0})
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [55, 65, 75, 80]
