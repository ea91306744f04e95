"""Dropout's masks under Keras' JAX backend: keras' own `Dropout` (`jax.random.bernoulli`: a
Threefry-2x32 block per element) against ours (`keras_transformer.layers.Dropout`: four
16-bit draws per block), each forward and backward in one XLA-compiled function.

Prints one JSON object: the device, and per layer the median over `--rounds` interleaved
rounds of a round's mean time per call (ms, `--calls` calls a round), with the elements per second. The default shape is one
sub-layer output of the paper's ~25k-token step (25,600 tokens x d_model 512, bfloat16); a
`base` training step draws about 30 such masks, a `big` one 30 of twice the width.

    python benchmarks/dropout_masks.py                      # on JAX's default device
    python benchmarks/dropout_masks.py --tokens 4096 --rounds 3   # a quick look on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it once, at its import
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402

from keras_transformer.layers.dropout import Dropout  # noqa: E402


def compiled_step(layer):
    """jit((inputs, cotangent, seed state) -> (gradient, next seed state)): the layer's
    dropout forward and its backward (the gradient is the mask times the cotangent), with the
    seed generator's state threaded through as a training step threads it."""
    state = layer.seed_generator.state

    def step(inputs, cotangent, seed_state):
        with keras.StatelessScope(state_mapping=[(state, seed_state)]) as scope:
            outputs, backward = jax.vjp(lambda x: layer(x, training=True), inputs)
            (gradient,) = backward(cotangent)
        return gradient, scope.get_current_value(state)

    return jax.jit(step)


def round_ms(step, inputs, cotangent, seed_state, calls: int) -> tuple[float, object]:
    """(mean ms per call over `calls` calls, the seed state after them): one round."""
    start = time.perf_counter()
    for _ in range(calls):
        gradient, seed_state = step(inputs, cotangent, seed_state)
    gradient.block_until_ready()
    return (time.perf_counter() - start) / calls * 1e3, seed_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=25_600)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rate", type=float, default=0.1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    layers = {"keras": keras.layers.Dropout(args.rate, seed=0, dtype=args.dtype),
              "ours_16_bit": Dropout(args.rate, seed=0, dtype=args.dtype)}
    inputs = jax.random.normal(jax.random.PRNGKey(1), (args.tokens, args.width), args.dtype)
    cotangent = jnp.ones_like(inputs)
    cases = {}
    for name, layer in layers.items():
        layer.build(inputs.shape)
        step = compiled_step(layer)
        seed_state = layer.seed_generator.state.value
        gradient, seed_state = step(inputs, cotangent, seed_state)  # compiled here
        kept = float(jnp.mean(gradient != 0))
        cases[name] = {"step": step, "seed_state": seed_state, "kept_fraction": kept,
                       "ms": []}
    for _ in range(args.rounds):  # interleaved: drift hits both alike
        for case in cases.values():
            ms, case["seed_state"] = round_ms(case["step"], inputs, cotangent,
                                               case["seed_state"], args.calls)
            case["ms"].append(ms)
    elements = args.tokens * args.width
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__,
              "shape": [args.tokens, args.width], "dtype": args.dtype, "rate": args.rate,
              "calls": args.calls, "rounds": args.rounds}
    for name, case in cases.items():
        median = statistics.median(case["ms"])
        report[name] = {"median_ms": round(median, 4), "rounds_ms": [round(v, 4) for v in
                                                                     case["ms"]],
                        "elements_per_second": round(elements / median * 1e3),
                        "kept_fraction": round(case["kept_fraction"], 5)}
    report["speedup"] = round(report["keras"]["median_ms"] / report["ours_16_bit"]["median_ms"],
                              3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
