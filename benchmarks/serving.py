"""Serving speed on real sentences: our SavedModel against CTranslate2 on the same weights
(issue 17, part 3).

One trained run is exported twice (into a temporary folder): as our SavedModel (requests
sorted by length and chunked by 32 inside the graph) and as a CTranslate2 model (float32
weights; int8 by `compute_type` at load). Each engine translates the whole split, text in
and text out, with 2 threads, batches of 32, greedy and beam 4 (α 0.6):

- the SavedModel in a child process that imports only tensorflow and tensorflow_text, called
  through its `translate` signature (`serving_default` with the beam as an input);
- CTranslate2 through `keras_transformer.ctranslate2_export.translate` (SentencePiece
  tokenization included; `max_batch_size` 32, sorted by length inside CTranslate2).

Throughput counts target tokens (SentencePiece pieces of the outputs + EOS, the same count for
every engine), median of `--runs` passes after one warm-up pass.

    python benchmarks/serving.py --model runs/multi30k-de-en --data ../shared/data/multi30k \\
        --split test_2016_flickr --src de --tgt en --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
BATCH = 32

SAVED_MODEL_CHILD = """
import json, sys, time
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the SentencePiece ops)
tf.config.threading.set_intra_op_parallelism_threads({threads})
tf.config.threading.set_inter_op_parallelism_threads(1)
texts = json.load(open(sys.argv[2]))
translate = tf.saved_model.load(sys.argv[1]).signatures["translate"]
inputs = tf.constant(texts)
results = {{}}
for beam in (1, 4):
    def run():
        out = translate(inputs=inputs, beam_size=tf.constant(beam), alpha=tf.constant(0.6))
        return [t.decode("utf-8") for t in out["outputs"].numpy()]
    run()  # warm-up (tracing of the loaded functions)
    seconds = []
    for _ in range({runs}):
        started = time.perf_counter()
        outputs = run()
        seconds.append(time.perf_counter() - started)
    results[beam] = {{"seconds": seconds, "outputs": outputs}}
print(json.dumps(results))
"""


def saved_model_runs(directory: Path, texts: list[str], runs: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(texts, handle)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    child = subprocess.run(
        [sys.executable, "-c", SAVED_MODEL_CHILD.format(threads=THREADS, runs=runs),
         str(directory), handle.name], env=env, capture_output=True, text=True, check=True)
    os.unlink(handle.name)
    return {int(beam): value for beam, value in json.loads(child.stdout).items()}


def ctranslate2_runs(directory: Path, texts: list[str], compute_type: str, runs: int) -> dict:
    import ctranslate2
    import sentencepiece as spm

    from keras_transformer.ctranslate2_export import translate

    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type,
                                       intra_threads=THREADS, inter_threads=1)
    processor = spm.SentencePieceProcessor(model_file=str(directory / "sentencepiece.model"))
    results = {}
    for beam in (1, 4):
        def run(beam=beam):
            return translate(translator, processor, texts, beam_size=beam, alpha=0.6,
                             max_batch_size=BATCH)
        run()
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            outputs = run()
            seconds.append(time.perf_counter() - started)
        results[beam] = {"seconds": seconds, "outputs": outputs}
    return results


def add_run_and_split_flags(parser: argparse.ArgumentParser) -> None:
    """--model (a run directory) and the split it translates: --data, --split, --src, --tgt."""
    parser.add_argument("--model", required=True, help="run directory")
    parser.add_argument("--data", required=True)
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_and_split_flags(parser)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import sentencepiece as spm

    from keras_transformer import artifacts
    from keras_transformer.ctranslate2_export import export_ctranslate2
    from keras_transformer.saved_model import export_saved_model
    from pipelines.corpora import load_corpus

    texts = load_corpus(args.data, args.split, args.src, args.tgt).sources
    model, tokenizer = artifacts.load_run(args.model)
    processor = spm.SentencePieceProcessor(model_proto=tokenizer.model_proto)
    with tempfile.TemporaryDirectory() as temporary:
        saved = export_saved_model(model, tokenizer, Path(temporary) / "saved", chunk_size=BATCH)
        ct2 = export_ctranslate2(model, tokenizer, Path(temporary) / "ct2")
        engines = {"SavedModel (float32)": saved_model_runs(saved, texts, args.runs)}
        for compute_type in ("float32", "int8"):
            engines[f"CTranslate2 {compute_type}"] = ctranslate2_runs(ct2, texts, compute_type,
                                                                     args.runs)
    reference = engines["SavedModel (float32)"]
    report = {}
    for name, results in engines.items():
        for beam, result in results.items():
            tokens = sum(len(processor.encode(t)) + 1 for t in result["outputs"])
            median = statistics.median(result["seconds"])
            same = sum(a == b for a, b in zip(result["outputs"], reference[beam]["outputs"],
                                               strict=True))
            report[f"{name}, {'greedy' if beam == 1 else f'beam {beam}'}"] = {
                "target_tokens_per_s": round(tokens / median, 1),
                "seconds": [round(s, 2) for s in result["seconds"]],
                "sentences": len(texts), "same_as_saved_model": same}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
