"""What a run's training loop hands its callbacks and reports: with a cooldown, the
checkpointer knows where it begins (the planned steps', not the steps trained), and the
outcome reports the best validation step before it."""

from __future__ import annotations

import time

from keras_transformer.training.callbacks import global_step
from keras_transformer.training.config import train_config
from keras_transformer.training.training_loop import TrainingLoop
from tests.training.test_callbacks import _compiled_tiny_model


def _loop(tmp_path, cooldown: float) -> TrainingLoop:
    config = train_config(data=str(tmp_path), src="de", tgt="en", out=str(tmp_path / "run"),
                          max_steps=50, cooldown=cooldown, checkpoint_every=10,
                          validate_every=10, average_last=2)
    return TrainingLoop(config, tmp_path / "run", {}, time.perf_counter(), max_steps=40,
                        agree=bool)


def test_a_loop_with_a_cooldown_reports_the_best_step_before_it(tmp_path):
    loop = _loop(tmp_path, cooldown=0.25)
    assert loop.checkpointer.cooldown_from == 30.0  # 40 planned steps, not the config's 50
    model = _compiled_tiny_model()
    loop.checkpointer.set_model(model)
    for epoch, val_loss in enumerate([5.0, 4.0, 4.2, 3.5]):
        model.optimizer.iterations.assign((epoch + 1) * 10)
        loop.checkpointer.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val_loss})
    assert global_step(model) == 40
    outcome = loop.outcome(model, done=True)
    assert (outcome["best_step"], outcome["best_step_before_cooldown"]) == (40, 20)


def test_a_loop_without_a_cooldown_reports_none(tmp_path):
    loop = _loop(tmp_path, cooldown=0.0)
    assert loop.checkpointer.cooldown_from is None
    model = _compiled_tiny_model()
    loop.checkpointer.set_model(model)
    assert loop.outcome(model, done=True)["best_step_before_cooldown"] is None
