"""5 Training: the `Transformer` with this project's training step, as a subclass.

`TransformerTrainer` is the model `python -m keras_transformer.train` fits. On top of Keras'
own `compile`/`fit` it adds gradient accumulation (5.1's ~25,000-token steps on fewer devices:
`keras_transformer.training.accumulation`) and, under mixed_float16, a loss scaling whose
skipped updates still count as steps and whose replicas skip together
(`keras_transformer.training.loss_scaling`).

Why a subclass and not a wrapper around a `Transformer`: it has the very same layers, so the
same weight paths. A checkpoint written by either class loads into the other, decoding and
export (`translate_texts`, SavedModel, CTranslate2) take it as a `Transformer`, and its own
`.keras` file reloads compiled. The split is keras-hub's (a backbone holds the architecture,
a task owns `compile` and the train step) and Keras' own (`keras.Model` is a `Layer` plus a
`Trainer`): `keras_transformer.model` holds the architecture and imports nothing of training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any

import keras

from keras_transformer.kernels.custom_gradient import release_custom_gradients
from keras_transformer.model.config import transformer_config
from keras_transformer.model.transformer import Transformer
from keras_transformer.training.loss_scaling import LossScaleOptimizer
from keras_transformer.training.precision import float16_on_this_cpu


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerTrainer(Transformer):
    """A `Transformer` whose `compile` takes `accumulate_steps` and which, under
    mixed_float16, scales its loss with `keras_transformer.training.loss_scaling`.

    Args: as `Transformer` (the fields of `TransformerConfig`, `dtype` and the usual
        `keras.Model` kwargs); `build_trainer` builds one from a preset.

    Inputs:
        {"source": int32 (batch, source_length), "target": int32 (batch, target_length)}, the
        target being shifted right (BOS first). Id 0 is padding.

    Outputs:
        float32 logits (batch, target_length, vocab_size), whatever the compute dtype.
    """

    def get_compile_config(self) -> dict[str, Any]:
        """`keras.Model.get_compile_config`, plus `accumulate_steps`."""
        config = super().get_compile_config()
        if config and getattr(self, "_accumulator", None) is not None:
            config["accumulate_steps"] = self._accumulator.steps
        return config

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compiles a loaded model as it was saved (Keras' own skips a custom `compile`)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def compile(self, *args, accumulate_steps: int = 1, **kwargs) -> None:
        """`keras.Model.compile`, plus gradient accumulation for `fit`.

        Under mixed_float16 (unless `auto_scale_loss=False`), an optimizer that is not a
        `keras.optimizers.LossScaleOptimizer` is wrapped in our `LossScaleOptimizer`.

        Args:
            accumulate_steps: micro-batches per optimizer update (fairseq's
                `--update-freq`); see `keras_transformer.training.accumulation`. With N > 1
                the loss must be a `LabelSmoothedCrossEntropy` (it normalises by the tokens of
                all N micro-batches), and `fit`'s steps are micro-batches while the
                optimizer's `iterations` count updates.
            *args, **kwargs: as `keras.Model.compile`.

        Raises:
            ValueError: `accumulate_steps` is not a positive integer, or the optimizer (or a
                `LossScaleOptimizer`'s inner one) has Keras' own `gradient_accumulation_steps`
                (use `accumulate_steps` instead).
        """
        if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int) or (
                accumulate_steps < 1):
            raise ValueError(f"accumulate_steps must be a positive integer, got "
                             f"{accumulate_steps!r}")
        self._accumulator = None
        if args and "optimizer" in kwargs:
            raise TypeError("compile() got the optimizer both by position and by keyword")
        optimizer = keras.optimizers.get(kwargs.pop("optimizer", args[0] if args else "rmsprop"))
        _refuse_keras_gradient_accumulation(optimizer)
        if (self.dtype_policy.name == "mixed_float16" and kwargs.get("auto_scale_loss", True)
                and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)):
            # Instead of keras' own (which compile would add): skipped updates count as
            # steps and replicas skip together (keras_transformer.training.loss_scaling).
            optimizer = LossScaleOptimizer(optimizer)
        super().compile(optimizer, *args[1:], **kwargs)
        if accumulate_steps > 1:
            self._accumulator = _accumulator(self, accumulate_steps)

    def fit(self, *args, **kwargs):
        """`keras.Model.fit`; with `accumulate_steps` > 1 each `fit` starts a fresh update.

        A `tf.data.Dataset` is shuffled by its pipeline (`make_batches`), so `shuffle`
        defaults to False for one (Keras would warn that it ignores its default True).
        Under mixed_float16 on a CPU whose TensorFlow sends float16 to oneDNN, the fit runs
        with TensorFlow's graph remapper off (`training.precision.float16_on_this_cpu`). The
        optimizer is built before the step is traced (`_build_optimizer_before_tracing`).
        """
        if getattr(self, "_accumulator", None) is not None:
            self._accumulator.reset()
        _build_optimizer_before_tracing(self)
        data = args[0] if args else kwargs.get("x")
        tf = sys.modules.get("tensorflow")  # a tf.data.Dataset means TensorFlow is imported
        if tf is not None and isinstance(data, tf.data.Dataset | tf.distribute.DistributedDataset):
            kwargs.setdefault("shuffle", False)
        with _float16_on_this_cpu(self):
            return super().fit(*args, **kwargs)

    def train_step(self, *args, **kwargs):
        """Keras' own train step. Under TensorFlow, the graph it is traced in is then
        released from TensorFlow's gradient registry
        (`kernels.custom_gradient.release_custom_gradients`): every Keras optimizer sums the
        gradients with tf.distribute's all-reduce, a `tf.custom_gradient` that TensorFlow
        registers for good, so without this each traced step, and the model it holds, would
        stay in memory for the life of the process whatever the optimizer (~120 MiB a `small`
        model trained and dropped with Keras' `"adam"`: BENCHMARKS.md). Not covered: Keras' own
        `keras.optimizers.LossScaleOptimizer` passed explicitly (this project's, which
        `compile` chooses under mixed_float16, releases its update branch itself)."""
        logs = super().train_step(*args, **kwargs)
        if keras.backend.backend() == "tensorflow":
            release_custom_gradients()
        return logs

    # Under mixed_float16 on a CPU that sends float16 to oneDNN, each of Keras' other entry
    # points also runs with the remapper off, as `fit` does (`--recipe auto` times its
    # calibration steps with `train_on_batch`).
    def evaluate(self, *args, **kwargs):
        """`keras.Model.evaluate` (see `fit` on mixed_float16)."""
        with _float16_on_this_cpu(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """`keras.Model.predict` (see `fit` on mixed_float16)."""
        with _float16_on_this_cpu(self):
            return super().predict(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """`keras.Model.train_on_batch` (see `fit` on mixed_float16 and the optimizer)."""
        _build_optimizer_before_tracing(self)
        with _float16_on_this_cpu(self):
            return super().train_on_batch(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        """`keras.Model.test_on_batch` (see `fit` on mixed_float16)."""
        with _float16_on_this_cpu(self):
            return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, *args, **kwargs):
        """`keras.Model.predict_on_batch` (see `fit` on mixed_float16)."""
        with _float16_on_this_cpu(self):
            return super().predict_on_batch(*args, **kwargs)

    def load_weights(self, *args, **kwargs):
        """`keras.Model.load_weights`; a partly accumulated update is discarded."""
        if getattr(self, "_accumulator", None) is not None:
            self._accumulator.reset()
        return super().load_weights(*args, **kwargs)

    @property
    def accumulate_steps(self) -> int:
        """Micro-batches per optimizer update (1 unless compiled with more)."""
        accumulator = getattr(self, "_accumulator", None)
        return 1 if accumulator is None else accumulator.steps

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last optimizer update (0 between updates)."""
        accumulator = getattr(self, "_accumulator", None)
        return 0 if accumulator is None else accumulator.pending

    def make_train_function(self, force: bool = False):
        """Keras' train function, or with `accumulate_steps` > 1 one call per micro-batch
        (`make_train_function` of `accumulation_tensorflow.GradientAccumulator` or
        `accumulation_jax.JaxGradientAccumulator`)."""
        if getattr(self, "_accumulator", None) is None:
            return super().make_train_function(force)
        if self.train_function is not None and not force:
            return self.train_function
        if self.steps_per_execution != 1:
            raise ValueError("accumulate_steps > 1 needs steps_per_execution=1 (each call of "
                             "the train function is one micro-batch)")
        if keras.backend.backend() == "jax":
            self.train_function = self._accumulator.make_train_function(self)
            return self.train_function
        micro = self._make_function(lambda data: self._accumulator.micro_step(self, data))
        self.train_function = self._accumulator.make_train_function(self, micro)
        return self.train_function


def _float16_on_this_cpu(model: TransformerTrainer):
    """`float16_on_this_cpu` for the model's dtype policy and TensorFlow's GPUs (a no-op
    context on other backends, whose XLA has no such fusion)."""
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext(False)
    return float16_on_this_cpu(model.dtype_policy.name)


def _build_optimizer_before_tracing(model: TransformerTrainer) -> None:
    """Builds the optimizer's variables now, on the model's trainable variables, where Keras'
    TensorFlow trainer would build them inside the first traced step.

    Without a distribution strategy Keras defers the build to the step's trace (under a
    strategy it builds them first, as here). A variable created inside a `tf.function` gets
    its initialization guarded by a `tf.cond`, one per variable (425 in a `tiny` accumulation
    test's fits): 11.7 s of tracing against 0.4 s built first (BENCHMARKS.md). The variables
    are the same ones, on the same trainable variables, as Keras' own build at the first
    `apply` would make them.
    """
    optimizer = getattr(model, "optimizer", None)  # None or absent before `compile`
    if (keras.backend.backend() != "tensorflow" or optimizer is None or optimizer.built
            or not model.built or getattr(model, "_distribute_strategy", None) is not None):
        return
    optimizer.build(model.trainable_variables)


def _accumulator(model: TransformerTrainer, steps: int):
    """The gradient accumulator of the Keras backend in use (imported only there)."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_transformer.training.accumulation_tensorflow import GradientAccumulator

        return GradientAccumulator(model, steps)
    if backend == "jax":
        from keras_transformer.training.accumulation_jax import JaxGradientAccumulator

        return JaxGradientAccumulator(model, steps)
    raise ValueError(f"gradient accumulation runs under the tensorflow and jax backends, "
                     f"not {backend!r}; set KERAS_BACKEND to one of them.")


def _refuse_keras_gradient_accumulation(optimizer: keras.optimizers.Optimizer) -> None:
    """Raises ValueError if `optimizer`, or the inner optimizer of a loss-scale optimizer,
    accumulates gradients itself (Keras' `gradient_accumulation_steps`)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    for candidate in (optimizer, inner):
        steps = getattr(candidate, "gradient_accumulation_steps", None)
        if candidate is not None and steps:
            raise ValueError(
                f"The optimizer {type(candidate).__name__} has gradient_accumulation_steps="
                f"{steps}: Keras' own gradient accumulation averages the micro-batches' mean "
                "losses (a micro-batch with few target tokens weighs as much as a full one) "
                "and fails under MirroredStrategy (keras-team/keras#20582). Leave the "
                "optimizer's gradient_accumulation_steps unset and pass "
                f"accumulate_steps={steps} to compile (`python -m keras_transformer.train "
                f"--accumulate {steps}`), which normalises by the target tokens of all "
                "micro-batches.")


def build_trainer(preset: str = "base", dtype=None, flash_attention: bool = False,
                  **overrides: Any) -> TransformerTrainer:
    """Builds a `TransformerTrainer` from a preset and overrides, as `build_transformer`.

    Example:
        model = build_trainer("small", vocab_size=8000, dtype="mixed_float16")
        model.compile(paper_adam(256), loss=GlobalTokenCrossEntropy(0.1), accumulate_steps=4)

    Raises:
        ValueError: unknown preset or field, d_model not divisible by num_heads, vocab < 4, ...
    """
    config = transformer_config(preset, **overrides)
    return TransformerTrainer(**dataclasses.asdict(config), dtype=dtype,
                              flash_attention=flash_attention)
