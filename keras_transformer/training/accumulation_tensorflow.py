"""Gradient accumulation under TensorFlow and `tf.distribute`: `accumulation.py`'s update with
per-replica accumulators (see that module for the semantics)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_transformer.kernels.custom_gradient import release_custom_gradients
from keras_transformer.training.accumulation import check_accumulation
from keras_transformer.training.losses_tensorflow import sum_over_replicas


class GradientAccumulator:
    """Per-replica gradient accumulators and the train step that uses them.

    Created by `TransformerTrainer.compile(accumulate_steps=N)` (under the strategy's scope,
    as `compile` is); `TransformerTrainer.make_train_function` builds `fit`'s step from it.

    Args:
        model: the compiled model; its `loss` must have `sum_and_count(y_true, y_pred)`
            -> (float32 token-loss sum, float32 token count), as
            `keras_transformer.training.losses.LabelSmoothedCrossEntropy` has.
        steps: micro-batches per update (N >= 2).
    """

    def __init__(self, model: keras.Model, steps: int):
        check_accumulation(model, steps)
        self.steps = steps
        self.loss = model.loss
        self.variables = list(model.trainable_variables)
        if not model.optimizer.built:
            model.optimizer.build(self.variables)

        def local(shape, dtype, name):  # one copy per replica, never synchronised
            return keras.Variable(tf.zeros(shape, dtype), trainable=False, name=name,
                                  synchronization="on_read", aggregation="sum")

        self.gradients = [local(v.shape, "float32", f"accumulated_{v.name}")
                          for v in self.variables]
        self.tokens = local((), "float32", "accumulated_tokens")
        self.pending = 0  # micro-batches accumulated since the last update
        # Variables the loss does not reach (None gradients), found when tracing: the
        # optimizer gets None for them, as from an ordinary step, and leaves them alone.
        self._without_gradient: set[int] = set()

    def reset(self) -> None:
        """Discards a partly accumulated update."""
        if self.pending:
            self._clear()
        self.pending = 0

    def _clear(self) -> None:
        """Zeroes this replica's accumulators (or all, in cross-replica context)."""
        for accumulated in self.gradients:
            accumulated.assign(tf.zeros_like(accumulated.value))
        self.tokens.assign(0.0)

    def micro_step(self, model: keras.Model, data) -> dict:
        """One micro-batch on this replica: forward, backward, accumulate (no communication).

        Returns the metrics, as `keras.Model.train_step` does. The logged `loss` is the
        token-weighted mean of the micro-batches' losses.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("gradient accumulation weighs every target token alike; "
                             "sample weights are not supported (use 0 labels for padding)")
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss_sum, tokens = self.loss.sum_and_count(y, y_pred)
            mean = loss_sum / tf.maximum(tokens, 1.0)
            scaled = model.optimizer.scale_loss(mean)
        model._loss_tracker.update_state(mean, sample_weight=tokens)
        gradients = tape.gradient(scaled, self.variables)
        for index, (accumulated, gradient) in enumerate(
                zip(self.gradients, gradients, strict=True)):
            if gradient is None:
                self._without_gradient.add(index)
            else:
                accumulated.assign_add(tf.cast(gradient, tf.float32) * tokens)
        self.tokens.assign_add(tokens)
        return model.compute_metrics(x, y, y_pred, sample_weight=None)

    def update(self, optimizer) -> None:
        """On each replica: the accumulated gradients, normalised by the tokens of all
        micro-batches of all replicas, go to the optimizer (which sums them over replicas
        and updates once); the accumulators restart from zero."""
        tokens = tf.identity(self.tokens.value)  # a tensor: collectives refuse variables
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            tokens = sum_over_replicas(tokens)
        inverse = 1.0 / tf.maximum(tokens, 1.0)
        optimizer.apply([None if index in self._without_gradient else g.value * inverse
                         for index, g in enumerate(self.gradients)], self.variables)
        # Keras' optimizers sum the gradients with tf.distribute's all-reduce, whose
        # registered gradient would keep this graph alive for good (FusedAdam releases its
        # own; Keras' optimizers do not): `kernels.custom_gradient`.
        release_custom_gradients()
        self._clear()

    def make_train_function(self, model: keras.Model, micro_function):
        """`fit`'s train function: `micro_function(iterator)` (Keras' function over
        `micro_step`, which distributes it and reduces its logs), then every N-th call the
        update, as a separate distributed function.

        The update cannot sit in a `tf.cond` inside the step: `MirroredStrategy` refuses
        synchronisation (the all-reduce) under control flow in a replica function. So the
        choice is made here, in Python, between two graphs.
        """
        strategy = model.distribute_strategy

        def update():
            strategy.run(self.update, args=(model.optimizer,))

        if not model.run_eagerly:  # traced as written, as Keras traces its own step
            update = tf.function(update, jit_compile=model.jit_compile, autograph=False)

        def train_function(iterator):
            logs = micro_function(iterator)
            self.pending += 1
            if self.pending == self.steps:
                update()
                self.pending = 0
            return logs

        return train_function
