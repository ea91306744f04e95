"""How good a model's translations are: sacreBLEU and chrF (13a, cased, detokenized). The
exact per-token validation loss is `training.losses.validation_loss`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

__all__ = ["score_translations"]


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU (sacreBLEU defaults: 13a tokenization, cased) and chrF, with signatures.

    Both sides are detokenized text; one reference per hypothesis.

    Returns:
        {"bleu": float, "chrf": float, "bleu_signature": str, "chrf_signature": str,
         "bleu_details": str (n-gram precisions, brevity penalty), "bleu_bp": float (the
         brevity penalty, 1.0 unless the hypotheses are shorter), "sentences": int}

    Raises:
        ValueError: if the lists differ in length or are empty.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references.")
    if not hypotheses:
        raise ValueError("nothing to score: no sentences.")
    bleu, chrf = BLEU(), CHRF()
    bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
    chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": float(bleu_score.score),
        "chrf": float(chrf_score.score),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_details": str(bleu_score),
        "bleu_bp": float(bleu_score.bp),
        "sentences": len(hypotheses),
    }
