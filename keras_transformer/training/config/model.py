"""`ModelConfig`: a preset (3, Table 3) and overrides of its hyperparameters."""

from __future__ import annotations

import dataclasses

from keras_transformer.errors import UsageError
from keras_transformer.model.config import TransformerConfig, transformer_config
from keras_transformer.training.config.fields import fraction, positive, setting


@dataclasses.dataclass
class ModelConfig:
    """A preset (`keras_transformer.model.config.PRESETS`) and overrides of its fields."""

    preset: str = setting("small", "small: 3 layers, d_model 256 (Multi30k); base/big: paper "
                           "Table 3", choices=("tiny", "small", "base", "big"))
    num_layers: int | None = setting(None, "encoder and decoder layers (N)", positive)
    d_model: int | None = setting(None, "model width", positive)
    num_heads: int | None = setting(None, "attention heads (divide d_model)", positive)
    d_ff: int | None = setting(None, "feed-forward inner width", positive)
    dropout: float | None = setting(None, "residual/embedding dropout (P_drop)", fraction)
    attention_dropout: float | None = setting(None, "dropout on attention weights", fraction)
    activation: str | None = setting(None, "feed-forward activation", choices=("relu", "gelu"))
    pre_norm: bool | None = setting(None, "layer norm before each sublayer instead of after "
                                     "(paper: after)")
    init_from: str | None = setting(
        None, "fine-tune: start from this finished run's final weights (its model.keras) and "
        "vocabulary (its tokenizer) instead of random ones, with a fresh optimizer and this "
        "run's own --warmup-steps and --lr-scale; the architecture and --vocab-size must be the "
        "run's (refused otherwise). results.json then scores this run's test split and the "
        "old run's before and after (training/fine_tuning.py)")

    def transformer(self, vocab_size: int) -> TransformerConfig:
        """The model's hyperparameters: the preset, these overrides and `vocab_size`.

        Raises:
            UsageError: an invalid combination (e.g. heads that do not divide d_model).
        """
        overrides = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                     if field.name not in ("preset", "init_from")
                     and getattr(self, field.name) is not None}
        try:
            return transformer_config(self.preset, vocab_size=vocab_size, **overrides)
        except ValueError as error:
            raise UsageError(f"model: {error}") from None
