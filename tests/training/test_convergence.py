"""The end-of-run verdict on the validation-loss curve (`keras_transformer.training.convergence`)."""

from __future__ import annotations

import math

import pytest

from keras_transformer.training.checkpoints import LAST
from keras_transformer.training.convergence import convergence_report, read_validation_losses


def _curve(values, every=200):
    return [(every * (index + 1), value) for index, value in enumerate(values)]


# Multi30k en->de with the recipe (BENCHMARKS.md): still falling at 4,200 steps: 2.724 at
# 3,000, 2.704 at 3,600-4,000, 2.695 at 4,200 (the earlier values descend to them).
EN_DE = [(200, 6.1), (600, 4.5), (1000, 3.6), (1600, 3.1), (2000, 2.93), (2400, 2.82),
         (3000, 2.724), (3600, 2.704), (4000, 2.704), (4200, 2.695)]

# The `multi30k` recipe on de+fr+cs->en, 87,000 pairs (BENCHMARKS.md, issue 39): under-trained,
# its German val loss still falling at 4,200 steps (the run's log, every 200 steps; the run
# itself reported 2.8% and ~2.616 after 8,400 steps from the unrounded losses).
THREE_SOURCES = _curve([5.530, 4.746, 4.315, 4.030, 3.721, 3.379, 3.173, 3.067, 2.964, 2.922,
                        2.864, 2.824, 2.792, 2.788, 2.745, 2.732, 2.708, 2.699, 2.687, 2.679,
                        2.669])


# The `multi30k` recipe on the news pairs, newstest-deen (BENCHMARKS.md, issue 39): under-trained,
# its val loss falling at every validation to 4,200 steps (the run reported 5.9% and ~3.580
# after 8,400 steps from the unrounded losses).
NEWS = _curve([7.008, 6.643, 6.264, 5.982, 5.678, 5.467, 5.395, 5.328, 5.213, 5.197, 5.129,
               5.074, 5.045, 4.963, 4.936, 4.855, 4.818, 4.756, 4.732, 4.727, 4.642])


@pytest.mark.parametrize(("curve", "best_before", "last", "projected_range"), [
    (EN_DE, 2.724, 2.695, (2.5, 2.695)),  # lower than now, not absurdly so
    (THREE_SOURCES, 2.745, 2.669, (2.606, 2.626)),
    (NEWS, 4.936, 4.642, (3.55, 3.61)),
])
def test_a_curve_still_falling_at_its_end_is_reported_with_a_projection(
        curve, best_before, last, projected_range):
    report = convergence_report(curve)
    assert report["verdict"] == "still improving"
    assert report["best_step"] == 4200
    assert report["tail_improvement"] == pytest.approx((best_before - last) / best_before,
                                                       abs=1e-5)
    low, high = projected_range
    assert low < report["projected_val_loss_at_twice_the_steps"] < high
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


# The `multi30k` recipe on the first 10,000 Multi30k de-en pairs (BENCHMARKS.md, issue 39): val
# loss best at step 1,400, 4.8% higher at 4,200; the final weights' candidates on val BLEU.
TEN_K = [(200, 5.45), (400, 4.761), (600, 4.274), (800, 3.768), (1000, 3.578), (1200, 3.413),
         (1400, 3.347), (1600, 3.35), (1800, 3.353), (2000, 3.378), (2200, 3.398),
         (2400, 3.416), (2600, 3.441), (2800, 3.46), (3000, 3.463), (3200, 3.487),
         (3400, 3.481), (3600, 3.507), (3800, 3.486), (4000, 3.477), (4200, 3.507)]


def _candidates(last: float, near_best: tuple[float, ...] = (28.86, 31.07, 30.42)):
    names = ("up to the best step", "around the best step", "best checkpoint")
    return [{"name": LAST, "steps": [3800, 3900, 4000, 4100, 4200], "val_bleu": last}] + [
        {"name": name, "steps": [1400], "val_bleu": bleu}
        for name, bleu in zip(names, near_best, strict=True)]


def test_a_rising_loss_whose_last_checkpoints_win_on_bleu_is_not_called_overfitting():
    report = convergence_report(TEN_K, candidates=_candidates(34.07))
    assert report["verdict"] == "improving by BLEU"
    assert (report["best_step"], report["val_bleu_last"], report["val_bleu_near_best"]) == (
        1400, 34.07, 31.07)
    assert report["rise_since_best"] == pytest.approx((3.507 - 3.347) / 3.347, abs=1e-5)
    message = report["message"]
    assert "34.07" in message and "31.07" in message and "1,400" in message
    assert "would do as well" not in message and "fewer steps would have lost BLEU" in message


@pytest.mark.parametrize("candidates", [
    None,  # chosen on val loss: no BLEU to go by
    _candidates(31.5),  # the last ahead by less than the margin: as good, in fewer steps
    _candidates(29.0),  # the last behind
    [{"name": LAST, "steps": [4200], "val_loss": 3.5},
     {"name": "best checkpoint", "steps": [1400], "val_loss": 3.3}],
])
def test_without_a_clear_bleu_win_of_the_last_checkpoints_a_rising_loss_is_overfitting(
        candidates):
    report = convergence_report(TEN_K, candidates=candidates)
    assert report["verdict"] == "overfitting"
    assert "fewer steps or more dropout would do as well" in report["message"]


def test_bleu_never_overrules_a_verdict_other_than_overfitting():
    assert convergence_report(EN_DE, candidates=_candidates(40.0))["verdict"] == (
        "still improving")


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


def test_rows_logged_under_other_columns_are_not_read(tmp_path):
    # A resumed run's rows written before MetricsLog kept the header's columns: 13 fields
    # under a 17-column header, val_loss's place holding val_perplexity (logs of a real run).
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,loss,step,val_accuracy,val_learning_rate,val_loss,val_step\n"
                    "0,5.0,100,NA,NA,NA,NA\n1,4.0,200,0.25,5.49,162.1\n"
                    "2,3.5,300,NA,NA,NA,NA,extra\n3,3.0,400,0.3,NA,3.9,400\n")
    assert read_validation_losses(path) == [(400, 3.9)]


# The 4,533-step `--recipe auto` Multi30k de->en run (a Xeon, 2026-11-27; 4,817 steps
# planned with a 20% cooldown from step 3,853.6, stopped by its --max-minutes guard): the
# plateau from ~2,400 steps that the recipe's runs show, then the cooldown's drop.
AUTO_DE_EN = [(200, 5.524), (400, 4.688), (600, 4.175), (800, 3.632), (1000, 3.297),
              (1200, 3.099), (1400, 2.966), (1600, 2.881), (1800, 2.788), (2000, 2.737),
              (2200, 2.691), (2400, 2.655), (2600, 2.651), (2800, 2.644), (3000, 2.669),
              (3200, 2.641), (3400, 2.659), (3600, 2.635), (3800, 2.637), (4000, 2.635),
              (4200, 2.626), (4400, 2.628), (4533, 2.623)]
AUTO_COOLDOWN_FROM = 4817 * (1 - 0.2)


def test_a_cooldowns_drop_is_not_taken_for_a_curve_still_improving():
    # Judged on the whole curve, the annealing's last 0.5% reads as a trend.
    assert convergence_report(AUTO_DE_EN)["verdict"] == "still improving"
    report = convergence_report(AUTO_DE_EN, cooldown_from=AUTO_COOLDOWN_FROM)
    assert report["verdict"] == "converged"
    assert report["cooldown_from_step"] == 3854
    assert report["cooldown_gain"] == pytest.approx((2.635 - 2.623) / 2.635, abs=1e-5)
    # The plateau of the curve before the cooldown: first within 0.5% of its best, 2.635.
    assert report["plateau_from_step"] == 2800
    assert report["tail_improvement"] == pytest.approx((2.644 - 2.635) / 2.644, abs=1e-5)
    # The whole run's best and final losses are still reported as they were.
    assert (report["best_step"], report["best_val_loss"], report["final_val_loss"]) == (
        4533, 2.623, 2.623)
    assert "before the cooldown (3,800 steps)" in report["message"]
    assert "from 2.635 to 2.623 (0.46% lower)" in report["message"]
    assert "would not help" in report["message"]


def test_a_curve_still_falling_before_its_cooldown_is_still_improving():
    # en->de's curve, then a cooldown's drop: the trend before the cooldown decides.
    curve = EN_DE + [(4400, 2.66), (4600, 2.64)]
    report = convergence_report(curve, cooldown_from=4300)
    assert report["verdict"] == "still improving"
    assert report["tail_improvement"] == pytest.approx((2.724 - 2.695) / 2.724, abs=1e-5)
    assert report["cooldown_gain"] == pytest.approx((2.695 - 2.64) / 2.695, abs=1e-5)
    # Projected from the curve before the cooldown: no lower than that curve's trend allows.
    assert 2.5 < report["projected_val_loss_at_twice_the_steps"] < 2.695
    assert "at step 8,600, where a run of twice the steps would start its cooldown" in (
        report["message"])


# `--recipe auto` on the news pairs at its 60-minute plan (BENCHMARKS.md, issue 39; a Xeon,
# 2026-11-29): 4,150 steps, the cooldown from step 3,320, the loss still falling before it.
AUTO_NEWS = _curve([7.103, 6.692, 6.353, 5.996, 5.772, 5.536, 5.424, 5.365, 5.295, 5.258,
                    5.220, 5.149, 5.103, 5.059, 5.008, 4.944, 4.892, 4.836, 4.786,
                    4.763]) + [(4150, 4.761)]


def test_the_auto_news_run_was_still_improving_before_its_cooldown():
    report = convergence_report(AUTO_NEWS, cooldown_from=4150 * (1 - 0.2))
    assert report["verdict"] == "still improving"
    assert report["cooldown_from_step"] == 3320
    # The last 25% of the steps before the cooldown (3,200) against the best before them.
    assert report["tail_improvement"] == pytest.approx((5.149 - 4.944) / 5.149, abs=1e-5)
    assert report["cooldown_gain"] == pytest.approx((4.944 - 4.761) / 4.944, abs=1e-5)
    assert 4.0 < report["projected_val_loss_at_twice_the_steps"] < 4.944
    assert "at step 6,640, where a run of twice the steps would start its cooldown" in (
        report["message"])


def test_a_cooldown_with_too_little_before_it_is_judged_on_the_whole_curve():
    curve = _curve([5.0, 4.0, 3.0, 2.9, 2.8, 2.7])
    late = convergence_report(curve, cooldown_from=1300)  # no validation after it
    early = convergence_report(curve, cooldown_from=500)  # 2 validations before it
    plain = convergence_report(curve)
    for report in (late, early):
        assert "cooldown_gain" not in report
        assert report == plain


def test_a_run_stopped_before_its_planned_steps_says_so():
    """The 4,533-step run above was stopped by its --max-minutes guard, 284 steps before the
    end of its 4,817-step schedule: the verdict stays the curve's, and says so."""
    reason = "used the --max-minutes budget (50.6 min)"
    report = convergence_report(AUTO_DE_EN, cooldown_from=AUTO_COOLDOWN_FROM,
                                trained_steps=4533, planned_steps=4817, stop_reason=reason)
    assert report["verdict"] == "converged"
    assert report["stopped_early"] == {"step": 4533, "planned_steps": 4817, "reason": reason}
    assert report["message"].endswith(
        "; the run stopped at step 4,533 of the 4,817 planned, its cooldown unfinished "
        f"({reason})")
    finished = convergence_report(AUTO_DE_EN, cooldown_from=AUTO_COOLDOWN_FROM,
                                  trained_steps=4817, planned_steps=4817,
                                  stop_reason="reached the step limit 4817")
    assert "stopped_early" not in finished and "stopped at" not in finished["message"]
    before_cooldown = convergence_report(AUTO_DE_EN[:-3], trained_steps=3000,
                                         planned_steps=4817, stop_reason="patience")
    assert before_cooldown["message"].endswith(
        "; the run stopped at step 3,000 of the 4,817 planned (patience)")
