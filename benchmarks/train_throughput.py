"""Training throughput against the machine's own matmul peak (issue 6).

Prints one JSON object: the measured fp32 and bf16 matmul FLOP/s, then for each case the
median step time, target tokens/s and model FLOP utilisation (MFU) = analytic train-step
FLOPs / step time / matmul peak of the same precision. FLOP formula: benchmarks/flops.py.

    python benchmarks/train_throughput.py                       # small, 64 x 32 x 32, bf16 + fp32
    python benchmarks/train_throughput.py --preset base --lengths 16 32 64 --precision mixed_bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.flops import train_step_flops  # noqa: E402
from keras_transformer.losses import LabelSmoothedCrossEntropy  # noqa: E402
from keras_transformer.model import build_transformer, transformer_config  # noqa: E402
from keras_transformer.schedule import paper_adam  # noqa: E402


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


def train_case(preset: str, precision: str, batch: int, source_length: int, target_length: int,
               vocab_size: int, steps: int, warmup: int, jit_compile: bool) -> dict:
    """Median step time of `model.train_on_batch` on fixed-shape synthetic data."""
    keras.mixed_precision.set_global_policy(precision)
    keras.utils.set_random_seed(0)
    config = transformer_config(preset, vocab_size=vocab_size)
    model = build_transformer(preset, vocab_size=vocab_size)
    model.compile(optimizer=paper_adam(config.d_model), loss=LabelSmoothedCrossEntropy(0.1),
                  jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    source = rng.integers(4, vocab_size, (batch, source_length), dtype=np.int32)
    target = rng.integers(4, vocab_size, (batch, target_length), dtype=np.int32)
    labels = np.roll(target, -1, axis=1)
    inputs = {"source": tf.constant(source), "target": tf.constant(target)}
    labels = tf.constant(labels)
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
        "preset": preset, "precision": precision, "jit_compile": jit_compile, "batch": batch,
        "source_length": source_length, "target_length": target_length,
        "step_time_s": round(step_time, 4),
        "target_tokens_per_s": round(batch * target_length / step_time, 1),
        "step_gflop": round(flops / 1e9, 2),
        "achieved_gflops": round(flops / step_time / 1e9, 1),
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
    print(json.dumps({
        "matmul_gflops": {"float32": round(peaks["float32"] / 1e9, 1),
                          "bfloat16": round(peaks["mixed_bfloat16"] / 1e9, 1)},
        "cases": cases,
    }, indent=2))


if __name__ == "__main__":
    main()
