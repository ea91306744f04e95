"""The end-of-run verdict on the validation-loss curve (`keras_transformer.training.convergence`)."""

from __future__ import annotations

import math

import pytest

from keras_transformer.training.convergence import convergence_report, read_validation_losses


def _curve(values, every=200):
    return [(every * (index + 1), value) for index, value in enumerate(values)]


# Multi30k en->de with the recipe (BENCHMARKS.md): still falling at 4,200 steps: 2.724 at
# 3,000, 2.704 at 3,600-4,000, 2.695 at 4,200 (the earlier values descend to them).
EN_DE = [(200, 6.1), (600, 4.5), (1000, 3.6), (1600, 3.1), (2000, 2.93), (2400, 2.82),
         (3000, 2.724), (3600, 2.704), (4000, 2.704), (4200, 2.695)]


def test_a_curve_still_falling_at_its_end_is_reported_with_a_projection():
    report = convergence_report(EN_DE)
    assert report["verdict"] == "still improving"
    assert report["tail_improvement"] == pytest.approx((2.724 - 2.695) / 2.724, abs=1e-5)
    projected = report["projected_val_loss_at_twice_the_steps"]
    assert 2.5 < projected < 2.695  # lower than now, not absurdly so
    assert "8,400" in report["message"] and "longer budget" in report["message"]


def test_a_plateau_within_the_noise_is_converged_from_where_it_began():
    # de->en: the plateau (2.66-2.72) from ~2,400 steps on, noise around it, to 4,200.
    noise = [0.02, -0.015, 0.01, -0.02, 0.025, -0.01, 0.0, 0.015, -0.005]
    curve = [(200, 6.0), (600, 4.4), (1000, 3.4), (1600, 2.9), (2000, 2.75)] + [
        (2400 + 200 * k, 2.69 + noise[k]) for k in range(len(noise))]
    report = convergence_report(curve)
    assert report["verdict"] == "converged"
    assert report["plateau_from_step"] == 2600  # the first within 0.5% of the best (2.67)
    assert "would not help" in report["message"]


def test_a_loss_that_rises_after_its_best_is_overfitting():
    curve = _curve([5.0, 3.5, 2.9, 2.6, 2.5, 2.55, 2.62, 2.7, 2.78, 2.85])
    report = convergence_report(curve)
    assert report["verdict"] == "overfitting"
    assert report["best_step"] == 1000
    assert report["rise_since_best"] == pytest.approx((2.85 - 2.5) / 2.5, abs=1e-5)


def test_the_projection_is_exact_for_a_geometric_decay():
    # L(s) = 2.5 + 2 * 0.8 ** (s / 200): each interval's gain is 0.8 of the previous one.
    curve = [(s, 2.5 + 2 * 0.8 ** (s / 200)) for s in range(200, 2001, 200)]
    projected = convergence_report(curve, tolerance=1e-4)["projected_val_loss_at_twice_the_steps"]
    assert projected == pytest.approx(2.5 + 2 * 0.8 ** (4000 / 200), abs=1e-4)


def test_too_few_validations_say_so():
    report = convergence_report([(100, 3.0), (200, 2.9)])
    assert report["verdict"] == "unknown" and "at least 4" in report["message"]


def test_the_logged_csv_is_read_with_its_gaps_and_resumed_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,loss,step,val_loss\n0,5.0,100,NA\n1,4.0,200,4.5\n"
                    "2,3.5,300,NA\n3,3.0,400,3.9\n3,3.0,400,3.8\n4,2.9,600,nan\n")
    assert read_validation_losses(path) == [(200, 4.5), (400, 3.8)]
    assert read_validation_losses(tmp_path / "absent.csv") == []
    assert not math.isnan(sum(loss for _, loss in read_validation_losses(path)))
