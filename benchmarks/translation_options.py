"""What the translation options cost (issue 37): the SavedModel's plain signatures against an
export of an earlier version of the code, and sampling against greedy search.

    python benchmarks/translation_options.py --model RUN_DIR --data ../shared/data/multi30k \\
        --src de --tgt en [--baseline OLD_SAVED_MODEL [--baseline-modes greedy,beam4]] [--runs 5]

The run is exported (as `benchmarks/serving.py` does: chunks of 32, 2 threads) and each
engine answers in a child process that imports only tensorflow and tensorflow_text:
- `translate` with beam 1 and beam 4 (or the `--baseline-modes`, e.g. the `sample` ones) on
  this export and on `--baseline` (e.g. exported by the code before the new signatures),
  interleaved run by run: the ratio is the cost of the change;
- `sample` (top-k 0, top-k 10, top-p 0.9; temperature 1) against `translate` beam 1 on the
  same export, interleaved.
Target tokens/s count the outputs' SentencePiece pieces + EOS; medians of `--runs` passes
after a warm-up pass. Prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import (  # noqa: E402
    BATCH,
    IDLE_SECONDS,
    THREADS,
    Engine,
    add_run_and_split_flags,
)

# `run(batch, mode)`: the Engine protocol's "beam" carries the mode: 1 and 4 are `translate`'s
# beam; the negative codes are `sample` settings.
OPTIONS_LOAD = """
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the SentencePiece ops)
tf.config.threading.set_intra_op_parallelism_threads({threads})
tf.config.threading.set_inter_op_parallelism_threads(1)
loaded = tf.saved_model.load(sys.argv[1])
SAMPLING = {{-1: (0, 1.0), -10: (10, 1.0), -90: (0, 0.9)}}

def run(batch, mode):
    if mode > 0:
        out = loaded.signatures["translate"](inputs=tf.constant(batch),
                                             beam_size=tf.constant(mode), alpha=tf.constant(0.6))
    else:
        top_k, top_p = SAMPLING[mode]
        out = loaded.signatures["sample"](
            inputs=tf.constant(batch), line_indices=tf.range(len(batch), dtype=tf.int64),
            seed=tf.constant(1, tf.int64), top_k=tf.constant(top_k), top_p=tf.constant(top_p),
            temperature=tf.constant(1.0), alpha=tf.constant(0.6))
    return [t.decode("utf-8") for t in out["outputs"].numpy()]
"""
MODES = {"greedy": 1, "beam4": 4, "sample_topk0": -1, "sample_topk10": -10,
         "sample_topp0.9": -90}


def passes(engines: dict, modes: list[str], texts: list[str], runs: int) -> dict:
    """{(engine, mode): {"seconds": [...], "outputs": [...]}}, interleaved pass by pass."""
    results = {}
    for name, engine in engines.items():
        for mode in modes:
            seconds, outputs = engine.translate(texts, MODES[mode])  # warm-up
            results[(name, mode)] = {"seconds": [], "outputs": outputs}
    for _ in range(runs):
        for mode in modes:
            for name, engine in engines.items():
                time.sleep(IDLE_SECONDS)
                results[(name, mode)]["seconds"].append(engine.translate(texts, MODES[mode])[0])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_and_split_flags(parser)
    parser.add_argument("--baseline", help="a SavedModel of the earlier code")
    parser.add_argument("--baseline-modes", default="greedy,beam4",
                        help=f"comma-separated, of {','.join(MODES)}: the modes run on both "
                        "exports (greedy among them: each export's ratios to its greedy too)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    baseline_modes = args.baseline_modes.split(",")
    if unknown := set(baseline_modes) - set(MODES):
        parser.error(f"unknown --baseline-modes: {sorted(unknown)}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import sentencepiece as spm

    from keras_transformer import run_directory
    from keras_transformer.serving.saved_model import export_saved_model
    from pipelines.corpora import load_corpus

    texts = list(load_corpus(args.data, args.split, args.src, args.tgt).sources)
    model, tokenizer = run_directory.load_run(args.model)
    processor = spm.SentencePieceProcessor(model_proto=tokenizer.model_proto)
    load = OPTIONS_LOAD  # Engine fills in {threads}
    with tempfile.TemporaryDirectory() as folder:
        saved = export_saved_model(model, tokenizer, Path(folder) / "saved", chunk_size=BATCH)
        engines = {"savedmodel": Engine(load, str(saved))}
        try:
            results = passes(engines, list(MODES), texts, args.runs)
            if args.baseline:
                baseline = {"current": engines["savedmodel"],
                            "baseline": Engine(load, args.baseline)}
                try:
                    results.update(passes(baseline, baseline_modes, texts, args.runs))
                finally:
                    baseline["baseline"].close()
        finally:
            engines["savedmodel"].close()
    cases = {}
    for (engine, mode), result in results.items():
        median = statistics.median(result["seconds"])
        tokens = sum(len(processor.encode(text)) + 1 for text in result["outputs"])
        cases[f"{engine} {mode}"] = {"target_tokens_per_s": round(tokens / median, 1),
                                     "seconds": [round(s, 3) for s in result["seconds"]]}
        print(f"{engine:<11} {mode:<15} {tokens / median:>9,.0f} target tokens/s "
              f"(median of {len(result['seconds'])})")
    greedy = cases["savedmodel greedy"]["target_tokens_per_s"]
    ratios = {f"{mode} / greedy": round(cases[f"savedmodel {mode}"]["target_tokens_per_s"]
                                        / greedy, 3) for mode in MODES if mode != "greedy"}
    if args.baseline:
        for mode in baseline_modes:
            ratios[f"{mode}: this export / baseline"] = round(
                cases[f"current {mode}"]["target_tokens_per_s"]
                / cases[f"baseline {mode}"]["target_tokens_per_s"], 3)
        if "greedy" in baseline_modes:  # both exports' ratios from the same interleaved passes
            for engine in ("current", "baseline"):
                greedy = cases[f"{engine} greedy"]["target_tokens_per_s"]
                for mode in baseline_modes:
                    if mode != "greedy":
                        ratios[f"{engine}: {mode} / greedy"] = round(
                            cases[f"{engine} {mode}"]["target_tokens_per_s"] / greedy, 3)
    for name, value in ratios.items():
        print(f"{name}: {value}")
    print(json.dumps({"cases": cases, "ratios": ratios, "split": args.split,
                      "sentences": len(texts), "threads": THREADS, "batch": BATCH}))


if __name__ == "__main__":
    main()
