"""Serving speed on real sentences: our SavedModel against CTranslate2 on the same weights
(issue 17, part 3).

One trained run is exported into a temporary folder: as our SavedModel (requests sorted by
length and chunked by 32 inside the graph), optionally again with an XLA-compiled decoding
step (`--xla`), and as a CTranslate2 model (float32 weights; int8 by `compute_type` at load).
Each engine translates the whole split, text in and text out, with 2 threads, batches of 32,
greedy and beam 4 (α 0.6):

- the SavedModel in a child process that imports only tensorflow and tensorflow_text, called
  through its signatures (`translate`, i.e. `serving_default` with the beam as an input);
- CTranslate2 through `keras_transformer.ctranslate2_export.translate` (SentencePiece
  tokenization included; `max_batch_size` 32, sorted by length inside CTranslate2).

Reported per engine and beam: target tokens/s (SentencePiece pieces of the outputs + EOS, the
same count for every engine), sentences/s (medians of `--runs` passes after a warm-up pass),
sacreBLEU against the references; for beam 4 also the batch-1 latency (p50, p90 over the first
100 sentences, one request each). A concurrency case sends 8 client threads x 50 requests of
1-8 sentences (seeded) to one loaded SavedModel: errors, throughput and peak memory.

    python benchmarks/serving.py --model runs/multi30k-de-en --data ../shared/data/multi30k \\
        --split test_2016_flickr --src de --tgt en --runs 3 --json
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
LATENCY_SENTENCES = 100
CLIENTS, REQUESTS, MAX_REQUEST = 8, 50, 8

SAVED_MODEL_CHILD = """
import json, random, resource, sys, threading, time
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the SentencePiece ops)
tf.config.threading.set_intra_op_parallelism_threads({threads})
tf.config.threading.set_inter_op_parallelism_threads(1)
texts = json.load(open(sys.argv[2]))
translate = tf.saved_model.load(sys.argv[1]).signatures["translate"]

def run(batch, beam):
    out = translate(inputs=tf.constant(batch), beam_size=tf.constant(beam),
                    alpha=tf.constant(0.6))
    return [t.decode("utf-8") for t in out["outputs"].numpy()]

results = {{}}
for beam in (1, 4):
    run(texts, beam)  # warm-up (tracing of the loaded functions; XLA compilations)
    seconds = []
    for _ in range({runs}):
        started = time.perf_counter()
        outputs = run(texts, beam)
        seconds.append(time.perf_counter() - started)
    results[beam] = {{"seconds": seconds, "outputs": outputs}}
for text in texts[:5]:
    run([text], 4)
latencies = []
for text in texts[:{latency}]:
    started = time.perf_counter()
    run([text], 4)
    latencies.append(time.perf_counter() - started)
results["latency"] = latencies
if {concurrency}:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    errors, sentences = [], [0]
    lock = threading.Lock()
    def client(seed):
        rng = random.Random(seed)
        for _ in range({requests}):
            size = rng.randint(1, {max_request})
            start = rng.randrange(len(texts) - size)
            try:
                out = run(texts[start: start + size], 4)
                assert len(out) == size
                with lock:
                    sentences[0] += size
            except Exception as error:  # reported, not raised: the case counts errors
                with lock:
                    errors.append(repr(error))
    threads = [threading.Thread(target=client, args=(seed,)) for seed in range({clients})]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results["concurrency"] = {{
        "seconds": time.perf_counter() - started, "sentences": sentences[0],
        "errors": errors[:5], "error_count": len(errors),
        "peak_rss_mb_before": rss_before / 1024,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}
print(json.dumps(results))
"""


def saved_model_runs(directory: Path, texts: list[str], runs: int, concurrency: bool) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(texts, handle)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    script = SAVED_MODEL_CHILD.format(
        threads=THREADS, runs=runs, latency=LATENCY_SENTENCES, concurrency=concurrency,
        requests=REQUESTS, max_request=MAX_REQUEST, clients=CLIENTS)
    child = subprocess.run([sys.executable, "-c", script, str(directory), handle.name],
                           env=env, capture_output=True, text=True, check=True)
    os.unlink(handle.name)
    results = json.loads(child.stdout.strip().splitlines()[-1])
    return {(int(key) if key.isdigit() else key): value for key, value in results.items()}


def ctranslate2_runs(directory: Path, texts: list[str], compute_type: str, runs: int) -> dict:
    import ctranslate2
    import sentencepiece as spm

    from keras_transformer.ctranslate2_export import translate

    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type,
                                       intra_threads=THREADS, inter_threads=1)
    processor = spm.SentencePieceProcessor(model_file=str(directory / "sentencepiece.model"))

    def run(batch, beam):
        return translate(translator, processor, batch, beam_size=beam, alpha=0.6,
                         max_batch_size=BATCH)

    results: dict = {}
    for beam in (1, 4):
        run(texts, beam)
        seconds = []
        for _ in range(runs):
            started = time.perf_counter()
            outputs = run(texts, beam)
            seconds.append(time.perf_counter() - started)
        results[beam] = {"seconds": seconds, "outputs": outputs}
    latencies = []
    for text in texts[:LATENCY_SENTENCES]:
        started = time.perf_counter()
        run([text], 4)
        latencies.append(time.perf_counter() - started)
    results["latency"] = latencies
    return results


def add_run_and_split_flags(parser: argparse.ArgumentParser) -> None:
    """--model (a run directory) and the split it translates: --data, --split, --src, --tgt."""
    parser.add_argument("--model", required=True, help="run directory")
    parser.add_argument("--data", required=True)
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_and_split_flags(parser)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--xla", action="store_true",
                        help="also a SavedModel with an XLA-compiled decoding step")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (its `cases`) as the last line")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import sentencepiece as spm

    from keras_transformer import artifacts
    from keras_transformer.ctranslate2_export import export_ctranslate2
    from keras_transformer.saved_model import export_saved_model
    from keras_transformer.scoring import score_translations
    from pipelines.corpora import load_corpus

    corpus = load_corpus(args.data, args.split, args.src, args.tgt)
    texts, references = list(corpus.sources), list(corpus.targets)
    model, tokenizer = artifacts.load_run(args.model)
    processor = spm.SentencePieceProcessor(model_proto=tokenizer.model_proto)
    engines = {}
    with tempfile.TemporaryDirectory() as temporary:
        saved = export_saved_model(model, tokenizer, Path(temporary) / "saved", chunk_size=BATCH)
        engines["savedmodel"] = saved_model_runs(saved, texts, args.runs, concurrency=True)
        if args.xla:
            xla = export_saved_model(model, tokenizer, Path(temporary) / "xla",
                                     chunk_size=BATCH, jit_compile=True)
            engines["savedmodel_xla"] = saved_model_runs(xla, texts, args.runs,
                                                         concurrency=False)
        ct2 = export_ctranslate2(model, tokenizer, Path(temporary) / "ct2")
        for compute_type in ("float32", "int8"):
            engines[f"ct2_{compute_type}"] = ctranslate2_runs(ct2, texts, compute_type,
                                                             args.runs)
    cases = []
    for engine, results in engines.items():
        for beam in (1, 4):
            outputs = results[beam]["outputs"]
            median = statistics.median(results[beam]["seconds"])
            tokens = sum(len(processor.encode(text)) + 1 for text in outputs)
            case = {
                "engine": engine, "beam": beam,
                "target_tokens_per_s": round(tokens / median, 1),
                "sentences_per_s": round(len(texts) / median, 1),
                "bleu": round(score_translations(outputs, references)["bleu"], 2),
                "same_as_savedmodel": sum(a == b for a, b in zip(
                    outputs, engines["savedmodel"][beam]["outputs"], strict=True)),
                "seconds": [round(s, 2) for s in results[beam]["seconds"]],
            }
            if beam == 4:
                case["latency_p50_ms"] = round(1000 * statistics.median(results["latency"]), 1)
                case["latency_p90_ms"] = round(1000 * _percentile(results["latency"], 0.9), 1)
            cases.append(case)
    concurrency = engines["savedmodel"]["concurrency"]
    concurrency["sentences_per_s"] = round(concurrency["sentences"] / concurrency["seconds"], 1)
    for case in cases:
        print(f"{case['engine']:<15} beam {case['beam']}: {case['target_tokens_per_s']:>8,.0f} "
              f"tokens/s {case['sentences_per_s']:>6.1f} sentences/s  BLEU {case['bleu']:.2f}"
              + (f"  batch-1 latency p50 {case['latency_p50_ms']} ms, p90 "
                 f"{case['latency_p90_ms']} ms" if "latency_p50_ms" in case else ""))
    print(f"concurrency ({CLIENTS} clients x {REQUESTS} requests of 1-{MAX_REQUEST} sentences, "
          f"beam 4): {concurrency['error_count']} errors, {concurrency['sentences_per_s']} "
          f"sentences/s, peak RSS {concurrency['peak_rss_mb']:.0f} MB")
    if args.json:
        print(json.dumps({"cases": cases, "concurrency": concurrency,
                          "threads": THREADS, "batch": BATCH, "split": args.split}))


if __name__ == "__main__":
    main()
