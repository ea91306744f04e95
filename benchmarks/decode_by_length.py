"""What a val or test sentence costs to decode, by its length and by the model (issue 39's
plan of a run's end, `keras_transformer.training.auto_minutes.length_factor`).

    python benchmarks/decode_by_length.py --model RUN [--model RUN2 ...] \
        --data ../shared/data/newstest-deen [--splits val,test] [--src de] [--tgt en] \
        [--also ../shared/data/multi30k] [--per-bin 128] [--runs 3]

Sentences of the given splits are grouped by source words (bins below); each model translates
each bin's first `--per-bin` sentences at beam 4, alpha 0.6 (the beam-4 decoding that the plan
counts in), through `keras_transformer.decoding.translator.translate_texts` as a run's end
does. `--also FOLDER` adds that corpus's val sentences as one more group (e.g. Multi30k's, the
plan's unit), so that one model's cost on both corpora and two models' cost on the same
sentences are measured in the same run. The groups and models are interleaved in each of
`--runs` rounds, so that load from other processes spreads over all of them; each figure is
the median over the rounds, in ms a sentence. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BINS = ((4, 7), (8, 11), (12, 15), (16, 20), (21, 27), (28, 36), (37, 50))


def groups(args: argparse.Namespace) -> dict[str, list[str]]:
    """Named lists of source sentences: the length bins, and `--also`'s val split."""
    from pipelines.corpora import load_corpus

    def read_sources(folder: Path, split: str) -> list[str]:
        return load_corpus(folder, split, args.src, args.tgt).sources

    sentences = [line for split in args.splits.split(",")
                 for line in read_sources(args.data, split)]
    named = {f"{low}-{high} words": [s for s in sentences if low <= len(s.split()) <= high]
             [:args.per_bin] for low, high in BINS}
    if args.also:
        named[f"{args.also.name} val"] = read_sources(args.also, "val")[:args.per_bin]
    return {name: group for name, group in named.items() if group}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a run directory")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--splits", default="val,test")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--also", type=Path, help="a corpus folder whose val split is added")
    parser.add_argument("--per-bin", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from keras_transformer.decoding.translator import translate_texts
    from keras_transformer.serving.translator import load_translator

    named = groups(args)
    models = {path: load_translator(path) for path in args.model}
    for translator in models.values():  # traced once before timing
        translate_texts(translator.model, translator.tokenizer, next(iter(named.values()))[:16],
                        beam_size=4, alpha=0.6)
    times: dict[tuple[str, str], list[float]] = {}
    words: dict[tuple[str, str], float] = {}
    for _ in range(args.runs):
        for name, sentences in named.items():
            for path, translator in models.items():
                started = time.perf_counter()
                hypotheses = translate_texts(translator.model, translator.tokenizer, sentences,
                                             beam_size=4, alpha=0.6)
                seconds = time.perf_counter() - started
                times.setdefault((path, name), []).append(1000 * seconds / len(sentences))
                words[(path, name)] = sum(len(h.split()) for h in hypotheses) / len(sentences)
    rows = [{"model": path, "group": name, "sentences": len(named[name]),
             "source_words": round(sum(len(s.split()) for s in named[name]) / len(named[name]), 1),
             "output_words": round(words[(path, name)], 1),
             "ms_a_sentence": round(statistics.median(times[(path, name)]), 1),
             "runs": [round(t, 1) for t in times[(path, name)]]}
            for path in models for name in named]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
