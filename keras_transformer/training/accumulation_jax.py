"""Gradient accumulation under Keras' JAX backend: `accumulation.py`'s update, as JAX steps.

The semantics are those of `keras_transformer.training.accumulation` (read it first): N
micro-batches give exactly the update of one batch holding them all, the loss normalised by
the target tokens of all of them; each micro-batch backpropagates its own token mean (loss
scaled under mixed_float16) and adds its gradient times its token count to float32 sums; the
N-th divides the sums by the total token count and hands them to the optimizer, whose
`iterations` count updates.

What differs is JAX's stateless style. Keras' JAX `fit` threads a state (trainable,
non-trainable, optimizer and metric variables) through `train_function(state, iterator)`;
the sums are one more piece of state that lives here, in memory, between calls (as the
TensorFlow accumulators live in memory: save and restore at update boundaries). As under
TensorFlow, the choice between accumulating and updating is made in Python, between two
XLA-compiled functions, not in a `lax.cond` that would carry both branches' buffers.

Data parallelism needs nothing of its own: under `keras.distribution.DataParallel` a step is
one program over the global batch (sharded across devices by XLA), so the token count and
the sums are already those of all devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
from keras import ops

from keras_transformer.training.accumulation import check_accumulation


class JaxGradientAccumulator:
    """Gradient sums in memory and the JAX train function that uses them.

    Created by `TransformerTrainer.compile(accumulate_steps=N)` under the JAX backend;
    `TransformerTrainer.make_train_function` installs `make_train_function`'s result.

    Args:
        model: the compiled model; its loss must have `sum_and_count(y_true, y_pred)`.
        steps: micro-batches per update (N >= 2).
    """

    def __init__(self, model: keras.Model, steps: int):
        check_accumulation(model, steps)
        self.steps = steps
        self.loss = model.loss
        self.pending = 0  # micro-batches accumulated since the last update
        self._sums = None  # (float32 gradient sums, float32 token count), or None when empty

    def reset(self) -> None:
        """Discards a partly accumulated update."""
        self.pending = 0
        self._sums = None

    def micro_step(self, model: keras.Model, state, sums, data):
        """One micro-batch: forward, backward, add to the sums. Stateless (jitted).

        Args:
            state: Keras' (trainable, non_trainable, optimizer, metrics) variable values.
            sums: (gradient sums like the trainable variables, token count), float32.
            data: one batch `(x, y)`.

        Returns:
            (logs, state with the non-trainable and metric variables advanced, new sums).
        """
        trainable, non_trainable, optimizer_values, metric_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("gradient accumulation weighs every target token alike; "
                             "sample weights are not supported (use 0 labels for padding)")
        optimizer_mapping = list(zip(model.optimizer.variables, optimizer_values, strict=True))

        def scaled_loss(trainable, non_trainable):
            y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x,
                                                         training=True)
            loss_sum, tokens = self.loss.sum_and_count(y, y_pred)
            mean = loss_sum / ops.maximum(tokens, 1.0)
            with keras.StatelessScope(state_mapping=optimizer_mapping):
                scaled = model.optimizer.scale_loss(mean)
            return scaled, (mean, tokens, y_pred, non_trainable)

        gradients, (mean, tokens, y_pred, non_trainable) = jax.grad(
            scaled_loss, has_aux=True)(trainable, non_trainable)
        gradient_sums, token_sum = sums
        gradient_sums = [total + gradient.astype("float32") * tokens
                         for total, gradient in zip(gradient_sums, gradients, strict=True)]
        logs, metric_values = self._metrics(model, metric_values, mean, tokens, x, y, y_pred)
        state = (trainable, non_trainable, optimizer_values, metric_values)
        return logs, state, (gradient_sums, token_sum + tokens)

    @staticmethod
    def _metrics(model, metric_values, mean, tokens, x, y, y_pred):
        """Metric updates as a stateless function; the logged `loss` is the token-weighted
        mean of the micro-batches' losses (as under TensorFlow)."""
        mapping = list(zip(model.metrics_variables, metric_values, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            model._loss_tracker.update_state(mean, sample_weight=tokens)
            logs = model.compute_metrics(x, y, y_pred, sample_weight=None)
        new_values = [scope.get_current_value(variable) for variable in model.metrics_variables]
        return logs, [value if value is not None else old
                      for value, old in zip(new_values, metric_values, strict=True)]

    @staticmethod
    def update(model: keras.Model, state, sums):
        """The optimizer update from the sums divided by their token count. Stateless."""
        trainable, non_trainable, optimizer_values, metric_values = state
        gradient_sums, tokens = sums
        inverse = 1.0 / jnp.maximum(tokens, 1.0)
        trainable, optimizer_values = model.optimizer.stateless_apply(
            optimizer_values, [total * inverse for total in gradient_sums], trainable)
        return trainable, non_trainable, optimizer_values, metric_values

    def make_train_function(self, model: keras.Model):
        """`fit`'s train function `(state, iterator) -> (logs, state)`: a micro-batch, then
        every N-th call the update, each XLA-compiled (unless the model runs eagerly)."""
        micro = lambda state, sums, data: self.micro_step(model, state, sums, data)  # noqa: E731
        update = lambda state, sums: self.update(model, state, sums)  # noqa: E731
        if not model.run_eagerly and model.jit_compile:
            micro = jax.jit(micro, donate_argnums=(1,))
            update = jax.jit(update, donate_argnums=(0, 1))

        def train_function(state, iterator):
            if self._sums is None:
                self._sums = ([jnp.zeros(v.shape, "float32") for v in model.trainable_variables],
                              jnp.zeros((), "float32"))
            logs, state, self._sums = micro(state, self._sums, next(iterator))
            self.pending += 1
            if self.pending == self.steps:
                state = update(state, self._sums)
                self.reset()
            return logs, state

        return train_function
