"""5.3 Optimizer: Adam(0.9, 0.98, 1e-9) with the warmup-then-inverse-square-root rate."""

from __future__ import annotations

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_transformer")
class NoamSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)  (paper eq. 3).

    Rises linearly for `warmup_steps` steps, then decays with the inverse square root of the
    step. `step` is the optimizer's iteration count; step 0 (the first update) uses the rate of
    step 1, since the formula is undefined at 0.

    Args:
        d_model: model width.
        warmup_steps: paper: 4000.
        scale: multiplies the whole rate (1.0 is the paper's).
    """

    def __init__(self, d_model: int, warmup_steps: int = 4000, scale: float = 1.0):
        if d_model <= 0 or warmup_steps <= 0 or scale <= 0:
            raise ValueError(
                f"d_model, warmup_steps and scale must be positive; got d_model={d_model}, "
                f"warmup_steps={warmup_steps}, scale={scale}."
            )
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale

    def __call__(self, step):
        step = ops.maximum(ops.cast(step, "float32"), 1.0)
        rate = ops.minimum(ops.rsqrt(step), step * self.warmup_steps**-1.5)
        return self.scale * self.d_model**-0.5 * rate

    def get_config(self) -> dict:
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale}


def paper_adam(
    d_model: int, warmup_steps: int = 4000, scale: float = 1.0, **kwargs
) -> keras.optimizers.Adam:
    """Adam with beta_1=0.9, beta_2=0.98, epsilon=1e-9 and the `NoamSchedule` rate."""
    return keras.optimizers.Adam(
        learning_rate=NoamSchedule(d_model, warmup_steps, scale),
        beta_1=0.9, beta_2=0.98, epsilon=1e-9, **kwargs,
    )
