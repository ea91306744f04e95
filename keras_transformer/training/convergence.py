"""Whether a run had converged: the verdict of its validation-loss curve, at the end of a run.

A run bounded in steps (every recipe here) stops where its budget ends, not where its model
stops improving: Multi30k de->en reaches its plateau by ~2,400 of the recipe's 4,200 steps,
en->de still improves at 4,200, and a corpus six times larger is undertrained by the same
steps (issue 39). Nothing told the user. This reads the validation losses a run logged
(logs/metrics.csv) and says which of three things happened, with the evidence:

- "still improving": the best loss of the last quarter of the steps is lower than the best
  before it by more than `TOLERANCE` (relative). Roughly what a longer budget would give:
  the loss after twice the steps if each validation interval's improvement keeps shrinking
  as it did over the second half (a geometric series). On the 1,200-step Multi30k de->en run
  of issue 37 it projects 2.74 at step 2,400, where the 4,200-step recipe's runs were at
  2.66-2.72: rough, as said.
- "converged": not still improving, and the final loss within `2 * TOLERANCE` of the best;
  the plateau starts at the first validation within `TOLERANCE` of the best.
- "overfitting": the final loss more than `2 * TOLERANCE` above the best, the best reached
  before the last fifth of the steps.
- "improving by BLEU": the loss says overfitting, but the final weights were chosen on val
  BLEU and the last checkpoints' average beat every candidate near the loss's best step by
  more than `BLEU_MARGIN`. The label-smoothed loss rises as predictions sharpen while the
  translations still improve: the `multi30k` recipe on 10,000 Multi30k pairs had its best
  val loss at step 1,400 of 4,200 (4.8% lower than at the end), yet its last 5 checkpoints
  scored 34.07 val BLEU against 31.07 around step 1,400 (BENCHMARKS.md, issue 39), where the
  loss alone said "fewer steps would do as well".

A schedule that anneals the rate at its end (`--cooldown`, which `--recipe auto` sets) drops
the loss over its last steps whether or not the model had converged: the drop is the
annealing's (Haegele et al. 2024), and more steps would end with the same drop. Such a run is
judged on the validations before its cooldown begins, and the report gives what the cooldown
added (`cooldown_gain`). Without that, the 4,533-step `auto` Multi30k de->en run (a 20%
cooldown; val loss 2.655 at step 2,400, 2.635-2.669 until the cooldown at 3,854, 2.623 at the
end) was called "still improving" and projected 2.545 for twice the steps, despite the
plateau by ~2,400 steps that the recipe's runs show.

`TOLERANCE` (0.5%) is about the step-to-step noise of Multi30k's val loss at its plateau
(2.66-2.72 around 2.69: ±1.1%; the best of a window moves less than a single value), and
below en->de's last-quarter gain (2.724 at step 3,000 -> 2.695 at 4,200: 1.1%).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keras_transformer.training.checkpoints import LAST

TOLERANCE = 0.005
TAIL_FRACTION = 0.25  # the window judged against what came before it
MIN_VALIDATIONS = 4
# Val BLEU points by which the last checkpoints must beat those near the loss's best step to
# overrule its "overfitting": above the +/-0.3 that one val decoding setting moves BLEU by on
# Multi30k (issue 29's grid), far below the 3.0 of the run that showed the need.
BLEU_MARGIN = 0.5


def read_validation_losses(metrics_csv: str | Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every validation a run logged (its logs/metrics.csv), in step
    order; a step logged twice (a resumed interval) keeps its last value. Rows with more or
    fewer fields than the header are skipped: a resumed run logged them under other columns
    before `callbacks.MetricsLog` kept the header's, and their val_loss is another metric."""
    path = Path(metrics_csv)
    if not path.is_file():
        return []
    losses: dict[int, float] = {}
    with path.open(newline="") as stream:
        for row in csv.DictReader(stream):
            if None in row or None in row.values():  # too many fields, or too few
                continue
            try:
                step, loss = int(float(row["step"])), float(row["val_loss"])
            except (KeyError, TypeError, ValueError):  # "NA": no validation in that interval
                continue
            if math.isfinite(loss):
                losses[step] = loss
    return sorted(losses.items())


def convergence_report(history: Sequence[tuple[int, float]], *,
                       tolerance: float = TOLERANCE,
                       cooldown_from: float | None = None,
                       candidates: Sequence[dict[str, Any]] | None = None,
                       trained_steps: int | None = None, planned_steps: int | None = None,
                       stop_reason: str | None = None) -> dict[str, Any]:
    """The verdict on a validation-loss curve (see the module docstring).

    Args:
        history: (step, val_loss) in step order.
        tolerance: relative change taken as no change.
        cooldown_from: the step where the learning rate's final cooldown begins, if the
            schedule has one: whether the model was still improving is judged on the
            validations up to it (when there are enough), overfitting on the whole curve.
        candidates: the final weights' candidates as `final_weights.choose_final_weights`
            scored them ({name, steps, val_bleu}); with val BLEU, an "overfitting" loss is
            checked against it (the "improving by BLEU" verdict).
        trained_steps, planned_steps, stop_reason: where the run stopped, where its schedule
            ends, and why it stopped: a run stopped before its planned steps (--max-minutes,
            patience) says so, with its cooldown unfinished if it had begun one.

    Returns:
        {"verdict": "still improving" | "converged" | "overfitting" | "unknown",
         "message": one line for the log, "best_step", "best_val_loss", "final_val_loss",
         and by verdict: "plateau_from_step", "tail_improvement" (relative),
         "projected_val_loss_at_twice_the_steps" (with a cooldown: at twice the step it
         began, before a longer run's own cooldown), "rise_since_best" (relative); with a
         cooldown judged apart, "cooldown_from_step" and "cooldown_gain" (relative: the best
         loss after the cooldown began against the best before it); "stopped_early"
         ({"step", "planned_steps", "reason"}) for a run stopped before its planned steps}.
    """
    report = _judge(history, tolerance, cooldown_from, candidates)
    if trained_steps is not None and planned_steps and trained_steps < planned_steps:
        report["stopped_early"] = {"step": trained_steps, "planned_steps": planned_steps,
                                   "reason": stop_reason}
        unfinished = (", its cooldown unfinished" if cooldown_from is not None
                      and trained_steps > cooldown_from else "")
        report["message"] += (f"; the run stopped at step {trained_steps:,} of the "
                              f"{planned_steps:,} planned{unfinished}"
                              + (f" ({stop_reason})" if stop_reason else ""))
    return report


def _judge(history: Sequence[tuple[int, float]], tolerance: float,
           cooldown_from: float | None, candidates: Sequence[dict[str, Any]] | None
           ) -> dict[str, Any]:
    """`convergence_report`'s verdict on the curve alone."""
    if len(history) < MIN_VALIDATIONS:
        return {"verdict": "unknown", "validations": len(history),
                "message": f"convergence unknown: {len(history)} validation(s), at least "
                           f"{MIN_VALIDATIONS} are needed (validate more often)"}
    steps = [step for step, _ in history]
    losses = [loss for _, loss in history]
    last_step, final = steps[-1], losses[-1]
    best_index = min(range(len(losses)), key=losses.__getitem__)
    best_step, best = steps[best_index], losses[best_index]
    report: dict[str, Any] = {"validations": len(history), "best_step": best_step,
                              "best_val_loss": best, "final_val_loss": final,
                              "tolerance": tolerance}
    judged, annealed, plain_best = list(history), "", best
    if cooldown_from is not None:
        before_cooldown = [(step, loss) for step, loss in history if step <= cooldown_from]
        after = [loss for step, loss in history if step > cooldown_from]
        if after and len(before_cooldown) >= MIN_VALIDATIONS:
            judged = before_cooldown
            plain_best = min(loss for _, loss in judged)
            gain = (plain_best - min(after)) / plain_best
            report.update(cooldown_from_step=round(cooldown_from),
                          cooldown_gain=round(gain, 5))
            annealed = (f"; the rate's cooldown from step {round(cooldown_from):,} then took "
                        f"it from {plain_best:.3f} to {min(after):.3f} "
                        + (f"({100 * gain:.2f}% lower), as annealing does at the end of "
                           "any run" if gain >= 0 else f"({-100 * gain:.2f}% higher)"))
    judged_last = judged[-1][0]
    tail_start = judged_last - TAIL_FRACTION * (judged_last - judged[0][0])
    before = [loss for step, loss in judged if step < tail_start]
    tail = [loss for step, loss in judged if step >= tail_start]
    if not before:
        before, tail = [judged[0][1]], [loss for _, loss in judged[1:]]
    improvement = (min(before) - min(tail)) / min(before)
    report["tail_improvement"] = round(improvement, 5)
    rise = (final - best) / best
    where = f" before the cooldown ({judged_last:,} steps)" if annealed else ""
    overfit = rise > 2 * tolerance and best_step < last_step - (last_step - steps[0]) / 5
    by_bleu = _last_beats_the_rest(candidates) if overfit else None
    if by_bleu:
        last_bleu, near_best = by_bleu
        report.update(verdict="improving by BLEU", rise_since_best=round(rise, 5),
                      val_bleu_last=round(last_bleu, 2), val_bleu_near_best=round(near_best, 2),
                      message=f"improving by BLEU: val loss {final:.3f} at step {last_step:,} "
                              f"is {100 * rise:.1f}% above its best, {best:.3f} at step "
                              f"{best_step:,}, but val BLEU kept rising: the last checkpoints "
                              f"score {last_bleu:.2f} against at most {near_best:.2f} near "
                              f"step {best_step:,} (the label-smoothed loss grows as "
                              "predictions sharpen); fewer steps would have lost BLEU, more "
                              "may still help")
    elif overfit:
        report.update(verdict="overfitting", rise_since_best=round(rise, 5),
                      message=f"overfitting: val loss {final:.3f} at step {last_step:,} is "
                              f"{100 * rise:.1f}% above its best, {best:.3f} at step "
                              f"{best_step:,}; fewer steps or more dropout would do as well "
                              "(the final weights are chosen on val: model.keras is not the "
                              "last step's)")
    elif improvement > tolerance:
        # Projected from the curve judged; with a cooldown, to where a run of twice the
        # steps would start its own (which would then lower the loss further).
        target = 2 * round(cooldown_from) if annealed else 2 * last_step
        projected = _projected_loss(judged, target)
        report.update(verdict="still improving",
                      projected_val_loss_at_twice_the_steps=round(projected, 4),
                      message=f"still improving{where}: the best val loss of the last "
                              f"{100 * TAIL_FRACTION:.0f}% of the steps is "
                              f"{100 * improvement:.1f}% below the best before them ("
                              f"{min(tail):.3f} against {min(before):.3f}); roughly "
                              + (f"{projected:.3f} at step {target:,}, where a run of twice "
                                 "the steps would start its cooldown" if annealed else
                                 f"{projected:.3f} after twice the steps ({target:,})")
                              + f": a longer budget would help{annealed}")
    else:
        plateau = next(step for step, loss in judged if loss <= plain_best * (1 + tolerance))
        report.update(verdict="converged", plateau_from_step=plateau,
                      message=f"converged{where}: val loss within {100 * tolerance:.1f}% of "
                              f"its best ({plain_best:.3f}) from step {plateau:,} of "
                              f"{judged_last:,}{annealed}; more steps of this recipe would "
                              "not help")
    return report


def _last_beats_the_rest(candidates: Sequence[dict[str, Any]] | None
                         ) -> tuple[float, float] | None:
    """(the last checkpoints' val BLEU, the best other candidate's) where the last beat every
    other candidate (each near the loss's best step) by more than `BLEU_MARGIN`, else None."""
    scored = [c for c in candidates or () if c.get("val_bleu") is not None]
    last = [c["val_bleu"] for c in scored if c["name"] == LAST]
    others = [c["val_bleu"] for c in scored if c["name"] != LAST]
    if not last or not others:
        return None
    near_best = max(others)
    return (last[0], near_best) if last[0] > near_best + BLEU_MARGIN else None


def _projected_loss(history: Sequence[tuple[int, float]], step: int) -> float:
    """The loss at `step` if each validation interval keeps improving by a fixed fraction `r`
    of the previous interval's improvement (per step, so that uneven intervals compare):
    `r` is the geometric mean of those ratios over the second half of the curve, at most
    0.95; a curve that stopped improving projects its best loss."""
    points = [(s, loss) for s, loss in history if s >= history[-1][0] / 2]
    points = points if len(points) >= 3 else list(history[-3:])
    rates = [(before - after) / (s1 - s0) for (s0, before), (s1, after)
             in zip(points, points[1:], strict=False)]
    best = min(loss for _, loss in history)
    ratios = [b / a for a, b in zip(rates, rates[1:], strict=False) if a > 0 and b > 0]
    if rates[-1] <= 0 or not ratios:
        return best
    ratio = min(math.exp(sum(math.log(r) for r in ratios) / len(ratios)), 0.95)
    interval = points[-1][0] - points[-2][0]
    gain, rate = 0.0, rates[-1]
    for _ in range(max(0, round((step - history[-1][0]) / interval))):
        rate *= ratio
        gain += rate * interval
    return min(history[-1][1] - gain, best)
