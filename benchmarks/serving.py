"""Serving speed on real sentences: our SavedModel against CTranslate2 on the same weights
(issue 17, part 3).

One trained run is exported into a temporary folder: as our SavedModel (requests sorted by
length and chunked by 32 inside the graph), optionally again with an XLA-compiled decoding
step (`--xla`), and as a CTranslate2 model (float32 weights; int8 by `compute_type` at load).
Each engine translates the whole split, text in and text out, with 2 threads, batches of 32,
greedy and beam 4 (α 0.6):

- the SavedModel in a child process that imports only tensorflow and tensorflow_text, called
  through its signatures (`translate`, i.e. `serving_default` with the beam as an input);
- CTranslate2 through `kt.translate_with_ctranslate2` (SentencePiece tokenization included;
  `max_batch_size` 32, sorted by length inside CTranslate2), each compute type in a child
  process of its own.

Reported per engine and beam: target tokens/s (SentencePiece pieces of the outputs + EOS, the
same count for every engine), sentences/s (medians of `--runs` passes after a warm-up pass),
sacreBLEU against the references; for beam 4 also the batch-1 latency (p50, p90 over the first
100 sentences, one request each; engine after engine: alternating them sentence by sentence
lets CTranslate2's spinning threads slow the next engine). All engines stay loaded and take
turns pass by pass, so that a machine whose speed drifts during the run (other tenants) slows
them alike. `--frozen-weights` adds the SavedModel in a process with
`TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1`, `--baseline` another SavedModel (an A/B of two exports). A
concurrency case sends 8 client threads x 50 requests of 1-8 sentences (seeded) to one loaded
SavedModel: errors, throughput and peak memory.

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
IDLE_SECONDS = 1.0
# oneDNN reorders a MatMul's weights into its blocked layout once and keeps them, instead of
# at every call; right only when every MatMul's second input is a weight that never changes.
FROZEN_WEIGHTS = "TF_ONEDNN_ASSUME_FROZEN_WEIGHTS"

# Each engine lives in its own child process (our SavedModel's imports only tensorflow and
# tensorflow_text), which waits for one JSON command per line on stdin and answers one JSON
# line, so that the parent can interleave the engines pass by pass. Separate processes also
# keep the engines' runtimes apart: once a CTranslate2 int8 translator has been created, a
# float32 one in the same process ran 5x slower (batch-1 latency 13.7 -> 73.6 ms).
SAVED_MODEL_LOAD = """
import tensorflow as tf
import tensorflow_text  # noqa: F401  (the SentencePiece ops)
tf.config.threading.set_intra_op_parallelism_threads({threads})
tf.config.threading.set_inter_op_parallelism_threads(1)
translate = tf.saved_model.load(sys.argv[1]).signatures["translate"]

def run(batch, beam):
    out = translate(inputs=tf.constant(batch), beam_size=tf.constant(beam),
                    alpha=tf.constant(0.6))
    return [t.decode("utf-8") for t in out["outputs"].numpy()]
"""

CTRANSLATE2_LOAD = """
import ctranslate2
import sentencepiece as spm
from keras_transformer.serving.ctranslate2 import translate_with_ctranslate2
translator = ctranslate2.Translator(sys.argv[1], device="cpu", compute_type=sys.argv[2],
                                    intra_threads={threads}, inter_threads=1)
processor = spm.SentencePieceProcessor(model_file=sys.argv[1] + "/sentencepiece.model")

def run(batch, beam):
    return translate_with_ctranslate2(translator, processor, batch, beam_size=beam, alpha=0.6,
                                      max_batch_size={batch})
"""

ENGINE_CHILD = """
import json, random, resource, sys, threading, time
{load}

def concurrency(texts):
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
    return {{"seconds": time.perf_counter() - started, "sentences": sentences[0],
            "errors": errors[:5], "error_count": len(errors),
            "peak_rss_mb_before": rss_before / 1024,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}

print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "concurrency":
        answer = concurrency(command["texts"])
    else:
        started = time.perf_counter()
        outputs = run(command["texts"], command["beam"])
        answer = {{"seconds": time.perf_counter() - started, "outputs": outputs}}
    print(json.dumps(answer), flush=True)
"""


class Engine:
    """One engine in a child process: `SAVED_MODEL_LOAD` or `CTRANSLATE2_LOAD` with `args`,
    and `env` added to its environment."""

    def __init__(self, load: str, *args: str, env: dict[str, str] | None = None):
        load = load.format(threads=THREADS, batch=BATCH)
        script = ENGINE_CHILD.format(load=load, requests=REQUESTS, max_request=MAX_REQUEST,
                                     clients=CLIENTS)
        self.child = subprocess.Popen(
            [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {})))
        self._answer()  # "ready": loaded

    def _answer(self):
        line = self.child.stdout.readline()
        if not line:
            raise RuntimeError(f"an engine's child process exited ({self.child.wait()})")
        return json.loads(line)

    def _ask(self, **command):
        self.child.stdin.write(json.dumps(command) + "\n")
        self.child.stdin.flush()
        return self._answer()

    def translate(self, texts: list[str], beam: int) -> tuple[float, list[str]]:
        """(seconds, translations) of one call with all of `texts`."""
        answer = self._ask(op="pass", texts=texts, beam=beam)
        return answer["seconds"], answer["outputs"]

    def concurrency(self, texts: list[str]) -> dict:
        return self._ask(op="concurrency", texts=texts)

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait()


def measure(engines: dict, texts: list[str], runs: int) -> dict:
    """Passes and batch-1 latencies of every engine. The passes are interleaved (each pass of
    one engine is followed by the same pass of the others), so a machine whose speed drifts
    (other tenants) shifts every engine alike rather than the one measured during the slow
    minutes. Before each engine's turn the machine idles a moment: CTranslate2's OpenMP
    threads and TensorFlow's thread pools spin a while after their work, which would
    otherwise take the next engine's cores."""
    results = {name: {1: {"seconds": []}, 4: {"seconds": []}, "latency": []} for name in engines}
    for beam in (1, 4):
        for name, engine in engines.items():  # warm-up: tracing, XLA compilations
            results[name][beam]["outputs"] = engine.translate(texts, beam)[1]
        for _ in range(runs):
            for name, engine in engines.items():
                time.sleep(IDLE_SECONDS)
                results[name][beam]["seconds"].append(engine.translate(texts, beam)[0])
    for name, engine in engines.items():
        time.sleep(IDLE_SECONDS)
        for text in texts[:5]:
            engine.translate([text], 4)
        for text in texts[:LATENCY_SENTENCES]:
            results[name]["latency"].append(engine.translate([text], 4)[0])
    return results


def matmul_weight_inputs(saved_model: Path) -> dict[str, int]:
    """How the second input of each 2-D MatMul in `saved_model`'s graph is made, counted.

    `TF_ONEDNN_ASSUME_FROZEN_WEIGHTS=1` makes oneDNN's MatMul kernels (not BatchMatMul's)
    reuse the reordered second input of their first call: right only if that input is a
    weight. Each is followed back through views (Reshape, Identity, ConcatV2, Transpose) to a
    variable read, or to a loop argument named after the captured tensor it carries.
    """
    from tensorflow.core.protobuf import saved_model_pb2  # noqa: PLC0415 (TF after flags)

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((saved_model / "saved_model.pb").read_bytes())
    counts: dict[str, int] = {}
    for function in proto.meta_graphs[0].graph_def.library.function:
        nodes = {node.name: node for node in function.node_def}
        for node in function.node_def:
            if node.op != "MatMul":
                continue
            name, origin = node.input[1].split(":")[0], "other"
            while name in nodes:
                source = nodes[name]
                if source.op == "ReadVariableOp":
                    origin = "variable"
                    break
                if source.op not in ("Reshape", "Identity", "ConcatV2", "Transpose"):
                    origin = source.op
                    break
                name = source.input[0].split(":")[0]
            else:
                is_weight = any(word in name for word in ("readvariableop", "reshape", "concat",
                                                          "transpose"))
                origin = "loop argument from a variable" if is_weight else f"argument {name}"
            counts[origin] = counts.get(origin, 0) + 1
    return counts


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
    parser.add_argument("--frozen-weights", action="store_true",
                        help="also the SavedModel in a process with "
                             f"{FROZEN_WEIGHTS}=1 (oneDNN caches its reordered weights)")
    parser.add_argument("--baseline", metavar="SAVED_MODEL",
                        help="also this SavedModel (e.g. one exported by an older version of "
                             "the code: an A/B in the same run)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (its `cases`) as the last line")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import sentencepiece as spm

    from keras_transformer import run_directory
    from keras_transformer.decoding.scoring import score_translations
    from keras_transformer.serving.ctranslate2 import export_ctranslate2
    from keras_transformer.serving.saved_model import export_saved_model
    from pipelines.corpora import load_corpus

    corpus = load_corpus(args.data, args.split, args.src, args.tgt)
    texts, references = list(corpus.sources), list(corpus.targets)
    model, tokenizer = run_directory.load_run(args.model)
    processor = spm.SentencePieceProcessor(model_proto=tokenizer.model_proto)
    engines = {}
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        try:
            saved = export_saved_model(model, tokenizer, folder / "saved", chunk_size=BATCH)
            engines["savedmodel"] = Engine(SAVED_MODEL_LOAD, str(saved))
            if args.frozen_weights:
                print(f"MatMul weight inputs in the export: {matmul_weight_inputs(saved)}")
                engines["savedmodel_frozen"] = Engine(SAVED_MODEL_LOAD, str(saved),
                                                      env={FROZEN_WEIGHTS: "1"})
            if args.baseline:
                engines["baseline"] = Engine(SAVED_MODEL_LOAD, args.baseline)
            if args.xla:
                xla = export_saved_model(model, tokenizer, folder / "xla", chunk_size=BATCH,
                                         jit_compile=True)
                engines["savedmodel_xla"] = Engine(SAVED_MODEL_LOAD, str(xla))
            ct2 = export_ctranslate2(model, tokenizer, folder / "ct2")
            for compute_type in ("float32", "int8"):
                engines[f"ct2_{compute_type}"] = Engine(CTRANSLATE2_LOAD, str(ct2), compute_type)
            results = measure(engines, texts, args.runs)
            concurrency = engines["savedmodel"].concurrency(texts)
        finally:
            for engine in engines.values():
                engine.close()
    cases = []
    for engine, result in results.items():
        for beam in (1, 4):
            outputs = result[beam]["outputs"]
            median = statistics.median(result[beam]["seconds"])
            tokens = sum(len(processor.encode(text)) + 1 for text in outputs)
            case = {
                "engine": engine, "beam": beam,
                "target_tokens_per_s": round(tokens / median, 1),
                "sentences_per_s": round(len(texts) / median, 1),
                "bleu": round(score_translations(outputs, references)["bleu"], 2),
                "same_as_savedmodel": sum(a == b for a, b in zip(
                    outputs, results["savedmodel"][beam]["outputs"], strict=True)),
                "seconds": [round(s, 2) for s in result[beam]["seconds"]],
            }
            if beam == 4:
                case["latency_p50_ms"] = round(1000 * statistics.median(result["latency"]), 1)
                case["latency_p90_ms"] = round(1000 * _percentile(result["latency"], 0.9), 1)
            cases.append(case)
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
