"""The weights a training run keeps (6.1, checkpoint averaging), chosen on the validation split.

The candidates are the averages of `keras_transformer.training.checkpoints.averaging_windows` (the
last checkpoints, and for a run whose best validation step came earlier, those up to and
around it) and the best checkpoint alone. Each is scored by its exact per-token validation
loss; the lowest wins, an average winning ties (averaging is the paper's choice). The choice,
the candidates and the reason go to `results.json`.
"""

from __future__ import annotations

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

BEST = "best checkpoint"


def choose_final_weights(model: keras.Model, checkpoint_dir: str | Path, best_step: int | None,
                         count: int, val_loss: Callable[[keras.Model], float]) -> dict[str, Any]:
    """Loads into `model` the candidate weights with the lowest validation loss.

    Args:
        model: a model of the run's architecture; holds the chosen weights on return.
        checkpoint_dir: the run's `checkpoints/` (periodic `ckpt-*` and `best.weights.h5`).
        best_step: the step of the best validation loss during training (None: unknown).
        count: checkpoints per average (`--average-last`).
        val_loss: the exact per-token validation loss of a model.

    Returns:
        `chosen` (a window name of `averaging_windows`, or `BEST`), `steps` (the steps whose
        weights `model` now holds), `val_loss`, `reason` (one sentence), and `candidates`:
        a list of {name, steps, val_loss}.

    Raises:
        FileNotFoundError: no periodic checkpoint in `checkpoint_dir`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    steps = [step for step, _ in list_checkpoints(checkpoint_dir)]
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no ckpt-*.weights.h5 to average")
    candidates = []
    for name, window in averaging_windows(steps, best_step, count).items():
        averaged = checkpoint_dir / f"averaged-{len(candidates)}.weights.h5"
        average_checkpoints(checkpoint_dir, window, averaged)
        candidates.append({"name": name, "steps": window, "file": averaged})
    best_file = checkpoint_dir / "best.weights.h5"
    if best_file.is_file() and best_step is not None and best_step >= 0:
        candidates.append({"name": BEST, "steps": [best_step], "file": best_file})
    for candidate in candidates:
        model.load_weights(candidate["file"])
        candidate["val_loss"] = float(val_loss(model))
    # Lowest loss; on a tie the earlier candidate (an average before the best checkpoint).
    chosen = min(candidates, key=lambda candidate: candidate["val_loss"])
    model.load_weights(chosen["file"])
    for candidate in candidates:
        if candidate["file"] != best_file:
            candidate["file"].unlink(missing_ok=True)
        del candidate["file"]
    others = ", ".join(f"{_describe(c)} {c['val_loss']:.4f}" for c in candidates
                       if c is not chosen)
    reason = (f"{_describe(chosen)}, steps {chosen['steps']}: lowest exact validation loss, {chosen['val_loss']:.4f}"
              + (f" (against {others})" if others else " (the only candidate)"))
    if chosen["name"] != LAST and best_step is not None and best_step < steps[-1]:
        reason += f"; validation was best at step {best_step}, before the last checkpoints"
    return {"chosen": chosen["name"], "steps": chosen["steps"], "val_loss": chosen["val_loss"],
            "reason": reason, "candidates": candidates}


def _describe(candidate: dict[str, Any]) -> str:
    if candidate["name"] == BEST:
        return "the best checkpoint alone"
    count = len(candidate["steps"])
    if candidate["name"] == LAST:
        return f"the average of the last {count} checkpoints"
    return f"the average of {count} checkpoints {candidate['name']}"
