"""The layout of a run directory, shared by training (writer) and decoding/evaluation (readers).

```
<run>/config.json        the model config, tokenizer settings, data and training arguments
<run>/tokenizer/         spm.model, spm.vocab, tokenizer.json (pipelines.tokenizer)
<run>/prepared/          the prepared training data unless --prepared puts them elsewhere
                         (tokenizer and token shards, pipelines.prepared)
<run>/model.keras        the final (checkpoint-averaged) model, loadable in a notebook
<run>/checkpoints/       periodic weights, ckpt-<step>.weights.h5, and best.weights.h5
<run>/backup/            the newest generations of the resumable state (training.backup)
<run>/logs/              TensorBoard
<run>/results.json       final metrics (validation loss, BLEU with its signature, ...)
<run>/.lock              held by the training run writing it (`take_run_dir`)
```

A run directory is "finished" once results.json exists; before that, the same training
command resumes it (`inspect_run_dir`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras

import keras_transformer.model.transformer  # noqa: F401  (registers the custom layers)
from keras_transformer.decoding.defaults import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.errors import UsageError
from pipelines import DEFAULT_CARVE_PAIRS, storage

if TYPE_CHECKING:
    from keras_transformer.training.config import TrainConfig

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
PREPARED_DIR = "prepared"
MODEL_FILE = "model.keras"
CHECKPOINT_DIR = "checkpoints"
BACKUP_DIR = "backup"
LOG_DIR = "logs"
RESULTS_FILE = "results.json"


def is_run_dir(path: str | Path) -> bool:
    """True if `path` holds a trained model and its tokenizer."""
    path = Path(path)
    return (path / MODEL_FILE).is_file() and (path / TOKENIZER_DIR).is_dir()


def load_run(path: str | Path):
    """Loads `(model, tokenizer)` from a run directory.

    Raises:
        FileNotFoundError: naming what is missing, if `path` is not a complete run directory.
    """
    path = Path(path)
    for required in (path / MODEL_FILE, path / TOKENIZER_DIR):
        if not required.exists():
            raise FileNotFoundError(
                f"{path} is not a run directory: {required.name} is missing. Pass the --out "
                "folder of a finished `python -m keras_transformer.train` run, or a SavedModel."
            )

    model = keras.models.load_model(path / MODEL_FILE, compile=False)
    from pipelines.tokenizer import SubwordTokenizer  # TensorFlow's: only where a run loads

    return model, SubwordTokenizer.load(path / TOKENIZER_DIR)


# What to do about a damaged file of a run directory, by name.
_DAMAGED_ADVICE = {
    CONFIG_FILE: "it records the run's settings: restore it from a copy, or start over with "
                 "--overwrite (or another --out)",
    RESULTS_FILE: "delete it and run the same training command: the run is evaluated again "
                  "from its checkpoints",
}


class DamagedFileError(UsageError):
    """A file of a run directory cannot be read (not JSON, not UTF-8, not an object)."""


def read_json(path: str | Path) -> dict[str, Any]:
    """Reads a JSON object written by `pipelines.storage.write_json`.

    Raises:
        FileNotFoundError: `path` does not exist.
        DamagedFileError: `path` is not a JSON object, naming it and what to do.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedFileError(f"{path} is damaged (not JSON: {error}); "
                               f"{_DAMAGED_ADVICE.get(path.name, 'restore or delete it')}"
                               ) from None
    if not isinstance(data, dict):
        raise DamagedFileError(f"{path} is damaged (a JSON {type(data).__name__}, not an "
                               f"object); {_DAMAGED_ADVICE.get(path.name, 'restore or delete it')}")
    return data


def _json_if_present(path: Path) -> dict[str, Any]:
    """`read_json(path)`, or {} where `path` is not a file."""
    return read_json(path) if path.is_file() else {}


def run_decoding(run: str | Path, beam: int | None = None,
                 alpha: float | None = None) -> tuple[int, float]:
    """The beam size and length penalty to decode a run with: those given, else the run's,
    each from the first place that records it: results.json's (what its test BLEU was scored
    with), its "decoding" (chosen on val, without a test split), config.json's arguments (the
    run's --beam/--alpha: what its training exported with `--choose-by loss`), else the
    paper's (`decoding.defaults`). A file is read only where a value is still missing.

    Raises:
        DamagedFileError: results.json or config.json is not a JSON object, or records a beam
            that is not an integer >= 1 or an alpha that is not a finite number >= 0.
    """
    if beam is not None and alpha is not None:
        return beam, alpha
    run = Path(run)
    read: dict[str, dict[str, Any]] = {}  # each file read once, when first needed

    def contents(file: str) -> dict[str, Any]:
        if file not in read:
            read[file] = _json_if_present(run / file)
        return read[file]

    # (file, the object that may hold "beam" and "alpha"), in the order they are looked in
    places = [(RESULTS_FILE, lambda: contents(RESULTS_FILE)),
              (RESULTS_FILE, lambda: contents(RESULTS_FILE).get("decoding")),
              (CONFIG_FILE, lambda: contents(CONFIG_FILE).get("arguments"))]

    def recorded(name: str, default, valid):
        for file, place_of in places:
            place = place_of()
            value = place.get(name) if isinstance(place, dict) else None
            if value is None:
                continue
            if isinstance(value, bool) or not valid(value):
                kind = "a whole number >= 1" if name == "beam" else "a finite number >= 0"
                raise DamagedFileError(
                    f"{run / file} is damaged: its {name!r} is {value!r}, not {kind}; "
                    f"{_DAMAGED_ADVICE[file]} (or give the {name} to decode with)")
            return value
        return default

    def is_beam(value) -> bool:
        return isinstance(value, int) and value >= 1

    def is_alpha(value) -> bool:
        return isinstance(value, int | float) and math.isfinite(value) and value >= 0

    return (beam if beam is not None else recorded("beam", DEFAULT_BEAM_SIZE, is_beam),
            alpha if alpha is not None else float(recorded("alpha", DEFAULT_ALPHA, is_alpha)))


class RunDirError(UsageError):
    """`--out` cannot be used: not a run directory, or a run made with other settings."""


def inspect_run_dir(
    out: str | Path, identity: dict[str, Any], overwrite: bool = False, resume: bool = False
) -> str:
    """What training should do with the directory `out`.

    Args:
        out: the run directory.
        identity: the settings that must match `config.json`'s "identity" for a resume.
        overwrite: start over even if `out` holds a run (it is deleted by the caller).
        resume: require a run to resume.

    Returns:
        "fresh" (absent, empty, or to be overwritten), "resume" or "finished".

    Raises:
        RunDirError: `out` is a file or a non-empty non-run folder, holds a run made with
            other settings (naming them), or `resume` is set and there is nothing to resume.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} exists and is not a directory")
    # Temporary files of a process killed while writing, and the lock, do not make a run.
    if not out.exists() or not storage.holds_files(out):
        if resume:
            raise RunDirError(f"--resume: {out} holds no run to resume")
        return "fresh"
    config_path = out / CONFIG_FILE
    if not config_path.is_file():
        raise RunDirError(f"--out {out} is a non-empty directory that is not a training run; "
                          "pick another --out")
    if overwrite:
        return "fresh"
    wanted = json.loads(json.dumps(identity))  # as it reads back from JSON (tuples -> lists)
    recorded = read_json(config_path).get("identity") or {}
    changed = sorted(key for key in wanted if recorded.get(key) != wanted[key])
    if changed:
        raise RunDirError(f"{out} was trained with different settings ({', '.join(changed)}); "
                          "use the original flags to resume, --overwrite to start over, or "
                          "another --out")
    return "finished" if (out / RESULTS_FILE).is_file() else "resume"


def lock_run_dir(lock: storage.FolderLock) -> None:
    """Takes the lock of a run directory (`storage.FolderLock`) before training writes it.

    Raises:
        RunDirError: another training run is writing it (naming its process).
    """
    try:
        lock.acquire()
    except storage.FolderInUse as error:
        raise RunDirError(f"{error}: another training run is writing it. Wait for that run "
                          "to end (or stop it), then run this command again to resume or "
                          "finish it; or pass another --out") from None


def lock_existing_run(lock: storage.FolderLock) -> None:
    """Takes the lock of `lock.folder` if it holds a run, before `inspect_run_dir` reads it
    (a new folder is locked by `take_run_dir`, once made).

    Raises:
        RunDirError: another training run is writing it.
    """
    if (lock.folder / CONFIG_FILE).is_file():
        lock_run_dir(lock)


def take_run_dir(lock: storage.FolderLock, mode: str, identity: dict[str, Any], *,
                 overwrite: bool, resume: bool) -> None:
    """Makes `lock.folder` this run's: creates it, takes its lock and, for a fresh run,
    empties it (`--overwrite`, or temporaries of killed writes) but for the lock file.

    Args:
        lock: the run directory's lock.
        mode: what `inspect_run_dir` (with the other arguments) said; if the lock was not
            held then, the folder is judged again under it: another run may have begun
            there meanwhile.

    Raises:
        RunDirError: another training run is writing it, or began there since `mode` was
            judged.
    """
    out = lock.folder
    out.mkdir(parents=True, exist_ok=True)
    if not lock.held:
        lock_run_dir(lock)
        if inspect_run_dir(out, identity, overwrite=overwrite, resume=resume) != mode:
            raise RunDirError(f"another run began in {out} while this one prepared: run this "
                              "command again to see what is there, or pass another --out")
    if mode == "fresh":
        empty_run_dir(out)


def empty_run_dir(out: Path) -> None:
    """Deletes what `out` holds but its lock file: a run starting meanwhile still finds
    the folder locked."""
    for entry in out.iterdir():
        if entry.name == storage.LOCK_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def delete_run_dir(out: Path) -> None:
    """Deletes, as far as it can, the run directory of a fresh run that failed; its lock
    file last, while still held."""
    with contextlib.suppress(OSError):
        empty_run_dir(out)
    shutil.rmtree(out, ignore_errors=True)


def run_record(config: TrainConfig, model_config) -> dict[str, Any]:
    """What config.json records first: `identity` (must match for a resume to be allowed), the
    model's hyperparameters, and `arguments`, the `TrainConfig`'s settings by flag name
    (`keras_transformer.training.config.config_from_flags` rebuilds it)."""
    model = {"preset": config.model.preset, **dataclasses.asdict(model_config)}
    data, batches, optimization = config.data, config.batches, config.optimization
    identity = {
        "data": data.data, "src": data.src, "tgt": data.tgt, "train_split": data.train_split,
        "prepared": data.prepared, "tokenizer_sample": data.tokenizer_sample,
        "model": model, "tokens_per_batch": batches.tokens_per_batch,
        "accumulate": batches.accumulate, "tokens_per_step": batches.tokens_per_step,
        "max_length": data.max_length, "label_smoothing": optimization.label_smoothing,
        "warmup_steps": optimization.warmup_steps, "lr_scale": optimization.lr_scale,
        "seed": optimization.seed, "checkpoint_every": config.output.checkpoint_every,
        "validate_every": config.validate_every,
        # Recorded only when set: the identities of other runs stay as they were.
        **({"init_from": config.model.init_from} if config.model.init_from else {}),
        **({"cooldown": optimization.cooldown, "max_steps": optimization.max_steps}
           if optimization.cooldown else {}),  # the schedule depends on the run's length
        **({"clean_train": True} if data.clean_train else {}),
        **({"carve_pairs": data.carve_pairs} if data.carve_pairs != DEFAULT_CARVE_PAIRS else {}),
    }
    return {"identity": identity, "model": model, "arguments": config.flags()}


def check_resumed_data(out: Path, config: dict[str, Any]) -> None:
    """Refuses to resume a run on other prepared data than it was trained on.

    Compares `config`'s "prepared" entry (corpus fingerprint and shard count: together
    they fix the batch stream) with what the run directory's config.json recorded, if it
    recorded one; a changed replica count only changes the batches, and is reported.

    Raises:
        UsageError: the data differ.
    """
    path = out / CONFIG_FILE
    recorded = read_json(path) if path.is_file() else {}
    before = recorded.get("prepared")
    if before is None:
        return  # a fresh run
    now = config["prepared"]
    for key in ("corpus_fingerprint", "shards"):
        if before.get(key) != now[key]:
            raise UsageError(f"{out} was trained on prepared data with {key} {before.get(key)!r}, "
                             f"{now['directory']} has {now[key]!r}: resume with the original "
                             "--prepared data, or start another run")
    if "step_budget" not in recorded and recorded.get("replicas", 1) > 1:
        raise UsageError(f"{out} was started on {recorded['replicas']} replicas when "
                         "--tokens-per-batch was a global budget (it is now per replica): its "
                         "steps cannot be continued as they were; start it again with "
                         "--overwrite, or another --out")
    for key, flag in (("precision", "--precision"), ("jit_compile", "--jit-compile")):
        # Another precision changes the optimizer's variables (loss scaling), XLA the
        # batches: neither run could continue where the other stopped.
        if None not in (recorded.get(key), config.get(key)) and recorded[key] != config[key]:
            value = recorded[key] if key == "precision" else ("on" if recorded[key] else "off")
            raise UsageError(f"{out} was trained with {key} {recorded[key]!r}, this machine "
                             f"would use {config[key]!r}: resume with {flag} {value}")
    if recorded.get("replicas") not in (None, config["replicas"]):
        print(f"note: resuming with {config['replicas']} replica(s) instead of "
              f"{recorded['replicas']}: the per-replica batches from here on differ from an "
              "uninterrupted run's", flush=True)
