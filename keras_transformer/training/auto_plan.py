"""A `--recipe auto` run's settings, decided once: the corpus counted, this machine's step
measured, the budget turned into steps (`keras_transformer.training.auto_recipe` has the
rules), and everything recorded in config.json's "auto", so that a resumed run reads its plan
back instead of measuring again (the run stays bounded in steps, as recipes are).

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
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.errors import UsageError
from keras_transformer.training import auto_recipe as rules
from keras_transformer.training.auto_recipe import Budget, Choice
from keras_transformer.training.config import (
    COMPONENTS,
    EvaluationConfig,
    TrainConfig,
    config_from_flags,
)
from keras_transformer.training.config.train import component_of
from keras_transformer.training.precision import training_precision
from pipelines.corpus_statistics import CorpusStatistics, corpus_statistics

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
# Settings that only say where and how the run writes: not part of what auto plans.
_NOT_PLANNED = {"out", "overwrite", "resume", "verbose", "no_export", "export_dir",
                "join_timeout", "backup_every", "keep_backups"}
# How the command computes, as for any resumed run (not in a run's identity): the plan was
# measured once; a run trained on JAX is finished under TensorFlow with its plan
# (`keras_backend.finishing_command`).
_RUN_HERE = {"backend", "precision", "jit_compile"}


@dataclasses.dataclass
class AutoPlan:
    """What `plan_run` decided: the settings and config.json's "auto" record."""

    config: TrainConfig
    record: dict[str, Any]

    def describe(self) -> str:
        """The dry run's and the log's account: the corpus, the budget, each choice and why."""
        record = self.record
        lines = [f"  auto           {record['statistics_text']}",
                 f"                 budget {record['budget']}; {record['plan_text']}",
                 *([f"                 the same plan on any machine: {record['repeat']} "
                    "with the flags given"]
                   if record.get("repeat") else []),
                 rules.describe_choices({name: Choice(**choice) for name, choice
                                         in record["choices"].items()},
                                        record["request"]["given"])]
        return "\n".join(lines)


def plan_run(config: TrainConfig, corpora: dict[str, Any], *, replicas: int, workers: int,
             started: float, precision: str, jit: bool, report: Callable[[str], None],
             stats: CorpusStatistics | None = None,
             step_seconds: Callable[[TrainConfig], float] | None = None) -> AutoPlan:
    """The settings of a `--recipe auto` run: read back from its config.json when it is
    resumed (never measured twice), else decided now.

    Args:
        config: the run's settings as given (`config.given` names the flags, which win).
        corpora: `run_data.load_corpora`'s: the train split is counted, val/test sizes
            enter the estimate of the end.
        replicas, workers: of the run (a minutes budget is measured on one machine).
        started: `time.perf_counter()` when the command's work began.
        precision, jit: the training's, as resolved for this machine.
        report: where progress lines go.
        stats: the corpus's statistics, if known (else the train split is counted).
        step_seconds: the seconds of a step of a candidate run's settings, instead of
            measuring them (to plan for other machines: `benchmarks/auto_recipe_table.py`).

    Raises:
        UsageError: no budget or too small a one, a budget that a cluster cannot measure,
            a resumed run planned with other settings, or no train split to count.
    """
    recorded = recorded_plan(config)
    if recorded is not None:
        report(f"--recipe auto: the plan of {config.output.out}'s config.json (measured once, "
               "when the run started)")
        return recorded
    optimization = config.optimization
    budget = Budget(optimization.budget_minutes, optimization.budget_steps)
    if budget.minutes is not None and workers > 1 and optimization.assume_step_seconds is None:
        raise UsageError("--budget-minutes is measured on one machine: a cluster gives "
                         "--budget-steps N (or --assume-step-seconds S)")
    if config.model.init_from:
        raise UsageError("--recipe auto chooses the model and vocabulary; --init-from keeps a "
                         "trained run's: give the settings (or --recipe multi30k) instead")
    if stats is None:
        stats = _count(config, corpora, report)
    choices = {**rules.data_choices(stats), "clean_train": Choice(
        True, "obvious noise dropped and counted (results.json's data_report; set before "
        "the corpus is read: `with_clean_train`)")}
    ceiling = rules.preset_ceiling(stats)
    candidates = (["given"] if "preset" in config.given else
                  list(reversed(rules.PRESET_ORDER[:rules.PRESET_ORDER.index(ceiling) + 1])))
    measured: dict[str, float] = {}
    tried: list[str] = []  # the larger presets stepped down from
    for preset in candidates:
        last = preset == candidates[-1]
        chosen = dict(choices)
        chosen["preset"] = Choice(ceiling if preset == "given" else preset,
                                  _preset_reason(stats, ceiling, preset, tried))
        name = preset if preset != "given" else config.model.preset
        chosen["dropout"] = rules.dropout_choice(stats, name)
        if "accumulate" not in config.given:  # (the two flags exclude each other)
            chosen["tokens_per_step"] = rules.tokens_choice(name)
        trial = _apply(config, chosen)
        # What the schedule depends on, as given flags may have changed them.
        sizes = {"d_model": trial.model.transformer(trial.data.vocab_size).d_model,
                 "tokens_per_step": trial.batches.budget(replicas, trial.data.max_length)
                 .tokens_per_step,
                 "warmup_steps": (trial.optimization.warmup_steps
                                  if "warmup_steps" in config.given else None),
                 "subword_samples": (trial.data.subword_samples
                                     if "subword_samples" in config.given else None)}
        if budget.steps is not None:
            schedule = rules.schedule_choices(stats, name, budget.steps, "--budget-steps",
                                              **sizes)
            plan_text = f"{budget.steps:,} steps given"
        else:
            try:
                schedule, plan_text, measured[name] = _minutes_schedule(
                    trial, stats, name, corpora, None if workers > 1 else started, precision,
                    jit, replicas, report, step_seconds, sizes)
            except UsageError as error:  # no time to train it at all: a smaller one may fit
                if last or preset == "given":
                    raise
                tried.append(name)
                report(f"--recipe auto: {error}; trying the next smaller preset")
                continue
        steps = schedule["max_steps"].value
        if (preset == "given" or last or optimization.assume_step_seconds is not None
                or steps >= rules.MIN_STEPS[name]):
            break
        tried.append(name)
        report(f"--recipe auto: {name} would train {steps:,} steps, fewer than the "
               f"{rules.MIN_STEPS[name]:,} it needs; trying the next smaller preset")
    # In the order of the plan's table; the schedule's values win (its val grid).
    chosen = {**{key: chosen[key] for key in ("preset", "dropout", "tokens_per_step")
                 if key in chosen}, **schedule, **chosen}
    chosen.update(schedule)
    final = _apply(config, chosen)
    final.check()
    record = {
        "request": _request(config),
        "budget": budget.describe(),
        "statistics": dataclasses.asdict(stats),
        "statistics_text": stats.describe(),
        "plan_text": plan_text,
        "measured_step_seconds": measured,
        "choices": {name: dataclasses.asdict(choice) for name, choice in chosen.items()},
    }
    if budget.steps is None:
        record["repeat"] = repeat_flags(chosen, final.model.preset)
    return AutoPlan(final, record)


def repeat_flags(choices: dict[str, Choice], preset: str) -> str:
    """The flags that repeat a minutes budget's plan without measuring: its steps as
    --budget-steps, the preset it trains (a minutes budget may step a preset down to fit)
    and the val grid it shrank to fit its end (a steps budget keeps the full grid)."""
    flags = ["--recipe auto", f"--budget-steps {choices['max_steps'].value}",
             f"--preset {preset}"]
    flags += [f"--{name.replace('_', '-')} {choices[name].value}"
              for name in ("val_beams", "val_sentences") if name in choices]
    return " ".join(flags)


def with_clean_train(config: TrainConfig) -> TrainConfig:
    """An auto run drops the training split's obvious noise (`--clean-train`: empty,
    length-mismatched and duplicate pairs, each counted in results.json's data_report)
    unless the flag was given. Set before the corpus is opened, fresh or resumed alike, so
    that a resumed run reads the same training pairs."""
    if "clean_train" in config.given:
        return config
    return dataclasses.replace(config, data=dataclasses.replace(config.data, clean_train=True))


def plan_on_this_machine(config: TrainConfig, corpora: dict[str, Any], strategy, workers: int,
                         started: float, report: Callable[[str], None]) -> AutoPlan:
    """`auto_plan.plan_run` with this machine's precision and XLA choice, as the training
    will resolve them (`fit.train_model`, `fit_jax.train_model`)."""
    optimization = config.optimization
    precision, jit, _ = training_precision(optimization.precision, optimization.jit_compile,
                                           optimization.backend)
    # (No strategy under JAX: one device.)
    replicas = 1 if optimization.backend == "jax" else strategy.num_replicas_in_sync
    return plan_run(config, corpora, replicas=replicas, workers=workers, started=started,
                    precision=precision, jit=jit, report=report)


def budget_report(auto: dict[str, Any], results: dict[str, Any], started: float,
                  earlier_training_seconds: float = 0.0) -> dict[str, Any]:
    """results.json's "budget" of an auto run: the plan against what the command took.

    `command_minutes` is this process's time; `training_minutes` is the whole run's, so a
    resumed run (`earlier_training_seconds` > 0: the training of its interrupted commands)
    also reports `earlier_training_minutes` and says that this command is not the whole run.
    """
    command = time.perf_counter() - started + STARTUP_SECONDS
    report = {"budget": auto["budget"], "steps_planned": auto["choices"]["max_steps"]["value"],
              "steps_trained": results["steps"], "command_minutes": round(command / 60, 1),
              "training_minutes": round(results["training_seconds"] / 60, 1),
              "evaluation_minutes": round(results["evaluation_seconds"] / 60, 1)}
    steps = f"{results['steps']:,} of the {report['steps_planned']:,} steps planned"
    end = f"{report['evaluation_minutes']} choosing on val, testing, exporting"
    if earlier_training_seconds > 0:
        report["earlier_training_minutes"] = round(earlier_training_seconds / 60, 1)
        report["message"] = (
            f"budget {auto['budget']}: resumed, so this command's {report['command_minutes']} "
            f"min are not the whole run's; training took {report['training_minutes']} min "
            f"over all its commands ({report['earlier_training_minutes']} before this one; "
            f"{steps}), {end}")
    else:
        report["message"] = (f"budget {auto['budget']}: this command took "
                             f"{report['command_minutes']} min ({report['training_minutes']} "
                             f"of them training {steps}, {end})")
    return report


def _preset_reason(stats: CorpusStatistics, ceiling: str, preset: str,
                   tried: list[str]) -> str:
    reason = (f"{stats.words:,} words support up to {ceiling} (base from "
              f"{rules.PRESET_FROM_WORDS['base']:,}, big from "
              f"{rules.PRESET_FROM_WORDS['big']:,})")
    if preset not in (ceiling, "given"):
        reason += (f"; stepped down: the budget gives larger presets fewer steps than they need "
                   f"({', '.join(f'{rules.MIN_STEPS[p]:,} for {p}' for p in tried)})")
    return reason


def _count(config: TrainConfig, corpora: dict[str, Any],
           report: Callable[[str], None]) -> CorpusStatistics:
    """The training split's statistics (one pass).

    Raises:
        UsageError: no train split here, or a bad one.
    """
    if corpora.get("train") is None:
        raise UsageError("--recipe auto counts the training split, which is not here "
                         f"({corpora.get('train_error')})")
    from pipelines.corpora import CorpusError  # (TensorFlow's: only where a corpus is read)

    report(f"--recipe auto: counting the training split of {config.data.data} ...")
    try:
        return corpus_statistics(corpora["train"].pairs())
    except (CorpusError, ValueError) as error:
        raise UsageError(f"train data: {error}") from None


def prepare_seconds(stats: CorpusStatistics, copies: int) -> float:
    """Preparing the data, estimated: `PREPARE_SECONDS`, and `SAMPLED_PREPARE_SECONDS` for
    each of `copies` sampled segmentations (0: the deterministic one alone)."""
    words = stats.words / 1e6
    return PREPARE_SECONDS[0] + (PREPARE_SECONDS[1] + SAMPLED_PREPARE_SECONDS * copies) * words


def _minutes_schedule(trial: TrainConfig, stats: CorpusStatistics, preset: str,
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
    grid = _decoding_grid(trial, corpora, budget_seconds, step_seconds)
    end = _end_seconds(trial, corpora, step_seconds,
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


def _decoding_cost(beam: int, alpha: float | None) -> float:
    """One decoding at `beam`, `alpha` (None: greedy), in beam-4, alpha-0.6 decodings: a wider
    beam costs in proportion, a larger alpha ~50% more per unit (longer hypotheses: 10.9 s at
    alpha 0.6, 15.5 s at 1.4, issue 29)."""
    return beam / 4 * (1 + 0.5 * ((0.6 if alpha is None else alpha) - 0.6))


def _decode_units(evaluation: EvaluationConfig, beams: str | None = None
                  ) -> tuple[float, float]:
    """(val, test): the beam-4, alpha-0.6 decodings per sentence that the run's end makes, as
    `val_choice.choose_on_val_bleu` makes them: each weight candidate (up to 4) decoded at
    --beam/--alpha, then the rest of the val grid (`beams` in place of --val-beams where the
    plan shrank it), and the test at the setting val chooses, planned at the grid's
    costliest. Choosing by loss decodes val once and the test at --beam/--alpha."""
    from keras_transformer.training.val_choice import decoding_grid, setting_key

    chosen = setting_key(evaluation.beam, evaluation.alpha)
    if evaluation.choose_by != "bleu":
        return 1.0, _decoding_cost(*chosen)
    grid_beams, grid_alphas = decoding_grid(evaluation.beam, evaluation.alpha,
                                            beams or evaluation.val_beams,
                                            evaluation.val_alphas)
    grid = {setting_key(b, a) for b in grid_beams for a in grid_alphas}
    val = 4 * _decoding_cost(*chosen) + sum(_decoding_cost(*key) for key in grid
                                            if key != chosen)
    return val, max(_decoding_cost(*key) for key in grid | {chosen})


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


def _end_seconds(trial: TrainConfig, corpora: dict[str, Any], step_seconds: float,
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
    val_units, test_units = _decode_units(trial.evaluation, beams)
    # Per sentence, relative to a 4,096-token step of this model.
    tokens = trial.batches.budget(1, trial.data.max_length).tokens_per_step
    per_sentence = DECODE_STEPS_PER_SENTENCE * step_seconds * 4096 / tokens
    return (val_units * val + test_units * tests) * per_sentence + EXPORT_SECONDS


def _decoding_grid(trial: TrainConfig, corpora: dict[str, Any], budget_seconds: float,
                   step_seconds: float) -> dict[str, Choice]:
    """Where the end would take more than `END_SHARE` of a minutes budget: beam 4 alone in
    the val grid, then, if it still would, the val sample that fits (at least
    `MIN_VAL_SENTENCES`). Flags given stay."""
    share = END_SHARE * budget_seconds
    full = _end_seconds(trial, corpora, step_seconds)
    if full <= share or trial.evaluation.choose_by != "bleu":
        return {}
    choices, beams = {}, None
    if "val_beams" not in trial.given:
        beams = "4"
        choices["val_beams"] = Choice(beams, f"the full grid's end (~{full / 60:.1f} min) "
                                      f"would take over {END_SHARE:.0%} of the budget: beam 4 "
                                      "only (beam 6 won nothing on val in issue 29)")
    total = len(corpora["val"])
    end = _end_seconds(trial, corpora, step_seconds, beams)
    if (end <= share or "val_sentences" in trial.given or trial.evaluation.val_sentences
            or total <= MIN_VAL_SENTENCES):
        return choices
    # The end is linear in the val sentences decoded: as many as fit, in hundreds.
    least = _end_seconds(trial, corpora, step_seconds, beams, MIN_VAL_SENTENCES)
    per_sentence = (end - least) / (total - MIN_VAL_SENTENCES)
    fits = MIN_VAL_SENTENCES + max(0.0, share - least) / per_sentence
    count = max(MIN_VAL_SENTENCES, int(fits // 100) * 100)
    sampled = _end_seconds(trial, corpora, step_seconds, beams, count)
    choices["val_sentences"] = Choice(count, (
        f"the end {'at beam 4 alone' if beams else 'with the grid given'} (~{end / 60:.1f} "
        f"min) would take over {END_SHARE:.0%} of the budget: the choices decode {count:,} of "
        f"the {total:,} val sentences, spread evenly (~{sampled / 60:.1f} min"
        + ("" if sampled <= share else f"; still over {END_SHARE:.0%}: at least "
           f"{MIN_VAL_SENTENCES:,} are decoded") + ")"))
    return choices


def _apply(config: TrainConfig, choices: dict[str, Choice]) -> TrainConfig:
    """`config` with each choice whose flag was not given."""
    parts = {component: {} for component in COMPONENTS}
    for name, choice in choices.items():
        if name not in config.given:
            parts[component_of(name)][name] = choice.value
    updated = {component: dataclasses.replace(getattr(config, component), **values)
               for component, values in parts.items() if values}
    return dataclasses.replace(config, **updated)


def _request(config: TrainConfig) -> dict[str, Any]:
    """What a resume must repeat for the recorded plan to apply: the given settings."""
    flags = config.flags()
    return {"given": {name: flags[name] for name in sorted(config.given)
                      if name not in _NOT_PLANNED | _RUN_HERE}}


def recorded_plan(config: TrainConfig) -> AutoPlan | None:
    """The plan in the run directory's config.json (a resume), or None for a fresh run.

    Raises:
        UsageError: the run there was planned with other settings.
    """
    path = Path(config.output.out) / run_directory.CONFIG_FILE
    if config.output.overwrite or not path.is_file():
        return None
    recorded = run_directory.read_json(path)
    plan = recorded.get("auto")
    if plan is None:
        return None  # not an auto run: the identity check names what differs
    request = _request(config)
    # Plans recorded before _RUN_HERE was left out of the request may hold those flags.
    before = {name: value for name, value in plan["request"]["given"].items()
              if name not in _RUN_HERE}
    if {**plan["request"], "given": before} != request:
        given = request["given"]
        changed = sorted(name for name in set(given) | set(before)
                         if given.get(name) != before.get(name))
        raise UsageError(f"{config.output.out} was planned by --recipe auto with other "
                         f"settings ({', '.join(changed)}); use the original flags to resume, "
                         "--overwrite to plan again, or another --out")
    resumed = config_from_flags(recorded["arguments"])
    # Where and how this command writes is its own; what was planned (the checkpoint
    # cadence) is the recorded run's.
    output = dataclasses.replace(resumed.output, **{
        field.name: getattr(config.output, field.name)
        for field in dataclasses.fields(config.output) if field.name in _NOT_PLANNED})
    optimization = dataclasses.replace(resumed.optimization, **{
        name: getattr(config.optimization, name) for name in _RUN_HERE})
    return AutoPlan(dataclasses.replace(resumed, output=output, optimization=optimization,
                                        cluster=config.cluster, given=config.given), plan)
