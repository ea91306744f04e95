"""`.keras` round trips: every public loss and metric of `keras_transformer.training.losses`,
and a compiled `TransformerTrainer` (GlobalTokenCrossEntropy, the metrics, `paper_adam`,
`accumulate_steps`), reload as they were saved; Keras' own gradient accumulation is refused."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_transformer.training.losses import (
    GlobalTokenCrossEntropy,
    LabelSmoothedCrossEntropy,
    MaskedAccuracy,
    Perplexity,
)
from keras_transformer.training.optimizer import paper_adam
from keras_transformer.training.trainer_model import TransformerTrainer, build_trainer

VOCAB = 23


def _numpy(x) -> np.ndarray:
    return keras.ops.convert_to_numpy(x)


def _tiny_model(**compile_kwargs) -> keras.Model:
    """A functional model mapping token ids (batch, length) to logits (batch, length, VOCAB)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Embedding(VOCAB, VOCAB)(inputs))
    model.compile(optimizer="sgd", **compile_kwargs)
    return model


def _inputs_and_labels(model: keras.Model) -> tuple[np.ndarray, np.ndarray]:
    """Ids, and labels right about half the time (so accuracy is neither 0 nor 1), with
    padding (0) at the ends of some rows."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(4, 7)).astype("int32")
    labels = np.argmax(_numpy(model(ids)), axis=-1).astype("int32")
    wrong = rng.random(labels.shape) < 0.5
    labels[wrong] = rng.integers(1, VOCAB, size=int(wrong.sum()))
    labels[1, 5:] = 0
    labels[3, 3:] = 0
    return ids, labels


def _reload(model: keras.Model, tmp_path) -> keras.Model:
    path = tmp_path / "model.keras"
    keras.saving.save_model(model, path)
    return keras.saving.load_model(path)


@pytest.mark.parametrize("loss", [LabelSmoothedCrossEntropy(0.2, name="smoothed"),
                                  LabelSmoothedCrossEntropy(0.0),
                                  GlobalTokenCrossEntropy(0.05, name="global_ce")],
                         ids=["smoothed", "unsmoothed", "global_token"])
def test_a_loss_reloads_with_its_class_config_and_value(loss, tmp_path):
    model = _tiny_model(loss=loss)
    ids, labels = _inputs_and_labels(model)
    loaded = _reload(model, tmp_path)

    assert type(loaded.loss) is type(loss)
    assert loaded.loss.get_config() == loss.get_config()
    expected = float(_numpy(loss(labels, model(ids))))
    assert expected > 0.0
    assert float(_numpy(loaded.loss(labels, loaded(ids)))) == pytest.approx(expected, rel=1e-6)
    assert loaded.evaluate(ids, labels, verbose=0) == pytest.approx(
        model.evaluate(ids, labels, verbose=0), rel=1e-6)


@pytest.mark.parametrize("metric", [MaskedAccuracy(), MaskedAccuracy(name="token_accuracy"),
                                    Perplexity(), Perplexity(name="ppl")],
                         ids=["accuracy", "named_accuracy", "perplexity", "named_perplexity"])
def test_a_metric_reloads_with_its_class_config_and_value(metric, tmp_path):
    model = _tiny_model(loss=LabelSmoothedCrossEntropy(0.1), metrics=[metric])
    ids, labels = _inputs_and_labels(model)
    expected = model.evaluate(ids, labels, verbose=0, return_dict=True)
    loaded = _reload(model, tmp_path)

    got = loaded.evaluate(ids, labels, verbose=0, return_dict=True)
    (reloaded,) = loaded.metrics[1].metrics  # [loss tracker, CompileMetrics], after a build
    assert type(reloaded) is type(metric)
    assert reloaded.get_config() == metric.get_config()
    assert set(got) == {"loss", metric.name}
    if isinstance(metric, MaskedAccuracy):
        assert 0.0 < expected[metric.name] < 1.0
    else:
        assert expected[metric.name] > 1.0
    assert got == pytest.approx(expected, rel=1e-6)


def _trainer_batch(seed: int):
    rng = np.random.default_rng(seed)
    features = {"source": rng.integers(1, VOCAB, (3, 6)).astype("int32"),
                "target": rng.integers(1, VOCAB, (3, 5)).astype("int32")}
    labels = rng.integers(1, VOCAB, (3, 5)).astype("int32")
    labels[0, 3:] = 0
    return features, labels


def test_a_compiled_trainer_reloads_compiled_as_saved(tmp_path):
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=VOCAB)
    model.compile(optimizer=paper_adam(model.config.d_model, 4, 1.0),
                  loss=GlobalTokenCrossEntropy(0.1),
                  metrics=[MaskedAccuracy(), Perplexity()], accumulate_steps=2)
    for seed in (1, 2):  # one whole update: non-zero Adam moments, iterations 1
        model.train_on_batch(*_trainer_batch(seed))
    assert int(_numpy(model.optimizer.iterations)) == 1 and model.pending_micro_batches == 0
    loaded = _reload(model, tmp_path)

    assert type(loaded) is TransformerTrainer and loaded.config == model.config
    assert loaded.accumulate_steps == 2
    assert loaded.get_compile_config()["accumulate_steps"] == 2
    assert loaded.get_compile_config() == model.get_compile_config()
    assert type(loaded.loss) is GlobalTokenCrossEntropy
    assert loaded.loss.get_config() == model.loss.get_config()
    assert type(loaded.optimizer) is type(model.optimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(_numpy(loaded.optimizer.iterations)) == 1

    features, labels = _trainer_batch(3)
    logits = _numpy(model(features))
    np.testing.assert_array_equal(_numpy(loaded(features)), logits)
    expected_loss = float(_numpy(model.loss(labels, logits)))
    assert float(_numpy(loaded.loss(labels, loaded(features)))) == pytest.approx(expected_loss,
                                                                                 rel=1e-6)
    got = loaded.evaluate(features, labels, verbose=0, return_dict=True)
    assert set(got) == {"loss", "accuracy", "perplexity"}
    assert got == pytest.approx(model.evaluate(features, labels, verbose=0, return_dict=True),
                                rel=1e-6)

    # It trains on as the original: accumulating (no update after one micro-batch), from the
    # same optimizer state, to the same weights.
    before = [w.numpy() for w in loaded.trainable_weights]
    for trainer in (model, loaded):
        trainer.train_on_batch(*_trainer_batch(4))
    assert loaded.pending_micro_batches == 1
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, loaded.trainable_weights,
                                                               strict=True))
    for trainer in (model, loaded):
        trainer.train_on_batch(*_trainer_batch(5))
    assert int(_numpy(loaded.optimizer.iterations)) == 2
    for a, b in zip(model.trainable_weights, loaded.trainable_weights, strict=True):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wrapped", [False, True], ids=["adam", "loss_scale_optimizer"])
def test_keras_own_gradient_accumulation_is_refused(wrapped):
    model = build_trainer("tiny", vocab_size=VOCAB)
    optimizer = keras.optimizers.Adam(gradient_accumulation_steps=2)
    if wrapped:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2") as refused:
        model.compile(optimizer=optimizer, loss=GlobalTokenCrossEntropy(0.1))
    assert "accumulate_steps=2" in str(refused.value)
    assert "--accumulate 2" in str(refused.value)
    assert not model.compiled
    with pytest.raises(ValueError, match="accumulate_steps=3"):  # by position too
        model.compile(keras.optimizers.SGD(gradient_accumulation_steps=3))
