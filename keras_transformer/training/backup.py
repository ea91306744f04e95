"""The resumable state of a run: backup generations, restored from the newest intact one.

A backup is what a killed run resumes from: the weights *and* the optimizer state (its step
count included) and `state.json` (the step, the stop rules' state, the elapsed time). Each
is written like an Orbax step: into a hidden temporary folder, every file fsynced, then
renamed to `backup/step-<step>/` — a generation is whole or absent — and the older
generations beyond `KEEP` are removed only after the new one is in place::

    backup/step-00000400/model_and_optimizer.weights.h5
    backup/step-00000400/state.json    step, stop state, and the CRC-32 and size of the
                                       weights and of every checkpoint file then kept
    backup/step-00000200/...           the previous generation, for when the newest is damaged

On start, `restore_backup` tries the generations newest first. One whose files are missing,
truncated, fail their checksum or do not load is reported in one line, set aside as
`damaged-step-<step>` and the next is tried; the run resumes from the newest intact one and
says so. If generations existed and none is intact it refuses, naming them. The checkpoints
are then made to agree with the state resumed from: files written after it are removed
(training writes them again) and files that fail their recorded checksum are set aside as
`<name>.damaged` (so averaging never reads them).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import keras
import numpy as np

from keras_transformer import run_directory
from keras_transformer.errors import UsageError
from keras_transformer.training.checkpoints import (
    BEST_FILE,
    list_checkpoints,
    save_model_weights,
)
from keras_transformer.training.weights_walk import WeightsWalk
from pipelines import storage

KEEP = 2  # generations kept: the newest, and the one before it for when it is damaged
WEIGHTS_FILE = "model_and_optimizer.weights.h5"  # Keras reads the .weights.h5 format by name
STATE_FILE = "state.json"
# The one backup of runs started before generations (state.next.json: written first).
LEGACY_WEIGHTS_FILE, LEGACY_NEXT_STATE_FILE = "latest.weights.h5", "state.next.json"
SEEDS_KEY = "random_states"  # state.json: the dropout generators' states
_PREFIX = "step-"
_LOG = logging.getLogger("keras_transformer")


def _seed_variables(model: keras.Model) -> list:
    """The states of the model's `keras.random.SeedGenerator`s (dropout's), in layer order:
    non-trainable variables that Keras' weight files leave out."""
    return [variable for variable in model.non_trainable_variables
            if variable.name == "seed_generator_state"]


def random_states(model: keras.Model) -> list[list[int]]:
    """Where each of the model's random generators is (dropout's masks from here on), as
    JSON: backed up with the weights, so that a resumed run draws the masks the
    uninterrupted run would have drawn, on either backend."""
    return [[int(value) for value in np.asarray(variable.numpy()).ravel()]
            for variable in _seed_variables(model)]


def restore_random_states(model: keras.Model, states: list[list[int]]) -> str | None:
    """Sets the model's random generators to `states` (`random_states`); returns what
    does not match (another model), or None."""
    variables = _seed_variables(model)
    if len(states) != len(variables):
        return f"{STATE_FILE} holds {len(states)} random states, the model has {len(variables)}"
    for variable, state in zip(variables, states, strict=True):
        variable.assign(np.asarray(state, dtype=variable.dtype).reshape(variable.shape))
    return None


def generation_dir(backup_dir: str | Path, step: int) -> Path:
    """The folder of the generation of `step`."""
    return Path(backup_dir) / f"{_PREFIX}{step:08d}"


def list_generations(backup_dir: str | Path) -> list[tuple[int, Path]]:
    """Finalized generations as (step, folder), newest first."""
    found = []
    for folder in Path(backup_dir).glob(f"{_PREFIX}*"):
        digits = folder.name[len(_PREFIX):]
        if digits.isdigit() and folder.is_dir():
            found.append((int(digits), folder))
    return sorted(found, reverse=True)


def write_backup(model: keras.Model, backup_dir: str | Path, state: dict[str, Any],
                 checkpoints: dict[str, dict[str, int]],
                 walk: WeightsWalk | None = None) -> None:
    """Writes the generation of `state["step"]` and removes those beyond `KEEP`.

    Args:
        model: the model with its optimizer (weights and optimizer state are saved).
        backup_dir: the run's `backup/`.
        state: what a resumed run needs (`RunCheckpointer.state`); must hold "step".
        checkpoints: the checkpoint files kept now, name -> {"bytes", "crc32"}, recorded so
            that a restore can tell damaged or later checkpoints apart.
        walk: the `WeightsWalk` of a model backed up again and again.

    Raises:
        StorageError: the disk is full or failing; the earlier generations are untouched.
    """
    backup_dir = Path(backup_dir)
    backup_dir.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    staging = backup_dir / f".tmp-{os.getpid()}-{_PREFIX}{step:08d}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    final = generation_dir(backup_dir, step)
    try:
        weights = save_model_weights(model, staging / WEIGHTS_FILE, include_optimizer=True,
                                     walk=walk)
        storage.write_json(staging / STATE_FILE,
                           {**state, "weights": weights, "checkpoints": checkpoints,
                            SEEDS_KEY: random_states(model)})
        if final.exists():  # the same step again (a resumed run that set a damaged one aside)
            shutil.rmtree(final)
        storage.replace_folder(staging, final, synced=True)
    except storage.StorageError as error:  # named by the generation, not its staging folder
        shutil.rmtree(staging, ignore_errors=True)
        raise storage.StorageError(error.errno, final, error.needed) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for _, older in list_generations(backup_dir)[KEEP:]:
        shutil.rmtree(older, ignore_errors=True)
    for name in (LEGACY_WEIGHTS_FILE, LEGACY_NEXT_STATE_FILE, STATE_FILE):
        (backup_dir / name).unlink(missing_ok=True)  # an earlier version's, now superseded


def restore_backup(model: keras.Model, run: str | Path, repair: bool = True) -> dict[str, Any]:
    """Loads the newest intact generation of `run`'s backup into `model`; returns its state.

    A run started by an earlier version, with one backup (`latest.weights.h5` with
    `state.json`, or `state.next.json` when it was killed between the two), resumes from it.

    Args:
        model: the compiled model with its optimizer built.
        run: the run directory (its `backup/` and `checkpoints/` are read).
        repair: once an intact generation is found, set the damaged newer ones aside,
            make the checkpoints agree with it, and remove leftover temporary files (the
            chief does; other workers of a cluster only read).

    Returns:
        The state (empty for a run with no backup at all: it starts at step 0, and says so
        if it had written checkpoints, which it then writes again).

    Raises:
        UsageError: backups exist (or were set aside before) and none is intact, naming
            each and what is wrong; or an intact backup that does not fit this run's
            settings (its checksum holds but it does not load). Nothing is moved.
    """
    run = Path(run)
    backup_dir = run / run_directory.BACKUP_DIR
    checkpoint_dir = run / run_directory.CHECKPOINT_DIR
    problems: list[tuple[Path, str]] = []
    for step, weights, state_file in _candidates(backup_dir):
        problem = _load_generation(model, weights, state_file, step)
        if problem is None:
            state = run_directory.read_json(state_file)
            for folder, reason in problems:
                _LOG.warning(f"backup {folder} is damaged ({reason})"
                             + ("; it is set aside" if repair else ""))
            if problems:
                _LOG.warning(f"resuming from the intact backup of step {step:,} "
                             f"({_owner(weights, backup_dir)}) instead")
            if repair:
                _set_aside([folder for folder, _ in problems if folder.parent == backup_dir
                            and folder.name.startswith(_PREFIX)])
                for folder in (backup_dir, checkpoint_dir):
                    storage.remove_stale_temporaries(folder)
                _agree_checkpoints(checkpoint_dir, step, state.get("checkpoints"))
            return state
        problems.append((_owner(weights, backup_dir), problem))
    set_aside = sorted(backup_dir.glob("damaged-*")) if backup_dir.is_dir() else []
    if problems or set_aside:
        named = [f"{folder.name}: {reason}" for folder, reason in problems]
        named += [f"{folder.name} (set aside before)" for folder in set_aside]
        raise UsageError(
            f"{backup_dir}: no intact backup to resume from ({'; '.join(named)}); the run "
            "cannot continue: start it again with --overwrite (or another --out); its "
            f"intact checkpoints in {checkpoint_dir} can still be averaged with "
            "`python -m keras_transformer.averaging`")
    found = list_checkpoints(checkpoint_dir)
    if found:  # killed after its first checkpoint, before its first backup
        _LOG.warning(f"{backup_dir} holds no backup: training starts at step 0 (the "
                     f"checkpoints up to step {found[-1][0]:,} are written again)")
    return {}


def _owner(weights: Path, backup_dir: Path) -> Path:
    """What a backup is named by: its generation folder, or an earlier version's file."""
    return weights.parent if weights.parent != backup_dir else weights


def _set_aside(paths: list[Path]) -> None:
    """Renames damaged generations `damaged-<name>` (`-2`, `-3`... if taken)."""
    for path in paths:
        target, number = path.with_name("damaged-" + path.name), 1
        while target.exists():
            number += 1
            target = path.with_name(f"damaged-{path.name}-{number}")
        os.replace(path, target)


def newest_step(backup_dir: str | Path) -> int:
    """The step of the newest backup (not checked), 0 if there is none."""
    candidates = _candidates(Path(backup_dir))
    return max(candidates[0][0], 0) if candidates else 0


def _candidates(backup_dir: Path) -> list[tuple[int, Path, Path]]:
    """(step, weights file, state file) of every backup to try, newest first: the
    generations, and the single backup of a run started by an earlier version
    (`latest.weights.h5` with `state.next.json` or `state.json`, whichever is its step)."""
    found = [(step, folder / WEIGHTS_FILE, folder / STATE_FILE)
             for step, folder in list_generations(backup_dir)]
    weights = backup_dir / LEGACY_WEIGHTS_FILE
    if weights.is_file():
        for name in (LEGACY_NEXT_STATE_FILE, STATE_FILE):
            try:
                step = int(run_directory.read_json(backup_dir / name)["step"])
            except (OSError, UsageError, KeyError, TypeError, ValueError):
                step = -1  # reported by `_load_generation`
            if name == STATE_FILE or step >= 0:
                found.append((step, weights, backup_dir / name))
    return sorted(found, key=lambda candidate: candidate[0], reverse=True)


def _load_generation(model: keras.Model, weights: Path, state_file: Path,
                     step: int) -> str | None:
    """Loads one backup into `model`; returns what is wrong with it, or None.

    Raises:
        UsageError: the weights pass their recorded checksum but do not load or hold
            another step: they are intact, made with other settings than this run's.
    """
    try:
        state = run_directory.read_json(state_file)
    except FileNotFoundError:
        return f"{state_file.name} is missing"
    except UsageError:
        return f"{state_file.name} is not valid JSON"
    except OSError as error:
        return f"{state_file.name} is unreadable ({error.strerror})"
    recorded = state.get("weights") or {}  # (an earlier version's backup records none)
    problem = _file_problem(weights, recorded)
    if problem is not None:
        return problem
    if state.get("step") != step:
        return f"{state_file.name} says step {state.get('step')!r}"
    # Keras warns about what it skips before it raises on weights of another model ("...
    # will retain their freshly-initialized weights"): the refusal below says what happened,
    # so its warnings are shown only for weights that did load. Recorded under the caller's
    # filters (judged where Keras warns: "ignore" drops one, "error" makes it a failed load),
    # then shown as Python would have shown them.
    with warnings.catch_warnings(record=True) as warned:
        try:
            model.load_weights(weights)
            held = int(model.optimizer.iterations.numpy())
        except Exception as error:  # noqa: BLE001 (h5py and Keras raise many kinds)
            problem = (f"{weights.name} does not load ({type(error).__name__}: "
                       f"{_first_line(error)})")
        else:
            problem = None if held == step else f"{weights.name} holds step {held}"
    if problem is None:
        for warning in warned:
            warnings.showwarning(warning.message, warning.category, warning.filename,
                                 warning.lineno, warning.file, warning.line)
    if problem is None and SEEDS_KEY in state:  # (an earlier version's backup has none)
        problem = restore_random_states(model, state[SEEDS_KEY])
    if problem is not None and "crc32" in recorded:
        # Intact, as written: another model or optimizer (e.g. another --precision).
        raise UsageError(f"{_owner(weights, state_file.parent)} does not match this run's "
                         f"settings ({problem}): resume with the flags it was trained with")
    return problem


def _file_problem(path: Path, recorded: dict[str, int]) -> str | None:
    """What is wrong with `path` against its recorded size and CRC-32, or None."""
    try:
        size = path.stat().st_size
        if "bytes" in recorded and size != recorded["bytes"]:
            return f"{path.name} has {size:,} bytes, {recorded['bytes']:,} were written"
        if "crc32" in recorded and storage.file_checksum(path) != recorded["crc32"]:
            return f"{path.name} fails its checksum"
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as error:  # a failing disk: try the older generation
        return f"{path.name} is unreadable ({error.strerror})"
    return None


def _agree_checkpoints(checkpoint_dir: Path, step: int,
                       recorded: dict[str, dict[str, int]] | None) -> None:
    """Makes `checkpoint_dir` agree with the state of `step` (see the module docstring).

    `recorded` is None for an earlier version's state, which recorded no checkpoints: only
    those of later steps are removed then.
    """
    if not checkpoint_dir.is_dir():
        return
    newer = [path for saved, path in list_checkpoints(checkpoint_dir) if saved > step]
    best = checkpoint_dir / BEST_FILE
    if recorded is not None and best.is_file() and (
            BEST_FILE not in recorded or _file_problem(best, recorded[BEST_FILE]) is not None):
        # Rewritten after the state (or damaged): either way not the best the state knows.
        newer.append(best)
    for path in newer:
        path.unlink(missing_ok=True)
    if newer:
        _LOG.info(f"removed {len(newer)} checkpoint file(s) written after step {step:,} "
                  "(training writes them again)")
    for name, sizes in (recorded or {}).items():
        if name == BEST_FILE:
            continue
        path = checkpoint_dir / name
        problem = _file_problem(path, sizes) if path.exists() else None
        if problem is not None:
            os.replace(path, path.with_name(path.name + ".damaged"))
            _LOG.warning(f"checkpoint {path} is damaged ({problem}); set aside as "
                         f"{path.name}.damaged, it is not averaged")


def checkpoint_record(checkpoint_dir: Path, state: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The restored `state`'s record of the checkpoint files (name -> {"bytes", "crc32"})
    still present in `checkpoint_dir`: what the checkpointer keeps up to date from there.
    A state that records none (an earlier version's) takes the files present as they are."""
    present = ({path.name: path for path in checkpoint_dir.iterdir()}
               if checkpoint_dir.is_dir() else {})
    if "checkpoints" not in state:
        return {name: {"bytes": path.stat().st_size, "crc32": storage.file_checksum(path)}
                for name, path in present.items()
                if name == BEST_FILE or (name.startswith("ckpt-") and name.endswith(".h5"))}
    return {name: sizes for name, sizes in state["checkpoints"].items() if name in present}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:160] if text else ""
