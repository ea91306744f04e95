"""The label-smoothed loss's gradient under JAX: written by hand (`keras_transformer/training/
losses_jax.py`) against JAX's autodiff of the same loss, on this machine's JAX device.

Three measurements, each alternating the two gradients:
- `loss`: the loss and its gradient alone (a jitted `value_and_grad` of the token losses'
  weighted sum over `--tokens` x `--vocab` logits), per logits dtype: medians of `--rounds`
  rounds of `--calls` calls.
- `buffers`: the (tokens, vocab)-sized buffers of the compiled `tiny` trainer step (with the
  run's metrics, vocabulary 997), counted in XLA's optimized HLO.
- `step`: the real trainer step of `--preset` (`benchmarks/accelerator_step.keras_step`, on
  synthetic tokens) with each loss, `--step-rounds` alternated rounds.

Usage (BENCHMARKS.md, "On JAX"):
    python benchmarks/loss_gradient.py --rounds 3 --calls 10 --step-rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.accelerator_step import (  # noqa: E402
    compiled_trainer,
    keras_step,
    trainer_state,
)
from keras_transformer.training.losses import (  # noqa: E402
    _portable_cross_entropy,
    token_cross_entropy,
)

GRADIENTS = {"closed_form": token_cross_entropy, "autodiff": _portable_cross_entropy}


def loss_timings(tokens: int, vocab: int, rounds: int, calls: int) -> dict:
    """Milliseconds per jitted `value_and_grad` of each gradient, per logits dtype."""
    rng = np.random.default_rng(0)
    labels = jnp.asarray(rng.integers(0, vocab, (tokens,)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens,)), jnp.float32)
    found = {}
    for dtype in ("float32", "bfloat16"):
        logits = jnp.asarray(rng.normal(size=(tokens, vocab)) * 3, dtype)
        steps = {name: jax.jit(jax.value_and_grad(
            lambda values, per_token=per_token: jnp.sum(
                per_token(labels, values.astype(jnp.float32), 0.1) * weights)))
            for name, per_token in GRADIENTS.items()}
        times = {name: [] for name in steps}
        for round_ in range(rounds):
            for name in (list(steps) if round_ % 2 == 0 else list(steps)[::-1]):
                jax.block_until_ready(steps[name](logits))
                start = time.perf_counter()
                for _ in range(calls):
                    result = steps[name](logits)
                jax.block_until_ready(result)
                times[name].append((time.perf_counter() - start) / calls * 1e3)
        found[dtype] = {name: {"median_ms": statistics.median(t), "ms": t}
                        for name, t in times.items()}
    return found


def step_buffers(vocab: int = 997) -> dict:
    """(tokens, vocab)-sized instructions in the compiled `tiny` train step's entry."""
    import keras

    from benchmarks.accelerator_step import synthetic_batch

    found = {}
    for name in GRADIENTS:
        keras.utils.set_random_seed(0)
        model = compiled_trainer("tiny", ["autodiffloss"] if name == "autodiff" else [],
                                 vocab, "mixed_bfloat16")
        features, labels = synthetic_batch(8, 12, 13, vocab)
        model.fit(features, labels, batch_size=8, epochs=1, verbose=0)  # builds the state
        text = jax.jit(model.train_step).lower(trainer_state(model),
                                               (features, labels)).compile().as_text()
        entry = text[text.index("\nENTRY"):]
        shapes = re.findall(rf"= (\w+)\[(?:8,13|104),{vocab}\]", entry)
        found[name] = {"buffers": len(shapes), "dtypes": shapes}
        keras.backend.clear_session()
    return found


def step_timings(preset: str, rounds: int) -> dict:
    """The trainer step of `preset` with each gradient (`+autodiffloss`), alternated."""
    settings = {"precision": "mixed_bfloat16", "window": 2, "steps": 6, "profile": ()}
    names = [preset, f"{preset}+autodiffloss"]
    times = {name: [] for name in names}
    for round_ in range(rounds):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            times[name].append(keras_step(name, settings)["step_seconds"] * 1e3)
    return {name: {"median_ms": statistics.median(t), "ms": t} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256 * 32)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--step-rounds", type=int, default=4, help="0: no step timing")
    args = parser.parse_args()
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__,
              "loss": loss_timings(args.tokens, args.vocab, args.rounds, args.calls),
              "buffers": step_buffers()}
    if args.step_rounds:
        report["step"] = step_timings(args.preset, args.step_rounds)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
