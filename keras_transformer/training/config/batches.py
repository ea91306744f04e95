"""`BatchConfig`: the tokens of a micro-batch and of an optimizer step (5.1: ~25,000 source
and ~25,000 target tokens a step, on any number of devices)."""

from __future__ import annotations

import dataclasses
import math

from keras_transformer.errors import UsageError
from keras_transformer.training.config.fields import positive, setting
from keras_transformer.training.step_budget import StepBudget


@dataclasses.dataclass
class BatchConfig:
    """The tokens of one micro-batch (per device) and of one optimizer step (global)."""

    tokens_per_batch: int = setting(
        4096, "PER REPLICA: most tokens in one micro-batch on one device (sentences x padded "
        "length, source or target, whichever is longer, as fairseq's --max-tokens counts): "
        "what must fit in a device's memory", positive)
    accumulate: int | None = setting(
        None, "micro-batches per optimizer step (gradient accumulation, fairseq's "
        "--update-freq); default 1, or what --tokens-per-step needs", positive)
    tokens_per_step: int | None = setting(
        None, "GLOBAL: tokens of one optimizer step over all replicas and micro-batches "
        "(paper: 25000). Sets --accumulate to ceil(this / (--tokens-per-batch x replicas)) and "
        "each micro-batch to this / (replicas x accumulate), so the same command makes the "
        "same step on 1 or 8 devices", positive)

    def check(self, max_length: int) -> None:
        """Raises `UsageError` if a longest pair could not fit, or both ways are given."""
        if self.tokens_per_batch < max_length:
            raise UsageError(f"--tokens-per-batch {self.tokens_per_batch} is below --max-length "
                             f"{max_length}: a longest pair would not fit in a micro-batch; "
                             f"the smallest valid value is {max_length}")
        if self.tokens_per_step is not None and self.accumulate is not None:
            raise UsageError("give --accumulate or --tokens-per-step, not both "
                             "(--tokens-per-step chooses the accumulation)")
        if self.tokens_per_step is not None and self.tokens_per_step < max_length:
            raise UsageError(f"--tokens-per-step {self.tokens_per_step} is below --max-length "
                             f"{max_length}: a longest pair would not fit in a step; the "
                             f"smallest valid value is {max_length} (on one replica)")

    def budget(self, replicas: int, max_length: int) -> StepBudget:
        """The step's budget on `replicas` replicas (after `check`).

        Raises:
            UsageError: a micro-batch would be smaller than `max_length`, naming the flag
                and its smallest valid value.
        """
        if self.tokens_per_step is None:
            return StepBudget(self.tokens_per_batch, replicas, self.accumulate or 1)
        total = self.tokens_per_step
        accumulate = math.ceil(total / (self.tokens_per_batch * replicas))
        micro_batch = total // (replicas * accumulate)
        if micro_batch < max_length:
            # With this accumulation it takes replicas x accumulate x max_length; fewer
            # micro-batches would need a step below `total`.
            smallest = replicas * accumulate * max_length
            raise UsageError(
                f"--tokens-per-step {total} over {replicas} replica(s) x {accumulate} "
                f"micro-batch(es) leaves {micro_batch} tokens per micro-batch, below "
                f"--max-length {max_length}: a longest pair would not fit; the smallest valid "
                f"--tokens-per-step from {total} up on {replicas} replica(s) is {smallest}")
        return StepBudget(micro_batch, replicas, accumulate)
