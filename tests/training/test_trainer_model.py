"""`TransformerTrainer`: the `Transformer` plus this project's training step. Same weights as
the model in both directions; the model itself keeps Keras' own training (no override, no
import of training/), and its config module loads without TensorFlow."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

from keras_transformer.model.transformer import Transformer, build_transformer
from keras_transformer.training.loss_scaling import LossScaleOptimizer
from keras_transformer.training.losses import LabelSmoothedCrossEntropy
from keras_transformer.training.trainer_model import TransformerTrainer, build_trainer
from tests.cli.test_train import REPO, cli_env

VOCAB = 37
# Everything the trainer adds to Keras' training; the model must define none of it.
TRAINING_METHODS = {"compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                    "predict_on_batch", "train_step", "make_train_function", "load_weights",
                    "get_compile_config", "compile_from_config", "accumulate_steps",
                    "pending_micro_batches"}


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    features = {"source": rng.integers(1, VOCAB, (3, 6)).astype("int32"),
                "target": rng.integers(1, VOCAB, (3, 5)).astype("int32")}
    return features, rng.integers(1, VOCAB, (3, 5)).astype("int32")


def test_a_trainers_weights_load_into_a_plain_transformer_and_back(tmp_path):
    features, labels = _batch()
    keras.utils.set_random_seed(0)
    trainer = build_trainer("tiny", vocab_size=VOCAB)
    trainer.compile(keras.optimizers.SGD(0.5), loss=LabelSmoothedCrossEntropy(0.1))
    trainer.train_on_batch(features, labels)  # trained weights, and optimizer state saved too
    trainer.save_weights(tmp_path / "trainer.weights.h5")

    keras.utils.set_random_seed(1)  # other initial weights
    model = build_transformer("tiny", vocab_size=VOCAB)
    assert type(model) is Transformer
    assert [w.path for w in model.weights] == [w.path for w in trainer.weights]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_weights(tmp_path / "trainer.weights.h5")
    expected = keras.ops.convert_to_numpy(trainer(features))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(features)), expected)

    model.save_weights(tmp_path / "model.weights.h5")
    keras.utils.set_random_seed(2)
    again = build_trainer("tiny", vocab_size=VOCAB)
    again.load_weights(tmp_path / "model.weights.h5")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(again(features)), expected)


def test_transformer_overrides_no_training_method():
    path = REPO / "keras_transformer" / "model" / "transformer.py"
    tree = ast.parse(path.read_text(), str(path))
    (cls,) = [node for node in tree.body
              if isinstance(node, ast.ClassDef) and node.name == "Transformer"]
    defined = {node.name for node in cls.body
               if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert not defined & TRAINING_METHODS
    trainer = {name for name in vars(TransformerTrainer) if not name.startswith("__")}
    assert trainer == TRAINING_METHODS  # the trainer holds exactly those


def test_the_model_package_imports_nothing_of_training():
    for path in sorted((REPO / "keras_transformer" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [name for name in names
                        if name.startswith("keras_transformer.training")], path


def test_the_model_config_loads_without_tensorflow():
    """Command lines import it to check their flags before TensorFlow loads."""
    code = ("import sys\n"
            "from keras_transformer.model.config import PRESETS, transformer_config\n"
            "transformer_config('tiny', vocab_size=40)\n"
            "print(sorted({'tensorflow', 'keras'} & set(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_a_plain_transformer_trains_as_any_keras_model():
    """Keras' own loss scaling under mixed_float16, ours on the trainer; no accumulation."""
    plain = build_transformer("tiny", vocab_size=VOCAB, dtype="mixed_float16")
    plain.compile(keras.optimizers.SGD(0.1), loss=LabelSmoothedCrossEntropy(0.1))
    assert type(plain.optimizer) is keras.optimizers.LossScaleOptimizer
    with pytest.raises(TypeError, match="accumulate_steps"):
        plain.compile(keras.optimizers.SGD(0.1), loss=LabelSmoothedCrossEntropy(0.1),
                      accumulate_steps=2)
    trainer = build_trainer("tiny", vocab_size=VOCAB, dtype="mixed_float16")
    trainer.compile(keras.optimizers.SGD(0.1), loss=LabelSmoothedCrossEntropy(0.1))
    assert isinstance(trainer.optimizer, LossScaleOptimizer) and trainer.accumulate_steps == 1
    assert trainer.config == plain.config and trainer.dtype_policy.name == "mixed_float16"


def test_a_saved_trainer_reloads_as_a_trainer(tmp_path):
    trainer = build_trainer("tiny", vocab_size=VOCAB)
    trainer.save(tmp_path / "trainer.keras")
    loaded = keras.models.load_model(tmp_path / "trainer.keras")
    assert type(loaded) is TransformerTrainer and loaded.config == trainer.config
    features, _ = _batch()
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(features)),
                                  keras.ops.convert_to_numpy(trainer(features)))


def test_the_optimizer_is_built_before_the_step_is_traced_with_the_same_result():
    # Keras' TensorFlow trainer, without a strategy, builds the optimizer inside the first
    # traced step, where each variable's initialization is guarded by a tf.cond (slow to
    # trace). The trainer builds it first, in `fit` and in `train_on_batch`: the same
    # variables and the same updates as Keras' own `fit` (the control).
    import tensorflow as tf

    features, labels = _batch(3)
    trained, built_when_traced = [], []
    for entry in (TransformerTrainer.fit, TransformerTrainer.train_on_batch, keras.Model.fit):
        keras.utils.set_random_seed(0)
        model = build_trainer("tiny", vocab_size=VOCAB, num_layers=1)
        model.compile(keras.optimizers.Adam(1e-2), loss=LabelSmoothedCrossEntropy(0.1))
        original = model.make_train_function

        def make_train_function(force=False, model=model, original=original):
            if model.train_function is None:  # the step is made (and traced) from here
                built_when_traced.append(model.optimizer.built)
            return original(force)

        model.make_train_function = make_train_function
        if entry is TransformerTrainer.train_on_batch:
            entry(model, features, labels)
            entry(model, features, labels)
        else:
            entry(model, tf.data.Dataset.from_tensors((features, labels)).repeat(2), epochs=1,
                  verbose=0, shuffle=False)
        assert int(model.optimizer.iterations) == 2
        # The paths below the optimizer's own (unique) name: "adam", "adam_1", ...
        trained.append(([v.path.split("/", 1)[1] for v in model.optimizer.variables],
                        [keras.ops.convert_to_numpy(w) for w in model.weights]))
    assert built_when_traced == [True, True, False]
    (paths, weights), *others = trained
    for other_paths, other_weights in others:
        assert other_paths == paths
        assert all(np.array_equal(a, b) for a, b in zip(weights, other_weights, strict=True))
