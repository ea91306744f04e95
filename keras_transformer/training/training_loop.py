"""What a training run does around `model.fit`, on either backend: the compiled model, the
number of steps, and the callbacks that stop, log, checkpoint and back the run up.

`fit.py` (TensorFlow, `tf.distribute`) and `fit_jax.py` (JAX) feed the same model the same
batches; everything else of the run is here, once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

import keras

from keras_transformer import run_directory
from keras_transformer.training import callbacks as cb
from keras_transformer.training.config import DEFAULT_MAX_STEPS, TrainConfig
from keras_transformer.training.keras_backend import tensorflow_installed
from keras_transformer.training.loss_scaling import LossScaleOptimizer
from keras_transformer.training.losses import (
    GlobalTokenCrossEntropy,
    MaskedAccuracy,
    Perplexity,
)
from keras_transformer.training.optimizer import cooldown_start, paper_adam
from keras_transformer.training.step_budget import StepBudget
from keras_transformer.training.trainer_model import build_trainer

_LOG = logging.getLogger("keras_transformer")


def compiled_trainer(record: dict[str, Any], optimization, precision: str, jit: bool,
                     accumulate: int, total_steps: int | None = None):
    """The run's `TransformerTrainer`, compiled as every run trains it (either backend):
    5.3's Adam and schedule (loss-scaled under mixed_float16; with `optimization.cooldown`,
    annealed to 0 at `total_steps`), 5.4's smoothed loss over the global batch's tokens,
    `accumulate` micro-batches an update; its optimizer built."""
    model = build_trainer(**record["model"], dtype=precision)
    cooldown = optimization.cooldown if total_steps else 0.0
    optimizer = paper_adam(model.config.d_model, optimization.warmup_steps,
                           optimization.lr_scale, total_steps, cooldown)
    if precision == "mixed_float16":  # steps skipped on overflow still count as steps
        optimizer = LossScaleOptimizer(optimizer, initial_scale=optimization.initial_loss_scale)
    model.compile(
        optimizer=optimizer,
        loss=GlobalTokenCrossEntropy(optimization.label_smoothing),
        metrics=[MaskedAccuracy(), Perplexity(), cb.TokenCount()],
        jit_compile=jit,
        accumulate_steps=accumulate,
    )
    if not model.optimizer.built:  # (accumulation builds it; building twice duplicates)
        model.optimizer.build(model.trainable_variables)
    return model


def record_training(record: dict[str, Any], prepared, budget: StepBudget, vocab_size: int,
                    **how: Any) -> None:
    """Adds to config.json's `record` how the run trains (`how`: precision, jit_compile,
    replicas, ...), its step budget, vocabulary and prepared data (which a resume must
    find again: `run_directory.check_resumed_data`)."""
    record.update(**how, step_budget={**dataclasses.asdict(budget),
                                      "tokens_per_step": budget.tokens_per_step},
                  tokenizer_vocab_size=vocab_size,
                  prepared={"directory": str(prepared.directory.resolve()),
                            "corpus_fingerprint": prepared.manifest["corpus_fingerprint"],
                            "pairs": prepared.pairs, "shards": prepared.num_shards})


def total_steps(config: TrainConfig, prepared, budget: StepBudget, replicas: int,
                shapes: dict[str, Any]) -> int:
    """The run's optimizer steps: --max-steps, or --epochs converted (micro-batches of one
    replica per epoch, / replicas x accumulate)."""
    optimization = config.optimization
    if not optimization.epochs:
        return optimization.max_steps or DEFAULT_MAX_STEPS
    micro_batches = sum(len(ends) for ends in prepared.shard_batches(
        budget.micro_batch, config.data.max_length,
        bucket_boundaries=shapes.get("bucket_boundaries")))
    return max(1, math.ceil(optimization.epochs * micro_batches
                            / (replicas * budget.accumulate)))


class TrainingLoop:
    """The callbacks of `model.fit` in a run (either backend), and what they report.

    Keras "epochs" are `interval` optimizer steps (the gcd of the checkpoint and validation
    cadences); the callbacks stop by steps, minutes, patience or NaN (`agree`: every worker
    together), log progress and metrics, and write checkpoints and backups.
    """

    def __init__(self, config: TrainConfig, home: Path, state: dict[str, Any], started: float,
                 max_steps: int, agree):
        optimization = config.optimization
        self.max_steps, self.max_minutes, self.agree = max_steps, optimization.max_minutes, agree
        self.interval = math.gcd(config.output.checkpoint_every, config.validate_every)
        self.state = state
        max_seconds = optimization.max_minutes * 60 if optimization.max_minutes else None
        self.stopper = cb.StopAt(max_steps, max_seconds,
                                 elapsed_before=float(state.get("elapsed_seconds", 0.0)))
        self.throughput = cb.ThroughputLogger()
        self.checkpointer = cb.RunCheckpointer(
            home / run_directory.CHECKPOINT_DIR, home / run_directory.BACKUP_DIR,
            config.output.checkpoint_every, keep=config.evaluation.average_last,
            patience=config.evaluation.patience, stopper=self.stopper, state=state,
            cooldown_from=cooldown_start(max_steps, optimization.cooldown))
        (home / run_directory.LOG_DIR).mkdir(parents=True, exist_ok=True)
        self.callbacks = [
            cb.FirstStepTimer(started, _LOG.info), self.stopper, self.throughput,
            self.checkpointer, cb.ProgressLog(self.stopper, _LOG.info),
            keras.callbacks.TerminateOnNaN(),
            cb.MetricsLog(str(home / run_directory.LOG_DIR / "metrics.csv"), append=True)]
        if importlib.util.find_spec("tensorboard") is not None and tensorflow_installed():
            self.callbacks.append(cb.StepTensorBoard(str(home / run_directory.LOG_DIR)))
        else:  # tf.summary needs TensorFlow and tensorboard; the CSV log has the same numbers
            _LOG.info("note: tensorboard is not installed; metrics go to logs/metrics.csv only")
        # Last: every stop is taken by all workers together, between optimizer updates.
        self.callbacks.append(cb.AgreedStop(agree, self.stopper))

    def describe(self, model, preset: str, prepared, budget: StepBudget, vocab_size: int,
                 step: int, precision: str, jit: bool) -> str:
        """The log line that starts training."""
        limit = f"{self.max_steps:,} steps" + (f" or {self.max_minutes:g} min"
                                               if self.max_minutes else "")
        return (f"training {model.count_params():,} parameters ({preset} preset, "
                f"vocabulary {vocab_size}) on {prepared.describe_pairs()}: {budget.describe()}; "
                f"{precision}, XLA {'on' if jit else 'off'}; " + (
                    f"resuming at step {step:,}, until {limit}" if step else f"until {limit}")
                + f"; a line every {self.interval} steps")

    def done(self, step: int) -> bool:
        """Whether the run already ended (but was killed while evaluating): not trained
        further. (Agreed, as every stop: workers given different --max-minutes could
        disagree.)"""
        stopper = self.stopper
        return self.agree(bool(step >= self.max_steps or self.state.get("stopped_early") or (
            stopper.max_seconds is not None and stopper.elapsed_before >= stopper.max_seconds)))

    def outcome(self, model, done: bool) -> dict[str, Any]:
        """What `run.finish_run` reports of the training."""
        step, stopper, checkpointer = cb.global_step(model), self.stopper, self.checkpointer
        return {
            "step": step, "max_steps": self.max_steps, "diverged": checkpointer.diverged,
            "reason": stopper.reason or self.state.get("stop_reason") or f"reached step {step}",
            "elapsed": stopper.elapsed if not done else stopper.elapsed_before,
            # Training time of the run's earlier (interrupted) commands, part of "elapsed".
            "elapsed_before": stopper.elapsed_before,
            "tokens_per_sec": self.throughput.total_tokens / max(
                self.throughput.total_seconds, 1e-9),
            "best_val_loss": checkpointer.best_val_loss
            if math.isfinite(checkpointer.best_val_loss) else None,
            "best_step": checkpointer.best_step,
            "best_step_before_cooldown": checkpointer.best_before_cooldown
            if checkpointer.cooldown_from is not None else None,
            **loss_scaling_state(model.optimizer),
        }


def loss_scaling_state(optimizer) -> dict[str, Any]:
    """The loss scale and the updates it skipped (mixed_float16), else None for both."""
    if not hasattr(optimizer, "skipped_updates"):
        return {"loss_scale": None, "skipped_updates": None}
    return {"loss_scale": float(optimizer.dynamic_scale.numpy()),
            "skipped_updates": int(optimizer.skipped_updates.numpy())}
