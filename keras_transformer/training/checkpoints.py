"""Checkpoints and their averaging (paper 6.1: "a single model obtained by averaging the last 5
checkpoints, which were written at 10-minute intervals").

A run keeps periodic `checkpoints/ckpt-<step>.weights.h5` files. The paper averages the last
ones; a run that stopped early (or overfit its small corpus) has its best weights before its
last checkpoints, so it also keeps the checkpoints around its best validation step, as
fairseq keeps its best checkpoints for averaging (`--keep-best-checkpoints`). A run whose rate
cools down to 0 at its end (`--cooldown`) also keeps those around its best step before the
cooldown began: averaging checkpoints taken at a high rate anneals as a cooldown does
(Sanyal et al. 2023, "Early Weight Averaging"), and which of the two does better on a small
corpus is not known in advance (the Multi30k recipe's best window, 5 checkpoints around its
best step at the full rate, scored 42.23 val BLEU where `--recipe auto`'s cooled-down last 5
scored 41.73, one run each). Which window is averaged is then decided on the validation split
(`keras_transformer.training.final_weights`).

Every weight file is made in memory and written with `pipelines.storage` (temporary name,
fsync, rename), so a kill or a full disk never leaves half of one: HDF5's own writer, failing
on a full disk, left open handles behind (and once crashed the process).

Averaging works on the HDF5 files directly (every floating-point array is averaged; integer
arrays such as counters are taken from the newest file), so it needs no model to run.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import h5py
import keras
import numpy as np

from keras_transformer.training.weights_walk import WeightsWalk
from pipelines import storage

LAST = "last"
UP_TO_BEST = "up to the best step"
AROUND_BEST = "around the best step"
BEFORE_COOLDOWN = "around the best step before the cooldown"
BEST_FILE = "best.weights.h5"


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """The periodic checkpoint of `step` in `directory`."""
    return Path(directory) / f"ckpt-{step:08d}.weights.h5"


def save_model_weights(model: keras.Model, path: str | Path, include_optimizer: bool = False,
                       walk: WeightsWalk | None = None) -> dict[str, int]:
    """Saves the model's weights as a Keras `.weights.h5` (what `model.load_weights` reads),
    made in memory and written durably and atomically.

    Args:
        model: a built model.
        path: the file to write.
        include_optimizer: also save the optimizer's variables (its step count included),
            three times the size: what a resumed run needs.
        walk: for a model saved again and again, the `WeightsWalk` that walks it once.

    Returns:
        {"bytes": size, "crc32": checksum} of the file written.

    Raises:
        StorageError: the disk is full or failing (`path` is untouched).
    """
    return write_weights_file(path, weights_file_bytes(model, include_optimizer, walk))


def weights_file_bytes(model: keras.Model, include_optimizer: bool = False,
                       walk: WeightsWalk | None = None) -> memoryview:
    """The bytes of the `.weights.h5` file that `save_model_weights` writes (arguments as
    there): to write the same weights to several files, make them once."""
    # Keras' own `model.save_weights` takes only a path ending in .weights.h5 and writes it
    # with HDF5's own writer (not atomic, and unsafe on a full disk), and always saves the
    # optimizer: `WeightsWalk` makes the same file in memory, with or without it.
    return (walk or WeightsWalk()).file_bytes(model, include_optimizer)


def write_weights_file(path: str | Path, data: memoryview) -> dict[str, int]:
    """Writes `weights_file_bytes` to `path` durably and atomically; returns {"bytes",
    "crc32"} of the file. Raises StorageError as `save_model_weights`."""
    storage.write_bytes(path, data)
    return {"bytes": len(data), "crc32": storage.checksum(data)}


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """Periodic checkpoints in `directory` as (step, path), oldest first."""
    found = []
    for path in Path(directory).glob("ckpt-*.weights.h5"):
        digits = path.name[len("ckpt-"):-len(".weights.h5")]
        if digits.isdigit():
            found.append((int(digits), path))
    return sorted(found)


def averaging_windows(steps: Sequence[int], best_step: int | None, count: int,
                      best_before_cooldown: int | None = None) -> dict[str, list[int]]:
    """The windows of `count` checkpoints worth averaging, by name, without repeats.

    Args:
        steps: the steps that have a periodic checkpoint.
        best_step: the step of the lowest validation loss (None or < 0: unknown).
        count: checkpoints per window (the paper: 5).
        best_before_cooldown: in a run with a cooldown, the step of the lowest validation
            loss before the cooldown began (None or < 0: no cooldown, or unknown).

    Returns:
        `LAST`: the newest `count`; and when a best step is known, `UP_TO_BEST`: the newest
        `count` at or before it, `AROUND_BEST`: the `count` nearest to it (earlier on ties);
        when a best step before a cooldown is known, `BEFORE_COOLDOWN`: the `count` nearest
        to it. A window equal to an earlier one is left out.
    """
    steps = sorted(steps)
    windows = {LAST: steps[-count:]}
    if best_step is not None and best_step >= 0:
        windows[UP_TO_BEST] = [step for step in steps if step <= best_step][-count:]
        windows[AROUND_BEST] = _nearest(steps, best_step, count)
    if best_before_cooldown is not None and best_before_cooldown >= 0:
        windows[BEFORE_COOLDOWN] = _nearest(steps, best_before_cooldown, count)
    unique: dict[str, list[int]] = {}
    for name, window in windows.items():
        if window and window not in unique.values():
            unique[name] = window
    return unique


def _nearest(steps: Sequence[int], center: int, count: int) -> list[int]:
    """The `count` steps nearest to `center` (earlier on ties), in order."""
    return sorted(sorted(steps, key=lambda step: (abs(step - center), step))[:count])


def steps_to_keep(steps: Sequence[int], best_step: int | None, count: int,
                  best_before_cooldown: int | None = None) -> set[int]:
    """The checkpoints a run must keep so that every window of `averaging_windows` exists."""
    return {step for window in averaging_windows(steps, best_step, count,
                                                 best_before_cooldown).values()
            for step in window}


def average_weight_files(paths: Sequence[str | Path], output: str | Path) -> Path:
    """Writes the element-wise mean of Keras `.weights.h5` files with identical structure.

    Args:
        paths: one or more weight files (one is copied through unchanged).
        output: the averaged file, also a Keras `.weights.h5` (`model.load_weights` reads it).

    Raises:
        ValueError: no paths, a damaged file (named), or files whose arrays differ in names
            or shapes.
    """
    if not paths:
        raise ValueError("No checkpoints to average.")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    sources = []
    try:
        for path in paths:
            try:
                sources.append(h5py.File(path, "r"))
            except OSError as error:  # truncated or overwritten: one line, not h5py's trace
                raise ValueError(
                    f"{path} is damaged, not a readable weights file ({str(error)[:120]}); "
                    "rename it to *.damaged (it is then left out) and average again") from None
        with h5py.File(buffer, "w") as target:
            _average_group(sources, target, [str(p) for p in paths])
    finally:
        for source in sources:
            source.close()
    storage.write_bytes(output, buffer.getbuffer())
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


def average_checkpoints(directory: str | Path, steps: Sequence[int], output: str | Path) -> Path:
    """Averages the periodic checkpoints of `steps` in `directory` into `output`.

    Raises:
        FileNotFoundError: a checkpoint of `steps` is missing.
    """
    paths = [checkpoint_path(directory, step) for step in steps]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoints to average are missing: {', '.join(missing)}")
    return average_weight_files(paths, output)


def average_last_checkpoints(directory: str | Path, last: int, output: str | Path) -> list[int]:
    """Averages the newest `last` periodic checkpoints in `directory` into `output`.

    Returns:
        The steps of the checkpoints averaged (fewer than `last` if fewer exist).

    Raises:
        FileNotFoundError: `directory` has no periodic checkpoints.
    """
    found = list_checkpoints(directory)
    if not found:
        raise FileNotFoundError(f"{directory}: no ckpt-*.weights.h5")
    chosen = found[-last:]
    average_weight_files([path for _, path in chosen], output)
    return [step for step, _ in chosen]
