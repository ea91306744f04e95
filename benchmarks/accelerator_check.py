"""The accelerator check of issue 36: the JAX trainer's speed on a GPU, and its agreement with
TensorFlow on the CPU, in one command (`benchmarks/accelerator_check.sh`).

Runs under Keras' JAX backend and imports no TensorFlow: the GPU machines have JAX, PyTorch and
numpy but no TensorFlow (nor Keras: the shell script installs the bundle's wheels first). The
bundle (`build/accelerator_bundle/`, made on a machine with TensorFlow by
`benchmarks/accelerator_bundle.py`) holds the Keras wheels, the Multi30k de->en folder as the
`multi30k` recipe prepares it, and the CPU reference: the seed of the initial weights (with
their SHA-256) and the per-step losses of 300 steps of the recipe's batches trained under
TensorFlow in float32.

Prints one JSON object (stdout), made of three parts, each run in its own process (a crash or
a time-out of one leaves the others' results) within a time budget (`--budget`). First, up to
30% of the budget, parallel processes compile what the parts will run (the agreement's batch
shapes, each preset's step, torch.compile's graphs) into the persistent caches (`--no-warm`:
not), since compiled one after another they take longer than the whole check may (cold on an
H200: ~13 s for each of the agreement's 10 shapes, 20-45 s for each preset and each
torch.compile). `warm` in the JSON says what each warmer did:

- `step`: the device, a measured bfloat16 matmul peak (jnp, several sizes, the best), and the
  project's real trainer step (`TransformerTrainer` compiled as `keras_transformer/training/
  fit.py` does: `GlobalTokenCrossEntropy(0.1)`, `paper_adam`, the preset's dropout,
  `mixed_bfloat16`, trained with `model.fit`) for the presets small (256 pairs x 32 source x 32
  target tokens, vocabulary 8000), base and big (400 x 64 x 64, vocabulary 37000) on synthetic
  tokens: compile time, median step time over `--steps` steps after a warm-up window (median of
  windows of `--window` steps), target tokens/s, TFLOP/s counted as `benchmarks/flops.py` does,
  and MFU against the device's spec (989 TFLOP/s bf16 dense for H100/H200 SXM) and against the
  measured matmul peak. Candidates for a faster step are written `preset+change` in
  `--presets` (`STEP_CHANGES`: `flash`, attention by lengths through cuDNN's fused kernel;
  `dropout0` and `vocab8000`, upper bounds on what cheaper masks and a fused output layer and
  loss could save); `--profile` traces a preset's step after timing it and summarises where
  the device time goes (`benchmarks/device_trace.py`).
- `torch`: the PyTorch peer on the same shapes: `nn.Transformer(d, h, L, L, d_ff, dropout,
  batch_first=True)` with sinusoidal positions, one embedding tied to the output projection,
  padding and causal masks, bfloat16 autocast, fused Adam with the same schedule, label
  smoothing 0.1; eager, then `torch.compile` (forward and loss). Skipped with a note if torch
  is missing.
- `agreement`: the recipe's model (dropout 0) from the bundle's initial weights, trained on the
  first `--agreement-steps` (300) batches of the bundle's prepared folder in the order
  `pipelines.numpy_batches.prepared_batches` gives them (each batch's digest checked against
  the reference's), compared with the CPU reference: the relative difference of the mean loss
  over the last `--agreement-window` (50) steps, steps 251-300; the bar is 1%.

Usage (on the GPU machine the shell script runs it; here for a CPU test):

    KERAS_BACKEND=jax python benchmarks/accelerator_check.py                 # everything
    KERAS_BACKEND=jax python benchmarks/accelerator_check.py --parts step --presets base
    KERAS_BACKEND=jax python benchmarks/accelerator_check.py --quick         # CPU: tiny, minutes

`--quick` (a CPU test of every code path): the tiny preset at 8 x 8 x 8 for the step and the
peer, 20 agreement steps in float32 compared with the reference's first 20.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_BUNDLE = REPO / "build" / "accelerator_bundle"
REFERENCE_FILE = "reference.json"
PREPARED_DIR = "multi30k-de-en"
WHEELS_DIR = "wheels"

# Synthetic step shapes: (pairs, source tokens, target tokens, vocabulary), per preset.
STEP_SHAPES = {"small": (256, 32, 32, 8000), "base": (400, 64, 64, 37000),
               "big": (400, 64, 64, 37000), "tiny": (8, 8, 8, 100)}
# Candidates for a faster step (issue 36's aim), each a change to a preset's step, written
# `preset+change+...` in --presets (the step part only): what each saves, measured alone.
STEP_CHANGES = {
    "flash": "attention by key lengths and a causal flag: cuDNN's fused kernel "
             "(keras_transformer/layers/attention_jax.py)",
    "dropout0": "no dropout (an upper bound on what cheaper dropout masks can save)",
    "vocab8000": "an 8,000 vocabulary (an upper bound on what a fused output layer and loss "
                 "can save; MFU counts the smaller output layer's FLOPs)",
}
# The parts, in the order they run (the agreement first: it is the check with a bar).
PARTS = ("agreement", "step", "torch")
# Shares of the time budget; time a part leaves goes to the later ones.
PART_SHARES = {"agreement": 0.40, "step": 0.35, "torch": 0.25}
# The budget's share for warming the compilation caches in parallel processes first (cold,
# one after another, the agreement's 10 shapes, the three presets and torch.compile take
# ~5 minutes of compiling: more than the whole check may take).
WARM_SHARE = 0.30
# bfloat16 dense tensor-core peak of the device's spec, TFLOP/s (NVIDIA data sheets; the
# sparse figures are twice these). First match in the device name wins.
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
                    ("GH200", 989.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
AGREEMENT_BAR = 0.01  # relative difference of the mean loss over the window
INIT_GENERATOR = "splitmix64-v1"


# --- The recipe's data and initial weights (shared with benchmarks/accelerator_bundle.py) ---


def recipe_batching(recipe: dict[str, Any], seed: int) -> dict[str, Any]:
    """`prepared_batches` arguments of a recipe's training stream, as `fit.py` builds it on a
    GPU (jit_compile auto -> on): the XLA buckets, every batch padded to its bucket's shape."""
    from pipelines.batch_plan import xla_bucket_boundaries

    max_length = int(recipe["max_length"])
    return {"tokens_per_batch": int(recipe["tokens_per_batch"]), "max_length": max_length,
            "seed": int(seed), "bucket_boundaries": xla_bucket_boundaries(max_length),
            "static_shapes": True}


def recipe_batches(folder: str | os.PathLike, batching: dict[str, Any]) -> Iterator:
    """The recipe's training batches (numpy), in `prepared_batches`' order."""
    from pipelines.numpy_batches import prepared_batches

    return prepared_batches(folder, **batching)


def batch_digest(features: dict[str, Any], labels: Any) -> str:
    """A short digest of one batch's arrays (int32, shapes included)."""
    digest = hashlib.sha1()
    for array in (features["source"], features["target"], labels):
        array = np.ascontiguousarray(np.asarray(array), dtype="<i4")
        digest.update(repr(array.shape).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


_MASK64 = (1 << 64) - 1


def _splitmix64(seed: int, stream: int, count: int) -> np.ndarray:
    """`count` uint64 of SplitMix64 (Steele et al. 2014) started at a state made of `seed` and
    `stream`: integer arithmetic only, so the same on every machine and numpy version."""
    start = ((seed * 0x9E3779B97F4A7C15) ^ (stream * 0xD1B54A32D192ED03)) & _MASK64
    state = (np.uint64(start)
             + np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    z = (state ^ (state >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _uniform24(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 in [0, 1) of 24 bits each per uint64 (exact)."""
    high = (bits >> np.uint64(40)).astype(np.float64)
    low = ((bits >> np.uint64(8)) & np.uint64(0xFFFFFF)).astype(np.float64)
    return high / 2.0**24, low / 2.0**24


def init_family(path: str, shape: tuple[int, ...], d_model: int) -> tuple[str, float]:
    """The initializer family of one of the model's weights, by its path and shape:
    ("uniform", limit) for Glorot-uniform kernels (fans of the projection: d_model in or out
    of the attention kernels' (d, heads, d_k) and (heads, d_k, d) shapes), ("normal", std)
    for the shared embedding (d_model^-0.5), ("constant", value) for biases and LayerNorm.

    Raises:
        ValueError: a weight of no known family (the model changed: update this rule).
    """
    name = path.rsplit("/", 1)[-1]
    if name in ("bias", "beta"):
        return "constant", 0.0
    if name == "gamma":
        return "constant", 1.0
    if name == "embeddings":
        return "normal", float(d_model) ** -0.5
    if name == "kernel":
        if len(shape) == 2:
            fan_in, fan_out = shape
        elif len(shape) == 3 and path.endswith("attention_output/kernel"):
            fan_in, fan_out = shape[0] * shape[1], shape[2]
        elif len(shape) == 3:
            fan_in, fan_out = shape[0], shape[1] * shape[2]
        else:
            raise ValueError(f"{path}: a kernel of shape {shape}, of no known family")
        return "uniform", math.sqrt(6.0 / (fan_in + fan_out))
    raise ValueError(f"{path}: a weight of no known initializer family (shape {shape})")


def seeded_weight(family: str, parameter: float, shape: tuple[int, ...], seed: int,
                  index: int) -> np.ndarray:
    """One weight of `seeded_initial_weights`: float32 of `shape`."""
    count = int(np.prod(shape, dtype=np.int64))
    if family == "constant":
        return np.full(shape, parameter, np.float32)
    if family == "uniform":
        high, low = _uniform24(_splitmix64(seed, index, (count + 1) // 2))
        values = np.concatenate([high, low])[:count]
        return ((2.0 * values - 1.0) * parameter).astype(np.float32).reshape(shape)
    if family == "normal":  # Irwin-Hall: the sum of 12 uniforms less 6 (mean 0, variance 1)
        high, low = _uniform24(_splitmix64(seed, index, 6 * count))
        values = (high.reshape(count, 6).sum(axis=1) + low.reshape(count, 6).sum(axis=1)) - 6.0
        return (values * parameter).astype(np.float32).reshape(shape)
    raise ValueError(f"unknown family {family!r}")


def seeded_initial_weights(model, seed: int) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Initial values of `model.trainable_weights`, the same on every backend and machine
    (integer SplitMix64 streams, one per weight), of the families of the model's own
    initializers (`init_family`); and a description holding their SHA-256.

    The recipe's model has 7.6M parameters (30 MB as a `.weights.h5`): more than the bundle
    may carry, so the bundle holds this generator's seed and digest instead of the weights.
    """
    d_model = model.config.d_model
    digest, arrays, families = hashlib.sha256(), [], []
    for index, weight in enumerate(model.trainable_weights):
        shape = tuple(int(n) for n in weight.shape)
        family, parameter = init_family(weight.path, shape, d_model)
        array = seeded_weight(family, parameter, shape, seed, index)
        digest.update(f"{index}:{shape}:".encode())
        digest.update(array.astype("<f4").tobytes())
        arrays.append(array)
        families.append([weight.path, list(shape), family, parameter])
    return arrays, {"generator": INIT_GENERATOR, "seed": int(seed),
                    "sha256": digest.hexdigest(), "weights": len(arrays),
                    "parameters": int(sum(a.size for a in arrays)), "families": families}


def recipe_model(recipe: dict[str, Any], precision: str | None, jit_compile: Any = "auto"):
    """The recipe's model with dropout 0, built, compiled as `fit.py` compiles it (without
    its TokenCount metric, which lives with TensorFlow-only callbacks; `jit_compile` as
    `resolve_jit` gives it: off on a CPU under TensorFlow, always on under JAX)."""
    import keras

    from keras_transformer.training.losses import (
        GlobalTokenCrossEntropy,
        MaskedAccuracy,
        Perplexity,
    )
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    keras.utils.set_random_seed(0)
    model = build_trainer(recipe["preset"], vocab_size=int(recipe["vocab_size"]), dropout=0.0,
                          dtype=precision)
    model.compile(optimizer=paper_adam(model.config.d_model, int(recipe["warmup_steps"]),
                                       float(recipe["lr_scale"])),
                  loss=GlobalTokenCrossEntropy(float(recipe["label_smoothing"])),
                  metrics=[MaskedAccuracy(), Perplexity()], jit_compile=jit_compile,
                  accumulate_steps=1)
    dummy = np.full((1, 3), 4, np.int32)
    model({"source": dummy, "target": dummy})  # creates the weights
    return model


def set_initial_weights(model, seed: int) -> dict[str, Any]:
    """Assigns `seeded_initial_weights` and builds the optimizer (as fit.py); returns their
    description."""
    arrays, description = seeded_initial_weights(model, seed)
    for weight, array in zip(model.trainable_weights, arrays, strict=True):
        weight.assign(array)
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return description


# --- Workers: each part in its own process ---


@dataclasses.dataclass
class Results:
    """A worker's results, written whole to `path` after each item (a killed worker leaves
    what it finished)."""

    path: Path
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def save(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        temporary.replace(self.path)


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _log(message: str) -> None:
    print(f"[check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _left(deadline: float) -> float:
    return deadline - time.time()


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


def _timing(window_seconds: list[float], window: int, batch: int, target_length: int,
            flops: float) -> dict[str, Any]:
    step = statistics.median(window_seconds) / window
    return {"step_seconds": step, "window_step_seconds": [s / window for s in window_seconds],
            "target_tokens_per_second": batch * target_length / step,
            "flops_per_step": flops, "tflops_per_second": flops / step / 1e12}


def jax_device() -> dict[str, Any]:
    import jax

    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind,
            "devices": len(jax.devices()), "jax": jax.__version__,
            "default_matmul_precision": str(jax.config.jax_default_matmul_precision)}


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

    from keras_transformer.training.losses import (
        GlobalTokenCrossEntropy,
        MaskedAccuracy,
        Perplexity,
    )
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    preset, changes = step_variant(name)
    batch, source_length, target_length, vocab_size = STEP_SHAPES[preset]
    if "vocab8000" in changes:
        vocab_size = 8000
    precision, window = settings["precision"], settings["window"]
    windows = max(1, settings["steps"] // window)
    keras.utils.set_random_seed(0)
    model = build_trainer(preset, vocab_size=vocab_size, dtype=precision,
                          flash_attention="flash" in changes,
                          **({"dropout": 0.0} if "dropout0" in changes else {}))
    model.compile(optimizer=paper_adam(model.config.d_model),
                  loss=GlobalTokenCrossEntropy(0.1),
                  metrics=[MaskedAccuracy(), Perplexity()], accumulate_steps=1)
    features, labels = synthetic_batch(batch, source_length, target_length, vocab_size)

    def forever():
        while True:
            yield features, labels

    start = time.perf_counter()
    first = _EpochTimes.make()
    model.fit(forever(), steps_per_epoch=1, epochs=1, verbose=0, callbacks=[first],
              shuffle=False)
    compile_seconds = first.times[-1] - start
    timer = _EpochTimes.make()
    start = time.perf_counter()
    model.fit(forever(), steps_per_epoch=window, epochs=1 + windows, verbose=0,
              callbacks=[timer], shuffle=False)
    ends = [start, *timer.times]
    window_seconds = [b - a for a, b in zip(ends[1:], ends[2:], strict=False)]  # after warm-up
    flops = step_flops(preset, batch, source_length, target_length, vocab_size)
    result = {"preset": preset, "changes": changes, "batch": batch,
              "source_length": source_length, "target_length": target_length,
              "vocab_size": vocab_size,
              "parameters": int(model.count_params()), "dropout": model.config.dropout,
              "precision": precision, "first_step_seconds": compile_seconds,
              "warmup_window_seconds": ends[1] - ends[0], "window": window,
              "timed_steps": window * len(window_seconds),
              **_timing(window_seconds, window, batch, target_length, flops),
              "loss_first_step": first.losses[-1], "loss_last_window": timer.losses[-1],
              "finite": all(math.isfinite(v) for v in [*first.losses, *timer.losses])}
    if name in settings.get("profile", ()):
        if deadline is not None and _left(deadline) < settings["profile_min_seconds"]:
            result["device_trace"] = {"skipped": "time budget"}
        else:
            try:  # the step's timing above stands whatever the profiler does
                result["device_trace"] = profiled_steps(model, forever(), name, settings)
            except Exception as error:  # noqa: BLE001 (recorded beside the timing)
                result["device_trace"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    del model
    keras.backend.clear_session()
    return result


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
    _log(f"device {results.data['device']}")
    sizes = settings["matmul_sizes"]
    results.data["matmul_peak"] = jax_matmul_peak(sizes, settings["matmul_flops"])
    results.save()
    _log(f"matmul peak {results.data['matmul_peak']['tflops_per_second']:.1f} TFLOP/s")
    results.data["keras_step"] = {}
    for preset in settings["presets"]:
        if _left(deadline) < settings["min_seconds_per_preset"]:
            results.data["keras_step"][preset] = {"skipped": "time budget"}
            results.save()
            continue
        _log(f"keras step {preset} ...")
        results.data["keras_step"][preset] = _running()
        results.save()
        try:
            results.data["keras_step"][preset] = keras_step(preset, settings, deadline)
        except Exception as error:  # noqa: BLE001 (recorded, and the next preset runs)
            results.data["keras_step"][preset] = {"error": f"{type(error).__name__}: {error}"}
            jax.clear_caches()
        results.save()
        _log(f"keras step {preset}: {_brief(results.data['keras_step'][preset])}")


def _running() -> dict[str, Any]:
    """What an item's record says while it runs (and after, if its process was killed)."""
    return {"incomplete": "the part's process was stopped while this ran",
            "started": time.time()}


def _brief(record: dict[str, Any]) -> str:
    if "step_seconds" not in record:
        return json.dumps(record)[:400]
    return (f"{record['step_seconds'] * 1e3:.2f} ms/step, "
            f"{record['target_tokens_per_second']:,.0f} target tok/s, "
            f"{record['tflops_per_second']:.2f} TFLOP/s, first step "
            f"{record.get('first_step_seconds', float('nan')):.1f} s")


def agreement_run(reference: dict[str, Any], folder: Path, precision: str, steps: int,
                  window: int, deadline: float, progress=None) -> dict[str, Any]:
    """The recipe's first `steps` batches from the reference's initial weights, compared with
    the reference's losses; `progress(losses)` is called every 10 steps."""
    import keras

    recipe = reference["recipe_settings"]
    model = recipe_model(recipe, precision)
    description = set_initial_weights(model, int(reference["initial_weights"]["seed"]))
    same_weights = description["sha256"] == reference["initial_weights"]["sha256"]
    if not same_weights:
        return {"error": "the regenerated initial weights differ from the reference's "
                         f"(sha256 {description['sha256']} against "
                         f"{reference['initial_weights']['sha256']})"}
    expected = reference["steps"]
    losses, seconds, first_of_shape, digests_ok = [], [], {}, 0
    batches = recipe_batches(folder, reference["batches"])
    stopped = None
    for step in range(steps):
        if _left(deadline) < 2:
            stopped = f"time budget, after {step} steps"
            break
        features, labels = next(batches)
        digests_ok += batch_digest(features, labels) == expected[step]["digest"]
        shape = "x".join(map(str, (*features["source"].shape, features["target"].shape[1])))
        start = time.perf_counter()
        logs = model.train_on_batch(features, labels, return_dict=True)
        seconds.append(time.perf_counter() - start)
        losses.append(float(logs["loss"]))
        first_of_shape.setdefault(shape, seconds[-1])
        if progress is not None and len(losses) % 10 == 0:
            progress({"incomplete": "the part's process was stopped while this ran",
                      "steps": len(losses), "seconds": sum(seconds),
                      "first_step_seconds_per_shape": first_of_shape, "losses": losses})
    done = len(losses)
    reference_losses = [entry["loss"] for entry in expected[:done]]
    relative = [abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True)]
    span = min(window, done)
    result = {"precision": precision, "steps": done, "stopped": stopped,
              "initial_weights_sha256_match": same_weights,
              "batches_identical": digests_ok == done, "batch_digests_matching": digests_ok,
              "shapes": len(first_of_shape),
              "first_step_seconds_per_shape": first_of_shape,
              "compile_seconds_estimate": sum(first_of_shape.values())
              - len(first_of_shape) * (statistics.median(seconds) if seconds else 0.0),
              "median_step_seconds": statistics.median(seconds) if seconds else None,
              "seconds": sum(seconds), "losses": losses,
              "first_step_relative_difference": relative[0] if relative else None,
              "max_step_relative_difference": max(relative) if relative else None}
    if span:
        mine = statistics.fmean(losses[done - span:])
        theirs = statistics.fmean(reference_losses[done - span:])
        result.update({"window": [done - span + 1, done], "mean_loss": mine,
                       "reference_mean_loss": theirs,
                       "relative_difference": abs(mine - theirs) / abs(theirs),
                       # judged only on the whole run: the bar is for steps 251-300
                       "within_bar": abs(mine - theirs) / abs(theirs) <= AGREEMENT_BAR
                       if done == steps else None,
                       "bar": AGREEMENT_BAR})
    del model
    keras.backend.clear_session()
    return result


def agreement_worker(settings: dict[str, Any], deadline: float, results: Results) -> None:
    from pipelines.prepared_folder import PreparedFolder

    bundle = Path(settings["bundle"])
    reference = json.loads((bundle / REFERENCE_FILE).read_text())
    folder = bundle / reference["prepared"]["folder"]
    PreparedFolder.load(folder).verify()  # checksums, as a training run does once
    steps = min(settings["agreement_steps"], len(reference["steps"]))
    results.data["agreement"] = {"reference": {
        key: reference["training"].get(key) for key in (
            "backend", "precision", "jit_compile", "fused_kernels", "steps", "seconds",
            "tensorflow", "keras", "cpu")}}
    results.data["agreement"]["runs"] = {}
    if "device" not in results.data:
        results.data["device"] = jax_device()
    for precision in settings["agreement_precisions"]:
        _log(f"agreement {precision}: {steps} steps ...")
        runs = results.data["agreement"]["runs"]

        def progress(partial, precision=precision, runs=runs):
            runs[precision] = partial
            results.save()

        try:
            run = agreement_run(reference, folder, precision, steps,
                                settings["agreement_window"], deadline, progress)
        except Exception as error:  # noqa: BLE001 (recorded)
            run = {"error": f"{type(error).__name__}: {error}"}
        results.data["agreement"]["runs"][precision] = run
        results.save()
        _log(f"agreement {precision}: " + json.dumps(
            {k: run.get(k) for k in ("steps", "mean_loss", "reference_mean_loss",
                                     "relative_difference", "batches_identical", "error")}))


def torch_worker(settings: dict[str, Any], deadline: float, results: Results) -> None:
    try:
        import torch
    except ImportError as error:
        results.data["torch"] = {"skipped": f"torch is not installed ({error})"}
        results.save()
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    record: dict[str, Any] = {"torch": torch.__version__, "device": device,
                              "device_name": torch.cuda.get_device_name(0)
                              if device == "cuda" else "cpu", "eager": {}, "compile": {}}
    results.data["torch"] = record
    record["matmul_peak"] = torch_matmul_peak(torch, device, settings["matmul_sizes"],
                                              settings["matmul_flops"])
    results.save()
    _log(f"torch {torch.__version__} on {record['device_name']}: matmul peak "
         f"{record['matmul_peak']['tflops_per_second']:.1f} TFLOP/s")
    for mode, preset in torch_plan(settings):
        needed = settings["min_seconds_per_preset"] * (2 if mode == "compile" else 1)
        if _left(deadline) < needed:
            record[mode][preset] = {"skipped": "time budget"}
            results.save()
            continue
        _log(f"torch {mode} {preset} ...")
        record[mode][preset] = _running()
        results.save()
        try:
            record[mode][preset] = torch_step(torch, device, preset, mode == "compile",
                                              settings)
        except Exception as error:  # noqa: BLE001 (recorded, and the next one runs)
            record[mode][preset] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
        if device == "cuda":
            torch.cuda.empty_cache()
        results.save()
        _log(f"torch {mode} {preset}: {_brief(record[mode][preset])}")


def torch_plan(settings: dict[str, Any]) -> list[tuple[str, str]]:
    """(mode, preset) in the order the peer runs them: preset by preset, in the order of
    `torch_compile_presets` (base first: the issue's comparison), each eager then compiled,
    so that a budget that runs out leaves the least important ones (small) out."""
    plain = [p for p in settings["presets"] if "+" not in p]  # candidates are ours alone
    order = [*settings["torch_compile_presets"],
             *(p for p in plain if p not in settings["torch_compile_presets"])]
    plan = []
    for preset in order:
        if "eager" in settings["torch_modes"] and preset in plain:
            plan.append(("eager", preset))
        if "compile" in settings["torch_modes"] and preset in settings["torch_compile_presets"]:
            plan.append(("compile", preset))
    return plan


def torch_matmul_peak(torch, device: str, sizes: list[int], flops: float,
                      repeats: int = 5) -> dict[str, Any]:
    """`jax_matmul_peak` through torch.matmul."""
    results = {}
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        calls = max(1, min(50, int(flops // (2 * size**3))))
        torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            _sync(torch, device)
            start = time.perf_counter()
            for _ in range(calls):
                torch.matmul(a, b)
            _sync(torch, device)
            times.append(time.perf_counter() - start)
        results[str(size)] = 2.0 * size**3 * calls / statistics.median(times) / 1e12
    best = max(results, key=results.get)
    return {"tflops_per_second": results[best], "best_size": int(best),
            "by_size_tflops_per_second": results, "dtype": "bfloat16", "through": "torch.matmul"}


def _sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_peer(torch, vocab_size: int, d_model: int, num_heads: int, num_layers: int,
               d_ff: int, dropout: float, max_length: int = 1024):
    """The peer model: nn.Transformer with sinusoidal positions and one embedding shared by
    source, target and the output projection (scaled by sqrt(d_model) at the input)."""
    nn = torch.nn

    class Peer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab_size, d_model)
            nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
            self.transformer = nn.Transformer(d_model, num_heads, num_layers, num_layers, d_ff,
                                              dropout, batch_first=True)
            self.dropout = nn.Dropout(dropout)
            position = torch.arange(max_length, dtype=torch.float32)[:, None]
            rate = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                             * (-math.log(10000.0) / d_model))
            table = torch.zeros(max_length, d_model)
            table[:, 0::2] = torch.sin(position * rate)
            table[:, 1::2] = torch.cos(position * rate)
            self.register_buffer("positions", table, persistent=False)

        def embed(self, ids):
            return self.dropout(self.embedding(ids) * d_model**0.5
                                + self.positions[: ids.shape[1]])

        def forward(self, source, target):
            length = target.shape[1]
            causal = torch.triu(torch.ones(length, length, dtype=torch.bool,
                                           device=target.device), diagonal=1)
            source_padding, target_padding = source == 0, target == 0
            hidden = self.transformer(
                self.embed(source), self.embed(target), tgt_mask=causal,
                src_key_padding_mask=source_padding, tgt_key_padding_mask=target_padding,
                memory_key_padding_mask=source_padding, tgt_is_causal=True)
            return hidden @ self.embedding.weight.t()

    return Peer()


def torch_step(torch, device: str, preset: str, compiled: bool,
               settings: dict[str, Any]) -> dict[str, Any]:
    """The peer's training step on the synthetic batch of `preset`: median step time."""
    import warnings

    from keras_transformer.model.config import transformer_config

    functional = torch.nn.functional
    batch, source_length, target_length, vocab_size = STEP_SHAPES[preset]
    config = transformer_config(preset, vocab_size=vocab_size)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested-tensor notes of nn.TransformerEncoder
        model = torch_peer(torch, vocab_size, config.d_model, config.num_heads,
                           config.num_layers, config.d_ff, config.dropout).to(device)
    model.train()
    try:
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9,
                                     fused=True)
        fused = True
    except (RuntimeError, ValueError):  # a device without the fused kernel
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        fused = False
    warmup = 4000

    def rate(step: int) -> float:  # the paper's schedule, as paper_adam (scale 1)
        step = max(step + 1, 1)
        return config.d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    features, labels = synthetic_batch(batch, source_length, target_length, vocab_size)
    source = torch.as_tensor(features["source"], dtype=torch.long, device=device)
    target = torch.as_tensor(features["target"], dtype=torch.long, device=device)
    label = torch.as_tensor(labels, dtype=torch.long, device=device)

    def loss_of(source, target, label):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(source, target)
        return functional.cross_entropy(logits.float().reshape(-1, vocab_size),
                                        label.reshape(-1), ignore_index=0,
                                        label_smoothing=0.1)

    forward = torch.compile(loss_of) if compiled else loss_of

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward(source, target, label)
        loss.backward()
        optimizer.step()
        schedule.step()
        return loss

    window = settings["window"]
    windows = max(1, settings["steps"] // window)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first_loss = float(step())
    first_step = time.perf_counter() - start
    for _ in range(window):  # warm-up window
        step()
    window_seconds = []
    for _ in range(windows):
        _sync(torch, device)
        start = time.perf_counter()
        for _ in range(window):
            loss = step()
        _sync(torch, device)
        window_seconds.append(time.perf_counter() - start)
    flops = step_flops(preset, batch, source_length, target_length, vocab_size)
    last_loss = float(loss)
    return {"preset": preset, "mode": "torch.compile" if compiled else "eager",
            "batch": batch, "source_length": source_length, "target_length": target_length,
            "vocab_size": vocab_size, "dropout": config.dropout,
            "parameters": sum(p.numel() for p in model.parameters()),
            "precision": "bfloat16 autocast", "fused_adam": fused,
            "first_step_seconds": first_step, "window": window,
            "timed_steps": window * windows,
            **_timing(window_seconds, window, batch, target_length, flops),
            "loss_first_step": first_loss, "loss_last_window": last_loss,
            "finite": math.isfinite(first_loss) and math.isfinite(last_loss)}


# --- Warming the compilation caches, in parallel ---


def agreement_shapes(settings: dict[str, Any]) -> list[str]:
    """The distinct batch shapes of the agreement's steps, in order of first use."""
    bundle = Path(settings["bundle"])
    reference = json.loads((bundle / REFERENCE_FILE).read_text())
    batches = recipe_batches(bundle / reference["prepared"]["folder"], reference["batches"])
    steps = min(settings["agreement_steps"], len(reference["steps"]))
    shapes: dict[str, None] = {}
    for _ in range(steps):
        features, _labels = next(batches)
        shapes.setdefault(_shape_key(features), None)
    return list(shapes)


def _shape_key(features: dict[str, Any]) -> str:
    return "x".join(map(str, (*features["source"].shape, features["target"].shape[1])))


def warm_worker(settings: dict[str, Any], deadline: float, results: Results) -> None:
    """Compiles one piece of a later part, so that part finds it in the persistent caches
    (JAX's compilation cache; Inductor's FX-graph and Triton caches): the parts' own first
    steps then load programs instead of compiling them one after another."""
    task = settings["warm_task"]
    results.data["task"] = task
    start = time.perf_counter()
    if task["kind"] == "agreement":
        bundle = Path(settings["bundle"])
        reference = json.loads((bundle / REFERENCE_FILE).read_text())
        model = recipe_model(reference["recipe_settings"], task["precision"])
        set_initial_weights(model, int(reference["initial_weights"]["seed"]))
        wanted = set(task["shapes"])
        batches = recipe_batches(bundle / reference["prepared"]["folder"],
                                 reference["batches"])
        for _ in range(min(settings["agreement_steps"], len(reference["steps"]))):
            if not wanted or _left(deadline) < 1:
                break
            features, labels = next(batches)
            if _shape_key(features) in wanted:
                wanted.discard(_shape_key(features))
                model.train_on_batch(features, labels)
    elif task["kind"] == "keras":
        keras_step(task["preset"], dict(settings, steps=1, window=1, profile=[]))
    elif task["kind"] == "torch":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_step(torch, device, task["preset"], True, dict(settings, steps=1, window=1))
    results.data["seconds"] = round(time.perf_counter() - start, 1)
    results.save()


def warm_tasks(settings: dict[str, Any], parts: list[str]) -> list[dict[str, Any]]:
    """What the parts will compile, cut into pieces for parallel warmers."""
    tasks: list[dict[str, Any]] = []
    if "agreement" in parts:
        shapes = agreement_shapes(settings)
        count = max(1, min(len(shapes), settings["agreement_warmers"]))
        for precision in settings["agreement_precisions"]:
            tasks += [{"kind": "agreement", "precision": precision,
                       "shapes": shapes[index::count]} for index in range(count)]
    if "step" in parts:
        tasks += [{"kind": "keras", "preset": preset} for preset in settings["presets"]]
    if "torch" in parts and "compile" in settings["torch_modes"]:
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            tasks += [{"kind": "torch", "preset": preset}
                      for preset in settings["torch_compile_presets"]]
    return tasks


def warm_caches(settings: dict[str, Any], parts: list[str], seconds: float, log_dir: Path,
                work: Path) -> dict[str, Any]:
    """Runs `warm_tasks` in parallel processes for at most `seconds`; how each went."""
    tasks = warm_tasks(settings, parts)
    processes = []
    deadline = time.time() + seconds
    start = time.time()
    for index, task in enumerate(tasks):
        name = f"warm{index}_{task['kind']}_{task.get('preset', task.get('precision'))}"
        env = _worker_env("agreement" if task["kind"] == "agreement" else task["kind"],
                          settings)
        # Many processes share the GPU: none may take most of its memory up front.
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false")
        out = work / f"{name}.json"
        log = log_dir / f"accelerator_check_{name}.log"
        command = _worker_command("warm", dict(settings, warm_task=task), deadline, out)
        stream = open(log, "w")  # noqa: SIM115 (closed below, after the process ends)
        processes.append((name, out, log, stream, subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            start_new_session=True)))
    record: dict[str, Any] = {"tasks": len(tasks), "budget_seconds": round(seconds, 1),
                              "by_task": {}}
    for name, out, log, stream, process in processes:
        try:
            rc = process.wait(timeout=max(deadline - time.time(), 0.0) + 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            rc = process.wait()
        stream.close()
        try:
            data = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            data = {}
        entry = {"rc": rc, "seconds": data.get("seconds")}
        if rc != 0:
            entry["log_tail"] = log.read_text(errors="replace")[-1500:]
        record["by_task"][name] = entry
    record["seconds"] = round(time.time() - start, 1)
    return record


WORKERS = {"step": step_worker, "agreement": agreement_worker, "torch": torch_worker,
           "warm": warm_worker}


def run_worker(part: str, settings: dict[str, Any], deadline: float, out: Path) -> None:
    # As on the GPU machines, where it is not installed: a TensorFlow import fails (Keras'
    # set_random_seed would import it where it is installed, to seed it too).
    sys.modules["tensorflow"] = None
    results = Results(out)
    results.data["started"] = time.time()
    results.save()
    WORKERS[part](settings, deadline, results)
    results.data["finished"] = time.time()
    results.save()


# --- The orchestrator ---


def spec_peak(name: str) -> tuple[float | None, str | None]:
    for key, tflops in SPEC_BF16_TFLOPS:
        if key.lower() in name.lower():
            return tflops, key
    return None, None


def add_mfu(record: dict[str, Any], spec: float | None, measured: float | None) -> None:
    if "tflops_per_second" not in record:
        return
    record["mfu_spec"] = record["tflops_per_second"] / spec if spec else None
    record["mfu_measured_matmul"] = (record["tflops_per_second"] / measured
                                     if measured else None)


def _worker_env(part: str, settings: dict[str, Any]) -> dict[str, str]:
    """A worker's environment: the JAX backend; the agreement's XLA flags for its programs
    (also when warming them: the flags are part of the compilation cache's key)."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1")
    if part == "agreement" and settings["agreement_xla_flags"]:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"),
                                                  settings["agreement_xla_flags"]]))
    return env


def _worker_command(part: str, settings: dict[str, Any], deadline: float,
                    out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", part,
            "--worker-out", str(out), "--worker-deadline", repr(deadline),
            "--worker-settings", json.dumps(settings)]


def run_part(part: str, settings: dict[str, Any], seconds: float, log_dir: Path,
             work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs one part in a child process for at most `seconds` (+ a grace period); its
    results (partial if it was stopped) and how it ran."""
    out = work / f"{part}.json"
    log = log_dir / f"accelerator_check_{part}.log"
    env = _worker_env(part, settings)
    deadline = time.time() + seconds
    command = _worker_command(part, settings, deadline, out)
    start = time.time()
    timed_out = False
    with open(log, "w") as stream:
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT,
                                   env=env, cwd=REPO, start_new_session=True)
        try:
            rc = process.wait(timeout=seconds + settings["grace_seconds"])
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            rc = process.wait()
    text = log.read_text(errors="replace")
    info = {"seconds": round(time.time() - start, 1), "budget_seconds": round(seconds, 1),
            "rc": rc, "killed_at_budget": timed_out, "log": str(log)}
    if rc != 0:
        info["log_tail"] = text[-3000:]
    for line in text.splitlines():
        if line.startswith("[check"):
            print(line, file=sys.stderr, flush=True)
    try:
        data = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}
    return data, info


def orchestrate(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    parts = [part for part in PARTS if part in settings["parts"]]
    bundle = Path(settings["bundle"])
    report: dict[str, Any] = {"check": "accelerator_check (issue 36)", "settings": settings,
                              "python": sys.version.split()[0],
                              "keras_backend": "jax", "parts": {},
                              "jax_compilation_cache": {
                                  "dir": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
                                  "warm_at_start": bool(os.environ.get(
                                      "ACCELERATOR_CHECK_WARM_CACHE"))}}
    if "agreement" in parts and not (bundle / REFERENCE_FILE).is_file():
        report["parts"]["agreement"] = {"skipped": f"no bundle at {bundle} (build it with "
                                                   "benchmarks/accelerator_bundle.py)"}
        parts.remove("agreement")
    log_dir = Path(args.log_dir or os.environ.get("OUT") or tempfile.mkdtemp())
    log_dir.mkdir(parents=True, exist_ok=True)
    settings["trace_dir"] = str(log_dir)
    merged: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        if settings["warm"] and parts:
            seconds = settings["budget"] * settings["warm_share"]
            _log(f"warming the compilation caches: up to {seconds:.0f} s")
            report["warm"] = warm_caches(settings, parts, seconds, log_dir, Path(work))
            _log(f"warm in {report['warm']['seconds']} s: " + ", ".join(
                f"{name} rc {entry['rc']} {entry['seconds']} s"
                for name, entry in report["warm"]["by_task"].items()))
        for index, part in enumerate(parts):
            left = settings["budget"] - (time.time() - started)
            shares = [PART_SHARES[p] for p in parts[index:]]
            seconds = max(left * shares[0] / sum(shares), 0.0)
            if seconds < 10:
                report["parts"][part] = {"skipped": "time budget"}
                continue
            _log(f"part {part}: up to {seconds:.0f} s")
            data, info = run_part(part, settings, seconds, log_dir, Path(work))
            report["parts"][part] = info
            for key, value in data.items():
                if key not in ("started", "finished"):
                    merged.setdefault(key, value)
            if "finished" not in data:
                info["incomplete"] = True
    device = merged.get("device") or {}
    torch_record = merged.get("torch") or {}
    name = device.get("device_kind") or torch_record.get("device_name") or ""
    spec, matched = spec_peak(name)
    measured = (merged.get("matmul_peak") or {}).get("tflops_per_second") or (
        torch_record.get("matmul_peak") or {}).get("tflops_per_second")
    report["device"] = device
    report["peaks"] = {"spec_bf16_dense_tflops": spec, "spec_matched": matched,
                       "measured_bf16_matmul_tflops": measured,
                       "jax_matmul": merged.get("matmul_peak"),
                       "torch_matmul": torch_record.get("matmul_peak")}
    keras_records = merged.get("keras_step") or {}
    for record in keras_records.values():
        add_mfu(record, spec, measured)
    for mode in ("eager", "compile"):
        for record in (torch_record.get(mode) or {}).values():
            add_mfu(record, spec, measured)
    report["keras_step"] = keras_records
    report["torch_peer"] = torch_record
    report["agreement"] = merged.get("agreement")
    report["summary"] = summary(report)
    report["seconds"] = round(time.time() - started, 1)
    return report


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, one line each."""
    lines: dict[str, Any] = {}

    def describe(record):
        if "step_seconds" not in record:
            return (record.get("skipped") or record.get("error", "")[:200]
                    or record.get("incomplete"))
        mfu = record.get("mfu_spec")
        return (f"{record['step_seconds'] * 1e3:.2f} ms/step, "
                f"{record['target_tokens_per_second']:,.0f} tok/s, "
                f"{record['tflops_per_second']:.1f} TFLOP/s"
                + (f", MFU {mfu:.1%} of spec" if mfu else "")
                + (f", {record['mfu_measured_matmul']:.1%} of matmul"
                   if record.get("mfu_measured_matmul") else ""))

    for preset, record in (report.get("keras_step") or {}).items():
        lines[f"keras {preset}"] = describe(record)
    for mode in ("eager", "compile"):
        for preset, record in ((report.get("torch_peer") or {}).get(mode) or {}).items():
            lines[f"torch {mode} {preset}"] = describe(record)
    if (report.get("torch_peer") or {}).get("skipped"):
        lines["torch"] = report["torch_peer"]["skipped"]
    for precision, run in ((report.get("agreement") or {}).get("runs") or {}).items():
        if "relative_difference" in run:
            lines[f"agreement {precision}"] = (
                f"mean loss of steps {run['window'][0]}-{run['window'][1]}: "
                f"{run['mean_loss']:.4f} vs CPU {run['reference_mean_loss']:.4f}, relative "
                f"difference {run['relative_difference']:.2e} "
                + {True: f"(within the {AGREEMENT_BAR:.0%} bar); ",
                   False: f"(OUTSIDE the {AGREEMENT_BAR:.0%} bar); ",
                   None: f"(not judged: {run['stopped']}); "}[run["within_bar"]]
                + f"batches identical: {run['batches_identical']}")
        else:
            lines[f"agreement {precision}"] = (run.get("error") or run.get("stopped")
                                               or run.get("incomplete"))
    return lines


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick

    def listed(value, default):
        return [v for v in (value or default).split(",") if v]

    presets = listed(args.presets, "tiny" if quick else "small,base,big")
    for preset in presets:
        try:
            step_variant(preset)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    unknown = [name for name in listed(args.profile, "") if name not in presets]
    if unknown:
        raise SystemExit(f"--profile {','.join(unknown)}: not in --presets "
                         f"({','.join(presets)})")
    compiled = [name for name in listed(args.torch_compile_presets, "")
                if name not in STEP_SHAPES]
    if compiled:
        raise SystemExit(f"--torch-compile-presets {','.join(compiled)}: the peer runs "
                         f"presets only, of {', '.join(STEP_SHAPES)}")
    parts = listed(args.parts, ",".join(PARTS))
    if args.profile and "step" not in parts:
        raise SystemExit("--profile traces the step part's presets: add step to --parts")
    for part in parts:
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}: one of {', '.join(PARTS)}")
    return {
        "parts": parts, "presets": presets, "quick": quick,
        "bundle": str(Path(args.bundle).resolve()),
        "precision": args.precision,
        "steps": args.steps or (4 if quick else 60),
        "window": args.window or (2 if quick else 20),
        "matmul_sizes": [int(s) for s in listed(args.matmul_sizes,
                                                "512" if quick else "4096,8192,16384")],
        "matmul_flops": 1e9 if quick else 4e12,
        "agreement_steps": args.agreement_steps or (20 if quick else 300),
        "agreement_window": args.agreement_window or (10 if quick else 50),
        "agreement_xla_flags": args.agreement_xla_flags,
        "agreement_precisions": listed(args.agreement_precision,
                                       "float32" if quick else "mixed_bfloat16"),
        "profile": listed(args.profile, ""),
        "profile_steps": 3 if quick else 5,
        "profile_top": 12,
        "profile_keep_bytes": 8 << 20,
        "profile_min_seconds": 5.0 if quick else 15.0,
        "torch_modes": listed(args.torch_modes, "eager,compile"),
        "torch_compile_presets": listed(args.torch_compile_presets,
                                        ",".join(p for p in presets if "+" not in p)
                                        if quick else "base,big,small"),
        "budget": args.budget if args.budget is not None else (1800.0 if quick else 265.0),
        "warm": not args.no_warm,
        "warm_share": WARM_SHARE,
        "agreement_warmers": 6,
        "grace_seconds": 20.0,
        "min_seconds_per_preset": 5.0 if quick else 20.0,
    }


def unpack_wheels(wheels: Path, target: Path) -> None:
    """Unpacks the wheels whose distributions the running Python lacks into `target` (for
    a Python without pip: put `target` on PYTHONPATH)."""
    import importlib.metadata
    import zipfile

    target.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            importlib.metadata.version(name)
            continue  # installed
        except importlib.metadata.PackageNotFoundError:
            pass
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        print(f"unpacked {wheel.name}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", help=f"comma-separated, of {','.join(PARTS)} (default all)")
    parser.add_argument("--presets", help="step and peer presets (default small,base,big); "
                        "`preset+change` adds a candidate to the step part: changes "
                        f"{', '.join(STEP_CHANGES)}")
    parser.add_argument("--steps", type=int, help="timed steps per preset (default 60)")
    parser.add_argument("--window", type=int, help="steps per timing window (default 20)")
    parser.add_argument("--precision", default="mixed_bfloat16", help="of the Keras step")
    parser.add_argument("--matmul-sizes", help="matmul peak sizes (default 4096,8192,16384)")
    parser.add_argument("--agreement-steps", type=int, help="default 300")
    parser.add_argument("--agreement-window", type=int,
                        help="last steps whose mean loss is compared (default 50)")
    parser.add_argument("--agreement-precision",
                        help="comma-separated dtype policies (default mixed_bfloat16)")
    parser.add_argument("--agreement-xla-flags", default="--xla_gpu_autotune_level=0",
                        help="XLA_FLAGS added for the agreement only (default: no GEMM "
                             "autotuning, to compile its 10 batch shapes faster; '' for none)")
    parser.add_argument("--profile", help="step presets (or candidates) whose step to trace "
                        "with JAX's profiler after timing it: the device time by kind of work "
                        "and the longest ops (benchmarks/device_trace.py); default none")
    parser.add_argument("--torch-modes", help="eager,compile (default both)")
    parser.add_argument("--torch-compile-presets",
                        help="presets of torch.compile, in order (default base,big,small)")
    parser.add_argument("--budget", type=float,
                        help="seconds for the warming and all parts (default 265: the run "
                             "tool's 300 s less the install and a margin)")
    parser.add_argument("--no-warm", action="store_true",
                        help="no parallel warming of the compilation caches first (each "
                             "part then compiles its programs one after another)")
    parser.add_argument("--bundle", default=str(DEFAULT_BUNDLE))
    parser.add_argument("--quick", action="store_true",
                        help="a CPU test: tiny shapes, 20 float32 agreement steps")
    parser.add_argument("--json-out", help="also write the JSON here")
    parser.add_argument("--log-dir", help="the parts' logs (default $OUT, else a temp dir)")
    parser.add_argument("--unpack-wheels", nargs=2, metavar=("WHEELS", "TARGET"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=(*PARTS, "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--worker-settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.unpack_wheels:
        unpack_wheels(Path(args.unpack_wheels[0]), Path(args.unpack_wheels[1]))
        return
    if args.worker:
        run_worker(args.worker, json.loads(args.worker_settings), args.worker_deadline,
                   Path(args.worker_out))
        return
    report = orchestrate(args, settings_of(args))
    text = json.dumps(report, indent=1, default=_jsonable)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
