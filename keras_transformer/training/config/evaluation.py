"""`EvaluationConfig`: validation, the weights kept (6.1: the average of the last
checkpoints), beam search and what chooses on val."""

from __future__ import annotations

import dataclasses

from keras_transformer.training.config.fields import (
    float_list,
    int_list,
    non_negative,
    positive,
    setting,
)


@dataclasses.dataclass
class EvaluationConfig:
    """Validation, the weights kept (6.1: the average of the last checkpoints), test BLEU."""

    validate_every: int | None = setting(None, "steps between validations (default: "
                                          "--checkpoint-every)", positive)
    patience: int = setting(10, "stop after this many validations without improvement "
                             "(0 = never)", non_negative)
    average_last: int = setting(
        5, "average the last N checkpoints (paper: 5); model.keras gets the average, or the "
        "best checkpoint if that has the lower validation loss", positive)
    beam: int = setting(4, "beam size for test BLEU (and the export)", positive)
    alpha: float = setting(0.6, "length penalty for test BLEU (and the export)",
                            non_negative)
    choose_by: str = setting(
        "loss", "what chooses on the val split: 'loss' picks the final weights (averages and "
        "the best checkpoint) by exact validation loss; 'bleu' picks them by val BLEU at "
        "--beam/--alpha, then the beam and alpha for test and the export among "
        "--val-beams x --val-alphas (a few val decodings: minutes on small data)",
        choices=("loss", "bleu"))
    val_beams: str = setting("", "with --choose-by bleu: beam sizes tried on val, "
                              "comma-separated (default: --beam)", check=int_list)
    val_alphas: str = setting("", "with --choose-by bleu: length penalties tried on val, "
                               "comma-separated (default: --alpha)", check=float_list)
    val_sentences: int = setting(
        0, "with --choose-by bleu: decode N val sentences, spread evenly over the split, for "
        "those choices (0 = all; validation loss reads them all)", non_negative)
