"""Train a Transformer end to end: `python -m keras_transformer.train --help`.

The command line of `keras_transformer.training.run.run_training`: its flags are the fields of
`TrainConfig` (generated: `keras_transformer.flags`), parsed into one and handed over. What the
library raises becomes one line on stderr and an exit status:

    0  trained (or already trained), or a --dry-run's plan printed
    1  the loss became NaN (earlier checkpoints are kept)
    2  a bad flag, corpus, run directory or cluster: nothing was created
    3  another worker of a cluster was lost: restart every worker to resume
    4  the disk is full, over quota, read-only or failing (`StorageError`, naming the path
       and the bytes needed): nothing was half-written; free space and run the same command
       again to resume from the last intact state
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from keras_transformer.errors import UsageError
from keras_transformer.flags import parse_train_args
from keras_transformer.logs import show_project_logs, stop_cli_logging

EXIT_DIVERGED, EXIT_USAGE, EXIT_WORKER_LOST = 1, 2, 3


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns its exit status."""
    config, dry_run = parse_train_args(argv)
    show_project_logs()
    from keras_transformer.training.keras_backend import tensorflow_installed, use_backend

    try:
        use_backend(config.optimization.backend)  # before anything imports Keras
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    # Imported after parsing: it loads TensorFlow (~4 s), which `--help` and a refused flag
    # should not wait for.
    from keras_transformer.cluster.workers import ClusterFailure
    from keras_transformer.errors import EXIT_STORAGE, StorageError, TrainingDiverged

    if tensorflow_installed():
        from keras_transformer.training.run import run_training
    else:  # a GPU machine without TensorFlow: JAX trains from a folder prepared elsewhere
        from keras_transformer.training.run_jax import train_prepared_on_jax

        def run_training(config, dry_run: bool):
            if dry_run:
                raise UsageError("--dry-run needs TensorFlow (it reads the corpus)")
            return train_prepared_on_jax(config)

    try:
        run_training(config, dry_run=dry_run)
    except ValueError as error:  # UsageError, RunDirError, ClusterConfigError, CorpusError
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except StorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_STORAGE
    except ClusterFailure as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_WORKER_LOST
    except TrainingDiverged as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_DIVERGED
    return 0


if __name__ == "__main__":
    status = main()
    if status == EXIT_WORKER_LOST:
        # Aborted collectives leave TensorFlow unusable, and tearing it down waits for the
        # input pipeline's threads (22 s measured on Multi30k): leave now, within the bound.
        sys.stdout.flush()
        stop_cli_logging()
        os._exit(status)
    sys.exit(status)
