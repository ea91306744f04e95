"""tensorflow-datasets translation splits, streamed and validated like local files.

Used through :func:`pipelines.corpora.open_corpus` with ``data="tfds:NAME[/CONFIG]"``.
Examples are read in batches with ``as_dataset`` (never the whole split at once) and
checked by :func:`pipelines.textfiles.iter_aligned`: invalid UTF-8 or an example empty on
one side is one :class:`CorpusError` naming the dataset, split, language and example.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow_datasets as tfds

from pipelines import multi30k_tfds
from pipelines.textfiles import CorpusError, iter_aligned

TFDS_PREFIX = "tfds:"
# Interchangeable split names, in order of preference when the requested one is absent.
_SPLIT_ALIASES = (
    ("validation", "val", "valid", "dev"),
    ("test", "test_2016_flickr"),
)
_READ_BATCH = 8192


@dataclasses.dataclass(frozen=True)
class TfdsSplit:
    """One split of a prepared tfds translation dataset; :meth:`pairs` streams it."""

    builder: Any  # tfds.core.DatasetBuilder
    origin: str
    split: str
    src_lang: str
    tgt_lang: str

    def pairs(self, one_sided: bool = False) -> Iterator[tuple[str, str]]:
        """Validated ``(source, target)`` pairs, stripped, streamed in batches (with
        ``one_sided``, those empty on one side too: `pipelines.textfiles.iter_aligned`)."""
        try:
            dataset = self.builder.as_dataset(split=self.split, shuffle_files=False)
        except (ValueError, KeyError) as error:
            raise CorpusError(f"{self.origin}: cannot read split {self.split!r}: {error}") from None
        langs = (self.src_lang, self.tgt_lang)
        dataset = dataset.map(lambda example: tuple(example[lang] for lang in langs))
        names = {lang: f"{self.origin} [{self.split}] {lang!r}" for lang in langs}
        rows = self._decoded_rows(tfds.as_numpy(dataset.batch(_READ_BATCH)), names)
        first, second = itertools.tee(rows)
        columns = {langs[0]: (row[0] for row in first), langs[1]: (row[1] for row in second)}
        yield from iter_aligned(columns, names, unit="example",  # type: ignore[misc]
                                one_sided=one_sided)

    def _decoded_rows(self, batches, names) -> Iterator[tuple[str, str]]:
        number = 0
        for batch in batches:
            for row in zip(*batch, strict=True):
                number += 1
                decoded = []
                for lang, value in zip((self.src_lang, self.tgt_lang), row, strict=True):
                    try:
                        decoded.append(value.decode("utf-8").strip())
                    except UnicodeDecodeError:
                        raise CorpusError(
                            f"{names[lang]}: example {number}: invalid UTF-8; fix or remove "
                            "that example in the dataset source"
                        ) from None
                yield tuple(decoded)

    def identity(self) -> dict[str, Any]:
        """Dataset name, config, version and split: what identifies its content."""
        info = self.builder.info
        return {"name": info.full_name, "split": self.split, "data_dir": str(self.builder.data_dir)}


def open_split(name: str, split: str, src_lang: str, tgt_lang: str,
               data_dir: str | None, manual_dir: str | None) -> TfdsSplit:
    """Resolve (and, if needed, download and prepare) one split of a tfds dataset."""
    origin = f"{TFDS_PREFIX}{name}"
    if manual_dir is not None and not os.path.isdir(manual_dir):
        # tfds would quietly fall back to downloading; a mistyped folder should fail here.
        raise CorpusError(f"{manual_dir}: manual_dir does not exist (or is not a directory)")
    builder = builder_of(name, data_dir)
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
        known = known_splits(builder)
        if known:
            tfds_split = resolve_split(split, known, origin)
        elif split in _SPLIT_ALIASES[0]:
            tfds_split = "validation"  # the tfds convention, when tfds does not say
    return TfdsSplit(builder, origin, tfds_split, src_lang, tgt_lang)


def available_splits(name: str, data_dir: str | None) -> list[str]:
    """The splits tfds knows for ``name`` (may be empty until it is prepared)."""
    return sorted(known_splits(builder_of(name, data_dir)))


def builder_of(name: str, data_dir: str | None) -> tfds.core.DatasetBuilder:
    """The tfds builder of ``NAME[/CONFIG]``; an unknown name is a :class:`CorpusError`."""
    try:
        return tfds.builder(name, data_dir=data_dir)
    except ValueError as error:  # DatasetNotFoundError and unknown configs are ValueErrors
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CorpusError(
            f"{TFDS_PREFIX}{name}: not a tensorflow-datasets dataset ({first_line}); use "
            "tfds:NAME or tfds:NAME/CONFIG as listed by tfds.list_builders()"
        ) from None


def known_splits(builder: tfds.core.DatasetBuilder) -> list[str]:
    try:
        return [str(name) for name in builder.info.splits.keys()]
    except Exception:  # mocked or unprepared infos may not list splits
        return []


def resolve_split(requested: str, available: Sequence[str], origin: str) -> str:
    """``requested`` if available, else an alias of it (val/validation/dev, test/...)."""
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
