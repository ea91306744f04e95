"""Which Keras backend a run trains on (`--backend`), chosen before Keras is imported.

Keras reads `KERAS_BACKEND` once, when it is first imported, and a process cannot switch
afterwards. So the train command sets it from `--backend` right after parsing its flags (it
imports no Keras before), and a run asking for another backend than the loaded one is
refused with what to do. Under `jax` the training itself runs (`fit_jax`); decoding, test
BLEU and the SavedModel are TensorFlow's, so a JAX run ends by running the same command with
`--backend tensorflow`, which finds the run trained and only finishes it (or, where
TensorFlow is not installed, by naming that command).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import Any

from keras_transformer.errors import UsageError
from keras_transformer.training.recipes import AUTO

BACKENDS = ("tensorflow", "jax")


def use_backend(name: str) -> None:
    """Makes Keras load `name` (sets `KERAS_BACKEND` if Keras is not imported yet).

    Raises:
        UsageError: Keras already runs another backend, or `name`'s package is missing.
    """
    if not _installed(name):
        raise UsageError(f"--backend {name}: the {name} package is not installed "
                         f"(pip install {'jax' if name == 'jax' else 'tensorflow'}).")
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = name
    if name == "jax" and tensorflow_installed():
        # TensorFlow shares the process (the input's preparation) and the machine (the
        # finishing command): JAX takes GPU memory as it needs it, not 75% at start.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    check_backend(name)


def check_backend(name: str) -> None:
    """Raises UsageError unless Keras runs (or will run) on `name`."""
    loaded = (sys.modules["keras"].backend.backend() if "keras" in sys.modules
              else os.environ.get("KERAS_BACKEND", "tensorflow"))
    if loaded != name:
        raise UsageError(
            f"this run trains with --backend {name}, but Keras already runs on {loaded} in "
            f"this process (Keras chooses its backend once, when it is imported): run "
            f"`python -m keras_transformer.train ... --backend {name}`, or set "
            f"KERAS_BACKEND={name} before importing keras.")


def tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported here (decoding, scoring and export need it)."""
    return _installed("tensorflow")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a finder refused it, or sys.modules holds None
        return False


def finishing_command(config: Any, precision: str, trained_steps: int) -> list[str]:
    """The train command that finishes a JAX-trained run under TensorFlow: `config`'s
    (a `TrainConfig`; not imported here, which `training.config` imports) every setting as
    a flag, with `--backend tensorflow`, the training's precision and XLA (the run
    directory's batches), without `--overwrite`. It finds the run trained, so it averages,
    scores and exports. Print it with `shlex.join`.

    `--max-steps` is the steps trained (so that no other device count or `--epochs`
    rounding can make it train on), except with a `--cooldown`: that schedule depends on
    the planned length, which the run's identity records (`run_directory.run_record`), so
    the run's own `--max-steps`/`--epochs` stay, and a run stopped before them (patience,
    `--max-minutes`) is found done by the stop its backup records.

    A `--recipe auto` run is finished as it is resumed: with the flags its user gave (its
    plan is read back from config.json, and a plan's settings given as flags would be
    another request), the backend, precision and XLA changed.
    """
    changed = {"backend": "tensorflow", "overwrite": False, "precision": precision,
               "jit_compile": "on"}
    planned = config.recipe == AUTO
    if not config.optimization.cooldown and not planned:
        changed.update(max_steps=trained_steps, epochs=None)
    command = [sys.executable, "-m", "keras_transformer.train"]
    if config.recipe is not None:
        command += ["--recipe", config.recipe]
    for component in dataclasses.fields(config):
        settings = getattr(config, component.name)
        if not dataclasses.is_dataclass(settings):
            continue
        for field in dataclasses.fields(settings):
            if planned and field.name not in config.given and field.name not in changed:
                continue
            value = changed.get(field.name, getattr(settings, field.name))
            flag = "--" + field.name.replace("_", "-")
            if isinstance(value, bool):  # store_true, or --x/--no-x (a default not False)
                if value or field.default is not False:
                    command.append(flag if value else "--no-" + flag[2:])
            elif value is not None:  # every value explicit: no recipe default can differ
                command += [flag, str(value)]
    return command
