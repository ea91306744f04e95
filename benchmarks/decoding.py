"""Decoding speed: cached vs uncached beam search, greedy, and a fixed-shape case.

    python benchmarks/decoding.py [--model RUN_DIR] [--data ../shared/data/multi30k]

1. Multi30k test_2016_flickr (de->en by default), sorted by length, in batches: beam 4 with
   the key/value cache, beam 4 without it (re-running the decoder over the prefix; on a
   subset, `--uncached-sentences`, with the cached search timed on the same subset), greedy.
   Without `--model`, an untrained `small` model and a tokenizer trained on the train split
   stand in (timing only: an untrained model rarely emits EOS, so outputs run to the length
   limit, source + 50).
2. Per-token cost against output length: cached beam forced to 8..64 tokens.
3. Fixed shape: `small` preset (vocab 8000), 1,000 random sources of 16 tokens, batch 32, every
   hypothesis forced to exactly 20 tokens; beam 4 and greedy, with and without the XLA step.

Throughput counts generated target tokens of the returned hypotheses (EOS included). Each
figure is the median (and min) over `--runs` passes, variants interleaved so that load from
other processes spreads over all of them. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_transformer.decoding.search import beam_search, encode_texts, greedy_search  # noqa: E402
from keras_transformer.model.transformer import build_transformer  # noqa: E402


def _timed(run, runs: int) -> dict:
    """Calls run() (returning tokens, sentences) `runs` times; throughput statistics."""
    seconds, tokens, sentences = [], 0, 0
    for _ in range(runs):
        started = time.perf_counter()
        tokens, sentences = run()
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    return {
        "seconds_median": round(median, 3), "seconds_min": round(min(seconds), 3),
        "tokens": tokens, "sentences": sentences,
        "tokens_per_s": round(tokens / median, 1),
        "tokens_per_s_best": round(tokens / min(seconds), 1),
        "sentences_per_s": round(sentences / median, 2),
    }


def _decode_all(search, batches, **options) -> tuple[int, int]:
    """One pass of `search(model, batch, **options)` over `batches`: (tokens, sentences)."""
    tokens = sentences = 0
    for batch in batches:
        ids, _ = search(batch, **options)
        tokens += int(tf.math.count_nonzero(ids))
        sentences += int(batch.shape[0])
    return tokens, sentences


def _interleaved(variants: dict, runs: int) -> dict:
    """Times each variant once per round, `runs` rounds, after one warm-up pass each."""
    for name, run in variants.items():
        run()  # traces (and with XLA compiles) every batch shape
        print(f"{name}: warmed up", file=sys.stderr, flush=True)
    results = {name: [] for name in variants}
    for round_number in range(runs):
        for name, run in variants.items():
            results[name].append(_timed(run, 1))
            print(f"{name} round {round_number + 1}/{runs}: "
                  f"{results[name][-1]['seconds_median']} s", file=sys.stderr, flush=True)
    summary = {}
    for name, rounds in results.items():
        seconds = [r["seconds_median"] for r in rounds]
        tokens, sentences = rounds[0]["tokens"], rounds[0]["sentences"]
        median = statistics.median(seconds)
        summary[name] = {
            "runs": len(seconds), "seconds_median": round(median, 3),
            "seconds_min": round(min(seconds), 3), "tokens": tokens, "sentences": sentences,
            "tokens_per_s": round(tokens / median, 1),
            "tokens_per_s_best": round(tokens / min(seconds), 1),
            "sentences_per_s": round(sentences / median, 2),
        }
    return summary


def _model_and_tokenizer(args):
    if args.model:
        from keras_transformer.run_directory import load_run

        return (*load_run(args.model), f"trained model {args.model}")
    from pipelines.corpora import load_corpus
    from pipelines.tokenizer import train_or_load_tokenizer

    train = load_corpus(args.data, "train", args.src, args.tgt)
    directory = Path(args.work_dir) / f"tokenizer-{args.src}-{args.tgt}-8000"
    tokenizer = train_or_load_tokenizer(train, directory, vocab_size=8000)
    model = build_transformer("small", vocab_size=tokenizer.vocab_size)
    return model, tokenizer, "untrained small model (timing only)"


def multi30k(args) -> dict:
    from pipelines.corpora import load_corpus

    model, tokenizer, description = _model_and_tokenizer(args)
    test = load_corpus(args.data, "test_2016_flickr", args.src, args.tgt)
    sources = encode_texts(tokenizer, test.sources[: args.sentences])
    order = np.argsort(-sources.row_lengths().numpy(), kind="stable")

    def batches(rows):
        return [tf.gather(sources, rows[i: i + args.batch_size]).to_tensor()
                for i in range(0, len(rows), args.batch_size)]

    everything = batches(order)
    # The uncached subset spreads over all lengths: every k-th sentence of the sorted order.
    step = max(len(order) // args.uncached_sentences, 1)
    subset = batches(order[::step][: args.uncached_sentences])

    beam = partial(beam_search, model, beam_size=4)
    greedy = partial(greedy_search, model)
    results = _interleaved({
        "beam4_cached": partial(_decode_all, beam, everything),
        "greedy_cached": partial(_decode_all, greedy, everything),
    }, args.runs)
    subset_results = _interleaved({
        "beam4_cached_subset": partial(_decode_all, beam, subset),
        "beam4_uncached_subset": partial(_decode_all, beam, subset, use_cache=False),
    }, args.runs)
    results.update(subset_results)
    results["cached_speedup_over_uncached"] = round(
        subset_results["beam4_cached_subset"]["tokens_per_s"]
        / subset_results["beam4_uncached_subset"]["tokens_per_s"], 2)
    results["model"] = description
    results["batch_size"] = args.batch_size
    return results


def per_token_cost(model, runs: int) -> dict:
    """Milliseconds per decoding step (batch 32, beam 4) as the forced output length grows."""
    rng = np.random.default_rng(1)
    batch = tf.constant(rng.integers(4, 8000, size=(32, 16)), tf.int32)
    costs = {}
    for length in (8, 16, 32, 64):
        search = partial(_decode_all, partial(beam_search, model), [batch], force_length=length)
        timing = _interleaved({"run": search}, runs)["run"]
        costs[str(length)] = round(1000 * timing["seconds_median"] / length, 2)
    return {"ms_per_step_by_output_length": costs}


def fixed_shape(model, args) -> dict:
    """Beam 4 and greedy, float32 with and without the XLA step (and mixed_bfloat16)."""
    rng = np.random.default_rng(0)
    sources = rng.integers(4, 8000, size=(1000, 16)).astype("int32")
    batches = [tf.constant(sources[i: i + 32]) for i in range(0, 1000, 32)]
    variants = {}
    for jit in (False, True):
        suffix = "_xla" if jit else ""
        for name, search in (("beam4", beam_search), ("greedy", greedy_search)):
            variants[name + suffix] = partial(_decode_all, partial(search, model), batches,
                                              force_length=20, jit_compile=jit)
    if args.bf16:
        bf16 = build_transformer("small", vocab_size=8000, dtype="mixed_bfloat16")
        bf16.set_weights(model.get_weights())
        for name, search in (("beam4", beam_search), ("greedy", greedy_search)):
            variants[name + "_bf16"] = partial(_decode_all, partial(search, bf16), batches,
                                               force_length=20)
    return _interleaved(variants, args.runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="run directory of a trained model")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--uncached-sentences", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--parts", default="multi30k,per_token,fixed",
                        help="comma-separated subset of multi30k,per_token,fixed")
    parser.add_argument("--bf16", action="store_true",
                        help="fixed shape: also time a mixed_bfloat16 copy of the model")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "kt_bench"))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    report = {"tensorflow": tf.__version__, "cpus": os.cpu_count(),
              "load_average_start": os.getloadavg()}
    if "multi30k" in parts:
        report["multi30k"] = multi30k(args)
    small = build_transformer("small", vocab_size=8000)
    if "per_token" in parts:
        report["per_token"] = per_token_cost(small, args.runs)
    if "fixed" in parts:
        report["fixed_shape"] = fixed_shape(small, args)
    report["load_average_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
