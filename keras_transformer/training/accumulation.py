"""Gradient accumulation: N micro-batches, then one optimizer update.

The paper's step holds ~25,000 source and 25,000 target tokens, over 8 GPUs (5.1, 5.2).
With fewer devices the same step is had by accumulating: fairseq's `--update-freq`,
OpenNMT-tf's `effective_batch_size`. `TransformerTrainer.compile(..., accumulate_steps=N)`
(`keras_transformer.training.trainer_model`) turns it on, for `model.fit` as for
`python -m keras_transformer.train --accumulate N`.

The update is exactly that of one batch holding all N micro-batches of every replica:
the loss is normalised by the target tokens of all of them, not a mean of N means.

- Each micro-batch backpropagates its own token mean (the magnitudes of an ordinary step,
  which 16-bit backward passes and loss scaling expect). Its gradient times its token count
  (the gradient of its token *sum*) is added to a float32 accumulator of this replica.
  No communication happens between updates.
- Every N-th micro-batch divides the accumulators by the token count of all N micro-batches
  of all replicas (one scalar all-reduce) and hands them to the optimizer. Keras' optimizer
  sums replicas' gradients (its all-reduce, once per update), then applies one update.
- The optimizer's `iterations`, and with it the learning-rate schedule, the training step,
  checkpoints and resume, count updates, not micro-batches.

The accumulators live in memory only: save and restore at update boundaries (the train
command does: its checkpoints and backups fall on multiples of the update). A micro-batch
whose update was interrupted before it was applied is simply trained again on resume.
Each `fit` and each `load_weights` starts from empty accumulators: micro-batches that did
not complete an update (a `fit` whose steps are not a multiple of N) are discarded.

The steps are backend-specific, beside this module: `accumulation_tensorflow.py` (replicas of
`tf.distribute`, per-replica variables, one all-reduce per update) and `accumulation_jax.py`
(Keras' stateless JAX train function; one program over the global batch).
"""

from __future__ import annotations

import keras


def check_accumulation(model: keras.Model, steps: int) -> None:
    """Raises ValueError unless `steps` >= 2 and `model`'s loss gives its token sum and
    count (`sum_and_count`), which the exact normalisation needs (on every backend)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"accumulate_steps must be an integer >= 2 here, got {steps!r}")
    if not hasattr(model.loss, "sum_and_count"):
        raise ValueError(
            f"gradient accumulation normalises by the tokens of all micro-batches, so the "
            f"loss must give its token sum and count (`sum_and_count`); {model.loss!r} "
            "does not: compile with keras_transformer.training.losses.LabelSmoothedCrossEntropy")
