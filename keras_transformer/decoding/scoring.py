"""How good a model's translations are: sacreBLEU and chrF (13a, cased, detokenized). The
exact per-token validation loss is `training.losses.validation_loss`; whether one system's BLEU
beats another's by more than chance is `paired_bootstrap` (Koehn 2004, as sacreBLEU runs it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

__all__ = ["paired_bootstrap", "score_translations"]


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


def paired_bootstrap(baseline: Sequence[str], system: Sequence[str],
                     references: Sequence[str], resamples: int = 1000) -> dict[str, Any]:
    """Paired bootstrap resampling (Koehn 2004) of corpus BLEU: `system` against `baseline`.

    sacreBLEU's own test (`sacrebleu REF -i BASELINE SYSTEM --paired-bs`), seeded as it
    seeds it (`SACREBLEU_SEED`, 12345 by default), so the command line gives the same p-value.

    Args:
        baseline, system: detokenized translations of the same sentences, line for line.
        references: one reference per sentence.
        resamples: bootstrap samples (sacreBLEU's default 1,000).

    Returns:
        {"bleu_baseline": float, "bleu_system": float, "p_value": float (the chance of a
         difference this large, either way, were the two systems alike; the scores say
         which way it went; p < 0.05 is the usual bar),
         "ci_baseline": float, "ci_system": float (95% confidence half-widths),
         "signature": str}

    Raises:
        ValueError: if the three lists differ in length or are empty.
    """
    from sacrebleu.significance import PairedTest

    if not len(baseline) == len(system) == len(references):
        raise ValueError(f"{len(baseline)} baseline and {len(system)} system translations but "
                         f"{len(references)} references: each needs one line per sentence.")
    if not references:
        raise ValueError("nothing to compare: no sentences.")
    test = PairedTest([("baseline", list(baseline)), ("system", list(system))],
                      {"bleu": BLEU()}, [list(references)], test_type="bs",
                      n_samples=resamples)
    signatures, scores = test()
    before, after = scores["BLEU"]
    return {"bleu_baseline": float(before.score), "bleu_system": float(after.score),
            "p_value": float(after.p_value), "ci_baseline": float(before.ci),
            "ci_system": float(after.ci), "signature": str(signatures["BLEU"])}
