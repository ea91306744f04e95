"""One training run's model and `model.fit` (5. Training), the middle of `run_training`.

Keras "epochs" here are fixed intervals of optimizer steps over an endless, seeded batch
stream (see `keras_transformer.training.callbacks`), which is what makes mid-run resumption exact.
With gradient accumulation (`--accumulate`, `--tokens-per-step`) Keras' steps are
micro-batches, `accumulate` of them per optimizer step (`keras_transformer.training.accumulation`).
"""

from __future__ import annotations

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
from keras_transformer.training import backup
from keras_transformer.training import callbacks as cb
from keras_transformer.training.config import TrainConfig
from keras_transformer.training.fine_tuning import load_initial_weights, read_initial_run
from keras_transformer.training.precision import describe_precision, training_precision
from keras_transformer.training.step_budget import StepBudget
from keras_transformer.training.training_loop import (
    TrainingLoop,
    compiled_trainer,
    record_training,
    total_steps,
)
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
    precision, jit, gpus = training_precision(optimization.precision,
                                              optimization.jit_compile, "tensorflow")
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
    record_training(record, prepared, budget, tokenizer.vocab_size, precision=precision,
                    jit_compile=jit, replicas=replicas)
    check_same_settings({**record["identity"], **{key: record[key] for key in (
        "precision", "jit_compile", "replicas", "step_budget")}}, cluster,
        config.cluster.join_timeout)
    run_directory.check_resumed_data(out, record)
    recorded = out / run_directory.CONFIG_FILE
    if recorded.is_file() and run_directory.read_json(recorded).get("backend") == "jax":
        record["backend"] = "jax"  # finishing a JAX run: it was trained there
    storage.write_json(home / run_directory.CONFIG_FILE, record)

    max_steps = total_steps(config, prepared, budget, replicas, shapes)
    with strategy.scope():
        model = compiled_trainer(record, optimization, precision, jit, accumulate, max_steps)
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
    if step == 0 and config.model.init_from:  # fine-tuning: the old run's weights
        load_initial_weights(model, read_initial_run(config.model.init_from))

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

    agree = any_worker(strategy) or bool
    loop = TrainingLoop(config, home, state, started, max_steps, agree)
    _LOG.info(loop.describe(model, config.model.preset, prepared, budget, tokenizer.vocab_size,
                            step,
                            describe_precision(optimization.precision, precision, gpus), jit))
    build_for_distributed_fit(model, next(iter(val_batches[context.input_pipeline_id])))
    done = loop.done(step)
    interval, validate_every = loop.interval, config.validate_every
    if not done:
        try:
            model.fit(
                train_data, epochs=math.ceil(max_steps / interval),
                initial_epoch=step // interval, steps_per_epoch=interval * accumulate,
                validation_data=val_data, validation_freq=validate_every // interval,
                callbacks=loop.callbacks,
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
    return {**loop.outcome(model, done), "replicas": replicas,
            "workers": cluster.num_workers, "precision": precision, "jit_compile": jit,
            "fused_kernels": fused}


def _count(dataset) -> int:
    """Number of elements of a finite dataset."""
    count = tf.autograph.experimental.do_not_convert(lambda count, _: count + 1)
    return int(dataset.reduce(0, count))
