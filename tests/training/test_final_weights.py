"""The weights a run keeps, chosen on the validation split among checkpoint averages and the
best checkpoint (6.1)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_transformer.training.checkpoints import checkpoint_path, save_model_weights
from tests.training.test_checkpoints import _model_with_constant_weights


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


def test_a_cooled_down_run_also_weighs_the_average_before_its_cooldown(tmp_path):
    """A run whose best validation step is its last (the cooldown's annealing) and whose best
    before the cooldown was step 700: the average around 700 competes, and wins here."""
    from keras_transformer.training.final_weights import choose_final_weights

    model = _model_with_constant_weights(0.0)
    for step in range(100, 1100, 100):
        save_model_weights(_model_with_constant_weights(step / 100), checkpoint_path(tmp_path, step))

    def val_loss(candidate):
        return abs(float(candidate.get_weights()[0].flat[0]) - 7.0)

    choice = choose_final_weights(model, tmp_path, best_step=1000, count=3, val_loss=val_loss,
                                  best_before_cooldown=700)
    assert [c["name"] for c in choice["candidates"]] == [
        "last", "around the best step before the cooldown"]
    assert choice["chosen"] == "around the best step before the cooldown"
    assert choice["steps"] == [600, 700, 800]
    assert "the average of 3 checkpoints around the best step before the cooldown" in (
        choice["reason"])
    np.testing.assert_allclose(model.get_weights()[0], 7.0)
