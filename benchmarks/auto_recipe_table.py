"""What `--recipe auto` picks for corpora of several sizes and budgets (docs/auto_recipe.md).

    python benchmarks/auto_recipe_table.py --data ../shared/data [--minutes 60]

The plans are `keras_transformer.training.auto_plan.plan_run`'s own, with:
- measured rows: corpora that exist here (Multi30k de-en, its first 10,000 pairs, de+fr+cs->en,
  the WMT news pairs), counted, and the step of each candidate preset measured on this machine
  (the same measurement a run makes; cached per model, vocabulary and pair length);
- scaled rows (100k, 300k pairs): Multi30k's words a pair, distinct words by Heaps' law
  (39,491 x (words / 667,403)^0.6, an assumption), steps measured here;
- extrapolated rows (1M and 4.5M pairs, WMT-like 24.4 words a side, other machines): step
  times assumed, stated in the row (the paper's 0.4 s base and 1.0 s big steps on 8 P100s,
  6.1; issue 36's 40 ms base step of ~25k tokens on one H200).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_transformer.training import auto_minutes, auto_plan  # noqa: E402
from keras_transformer.training.config import train_config  # noqa: E402
from keras_transformer.training.precision import resolve_precision  # noqa: E402
from pipelines.corpora import ParallelCorpus, load_corpus, open_corpus  # noqa: E402
from pipelines.corpus_statistics import CorpusStatistics, corpus_statistics  # noqa: E402


def heaps(pairs: int, words_a_side: float, like: CorpusStatistics) -> CorpusStatistics:
    """A corpus of `pairs` pairs shaped like `like`, its distinct words by Heaps' law."""
    words = int(2 * pairs * words_a_side)
    types = int(like.word_types * (words / like.words) ** 0.6)
    return CorpusStatistics(pairs, words // 2, words - words // 2, types, like.long_source,
                            like.long_target)


def counted(data: Path, folder: str, sources: str, limit: int | None = None
            ) -> CorpusStatistics:
    pairs = itertools.chain.from_iterable(
        open_corpus(data / folder, "train", source, "en").pairs()
        for source in sources.split(","))
    return corpus_statistics(itertools.islice(pairs, limit))


def plan(stats: CorpusStatistics, minutes: float, step_seconds,
         splits: dict[str, ParallelCorpus]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        config = train_config(recipe="auto", budget_minutes=minutes, data="unused", src="de",
                              tgt="en", out=str(Path(scratch) / "run"))
        corpora = dict(splits)  # their sentences' lengths enter the end's estimate
        result = auto_plan.plan_run(config, corpora, replicas=1, workers=1,
                                    started=time.perf_counter() - 20.0,  # start-up, counting
                                    precision=resolve_precision("auto"), jit=False,
                                    report=lambda line: None, stats=stats,
                                    step_seconds=step_seconds)
    choices = {name: choice["value"] for name, choice in result.record["choices"].items()}
    steps, tokens = choices["max_steps"], choices["tokens_per_step"]
    from keras_transformer.training.auto_recipe import SAMPLED_LENGTH, passes_per_step

    # Sampled segmentations are SAMPLED_LENGTH times as many pieces: fewer passes a step.
    longer = SAMPLED_LENGTH if choices.get("subword_samples") else 1.0
    return {**choices, "passes": steps * passes_per_step(stats, tokens) / longer,
            "capped": "passes over" in result.record["choices"]["max_steps"]["reason"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--minutes", type=float, default=60.0)
    args = parser.parse_args()
    precision = resolve_precision("auto")
    cache: dict[tuple, float] = {}

    def measured(stats: CorpusStatistics):
        def seconds(trial) -> float:
            key = (trial.model.preset, trial.data.vocab_size, trial.batches.tokens_per_step,
                   round(stats.mean_pair_words))
            if key not in cache:
                cache[key] = auto_minutes.measure_run_step(trial, stats, precision, False, 1,
                                                           lambda line: None)
            return cache[key]
        return seconds

    # The val and test splits each row's run decodes: Multi30k's, or newstest2013/2014 for
    # news and WMT-like corpora (WMT14's own val and test).
    splits = {folder: {role: load_corpus(args.data / folder, role, "de", "en")
                       for role in ("val", "test")}
              for folder in ("multi30k", "newstest-deen")}
    caption, news = splits["multi30k"], splits["newstest-deen"]
    multi30k = counted(args.data, "multi30k", "de")
    wmt = heaps(4_500_000, 24.4, multi30k)
    rows = [
        ("Multi30k de-en, first 10,000 pairs", counted(args.data, "multi30k", "de", 10_000),
         args.minutes, "measured here", None, caption),
        ("Multi30k de-en", multi30k, args.minutes, "measured here", None, caption),
        ("WMT news de-en (newstest-deen)", counted(args.data, "newstest-deen", "de"),
         args.minutes, "measured here", None, news),
        ("Multi30k de+fr+cs-en", counted(args.data, "multi30k", "de,fr,cs"), args.minutes,
         "measured here", None, caption),
        ("100,000 pairs (scaled)", heaps(100_000, 11.5, multi30k), args.minutes,
         "measured here", None, caption),
        ("300,000 pairs (scaled)", heaps(300_000, 11.5, multi30k), args.minutes,
         "measured here", None, caption),
        ("1M pairs, WMT-like (extrapolated)", heaps(1_000_000, 24.4, multi30k), 240.0,
         "one H200, assumed: base 0.040 s", {"small": 0.012, "base": 0.040, "big": 0.088},
         news),
        ("4.5M pairs, WMT14 (extrapolated)", wmt, 720.0,
         "8 P100s, assumed: base 0.4 s, big 1.0 s (6.1)", {"base": 0.4, "big": 1.0,
                                                           "small": 0.2}, news),
        ("4.5M pairs, WMT14 (extrapolated)", wmt, 84 * 60.0,
         "8 P100s, assumed: base 0.4 s, big 1.0 s (6.1)", {"base": 0.4, "big": 1.0,
                                                           "small": 0.2}, news),
    ]
    print(f"precision here: {precision}\n")
    print("| corpus | pairs | words | budget | step time | preset | vocabulary | dropout | "
          "tokens a step | steps | passes | warmup | lr scale | val beams |")
    print("|" + "---|" * 14)
    for name, stats, minutes, how, assumed, row_splits in rows:
        step = measured(stats) if assumed is None else (
            lambda trial, table=assumed: table[trial.model.preset])
        chosen = plan(stats, minutes, step, row_splits)
        steps = f"{chosen['max_steps']:,}" + (" (capped)" if chosen["capped"] else "") + (
            f", {chosen['subword_samples']} sampled segmentations"
            if chosen.get("subword_samples") else "")
        print(f"| {name} | {stats.pairs:,} | {stats.words:,} | {minutes / 60:g} h | {how} | "
              f"{chosen['preset']} | {chosen['vocab_size']:,} | {chosen['dropout']} | "
              f"{chosen['tokens_per_step']:,} | {steps} | {chosen['passes']:.0f} | "
              f"{chosen['warmup_steps']:,} | {chosen['lr_scale']} | {chosen['val_beams']}"
              + (f", on {chosen['val_sentences']:,} val sentences" if "val_sentences" in chosen
                 else "") + " |")
    print("\nmeasured step seconds:", {f"{k[0]} v{k[1]} t{k[2]} w{k[3]}": round(v, 3)
                                       for k, v in cache.items()})


if __name__ == "__main__":
    main()
