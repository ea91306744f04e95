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

from keras_transformer.flags import (
    HelpFormatter,
    add_data_flags,
    positive_int,
    validate_data_flags,
)
from keras_transformer.logs import add_verbose_flag
from keras_transformer.training.recipes import add_recipe_flag, parse_with_recipe


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m keras_transformer.prepare`."""
    p = argparse.ArgumentParser(
        prog="python -m keras_transformer.prepare",
        description="Prepare a training split once (tokenizer + token shards) for "
        "`python -m keras_transformer.train --prepared OUT`.",
        formatter_class=HelpFormatter,
    )
    add_recipe_flag(p)
    add_data_flags(p)
    p.add_argument("--shards", type=positive_int, default=1,
                   help="at least this many shards: the number of workers that will train")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the sample, the vocabulary and the shard assignment")
    p.add_argument("--out", required=True, help="directory to create (must not exist)")
    add_verbose_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (2: bad flags or corpus, nothing created)."""
    args = parse_with_recipe(build_parser(), argv)
    from keras_transformer.logs import show_project_logs
    from pipelines.corpora import open_corpus
    from pipelines.prepared import prepare_corpus

    show_project_logs()
    try:
        validate_data_flags(args)
        split = open_corpus(args.data, args.train_split, args.src, args.tgt,
                            data_dir=args.data_dir, manual_dir=args.manual_dir)
        prepared = prepare_corpus(
            split, args.out, vocab_size=args.vocab_size, max_length=args.max_length,
            tokenizer_sample=args.tokenizer_sample, shard_pairs=args.shard_pairs,
            min_shards=args.shards, seed=args.seed)
    except ValueError as error:  # UsageError, CorpusError, PreparedError, a vocabulary too large
        print(f"error: {error}", file=sys.stderr)
        return 2
    manifest = prepared.manifest
    print(f"prepared {manifest['pairs_kept']:,} of {manifest['pairs_total']:,} pairs "
          f"({prepared.num_shards} shards, vocabulary {manifest['tokenizer_vocab_size']}) in "
          f"{manifest['seconds']:.0f} s: {prepared.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
