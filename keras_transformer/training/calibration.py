"""How long one optimizer step takes on this machine, measured before a `--recipe auto` run
fixes its steps from a minutes budget (`keras_transformer.training.auto_plan`).

The step is the run's own: the model, precision, XLA choice, loss and Adam of
`training_loop.compiled_trainer`, on synthetic token ids shaped like the corpus's batches
(one length, the corpus's mean pair in pieces), `accumulate` micro-batches an update.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import numpy as np

from keras_transformer.training.step_budget import StepBudget
from keras_transformer.training.training_loop import compiled_trainer


def measure_step_seconds(model_settings: dict[str, Any], optimization, precision: str,
                         jit: bool, budget: StepBudget, pair_tokens: int, *,
                         warmup: int = 2, repeats: int = 4) -> float:
    """The median seconds of one optimizer step (all its micro-batches) on one replica.

    Args:
        model_settings: `TransformerConfig` fields (as config.json's "model" holds them).
        optimization: the run's `OptimizationConfig` (schedule, label smoothing).
        precision, jit: as the run resolved them.
        budget: the step's micro-batch tokens and accumulation.
        pair_tokens: the padded length of a typical pair, in pieces.
        warmup: micro-batches run first and not timed (tracing, XLA compilation).
        repeats: optimizer steps timed.
    """
    model = compiled_trainer({"model": model_settings}, optimization, precision, jit,
                             budget.accumulate)
    vocab = model_settings["vocab_size"]
    sentences = max(1, budget.micro_batch // pair_tokens)
    rng = np.random.default_rng(0)
    source = rng.integers(4, vocab, (sentences, pair_tokens), dtype=np.int32)
    target = rng.integers(4, vocab, (sentences, pair_tokens), dtype=np.int32)
    features, labels = {"source": source, "target": target}, np.roll(target, -1, axis=1)
    for _ in range(warmup):
        model.train_on_batch(features, labels)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(budget.accumulate):
            model.train_on_batch(features, labels)
        seconds.append(time.perf_counter() - start)
    del model
    gc.collect()
    return statistics.median(seconds)
