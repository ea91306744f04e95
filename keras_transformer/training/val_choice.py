"""The decoding settings for test and the export, chosen on the validation split
(`--choose-by bleu`, issue 29).

After the final weights are chosen (`keras_transformer.training.final_weights`), every beam
size and length penalty of `--val-beams` x `--val-alphas` decodes the validation split (or
the `--val-sentences` sample of it that made the weights' choice); the
highest val BLEU wins, the earlier setting on a tie (the smaller beam, then the alpha given
first). Test BLEU and the SavedModel then use the winner: nothing is chosen on test.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import keras

from keras_transformer.decoding.scoring import score_translations
from keras_transformer.decoding.translator import translate_texts
from keras_transformer.errors import UsageError
from keras_transformer.serving.detailed_signatures import MAX_ALPHA, MAX_BEAM_SIZE
from keras_transformer.training.config import EvaluationConfig, comma_separated
from keras_transformer.training.final_weights import by_val_bleu, choose_final_weights

_LOG = logging.getLogger("keras_transformer")

CHOSEN_BY = "val BLEU"


def decoding_grid(beam: int, alpha: float, val_beams: str, val_alphas: str
                  ) -> tuple[list[int], list[float]]:
    """The beam sizes and length penalties to try on val, from `EvaluationConfig`'s settings.

    Args:
        beam: `--beam`, tried alone when `val_beams` is empty.
        alpha: `--alpha`, tried alone when `val_alphas` is empty.
        val_beams: comma-separated beam sizes ("" for none).
        val_alphas: comma-separated length penalties ("" for none).

    Returns:
        (beams, alphas) without repeats: the beams smallest first (a tie goes to the cheaper
        decoding), the alphas in the order given.
    """
    beams = sorted(set(comma_separated(val_beams, int))) or [beam]
    alphas = list(dict.fromkeys(comma_separated(val_alphas, float))) or [alpha]
    return beams, alphas


def check_serving_options(evaluation: EvaluationConfig) -> None:
    """Refuses a beam or length penalty for test and the export that the SavedModel cannot
    serve (beams of 1 to `MAX_BEAM_SIZE`, alphas of 0 to `MAX_ALPHA`: its signatures clip
    others), before the run trains rather than at its export.

    Raises:
        UsageError: naming the flags.
    """
    beams, alphas = ((decoding_grid(evaluation.beam, evaluation.alpha, evaluation.val_beams,
                                    evaluation.val_alphas))
                     if evaluation.choose_by == "bleu" else ([evaluation.beam], [evaluation.alpha]))
    if any(not 1 <= beam <= MAX_BEAM_SIZE for beam in beams):
        raise UsageError(f"--beam/--val-beams {', '.join(map(str, beams))}: the SavedModel "
                         f"serves beams of 1 to {MAX_BEAM_SIZE}; choose among those, or pass "
                         "--no-export")
    if any(not 0 <= alpha <= MAX_ALPHA for alpha in alphas):
        raise UsageError(f"--alpha/--val-alphas {', '.join(f'{a:g}' for a in alphas)}: the "
                         f"SavedModel serves length penalties of 0 to {MAX_ALPHA:g}; choose "
                         "among those, or pass --no-export")


def val_sample(val, count: int) -> tuple[list[str], list[str]]:
    """`count` pairs of the val split spread evenly over it, in order (all of it when
    `count` is 0 or at least its size): a sample of every part of a split kept in document
    order, such as a news test set's, where its first lines would be a few articles.

    Returns:
        (sources, references).
    """
    total = len(val.sources)
    if not count or count >= total:
        return list(val.sources), list(val.targets)
    rows = [index * total // count for index in range(count)]
    return [val.sources[row] for row in rows], [val.targets[row] for row in rows]


def setting_key(beam: int, alpha: float) -> tuple[int, float | None]:
    """What identifies a decoding: greedy search (beam 1) ignores the length penalty."""
    return beam, (alpha if beam > 1 else None)


def score_decoding(model: keras.Model, tokenizer, sources: Sequence[str],
                   references: Sequence[str], beam: int, alpha: float) -> dict[str, Any]:
    """`score_translations` of `model`'s translations of `sources` at one beam and alpha."""
    hypotheses = translate_texts(model, tokenizer, sources, beam_size=beam, alpha=alpha)
    return score_translations(hypotheses, references)


def choose_decoding(model: keras.Model, tokenizer, sources: Sequence[str],
                    references: Sequence[str], beams: Sequence[int], alphas: Sequence[float],
                    known: Mapping[tuple[int, float | None], dict[str, Any]] | None = None
                    ) -> dict[str, Any]:
    """The beam size and length penalty with the highest BLEU on the validation split.

    Every (beam, alpha) of `beams` x `alphas` is tried in that order (beams outer); one line
    is logged per setting. A setting already decoded with these weights (`known`, or a greedy
    one with another alpha) is not decoded again.

    Args:
        model: the model, holding its final weights.
        tokenizer: its `SubwordTokenizer`.
        sources: the validation source sentences.
        references: their reference translations.
        beams: beam sizes (1: greedy).
        alphas: length penalties.
        known: `score_translations` results of these weights on these sentences, by
            `setting_key(beam, alpha)`.

    Returns:
        {"chosen_by": "val BLEU", "beam", "alpha", "val_bleu" (the winner's), "tried": a list
        of {"beam", "alpha", "val_bleu", "val_bp" (brevity penalty)}}; the first setting with
        the highest BLEU wins.

    Raises:
        ValueError: no beam or no alpha to try.
    """
    if not beams or not alphas:
        raise ValueError("choose_decoding needs at least one beam size and one alpha")
    scored = dict(known or {})
    tried = []
    for beam in beams:
        for alpha in alphas:
            key = setting_key(beam, alpha)
            again = key in scored
            if not again:
                scored[key] = score_decoding(model, tokenizer, sources, references, beam, alpha)
            scores = scored[key]
            tried.append({"beam": beam, "alpha": alpha, "val_bleu": scores["bleu"],
                          "val_bp": scores["bleu_bp"]})
            _LOG.info(f"val BLEU {scores['bleu']:.2f} (brevity penalty {scores['bleu_bp']:.3f})"
                      f" with beam {beam}, alpha {alpha:g}"
                      + (" (already decoded)" if again else ""))
    chosen = max(tried, key=lambda setting: setting["val_bleu"])  # the first of equal ones
    return {"chosen_by": CHOSEN_BY, "beam": chosen["beam"], "alpha": chosen["alpha"],
            "val_bleu": chosen["val_bleu"], "tried": tried}


def choose_on_val_bleu(model: keras.Model, tokenizer, val, checkpoint_dir: str | Path,
                       best_step: int | None, evaluation: EvaluationConfig,
                       best_before_cooldown: int | None = None
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`--choose-by bleu`: the final weights by val BLEU at `--beam`/`--alpha`, then the
    decoding setting by `choose_decoding` over `--val-beams` x `--val-alphas`.

    Args:
        model: a model of the run's architecture; holds the chosen weights on return.
        tokenizer: the run's `SubwordTokenizer`.
        val: the validation `ParallelCorpus`: all of it is decoded, or the
            `--val-sentences` of it that `val_sample` spreads over it.
        checkpoint_dir: the run's `checkpoints/`.
        best_step: the step of the best validation loss during training (None: unknown).
        evaluation: the run's `EvaluationConfig`.
        best_before_cooldown: with a cooldown, the step of the best validation loss before
            it began (None: no cooldown, or unknown).

    Returns:
        (what `choose_final_weights` returns, what `choose_decoding` returns); on a sample,
        each has "val_sentences", the sample's size.
    """
    sources, references = val_sample(val, evaluation.val_sentences)
    sampled = len(sources) < len(val.sources)
    beam, alpha = evaluation.beam, evaluation.alpha
    which = (f"{len(sources):,} of the {len(val.sources):,} {val.split} sentences, spread "
             "evenly" if sampled else f"{len(sources):,} {val.split} sentences")
    _LOG.info(f"choosing the final weights on val BLEU ({which}, beam {beam}, alpha "
              f"{alpha:g}): one decoding per candidate ...")
    scored: list[dict[str, Any]] = []  # each candidate's scores, in the order scored

    def val_bleu(candidate: keras.Model) -> float:
        scored.append(score_decoding(candidate, tokenizer, sources, references, beam, alpha))
        return scored[-1]["bleu"]

    wording = (f"highest val BLEU on {len(sources):,} of {len(val.sources):,} sentences"
               if sampled else "highest val BLEU")
    choice = choose_final_weights(model, checkpoint_dir, best_step, evaluation.average_last,
                                  criterion=by_val_bleu(val_bleu, wording),
                                  best_before_cooldown=best_before_cooldown)
    names = [candidate["name"] for candidate in choice["candidates"]]
    # The winner was decoded at --beam/--alpha already: that setting is not decoded again.
    known = {setting_key(beam, alpha): scored[names.index(choice["chosen"])]}
    beams, alphas = decoding_grid(beam, alpha, evaluation.val_beams, evaluation.val_alphas)
    decoding = choose_decoding(model, tokenizer, sources, references, beams, alphas, known)
    if sampled:
        choice["val_sentences"] = decoding["val_sentences"] = len(sources)
    _LOG.info(f"chosen on {val.split}: {describe_decoding(decoding)}")
    return choice, decoding


def describe_decoding(decoding: Mapping[str, Any]) -> str:
    """One line: the setting chosen, on what, and among how many."""
    count = len(decoding["tried"])
    return (f"beam {decoding['beam']}, alpha {decoding['alpha']:g} for test and the export: "
            f"{'highest' if count > 1 else 'the only setting tried,'} {decoding['chosen_by']}"
            f" {decoding['val_bleu']:.2f}"
            + (f" of {count} settings tried" if count > 1 else "")
            + (f" on {decoding['val_sentences']:,} val sentences"
               if "val_sentences" in decoding else ""))
