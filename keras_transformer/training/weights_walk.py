"""A model's `.weights.h5` files saved and loaded by Keras' own walk over it, made once.

Keras saves a model's weights (`model.save_weights`, `model.load_weights`) by walking the
model to find every object that owns state (layers, the optimizer): `dir()` and `getattr`
on each object, then each found object saves or loads its own variables. For small models
the walk is most of a file's cost (60% of saving a `tiny` trainer's weights, 36% of loading
them: BENCHMARKS.md, "Keras' walk recorded once"), and a run saves and loads the same model
many times: a checkpoint and a backup at each interval, then every candidate average loaded
to be scored on val (paper 6.1 averages the last 5 checkpoints). A `WeightsWalk` records the
walk once (which objects, under which paths, in which order) and replays it: each object
saves or loads its own variables as Keras' walk asks it to, so the files are Keras' byte for
byte (tests/training/test_weights_walk.py). The walk is recorded again whenever the model's
layers or variables or its optimizer change (an optimizer built on the first step, a
recompile).
"""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import keras
from keras.src.saving import saving_lib

from keras_transformer.training.trainer_model import TransformerTrainer

# One object Keras' walk found: (the object, its path in the file, the metadata Keras gives
# its group).
_Visit = tuple[object, str, dict | None]


class WeightsWalk:
    """Saves and loads one model's `.weights.h5` files as Keras does, walking it once.

    Hold one for a model that is saved or loaded repeatedly; each call checks that the
    recorded walk still fits the model (same layers, variables and optimizer) and records
    it again when not.
    """

    def __init__(self):
        # include_optimizer -> (what the walk was recorded for, the objects in its order, or
        # None if it could not be recorded). The visits hold their objects (strongly, on
        # purpose): while recorded, none of them can be freed, so no other object can take
        # an id that `_what_the_walk_depends_on` compares.
        self._walks: dict[bool, tuple[tuple, list[_Visit] | None]] = {}

    def file_bytes(self, model: keras.Model, include_optimizer: bool = False) -> memoryview:
        """The bytes of the `.weights.h5` file Keras' `save_weights` writes for `model`
        (without the optimizer's variables unless `include_optimizer`)."""
        visits, data = self._recorded(model, include_optimizer, save=True)
        if data is not None:  # just recorded: the walk saved the file as it went
            return data
        buffer = io.BytesIO()
        store = saving_lib.H5IOStore(buffer, mode="w")
        for saveable, path, metadata in visits:
            saveable.save_own_variables(store.make(path, metadata=metadata))
        store.close()
        return buffer.getbuffer()

    def load(self, model: keras.Model, path: str | Path) -> None:
        """`model.load_weights(path)` for a `.weights.h5` file. Left to `model.load_weights`:
        a file that does not fit the model (Keras names what is missing or mismatched),
        another kind of file, a model holding part of an accumulated update (its own
        `load_weights` discards it) and a model whose class loads in its own way."""
        own_load = type(model).load_weights in (keras.Model.load_weights,
                                                TransformerTrainer.load_weights)
        if (own_load and str(path).endswith(".weights.h5") and Path(path).is_file()
                and not getattr(model, "pending_micro_batches", 0)):
            visits, _ = self._recorded(model, include_optimizer=True, save=False)
            if visits is not None and _replay_load(visits, path):
                return
        model.load_weights(path)

    def _recorded(self, model: keras.Model, include_optimizer: bool,
                  save: bool) -> tuple[list[_Visit] | None, memoryview | None]:
        """The walk recorded for `model`, recorded now if there is none that fits: (its
        visits, or None if it cannot be recorded; the file's bytes if it was walked now
        with `save`, else None)."""
        fits = _what_the_walk_depends_on(model)
        recorded = self._walks.get(include_optimizer)
        if recorded is not None and recorded[0] == fits and recorded[1] is not None:
            return recorded[1], None
        visits, data = _walk(model, include_optimizer, save)
        self._walks[include_optimizer] = (fits, visits)
        return visits, data if save else None


def _what_the_walk_depends_on(model: keras.Model) -> tuple:
    """What a recorded walk is valid for: the model, its optimizer, all their variables and
    the model's layers (an optimizer builds its variables on the first step; a recompile
    replaces it)."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.weights)
    if optimizer is not None:
        variables += optimizer.variables
    # Layers too: one without variables (a dropout) still has its group in the file.
    layers = model._flatten_layers(include_self=False)  # private Keras, as Keras' own walk
    return (id(model), id(optimizer), tuple(id(variable) for variable in variables),
            tuple((id(layer), layer.name) for layer in layers))


def _replay_load(visits: list[_Visit], path: str | Path) -> bool:
    """Loads each visited object's variables from `path` as Keras' `_load_state` walk does;
    False if one of them could not load (the file does not fit the model). The warnings of
    a replay that loads are shown as Keras' load shows them; those of one that fails are
    dropped, as Keras' own load, which the caller runs then, warns again."""
    with warnings.catch_warnings(record=True) as caught:
        loaded = _replay_each_load(visits, path)
    if loaded:
        for warning in caught:
            warnings.showwarning(warning.message, warning.category, warning.filename,
                                 warning.lineno, warning.file, warning.line)
    return loaded


def _replay_each_load(visits: list[_Visit], path: str | Path) -> bool:
    # Private Keras API, on purpose (checked against Keras 3.15.1; recheck on an upgrade):
    # `_load_state` visits the objects of a save walk that skips nothing, in the same order,
    # and asks each `load_own_variables(store.get(path))`, as here.
    try:
        store = saving_lib.H5IOStore(Path(path), mode="r")
    except Exception:  # noqa: BLE001 - the caller lets Keras' own load raise its error
        return False
    try:
        for saveable, inner_path, _ in visits:
            saveable.load_own_variables(store.get(inner_path))
    except Exception:  # noqa: BLE001 - as above
        return False
    finally:
        store.close()
    return True


class _RecordingStore(saving_lib.H5IOStore):
    """Keras' in-memory H5 store that also notes which object each group is made for."""

    def __init__(self, save: bool):
        super().__init__(io.BytesIO(), mode="w")
        self.save = save  # False: only the walk is wanted, not the file
        self.visits: list[_Visit] | None = []

    def make(self, path, metadata=None):
        # Private Keras API, on purpose (checked against Keras 3.15.1): `_save_state(saveable,
        # ...)` calls `saveable.save_own_variables(store.make(path, metadata))` for each
        # object of its walk, so its frame names the object. Called otherwise, nothing is
        # recorded, and every save and load walks the model again.
        caller = sys._getframe(1)
        saveable = caller.f_locals.get("saveable")
        if caller.f_code is not saving_lib._save_state.__code__ or saveable is None:
            self.visits = None
        elif self.visits is not None:
            self.visits.append((saveable, path, dict(metadata) if metadata else None))
        return super().make(path, metadata=metadata)

    def __setitem__(self, key, value):
        if self.save:
            super().__setitem__(key, value)


def _walk(model: keras.Model, include_optimizer: bool,
          save: bool = True) -> tuple[list[_Visit] | None, memoryview]:
    """Keras' `save_weights` into memory (the body of `saving_lib.save_weights_only`, which
    takes only a path), recording the objects its walk visits in their order: (the visits,
    or None where they could not be recorded; the file's bytes, or no arrays unless
    `save`)."""
    optimizer = getattr(model, "optimizer", None)
    skipped = {id(optimizer)} if optimizer is not None and not include_optimizer else set()
    store = _RecordingStore(save)
    saving_lib._save_state(model, weights_store=store, assets_store=None, inner_path="",
                           visited_saveables=skipped)
    store.close()
    return store.visits, store.path_or_io.getbuffer()
