"""Prepare a training corpus once: `python -m keras_transformer.prepare --help`.

Validates the train split in one streaming pass, trains the shared SentencePiece
vocabulary on a seeded sample, and tokenizes every pair into shards (`pipelines.prepared`).
`python -m keras_transformer.train --prepared DIR` then trains from DIR without reading the
text again, on this machine or any other that can read DIR. A bad corpus or flag fails with
one line and exit status 2 before DIR exists; an interrupted preparation leaves no DIR.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keras_transformer.train_flags import HelpFormatter, positive_int
from pipelines import DEFAULT_SHARD_PAIRS, DEFAULT_TOKENIZER_SAMPLE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m keras_transformer.prepare",
        description="Prepare a training split once (tokenizer + token shards) for "
        "`python -m keras_transformer.train --prepared OUT`.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--data", required=True,
                   help="folder of {split}.{lang}[.gz] files, or tfds:NAME[/CONFIG]")
    p.add_argument("--data-dir", help="tensorflow-datasets data_dir (tfds: data only)")
    p.add_argument("--src", required=True, help="source language code, e.g. de")
    p.add_argument("--tgt", required=True, help="target language code, e.g. en")
    p.add_argument("--train-split", default="train", help="split to prepare")
    p.add_argument("--vocab-size", type=positive_int, default=8000,
                   help="shared source/target subword vocabulary size (paper: ~37000)")
    p.add_argument("--max-length", type=positive_int, default=128,
                   help="longest pair kept, in subwords + EOS; longer pairs are dropped")
    p.add_argument("--tokenizer-sample", type=positive_int, default=DEFAULT_TOKENIZER_SAMPLE,
                   help="pairs sampled (seeded) to train SentencePiece on")
    p.add_argument("--shard-pairs", type=positive_int, default=DEFAULT_SHARD_PAIRS,
                   help="pairs per shard")
    p.add_argument("--shards", type=positive_int, default=1,
                   help="at least this many shards: the number of workers that will train")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the sample, the vocabulary and the shard assignment")
    p.add_argument("--out", required=True, help="directory to create (must not exist)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.src == args.tgt:
        print(f"error: --src and --tgt are both {args.src!r}", file=sys.stderr)
        return 2
    if args.vocab_size < 300:
        print("error: --vocab-size must be >= 300 (4 special ids + 256 byte pieces + words)",
              file=sys.stderr)
        return 2
    if args.max_length < 2:
        print(f"error: --max-length must be >= 2, got {args.max_length}", file=sys.stderr)
        return 2
    from pipelines.corpora import open_corpus
    from pipelines.prepared import prepare_corpus

    try:
        split = open_corpus(args.data, args.train_split, args.src, args.tgt,
                            data_dir=args.data_dir)
        prepared = prepare_corpus(
            split, args.out, vocab_size=args.vocab_size, max_length=args.max_length,
            tokenizer_sample=args.tokenizer_sample, shard_pairs=args.shard_pairs,
            min_shards=args.shards, seed=args.seed)
    except ValueError as error:  # CorpusError, PreparedError, a vocabulary too large
        print(f"error: {error}", file=sys.stderr)
        return 2
    manifest = prepared.manifest
    print(f"prepared {manifest['pairs_kept']:,} of {manifest['pairs_total']:,} pairs "
          f"({prepared.num_shards} shards, vocabulary {manifest['tokenizer_vocab_size']}) in "
          f"{manifest['seconds']:.0f} s: {prepared.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
