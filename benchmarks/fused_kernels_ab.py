"""Training step with and without the fused CPU kernels, measured in one process (issue 6).

Builds the same model twice (seed 0), once tracing its train step with
`KERAS_TRANSFORMER_FUSED_KERNELS=off` (TensorFlow ops) and once with `on`, then alternates
their `train_on_batch` steps for `--rounds` rounds: both variants see the same machine state,
which on a shared 2-core machine drifts by more than the effects measured. Prints JSON with
the median step time of each and their ratio.

    python benchmarks/fused_kernels_ab.py --rounds 25
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

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.train_throughput import _compiled_model  # noqa: E402
from keras_transformer.kernels import MODE_VARIABLE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=32, help="source = target length")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shape = (args.batch, args.length)
    target = rng.integers(4, args.vocab_size, shape, dtype=np.int32)
    inputs = {"source": tf.constant(rng.integers(4, args.vocab_size, shape, dtype=np.int32)),
              "target": tf.constant(target)}
    labels = tf.constant(np.roll(target, -1, axis=1))
    models, first_loss = {}, {}
    for mode in ("off", "on"):
        os.environ[MODE_VARIABLE] = mode  # read when the train step is traced (first call)
        models[mode], _ = _compiled_model(args.preset, args.precision, args.vocab_size, False)
        first_loss[mode] = float(models[mode].train_on_batch(inputs, labels))
        for _ in range(args.warmup):
            models[mode].train_on_batch(inputs, labels)
    times = {mode: [] for mode in models}
    for _ in range(args.rounds):
        for mode, model in models.items():
            start = time.perf_counter()
            model.train_on_batch(inputs, labels)
            times[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    print(json.dumps({
        "preset": args.preset, "precision": args.precision, "batch": args.batch,
        "length": args.length, "rounds": args.rounds,
        "first_step_loss": first_loss,
        "median_step_s": {mode: round(value, 4) for mode, value in medians.items()},
        "target_tokens_per_s": {mode: round(args.batch * args.length / value, 1)
                                for mode, value in medians.items()},
        "on_over_off": round(medians["on"] / medians["off"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
