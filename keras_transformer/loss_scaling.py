"""Dynamic loss scaling for mixed_float16 whose step count is the number of batches trained.

float16 gradients underflow; Keras' `LossScaleOptimizer` multiplies the loss by a scale,
divides the gradients by it, and when a gradient is not finite skips the update and halves
the scale. Two things make Keras' version unfit for this project's training runs:

- A skipped update does not count: `iterations` falls behind the batches trained, and with
  it everything that counts steps (checkpoints every N steps, `--max-steps`, the learning
  rate, the resume position in the data stream). Here a skipped update counts as a step
  (as PyTorch's `GradScaler` with a per-batch scheduler does): the step count is always the
  number of batches trained, and `skipped_updates` says how many of them changed nothing.
- Each replica decides alone whether its gradients are finite, *before* they are summed
  over replicas (Keras assumes they already were). Under `MirroredStrategy` the first
  replica's verdict is taken for all, so another replica's inf reaches the weights; under
  `MultiWorkerMirroredStrategy` workers can disagree, one entering the update's all-reduce
  while the other skips it: a hang. Here every replica and worker skips or applies together.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops
from keras.src.utils import tracking


@keras.saving.register_keras_serializable(package="keras_transformer")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """`keras.optimizers.LossScaleOptimizer` counting skipped updates as steps, with one skip
    decision for all replicas (see the module docstring). Same arguments.

    Attributes:
        skipped_updates: int variable, updates skipped for non-finite gradients.
        iterations: steps, skipped ones included (the inner optimizer's count).
    """

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self.skipped_updates = self.add_variable(
            shape=(), dtype="int", initializer="zeros", aggregation="only_first_replica",
            name="skipped_updates")
        super().build(var_list)

    def _stateful_handle_non_finite_grads(self):
        super()._stateful_handle_non_finite_grads()
        self.skipped_updates.assign_add(1)
        self.inner_optimizer.iterations.assign_add(1)

    def check_finite(self, grads):
        """True if every replica's gradients are finite (one all-reduce where replicas
        synchronise without `merge_call`; see `_tf_apply` for the others)."""
        finite = super().check_finite(grads)
        context = tf.distribute.get_replica_context()
        if (context is not None and context.num_replicas_in_sync > 1
                and tf.__internal__.distribute.strategy_supports_no_merge_call()):
            bad = context.all_reduce(tf.distribute.ReduceOp.SUM,
                                     tf.cast(tf.logical_not(finite), tf.float32))
            finite = tf.equal(bad, 0.0)
        return finite

    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._common_apply(grads, trainable_variables=trainable_variables)
            return

        def handle_cross_replica(distribution, grads, trainable_variables):
            per_replica = distribution.extended.call_for_each_replica(
                super(LossScaleOptimizer, self).check_finite, args=(grads,))
            # Every replica's verdict, not the first one's: the gradients are not yet summed.
            finite = ops.all(ops.stack(distribution.experimental_local_results(per_replica)))

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            # In cross-replica context: a replica-context cond may not contain merge_call.
            ops.cond(finite, apply_fn, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(
            handle_cross_replica, args=(grads, trainable_variables))
