"""Training throughput against the machine's own matmul peak (issue 6).

Prints one JSON object: the measured fp32 and bf16 matmul FLOP/s, then for each case the
median step time, target tokens/s and model FLOP utilisation (MFU) = analytic train-step
FLOPs / step time / matmul peak of the same precision. FLOP formula: benchmarks/flops.py.

    python benchmarks/train_throughput.py                       # small, 64 x 32 x 32, bf16 + fp32
    python benchmarks/train_throughput.py --preset base --lengths 16 32 64 --precision mixed_bfloat16
    python benchmarks/train_throughput.py --real-data ../shared/data/multi30k   # + Multi30k
    python benchmarks/train_throughput.py --precision mixed_bfloat16 --accumulate 4   # + issue 14

Training uses the fused CPU kernels unless KERAS_TRANSFORMER_FUSED_KERNELS=off (each case
reports `fused_kernels`); `benchmarks/fused_kernels_ab.py` compares the two in one process.

With `--real-data`, also trains on Multi30k train (de->en) through the real pipeline (in-graph
tokenizer, bucketed batches of 4,096 tokens): after `--real-warmup` steps (every new batch
shape is traced), `--real-steps` timed steps; reports real (non-PAD) and padded target
tokens/s, the padding efficiency of those batches, and MFU over their padded shapes.

With `--accumulate N`, also compares, in the same process and interleaved round by round,
one optimizer step on one batch of N x `--batch` sentences against the same step accumulated
over N micro-batches of `--batch` sentences (`TransformerTrainer.compile(accumulate_steps=N)`):
target tokens/s of each (median over rounds) and their ratio.
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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.flops import train_step_flops  # noqa: E402
from keras_transformer.kernels import fused_kernels  # noqa: E402
from keras_transformer.model.config import transformer_config  # noqa: E402
from keras_transformer.training.losses import LabelSmoothedCrossEntropy  # noqa: E402
from keras_transformer.training.optimizer import paper_adam  # noqa: E402
from keras_transformer.training.trainer_model import build_trainer  # noqa: E402


def matmul_peak(dtype: str, size: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a size x size matmul through TensorFlow (median of `repeats`)."""
    a = tf.random.normal((size, size), dtype=tf.float32)
    a = tf.cast(a, dtype)
    b = tf.cast(tf.random.normal((size, size)), dtype)
    step = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[:1, :1], tf.float32)))
    step(a, b).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(a, b).numpy()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def _compiled_model(preset: str, precision: str, vocab_size: int, jit_compile: bool,
                    accumulate_steps: int = 1):
    """A freshly initialised model (seed 0), compiled with the paper's Adam and loss."""
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(0)
    config = transformer_config(preset, vocab_size=vocab_size)
    model = build_trainer(preset, vocab_size=vocab_size)
    model.compile(optimizer=paper_adam(config.d_model), loss=LabelSmoothedCrossEntropy(0.1),
                  jit_compile=jit_compile, accumulate_steps=accumulate_steps)
    return model, config


def _synthetic_batch(batch: int, length: int, vocab_size: int, seed: int,
                     target_length: int | None = None):
    """Random (features, labels) of `batch` pairs, labels = the target shifted left."""
    rng = np.random.default_rng(seed)
    source = rng.integers(4, vocab_size, (batch, length), dtype=np.int32)
    target = rng.integers(4, vocab_size, (batch, target_length or length), dtype=np.int32)
    return ({"source": tf.constant(source), "target": tf.constant(target)},
            tf.constant(np.roll(target, -1, axis=1)))


def accumulation_case(preset: str, precision: str, batch: int, length: int, accumulate: int,
                      vocab_size: int, rounds: int, steps: int, warmup: int) -> dict:
    """Optimizer steps of `accumulate` x `batch` sentences: one batch vs accumulated."""
    whole_model, _ = _compiled_model(preset, precision, vocab_size, False)
    micro_model, _ = _compiled_model(preset, precision, vocab_size, False, accumulate)
    micro = [_synthetic_batch(batch, length, vocab_size, seed) for seed in range(accumulate)]
    whole = (
        {k: tf.concat([m[0][k] for m in micro], axis=0) for k in ("source", "target")},
        tf.concat([m[1] for m in micro], axis=0),
    )

    def one_batch_step():
        whole_model.train_on_batch(*whole)

    def accumulated_step():
        for features, labels in micro:
            micro_model.train_on_batch(features, labels)

    for _ in range(warmup):
        one_batch_step()
        accumulated_step()
    times = {"one_batch": [], "accumulated": []}
    for _ in range(rounds):  # interleaved, so that both see the same machine state
        for name, step in (("one_batch", one_batch_step), ("accumulated", accumulated_step)):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps)
    assert int(micro_model.optimizer.iterations) == int(whole_model.optimizer.iterations)
    keras.mixed_precision.set_global_policy("float32")
    tokens = accumulate * batch * length
    rates = {name: tokens / statistics.median(seconds) for name, seconds in times.items()}
    return {
        "case": "accumulation", "preset": preset, "precision": precision,
        "step": f"{accumulate} x {batch} sentences x {length} tokens", "rounds": rounds,
        "one_batch_target_tokens_per_s": round(rates["one_batch"], 1),
        "accumulated_target_tokens_per_s": round(rates["accumulated"], 1),
        "accumulated_over_one_batch": round(rates["accumulated"] / rates["one_batch"], 3),
    }


def train_case(preset: str, precision: str, batch: int, source_length: int, target_length: int,
               vocab_size: int, steps: int, warmup: int, jit_compile: bool) -> dict:
    """Median step time of `model.train_on_batch` on fixed-shape synthetic data."""
    model, config = _compiled_model(preset, precision, vocab_size, jit_compile)
    inputs, labels = _synthetic_batch(batch, source_length, vocab_size, seed=0,
                                      target_length=target_length)
    for _ in range(warmup):
        model.train_on_batch(inputs, labels)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(inputs, labels)
        times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    flops = train_step_flops(batch, source_length, target_length, config.num_layers,
                             config.d_model, config.d_ff, vocab_size)
    keras.mixed_precision.set_global_policy("float32")
    return {
        "preset": preset, "precision": precision, "jit_compile": jit_compile,
        "fused_kernels": fused_kernels() is not None and not jit_compile, "batch": batch,
        "source_length": source_length, "target_length": target_length,
        "step_time_s": round(step_time, 4),
        "target_tokens_per_s": round(batch * target_length / step_time, 1),
        "step_gflop": round(flops / 1e9, 2),
        "achieved_gflops": round(flops / step_time / 1e9, 1),
    }


def real_data_case(data: str, preset: str, precision: str, vocab_size: int, warmup: int,
                   steps: int, work_dir: Path) -> dict:
    """Train steps on Multi30k de->en batches from the training pipeline (see module doc)."""
    from pipelines.batching import make_batches
    from pipelines.corpora import load_corpus
    from pipelines.tokenizer import train_or_load_tokenizer

    # The model first: seeding (keras.utils.set_random_seed) clears TF's kernel cache, which
    # would drop the sentencepiece resource of a tokenizer created before it.
    model, config = _compiled_model(preset, precision, vocab_size, jit_compile=False)
    corpus = load_corpus(data, "train", "de", "en")
    tokenizer = train_or_load_tokenizer(corpus, work_dir / f"tokenizer-de-en-{vocab_size}",
                                        vocab_size=vocab_size)
    batches = make_batches(corpus, tokenizer, tokens_per_batch=4096, shuffle=True, repeat=True)
    iterator = iter(batches)
    for _ in range(warmup):
        model.train_on_batch(*next(iterator))
    timed = [next(iterator) for _ in range(steps)]  # fetched first: time the steps alone
    start = time.perf_counter()
    for features, labels in timed:
        model.train_on_batch(features, labels)
    seconds = time.perf_counter() - start
    keras.mixed_precision.set_global_policy("float32")

    real = slots = target_real = target_slots = flops = 0
    for features, _ in timed:
        source, target = features["source"].numpy(), features["target"].numpy()
        real += np.count_nonzero(source) + np.count_nonzero(target)
        slots += source.size + target.size
        target_real += np.count_nonzero(target)
        target_slots += target.size
        flops += train_step_flops(*target.shape[:1], source.shape[1], target.shape[1],
                                  config.num_layers, config.d_model, config.d_ff, vocab_size)
    return {
        "preset": preset, "precision": precision, "data": "multi30k train de-en",
        "tokens_per_batch": 4096, "steps": steps, "step_time_s": round(seconds / steps, 4),
        "target_tokens_per_s": round(target_real / seconds, 1),
        "padded_target_tokens_per_s": round(target_slots / seconds, 1),
        "padding_efficiency": round(real / slots, 3),
        "achieved_gflops": round(flops / seconds / 1e9, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--precision", nargs="+", default=["mixed_bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32],
                        help="source = target lengths to measure")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument("--accumulate", type=int, default=0,
                        help="also compare N accumulated micro-batches with one batch of N x "
                        "--batch sentences (at the first of --lengths)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (accumulate)")
    parser.add_argument("--real-data", help="Multi30k folder: also measure the real pipeline")
    parser.add_argument("--real-warmup", type=int, default=60)
    parser.add_argument("--real-steps", type=int, default=100)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "kt_bench"))
    args = parser.parse_args()

    peaks = {"float32": matmul_peak("float32"), "mixed_bfloat16": matmul_peak("bfloat16")}
    cases = []
    for precision in args.precision:
        for length in args.lengths:
            case = train_case(args.preset, precision, args.batch, length, length,
                              args.vocab_size, args.steps, args.warmup, args.jit_compile)
            case["mfu"] = round(case["achieved_gflops"] * 1e9 / peaks[precision], 3)
            cases.append(case)
            print(json.dumps(case), file=sys.stderr)
        if args.accumulate > 1:
            case = accumulation_case(args.preset, precision, args.batch, args.lengths[0],
                                     args.accumulate, args.vocab_size, args.rounds,
                                     max(1, args.steps // 4), args.warmup)
            cases.append(case)
            print(json.dumps(case), file=sys.stderr)
        if args.real_data:
            case = real_data_case(args.real_data, args.preset, precision, args.vocab_size,
                                  args.real_warmup, args.real_steps, Path(args.work_dir))
            case["mfu"] = round(case["achieved_gflops"] * 1e9 / peaks[precision], 3)
            cases.append(case)
            print(json.dumps(case), file=sys.stderr)
    print(json.dumps({
        "matmul_gflops": {"float32": round(peaks["float32"] / 1e9, 1),
                          "bfloat16": round(peaks["mixed_bfloat16"] / 1e9, 1)},
        "cases": cases,
    }, indent=2))


if __name__ == "__main__":
    main()
