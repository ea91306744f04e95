"""`WeightsWalk`: a model's `.weights.h5` files saved and loaded by a walk recorded once are
Keras' own, byte for byte and value for value, and the walk is recorded again when the
model's variables change."""

from __future__ import annotations

import io

import h5py
import keras
import numpy as np
import pytest
from keras.src.saving import saving_lib

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
    return [np.array(v) for v in model.weights + model.optimizer.variables]


@pytest.fixture
def trainer():
    """A tiny trainer compiled, not yet trained (its optimizer has no variables), and a
    batch to train it on."""
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
    model.compile(paper_adam(32, 10), loss=GlobalTokenCrossEntropy(0.1), accumulate_steps=2)
    rng = np.random.default_rng(0)
    source = rng.integers(4, VOCAB, (4, 6)).astype("int32")
    target = rng.integers(4, VOCAB, (4, 7)).astype("int32")
    batch = ({"source": source, "target": target[:, :-1]}, target[:, 1:])
    return model, batch


def test_files_are_keras_own_before_and_after_the_optimizer_is_built(trainer, tmp_path):
    model, (features, labels) = trainer
    walk = WeightsWalk()
    for include_optimizer in (True, False):  # recorded before the first step
        assert bytes(walk.file_bytes(model, include_optimizer)) == _keras_bytes(
            model, include_optimizer)
    for _ in range(2):  # the optimizer's variables appear: recorded again, then replayed
        model.fit(features, labels, batch_size=2, verbose=0)
        for include_optimizer in (True, False):
            data = bytes(walk.file_bytes(model, include_optimizer))
            assert data == _keras_bytes(model, include_optimizer)
    # What Keras' own save_weights writes to a path holds the same groups and arrays.
    path = tmp_path / "keras.weights.h5"
    model.save_weights(path)
    assert _contents(io.BytesIO(bytes(walk.file_bytes(model, True)))) == _contents(path)
    assert any(name.startswith("optimizer/") for name in _contents(path))


def test_a_recompiled_model_is_walked_again(trainer):
    model, (features, labels) = trainer
    walk = WeightsWalk()
    model.fit(features, labels, batch_size=2, verbose=0)
    before = bytes(walk.file_bytes(model, True))
    model.compile(keras.optimizers.SGD(0.1), loss=GlobalTokenCrossEntropy(0.1))
    model.fit(features, labels, batch_size=2, verbose=0)
    after = bytes(walk.file_bytes(model, True))
    assert after == _keras_bytes(model, True) and after != before


def test_loads_as_keras_load_weights(trainer, tmp_path):
    model, (features, labels) = trainer
    model.fit(features, labels, batch_size=2, verbose=0)
    walk = WeightsWalk()
    path = tmp_path / "a.weights.h5"
    path.write_bytes(walk.file_bytes(model, True))
    saved = _state(model)
    for _ in range(2):  # recorded on the first load, replayed on the second
        model.fit(features, labels, batch_size=2, verbose=0)
        assert any(not np.array_equal(a, b) for a, b in zip(saved, _state(model), strict=True))
        walk.load(model, path)
        assert all(np.array_equal(a, b) for a, b in zip(saved, _state(model), strict=True))
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
    with pytest.raises(ValueError) as keras_error:
        model.load_weights(path)
    walk = WeightsWalk()
    walk.file_bytes(model, True)  # a recorded walk: the replayed load fails, then Keras'
    with pytest.raises(ValueError) as ours:
        walk.load(model, path)
    assert str(ours.value) == str(keras_error.value)
