"""Average a run's checkpoints by hand (paper 6.1):

    python -m keras_transformer.averaging --run runs/x --last 5

writes `<run>/model.keras` from the mean of the newest 5 `checkpoints/ckpt-<step>.weights.h5`
(the library: `keras_transformer.training.checkpoints`). The model file is written under a
temporary name and renamed into place: a reader finds the old one or the new one.

Exit status: 0 averaged; 2 not a run directory (or a damaged one), no checkpoints or a bad
flag (one `error:` line); 4 (`EXIT_STORAGE`) the disk is full, over quota, read-only or
failing (one `error:` line naming the file and the bytes it needed; nothing half-written):
free space and run the same command again.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_transformer import run_directory
from keras_transformer.flags import add_verbose_flag, storage_errors_as_status
from keras_transformer.logs import show_project_logs
from keras_transformer.model.transformer import build_transformer
from keras_transformer.training.checkpoints import average_last_checkpoints
from pipelines import storage


def main(argv: Sequence[str] | None = None) -> int:
    """The averaging command; returns the exit status."""
    show_project_logs()  # progress lines on stdout (a previous command may have moved them)
    return storage_errors_as_status(_average, argv)


def _average(argv: Sequence[str] | None) -> int:
    """The command's work; raises `StorageError` for a full or failing disk."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.averaging",
        description="Average the last N checkpoints of a training run into <run>/model.keras.",
    )
    parser.add_argument("--run", required=True, help="run directory of keras_transformer.train")
    parser.add_argument("--last", type=int, default=5, help="checkpoints to average (default 5)")
    parser.add_argument("--output", help="model file to write (default <run>/model.keras)")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be >= 1")
    run = Path(args.run)
    config_path = run / run_directory.CONFIG_FILE
    if not config_path.is_file():
        print(f"error: {run} is not a training run directory (no {run_directory.CONFIG_FILE})",
              file=sys.stderr)
        return 2

    averaged = run / run_directory.CHECKPOINT_DIR / "averaged.weights.h5"
    try:
        config = run_directory.read_json(config_path)
        steps = average_last_checkpoints(run / run_directory.CHECKPOINT_DIR, args.last, averaged)
    except (FileNotFoundError, ValueError) as error:  # ValueError: a damaged config.json too
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = build_transformer(**config["model"])
    model.load_weights(averaged)
    output = Path(args.output) if args.output else run / run_directory.MODEL_FILE
    # The temporary name keeps the suffix (`.tmp-<pid>-model.keras`), which Keras requires.
    needed = sum(weight.numpy().nbytes for weight in model.weights)
    with storage.replacing(output, needed=needed) as temporary:
        model.save(temporary)
    print(f"averaged checkpoints of steps {steps} -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
