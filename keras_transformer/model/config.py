"""The model's hyperparameters: 3 Model Architecture's settings, Table 3's presets, checks.

`TransformerConfig` holds every hyperparameter of `keras_transformer.model.transformer.
Transformer`, validated on construction; `transformer_config(preset, **overrides)` gives a
preset's values with some changed. Nothing here imports TensorFlow or Keras: command lines
import it to check their flags (and print `--help`) before TensorFlow loads.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

# Model hyperparameters; any of them can be overridden on top of a preset.
PRESETS: dict[str, dict[str, Any]] = {
    # Paper, Table 3 "base".
    "base": dict(num_layers=6, d_model=512, num_heads=8, d_ff=2048, dropout=0.1),
    # Paper, Table 3 "big".
    "big": dict(num_layers=6, d_model=1024, num_heads=16, d_ff=4096, dropout=0.3),
    # The Multi30k default: 29k sentence pairs do not need (and overfit) a base model.
    "small": dict(num_layers=3, d_model=256, num_heads=8, d_ff=1024, dropout=0.1),
    # For tests: seconds to build and train.
    "tiny": dict(num_layers=2, d_model=32, num_heads=4, d_ff=64, dropout=0.0),
}


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Every hyperparameter of the model, validated on construction."""

    vocab_size: int = 8000
    num_layers: int = 6
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation: str = "relu"
    pre_norm: bool = False
    tie_embeddings: bool = True
    layer_norm_epsilon: float = 1e-6
    max_wavelength: float = 10000.0

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff"):
            value = getattr(self, name)
            if _is_integer(value):  # numpy integers -> int, so the config stays JSON-able
                object.__setattr__(self, name, int(value))
        for name in ("num_layers", "d_model", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not _is_integer(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not _is_integer(self.vocab_size) or self.vocab_size < 4:
            raise ValueError(
                f"vocab_size must be an integer >= 4 (pad=0, unk=1, bos=2, eos=3 are reserved), "
                f"got {self.vocab_size!r}."
            )
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: each "
                "head has d_k = d_model / num_heads (paper 3.2.2). Pick a num_heads that "
                "divides d_model."
            )
        if self.d_model % 2:
            raise ValueError(f"d_model must be even (sinusoidal positions), got {self.d_model}.")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}.")


def transformer_config(preset: str = "base", **overrides: Any) -> TransformerConfig:
    """A preset's hyperparameters with `overrides` applied.

    Raises:
        ValueError: for an unknown preset, an unknown field, or an invalid value.
    """
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}.")
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"Unknown model setting(s) {unknown}; known: {sorted(fields)}.")
    return TransformerConfig(**{**PRESETS[preset], **overrides})
