"""`WeightsWalk`: a model's `.weights.h5` files saved and loaded by a walk recorded once are
Keras' own, byte for byte and value for value, and the walk is recorded again when the
model's variables change."""

from __future__ import annotations

import io
import re
import warnings

import h5py
import keras
import numpy as np
import pytest
from keras.src.saving import saving_lib

from keras_transformer.model.transformer import build_transformer
from keras_transformer.training import weights_walk
from keras_transformer.training.losses import GlobalTokenCrossEntropy
from keras_transformer.training.optimizer import paper_adam
from keras_transformer.training.trainer_model import build_trainer
from keras_transformer.training.weights_walk import WeightsWalk

VOCAB = 60


def _keras_bytes(model: keras.Model, include_optimizer: bool) -> bytes:
    """Keras' `save_weights_only` walk, into memory as `weights_file_bytes` always wrote."""
    buffer = io.BytesIO()
    store = saving_lib.H5IOStore(buffer, mode="w")
    skipped = set() if include_optimizer else {id(model.optimizer)}
    saving_lib._save_state(model, weights_store=store, assets_store=None, inner_path="",
                           visited_saveables=skipped)
    store.close()
    return buffer.getvalue()


def _contents(source) -> dict[str, object]:
    """Every group's attributes and every dataset's values in a .weights.h5 file."""
    found = {}
    with h5py.File(source, "r") as file:
        def visit(name, item):
            found[name] = (dict(item.attrs) if isinstance(item, h5py.Group)
                           else (item[()].tobytes(), str(item.dtype), dict(item.attrs)))
        file.visititems(visit)
    return found


def _state(model: keras.Model) -> list[np.ndarray]:
    optimizer = getattr(model, "optimizer", None)
    return [np.array(v) for v in model.weights + (optimizer.variables if optimizer else [])]


def _batch() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    source = rng.integers(4, VOCAB, (4, 6)).astype("int32")
    target = rng.integers(4, VOCAB, (4, 7)).astype("int32")
    return {"source": source, "target": target[:, :-1]}, target[:, 1:]


@pytest.fixture
def trainer():
    """A tiny trainer accumulating 2 micro-batches an update (which builds its optimizer
    at compile), and a batch to train it on."""
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
    model.compile(paper_adam(32, 10), loss=GlobalTokenCrossEntropy(0.1), accumulate_steps=2)
    return model, _batch()


@pytest.fixture
def walks(monkeypatch) -> list[bool]:
    """Each time a `WeightsWalk` walks a model, whether it saved the arrays too."""
    made = []
    record = weights_walk._walk

    def counted(model, include_optimizer, save=True):
        made.append(save)
        return record(model, include_optimizer, save)

    monkeypatch.setattr(weights_walk, "_walk", counted)
    return made


def test_files_are_keras_own_before_and_after_the_optimizer_is_built(walks, tmp_path):
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=VOCAB)
    model.compile(paper_adam(32, 10), loss=GlobalTokenCrossEntropy(0.1))
    features, labels = _batch()
    walk = WeightsWalk()
    for include_optimizer in (True, False):  # recorded before the first step
        assert bytes(walk.file_bytes(model, include_optimizer)) == _keras_bytes(
            model, include_optimizer)
    unbuilt = len(model.optimizer.variables)  # its step counter only
    assert len(walks) == 2
    for round_ in range(2):  # the optimizer's variables appear: recorded again, then replayed
        model.fit(features, labels, verbose=0)
        for include_optimizer in (True, False):
            data = bytes(walk.file_bytes(model, include_optimizer))
            assert data == _keras_bytes(model, include_optimizer)
        assert len(walks) == 4 and len(model.optimizer.variables) > unbuilt, round_
    # What Keras' own save_weights writes to a path holds the same groups and arrays.
    path = tmp_path / "keras.weights.h5"
    model.save_weights(path)
    assert _contents(io.BytesIO(bytes(walk.file_bytes(model, True)))) == _contents(path)
    assert any(name.startswith("optimizer/") for name in _contents(path))


def test_a_recompiled_model_is_walked_again(trainer, tmp_path):
    model, (features, labels) = trainer
    walk = WeightsWalk()
    model.fit(features, labels, batch_size=2, verbose=0)
    before = bytes(walk.file_bytes(model, True))
    assert bytes(walk.file_bytes(model, True)) == _keras_bytes(model, True)  # replayed
    model.compile(keras.optimizers.SGD(0.1), loss=GlobalTokenCrossEntropy(0.1))
    model.fit(features, labels, batch_size=2, verbose=0)
    after = bytes(walk.file_bytes(model, True))
    assert after == _keras_bytes(model, True) and after != before
    # Keras' own file of this model, loaded by a fresh walk into a model of the same
    # architecture without an optimizer.
    path = tmp_path / "keras.weights.h5"
    model.save_weights(path)
    plain, by_keras = (build_transformer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
                       for _ in range(2))
    plain(features), by_keras(features)
    WeightsWalk().load(plain, path)
    by_keras.load_weights(path)
    assert all(np.array_equal(a, b) for a, b in zip(_state(plain), _state(by_keras),
                                                    strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(
        _state(plain), _state(build_transformer("tiny", vocab_size=VOCAB)), strict=True))


def test_loads_as_keras_load_weights(trainer, tmp_path, walks):
    model, (features, labels) = trainer
    model.fit(features, labels, batch_size=2, verbose=0)
    path = tmp_path / "a.weights.h5"
    model.save_weights(path)
    saved = _state(model)
    walk = WeightsWalk()
    for _ in range(2):  # recorded (without writing the arrays) on the first load
        model.fit(features, labels, batch_size=2, verbose=0)
        assert any(not np.array_equal(a, b) for a, b in zip(saved, _state(model), strict=True))
        walk.load(model, path)
        assert all(np.array_equal(a, b) for a, b in zip(saved, _state(model), strict=True))
    assert walks == [False]
    # Half of an accumulated update is discarded, as the trainer's own load_weights does.
    model.train_on_batch(features, labels)
    assert model.pending_micro_batches == 1
    walk.load(model, path)
    assert model.pending_micro_batches == 0
    assert all(np.array_equal(a, b) for a, b in zip(saved, _state(model), strict=True))


def test_a_file_that_does_not_fit_gets_keras_own_error(trainer, tmp_path):
    model, (features, labels) = trainer
    model.fit(features, labels, batch_size=2, verbose=0)
    other = build_trainer("tiny", vocab_size=VOCAB + 4)
    other.compile(paper_adam(32, 10), loss=GlobalTokenCrossEntropy(0.1))
    path = tmp_path / "other.weights.h5"
    other.save_weights(path)
    with warnings.catch_warnings(record=True) as keras_warnings, \
            pytest.raises(ValueError) as keras_error:
        warnings.simplefilter("always")
        model.load_weights(path)
    walk = WeightsWalk()
    walk.file_bytes(model, True)  # a recorded walk: its load fails, then Keras' raises
    with warnings.catch_warnings(record=True) as our_warnings, \
            pytest.raises(ValueError) as ours:
        warnings.simplefilter("always")
        walk.load(model, path)
    assert str(ours.value) == str(keras_error.value)
    # The same warnings as Keras', once each (the failed replay's are dropped); optimizer
    # names differ by their instance number only.
    def messages(caught):
        return sorted(re.sub(r"fused_adam_\d+", "fused_adam", str(w.message)) for w in caught)
    assert messages(keras_warnings)
    assert messages(our_warnings) == messages(keras_warnings)


def test_a_load_that_fits_warns_as_keras_load_weights_once(trainer, tmp_path):
    model, _ = trainer  # its optimizer built at compile (accumulation)
    other = build_trainer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
    other.compile(paper_adam(32, 10), loss=GlobalTokenCrossEntropy(0.1))  # optimizer unbuilt
    path = tmp_path / "unbuilt_optimizer.weights.h5"
    other.save_weights(path)

    def warned(load) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load(model, path)
        return [str(warning.message) for warning in caught]

    keras_warnings = warned(lambda model, path: model.load_weights(path))
    assert len(keras_warnings) == 1 and "Skipping variable loading for optimizer" in (
        keras_warnings[0])
    assert warned(WeightsWalk().load) == keras_warnings  # the replay loads, and warns once
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), other.get_weights(),
                                                    strict=True))
