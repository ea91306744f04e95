"""The agreement part of the accelerator check of issue 36 (`benchmarks/accelerator_check.py`):
the recipe's model (dropout 0) from the bundle's initial weights, trained on the first steps'
batches of the bundle's prepared Multi30k folder and compared with the CPU reference's losses
(the mean over the last steps' window; the bar is `AGREEMENT_BAR`).

The recipe's batches (`recipe_batching`, `recipe_batches`, `batch_digest`) and initial weights
(`seeded_initial_weights`: integer SplitMix64 streams of the families of the model's own
initializers, the same bit for bit on every backend and machine) are shared with
`benchmarks/accelerator_bundle.py`, which trains the reference under TensorFlow on a CPU; so
Keras is imported in the functions only, under whichever backend the caller chose.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.accelerator_common import REFERENCE_FILE, Results, jax_device, say, seconds_left

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


# --- The agreement run, in the agreement worker's process ---


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
        if seconds_left(deadline) < 2:
            stopped = f"time budget, after {step} steps"
            break
        features, labels = next(batches)
        digests_ok += batch_digest(features, labels) == expected[step]["digest"]
        shape = _shape_key(features)
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
        say(f"agreement {precision}: {steps} steps ...")
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
        say(f"agreement {precision}: " + json.dumps(
            {k: run.get(k) for k in ("steps", "mean_loss", "reference_mean_loss",
                                     "relative_difference", "batches_identical", "error")}))


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
