"""Dynamic loss scaling for mixed_float16 whose step count is the number of batches trained.

float16 gradients underflow; Keras' `LossScaleOptimizer` multiplies the loss by a scale,
divides the gradients by it, and when a gradient is not finite skips the update and halves
the scale. Two things make Keras' version unfit for this project's training runs:

- A skipped update does not count: `iterations` falls behind the batches trained, and with
  it everything that counts steps (checkpoints every N steps, `--max-steps`, the learning
  rate, the resume position in the data stream). Here a skipped update counts as a step,
  as the learning rate of PyTorch's `GradScaler` users does (the scheduler steps every
  batch): the step count is always the number of batches trained, and `skipped_updates`
  says how many of them changed nothing. Adam's bias correction counts the skipped steps
  too; with the paper's beta_2 = 0.98 that shrinks the first update after k early skips to
  0.5-0.75 of its size and is forgotten within ~100 steps.
- Each replica decides alone whether its gradients are finite, *before* they are summed
  over replicas (Keras assumes they already were). Under `MirroredStrategy` the first
  replica's verdict is taken for all, so another replica's inf reaches the weights; under
  `MultiWorkerMirroredStrategy` workers can disagree, one entering the update's all-reduce
  while the other skips it: a hang. Here the verdict is all-reduced first: every replica
  and worker skips or applies together.

Under JAX a step is one program over the global batch, so its gradients are already summed
and one verdict holds for all devices; there only the counting is added (to the stateless
path Keras' JAX trainer takes).
"""

from __future__ import annotations

import keras
from keras import ops
from keras.src.utils import tracking

from keras_transformer.kernels.custom_gradient import release_custom_gradients


@keras.saving.register_keras_serializable(package="keras_transformer")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """`keras.optimizers.LossScaleOptimizer` counting skipped updates as steps, with one skip
    decision for all replicas (see the module docstring). Same arguments.

    `TransformerTrainer.compile` (`keras_transformer.training.trainer_model`) wraps its
    optimizer in one under mixed_float16, instead of Keras' own.

    Attributes:
        skipped_updates: int variable, updates skipped for non-finite gradients.
        iterations: steps, skipped ones included (the inner optimizer's count).
    """

    # Private Keras API, on purpose (checked against Keras 3.15.1): Keras exports no way to
    # turn off an optimizer's automatic attribute tracking while it builds; its own
    # LossScaleOptimizer.build (which creates step_counter and dynamic_scale just so) and
    # BaseOptimizer.build use this same decorator, and `skipped_updates` is built the same
    # way (`add_variable` tracks it; the attribute assignment must not). Recheck on upgrade.
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self.skipped_updates = self.add_variable(
            shape=(), dtype="int", initializer="zeros", aggregation="only_first_replica",
            name="skipped_updates")
        super().build(var_list)

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        """Keras' unscaled update by the inner optimizer. Under TensorFlow it runs in a
        `tf.cond` branch, a graph of its own, which the inner optimizer's all-reduce would
        keep alive for good: released here (`kernels.custom_gradient`), where it is traced."""
        super()._stateful_handle_finite_grads(grads, trainable_variables)
        if keras.backend.backend() == "tensorflow":
            release_custom_gradients()

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()
        self.skipped_updates.assign_add(1)
        self.inner_optimizer.iterations.assign_add(1)

    def _stateless_handle_non_finite_grads(self, optimizer_variables, trainable_variables):
        """Keras' stateless skip (JAX), counting the skipped update as a step."""
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.step_counter.assign(0)
            self.dynamic_scale.assign(ops.multiply(self.dynamic_scale, 0.5))
            self.skipped_updates.assign_add(1)
            self.inner_optimizer.iterations.assign_add(1)
        values = [scope.get_current_value(variable) for variable in self.variables]
        return trainable_variables, [new if new is not None else old
                                     for new, old in zip(values, optimizer_variables,
                                                         strict=True)]

    def check_finite(self, grads):
        """True if the gradients of every replica (on every worker) are finite. Where replicas
        synchronise without `merge_call`, one scalar all-reduce here; otherwise `_tf_apply`
        reduces the replicas' verdicts in cross-replica context. Under JAX, Keras' check
        (the gradients are those of the global batch)."""
        finite = super().check_finite(grads)
        if keras.backend.backend() != "tensorflow":
            return finite
        import tensorflow as tf  # tf.distribute's replicas

        context = tf.distribute.get_replica_context()
        if (context is not None and context.num_replicas_in_sync > 1
                and tf.__internal__.distribute.strategy_supports_no_merge_call()):
            from keras_transformer.training.losses_tensorflow import sum_over_replicas

            bad = sum_over_replicas(tf.cast(tf.logical_not(finite), tf.float32))
            finite = tf.equal(bad, 0.0)
        return finite

    def _tf_apply(self, grads, trainable_variables=None):
        import tensorflow as tf  # TensorFlow's apply: tf.distribute's replicas

        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._common_apply(grads, trainable_variables=trainable_variables)
            return

        def local_overflow(grads):
            finite = super(LossScaleOptimizer, self).check_finite(grads)
            return tf.cast(tf.logical_not(finite), tf.float32)

        def handle_cross_replica(distribution, grads, trainable_variables):
            # Every replica's verdict, on every worker (the gradients are not summed yet).
            overflows = distribution.extended.call_for_each_replica(local_overflow,
                                                                    args=(grads,))
            finite = tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, overflows,
                                                  axis=None), 0.0)

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            # In cross-replica context: a replica-context cond may not contain merge_call.
            ops.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            handle_cross_replica, args=(grads, trainable_variables))
