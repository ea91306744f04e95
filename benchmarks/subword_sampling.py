"""SentencePiece in the input pipeline, deterministic or sampled (issue 29's subword
regularization): how fast `tf.data` tokenizes both sides of a training split in the graph.

Each setting tokenizes every pair of the split with tensorflow-text's `SentencepieceTokenizer`
(the run's tokenizer model), in batches of 256 through a parallel map; reported: the best of
--repeats passes, in pairs/s and target tokens/s, and the target tokens a pair (sampled
segmentations are longer). Compare with what training consumes (the training log's target
tokens/s). The last line times what `prepare --subword-samples K` runs for each copy instead
(`pipelines.shard_files._sampled_batches`: SentencePiece's Python binding, seeded, one
thread; BPE-dropout at --alpha), which is what the project uses (docs/training.md).

    python benchmarks/subword_sampling.py --tokenizer runs/multi30k-de-en/tokenizer \
        --data ../shared/data/multi30k --split train --src de --tgt en
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (name, SentencepieceTokenizer arguments): deterministic, then sampling (Kudo 2018).
SETTINGS = [
    ("deterministic", {}),
    ("sampled, nbest_size=-1, alpha=0.1", dict(nbest_size=-1, alpha=0.1)),
    ("sampled, nbest_size=64, alpha=0.1", dict(nbest_size=64, alpha=0.1)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a run's tokenizer/ folder")
    parser.add_argument("--data", required=True)
    parser.add_argument("--split", default="train")
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.1, help="of the prepared copies")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import tensorflow_text as tf_text

    from pipelines.corpora import load_corpus, open_corpus
    from pipelines.shard_files import _sampled_batches
    from pipelines.tokenizer import SubwordTokenizer

    tokenizer = SubwordTokenizer.load(args.tokenizer)
    corpus = load_corpus(args.data, args.split, args.src, args.tgt)
    sources, targets = list(corpus.sources), list(corpus.targets)
    for name, settings in SETTINGS:
        pieces = tf_text.SentencepieceTokenizer(model=tokenizer.model_proto, **settings)
        dataset = (tf.data.Dataset.from_tensor_slices((sources, targets)).batch(256)
                   .map(lambda s, t, p=pieces: (p.tokenize(s), p.tokenize(t)),
                        num_parallel_calls=tf.data.AUTOTUNE)
                   .map(lambda s, t: tf.reduce_sum(t.row_lengths())))
        best, tokens = 0.0, 0
        for _ in range(args.repeats + 1):  # the first pass warms up
            started = time.perf_counter()
            tokens = sum(int(count) for count in dataset)
            best = max(best, tokens / (time.perf_counter() - started))
        pairs_per_s = best * len(sources) / tokens
        report(name, pairs_per_s, best, tokens / len(sources))

    split = open_corpus(args.data, args.split, args.src, args.tgt)
    best, tokens = 0.0, 0
    for copy in range(args.repeats):
        started = time.perf_counter()
        tokens = sum(int(batch[4].sum()) for batch in _sampled_batches(
            split, tokenizer.model_proto, args.alpha, [0, copy]))
        best = max(best, tokens / (time.perf_counter() - started))
    report(f"prepared copy, seeded, 1 thread, alpha={args.alpha:g}",
           best * len(sources) / tokens, best, tokens / len(sources))


def report(name: str, pairs_per_s: float, tokens_per_s: float, tokens_a_pair: float) -> None:
    print(f"{name:<36} {pairs_per_s:>9,.0f} pairs/s {tokens_per_s:>11,.0f} target tokens/s "
          f"{tokens_a_pair:5.1f} target tokens a pair", flush=True)


if __name__ == "__main__":
    main()
