"""Average a run's checkpoints by hand (paper 6.1):

    python -m keras_transformer.averaging --run runs/x --last 5

writes `<run>/model.keras` from the mean of the newest 5 `checkpoints/ckpt-<step>.weights.h5`
(the library: `keras_transformer.training.checkpoints`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_transformer import run_directory
from keras_transformer.flags import add_verbose_flag
from keras_transformer.model.transformer import build_transformer
from keras_transformer.training.checkpoints import average_last_checkpoints


def main(argv: Sequence[str] | None = None) -> int:
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

    config = run_directory.read_json(config_path)
    averaged = run / run_directory.CHECKPOINT_DIR / "averaged.weights.h5"
    try:
        steps = average_last_checkpoints(run / run_directory.CHECKPOINT_DIR, args.last, averaged)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = build_transformer(**config["model"])
    model.load_weights(averaged)
    output = Path(args.output) if args.output else run / run_directory.MODEL_FILE
    model.save(output)
    print(f"averaged checkpoints of steps {steps} -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
