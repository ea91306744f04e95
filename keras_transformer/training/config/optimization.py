"""`OptimizationConfig`: 5.3 Adam and its warmup schedule, 5.4 label smoothing, when to stop,
precision and the backend."""

from __future__ import annotations

import dataclasses

from keras_transformer.training.config.fields import fraction, non_negative, positive, setting
from keras_transformer.training.keras_backend import BACKENDS
from keras_transformer.training.precision import JIT_CHOICES, PRECISIONS

DEFAULT_MAX_STEPS = 100_000  # paper, base model; normally --max-minutes or --epochs ends first


@dataclasses.dataclass
class OptimizationConfig:
    """5.3 Adam with the warmup schedule, 5.4 label smoothing, when to stop, precision."""

    label_smoothing: float = setting(0.1, "epsilon_ls", fraction)
    warmup_steps: int = setting(4000, "learning rate warmup (paper: 4000; fewer suit short CPU "
                                 "runs)", positive)
    lr_scale: float = setting(1.0, "multiplies the paper's learning rate schedule", positive)
    max_steps: int | None = setting(None, f"optimizer steps (default {DEFAULT_MAX_STEPS} "
                                     "unless --epochs)", positive)
    epochs: float | None = setting(None, "passes over the training data (converted to steps)",
                                    positive)
    max_minutes: float | None = setting(None, "wall-clock budget for training "
                                         "(evaluation/export come after)", positive)
    cooldown: float = setting(
        0.0, "the last fraction of the steps over which the rate falls linearly to 0 (after "
        "the paper's schedule; --recipe auto: 0.2); 0 = the paper's schedule alone", fraction)
    budget_minutes: float | None = setting(
        None, "--recipe auto: minutes for the whole command (data, measuring this machine, "
        "training, val choices, test, export); the steps they hold are measured once and "
        "recorded, so a resumed run keeps them (docs/auto_recipe.md)", positive)
    budget_steps: int | None = setting(
        None, "--recipe auto: optimizer steps instead of minutes (the same run on any "
        "machine)", positive)
    assume_step_seconds: float | None = setting(
        None, "--recipe auto: seconds of one training step, instead of measuring them (to plan "
        "for another machine with --dry-run; the preset is then not stepped down)", positive)
    seed: int = setting(0, "seeds initialization, shuffling and the vocabulary", non_negative)
    precision: str = setting(
        "auto", "auto: mixed_bfloat16 on GPUs of compute capability >= 8.0 and on CPUs with "
        "AVX512_BF16/AMX, mixed_float16 (dynamic loss scaling) on older GPUs, float32 "
        "otherwise", choices=PRECISIONS)
    initial_loss_scale: float = setting(
        2.0**15, "mixed_float16 only: the dynamic loss scale's start. A step whose gradients "
        "overflow changes nothing and halves it, and still counts as a step (results.json: "
        "skipped_updates)", positive)
    jit_compile: str = setting(
        "auto", "XLA-compile the train step: auto = on with GPUs, off on CPUs (slower there: "
        "BENCHMARKS.md). With XLA, batches come in a bounded set of shapes (coarser buckets, "
        "full batches), each compiled once", choices=JIT_CHOICES)
    backend: str = setting(
        "tensorflow", "Keras backend of the training: jax trains (XLA always) from the prepared "
        "folder with numpy input, then scoring and export run under TensorFlow (README: which "
        "backend does what)", choices=BACKENDS)
