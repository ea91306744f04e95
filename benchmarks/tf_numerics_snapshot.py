"""A snapshot of the TensorFlow training step's numbers, to show a change left them alone.

Builds a `small` 2-layer `TransformerTrainer` (vocabulary 500, dropout 0.1) from a fixed seed,
then saves its inference logits, the label-smoothed loss and every gradient of one
dropout-on training step (`tf.function`), in float32 and in mixed_bfloat16, to an .npz.
Run it at two commits and compare (issue 36: bit-identical before and after the backend
split):

    git stash; python benchmarks/tf_numerics_snapshot.py /tmp/before.npz; git stash pop
    python benchmarks/tf_numerics_snapshot.py /tmp/after.npz --compare /tmp/before.npz
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_transformer.training.losses import LabelSmoothedCrossEntropy  # noqa: E402
from keras_transformer.training.trainer_model import build_trainer  # noqa: E402


def snapshot() -> dict[str, np.ndarray]:
    """{name: array} of logits, loss and gradients under both precisions."""
    rng = np.random.default_rng(0)
    source = rng.integers(3, 500, (8, 13)).astype("int32")
    source[:, 10:] = 0
    target = rng.integers(3, 500, (8, 11)).astype("int32")
    target[:, 9:] = 0
    labels = np.roll(target, -1, 1)
    labels[:, -1] = 0
    found = {}
    for policy in ("float32", "mixed_bfloat16"):
        keras.utils.set_random_seed(1)
        model = build_trainer("small", vocab_size=500, num_layers=2, dtype=policy, dropout=0.1)
        features = {"source": source, "target": target}
        found[f"{policy}_logits"] = np.asarray(model(features, training=False))
        loss_function = LabelSmoothedCrossEntropy(0.1)

        @tf.function
        def step(features, labels, model=model, loss_function=loss_function):
            with tf.GradientTape() as tape:
                loss = loss_function(labels, model(features, training=True))
            return loss, tape.gradient(loss, model.trainable_variables)

        loss, gradients = step(features, labels)
        found[f"{policy}_loss"] = loss.numpy()
        for variable, gradient in zip(model.trainable_variables, gradients, strict=True):
            found[f"{policy}_grad_{variable.path}"] = np.asarray(
                tf.convert_to_tensor(gradient), dtype=np.float32)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help=".npz to write")
    parser.add_argument("--compare", help="an earlier snapshot: report what differs")
    args = parser.parse_args()
    found = snapshot()
    np.savez(args.output, **found)
    if args.compare:
        before = np.load(args.compare)
        differ = [name for name in found if name not in before
                  or not np.array_equal(found[name], before[name])]
        print(f"{len(found)} arrays, {len(differ)} differ" + (f": {differ[:5]}" if differ else
                                                             " (bit-identical)"))


if __name__ == "__main__":
    main()
