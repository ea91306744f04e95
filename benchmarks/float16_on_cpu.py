"""mixed_float16 on a CPU whose TensorFlow sends float16 ops to oneDNN (Intel Xeons since
Sapphire Rapids): the fused float16 MatMul + BiasAdd against the plain MatMul, and the `tiny`
trainer's step with TensorFlow's graph remapper on and off (`training.precision
.float16_on_this_cpu`, which `TransformerTrainer.fit` applies), float32 as the reference.

Prints one JSON object: whether this CPU sends float16 to oneDNN, the matmul medians (ms) of
`--calls` calls each, and per trainer case the median step time (ms) over `--rounds`
interleaved rounds of `--steps` steps. On CPUs without AVX512_FP16/AMX_FP16/AVX_NE_CONVERT
the two float16 cases are the same program.

    python benchmarks/float16_on_cpu.py
    python benchmarks/float16_on_cpu.py --rounds 5 --steps 10
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

from keras_transformer.training import precision  # noqa: E402
from keras_transformer.training.losses import LabelSmoothedCrossEntropy  # noqa: E402
from keras_transformer.training.trainer_model import build_trainer  # noqa: E402

MATMULS = ((512, 32, 64), (64, 64, 64), (2048, 256, 256))


def median_ms(function, calls: int) -> float:
    function()  # traced and optimized by grappler on the first call
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        function()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def matmuls(calls: int) -> list[dict]:
    rows = []
    for m, k, n in MATMULS:
        x = tf.cast(tf.random.normal([m, k]), tf.float16)
        w = tf.cast(tf.random.normal([k, n]), tf.float16)
        b = tf.cast(tf.random.normal([n]), tf.float16)
        plain = tf.function(lambda x=x, w=w: tf.matmul(x, w))
        fused = tf.function(lambda x=x, w=w, b=b: tf.nn.bias_add(tf.matmul(x, w), b))
        rows.append({"shape": f"{m}x{k}x{n}", "matmul_ms": median_ms(plain, calls),
                     "matmul_bias_add_ms": median_ms(fused, calls)})
    return rows


class _Case:
    """A compiled tiny trainer; `remap_guard` False fits it as if the CPU had no float16
    oneDNN path (so the remapper stays on)."""

    def __init__(self, policy: str, remap_guard: bool, batch: int, length: int):
        off = (remap_guard and policy == "mixed_float16"
               and precision.cpu_sends_float16_to_onednn())
        self.name = f"{policy}, remapper {'off' if off else 'on'}"
        self.remap_guard = remap_guard
        keras.utils.set_random_seed(0)
        self.model = build_trainer("tiny", vocab_size=300, dtype=policy)
        self.model.compile("adam", loss=LabelSmoothedCrossEntropy(0.1))
        rng = np.random.default_rng(0)
        ids = rng.integers(4, 300, size=(batch, length + 1)).astype("int32")
        self.data = tf.data.Dataset.from_tensors(
            ({"source": ids[:, 1:], "target": ids[:, :-1]}, ids[:, 1:])).repeat()

    def fit(self, steps: int) -> float:
        real = precision.cpu_flags
        if not self.remap_guard:
            precision.cpu_flags = lambda cpuinfo="/proc/cpuinfo": set()
        try:
            started = time.perf_counter()
            self.model.fit(self.data, steps_per_epoch=steps, epochs=1, verbose=0)
            return (time.perf_counter() - started) * 1e3 / steps
        finally:
            precision.cpu_flags = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10, help="timed calls per matmul")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=16)
    args = parser.parse_args()

    cases = [_Case("float32", True, args.batch, args.length),
             _Case("mixed_float16", False, args.batch, args.length),
             _Case("mixed_float16", True, args.batch, args.length)]
    for case in cases:  # traces and optimizes each train function under its own setting
        case.fit(args.steps)
    times = {case.name: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            times[case.name].append(case.fit(args.steps))
    print(json.dumps({
        "cpu_sends_float16_to_onednn": precision.cpu_sends_float16_to_onednn(),
        "tensorflow": tf.__version__,
        "float16_matmuls_remapper_on": matmuls(args.calls),
        "tiny_step_ms": {name: {"median": statistics.median(values),
                                "rounds": [round(value, 1) for value in values]}
                         for name, values in times.items()},
        "batch": [args.batch, args.length], "steps_per_round": args.steps,
    }, indent=1))


if __name__ == "__main__":
    main()
