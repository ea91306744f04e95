"""`--recipe auto --budget-minutes`: what the minutes leave to train, and the val grid that
fits the end (`keras_transformer.training.auto_plan` plans the run with it).

How the minutes are spent: the whole command (start-up, counting the corpus, measuring,
preparing the data, training, the val choices, the test and the export) fits
`--budget-minutes`. Everything but training is measured (counting, measuring) or estimated
from measurements of this project (preparing, decoding, export: the constants below); the
training gets the rest, at the measured step time times the run's own overheads
(validation, checkpoints, new batch shapes). `--max-minutes` stays a guard on training alone,
set to 1.25x the planned training minutes (or, where the passes cap the steps, the training
minutes the budget leaves, if more): a machine that slows down still ends near the budget,
and a run stopped by it says so (results.json's stop_reason and convergence).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from keras_transformer.errors import UsageError
from keras_transformer.training import auto_recipe as rules
from keras_transformer.training.auto_recipe import Choice
from keras_transformer.training.config import EvaluationConfig, TrainConfig
from pipelines.corpus_statistics import CorpusStatistics

# Measured on this project's runs (BENCHMARKS.md): a whole run averages 4,902 target tokens/s
# where its step alone does 5,400-5,700 (run 7): validation, checkpoints, new batch shapes.
RUN_OVERHEAD = 1.12
# A beam-4 decoding of one val sentence costs ~0.015-0.020 of a 4,096-token training step of
# the same model: 10.9 s for 1,014 sentences at 0.72 s a step (issue 29, the AVX-512 EPYC,
# bfloat16), 60 s for 1,000 at ~4 s a step (AVX2, float32), 0.020 on the Intel Xeon (AMX;
# two idle `auto` runs' whole end, 170 and 250 s at steps of 0.443 and 0.730 s;
# BENCHMARKS.md). The larger, so that the end fits the budget on each machine.
DECODE_STEPS_PER_SENTENCE = 0.020
# ... of a Multi30k de->en val sentence (12.0 words a reference; 157.7 their mean square).
# Longer sentences cost more than their length: on the Xeon, a val sentence of newstest2013
# (18.7 words a reference) took 3.5x one of Multi30k (the `multi30k` recipe's news run:
# 33.7 min for its 11 beam-4-equivalent val decodings of 3,000 sentences, the test and the
# export, against 10.3 planned). Two things make it (`benchmarks/decode_by_length.py`): the
# length (one model: 35 ms a sentence of 6 words, 48 of 10, 100 of 18, 244 of 41) and the
# model (Multi30k's val sentences: 46 ms with the news model, far from converged, whose beams
# finish later; 27 with a Multi30k model). The mean square of the reference words, relative
# to Multi30k's, gives 3.0x there: a fit of the two corpora measured, not a model of
# decoding. The references, so that every source language of a many-to-one run counts
# alike, and a source without spaces between words too. At least 1, as sentences shorter
# than Multi30k's are not measured to be cheaper in proportion (the cost above flattens at
# the short end).
MULTI30K_VAL_SQUARED_WORDS = 157.7
MIN_VAL_SENTENCES = 1000  # a shrunk val sample: Multi30k's val size, where the grid was chosen
STARTUP_SECONDS = 15.0  # Python and TensorFlow, before run_training starts counting
EXPORT_SECONDS = 45.0  # model.keras and the SavedModel (tracing its signatures)
PREPARE_SECONDS = (10.0, 10.0)  # + per million words: the tokenizer and the token shards
# + per million words of each sampled segmentation (--subword-samples): Multi30k's first
# 10,000 pairs in 20 copies, 4.5M words, were segmented and written in 7 s on the Zen 5 EPYC
# (1.6 s per million), with a margin.
SAMPLED_PREPARE_SECONDS = 2.0
# The val grid shrinks to beam 4, then to a sample of val, where the end would take more of
# the budget.
END_SHARE = 0.15


def prepare_seconds(stats: CorpusStatistics, copies: int) -> float:
    """Preparing the data, estimated: `PREPARE_SECONDS`, and `SAMPLED_PREPARE_SECONDS` for
    each of `copies` sampled segmentations (0: the deterministic one alone)."""
    words = stats.words / 1e6
    return PREPARE_SECONDS[0] + (PREPARE_SECONDS[1] + SAMPLED_PREPARE_SECONDS * copies) * words


def minutes_schedule(trial: TrainConfig, stats: CorpusStatistics, preset: str,
                     corpora: dict[str, Any], started: float | None, precision: str, jit: bool,
                     replicas: int, report: Callable[[str], None],
                     assumed: Callable[[TrainConfig], float] | None,
                     sizes: dict[str, int | None]) -> tuple[dict[str, Choice], str, float]:
    """The schedule a minutes budget buys `preset`: its step measured here (or assumed), the
    time left after everything else the command does. `started` None (a cluster's worker):
    the time spent so far is not read from this worker's clock, which differs from the
    others' (they start, and wait for each other, at other times), so that every worker
    plans the same steps."""
    optimization = trial.optimization
    if assumed is not None:
        step_seconds, how = assumed(trial), "assumed"
    elif optimization.assume_step_seconds is not None:
        step_seconds, how = optimization.assume_step_seconds, "assumed (--assume-step-seconds)"
    else:
        step_seconds = measure_run_step(trial, stats, precision, jit, replicas, report)
        how = f"measured here ({precision}, XLA {'on' if jit else 'off'})"
    run_step = step_seconds * RUN_OVERHEAD
    budget_seconds = optimization.budget_minutes * 60
    spent = STARTUP_SECONDS + (time.perf_counter() - started if started is not None else 0.0)
    prepare = prepare_seconds(stats, sizes["subword_samples"] or 0)
    grid = decoding_grid_choices(trial, corpora, budget_seconds, step_seconds)
    end = end_seconds(trial, corpora, step_seconds,
                      grid["val_beams"].value if "val_beams" in grid else None,
                      grid["val_sentences"].value if "val_sentences" in grid else None)
    training = budget_seconds - spent - prepare - end
    schedule = rules.budget_minutes_choices(stats, preset, max(training, 1.0), run_step, **sizes)
    decided = schedule["subword_samples"]
    if decided.value and sizes["subword_samples"] is None:
        # The plan samples segmentations: their preparation comes out of the training minutes,
        # and the choice stays where the steps left fall just below twice the cap (still well
        # beyond it).
        prepare = prepare_seconds(stats, decided.value)
        training = budget_seconds - spent - prepare - end
        schedule = rules.budget_minutes_choices(stats, preset, max(training, 1.0), run_step,
                                                **sizes, sampling=decided)
    if training < max(60.0, 50 * run_step):
        needed = (spent + prepare + end + max(60.0, 50 * run_step)) / 60
        raise UsageError(f"--budget-minutes {optimization.budget_minutes:g} leaves "
                         f"{max(training, 0) / 60:.1f} min to train {preset} after the rest of "
                         f"the command ({(spent + prepare + end) / 60:.1f} min); give at least "
                         f"{math.ceil(needed)}")
    schedule = {**schedule, **grid}
    text = (f"a step of {sizes['tokens_per_step']:,} tokens takes {step_seconds:.3f} s "
            f"{how}, {run_step:.3f} s with the run's overheads (x{RUN_OVERHEAD}); of "
            f"{budget_seconds / 60:.1f} min, {spent / 60:.1f} went to starting, counting and "
            f"measuring, ~{prepare / 60:.1f} go to preparing the data, ~{end / 60:.1f} to the "
            f"val choices, test and export: {training / 60:.1f} min of training")
    return schedule, text, step_seconds


def measure_run_step(trial: TrainConfig, stats: CorpusStatistics, precision: str, jit: bool,
                     replicas: int, report: Callable[[str], None]) -> float:
    """The measured seconds of one step of `trial`'s model, precision and tokens per step, on
    synthetic batches of the corpus's mean pair length (`calibration.measure_step_seconds`)."""
    from keras_transformer.training.calibration import measure_step_seconds

    model = dataclasses.asdict(trial.model.transformer(trial.data.vocab_size))
    budget = trial.batches.budget(replicas, trial.data.max_length)
    pair_tokens = max(2, round(stats.mean_pair_words * rules.PIECES_PER_WORD) + 1)
    report(f"--recipe auto: measuring a {trial.model.preset} step of "
           f"{budget.tokens_per_step:,} tokens on this machine ...")
    return measure_step_seconds(model, trial.optimization, precision, jit, budget, pair_tokens)


def decoding_cost(beam: int, alpha: float | None) -> float:
    """One decoding at `beam`, `alpha` (None: greedy), in beam-4, alpha-0.6 decodings: a wider
    beam costs in proportion, a larger alpha ~50% more per unit (longer hypotheses: 10.9 s at
    alpha 0.6, 15.5 s at 1.4, issue 29)."""
    return beam / 4 * (1 + 0.5 * ((0.6 if alpha is None else alpha) - 0.6))


def decode_units(evaluation: EvaluationConfig, beams: str | None = None
                 ) -> tuple[float, float]:
    """(val, test): the beam-4, alpha-0.6 decodings per sentence that the run's end makes, as
    `val_choice.choose_on_val_bleu` makes them: each weight candidate (up to 4) decoded at
    --beam/--alpha, then the rest of the val grid (`beams` in place of --val-beams where the
    plan shrank it), and the test at the setting val chooses, planned at the grid's
    costliest. Choosing by loss decodes val once and the test at --beam/--alpha."""
    from keras_transformer.training.val_choice import decoding_grid, setting_key

    chosen = setting_key(evaluation.beam, evaluation.alpha)
    if evaluation.choose_by != "bleu":
        return 1.0, decoding_cost(*chosen)
    grid_beams, grid_alphas = decoding_grid(evaluation.beam, evaluation.alpha,
                                            beams or evaluation.val_beams,
                                            evaluation.val_alphas)
    grid = {setting_key(b, a) for b in grid_beams for a in grid_alphas}
    val = 4 * decoding_cost(*chosen) + sum(decoding_cost(*key) for key in grid
                                            if key != chosen)
    return val, max(decoding_cost(*key) for key in grid | {chosen})


def length_factor(corpus: Any, limit: int = 0) -> float:
    """The decoding cost of a sentence of `corpus` (its first `limit`, 0: all) relative to
    one of Multi30k's val: the mean square of its references' words (whitespace-separated)
    over `MULTI30K_VAL_SQUARED_WORDS`, at least 1 (1 for an object without references)."""
    references = getattr(corpus, "targets", None)
    if not references:
        return 1.0
    references = references[:limit] if limit else references
    squares = sum(len(sentence.split()) ** 2 for sentence in references) / len(references)
    return max(1.0, squares / MULTI30K_VAL_SQUARED_WORDS)


def end_seconds(trial: TrainConfig, corpora: dict[str, Any], step_seconds: float,
                beams: str | None = None, val_sentences: int | None = None) -> float:
    """The val choices, the test translations and the export, estimated. `beams` and
    `val_sentences` stand for the settings when the plan shrinks them."""
    sample = trial.evaluation.val_sentences if val_sentences is None else val_sentences
    if trial.evaluation.choose_by != "bleu":
        sample = 0  # the sample is for the BLEU choices; by loss, val is decoded once, whole
    val = min(len(corpora["val"]), sample or len(corpora["val"]))
    val *= length_factor(corpora["val"])
    tests = sum(min(len(corpus), trial.data.test_limit or len(corpus))
                * length_factor(corpus, trial.data.test_limit)
                for role, corpus in corpora.items()
                if role == "test" or role.startswith("test:"))
    val_units, test_units = decode_units(trial.evaluation, beams)
    # Per sentence, relative to a 4,096-token step of this model.
    tokens = trial.batches.budget(1, trial.data.max_length).tokens_per_step
    per_sentence = DECODE_STEPS_PER_SENTENCE * step_seconds * 4096 / tokens
    return (val_units * val + test_units * tests) * per_sentence + EXPORT_SECONDS


def decoding_grid_choices(trial: TrainConfig, corpora: dict[str, Any],
                          budget_seconds: float, step_seconds: float) -> dict[str, Choice]:
    """Where the end would take more than `END_SHARE` of a minutes budget: beam 4 alone in
    the val grid, then, if it still would, the val sample that fits (at least
    `MIN_VAL_SENTENCES`). Flags given stay."""
    share = END_SHARE * budget_seconds
    full = end_seconds(trial, corpora, step_seconds)
    if full <= share or trial.evaluation.choose_by != "bleu":
        return {}
    choices, beams = {}, None
    if "val_beams" not in trial.given:
        beams = "4"
        choices["val_beams"] = Choice(beams, f"the full grid's end (~{full / 60:.1f} min) "
                                      f"would take over {END_SHARE:.0%} of the budget: beam 4 "
                                      "only (beam 6 won nothing on val in issue 29)")
    total = len(corpora["val"])
    end = end_seconds(trial, corpora, step_seconds, beams)
    if (end <= share or "val_sentences" in trial.given or trial.evaluation.val_sentences
            or total <= MIN_VAL_SENTENCES):
        return choices
    # The end is linear in the val sentences decoded: as many as fit, in hundreds.
    least = end_seconds(trial, corpora, step_seconds, beams, MIN_VAL_SENTENCES)
    per_sentence = (end - least) / (total - MIN_VAL_SENTENCES)
    fits = MIN_VAL_SENTENCES + max(0.0, share - least) / per_sentence
    count = max(MIN_VAL_SENTENCES, int(fits // 100) * 100)
    sampled = end_seconds(trial, corpora, step_seconds, beams, count)
    choices["val_sentences"] = Choice(count, (
        f"the end {'at beam 4 alone' if beams else 'with the grid given'} (~{end / 60:.1f} "
        f"min) would take over {END_SHARE:.0%} of the budget: the choices decode {count:,} of "
        f"the {total:,} val sentences, spread evenly (~{sampled / 60:.1f} min"
        + ("" if sampled <= share else f"; still over {END_SHARE:.0%}: at least "
           f"{MIN_VAL_SENTENCES:,} are decoded") + ")"))
    return choices
