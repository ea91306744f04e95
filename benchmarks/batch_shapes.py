"""Distinct batch shapes in one epoch of the training pipeline (what an XLA-compiled step
compiles once each), with the default buckets and with XLA's (issue 15).

Prepares the train split of a corpus into a temporary folder (as `train` does), then reads
`--epochs` epochs of batches both ways (each epoch shuffles differently, so partial batches
change size) and counts distinct (source, target) shapes in the first epoch and in all,
batches per epoch and the padding efficiency (non-PAD over all positions).

    python benchmarks/batch_shapes.py --data ../shared/data/multi30k --src de --tgt en
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from pipelines.batching import xla_bucket_boundaries  # noqa: E402
from pipelines.corpora import open_corpus  # noqa: E402
from pipelines.prepared import prepare_corpus  # noqa: E402


def epoch_shapes(prepared, epochs: int, **kwargs) -> dict:
    """Shapes, batches and padding efficiency of `epochs` epochs of `prepared.batches`."""
    shapes, first_epoch, batches, real, slots = set(), 0, 0, 0, 0
    for epoch in range(epochs):
        for features, labels in prepared.batches(repeat=False, seed=epoch, **kwargs):
            source, target = features["source"].numpy(), features["target"].numpy()
            shapes.add((source.shape, target.shape))
            batches += 1
            real += np.count_nonzero(source) + np.count_nonzero(labels.numpy())
            slots += source.size + target.size
        first_epoch = first_epoch or len(shapes)
    return {"distinct_shapes_first_epoch": first_epoch,
            f"distinct_shapes_{epochs}_epochs": len(shapes),
            "batches_per_epoch": batches // epochs, "padding_efficiency": round(real / slots, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        prepared = prepare_corpus(open_corpus(args.data, "train", args.src, args.tgt),
                                  Path(folder) / "prepared", vocab_size=args.vocab_size,
                                  max_length=args.max_length)
        common = dict(tokens_per_batch=args.tokens_per_batch, max_length=args.max_length)
        boundaries = xla_bucket_boundaries(args.max_length)
        result = {
            "pairs": prepared.pairs, **common,
            "default_buckets": epoch_shapes(prepared, args.epochs, **common),
            "xla_buckets_static_shapes": {
                **epoch_shapes(prepared, args.epochs, bucket_boundaries=boundaries,
                               static_shapes=True, **common),
                "predicted_shapes": len(prepared.static_shapes(
                    args.tokens_per_batch, args.max_length, bucket_boundaries=boundaries)),
                "boundaries": boundaries},
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
