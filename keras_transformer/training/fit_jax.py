"""One training run's `model.fit` under Keras' JAX backend (`--backend jax`), beside `fit.py`.

The same run as under TensorFlow (`fit.train_model`): the same compiled `TransformerTrainer`
(`training_loop.compiled_trainer`), the same callbacks, checkpoints, backups and stops
(`training_loop.TrainingLoop`), the same batches in the same order. What differs is the input and the
devices: the batches come from the prepared folder through numpy
(`pipelines.numpy_batches`, bit-identical to the tf.data pipeline's), so training needs no
TensorFlow; every step is XLA-compiled over the bounded batch shapes of
`pipelines.batching.xla_bucket_boundaries`; and one process trains on one device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import keras

from keras_transformer import run_directory
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
from pipelines.batch_plan import xla_bucket_boundaries
from pipelines.numpy_batches import prepared_batches, validation_batches

_LOG = logging.getLogger("keras_transformer")


def train_model(config: TrainConfig, record: dict[str, Any], prepared, validation,
                budget: StepBudget, out: Path, started: float) -> dict[str, Any]:
    """Model and `model.fit` on JAX; returns what `run.finish_run` reports.

    Args:
        config: the run's settings (`config.optimization.backend == "jax"`).
        record: config.json's record, completed here as `fit.train_model` does.
        prepared: the prepared training folder (`pipelines.prepared_folder.PreparedFolder`).
        validation: the validation batches, a list of numpy `(features, labels)`.
        budget: the step's token budget (one replica: the callers build it for one device).
        out: the run directory.
        started: when the command started (`time.perf_counter()`).
    """
    optimization, max_length = config.optimization, config.data.max_length
    keras.utils.set_random_seed(optimization.seed)
    precision, _, gpus = training_precision(optimization.precision, optimization.jit_compile,
                                            "jax")
    # XLA always: JAX has no other way to run a step fast; its shapes are bounded.
    shapes = dict(bucket_boundaries=xla_bucket_boundaries(max_length), static_shapes=True)
    accumulate = budget.accumulate
    record["train_batch_shapes"] = len(prepared.static_shapes(
        budget.micro_batch, max_length, bucket_boundaries=shapes["bucket_boundaries"]))
    record_training(record, prepared, budget, prepared.vocab_size, precision=precision,
                    jit_compile=True, replicas=1, backend="jax")
    run_directory.check_resumed_data(out, record)
    storage.write_json(out / run_directory.CONFIG_FILE, record)

    max_steps = total_steps(config, prepared, budget, 1, shapes)
    model = compiled_trainer(record, optimization, precision, True, accumulate, max_steps)
    state = backup.restore_backup(model, out, repair=True)
    step = cb.global_step(model)
    if step == 0 and config.model.init_from:  # fine-tuning: the old run's weights
        load_initial_weights(model, read_initial_run(config.model.init_from))
    # The seeded stream of the TensorFlow run, resumed at its batch (no replay).
    train_data = prepared_batches(prepared, tokens_per_batch=budget.global_micro_batch,
                                  max_length=max_length, seed=optimization.seed,
                                  skip_batches=step * accumulate, **shapes)
    loop = TrainingLoop(config, out, state, started, max_steps, bool)
    _LOG.info(loop.describe(model, config.model.preset, prepared, budget, prepared.vocab_size,
                            step,
                            describe_precision(optimization.precision, precision, gpus),
                            True) + f"; Keras on JAX ({keras.backend.backend()}, "
              f"{_devices()})")
    done = loop.done(step)
    if not done:
        interval = loop.interval
        model.fit(
            train_data, epochs=-(-max_steps // interval), initial_epoch=step // interval,
            steps_per_epoch=interval * accumulate,
            validation_data=_Batches(validation),
            validation_freq=config.validate_every // interval, callbacks=loop.callbacks,
            verbose=2 if config.output.verbose else 0, shuffle=False)
    return {**loop.outcome(model, done), "replicas": 1, "workers": 1, "precision": precision,
            "jit_compile": True, "fused_kernels": False}


def validation(config: TrainConfig, corpora: dict[str, Any] | None, prepared,
               budget: StepBudget) -> list:
    """The validation batches as numpy, those of the TensorFlow run (one pass, no shuffling,
    the XLA shapes): from the prepared folder's val split when it holds one
    (`pipelines.numpy_batches.validation_batches`, no TensorFlow), else tokenized from
    `corpora["val"]` by TensorFlow's pipeline (a folder prepared by an earlier version)."""
    max_length = config.data.max_length
    shapes = dict(tokens_per_batch=budget.global_micro_batch, max_length=max_length,
                  seed=config.optimization.seed,
                  bucket_boundaries=xla_bucket_boundaries(max_length), static_shapes=True)
    try:
        prepared.check_validation(config.data.val_split)  # the run's val split, prepared
    except ValueError:  # PreparedError: none, or another split's
        if corpora is None:  # no TensorFlow here to tokenize it: say what is missing
            raise
        from pipelines.batching import make_batches  # TensorFlow's input pipeline

        batches = make_batches(corpora["val"], prepared.tokenizer(), shuffle=False, **shapes)
        return list(batches.as_numpy_iterator())
    return validation_batches(prepared, **shapes)


def _devices() -> str:
    import jax

    devices = jax.local_devices()
    return f"{len(devices)} {devices[0].platform} device{'s' if len(devices) > 1 else ''}"


class _Batches(keras.utils.PyDataset):
    """A list of numpy batches as a Keras dataset: iterated in full at every validation."""

    def __init__(self, batches: list):
        super().__init__()
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        return self.batches[index]
