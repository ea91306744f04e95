"""One training run's model and `model.fit` (5. Training), the middle of `run_training`.

Keras "epochs" here are fixed intervals of optimizer steps over an endless, seeded batch
stream (see `keras_transformer.training.callbacks`), which is what makes mid-run resumption exact.
With gradient accumulation (`--accumulate`, `--tokens-per-step`) Keras' steps are
micro-batches, `accumulate` of them per optimizer step (`keras_transformer.training.accumulation`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from keras_transformer import run_directory
from keras_transformer.cluster.keras_patches import build_for_distributed_fit
from keras_transformer.cluster.workers import Cluster, any_worker, check_same_settings
from keras_transformer.errors import UsageError
from keras_transformer.kernels import fused_kernels
from keras_transformer.training import backup, run_data
from keras_transformer.training import callbacks as cb
from keras_transformer.training.config import DEFAULT_MAX_STEPS, TrainConfig
from keras_transformer.training.loss_scaling import LossScaleOptimizer
from keras_transformer.training.losses import (
    GlobalTokenCrossEntropy,
    MaskedAccuracy,
    Perplexity,
)
from keras_transformer.training.optimizer import paper_adam
from keras_transformer.training.precision import (
    describe_precision,
    gpu_capabilities,
    resolve_jit,
    resolve_precision,
)
from keras_transformer.training.step_budget import StepBudget
from keras_transformer.training.trainer_model import build_trainer
from pipelines import storage
from pipelines.batching import make_batches, xla_bucket_boundaries
from pipelines.prepared import damaged_shard

_LOG = logging.getLogger("keras_transformer")


def train_model(config: TrainConfig, record: dict[str, Any], corpora: dict[str, Any],
                prepared, strategy, cluster: Cluster, budget: StepBudget, out: Path,
                home: Path, started: float) -> dict[str, Any]:
    """Pipelines, model and `model.fit`; returns what `run.finish_run` reports.

    `cluster` is the `TF_CONFIG` cluster `strategy` spans; `budget` spreads each optimizer
    step over replicas and accumulated micro-batches; Keras steps are micro-batches, every
    other count (schedule, checkpoints, resume) is of optimizer steps. `out` is the run
    directory (read for resuming), `home` where this worker writes (`out` on the chief, a
    scratch folder on other workers), `started` when the command started.
    """
    optimization, max_length = config.optimization, config.data.max_length
    keras.utils.set_random_seed(optimization.seed)
    gpus = len(tf.config.list_logical_devices("GPU"))
    precision = resolve_precision(optimization.precision, gpu_capabilities())
    jit = resolve_jit(optimization.jit_compile, gpus)
    fused = not jit and fused_kernels() is not None  # XLA-compiled steps use TF ops
    replicas, accumulate = strategy.num_replicas_in_sync, budget.accumulate
    # XLA compiles one step per batch shape: coarser buckets, every batch padded to its
    # bucket's full shape (pipelines.batching.xla_bucket_boundaries).
    shapes = dict(bucket_boundaries=xla_bucket_boundaries(max_length),
                  static_shapes=True) if jit else {}
    if jit:
        record["train_batch_shapes"] = len(prepared.static_shapes(
            budget.micro_batch, max_length, bucket_boundaries=shapes["bucket_boundaries"]))
        _LOG.info(f"XLA: the training batches come in {record['train_batch_shapes']} shapes "
                  "(each compiled once)")
    tokenizer = prepared.tokenizer()
    record.update(precision=precision, jit_compile=jit, replicas=replicas,
                  step_budget={**dataclasses.asdict(budget),
                               "tokens_per_step": budget.tokens_per_step},
                  tokenizer_vocab_size=tokenizer.vocab_size,
                  prepared={"directory": str(prepared.directory.resolve()),
                            "corpus_fingerprint": prepared.manifest["corpus_fingerprint"],
                            "pairs": prepared.pairs, "shards": prepared.num_shards})
    check_same_settings({**record["identity"], **{key: record[key] for key in (
        "precision", "jit_compile", "replicas", "step_budget")}}, cluster,
        config.cluster.join_timeout)
    run_data.check_resumed_data(out, record)
    storage.write_json(home / run_directory.CONFIG_FILE, record)

    with strategy.scope():
        model = build_trainer(**record["model"], dtype=precision)
        optimizer = paper_adam(model.config.d_model, optimization.warmup_steps,
                               optimization.lr_scale)
        if precision == "mixed_float16":  # steps skipped on overflow still count as steps
            optimizer = LossScaleOptimizer(optimizer,
                                           initial_scale=optimization.initial_loss_scale)
        model.compile(
            optimizer=optimizer,
            loss=GlobalTokenCrossEntropy(optimization.label_smoothing),
            metrics=[MaskedAccuracy(), Perplexity(), cb.TokenCount()],
            jit_compile=jit,
            accumulate_steps=accumulate,
        )
        if not model.optimizer.built:  # (accumulation builds it; building twice duplicates)
            model.optimizer.build(model.trainable_variables)
    # Resume: every worker restores the chief's backup (a shared filesystem is assumed) from
    # its newest intact generation; only the chief sets damaged files aside.
    state = backup.restore_backup(model, out, repair=cluster.is_chief)
    # A worker that read another generation (a read error the chief did not have) would
    # train other weights from another data position, silently.
    check_same_settings({"restored backup step": cb.global_step(model)}, cluster,
                        config.cluster.join_timeout, key="keras_transformer/restored_step",
                        advice="Every worker must resume from the chief's backup: is the run "
                               "directory the same shared path on every machine?")
    step = cb.global_step(model)

    batching = dict(tokenizer=tokenizer, tokens_per_batch=budget.global_micro_batch,
                    max_length=max_length, seed=optimization.seed, **shapes)
    contexts: list[tf.distribute.InputContext] = []

    def train_batches(context: tf.distribute.InputContext) -> tf.data.Dataset:
        contexts.append(context)
        # The stream is seeded and its shards' batch counts known, so a resumed run starts
        # exactly where the interrupted one was, reading one shard (no replay).
        per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
        return prepared.batches(tokens_per_batch=budget.global_micro_batch,
                                max_length=max_length, seed=optimization.seed,
                                input_context=context,
                                skip_batches=step * accumulate * per_pipeline, **shapes)

    train_data = strategy.distribute_datasets_from_function(train_batches)
    context = contexts[0]
    per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
    # Every worker must run the same number of validation steps (collectives), so all take
    # the longest shard's count, padding the others from the (repeated) stream.
    # Each pipeline's validation batches, built once (building one traces its functions:
    # ~0.3 s each, paid at every start), counted, sampled and iterated from the same object.
    val_batches = [make_batches(corpora["val"], shuffle=False, input_context=tf.distribute
                                .InputContext(context.num_input_pipelines, pipeline,
                                              context.num_replicas_in_sync), **batching)
                   for pipeline in range(context.num_input_pipelines)]
    val_steps = max(math.ceil(_count(batches) / per_pipeline) for batches in val_batches)
    # One pass (repeat=True would fill partial buckets from further passes), wrapped around
    # only to give every worker the same number of batches.
    val_data = strategy.distribute_datasets_from_function(
        lambda ctx: val_batches[ctx.input_pipeline_id].repeat().take(val_steps * per_pipeline))

    if optimization.epochs:  # micro-batches of one replica per epoch, / replicas x accumulate
        micro_batches = sum(len(ends) for ends in prepared.shard_batches(
            budget.micro_batch, max_length, bucket_boundaries=shapes.get("bucket_boundaries")))
        max_steps = max(1, math.ceil(optimization.epochs * micro_batches
                                     / (replicas * accumulate)))
    else:
        max_steps = optimization.max_steps or DEFAULT_MAX_STEPS
    validate_every = config.validate_every
    interval = math.gcd(config.output.checkpoint_every, validate_every)
    max_seconds = optimization.max_minutes * 60 if optimization.max_minutes else None
    stopper = cb.StopAt(max_steps, max_seconds,
                        elapsed_before=float(state.get("elapsed_seconds", 0.0)))
    throughput = cb.ThroughputLogger()
    checkpointer = cb.RunCheckpointer(
        home / run_directory.CHECKPOINT_DIR, home / run_directory.BACKUP_DIR,
        config.output.checkpoint_every, keep=config.evaluation.average_last,
        patience=config.evaluation.patience, stopper=stopper, state=state)
    (home / run_directory.LOG_DIR).mkdir(parents=True, exist_ok=True)
    callbacks = [cb.FirstStepTimer(started, _LOG.info), stopper, throughput, checkpointer,
                 cb.ProgressLog(stopper, _LOG.info),
                 keras.callbacks.TerminateOnNaN(),
                 cb.MetricsLog(str(home / run_directory.LOG_DIR / "metrics.csv"), append=True)]
    if importlib.util.find_spec("tensorboard") is not None:
        callbacks.append(cb.StepTensorBoard(str(home / run_directory.LOG_DIR)))
    else:  # tf.summary needs the tensorboard package; the CSV log has the same numbers
        _LOG.info("note: tensorboard is not installed; metrics go to logs/metrics.csv only")
    # Last: every stop is taken by all workers together, between optimizer updates.
    agree = any_worker(strategy) or bool
    callbacks.append(cb.AgreedStop(agree, stopper))
    limit = f"{max_steps:,} steps" + (f" or {optimization.max_minutes:g} min"
                                      if optimization.max_minutes else "")
    _LOG.info(f"training {model.count_params():,} parameters ({config.model.preset} preset, "
              f"vocabulary {tokenizer.vocab_size}) on {prepared.describe_pairs()}: "
              f"{budget.describe()}; "
              f"{describe_precision(optimization.precision, precision, gpus)}, "
              f"XLA {'on' if jit else 'off'}; " + (
                  f"resuming at step {step:,}, until {limit}" if step else f"until {limit}")
              + f"; a line every {interval} steps")
    build_for_distributed_fit(model, next(iter(val_batches[context.input_pipeline_id])))
    # A run that already ended (but was killed while evaluating) is not trained further.
    # (Agreed, as every stop: workers given different --max-minutes could disagree.)
    done = agree(bool(step >= max_steps or state.get("stopped_early") or (
        stopper.max_seconds is not None and stopper.elapsed_before >= stopper.max_seconds)))
    if not done:
        try:
            model.fit(
                train_data, epochs=math.ceil(max_steps / interval),
                initial_epoch=step // interval, steps_per_epoch=interval * accumulate,
                validation_data=val_data, validation_freq=validate_every // interval,
                callbacks=callbacks,
                # Keras' own "Epoch 3/42" lines only with --verbose: ProgressLog counts steps.
                verbose=2 if config.output.verbose else 0, shuffle=False,
            )
        except tf.errors.OpError as error:
            # A shard damaged after its checksum was verified (the input pipeline's range
            # check): one line naming it, not an op traceback.
            damaged = damaged_shard(error)
            if damaged is None:
                raise
            raise UsageError(str(damaged)) from None
    step = cb.global_step(model)
    return {
        "step": step, "diverged": checkpointer.diverged,
        "reason": stopper.reason or state.get("stop_reason") or f"reached step {step}",
        "elapsed": stopper.elapsed if not done else stopper.elapsed_before,
        "tokens_per_sec": throughput.total_tokens / max(throughput.total_seconds, 1e-9),
        "best_val_loss": checkpointer.best_val_loss
        if math.isfinite(checkpointer.best_val_loss) else None,
        "best_step": checkpointer.best_step, "replicas": replicas,
        "workers": cluster.num_workers,
        "precision": precision, "jit_compile": jit,
        "fused_kernels": fused, **loss_scaling_state(model.optimizer),
    }


def loss_scaling_state(optimizer) -> dict[str, Any]:
    """The loss scale and the updates it skipped (mixed_float16), else None for both."""
    if not hasattr(optimizer, "skipped_updates"):
        return {"loss_scale": None, "skipped_updates": None}
    return {"loss_scale": float(optimizer.dynamic_scale.numpy()),
            "skipped_updates": int(optimizer.skipped_updates.numpy())}


def _count(dataset) -> int:
    """Number of elements of a finite dataset."""
    return int(dataset.reduce(0, lambda count, _: count + 1))
