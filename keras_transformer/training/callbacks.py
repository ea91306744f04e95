"""Training callbacks: throughput and learning-rate logging, wall-clock and step limits,
periodic and best checkpoints with early stopping, and a crash-safe backup for resuming.

Keras "epochs" in `train.py` are fixed intervals of `steps_per_epoch` optimizer steps over an
endless, deterministic batch stream (not passes over the data), so the backup written at
each interval's end is always on an interval boundary: a resumed run starts the next interval
with the data stream started at exactly the restored step (without replaying the steps before).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import time
from pathlib import Path
from typing import Any

import keras
from keras import ops

from keras_transformer.training import backup
from keras_transformer.training.checkpoints import (
    BEST_FILE,
    checkpoint_path,
    list_checkpoints,
    steps_to_keep,
    weights_file_bytes,
    write_weights_file,
)
from keras_transformer.training.weights_walk import WeightsWalk
from pipelines import storage
from pipelines.constants import PAD_ID


@keras.saving.register_keras_serializable(package="keras_transformer")
class TokenCount(keras.metrics.Metric):
    """Number of non-padding label tokens seen since the last reset (summed over replicas)."""

    def __init__(self, name: str = "tokens", **kwargs):
        kwargs.pop("dtype", None)
        super().__init__(name=name, dtype="float32", **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        del y_pred, sample_weight
        self.count.assign_add(ops.sum(ops.cast(ops.not_equal(y_true, PAD_ID), "float32")))

    def result(self):
        # A copy: fit() reads epoch results after validation, and the variable would by then
        # hold the validation count.
        return ops.add(self.count, 0.0)

    def reset_state(self):
        self.count.assign(0.0)


def global_step(model: keras.Model) -> int:
    """The optimizer's update count: the training step, which survives a restore."""
    return int(model.optimizer.iterations.numpy())


class ThroughputLogger(keras.callbacks.Callback):
    """Adds `tokens_per_sec`, `steps_per_sec`, `learning_rate` and `step` to each interval's
    logs (so the progress bar, TensorBoard and the history all show them).

    Place it before `TensorBoard` in the callback list: later callbacks see the added keys.
    """

    def __init__(self):
        super().__init__()
        self._start = time.perf_counter()
        self._start_step = 0
        self.total_tokens = 0.0
        self.total_seconds = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._start_step = global_step(self.model)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        seconds = max(time.perf_counter() - self._start, 1e-9)
        step = global_step(self.model)
        tokens = float(logs.get("tokens", 0.0))
        self.total_tokens += tokens
        self.total_seconds += seconds
        logs["tokens_per_sec"] = tokens / seconds
        logs["steps_per_sec"] = (step - self._start_step) / seconds
        logs["step"] = step
        rate = self.model.optimizer.learning_rate
        logs["learning_rate"] = float(ops.convert_to_numpy(rate))


class FirstStepTimer(keras.callbacks.Callback):
    """Reports once, after the first training step, how long the command took to get there.

    Args:
        started: `time.perf_counter()` when the command started.
        report: called with the message (e.g. `print`).
    """

    def __init__(self, started: float, report):
        super().__init__()
        self.started = started
        self.report = report
        self._done = False

    def on_train_batch_end(self, batch, logs=None):
        if not self._done:
            self._done = True
            self.report(f"first training step (step {global_step(self.model)}) done "
                        f"{time.perf_counter() - self.started:.1f} s after start")


class ProgressLog(keras.callbacks.Callback):
    """One line per interval, in optimizer steps and minutes (instead of Keras' "Epoch 3/42"):

        step 1,200 / 4,200 · 15.2 min, ~38 min left · loss 3.214 · accuracy 0.523 ·
        val_loss 2.931 · 4,812 tokens/s

    With a --max-minutes budget that ends the run first, the total is an estimate at the
    current speed ("~3,900").

    Args:
        stopper: the run's `StopAt` (step limit, time budget, elapsed time).
        report: called with each line (e.g. a logger's `info`).
    """

    def __init__(self, stopper: StopAt, report):
        super().__init__()
        self.stopper = stopper
        self.report = report
        self._first_step = None

    def on_train_begin(self, logs=None):
        self._first_step = global_step(self.model)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        step = global_step(self.model)
        elapsed = self.stopper.elapsed
        run_seconds = max(elapsed - self.stopper.elapsed_before, 1e-9)
        rate = (step - self._first_step) / run_seconds  # steps/s in this process
        total, approximate = self.stopper.max_steps, ""
        if self.stopper.max_seconds is not None and rate > 0:
            by_time = step + int(rate * max(self.stopper.max_seconds - elapsed, 0.0))
            if by_time < total:
                total, approximate = by_time, "~"
        left = (total - step) / rate / 60 if rate > 0 else float("nan")
        parts = [f"step {step:,} / {approximate}{total:,}",
                 f"{elapsed / 60:.1f} min, ~{left:.0f} min left"]
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            if key in logs:
                parts.append(f"{key} {float(logs[key]):.3f}")
        if "tokens_per_sec" in logs:
            parts.append(f"{float(logs['tokens_per_sec']):,.0f} tokens/s")
        self.report(" · ".join(parts))


class StepTensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose x axis is the optimizer step, not Keras' interval
    ("epoch") index: curves of runs with different intervals, or resumed runs, line up."""

    def _log_epoch_metrics(self, epoch, logs):
        super()._log_epoch_metrics(global_step(self.model), logs)


class StopAt(keras.callbacks.Callback):
    """Stops after `max_steps` optimizer steps or `max_seconds` of training, whichever first.

    `elapsed_before` is the training time of earlier (interrupted) runs of the same run
    directory, so a resumed run keeps to the original wall-clock budget.
    """

    def __init__(self, max_steps: int, max_seconds: float | None, elapsed_before: float = 0.0):
        super().__init__()
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.elapsed_before = elapsed_before
        self.reason = ""
        self._start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        """Training seconds so far, including earlier runs."""
        return self.elapsed_before + time.perf_counter() - self._start

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if global_step(self.model) >= self.max_steps:
            self.reason = f"reached the step limit {self.max_steps}"
            self.model.stop_training = True
        elif self.max_seconds is not None and self.elapsed >= self.max_seconds:
            self.reason = f"used the --max-minutes budget ({self.max_seconds / 60:g} min)"
            self.model.stop_training = True


class AgreedStop(keras.callbacks.Callback):
    """Makes each stop a decision of every worker, taken between optimizer updates.

    A worker that left `fit` alone would leave the others waiting forever in their next
    all-reduce, and a stop between the micro-batches of an accumulated update would drop
    them. So a stop wished by any callback before this one (place it last) waits for the
    update's end; there, and at each interval's end, `stop_training` becomes the OR of every
    worker's wish (`agree`). Stops decided from all-reduced values (the step, the loss for
    NaN, the validation loss for patience) are the same on every worker anyway; the wall
    clock of `--max-minutes` is not.

    Args:
        agree: this worker's wish -> whether any worker wishes to stop; a collective where
            several processes train (`keras_transformer.cluster.workers.any_worker`), else `bool`.
        stopper: the `StopAt` callback; its `reason` says so when another worker's clock
            stopped this one.
    """

    def __init__(self, agree, stopper: StopAt):
        super().__init__()
        self.agree = agree
        self.stopper = stopper
        self._wished = False

    def on_train_batch_end(self, batch, logs=None):
        self._wished = self._wished or bool(self.model.stop_training)
        if getattr(self.model, "pending_micro_batches", 0):
            self.model.stop_training = False  # until the update's end
            return
        self._settle()

    def on_epoch_end(self, epoch, logs=None):
        self._wished = self._wished or bool(self.model.stop_training)
        self._settle()

    def _settle(self) -> None:
        stop = self.agree(self._wished)
        if stop and not self._wished and not self.stopper.reason:
            # Only a worker's own --max-minutes clock (or flags other than ours) can differ.
            self.stopper.reason = "stopped with another worker (its --max-minutes or --max-steps)"
        self.model.stop_training = stop
        self._wished = stop


class MetricsLog(keras.callbacks.CSVLogger):
    """`keras.callbacks.CSVLogger` (appending, one row per interval) whose write failures on
    a full or failing disk become a `StorageError` naming the file, not a traceback, and
    whose rows keep the columns of the header already in the file."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        # Keras takes the columns from the first interval it logs, even when appending to a
        # file whose header says otherwise: a run resumed into an interval with validation,
        # whose header was written at one without (every val_ column, val_learning_rate
        # among them), wrote shorter rows under it, and val_loss was read from another
        # column. The file's columns are kept; a metric it lacks is left out.
        columns = self._header()
        if columns and columns[0] == "epoch":
            self.keys = columns[1:]

    def _header(self) -> list[str]:
        if not os.path.isfile(self.filename):
            return []
        with open(self.filename, newline="") as stream:
            return next(csv.reader(stream, delimiter=self.sep), [])

    def on_epoch_end(self, epoch, logs=None):
        before = os.path.getsize(self.filename) if os.path.isfile(self.filename) else 0
        try:
            super().on_epoch_end(epoch, logs)
            self.csv_file.flush()
        except Exception as error:  # OSError, or tf.errors.OpError where gfile writes
            failure = storage.storage_error(error, self.filename)
            if failure is None:
                raise
            with contextlib.suppress(OSError):
                self.csv_file.close()  # (flushes again, and fails again)
            with contextlib.suppress(OSError):  # no half row for the resumed run to append to
                os.truncate(self.filename, before)
            raise failure from None


class RunCheckpointer(keras.callbacks.Callback):
    """At each interval's end: periodic checkpoint, best-by-validation-loss checkpoint, early
    stopping, and the resumable backup (optimizer included) with `state` for a restart.

    Args:
        checkpoint_dir: where `ckpt-<step>.weights.h5` and `best.weights.h5` go.
        backup_dir: where the backup generations go (`keras_transformer.training.backup`).
        checkpoint_every: save a periodic checkpoint when the step is a multiple of this.
        keep: the checkpoints averaged: keep the newest `keep` periodic checkpoints and the
            `keep` around the best validation step.
        patience: stop after this many validations without improvement (0 = never).
        stopper: the `StopAt` callback, whose elapsed time is recorded for resuming.
        state: restored state of an interrupted run (best_val_loss, bad_validations, the
            checkpoint files' record, ...).
        cooldown_from: the step where the rate's final cooldown begins (None: no cooldown):
            the checkpoints around the best validation step before it are kept as well
            (`keras_transformer.training.checkpoints.averaging_windows`).

    Raises (from `on_epoch_end`):
        StorageError: a full or failing disk; the files written before are intact.
    """

    def __init__(
        self,
        checkpoint_dir: str | Path,
        backup_dir: str | Path,
        checkpoint_every: int,
        keep: int,
        patience: int,
        stopper: StopAt,
        state: dict[str, Any] | None = None,
        cooldown_from: float | None = None,
    ):
        super().__init__()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.backup_dir = Path(backup_dir)
        self.checkpoint_every = checkpoint_every
        self.keep = keep
        self.patience = patience
        self.stopper = stopper
        state = state or {}
        self.best_val_loss = float(state.get("best_val_loss") or math.inf)
        self.best_step = int(state.get("best_step", -1))
        self.bad_validations = int(state.get("bad_validations", 0))
        self.cooldown_from = cooldown_from
        self.best_before_cooldown = int(state.get("best_step_before_cooldown", -1))
        # name -> {"bytes", "crc32"} of every checkpoint file kept, recorded in the backup.
        self.checkpoints = backup.checkpoint_record(self.checkpoint_dir, state)
        self.diverged = False
        self.stopped_early = False
        # The step of the last checkpoint interval's end: a resume from a stop between two
        # checkpoints (--max-minutes, then a larger limit) ends its intervals off the grid,
        # so a checkpoint is due where a multiple of checkpoint_every was passed, not hit.
        self.last_step = int(state.get("step", 0))
        # Checkpoints, the best file and backups save the same model: walk it once.
        self.weights_walk = WeightsWalk()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        step = global_step(self.model)
        loss = logs.get("loss")
        if loss is not None and not math.isfinite(loss):
            self.diverged = True  # TerminateOnNaN stops; never checkpoint NaN weights
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.backup_dir.mkdir(parents=True, exist_ok=True)
        passed = step // self.checkpoint_every > self.last_step // self.checkpoint_every
        self.last_step = step
        weights = None  # the checkpoint's bytes: the best file, if due, is the same file
        if passed or self.model.stop_training:
            path = checkpoint_path(self.checkpoint_dir, step)
            weights = weights_file_bytes(self.model, walk=self.weights_walk)
            self.checkpoints[path.name] = write_weights_file(path, weights)
            self._remove_old_checkpoints()
        val_loss = logs.get("val_loss")
        if val_loss is not None:
            if val_loss < self.best_val_loss:
                self.best_val_loss, self.best_step = float(val_loss), step
                self.bad_validations = 0
                if weights is None:
                    weights = weights_file_bytes(self.model, walk=self.weights_walk)
                self.checkpoints[BEST_FILE] = write_weights_file(
                    self.checkpoint_dir / BEST_FILE, weights)
            else:
                self.bad_validations += 1
                if self.patience and self.bad_validations >= self.patience:
                    self.stopper.reason = (
                        f"early stopping: no validation improvement in {self.patience} "
                        f"validations (best {self.best_val_loss:.4f} at step {self.best_step})"
                    )
                    self.stopped_early = True
                    self.model.stop_training = True
            if self.cooldown_from is not None and step <= self.cooldown_from:
                self.best_before_cooldown = self.best_step
        # The backup last, so that a restart never sees a backup ahead of the checkpoints.
        backup.write_backup(self.model, self.backup_dir, self.state(epoch + 1, step),
                            self.checkpoints, walk=self.weights_walk)

    def _remove_old_checkpoints(self) -> None:
        # The newest `keep`, and those around the best step so far (and before the
        # cooldown): an early-stopped or cooled-down run may average those instead
        # (keras_transformer.training.checkpoints.averaging_windows).
        found = dict(list_checkpoints(self.checkpoint_dir))
        for step in set(found) - steps_to_keep(list(found), self.best_step, self.keep,
                                               self.best_before_cooldown):
            found[step].unlink(missing_ok=True)
            self.checkpoints.pop(found[step].name, None)

    def state(self, epochs_done: int, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "epochs_done": epochs_done,
            "elapsed_seconds": self.stopper.elapsed,
            "best_val_loss": self.best_val_loss if math.isfinite(self.best_val_loss) else None,
            "best_step": self.best_step,
            "best_step_before_cooldown": self.best_before_cooldown,
            "bad_validations": self.bad_validations,
            "stopped_early": self.stopped_early,
            "stop_reason": self.stopper.reason,
        }
