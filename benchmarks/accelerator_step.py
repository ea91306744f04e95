"""The step part of the accelerator check of issue 36 (`benchmarks/accelerator_check.py`): the
device's bfloat16 matmul peak measured through jnp, and the project's real trainer step
(`TransformerTrainer` compiled as `fit.py` does, trained with `model.fit`) of each preset, or
candidate `preset+change` (`STEP_CHANGES`), on synthetic tokens: compile time, median step time
over windows of steps, target tokens/s and TFLOP/s; with `--profile`, where the device time
goes (`benchmarks/device_trace.py`). The PyTorch peer (`accelerator_torch.py`) times its step
on the same synthetic batches, FLOP count and windows.

Runs in the step worker's process (and the warmers'), under Keras' JAX backend; Keras and JAX
are imported there only.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from benchmarks.accelerator_common import (
    STEP_SHAPES,
    Results,
    brief,
    jax_device,
    running_record,
    say,
    seconds_left,
)

# Candidates for a faster step (issue 36's aim), each a change to a preset's step, written
# `preset+change+...` in --presets (the step part only): what each saves, measured alone.
STEP_CHANGES = {
    "flash": "attention by key lengths and a causal flag: cuDNN's fused kernel "
             "(keras_transformer/layers/attention_jax.py)",
    "dropout0": "no dropout (an upper bound on what cheaper dropout masks can save)",
    "vocab8000": "an 8,000 vocabulary (an upper bound on what a fused output layer and loss "
                 "can save; MFU counts the smaller output layer's FLOPs)",
    "autodiffloss": "the loss's gradient by JAX's autodiff, as before the closed form of "
                    "keras_transformer/training/losses_jax.py: what that form saves",
    "separatestats": "the loss's and the metrics' statistics of the logits as separate "
                     "reductions, as on CPUs (losses_jax.token_statistics): what their one "
                     "pass saves",
}


def synthetic_batch(batch: int, source_length: int, target_length: int, vocab_size: int,
                    seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Random pairs without padding: source ending in EOS, target BOS-first, labels the
    target shifted left."""
    from pipelines.constants import BOS_ID, EOS_ID

    rng = np.random.default_rng(seed)
    source = rng.integers(4, vocab_size, (batch, source_length), dtype=np.int32)
    source[:, -1] = EOS_ID
    target = rng.integers(4, vocab_size, (batch, target_length + 1), dtype=np.int32)
    target[:, 0] = BOS_ID
    target[:, -1] = EOS_ID
    return {"source": source, "target": target[:, :-1]}, target[:, 1:].copy()


def step_flops(preset: str, batch: int, source_length: int, target_length: int,
               vocab_size: int) -> float:
    from benchmarks.flops import train_step_flops
    from keras_transformer.model.config import transformer_config

    config = transformer_config(preset, vocab_size=vocab_size)
    return train_step_flops(batch, source_length, target_length, config.num_layers,
                            config.d_model, config.d_ff, vocab_size)


def step_timing(window_seconds: list[float], window: int, batch: int, target_length: int,
            flops: float) -> dict[str, Any]:
    step = statistics.median(window_seconds) / window
    return {"step_seconds": step, "window_step_seconds": [s / window for s in window_seconds],
            "target_tokens_per_second": batch * target_length / step,
            "flops_per_step": flops, "tflops_per_second": flops / step / 1e12}


def jax_matmul_peak(sizes: list[int], flops: float, repeats: int = 5) -> dict[str, Any]:
    """bfloat16 FLOP/s of size x size matmuls through jnp (float32 accumulation): per size
    the median of `repeats` timings of chained products (about `flops` FLOPs each), and the
    best size's."""
    import jax
    import jax.numpy as jnp

    results = {}
    for size in sizes:
        key_a, key_b = jax.random.split(jax.random.PRNGKey(size))
        a = jax.random.normal(key_a, (size, size), jnp.bfloat16)
        b = jax.random.normal(key_b, (size, size), jnp.bfloat16)
        calls = max(1, min(50, int(flops // (2 * size**3))))

        @jax.jit
        def chained(a, b, calls=calls):
            def body(_, carry):
                return (carry @ b) * jnp.bfloat16(0.01)  # stays finite
            return jax.lax.fori_loop(0, calls, body, a)

        chained(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            chained(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        results[str(size)] = 2.0 * size**3 * calls / statistics.median(times) / 1e12
    best = max(results, key=results.get)
    return {"tflops_per_second": results[best], "best_size": int(best),
            "by_size_tflops_per_second": results, "dtype": "bfloat16", "through": "jnp.matmul"}


class _EpochTimes:
    """A Keras callback (built lazily: keras is imported in the workers only) recording the
    time and loss at each epoch's end (reading the loss waits for the epoch's last step)."""

    @staticmethod
    def make():
        import keras

        class EpochTimes(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times, self.losses = [], []

            def on_epoch_end(self, epoch, logs=None):
                self.losses.append(float((logs or {}).get("loss", float("nan"))))
                self.times.append(time.perf_counter())

        return EpochTimes()


def step_variant(name: str) -> tuple[str, list[str]]:
    """`preset+change+...` (see `STEP_CHANGES`) as (preset, changes).

    Raises:
        ValueError: an unknown preset or change.
    """
    preset, *changes = name.split("+")
    if preset not in STEP_SHAPES:
        raise ValueError(f"unknown preset {preset!r} in {name!r}: one of "
                         f"{', '.join(STEP_SHAPES)}")
    unknown = [change for change in changes if change not in STEP_CHANGES]
    if unknown:
        raise ValueError(f"unknown change(s) {', '.join(unknown)} in {name!r}: of "
                         f"{', '.join(STEP_CHANGES)}")
    return preset, changes


def keras_step(name: str, settings: dict[str, Any],
               deadline: float | None = None) -> dict[str, Any]:
    """The trainer step of preset (or variant: `step_variant`) `name` on synthetic tokens,
    trained with `model.fit`; traced too if `name` is in `settings["profile"]` and time is
    left before `deadline`."""
    import keras

    preset, changes = step_variant(name)
    batch, source_length, target_length, vocab_size = STEP_SHAPES[preset]
    if "vocab8000" in changes:
        vocab_size = 8000
    precision = settings["precision"]
    keras.utils.set_random_seed(0)
    model = compiled_trainer(preset, changes, vocab_size, precision)
    features, labels = synthetic_batch(batch, source_length, target_length, vocab_size)
    with statistics_as(changes):  # the step is traced in the first `fit`
        timed = _timed_fit(model, features, labels, settings)
    window_seconds = timed.pop("window_seconds")
    flops = step_flops(preset, batch, source_length, target_length, vocab_size)
    result = {"preset": preset, "changes": changes, "batch": batch,
              "source_length": source_length, "target_length": target_length,
              "vocab_size": vocab_size,
              "parameters": int(model.count_params()), "dropout": model.config.dropout,
              "precision": precision, **timed,
              **step_timing(window_seconds, settings["window"], batch, target_length, flops)}
    if name in settings.get("profile", ()):
        if deadline is not None and seconds_left(deadline) < settings["profile_min_seconds"]:
            result["device_trace"] = {"skipped": "time budget"}
        else:
            try:  # the step's timing above stands whatever the profiler does
                with statistics_as(changes):  # the same program if it were traced again
                    result["device_trace"] = profiled_steps(
                        model, _repeated(features, labels), name, settings)
            except Exception as error:  # noqa: BLE001 (recorded beside the timing)
                result["device_trace"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    del model
    keras.backend.clear_session()
    return result


def _repeated(features, labels):
    while True:
        yield features, labels


def _timed_fit(model, features, labels, settings: dict[str, Any]) -> dict[str, Any]:
    """A first `fit` step (compilation), then `settings["steps"]` steps in windows of
    `settings["window"]`, the first window a warm-up: times and losses."""
    window = settings["window"]
    windows = max(1, settings["steps"] // window)
    start = time.perf_counter()
    first = _EpochTimes.make()
    model.fit(_repeated(features, labels), steps_per_epoch=1, epochs=1, verbose=0,
              callbacks=[first], shuffle=False)
    compile_seconds = first.times[-1] - start
    timer = _EpochTimes.make()
    start = time.perf_counter()
    model.fit(_repeated(features, labels), steps_per_epoch=window, epochs=1 + windows,
              verbose=0, callbacks=[timer], shuffle=False)
    ends = [start, *timer.times]
    return {"first_step_seconds": compile_seconds, "warmup_window_seconds": ends[1] - ends[0],
            "window": window, "window_seconds": [b - a for a, b in zip(ends[1:], ends[2:],
                                                                        strict=False)],
            "timed_steps": window * (len(ends) - 2),
            "loss_first_step": first.losses[-1], "loss_last_window": timer.losses[-1],
            "finite": all(math.isfinite(v) for v in [*first.losses, *timer.losses])}


@contextlib.contextmanager
def statistics_as(changes: list[str]):
    """Under `separatestats`, `losses_jax.token_statistics` computes the statistics as
    separate reductions on every platform while the step is traced; otherwise nothing."""
    if "separatestats" not in changes:
        yield
        return
    from keras_transformer.training import losses_jax

    def separate(labels, logits):
        return losses_jax.TokenStatistics(*losses_jax._separate_reductions(
            losses_jax._label_ids(labels), logits))

    with mock.patch.object(losses_jax, "token_statistics", separate):
        yield


def compiled_trainer(preset: str, changes: list[str], vocab_size: int, precision: str):
    """`preset`'s `TransformerTrainer` with `changes` (`STEP_CHANGES`; `vocab8000` is the
    caller's `vocab_size`), compiled as a run compiles it: the paper's Adam,
    `GlobalTokenCrossEntropy(0.1)` (with autodiff's gradient under `autodiffloss`), the
    run's metrics."""
    from keras_transformer.training.losses import (
        GlobalTokenCrossEntropy,
        MaskedAccuracy,
        Perplexity,
    )
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    model = build_trainer(preset, vocab_size=vocab_size, dtype=precision,
                          flash_attention="flash" in changes,
                          **({"dropout": 0.0} if "dropout0" in changes else {}))
    loss = (_autodiff_loss_class()(0.1) if "autodiffloss" in changes
            else GlobalTokenCrossEntropy(0.1))
    model.compile(optimizer=paper_adam(model.config.d_model), loss=loss,
                  metrics=[MaskedAccuracy(), Perplexity()], accumulate_steps=1)
    return model


def trainer_state(model) -> tuple[list, list, list, list]:
    """The state Keras' JAX `train_step` takes, as `fit` passes it: the values of the
    trainable, non-trainable, optimizer and metrics variables."""
    return tuple([variable.value for variable in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))


def _autodiff_loss_class():
    """`GlobalTokenCrossEntropy` whose per-token loss is the portable `keras.ops` loss
    (`losses._portable_cross_entropy`: separate reductions), differentiated by JAX's
    autodiff, as the training loss was before `losses_jax`."""
    from keras import ops

    from keras_transformer.training.losses import (
        GlobalTokenCrossEntropy,
        _portable_cross_entropy,
        _real_tokens,
    )

    class AutodiffGlobalTokenCrossEntropy(GlobalTokenCrossEntropy):
        def sum_and_count(self, y_true, y_pred):
            weights = _real_tokens(y_true)
            losses = _portable_cross_entropy(y_true, y_pred, self.label_smoothing)
            return ops.sum(losses * weights), ops.sum(weights)

    return AutodiffGlobalTokenCrossEntropy


def profiled_steps(model, batches, name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings["profile_steps"]` more steps of a compiled model under JAX's profiler: where
    the device time goes (`benchmarks/device_trace.py`). The trace stays in the log folder
    (`trace_<name>/`) for TensorBoard or Perfetto when it is small enough to bring back."""
    import jax

    from benchmarks.device_trace import summarise

    folder = Path(settings["trace_dir"]) / f"trace_{name.replace('+', '_')}"
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        model.fit(batches, steps_per_epoch=settings["profile_steps"], epochs=1, verbose=0,
                  shuffle=False)
    summary = summarise(folder, top=settings["profile_top"])
    summary["steps"] = settings["profile_steps"]
    for path in folder.rglob("*"):  # bring back the Perfetto trace only, if small
        if path.is_file() and (not path.name.startswith("perfetto_trace")
                               or path.stat().st_size > settings["profile_keep_bytes"]):
            path.unlink()
    return summary


def step_worker(settings: dict[str, Any], deadline: float, results: Results) -> None:
    import jax

    results.data["device"] = jax_device()
    results.save()
    say(f"device {results.data['device']}")
    sizes = settings["matmul_sizes"]
    results.data["matmul_peak"] = jax_matmul_peak(sizes, settings["matmul_flops"])
    results.save()
    say(f"matmul peak {results.data['matmul_peak']['tflops_per_second']:.1f} TFLOP/s")
    results.data["keras_step"] = {}
    for preset in settings["presets"]:
        if seconds_left(deadline) < settings["min_seconds_per_preset"]:
            results.data["keras_step"][preset] = {"skipped": "time budget"}
            results.save()
            continue
        say(f"keras step {preset} ...")
        results.data["keras_step"][preset] = running_record()
        results.save()
        try:
            results.data["keras_step"][preset] = keras_step(preset, settings, deadline)
        except Exception as error:  # noqa: BLE001 (recorded, and the next preset runs)
            results.data["keras_step"][preset] = {"error": f"{type(error).__name__}: {error}"}
            jax.clear_caches()
        results.save()
        say(f"keras step {preset}: {brief(results.data['keras_step'][preset])}")
