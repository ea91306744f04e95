"""A `--recipe auto` run's settings, decided once: the corpus counted, this machine's step
measured, the budget turned into steps (`keras_transformer.training.auto_recipe` has the
rules, `keras_transformer.training.auto_minutes` what a minutes budget leaves to train), and
everything recorded in config.json's "auto", so that a resumed run reads its plan back
instead of measuring again (the run stays bounded in steps, as recipes are).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.errors import UsageError
from keras_transformer.training import auto_recipe as rules
from keras_transformer.training.auto_minutes import STARTUP_SECONDS, minutes_schedule
from keras_transformer.training.auto_recipe import Budget, Choice
from keras_transformer.training.config import (
    COMPONENTS,
    TrainConfig,
    config_from_flags,
)
from keras_transformer.training.config.train import component_of
from keras_transformer.training.precision import training_precision
from pipelines.corpus_statistics import CorpusStatistics, corpus_statistics

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
                schedule, plan_text, measured[name] = minutes_schedule(
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
