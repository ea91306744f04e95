"""Parallel corpora: local ``{split}.{lang}[.gz]`` folders and tensorflow-datasets.

``load_corpus`` reads a whole split into memory and validates it fully, raising one
:class:`CorpusError` per problem (the file, the 1-based line or example number, and how
to fix it). Over-long pairs are only ever removed by :func:`filter_long_pairs`, which
counts what it drops in a log line (logger ``"pipelines"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from pipelines import multi30k_tfds  # noqa: F401  (registers the "multi30k" tfds builder)
from pipelines.textfiles import (
    CorpusError,
    find_parallel_files,
    read_aligned,
    validate_aligned,
)

__all__ = [
    "CorpusError",
    "ParallelCorpus",
    "available_splits",
    "corpus_fingerprint",
    "filter_long_pairs",
    "load_corpus",
]

_LOG = logging.getLogger("pipelines")
TFDS_PREFIX = "tfds:"
# Interchangeable split names, in order of preference when the requested one is absent.
_SPLIT_ALIASES = (
    ("validation", "val", "valid", "dev"),
    ("test", "test_2016_flickr"),
)
_TFDS_READ_BATCH = 8192


@dataclasses.dataclass(frozen=True)
class ParallelCorpus:
    """One split of a parallel corpus held in memory: ``sources[i]`` translates to ``targets[i]``.

    ``origin`` says where it was read from (a folder path or ``"tfds:NAME"``), ``split`` is
    the resolved split name (e.g. ``"test_2016_flickr"`` for a requested ``"test"``).
    """

    sources: list[str]
    targets: list[str]
    src_lang: str
    tgt_lang: str
    split: str
    origin: str

    def __post_init__(self) -> None:
        if len(self.sources) != len(self.targets):
            raise CorpusError(
                f"{self.origin} [{self.split}]: {len(self.sources)} sources but "
                f"{len(self.targets)} targets; a corpus needs one target per source"
            )

    def __len__(self) -> int:
        return len(self.sources)

    def as_dataset(self) -> tf.data.Dataset:
        """The pairs in order as a dataset of ``(source, target)`` tf.string scalars."""
        return tf.data.Dataset.from_tensor_slices(
            (
                tf.constant(self.sources, dtype=tf.string, shape=[len(self)]),
                tf.constant(self.targets, dtype=tf.string, shape=[len(self)]),
            )
        )


def load_corpus(
    data: str | os.PathLike,
    split: str,
    src_lang: str,
    tgt_lang: str,
    *,
    data_dir: str | None = None,
    manual_dir: str | None = None,
) -> ParallelCorpus:
    """Load and validate one split of a parallel corpus.

    Args:
      data: a local folder holding ``{split}.{lang}`` or ``{split}.{lang}.gz`` files, or
        ``"tfds:NAME[/CONFIG]"`` for a tensorflow-datasets translation dataset (examples
        are dicts keyed by language code), e.g. ``"tfds:wmt14_translate/de-en"`` or
        ``"tfds:multi30k"`` (our own builder, :mod:`pipelines.multi30k_tfds`).
      split: split name. Exact names always work; ``"val"``/``"validation"`` and
        ``"test"`` (-> ``test_2016_flickr`` for Multi30k) are aliases of each other.
        tfds slicing such as ``"train[:10%]"`` is passed to tfds as is.
      src_lang, tgt_lang: language codes, e.g. ``"de"`` and ``"en"``.
      data_dir: tfds data directory (where prepared datasets live); tfds only.
      manual_dir: folder with manually downloaded files, for tfds builders that accept
        one; for ``tfds:multi30k`` a folder of the release files avoids the download.

    Returns:
      The validated :class:`ParallelCorpus`. Whitespace around each sentence is
      stripped; the text itself is kept verbatim.

    Raises:
      CorpusError: missing folder/file/split/language, empty file, invalid UTF-8,
        mismatched line counts, an entry empty on one side only, unknown dataset.
    """
    data = os.fspath(data)
    if src_lang == tgt_lang:
        raise CorpusError(f"{data}: source and target language are both {src_lang!r}")
    if data.startswith(TFDS_PREFIX):
        return _load_tfds(data[len(TFDS_PREFIX) :], split, src_lang, tgt_lang, data_dir, manual_dir)
    return _load_folder(Path(data), split, src_lang, tgt_lang)


def available_splits(data: str | os.PathLike, *, data_dir: str | None = None) -> list[str]:
    """Sorted split names of ``data`` (same forms as :func:`load_corpus`).

    For a folder: every split with files in two or more languages. For tfds: the splits
    tfds knows, which may be empty until the dataset has been prepared in ``data_dir``.
    """
    data = os.fspath(data)
    if data.startswith(TFDS_PREFIX):
        builder = _tfds_builder(data[len(TFDS_PREFIX) :], data_dir)
        return sorted(_known_tfds_splits(builder))
    index = find_parallel_files(data)
    return sorted(split for split, langs in index.items() if len(langs) >= 2)


def corpus_fingerprint(corpus: ParallelCorpus) -> str:
    """A stable SHA-256 hex digest of the languages and every pair's text, in order.

    Independent of where the corpus was read from, so moving the data does not
    invalidate caches keyed by it (e.g. the tokenizer's).
    """
    digest = hashlib.sha256()
    header = {
        "format": 1,
        "src_lang": corpus.src_lang,
        "tgt_lang": corpus.tgt_lang,
        "pairs": len(corpus),
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    for source, target in zip(corpus.sources, corpus.targets, strict=True):
        for text in (source, target):
            encoded = text.encode("utf-8")
            # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    return digest.hexdigest()


def filter_long_pairs(
    corpus: ParallelCorpus,
    max_length: int,
    *,
    length_fn: Callable[[Sequence[str]], Sequence[int]] | None = None,
    unit: str = "words",
) -> ParallelCorpus:
    """Drop pairs whose source or target is longer than ``max_length``, and log how many.

    Args:
      corpus: the corpus to filter.
      max_length: the largest allowed length (inclusive), in ``unit``.
      length_fn: maps a list of sentences to their lengths, in one call so it can be
        vectorised (e.g. subword counts from a tokenizer). Default: whitespace words.
      unit: what ``length_fn`` counts, for the log line.

    Returns:
      A new corpus with the kept pairs in their original order.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be a positive number of {unit}, got {max_length}")
    if length_fn is None:
        length_fn = _word_counts
    source_lengths = np.asarray(length_fn(corpus.sources), dtype=np.int64)
    target_lengths = np.asarray(length_fn(corpus.targets), dtype=np.int64)
    keep = (source_lengths <= max_length) & (target_lengths <= max_length)
    kept = int(keep.sum())
    dropped = len(corpus) - kept
    _LOG.info(
        "%s [%s] %s-%s: kept %d of %d pairs, dropped %d (%.2f%%) longer than %d %s",
        corpus.origin,
        corpus.split,
        corpus.src_lang,
        corpus.tgt_lang,
        kept,
        len(corpus),
        dropped,
        100.0 * dropped / max(len(corpus), 1),
        max_length,
        unit,
    )
    if dropped == 0:
        return corpus
    indices = np.flatnonzero(keep)
    return dataclasses.replace(
        corpus,
        sources=[corpus.sources[i] for i in indices],
        targets=[corpus.targets[i] for i in indices],
    )


def _word_counts(texts: Sequence[str]) -> list[int]:
    return [len(text.split()) for text in texts]


def _resolve_split(requested: str, available: Sequence[str], origin: str) -> str:
    if requested in available:
        return requested
    for group in _SPLIT_ALIASES:
        if requested in group:
            for candidate in group:
                if candidate in available:
                    return candidate
    if requested == "test":
        tests = [name for name in available if name.startswith("test")]
        if len(tests) == 1:
            return tests[0]
    raise CorpusError(
        f"{origin}: no split {requested!r}; available splits: "
        f"{', '.join(sorted(available)) or 'none'}"
    )


def _load_folder(folder: Path, split: str, src_lang: str, tgt_lang: str) -> ParallelCorpus:
    index = find_parallel_files(folder)
    available = sorted(name for name, langs in index.items() if len(langs) >= 2)
    present = sorted(index)
    try:
        name = _resolve_split(split, present, str(folder))
    except CorpusError:
        raise CorpusError(
            f"{folder}: no split {split!r} (no {split}.{src_lang}[.gz] / {split}.{tgt_lang}[.gz]); "
            f"available splits: {', '.join(available) or 'none'}"
        ) from None
    langs = index[name]
    for lang in (src_lang, tgt_lang):
        if lang not in langs:
            raise CorpusError(
                f"{folder / f'{name}.{lang}'}[.gz]: missing; split {name!r} has languages "
                f"{', '.join(sorted(langs))}: add the file or choose one of those languages"
            )
    columns = read_aligned({src_lang: langs[src_lang], tgt_lang: langs[tgt_lang]})
    return _corpus_from_columns(columns, src_lang, tgt_lang, name, str(folder))


def _tfds_builder(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    try:
        return tfds.builder(name, data_dir=data_dir)
    except ValueError as error:  # DatasetNotFoundError and unknown configs are ValueErrors
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CorpusError(
            f"{TFDS_PREFIX}{name}: not a tensorflow-datasets dataset ({first_line}); use "
            "tfds:NAME or tfds:NAME/CONFIG as listed by tfds.list_builders()"
        ) from None


def _known_tfds_splits(builder: tfds.core.DatasetBuilder) -> list[str]:
    try:
        return [str(name) for name in builder.info.splits.keys()]
    except Exception:  # mocked or unprepared infos may not list splits
        return []


def _load_tfds(
    name: str,
    split: str,
    src_lang: str,
    tgt_lang: str,
    data_dir: str | None,
    manual_dir: str | None,
) -> ParallelCorpus:
    origin = f"{TFDS_PREFIX}{name}"
    if manual_dir is not None and not Path(manual_dir).is_dir():
        # tfds would quietly fall back to downloading; a mistyped folder should fail here.
        raise CorpusError(f"{manual_dir}: manual_dir does not exist (or is not a directory)")
    builder = _tfds_builder(name, data_dir)
    languages = list(builder.info.features.keys()) if hasattr(builder.info.features, "keys") else []
    for lang in (src_lang, tgt_lang):
        if lang not in languages:
            raise CorpusError(
                f"{origin}: no language {lang!r}; its examples have {', '.join(languages) or 'no'} "
                "fields: choose src_lang/tgt_lang among them (or another config, e.g. NAME/de-en)"
            )
    ours = builder.name == multi30k_tfds.Multi30k.name
    config = tfds.download.DownloadConfig(manual_dir=manual_dir, try_download_gcs=not ours)
    try:
        builder.download_and_prepare(download_config=config)
    except CorpusError:
        raise
    except Exception as error:  # network, disk and tfds errors alike
        hint = " (pass manual_dir=<folder with the release files>)" if ours else ""
        raise CorpusError(
            f"{origin}: could not download/prepare into {builder.data_dir}: "
            f"{type(error).__name__}: {error}{hint}"
        ) from error

    tfds_split = split
    if "[" not in split:  # a slicing expression is for tfds to interpret
        known = _known_tfds_splits(builder)
        if known:
            tfds_split = _resolve_split(split, known, origin)
        elif split in _SPLIT_ALIASES[0]:
            tfds_split = "validation"  # the tfds convention, when tfds does not say
    try:
        dataset = builder.as_dataset(split=tfds_split, shuffle_files=False)
    except (ValueError, KeyError) as error:
        raise CorpusError(f"{origin}: cannot read split {tfds_split!r}: {error}") from None
    dataset = dataset.map(lambda example: (example[src_lang], example[tgt_lang]))
    columns: dict[str, list[str]] = {src_lang: [], tgt_lang: []}
    for batch in tfds.as_numpy(dataset.batch(_TFDS_READ_BATCH)):
        for lang, values in zip((src_lang, tgt_lang), batch, strict=True):
            column = columns[lang]
            for value in values:
                try:
                    column.append(value.decode("utf-8").strip())
                except UnicodeDecodeError:
                    raise CorpusError(
                        f"{origin} [{tfds_split}] {lang!r}: example {len(column) + 1}: invalid "
                        "UTF-8; fix or remove that example in the dataset source"
                    ) from None
    names = {lang: f"{origin} [{tfds_split}] {lang!r}" for lang in columns}
    columns = validate_aligned(columns, names, unit="example")
    return _corpus_from_columns(columns, src_lang, tgt_lang, tfds_split, origin)


def _corpus_from_columns(
    columns: dict[str, list[str]], src_lang: str, tgt_lang: str, split: str, origin: str
) -> ParallelCorpus:
    _LOG.info("%s [%s]: loaded %d %s-%s pairs", origin, split, len(columns[src_lang]),
              src_lang, tgt_lang)
    return ParallelCorpus(
        sources=columns[src_lang], targets=columns[tgt_lang], src_lang=src_lang,
        tgt_lang=tgt_lang, split=split, origin=origin,
    )
