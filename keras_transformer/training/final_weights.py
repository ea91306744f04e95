"""The weights a training run keeps (6.1, checkpoint averaging), chosen on the validation split.

The candidates are the averages of `keras_transformer.training.checkpoints.averaging_windows` (the
last checkpoints; for a run whose best validation step came earlier, those up to and around
it; for a run with a cooldown, those around its best step before the cooldown) and the best
checkpoint alone. Each is scored on the validation split by a
`Criterion`: its exact per-token loss (the lowest wins, `by_val_loss`) or its BLEU
(`--choose-by bleu`: the highest wins, `by_val_bleu`); an average wins ties (averaging is the
paper's choice). The choice, the candidates and the reason go to `results.json`. Nothing is
ever chosen on the test split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from keras_transformer.training.checkpoints import (
    LAST,
    average_checkpoints,
    averaging_windows,
    list_checkpoints,
)
from keras_transformer.training.weights_walk import WeightsWalk

BEST = "best checkpoint"


@dataclasses.dataclass(frozen=True)
class Criterion:
    """How the candidate weights are scored on the validation split.

    Attributes:
        key: the field of each candidate (and of the choice) holding its score.
        wording: what the reason calls the winning score, e.g. "highest val BLEU".
        score: the score of a model holding a candidate's weights.
        higher_is_better: True for BLEU, False for a loss.
        digits: decimals of the scores in the reason.
    """

    key: str
    wording: str
    score: Callable[[keras.Model], float]
    higher_is_better: bool = False
    digits: int = 4


def by_val_loss(val_loss: Callable[[keras.Model], float]) -> Criterion:
    """The lowest exact per-token validation loss wins (`--choose-by loss`, the default)."""
    return Criterion("val_loss", "lowest exact validation loss", val_loss)


def by_val_bleu(val_bleu: Callable[[keras.Model], float],
                wording: str = "highest val BLEU") -> Criterion:
    """The highest validation BLEU wins (`--choose-by bleu`), decoded as test will be;
    `wording` names it in the reason (e.g. on a sample of val)."""
    return Criterion("val_bleu", wording, val_bleu, higher_is_better=True, digits=2)


def choose_final_weights(model: keras.Model, checkpoint_dir: str | Path, best_step: int | None,
                         count: int, val_loss: Callable[[keras.Model], float] | None = None,
                         *, criterion: Criterion | None = None,
                         best_before_cooldown: int | None = None) -> dict[str, Any]:
    """Loads into `model` the candidate weights that score best on the validation split.

    Args:
        model: a model of the run's architecture; holds the chosen weights on return.
        checkpoint_dir: the run's `checkpoints/` (periodic `ckpt-*` and `best.weights.h5`).
        best_step: the step of the best validation loss during training (None: unknown).
        count: checkpoints per average (`--average-last`).
        val_loss: the exact per-token validation loss of a model: short for
            `criterion=by_val_loss(val_loss)`.
        criterion: how candidates are scored (give it or `val_loss`, not both).
        best_before_cooldown: with a cooldown, the step of the best validation loss before
            it began (None: no cooldown, or unknown).

    Returns:
        `chosen` (a window name of `averaging_windows`, or `BEST`), `steps` (the steps whose
        weights `model` now holds), the chosen score under `criterion.key` ("val_loss" or
        "val_bleu"), `reason` (one sentence), and `candidates`: a list of {name, steps,
        <criterion.key>}, in the order they were scored.

    Raises:
        FileNotFoundError: no periodic checkpoint in `checkpoint_dir`.
        ValueError: both or neither of `val_loss` and `criterion`.
    """
    if (val_loss is None) == (criterion is None):
        raise ValueError("give val_loss or criterion, not both (nor neither)")
    criterion = criterion or by_val_loss(val_loss)
    key = criterion.key
    checkpoint_dir = Path(checkpoint_dir)
    steps = [step for step, _ in list_checkpoints(checkpoint_dir)]
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no ckpt-*.weights.h5 to average")
    candidates = []
    for name, window in averaging_windows(steps, best_step, count,
                                          best_before_cooldown).items():
        averaged = checkpoint_dir / f"averaged-{len(candidates)}.weights.h5"
        average_checkpoints(checkpoint_dir, window, averaged)
        candidates.append({"name": name, "steps": window, "file": averaged})
    best_file = checkpoint_dir / "best.weights.h5"
    if best_file.is_file() and best_step is not None and best_step >= 0:
        candidates.append({"name": BEST, "steps": [best_step], "file": best_file})
    walk = WeightsWalk()  # each candidate loaded into the same model: walk it once
    for candidate in candidates:
        walk.load(model, candidate["file"])
        candidate[key] = float(criterion.score(model))
    # On a tie the earlier candidate (an average before the best checkpoint): min and max
    # both return the first of equal scores.
    best = max if criterion.higher_is_better else min
    chosen = best(candidates, key=lambda candidate: candidate[key])
    walk.load(model, chosen["file"])
    for candidate in candidates:
        if candidate["file"] != best_file:
            candidate["file"].unlink(missing_ok=True)
        del candidate["file"]
    digits = criterion.digits
    others = ", ".join(f"{_describe(c)} {c[key]:.{digits}f}" for c in candidates
                       if c is not chosen)
    reason = (f"{_describe(chosen)}, steps {chosen['steps']}: {criterion.wording}, "
              f"{chosen[key]:.{digits}f}"
              + (f" (against {others})" if others else " (the only candidate)"))
    if chosen["name"] != LAST and best_step is not None and best_step < steps[-1]:
        reason += f"; validation was best at step {best_step}, before the last checkpoints"
    return {"chosen": chosen["name"], "steps": chosen["steps"], key: chosen[key],
            "reason": reason, "candidates": candidates}


def _describe(candidate: dict[str, Any]) -> str:
    if candidate["name"] == BEST:
        return "the best checkpoint alone"
    count = len(candidate["steps"])
    if candidate["name"] == LAST:
        return f"the average of the last {count} checkpoints"
    return f"the average of {count} checkpoints {candidate['name']}"
