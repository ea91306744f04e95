"""Draws a run's TensorBoard curves into a PNG (docs/tensorboard.png in the README):

    python docs/tensorboard_curves.py --run runs/multi30k-de-en --out docs/tensorboard.png

Reads the scalars TensorBoard shows from the run's event files (`<run>/logs/train`,
`<run>/logs/validation`): loss and accuracy for training and validation, the learning rate and
target tokens per second, against the optimizer step. Runs logged before the x axis became
the step (Keras' interval index instead) are converted with the run's --checkpoint-every /
--validate-every interval. Needs matplotlib and tensorboard.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PANELS = (("epoch_loss", "loss (label-smoothed)"), ("epoch_accuracy", "token accuracy"),
          ("epoch_learning_rate", "learning rate"), ("epoch_tokens_per_sec", "target tokens/s"))


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the event files in `folder`."""
    if not folder.is_dir():
        return {}
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    found = {}
    for tag in events.Tags().get("tensors", []):
        found[tag] = [(event.step, float(event.tensor_proto.float_val[0]
                                         if event.tensor_proto.float_val else
                                         _tensor_value(event.tensor_proto)))
                      for event in events.Tensors(tag)]
    for tag in events.Tags().get("scalars", []):
        found[tag] = [(event.step, event.value) for event in events.Scalars(tag)]
    return found


def _tensor_value(proto) -> float:
    import tensorflow as tf

    return float(tf.make_ndarray(proto))


def interval(run: Path) -> int:
    """Optimizer steps per Keras interval ("epoch") of the run."""
    arguments = json.loads((run / "config.json").read_text())["arguments"]
    every = arguments["checkpoint_every"]
    return math.gcd(every, arguments.get("validate_every") or every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run = Path(args.run)
    train, validation = scalars(run / "logs" / "train"), scalars(run / "logs" / "validation")
    steps_per_interval = interval(run)
    last = max(step for series in train.values() for step, _ in series)
    # Interval indices (0, 1, ...) rather than steps: convert.
    scale = steps_per_interval if last < steps_per_interval * 2 else 1
    offset = 1 if scale > 1 else 0
    figure = Figure(figsize=(9, 5.6), dpi=80)
    for position, (tag, title) in enumerate(PANELS, start=1):
        axes = figure.add_subplot(2, 2, position)
        for label, source, style in (("train", train, "-"), ("validation", validation, "o-")):
            if tag in source:
                steps, values = zip(*sorted(source[tag]), strict=True)
                axes.plot([(step + offset) * scale for step in steps], values, style,
                          label=label, markersize=3)
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("step", fontsize=8)
        axes.tick_params(labelsize=8)
        axes.grid(alpha=0.3)
        if tag in validation:
            axes.legend(fontsize=8)
    figure.suptitle(f"{run.name}: TensorBoard scalars (logs/train, logs/validation)", fontsize=11)
    figure.tight_layout()
    figure.savefig(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
