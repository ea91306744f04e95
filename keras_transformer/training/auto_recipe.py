"""`--recipe auto`: every setting of a run chosen from the corpus and a budget (issue 39).

Each rule is a formula over the corpus's word statistics (`pipelines.corpus_statistics`),
anchored at two points that were measured, not looked up by corpus name:

- the `multi30k` recipe, tuned on Multi30k's val split (BENCHMARKS.md, issues 4 and 29):
  29,000 pairs, 667,403 words of both sides, 39,491 distinct words -> the `small` preset,
  8,000 pieces, dropout 0.2, 4,096 tokens a step, 1,000 warmup steps of 4,200, peak rate
  9.9e-4; de->en reached its val plateau by ~2,400 steps (~20 passes over the data), en->de
  still improved at 4,200 (~35 passes);
- the paper (5.1-5.4, 6.1) on WMT14 en-de: 4.5M pairs, ~2.2e8 words -> `base`, 37,000
  pieces, dropout 0.1, 25,000 tokens a step, 4,000 warmup steps of 100,000, peak 7.0e-4.

Between and beyond them the rules interpolate on a log scale of the words (dropout: of the
distinct words, which tell varied text from repetitive), as the low-resource
studies found the settings to move with data size: fewer subword pieces and more dropout for
less data (Sennrich and Zhang 2019, "Revisiting Low-Resource NMT"; Araabi and Monz 2020,
"Optimizing Transformer for Low-Resource NMT"). The budget fixes the steps, and the rate
anneals to zero at the last one (Li et al. 2020, "Budgeted Training"; a linear cooldown over
the last 20% after the paper's inverse square root, as Haegele et al. 2024 found to match a
schedule planned for the length). docs/auto_recipe.md states every rule and what `auto` picks
for several corpus sizes; `keras_transformer.training.auto_plan` measures the machine and
applies these choices to a run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipelines.corpus_statistics import CorpusStatistics

MULTI30K_WORDS = 667_403  # Multi30k de-en train, both sides: the `multi30k` recipe's corpus
MULTI30K_WORD_TYPES = 39_491  # its distinct words
# Dropout's slope a decade of distinct words: 0.1 a decade of words over Multi30k's Heaps'
# exponent, 0.60 (`dropout_choice`).
DROPOUT_PER_DECADE = 0.165
MIN_VOCABULARY = 300  # --vocab-size's least: 4 special ids, 256 byte pieces and some more
PRESET_ORDER = ("small", "base", "big")
# From this many words (both sides) a corpus supports the next larger model: Multi30k (0.7M)
# overfits `base` (model/config.py); IWSLT-size corpora (~5M) are where published systems
# move to 512-wide models; `big` helps only on WMT-size data (the paper's 4.5M pairs).
PRESET_FROM_WORDS = {"small": 0, "base": 5_000_000, "big": 100_000_000}
# A larger model trained for fewer steps than this is further from converged than the next
# smaller one would be; it is then stepped down. A judgment, not measured here: `base` is
# the paper's warmup times 5, `big` a sixth of its 300,000 steps.
MIN_STEPS = {"small": 0, "base": 20_000, "big": 50_000}
TOKENS_PER_STEP = {"small": 4096, "base": 25_000, "big": 25_000}  # the recipe's; the paper's
D_MODEL = {"small": 256, "base": 512, "big": 1024}
# The peak learning rate of each width as tuned: 0.5 * 256^-0.5 * 1000^-0.5 (`multi30k`),
# 512^-0.5 * 4000^-0.5 and 1024^-0.5 * 4000^-0.5 (the paper's base and big).
PEAK_RATE = {"small": 0.5 * 256**-0.5 * 1000**-0.5, "base": 512**-0.5 * 4000**-0.5,
             "big": 1024**-0.5 * 4000**-0.5}
WARMUP_SHARE = 0.24  # `multi30k`: 1,000 of 4,200 steps; capped at the paper's 4,000
COOLDOWN = 0.2
# Passes over the training data at most, judged on val BLEU (the final weights are chosen on
# it), not on val loss: the `multi30k` recipe on 10,000 Multi30k pairs (~104 passes in 4,200
# steps) had its best val loss at ~35 passes, yet its last checkpoints scored 3.0 val BLEU
# above those around it; on the 29,000 pairs, 7,000 steps (~58 passes) did as well as 4,200
# (~35) in both directions (BENCHMARKS.md, issues 38 and 39). More than ~100 is unmeasured.
MAX_PASSES = 100
# Where the budget holds at least `SAMPLING_FROM` times the steps of `MAX_PASSES`, the rest
# is spent on subword regularization (Kudo 2018; BPE-dropout, Provilkov et al. 2020, whose
# gains were largest on the smallest corpora): `SAMPLED_COPIES` seeded segmentations of every
# pair, BPE-dropout `SAMPLED_ALPHA`, read for at most `MAX_SAMPLED_PASSES` passes. Measured on
# Multi30k's first 10,000 pairs at the 9,429 steps an hour buys on the Zen 5 EPYC: 37.51 val
# BLEU sampled against 34.87 for one segmentation read as often (p = 0.001; 33.84 at the
# 100-pass cap, the `multi30k` recipe 33.74; BENCHMARKS.md, issue 39). Sampling learns more
# slowly (issue 29: on 29,000 pairs it was far behind at step 2,000 of the recipe's 4,200),
# hence only where the budget is well beyond what one segmentation can use; its pieces are
# ~1.45x as many (Multi30k German: 21.2 a sentence against 14.8).
SAMPLING_FROM = 2.0
SAMPLED_COPIES = 20
SAMPLED_ALPHA = 0.1
SAMPLED_LENGTH = 1.45
MAX_SAMPLED_PASSES = 2 * MAX_PASSES  # a judgment: twice one segmentation's, as each differs
PIECES_PER_WORD = 1.3  # Multi30k: 14.3 target pieces a sentence for 11.9 words at 8,000
PADDING = 1.1  # bucketed batches: padding efficiency 93.6% measured on Multi30k
CHECKPOINTS_PER_RUN = 42  # `multi30k`: every 100 of 4,200 steps; validation every 2nd
VAL_BEAMS, VAL_ALPHAS = "4,6", "0.6,1.0,1.4"  # issue 29's grid, chosen on val BLEU


@dataclasses.dataclass(frozen=True)
class Choice:
    """One setting `auto` chose: its value and why (for --dry-run and config.json)."""

    value: Any
    reason: str


def round_to(value: float, step: int) -> int:
    return max(step, int(round(value / step)) * step)


def vocabulary_choice(stats: CorpusStatistics) -> Choice:
    """Subword pieces: 8,000 x (words / Multi30k's)^0.3, which meets the paper's 37,000 at
    WMT14's 2.2e8 words; at most a quarter of the distinct words (beyond that pieces are
    whole rare words: Sennrich and Zhang 2019 found small vocabularies best on little data)."""
    scaled = 8000 * (stats.words / MULTI30K_WORDS) ** 0.3
    value = min(scaled, stats.word_types / 4, 37_000)
    step = 500 if value >= 1000 else 50
    # Rounded down where a cap binds, so that rounding never lifts it above the cap.
    value = (int(value // step) * step if value < scaled else round_to(value, step))
    value = max(MIN_VOCABULARY, value)
    return Choice(value, f"8,000 x ({stats.words:,} words / Multi30k's {MULTI30K_WORDS:,})^0.3"
                  f" = {scaled:,.0f}, at most a quarter of the {stats.word_types:,} distinct "
                  f"words and the paper's 37,000, rounded, at least {MIN_VOCABULARY} (the "
                  "tokenizer's byte pieces and special ids)")


def preset_ceiling(stats: CorpusStatistics) -> str:
    """The largest preset the data support (`PRESET_FROM_WORDS`)."""
    return [name for name in PRESET_ORDER if stats.words >= PRESET_FROM_WORDS[name]][-1]


def dropout_choice(stats: CorpusStatistics, preset: str) -> Choice:
    """0.2 at Multi30k's distinct words, 0.165 more for every 10x fewer, 0.165 less for 10x
    more, within [0.1, 0.3]; `big` keeps the paper's 0.3.

    The rule is "0.1 more dropout for every 10x fewer words" (the low-resource studies'
    direction) restated on distinct words through Multi30k's own Heaps' exponent (its first
    10,000 pairs: 20,414 distinct words in 223,942; all 29,000: 39,491 in 667,403; so
    distinct words grow as words^0.60 and 0.1 / 0.60 = 0.165 a decade). On text as
    repetitive as captions both give the same value; a corpus whose words are more varied
    (news: 133,901 distinct in 1.0M words, 3.4x Multi30k's distinct words for 1.5x its
    words) may hold more for a model to learn, and did better with less dropout: 0.1 scored
    7.54 val BLEU where the words rule's 0.2 scored 4.34 and 3.58 (one corpus and budget;
    BENCHMARKS.md, issue 39)."""
    if preset == "big":
        return Choice(0.3, "the paper's big model (Table 3)")
    raw = 0.2 + DROPOUT_PER_DECADE * math.log10(MULTI30K_WORD_TYPES / stats.word_types)
    value = round(min(0.3, max(0.1, raw)) * 20) / 20
    return Choice(value, f"0.2 + {DROPOUT_PER_DECADE} x log10(Multi30k's "
                  f"{MULTI30K_WORD_TYPES:,} distinct words / {stats.word_types:,}) = "
                  f"{raw:.3f}, within [0.1, 0.3], to 0.05")


def max_length_choice(stats: CorpusStatistics) -> Choice:
    """128 pieces (`multi30k`) if 99.9% of the sentences fit at `PIECES_PER_WORD`, else 256
    (the paper's); longer pairs are left out of the batches."""
    longest = math.ceil(max(stats.long_source, stats.long_target) * PIECES_PER_WORD) + 1
    value = 128 if longest <= 128 else 256
    return Choice(value, f"99.9% of sentences within {max(stats.long_source, stats.long_target)}"
                  f" words ~ {longest} pieces")


def passes_per_step(stats: CorpusStatistics, tokens_per_step: int) -> float:
    """The fraction of the corpus one step reads (pairs of the longer side's pieces, padded)."""
    tokens = stats.pairs * stats.mean_pair_words * PIECES_PER_WORD * PADDING
    return tokens_per_step / tokens


def steps_cap(stats: CorpusStatistics, tokens_per_step: int, sampling: bool) -> int:
    """The most steps worth training: those of `MAX_PASSES` over the data, or, reading
    sampled segmentations (`sampling`), those of `MAX_SAMPLED_PASSES` over pieces
    `SAMPLED_LENGTH` times as many."""
    passes = MAX_SAMPLED_PASSES * SAMPLED_LENGTH if sampling else MAX_PASSES
    return max(1, int(passes / passes_per_step(stats, tokens_per_step)))


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the user gave: minutes for the whole command, or steps (its reproducible form)."""

    minutes: float | None = None
    steps: int | None = None

    def describe(self) -> str:
        return (f"{self.minutes:g} minutes" if self.minutes is not None
                else f"{self.steps:,} steps")


def schedule_choices(stats: CorpusStatistics, preset: str, budget_steps: int,
                     why_steps: str, *, d_model: int | None = None,
                     tokens_per_step: int | None = None,
                     warmup_steps: int | None = None,
                     subword_samples: int | None = None,
                     sampling: Choice | None = None) -> dict[str, Choice]:
    """The steps (the budget's, at most `steps_cap`), subword sampling, warmup, peak rate,
    cooldown and checkpoint cadence of a run of `preset` that the budget gives
    `budget_steps` steps. `d_model` and `tokens_per_step` default to the preset's, the
    warmup to `WARMUP_SHARE` of the steps (given flags may change them: the peak rate is
    the preset's at the warmup's end either way); a preset without a tuned rate (`tiny`)
    takes `small`'s. `sampling` is auto's --subword-samples where already decided (a minutes
    plan decides before it takes the copies' preparation out of its minutes), else
    `sampling_choice` on `budget_steps`; a given `subword_samples` wins and decides the cap.
    """
    tokens = tokens_per_step or TOKENS_PER_STEP.get(preset, TOKENS_PER_STEP["small"])
    width = d_model or D_MODEL.get(preset, D_MODEL["small"])
    own = sampling or sampling_choice(stats, tokens, budget_steps)
    sampled = (own.value if subword_samples is None else subword_samples) > 0
    most = steps_cap(stats, tokens, sampled)
    steps = min(budget_steps, most)
    read = (f"{MAX_SAMPLED_PASSES} passes over its sampled segmentations" if sampled
            else f"{MAX_PASSES} passes over the data")
    steps_reason = why_steps if steps == budget_steps else (
        f"{read} ({most:,} steps of {tokens:,} tokens), the most "
        f"{'judged' if sampled else 'measured'} to help: the budget's {budget_steps:,} would "
        "read it more often, so the run ends early")
    warmup = warmup_steps or min(4000, steps,
                                 round_to(WARMUP_SHARE * steps, 10 if steps < 1000 else 100))
    peak = PEAK_RATE.get(preset, PEAK_RATE["small"])
    lr_scale = round(peak * math.sqrt(width * warmup), 4)
    every = max(10, round_to(steps / CHECKPOINTS_PER_RUN, 10 if steps < 4200 else 50))
    choices = {
        "max_steps": Choice(steps, steps_reason),
        "warmup_steps": Choice(warmup, f"{WARMUP_SHARE:.0%} of the steps (multi30k: 1,000 of "
                               "4,200), at most the paper's 4,000"),
        "lr_scale": Choice(lr_scale, f"a peak rate of {peak:.2e} "
                           f"({preset if preset in PEAK_RATE else 'small'}'s as tuned), reached "
                           f"at step {warmup}"),
        "cooldown": Choice(COOLDOWN, "the rate falls linearly to 0 over the last 20% of the "
                           "steps: the run ends annealed at its budget"),
        "checkpoint_every": Choice(every, f"{CHECKPOINTS_PER_RUN} checkpoints a run "
                                   "(multi30k: every 100 of 4,200)"),
        "validate_every": Choice(2 * every, "every second checkpoint"),
        "average_last": Choice(5, "the paper's 5 (6.1), chosen on val against the 5 around "
                                  "the best step before the cooldown and the best"),
        "subword_samples": own,  # auto's (a given --subword-samples decides the cap above)
    }
    if sampled:
        choices["subword_alpha"] = Choice(SAMPLED_ALPHA, "BPE-dropout's (Provilkov et al. 2020)")
    return choices


def sampling_choice(stats: CorpusStatistics, tokens: int, budget_steps: int) -> Choice:
    """`--subword-samples`: `SAMPLED_COPIES` where the budget holds `SAMPLING_FROM` times the
    steps of `MAX_PASSES` over one segmentation (`steps_cap`), else 0."""
    if budget_steps >= SAMPLING_FROM * steps_cap(stats, tokens, sampling=False):
        return Choice(SAMPLED_COPIES, (
            f"the budget's {budget_steps:,} steps of {tokens:,} tokens are over {SAMPLING_FROM:g}x"
            f" {MAX_PASSES} passes over one segmentation: the rest goes to subword "
            f"regularization, {SAMPLED_COPIES} sampled segmentations of every pair (pieces "
            f"~{SAMPLED_LENGTH}x as many)"))
    return Choice(0, (f"one segmentation: the budget holds less than {SAMPLING_FROM:g}x the "
                      f"steps of {MAX_PASSES} passes over the data, and sampling learns slowly"))


def tokens_choice(preset: str) -> Choice:
    """The tokens of a step: `TOKENS_PER_STEP` (`tiny`: `small`'s)."""
    tokens = TOKENS_PER_STEP.get(preset, TOKENS_PER_STEP["small"])
    source = "the paper" if tokens == TOKENS_PER_STEP["base"] else "the multi30k recipe"
    return Choice(tokens, f"{source}'s, for {preset}")


def data_choices(stats: CorpusStatistics) -> dict[str, Choice]:
    """The choices that need only the corpus: vocabulary, length limit, label smoothing and
    how the final weights and decoding are chosen."""
    return {
        "vocab_size": vocabulary_choice(stats),
        "max_length": max_length_choice(stats),
        "label_smoothing": Choice(0.1, "the paper's (5.4)"),
        "choose_by": Choice("bleu", "the final weights, beam and alpha by val BLEU (issue 29: "
                            "+0.3 to +0.6 on val over the paper's defaults)"),
        "val_beams": Choice(VAL_BEAMS, "issue 29's grid"),
        "val_alphas": Choice(VAL_ALPHAS, "issue 29's grid"),
        "patience": Choice(0, "no early stop: the schedule ends at the budget"),
    }


def budget_minutes_choices(stats: CorpusStatistics, preset: str, training_seconds: float,
                           step_seconds: float, **sizes: Any) -> dict[str, Choice]:
    """`schedule_choices` for a minutes budget: the steps that `training_seconds` hold at
    `step_seconds` (measured, with the run's overheads), and a --max-minutes guard.

    The guard is 1.25x the planned training minutes, or all the training minutes the budget
    leaves where more: when the passes cap the steps below what the budget holds, a machine
    slower than measured may use that slack before the guard cuts the schedule short (a
    Multi30k run on a Xeon whose speed varied 1.5x within the hour was stopped at 4,533 of
    4,817 steps, its cooldown unfinished, with 6.8 of its 60 minutes unused)."""
    steps = max(1, int(training_seconds / step_seconds))
    choices = schedule_choices(stats, preset, steps, f"{training_seconds / 60:.1f} min of "
                               f"training at {step_seconds:.3f} s a step", **sizes)
    planned = choices["max_steps"].value * step_seconds / 60
    available = training_seconds / 60
    if available > 1.25 * planned:
        guard, why = available, (f"a guard: the {available:.1f} training minutes the budget "
                                 f"leaves (the steps planned take {planned:.1f})")
    else:
        guard, why = 1.25 * planned, f"a guard: 1.25x the {planned:.1f} training minutes planned"
    choices["max_minutes"] = Choice(round(max(1.0, guard), 1), why)
    return choices


def describe_choices(choices: dict[str, Choice], given: dict[str, Any]) -> str:
    """The dry run's table: each setting, its value and why; a flag given wins (`given`:
    the values of the flags given), and the line says what auto would have chosen."""
    width = max(len(name) for name in choices) + 3
    return "\n".join(f"    --{name.replace('_', '-'):<{width}}"
                     + (f"{given[name]}  (given as a flag; auto: {choice.value}, "
                        f"{choice.reason})" if name in given
                        else f"{choice.value}  ({choice.reason})")
                     for name, choice in choices.items())
