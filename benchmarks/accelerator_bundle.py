"""Builds the bundle of the accelerator check (issue 36): what a GPU machine without
TensorFlow, Keras or a package index needs to run `benchmarks/accelerator_check.sh`.

Run it here, on a machine with TensorFlow and the data (`/work/shared/data/multi30k`):

    python benchmarks/accelerator_bundle.py                 # ~7 min on a 2-core CPU
    python benchmarks/accelerator_bundle.py --parts reference --steps 300 --force

It writes `build/accelerator_bundle/` (ignored by git, under 20 MB, carried to the GPU machine
with the run tool's `carry: ["build/accelerator_bundle"]`):

- `wheels/`: Keras 3.15.1 and those of its dependencies a machine with only JAX, numpy and
  PyTorch may lack (absl-py, h5py, ml-dtypes, namex, optree, packaging, rich, markdown-it-py,
  mdurl, pygments, typing-extensions), for CPython 3.12 manylinux x86_64; numpy is left out
  (JAX brings it, and it alone is 16 MB).
- `multi30k-de-en/`: Multi30k de->en prepared by the project's own command as the `multi30k`
  recipe prepares it (`python -m keras_transformer.prepare --recipe multi30k --src de --tgt en`).
- `reference.json`: the CPU reference of the 300-step agreement check: the recipe's settings,
  the batch stream's arguments (`prepared_batches` with the recipe's token budget and seed, the
  XLA buckets and static shapes that fit.py uses on a GPU), the initial weights' generator, seed
  and SHA-256 (the recipe's model, dropout 0; its 7.6M float32 parameters would take 30 MB as a
  `.weights.h5`, so both sides regenerate them bit for bit:
  `accelerator_agreement.seeded_initial_weights`, checked here against the families of Keras' own
  initial values), and per step the loss of training on CPU under TensorFlow in float32
  (`train_on_batch`, compiled as fit.py compiles on a CPU), the batch's shape, target tokens and
  digest.
- `bundle.json`: what was built, when, from which commit, with which versions; file sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["KERAS_BACKEND"] = "tensorflow"  # the reference is TensorFlow's, by definition
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.accelerator_agreement import (  # noqa: E402
    batch_digest,
    init_family,
    recipe_batches,
    recipe_batching,
    recipe_model,
    set_initial_weights,
)
from benchmarks.accelerator_common import (  # noqa: E402
    DEFAULT_BUNDLE,
    PREPARED_DIR,
    REFERENCE_FILE,
    REPO,
    WHEELS_DIR,
)

RECIPE = "multi30k"
KERAS_VERSION = "3.15.1"
# Platform of the GPU machines; pip picks per package the newest wheel these accept.
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64")
# JAX brings numpy (a 16 MB wheel): left out.
LEFT_OUT = ("numpy",)
SIZE_LIMIT = 20 * 2**20
DEFAULT_DATA = Path("/work/shared/data/multi30k")
PARTS = ("wheels", "prepared", "reference")


def say(message: str) -> None:
    print(f"[bundle {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n")
    temporary.replace(path)


def download_wheels(target: Path) -> dict[str, Any]:
    """`pip download`s Keras and its dependencies for CPython 3.12 manylinux x86_64 into
    `target`, less `LEFT_OUT`."""
    with tempfile.TemporaryDirectory() as work:
        command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
                   "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                   "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS],
                   "--dest", work, f"keras=={KERAS_VERSION}"]
        say(" ".join(command))
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        wheels, left_out = [], []
        for wheel in sorted(Path(work).glob("*.whl")):
            name = wheel.name.split("-")[0].lower().replace("_", "-")
            if name in LEFT_OUT:
                left_out.append(wheel.name)
                continue
            shutil.copy2(wheel, target / wheel.name)
            wheels.append({"file": wheel.name, "bytes": wheel.stat().st_size,
                           "sha256": _sha256(wheel)})
    return {"python": PYTHON_VERSION, "platforms": list(PLATFORMS), "keras": KERAS_VERSION,
            "wheels": wheels, "left_out": left_out,
            "left_out_why": "JAX depends on numpy: every machine with JAX has it"}


def prepare(folder: Path, data: Path, force: bool) -> dict[str, Any]:
    """Multi30k de->en prepared by `python -m keras_transformer.prepare --recipe multi30k`."""
    from pipelines.prepared_folder import PreparedError, PreparedFolder

    command = [sys.executable, "-m", "keras_transformer.prepare", "--recipe", RECIPE,
               "--data", str(data), "--src", "de", "--tgt", "en", "--out", str(folder)]
    if folder.exists() and not force:
        try:
            PreparedFolder.load(folder).verify()
            say(f"{folder}: prepared already (--force prepares it again)")
            return {"command": command, "reused": True}
        except PreparedError as error:
            say(f"{folder}: {error}; preparing it again")
    if folder.exists():
        shutil.rmtree(folder)
    say(" ".join(command))
    start = time.time()
    subprocess.run(command, check=True, cwd=REPO)
    return {"command": [c.replace(str(REPO) + "/", "") for c in command],
            "seconds": round(time.time() - start, 1)}


def check_init_families(model) -> dict[str, Any]:
    """Keras' own initial values of each weight against the family `init_family` gives it:
    constants equal, uniform values within +-limit reaching it with the uniform's std, normal
    values with its std. Raises AssertionError naming the first weight that differs."""
    worst = {"uniform_std": 0.0, "normal_std": 0.0, "uniform_max": 0.0}
    for weight in model.trainable_weights:
        values = np.asarray(weight, np.float64)
        family, parameter = init_family(weight.path, values.shape, model.config.d_model)
        if family == "constant":
            assert np.all(values == parameter), f"{weight.path}: not all {parameter}"
            continue
        std = float(values.std())
        if family == "uniform":
            top = float(np.abs(values).max())
            assert top <= parameter * (1 + 1e-6), f"{weight.path}: {top} beyond {parameter}"
            assert top >= parameter * 0.99, f"{weight.path}: max {top}, limit {parameter}"
            deviation = abs(std / (parameter / np.sqrt(3.0)) - 1.0)
            worst["uniform_max"] = max(worst["uniform_max"], 1.0 - top / parameter)
            worst["uniform_std"] = max(worst["uniform_std"], deviation)
        else:
            deviation = abs(std / parameter - 1.0)
            assert abs(float(values.mean())) < 0.05 * parameter, f"{weight.path}: mean"
            worst["normal_std"] = max(worst["normal_std"], deviation)
        assert deviation < 0.05, f"{weight.path}: std {std}, {family} {parameter}"
    return {"checked": len(model.trainable_weights), "worst_relative_deviation": worst}


def check_tf_data(folder: Path, batching: dict[str, Any], count: int) -> dict[str, Any]:
    """The first `count` batches of the tf.data pipeline against `prepared_batches`'."""
    from pipelines.prepared import PreparedCorpus

    dataset = PreparedCorpus.load(folder).batches(**batching)
    numpy_stream = recipe_batches(folder, batching)
    same = 0
    for (features, labels), (np_features, np_labels) in zip(
            dataset.take(count).as_numpy_iterator(), numpy_stream, strict=False):
        same += batch_digest(features, labels) == batch_digest(np_features, np_labels)
    return {"checked": count, "identical": same == count}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def reference(out: Path, steps: int) -> dict[str, Any]:
    """Trains the recipe's model (dropout 0, float32) on CPU under TensorFlow for `steps`
    steps from the seeded initial weights; writes and returns `reference.json`."""
    import keras
    import tensorflow as tf

    from keras_transformer.kernels import fused_kernels
    from keras_transformer.training.config import train_config
    from keras_transformer.training.recipes import RECIPES

    recipe = RECIPES[RECIPE]
    seed = train_config(recipe=RECIPE, data="-", src="de", tgt="en",
                        out="-").optimization.seed
    settings = {key: recipe[key] for key in ("preset", "vocab_size", "max_length",
                                             "tokens_per_batch", "warmup_steps", "lr_scale",
                                             "label_smoothing")}
    settings["seed"] = seed
    folder = out / PREPARED_DIR
    batching = recipe_batching(settings, seed)
    tf_data = check_tf_data(folder, batching, 5)
    say(f"tf.data batches against prepared_batches': {tf_data}")
    assert tf_data["identical"], "the tf.data and numpy batches differ"

    model = recipe_model(settings, "float32", jit_compile=False)
    families = check_init_families(model)
    say(f"initializer families: {families}")
    weights = set_initial_weights(model, seed)
    weights["checked_against_keras_init"] = families
    record: dict[str, Any] = {
        "recipe": RECIPE, "recipe_settings": settings,
        "model": {"preset": settings["preset"], "vocab_size": settings["vocab_size"],
                  "dropout": 0.0, "parameters": int(model.count_params())},
        "prepared": {"folder": PREPARED_DIR},
        "batches": batching,
        "batches_note": "prepared_batches(folder, **batches): the recipe's token budget and "
                        "seed with the XLA buckets and static shapes fit.py uses on a GPU",
        "tf_data_check": tf_data,
        "initial_weights": weights,
        "training": {"backend": "tensorflow", "precision": "float32", "jit_compile": False,
                     "fused_kernels": fused_kernels() is not None, "steps": 0,
                     "tensorflow": tf.__version__, "keras": keras.__version__,
                     "cpu": cpu_name(), "how": "model.train_on_batch per step"},
        "steps": [],
    }
    stream = recipe_batches(folder, batching)
    start = time.time()
    times = []
    partial = out / (REFERENCE_FILE + ".partial")
    for step in range(steps):
        features, labels = next(stream)
        began = time.perf_counter()
        logs = model.train_on_batch(features, labels, return_dict=True)
        times.append(time.perf_counter() - began)
        record["steps"].append({
            "loss": float(logs["loss"]),
            "shape": [int(n) for n in (*features["source"].shape,
                                       features["target"].shape[1])],
            "target_tokens": int(np.count_nonzero(labels)),
            "digest": batch_digest(features, labels)})
        if (step + 1) % 25 == 0 or step + 1 == steps:
            record["training"].update(steps=step + 1, seconds=round(time.time() - start, 1),
                                      median_step_seconds=round(statistics.median(times), 3))
            _write_json(partial, record)
            say(f"step {step + 1}/{steps}: loss {record['steps'][-1]['loss']:.4f}, "
                 f"{statistics.median(times):.2f} s/step")
    record["training"]["learning_rate_last"] = float(
        keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    _write_json(out / REFERENCE_FILE, record)
    partial.unlink(missing_ok=True)
    return record


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def contents(out: Path) -> dict[str, Any]:
    files = sorted(p for p in out.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    return {"bytes": total, "megabytes": round(total / 2**20, 2),
            "limit_megabytes": SIZE_LIMIT // 2**20,
            "files": {str(p.relative_to(out)): p.stat().st_size for p in files}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(DEFAULT_BUNDLE))
    parser.add_argument("--data", default=str(DEFAULT_DATA),
                        help="Multi30k's folder of {split}.{lang}.gz files")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {','.join(PARTS)} (default all)")
    parser.add_argument("--steps", type=int, default=300, help="reference steps (300)")
    parser.add_argument("--force", action="store_true", help="prepare the corpus again")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: of {', '.join(PARTS)}")
    manifest_path = out / "bundle.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if "wheels" in parts:
        manifest["wheels"] = download_wheels(out / WHEELS_DIR)
        say(f"{len(manifest['wheels']['wheels'])} wheels, left out "
             f"{manifest['wheels']['left_out']}")
    if "prepared" in parts:
        manifest["prepared"] = prepare(out / PREPARED_DIR, Path(args.data), args.force)
    if "reference" in parts:
        record = reference(out, args.steps)
        manifest["reference"] = {key: record["training"][key] for key in (
            "steps", "seconds", "median_step_seconds", "cpu", "tensorflow", "keras",
            "fused_kernels")}
        manifest["reference"]["initial_weights_sha256"] = record["initial_weights"]["sha256"]
    manifest.update(built=time.strftime("%Y-%m-%d %H:%M:%S %Z"), git=git_state(),
                    python=sys.version.split()[0])
    manifest["contents"] = contents(out)
    _write_json(manifest_path, manifest)
    manifest["contents"] = contents(out)  # with bundle.json itself
    _write_json(manifest_path, manifest)
    size = manifest["contents"]["bytes"]
    say(f"{out}: {size / 2**20:.2f} MB in {len(manifest['contents']['files'])} files")
    if size > SIZE_LIMIT:
        raise SystemExit(f"the bundle is {size / 2**20:.1f} MB, over the "
                         f"{SIZE_LIMIT // 2**20} MB limit")


if __name__ == "__main__":
    main()
