"""The command that finishes a JAX-trained run under TensorFlow: parsed back, it names the
same run (config.json's identity), so the finishing run finds it trained instead of refusing
it as trained with different settings."""

from __future__ import annotations

import pytest

from keras_transformer.flags import parse_train_args
from keras_transformer.run_directory import run_record
from keras_transformer.training.config import train_config
from keras_transformer.training.keras_backend import finishing_command


def _identity(config) -> dict:
    return run_record(config, config.check())["identity"]


@pytest.mark.parametrize("length", [dict(max_steps=4817), dict(epochs=3)],
                         ids=["max-steps", "epochs"])
def test_a_run_with_a_cooldown_stopped_early_keeps_its_planned_length(length):
    """A cooldown's schedule depends on the planned length, which the identity records: a
    run stopped at step 4,533 (the minutes guard) is finished with its own length."""
    config = train_config(data="corpus", src="de", tgt="en", out="runs/x", backend="jax",
                          cooldown=0.2, **length)
    settings, _ = parse_train_args(finishing_command(config, "mixed_bfloat16", 4533)[3:])
    assert settings.optimization.backend == "tensorflow"
    assert (settings.optimization.max_steps, settings.optimization.epochs) == (
        config.optimization.max_steps, config.optimization.epochs)
    assert _identity(settings) == _identity(config)


def test_a_run_without_a_cooldown_is_finished_at_the_steps_it_trained():
    config = train_config(data="corpus", src="de", tgt="en", out="runs/x", backend="jax",
                          epochs=3)
    settings, _ = parse_train_args(finishing_command(config, "float32", 1234)[3:])
    assert (settings.optimization.max_steps, settings.optimization.epochs) == (1234, None)
    assert _identity(settings) == _identity(config)
