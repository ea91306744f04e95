"""`kernels.custom_gradient`: `tf.custom_gradient`'s gradients, and graphs that can be freed.

The forward function below is x * x with a gradient deliberately not its derivative
(3 * upstream instead of 2 * x * upstream), so that every check sees which one was used:
the hand-written gradient or autodiff. A tape inside the traced function calls the gradient
it recorded; `tf.gradients`, while loops and the lazily built backward of a traced function
look it up by name, through the stand-in left in TensorFlow's registry. "Freed" is checked
with a weak reference to the traced graph after the function that traced it is dropped and
garbage is collected; the model-level check trains, evaluates and decodes twice in one
process and requires that the second round leaves no graph behind.
"""

from __future__ import annotations

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.framework.func_graph import FuncGraph

from keras_transformer.decoding.search import beam_search
from keras_transformer.kernels.custom_gradient import custom_gradient, release_custom_gradients
from keras_transformer.model.transformer import build_transformer
from keras_transformer.training.losses import GlobalTokenCrossEntropy, LabelSmoothedCrossEntropy
from keras_transformer.training.optimizer import FusedAdam, paper_adam
from keras_transformer.training.trainer_model import build_trainer

X = np.array([1.0, -2.0, 0.5], np.float32)
HAND_WRITTEN = 3.0 * np.ones_like(X)  # autodiff would give 2 * X


@custom_gradient
def square(x):
    def grad(upstream):
        return 3.0 * upstream

    return x * x, grad


def _custom_entries() -> set[str]:
    return {name for name in ops._gradient_registry._registry if name.startswith("CustomGradient")}


def _under_tape_in_function():
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = square(x)
        return tape.gradient(y, x)

    return step(tf.constant(X))


def _symbolic_in_function():
    """`tf.gradients` looks the gradient up in the registry by the op's name."""

    @tf.function
    def step(x):
        return tf.gradients(square(x), x)[0]

    return step(tf.constant(X))


def _through_a_while_loop():
    """while_v2 differentiates its body's graph through the registry."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            _, y = tf.while_loop(lambda i, y: i < 1, lambda i, y: (i + 1, square(y)), [0, x])
        return tape.gradient(y, x)

    return step(tf.constant(X))


def _eager_gradient(function):
    x = tf.constant(X)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = function(x)
    return tape.gradient(y, x)


def _traced_then_collected(python_function):
    """The backward function of a traced call is built lazily, on the first tape.gradient:
    here after a garbage collection, from the registry's stand-in."""
    function = tf.function(python_function).get_concrete_function(tf.TensorSpec([3], tf.float32))
    gc.collect()
    return _eager_gradient(function)


def _traced_function_differentiated_eagerly_after_a_collection():
    return _traced_then_collected(square)


def _while_body_differentiated_eagerly_after_a_collection():
    """The while loop's body graph, held by the loop's op, keeps its stand-in's function."""
    return _traced_then_collected(
        lambda x: tf.while_loop(lambda i, y: i < 1, lambda i, y: (i + 1, square(y)), [0, x])[1])


def _eager():
    return _eager_gradient(square)


@pytest.mark.parametrize("compute", [
    _eager, _under_tape_in_function, _symbolic_in_function, _through_a_while_loop,
    _traced_function_differentiated_eagerly_after_a_collection,
    _while_body_differentiated_eagerly_after_a_collection], ids=lambda f: f.__name__)
def test_the_gradient_is_the_hand_written_one(compute):
    np.testing.assert_allclose(compute().numpy(), HAND_WRITTEN, rtol=1e-6)


def test_a_traced_graph_is_freed_with_its_function_and_its_entry_leaves_the_registry():
    gc.collect()
    before = _custom_entries()
    function = tf.function(lambda x: tf.gradients(square(x), x)[0])
    concrete = function.get_concrete_function(tf.TensorSpec([3], tf.float32))
    graph = weakref.ref(concrete.graph)
    added = _custom_entries() - before
    assert len(added) == 1  # the one call's gradient, still registered while the graph lives
    np.testing.assert_allclose(concrete(tf.constant(X)).numpy(), HAND_WRITTEN)
    del function, concrete
    gc.collect()
    assert graph() is None
    assert not added & _custom_entries()


def test_release_custom_gradients_frees_a_graph_of_tensorflows_own_custom_gradients():
    """tf.distribute's all_reduce (Keras' optimizers call it on every step's gradients)."""
    moved = []

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, x * x)
        gradient = tape.gradient(y, x)  # all_reduce's gradient is one more all_reduce
        moved.append(release_custom_gradients())  # at the end of the trace
        moved.append(release_custom_gradients())  # a second time: already moved
        return gradient

    concrete = step.get_concrete_function(tf.TensorSpec([3], tf.float32))
    graph = weakref.ref(concrete.graph)
    np.testing.assert_allclose(concrete(tf.constant(X)).numpy(), 2 * X)
    assert moved == [2, 0]
    assert release_custom_gradients() == 0  # eagerly: nothing registered, nothing done
    del step, concrete
    gc.collect()
    assert graph() is None


def live_graphs() -> list[FuncGraph]:
    """The TensorFlow graphs alive after a garbage collection (shared with the serving
    tests)."""
    gc.collect()
    return [graph for graph in gc.get_objects() if isinstance(graph, FuncGraph)]


def _train_evaluate_decode(rng: np.random.Generator, accumulation: str) -> None:
    """A notebook's round: a model trained, evaluated, beam-decoded, then dropped. Trained
    with gradient accumulation (ours, with the train command's loss and the paper's Adam or
    Keras' SGD; or Keras' own, whose update runs in a `tf.cond` branch), or without, by a
    `TransformerTrainer` with Keras' own Adam (in float32; in mixed_float16, where the loss
    scaling applies the update in a `tf.cond` branch). (Over several replicas:
    tests/cluster/test_strategy.py.)"""
    if accumulation.startswith("ours"):
        model = build_trainer("tiny", vocab_size=40)
        optimizer = paper_adam(32, 10) if accumulation == "ours" else keras.optimizers.SGD(0.1)
        model.compile(optimizer, loss=GlobalTokenCrossEntropy(0.1), accumulate_steps=2)
    elif accumulation.startswith("none_keras_adam"):
        dtype = "mixed_float16" if accumulation.endswith("float16") else None
        model = build_trainer("tiny", vocab_size=40, dtype=dtype)
        model.compile("adam", loss=GlobalTokenCrossEntropy(0.1))
    else:
        model = build_transformer("tiny", vocab_size=40)
        model.compile(FusedAdam(1e-3, gradient_accumulation_steps=2),
                      loss=LabelSmoothedCrossEntropy(0.1))
    source = rng.integers(4, 40, (4, 6)).astype("int32")
    target = rng.integers(4, 40, (4, 7)).astype("int32")
    features = {"source": source, "target": target[:, :-1]}
    model.fit(features, target[:, 1:], batch_size=2, epochs=1, verbose=0)
    model.evaluate(features, target[:, 1:], batch_size=4, verbose=0)
    beam_search(model, source, beam_size=2, max_length=4)


@pytest.mark.parametrize("accumulation", ["ours", "ours_keras_sgd", "keras", "none_keras_adam",
                                          "none_keras_adam_float16"])
def test_a_model_trained_evaluated_decoded_and_dropped_leaves_no_graph_behind(accumulation):
    rng = np.random.default_rng(0)
    # fills the process's own caches (module-level functions)
    _train_evaluate_decode(rng, accumulation)
    keras.backend.clear_session()
    before = live_graphs()  # held: no graph of the next round can take one's id
    entries = _custom_entries()
    _train_evaluate_decode(rng, accumulation)
    keras.backend.clear_session()
    kept = {id(graph) for graph in before}
    assert [graph.name for graph in live_graphs() if id(graph) not in kept] == []
    assert _custom_entries() <= entries
