"""Checkpoint averaging (paper 6.1: "averaging the last 5 checkpoints, written at 10-minute
intervals"), as a function and as a command:

    python -m keras_transformer.averaging --run runs/x --last 5

writes `<run>/model.keras` from the mean of the newest 5 `checkpoints/ckpt-<step>.weights.h5`.
Averaging works on the HDF5 files directly (every floating-point array is averaged; integer
arrays such as counters are taken from the newest file), so it needs no model to run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from keras_transformer import artifacts
from keras_transformer.callbacks import list_checkpoints


def average_weight_files(paths: Sequence[str | Path], output: str | Path) -> Path:
    """Writes the element-wise mean of Keras `.weights.h5` files with identical structure.

    Args:
        paths: two or more weight files (one is copied through unchanged).
        output: the averaged file, also a Keras `.weights.h5` (`model.load_weights` reads it).

    Raises:
        ValueError: no paths, or files whose arrays differ in names or shapes.
    """
    if not paths:
        raise ValueError("No checkpoints to average.")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(".tmp-" + output.name)
    sources = [h5py.File(path, "r") for path in paths]
    try:
        with h5py.File(temporary, "w") as target:
            _average_group(sources, target, [str(p) for p in paths])
    finally:
        for source in sources:
            source.close()
    temporary.replace(output)
    return output


def _average_group(sources: list[h5py.Group], target: h5py.Group, names: list[str]) -> None:
    first, newest = sources[0], sources[-1]
    for key, value in first.attrs.items():
        target.attrs[key] = value
    for key in first:
        missing = [name for name, source in zip(names, sources, strict=True) if key not in source]
        if missing:
            raise ValueError(f"{key!r} of {names[0]} is missing in {missing}: different models?")
        item = first[key]
        if isinstance(item, h5py.Group):
            _average_group([source[key] for source in sources], target.create_group(key), names)
            continue
        arrays = [np.asarray(source[key]) for source in sources]
        shapes = {array.shape for array in arrays}
        if len(shapes) > 1:
            raise ValueError(f"{item.name} has different shapes {sorted(shapes)}: different models?")
        if np.issubdtype(arrays[0].dtype, np.floating):
            # Sum in float64 so the mean of N float32 files is exact to float32 precision.
            mean = np.mean(np.stack(arrays).astype(np.float64), axis=0).astype(arrays[0].dtype)
            target.create_dataset(key, data=mean)
        else:
            target.create_dataset(key, data=np.asarray(newest[key]))


def average_last_checkpoints(run_dir: str | Path, last: int, output: str | Path) -> list[int]:
    """Averages the newest `last` periodic checkpoints of a run into `output`.

    Returns:
        The steps of the checkpoints averaged (fewer than `last` if fewer exist).

    Raises:
        FileNotFoundError: the run has no periodic checkpoints.
    """
    found = list_checkpoints(Path(run_dir) / artifacts.CHECKPOINT_DIR)
    if not found:
        raise FileNotFoundError(f"{run_dir}: no {artifacts.CHECKPOINT_DIR}/ckpt-*.weights.h5")
    chosen = found[-last:]
    average_weight_files([path for _, path in chosen], output)
    return [step for step, _ in chosen]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.averaging",
        description="Average the last N checkpoints of a training run into <run>/model.keras.",
    )
    parser.add_argument("--run", required=True, help="run directory of keras_transformer.train")
    parser.add_argument("--last", type=int, default=5, help="checkpoints to average (default 5)")
    parser.add_argument("--output", help="model file to write (default <run>/model.keras)")
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be >= 1")
    run = Path(args.run)
    config_path = run / artifacts.CONFIG_FILE
    if not config_path.is_file():
        print(f"error: {run} is not a training run directory (no {artifacts.CONFIG_FILE})",
              file=sys.stderr)
        return 2

    from keras_transformer.model import build_transformer

    config = artifacts.read_json(config_path)
    averaged = run / artifacts.CHECKPOINT_DIR / "averaged.weights.h5"
    try:
        steps = average_last_checkpoints(run, args.last, averaged)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = build_transformer(**config["model"])
    model.load_weights(averaged)
    output = Path(args.output) if args.output else run / artifacts.MODEL_FILE
    model.save(output)
    print(f"averaged checkpoints of steps {steps} -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
