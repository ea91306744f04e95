"""5.3 Optimizer: Adam(0.9, 0.98, 1e-9) with the warmup-then-inverse-square-root rate."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.kernels.custom_gradient import release_custom_gradients


def cooldown_start(total_steps: int | None, cooldown: float) -> float | None:
    """The step where `NoamSchedule`'s final cooldown begins (None without one): computed as
    the schedule does, so that step comparisons agree with it (90 * (1 - 0.7) is 62.99...)."""
    if not cooldown or not total_steps:
        return None
    return total_steps - cooldown * total_steps


@keras.saving.register_keras_serializable(package="keras_transformer")
class NoamSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)  (paper eq. 3).

    Rises linearly for `warmup_steps` steps, then decays with the inverse square root of the
    step. `step` is the optimizer's iteration count; step 0 (the first update) uses the rate of
    step 1, since the formula is undefined at 0.

    With `cooldown` > 0 the rate is also multiplied by min(1, (total_steps - step) /
    (cooldown * total_steps)): it falls linearly to 0 over the last `cooldown` share of the
    run, so a run of known length ends annealed (Haegele et al. 2024: a cooldown after a
    rate that does not depend on the length matches schedules planned for it).

    Args:
        d_model: model width.
        warmup_steps: paper: 4000.
        scale: multiplies the whole rate (1.0 is the paper's).
        total_steps: the run's optimizer steps (needed with a cooldown).
        cooldown: the share of the steps, at the end, over which the rate falls to 0.
    """

    def __init__(self, d_model: int, warmup_steps: int = 4000, scale: float = 1.0,
                 total_steps: int | None = None, cooldown: float = 0.0):
        if d_model <= 0 or warmup_steps <= 0 or scale <= 0:
            raise ValueError(
                f"d_model, warmup_steps and scale must be positive; got d_model={d_model}, "
                f"warmup_steps={warmup_steps}, scale={scale}."
            )
        if not 0.0 <= cooldown < 1.0 or (cooldown > 0 and not total_steps):
            raise ValueError(f"cooldown must be in [0, 1) and needs total_steps; got "
                             f"cooldown={cooldown}, total_steps={total_steps}.")
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale
        self.total_steps = total_steps
        self.cooldown = cooldown

    def __call__(self, step):
        step = ops.maximum(ops.cast(step, "float32"), 1.0)
        rate = ops.minimum(ops.rsqrt(step), step * self.warmup_steps**-1.5)
        rate = self.scale * self.d_model**-0.5 * rate
        if self.cooldown > 0:
            left = (self.total_steps - step) / (self.cooldown * self.total_steps)
            rate = rate * ops.clip(left, 0.0, 1.0)
        return rate

    def get_config(self) -> dict:
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale,
                "total_steps": self.total_steps, "cooldown": self.cooldown}


@keras.saving.register_keras_serializable(package="keras_transformer")
class FusedAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam` whose update of each dense variable is one fused kernel.

    Same arguments, state variables and update rule as keras' Adam (Kingma and Ba 2015,
    with epsilon added to sqrt(v), as keras does). keras updates every variable with ~11
    separate passes over it (moments, square, sqrt, divide, three assignments); TensorFlow's
    `ResourceApplyAdam` does it in one. Sparse gradients and `amsgrad` use keras' update, as
    does every backend but TensorFlow (under JAX, XLA fuses keras' update: the fused op is a
    TensorFlow fast path, chosen only there).
    """

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        """Keras' update of all variables; in a step traced by TensorFlow, the graph it was
        traced in is then released from TensorFlow's gradient registry
        (`kernels.custom_gradient.release_custom_gradients`). Keras' TensorFlow optimizer
        sums the gradients over replicas here, with tf.distribute's `all_reduce`, a
        `tf.custom_gradient`, even on one device: without this, every traced training step
        would stay in memory for the life of the process (~190 MiB a `small` model trained
        and dropped: BENCHMARKS.md). Here rather than in `apply`, because Keras' own
        `gradient_accumulation_steps` runs this inside a `tf.cond` branch, a graph of its
        own. A Keras-private method (Keras 3.15): if Keras stops calling it, the graphs stay
        and tests/kernels/test_custom_gradient.py fails."""
        self._shared_scalars = _SharedScalars()  # filled by `_adam_scalars`, for this update
        try:
            super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._shared_scalars = None
        if keras.backend.backend() == "tensorflow":
            release_custom_gradients()

    def update_step(self, gradient, variable, learning_rate):
        if keras.backend.backend() != "tensorflow":
            return super().update_step(gradient, variable, learning_rate)
        import tensorflow as tf  # the TensorFlow fast path above

        if self.amsgrad or isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        tf.raw_ops.ResourceApplyAdam(
            var=variable.handle,
            m=self._momentums[index].value.handle,
            v=self._velocities[index].value.handle,
            grad=tf.cast(gradient, variable.dtype),
            **self._adam_scalars(variable, learning_rate),
        )

    def _adam_scalars(self, variable, learning_rate) -> dict:
        """`ResourceApplyAdam`'s scalar inputs for `variable`: the same for every variable
        of its dtype and device, so made once per update (and graph, as a `tf.cond` branch
        is a graph of its own) and shared, not once per variable: 8 ops less to trace for
        each of a `tiny` model's 85 variables (BENCHMARKS.md)."""
        import tensorflow as tf

        dtype = variable.dtype
        shared = getattr(self, "_shared_scalars", None)  # None: outside `_backend_update_step`
        key = (tf.compat.v1.get_default_graph(), variable.device, dtype, id(learning_rate))
        if shared is not None and key in shared.by_key:
            return shared.by_key[key]
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        scalars = dict(beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
                       lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
                       epsilon=tf.cast(self.epsilon, dtype))
        if shared is not None:
            shared.by_key[key] = scalars
        return scalars


class _SharedScalars:
    """`FusedAdam._adam_scalars` of one update, by (graph, device, dtype, learning rate). A
    plain object: Keras would wrap a dict assigned to the optimizer in its tracking."""

    def __init__(self):
        self.by_key: dict = {}


def paper_adam(
    d_model: int, warmup_steps: int = 4000, scale: float = 1.0,
    total_steps: int | None = None, cooldown: float = 0.0, **kwargs
) -> keras.optimizers.Adam:
    """`FusedAdam` with beta_1=0.9, beta_2=0.98, epsilon=1e-9 and the `NoamSchedule` rate."""
    return FusedAdam(
        learning_rate=NoamSchedule(d_model, warmup_steps, scale, total_steps, cooldown),
        beta_1=0.9, beta_2=0.98, epsilon=1e-9, **kwargs,
    )
