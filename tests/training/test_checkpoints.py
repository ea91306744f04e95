"""Checkpoint files and their averaging (paper 6.1): the element-wise mean of weight files,
refused across architectures, and the windows averaged around the best step."""

from __future__ import annotations

import numpy as np
import pytest

from keras_transformer.model.transformer import build_transformer
from keras_transformer.training.checkpoints import (
    average_weight_files,
    averaging_windows,
    checkpoint_path,
    list_checkpoints,
    save_model_weights,
    steps_to_keep,
)


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


def test_averaging_refuses_different_architectures(tmp_path):
    save_model_weights(build_transformer("tiny", vocab_size=20), tmp_path / "a.weights.h5")
    save_model_weights(build_transformer("tiny", vocab_size=30), tmp_path / "b.weights.h5")
    with pytest.raises(ValueError, match="different"):
        average_weight_files([tmp_path / "a.weights.h5", tmp_path / "b.weights.h5"],
                             tmp_path / "avg.weights.h5")


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


def test_a_run_with_a_cooldown_also_averages_around_its_best_step_before_it():
    steps = list(range(100, 1100, 100))
    # Best at the end of the cooldown (from step 800), best before it at 700.
    assert averaging_windows(steps, 1000, 3, best_before_cooldown=700) == {
        "last": [800, 900, 1000],
        "around the best step before the cooldown": [600, 700, 800]}
    assert steps_to_keep(steps, 1000, 3, best_before_cooldown=700) == {
        600, 700, 800, 900, 1000}
    # A window equal to another is not repeated; unknown (-1) adds none.
    assert averaging_windows(steps, 1000, 3, best_before_cooldown=900) == {
        "last": [800, 900, 1000]}
    assert averaging_windows(steps, 1000, 3, best_before_cooldown=-1) == {
        "last": [800, 900, 1000]}
