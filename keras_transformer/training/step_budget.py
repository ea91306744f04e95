"""One optimizer step's token budget over devices and micro-batches (paper 5.1: "Each training
batch contained a set of sentence pairs containing approximately 25000 source tokens and 25000
target tokens", on 8 GPUs).

`keras_transformer.training.config.BatchConfig.budget` computes it from the flags and the
devices at hand; training and the dry run's plan read it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepBudget:
    """How one optimizer step's tokens are spread: on each of `replicas` devices,
    `accumulate` micro-batches of at most `micro_batch` tokens each (5.1: ~25,000 source and
    25,000 target tokens a step, over 8 GPUs)."""

    micro_batch: int
    replicas: int
    accumulate: int

    @property
    def tokens_per_step(self) -> int:
        """The step's token budget over all replicas and micro-batches."""
        return self.micro_batch * self.replicas * self.accumulate

    @property
    def global_micro_batch(self) -> int:
        """One micro-step's budget over all replicas: the global `tokens_per_batch` that
        `pipelines.batching` splits over replicas."""
        return self.micro_batch * self.replicas

    def describe(self) -> str:
        return (f"{self.replicas} replica(s) x {self.accumulate} micro-batch(es) of <= "
                f"{self.micro_batch} tokens = {self.tokens_per_step} tokens per step")
