"""`tf.custom_gradient` whose graphs can be garbage collected.

The hand-written gradients of this project's TensorFlow fast paths (3.1's LayerNorm, the
fused kernels, 5.4's cross-entropy) are `tf.custom_gradient` functions. In graph mode (a
`tf.function`, a Keras scratch graph, a while loop's body) every call of one registers its
gradient function under a fresh name ("CustomGradient-<uid>") in TensorFlow's global
gradient registry, and nothing ever removes it (tensorflow/tensorflow#27492, #97697). That
function's closure holds the call's tensors, so the registry keeps every graph that ever
called one alive for the life of the process, with all its operations: a training step,
each decoding search, each layer's scratch graph when Keras builds a model. A process that
builds and traces many graphs grows without bound: a notebook that trains model after model,
a back-translation run (two models), a server reloading models, and this project's test
suite (after four test modules, 324,000 graph operations alive and walked by every garbage
collection). (Since `gradients_recorded` below, the LayerNorm takes its hand-written
gradient only under a tape: decoding searches and scratch graphs no longer call one.)

`custom_gradient` below is `tf.custom_gradient` with one change, after each graph-mode call:
the registered function moves onto the graph that holds the call, and the registry keeps a
small function that reaches it through a weak reference to that graph and is removed when
the graph is collected. Gradients are exactly TensorFlow's, looked up the same way, for as
long as anything can ask for them (asking needs the graph's operations, which hold the
graph); the graph is then freed with its last user. Eager calls register nothing and are
left as they are. One difference remains: a copy of such an operation in another graph (a
`tf.compat.v1.import_graph_def`, a function re-imported without its custom gradients) finds
no gradient once the original graph is gone, where TensorFlow would have differentiated the
copy with the original's tensors.

`release_custom_gradients` does the same at the end of a trace, for the custom gradients of
TensorFlow's own code in the graph: tf.distribute's `all_reduce` is one, and Keras' optimizers
call it on the gradients of every traced training step, even on one device. `FusedAdam` (the
paper's Adam, `paper_adam`: after Keras' update step), `TransformerTrainer.train_step` (after
Keras' step, whatever the optimizer), the loss scaling's update (in its `tf.cond` branch), the
gradient accumulation's update (after any optimizer's) and
`losses_tensorflow.sum_over_replicas` call it. A plain `Transformer` compiled with an optimizer
of Keras' own (`"adam"`) still has each traced training step kept alive by Keras' all-reduce.

`gradients_recorded` says whether a gradient tape could record what is computed now, so that
a hand-written gradient (a speed-up of the backward pass only) is left out where no tape
could use it: inference, evaluation, decoding, a SavedModel's signatures. Such graphs then
register nothing; and a SavedModel holding custom gradients saves their traced gradient
functions, which every `tf.saved_model.load` of it registers for the life of the process,
with the loaded functions they hold (a `small` model's export: ~230 graphs and ~430 MiB a
load).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

# The graph attribute that owns the gradient functions of its custom-gradient calls.
_OWNED_GRADIENTS = "_keras_transformer_custom_gradients"


def custom_gradient(forward: Callable) -> Callable:
    """`tf.custom_gradient(forward)`, letting each graph that calls it be garbage collected.

    Args:
        forward: as for `tf.custom_gradient`: takes tensors (positional arguments only),
            returns (outputs, gradient function).

    Returns:
        the decorated function: the same outputs and gradients as `tf.custom_gradient`.
    """
    import tensorflow as tf  # a TensorFlow fast path: callers import it already

    decorated = tf.custom_gradient(forward)

    # Called as tf.custom_gradient's own wrapper is: as Python, not converted by AutoGraph.
    @tf.autograph.experimental.do_not_convert
    @functools.wraps(forward)
    def call(*args):
        outputs = decorated(*args)
        flat = tf.nest.flatten(outputs, expand_composites=True)
        if flat and not tf.executing_eagerly():
            _move_onto_graph(flat[0].op)
        return outputs

    return call


def gradients_recorded() -> bool:
    """Whether a `tf.GradientTape` (or forward accumulator) could record the operations made
    now on this thread.

    True under an active tape: eagerly, and while tracing a function that runs under one (a
    Keras training step traces the model inside its tape, in each replica's thread under
    `tf.distribute`). False elsewhere: a Keras model built outside a tape, evaluation,
    decoding, a SavedModel's signatures, under `tape.stop_recording()`. The operations made
    where this is False are still differentiable, by autodiff of the forward operations: by
    `tf.gradients`, or by a tape around a function traced earlier without one.
    """
    # TensorFlow has no public query of the tape stack (the module moved once, in TF 2.13):
    # if it moves again, every call takes the hand-written gradient, as before this query.
    try:
        from tensorflow.python.eager.record import could_possibly_record
    except ImportError:
        return True
    return could_possibly_record()


def release_custom_gradients(graph=None) -> int:
    """Lets a graph be collected despite the custom gradients its operations registered.

    For the `tf.custom_gradient` calls of code this project does not own, made while tracing
    the graph: tf.distribute's `all_reduce` is one, which Keras' optimizers call on the
    gradients of each traced training step (and this project's all-reduces over several
    replicas). Call it at the end of a trace, inside the function being traced: it walks the
    operations that trace made in that graph, not those of graphs nested in it (a while
    loop's body, a `tf.cond` branch: call it there, where they are being traced), nor
    operations imported from elsewhere. A function already moved is left as it is.

    Args:
        graph: a `tf.Graph`; default: the graph being built (none when executing eagerly:
            then nothing was registered, and nothing is done).

    Returns:
        the number of registered gradient functions moved onto the graph.
    """
    import tensorflow as tf

    if graph is None:
        if tf.executing_eagerly():
            return 0
        graph = tf.compat.v1.get_default_graph()
    return sum(_move_onto_graph(op) for op in graph.get_operations() if op.type == "IdentityN")


def _move_onto_graph(op) -> bool:
    """Moves the gradient function registered for `op` (the IdentityN that
    `tf.custom_gradient` routes its outputs through) from the global registry onto `op.graph`.

    Returns:
        whether a function was moved (False: `op` has none of tf.custom_gradient's registered,
        or it was moved before).
    """
    # The registry has no public API to remove or replace an entry.
    from tensorflow.python.framework import ops

    try:
        name = op.get_attr("_gradient_op_type").decode()
    except ValueError:  # not the op tf.custom_gradient made: nothing was registered for it
        return False
    registry = ops._gradient_registry._registry
    entry = registry.get(name)
    # Only the entries tf.custom_gradient made for one call: a name registered otherwise
    # (`tf.RegisterGradient` with `gradient_override_map`, a loaded SavedModel's functions)
    # may serve other graphs too, and must outlive this one.
    if (entry is None or not name.startswith("CustomGradient-")
            or getattr(entry["type"], "__name__", None) != "internal_grad_fn"):
        return False
    graph = op.graph
    owned = getattr(graph, _OWNED_GRADIENTS, None)
    if owned is None:
        owned = {}
        setattr(graph, _OWNED_GRADIENTS, owned)
    owned[name] = entry["type"]
    # The callback must not hold the graph; the weak reference lives as long as the entry.
    graph_ref = weakref.ref(graph, lambda _: registry.pop(name, None))

    def gradient(gradient_op, *output_gradients):
        return getattr(graph_ref(), _OWNED_GRADIENTS)[name](gradient_op, *output_gradients)

    entry["type"] = gradient
    return True
