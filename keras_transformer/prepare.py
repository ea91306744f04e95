"""Prepare a training corpus once: `python -m keras_transformer.prepare --help`.

Validates the train split in one streaming pass, trains the shared SentencePiece
vocabulary on a seeded sample, and tokenizes every pair into shards (`pipelines.prepared`),
and the validation split (--val-split) too, for `train --backend jax` (no TensorFlow there
to tokenize it: `pipelines.numpy_batches.validation_batches`); a folder without val/test
splits has them carved out of train as `train` carves them (--carve-pairs, --seed), a tfds
corpus without the default validation split is prepared without one (a note says so), and a
--val-split given must exist.
`python -m keras_transformer.train --prepared DIR` then trains from DIR without reading the
text again, on this machine or any other that can read DIR. An interrupted preparation
leaves no DIR; neither does a failure, which is one line (`error: ...`) on stderr, never a
traceback. Exit statuses:

    0  prepared: DIR is complete (every shard file's CRC-32 is in DIR/manifest.json)
    2  a bad flag, corpus or --out (e.g. not empty, or not writable): nothing was written
    4  the storage failed (no space left, a quota, a read-only or failing disk): the line
       names the path, the bytes needed and free; free space and run the same command again

The corpus flags are `DataConfig`'s (`keras_transformer.training.config.PREPARE_FIELDS`),
generated as `train`'s are, so the two commands take them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from keras_transformer.errors import EXIT_STORAGE, StorageError, UsageError
from keras_transformer.flags import (
    add_config_flags,
    add_recipe_flag,
    add_verbose_flag,
    given_flags,
    positive_int,
)
from keras_transformer.logs import show_project_logs
from keras_transformer.training.config import PREPARE_FIELDS, DataConfig, data_config
from keras_transformer.training.recipes import RECIPES

# `train`'s --val-split is not (yet) one of the settings `prepare` shares: a flag of its own.
_OWN_VAL_FLAG = "val_split" not in PREPARE_FIELDS


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m keras_transformer.prepare`."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.prepare",
        description="Prepare a training split once (tokenizer + token shards) for "
        "`python -m keras_transformer.train --prepared OUT`.")
    add_recipe_flag(parser)
    add_config_flags(parser, DataConfig, only=PREPARE_FIELDS)
    parser.add_argument("--shards", type=positive_int, default=1,
                        help="at least this many shards: the number of workers that will train")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the sample, the vocabulary and the shard assignment")
    if _OWN_VAL_FLAG:
        parser.add_argument(
            "--val-split", default=None,
            help="the validation split, whose token ids are prepared too (for `train "
            "--backend jax`, which validates on them): train's --val-split. Default: the "
            "recipe's, else val, skipped with a note if the corpus has no such split; "
            "'none': none")
    parser.add_argument("--out", required=True, help="directory to create (must not exist)")
    add_verbose_flag(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[DataConfig, argparse.Namespace]:
    """The corpus settings (a `--recipe`'s values under the flags given) and the rest."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    own = ("val_split",) if _OWN_VAL_FLAG else ()
    given = given_flags(namespace, exclude=("recipe", "shards", "seed", "out", "verbose", *own))
    try:
        data = data_config(namespace.recipe, **given)
    except UsageError as error:  # e.g. a recipe value its flag would refuse
        parser.error(str(error))
    if _OWN_VAL_FLAG:  # as train's: the flag's, the recipe's, the default
        data = dataclasses.replace(data, val_split=namespace.val_split or RECIPES.get(
            namespace.recipe or "", {}).get("val_split", data.val_split))
    return data, namespace


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (see the module docstring)."""
    data, args = parse_args(argv)
    # Imported after parsing: they load TensorFlow (~4 s), which `--help` and a refused flag
    # should not wait for.
    from keras_transformer.training.run_data import (
        carve_missing_splits,
        open_tokenizer_data,
        open_training_split,
    )
    from pipelines.prepared import prepare_corpus

    show_project_logs()
    try:
        data.check()
        # As train does: a folder without val/test has them carved out of train (--seed).
        carving = carve_missing_splits(data, args.seed)
        split = open_training_split(data, carving)
        validation = (carving.held_out["val"] if carving and "val" in carving.held_out
                      else validation_split(data, explicit=getattr(args, "val_split", None)
                                            is not None))
        prepared = prepare_corpus(
            split, args.out, vocab_size=data.vocab_size, max_length=data.max_length,
            tokenizer_sample=data.tokenizer_sample, shard_pairs=data.shard_pairs,
            min_shards=args.shards, seed=args.seed, subword_samples=data.subword_samples,
            subword_alpha=data.subword_alpha, validation=validation,
            validation_split=data.val_split, tokenizer_data=open_tokenizer_data(data))
    except ValueError as error:  # UsageError, CorpusError, PreparedError, a vocabulary too large
        print(f"error: {error}", file=sys.stderr)
        return 2
    except StorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_STORAGE
    except OSError as error:  # e.g. --out in a folder this user may not write to
        print(f"error: {error}", file=sys.stderr)
        return 2
    manifest = prepared.manifest
    copies = manifest["settings"].get("subword_samples") or 1
    print(f"prepared {manifest['pairs_kept'] // copies:,} of {manifest['pairs_total']:,} pairs "
          + (f"x {copies} sampled segmentations " if copies > 1 else "") +
          f"({prepared.num_shards} shards, vocabulary {manifest['tokenizer_vocab_size']}) in "
          f"{manifest['seconds']:.0f} s: {prepared.directory}")
    if prepared.validation is not None:
        entry = prepared.validation
        print(f"validation: the {entry['pairs']:,} pairs of {entry['origin']} [{entry['split']}]")
    return 0


def validation_split(data: DataConfig, *, explicit: bool):
    """The validation split to prepare (`ParallelCorpus`), as `train` loads it (its first
    source language), or None: --val-split none, or the default split absent from the
    corpus (a note says so; `train --backend jax` will ask for it).

    Raises:
        CorpusError: a --val-split given that the corpus lacks, or a split that is invalid.
    """
    from pipelines.corpora import CorpusError, open_corpus, source_languages

    if data.val_split.lower() == "none":
        return None
    where = dict(data_dir=data.data_dir, manual_dir=data.manual_dir)
    try:
        split = open_corpus(data.data, data.val_split, source_languages(data.src)[0], data.tgt,
                            **where)
    except CorpusError as error:
        if explicit:
            raise CorpusError(f"val data: {error}") from None
        print(f"note: no validation split prepared ({error}); `train --backend jax` needs "
              "one: give --val-split", flush=True)
        return None
    try:
        return split.load()
    except CorpusError as error:
        raise CorpusError(f"val data: {error}") from None


if __name__ == "__main__":
    sys.exit(main())
