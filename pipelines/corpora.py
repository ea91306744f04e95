"""Parallel corpora: local ``{split}.{lang}[.gz]`` folders and tensorflow-datasets, as streams.

:func:`open_corpus` resolves one split (folder, files, languages, tfds builder) without
reading it and returns a :class:`CorpusSplit`, whose :meth:`~CorpusSplit.pairs` streams
validated sentence pairs: a corpus of any size is checked in one pass and constant memory.
Every problem becomes one :class:`CorpusError` naming the file (or dataset), the 1-based
line or example number, and how to fix it. :func:`scan_corpus` is that one pass for a
training split: pair count, content fingerprint and a bounded, seeded sample (for the
tokenizer). :func:`load_corpus` holds a small split (validation, test) in memory as a
:class:`ParallelCorpus`. Pairs too long for training are dropped later, by the pipelines
that tokenize them, and counted by :func:`log_dropped` (logger ``"pipelines"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import tensorflow as tf

from pipelines import tfds_corpora
from pipelines.batch_plan import log_dropped  # numpy alone; re-exported
from pipelines.pair_selection import TrainSelection
from pipelines.textfiles import CorpusError, find_parallel_files, iter_aligned, iter_text_lines

__all__ = [
    "CorpusError",
    "CorpusScan",
    "CorpusSplit",
    "ParallelCorpus",
    "available_splits",
    "corpus_fingerprint",
    "log_dropped",
    "load_corpus",
    "mixed_corpus",
    "open_corpus",
    "scan_corpus",
    "source_languages",
]

_LOG = logging.getLogger("pipelines")
TFDS_PREFIX = tfds_corpora.TFDS_PREFIX
_FINGERPRINT_FORMAT = 2


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


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    """One split of a parallel corpus, resolved but not read: :meth:`pairs` streams it.

    Made by :func:`open_corpus`. ``files`` holds the source and target file of a local
    split; ``tfds`` the tensorflow-datasets reader of a tfds split; ``parts`` the splits of
    each source language of a many-to-one split (``src_lang`` ``"de,fr,cs"``), read one
    after the other. ``selection`` (:mod:`pipelines.pair_selection`, made by
    :mod:`pipelines.carving`) keeps only its training pairs: not carved out for val/test,
    and not noise if it cleans.
    """

    origin: str
    split: str
    src_lang: str
    tgt_lang: str
    files: tuple[Path, Path] | None = None
    tfds: tfds_corpora.TfdsSplit | None = None
    parts: tuple[CorpusSplit, ...] = ()
    repeat: int = 1
    source_tag: str = ""
    selection: TrainSelection | None = None
    # Pass pairs empty on one side on (to a reader that drops and counts them) instead of
    # refusing the corpus: `pipelines.carving` with clean. Not part of the identity.
    keep_one_sided: bool = False

    def pairs(self) -> Iterator[tuple[str, str]]:
        """Validated ``(source, target)`` pairs in corpus order, streamed.

        Whitespace around each sentence is stripped; pairs blank on both sides are
        skipped (and counted in a warning). A split with ``repeat`` N gives its pairs N
        times over; one with a ``source_tag`` puts it, and a space, before each source.
        Raises :class:`CorpusError` while iterating, at the first problem.
        """
        for _ in range(self.repeat):
            if not self.source_tag:
                yield from self._pairs_once()
                continue
            for source, target in self._pairs_once():
                yield f"{self.source_tag} {source}", target

    def source_tags(self) -> list[str]:
        """The source tags of this split and its parts, sorted (reserved tokens for the
        tokenizer: each one is one piece, never split)."""
        tags = {self.source_tag} | {tag for part in self.parts for tag in part.source_tags()}
        return sorted(tags - {""})

    def _pairs_once(self) -> Iterator[tuple[str, str]]:
        if self.selection is None:
            yield from self._read()
        else:
            yield from self.selection.pairs(self._read())

    def _read(self) -> Iterator[tuple[str, str]]:
        # A selection that cleans (--clean-train) drops and counts pairs empty on one side:
        # the reader passes them on instead of refusing the corpus.
        one_sided = self.keep_one_sided or (self.selection is not None and self.selection.clean)
        if self.parts:
            for part in self.parts:
                yield from (dataclasses.replace(part, keep_one_sided=True) if one_sided
                            else part).pairs()
        elif self.files is not None:
            paths = dict(zip((self.src_lang, self.tgt_lang), self.files, strict=True))
            columns = {lang: iter_text_lines(path) for lang, path in paths.items()}
            names = {lang: str(path) for lang, path in paths.items()}
            yield from iter_aligned(columns, names, one_sided=one_sided)  # type: ignore[misc]
        else:
            assert self.tfds is not None
            yield from self.tfds.pairs(one_sided=one_sided)

    def load(self) -> ParallelCorpus:
        """The whole split in memory (for small splits: validation, test)."""
        sources, targets = [], []
        for source, target in self.pairs():
            sources.append(source)
            targets.append(target)
        _LOG.info("%s [%s]: loaded %d %s-%s pairs", self.origin, self.split, len(sources),
                  self.src_lang, self.tgt_lang)
        return ParallelCorpus(sources, targets, self.src_lang, self.tgt_lang, self.split,
                              self.origin)

    def identity(self) -> dict[str, Any]:
        """What identifies the split's content cheaply, without reading it.

        Local files: their resolved paths, sizes and modification times; tfds: dataset,
        version and split. Caches of a prepared split record it, to notice a corpus that
        changed since (a content fingerprint would mean reading the whole corpus).
        """
        base = {"origin": self.origin, "split": self.split, "src_lang": self.src_lang,
                "tgt_lang": self.tgt_lang}
        # Recorded only when set: the identities of plain splits stay as they were.
        base.update({"repeat": self.repeat} if self.repeat != 1 else {})
        base.update({"source_tag": self.source_tag} if self.source_tag else {})
        base.update({"selection": self.selection.identity()} if self.selection else {})
        if self.parts:
            parts = [part.identity() for part in self.parts]
            return {**base, "parts": parts,
                    "files": [file for part in parts for file in part.get("files", [])]}
        if self.files is not None:
            stats = [path.stat() for path in self.files]
            return {**base, "files": [
                {"path": str(path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
                for path, stat in zip(self.files, stats, strict=True)]}
        assert self.tfds is not None
        return {**base, "tfds": self.tfds.identity()}


@dataclasses.dataclass(frozen=True)
class CorpusScan:
    """What one validating pass over a training split found (:func:`scan_corpus`).

    ``pairs`` counts the valid pairs, ``fingerprint`` is :func:`corpus_fingerprint` of
    the whole split, ``sample`` holds up to ``sample_pairs`` of its pairs, in corpus order,
    ``identity`` is :meth:`CorpusSplit.identity` taken before the pass.
    """

    split: CorpusSplit
    pairs: int
    fingerprint: str
    sample: ParallelCorpus
    identity: dict[str, Any]


def open_corpus(
    data: str | os.PathLike,
    split: str,
    src_lang: str,
    tgt_lang: str,
    *,
    data_dir: str | None = None,
    manual_dir: str | None = None,
) -> CorpusSplit:
    """Resolve one split of a parallel corpus, without reading it.

    Args:
      data: a local folder holding ``{split}.{lang}`` or ``{split}.{lang}.gz`` files, or
        ``"tfds:NAME[/CONFIG]"`` for a tensorflow-datasets translation dataset (examples
        are dicts keyed by language code), e.g. ``"tfds:wmt14_translate/de-en"`` or
        ``"tfds:multi30k"`` (our own builder, :mod:`pipelines.multi30k_tfds`).
      split: split name. Exact names always work; ``"val"``/``"validation"`` and
        ``"test"`` (-> ``test_2016_flickr`` for Multi30k) are aliases of each other.
        tfds slicing such as ``"train[:10%]"`` is passed to tfds as is.
      src_lang, tgt_lang: language codes, e.g. ``"de"`` and ``"en"``. Several source
        languages, comma-separated (``"de,fr,cs"``), make one many-to-one split: the
        pairs of each source language with the same target, one language after the other
        (Johnson et al. 2017; Multi30k has the same English captions in German, French and
        Czech).
      data_dir: tfds data directory (where prepared datasets live); tfds only.
      manual_dir: folder with manually downloaded files, for tfds builders that accept
        one; for ``tfds:multi30k`` a folder of the release files avoids the download.

    Raises:
      CorpusError: missing folder/file/split/language, unknown dataset, a tfds dataset
        that cannot be prepared.
    """
    data = os.fspath(data)
    if "," in src_lang:
        languages = source_languages(src_lang)
        if len(set(languages)) < len(languages) or "" in languages:
            raise CorpusError(f"{data}: source languages {src_lang!r}: each one once, "
                              "comma-separated, e.g. de,fr,cs")
        parts = tuple(open_corpus(data, split, language, tgt_lang, data_dir=data_dir,
                                  manual_dir=manual_dir) for language in languages)
        return CorpusSplit(parts[0].origin, parts[0].split, src_lang, tgt_lang, parts=parts)
    if src_lang == tgt_lang:
        raise CorpusError(f"{data}: source and target language are both {src_lang!r}")
    if data.startswith(TFDS_PREFIX):
        reader = tfds_corpora.open_split(data[len(TFDS_PREFIX):], split, src_lang, tgt_lang,
                                         data_dir, manual_dir)
        return CorpusSplit(reader.origin, reader.split, src_lang, tgt_lang, tfds=reader)
    folder = Path(data)
    index = find_parallel_files(folder)
    available = sorted(name for name, langs in index.items() if len(langs) >= 2)
    # Among the splits with both languages first (a folder holding validation.en alone and
    # dev.de/dev.en gives dev for "val"), then among all (to name what is missing).
    both = sorted(name for name, langs in index.items() if {src_lang, tgt_lang} <= set(langs))
    try:
        try:
            name = tfds_corpora.resolve_split(split, both, str(folder))
        except CorpusError:
            name = tfds_corpora.resolve_split(split, sorted(index), str(folder))
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
    return CorpusSplit(str(folder), name, src_lang, tgt_lang,
                       files=(langs[src_lang], langs[tgt_lang]))


def mixed_corpus(real: CorpusSplit, *, added: Sequence[CorpusSplit] = (),
                 synthetic: Sequence[CorpusSplit] = (), upsample_real: int = 1,
                 synthetic_tag: str = "") -> CorpusSplit:
    """One training split of real pairs, other real corpora and synthetic pairs, streamed one
    after the other (the preparation spreads them over its shards, seeded).

    Back-translation (Sennrich et al. 2016) trains on real pairs together with synthetic
    ones whose sources are machine translations of monolingual target text; a tag token
    before each synthetic source tells the model which is which (Caswell et al. 2019,
    "Tagged Back-Translation"), and repeating the real pairs sets the real:synthetic ratio
    (fairseq's ``--upsample-primary``; Edunov et al. 2018). Fine-tuning on a new domain adds
    some of the old corpus the same way, against forgetting (Chu et al. 2017).

    Args:
      real: the real training split (its repeat is replaced by ``upsample_real``).
      added: more real splits (e.g. the old domain's), as they are, untagged.
      synthetic: synthetic splits (e.g. `keras_transformer.back_translate` folders).
      upsample_real: how many times ``real`` is repeated (>= 1).
      synthetic_tag: put before each synthetic source ("" for none).

    Raises:
      CorpusError: a split of other languages than ``real``'s, or a bad repeat or tag.
    """
    if isinstance(upsample_real, bool) or not isinstance(upsample_real, int) or upsample_real < 1:
        raise CorpusError(f"the real pairs' upsampling must be a whole number >= 1, got "
                          f"{upsample_real!r}")
    if synthetic_tag != synthetic_tag.strip() or " " in synthetic_tag:
        raise CorpusError(f"the synthetic tag {synthetic_tag!r} must be one token without "
                          "spaces, e.g. <BT>")
    for other in (*added, *synthetic):
        if (other.src_lang, other.tgt_lang) != (real.src_lang, real.tgt_lang):
            raise CorpusError(f"{other.origin} [{other.split}] is {other.src_lang}-"
                              f"{other.tgt_lang}, the training data {real.src_lang}-"
                              f"{real.tgt_lang}: give corpora of the same languages")
    if not added and not synthetic and upsample_real == 1:
        return real
    parts = (dataclasses.replace(real, repeat=upsample_real), *added,
             *(dataclasses.replace(part, source_tag=synthetic_tag) for part in synthetic))
    return CorpusSplit(" + ".join(part.origin for part in parts), real.split, real.src_lang,
                       real.tgt_lang, parts=parts)


def source_languages(src_lang: str) -> list[str]:
    """The source languages of ``src_lang``: ``"de,fr,cs"`` -> ``["de", "fr", "cs"]``."""
    return [language.strip() for language in src_lang.split(",")]


def load_corpus(
    data: str | os.PathLike,
    split: str,
    src_lang: str,
    tgt_lang: str,
    *,
    data_dir: str | None = None,
    manual_dir: str | None = None,
) -> ParallelCorpus:
    """Load and validate one (small) split into memory: ``open_corpus(...).load()``.

    Arguments as :func:`open_corpus`. Whitespace around each sentence is stripped; the
    text itself is kept verbatim. For a large training split, stream it instead
    (:meth:`CorpusSplit.pairs`, :func:`scan_corpus`, :mod:`pipelines.prepared`).

    Raises:
      CorpusError: missing folder/file/split/language, empty file, invalid UTF-8,
        mismatched line counts, an entry empty on one side only, unknown dataset.
    """
    return open_corpus(data, split, src_lang, tgt_lang, data_dir=data_dir,
                       manual_dir=manual_dir).load()


def available_splits(data: str | os.PathLike, *, data_dir: str | None = None) -> list[str]:
    """Sorted split names of ``data`` (same forms as :func:`open_corpus`).

    For a folder: every split with files in two or more languages. For tfds: the splits
    tfds knows, which may be empty until the dataset has been prepared in ``data_dir``.
    """
    data = os.fspath(data)
    if data.startswith(TFDS_PREFIX):
        return tfds_corpora.available_splits(data[len(TFDS_PREFIX):], data_dir)
    index = find_parallel_files(data)
    return sorted(split for split, langs in index.items() if len(langs) >= 2)


class _Fingerprint:
    """SHA-256 over the languages and every pair's text, in order, fed one pair at a time."""

    def __init__(self, src_lang: str, tgt_lang: str):
        self._digest = hashlib.sha256()
        header = {"format": _FINGERPRINT_FORMAT, "src_lang": src_lang, "tgt_lang": tgt_lang}
        self._digest.update(json.dumps(header, sort_keys=True).encode())
        self.pairs = 0

    def add(self, source: str, target: str) -> None:
        for text in (source, target):
            encoded = text.encode("utf-8")
            # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
            self._digest.update(len(encoded).to_bytes(8, "little"))
            self._digest.update(encoded)
        self.pairs += 1

    def hexdigest(self) -> str:
        final = self._digest.copy()
        final.update(self.pairs.to_bytes(8, "little"))
        return final.hexdigest()


def corpus_fingerprint(corpus: ParallelCorpus | CorpusSplit) -> str:
    """A stable SHA-256 hex digest of the languages and every pair's text, in order.

    Independent of where the corpus was read from, so moving the data does not
    invalidate caches keyed by it. A :class:`CorpusSplit` is streamed (one pass).
    """
    fingerprint = _Fingerprint(corpus.src_lang, corpus.tgt_lang)
    pairs: Iterable[tuple[str, str]] = (
        corpus.pairs() if isinstance(corpus, CorpusSplit)
        else zip(corpus.sources, corpus.targets, strict=True)
    )
    for source, target in pairs:
        fingerprint.add(source, target)
    return fingerprint.hexdigest()


def scan_corpus(split: CorpusSplit, *, sample_pairs: int, seed: int = 0) -> CorpusScan:
    """Validate a training split in one streaming pass; count, fingerprint and sample it.

    Validation, count and fingerprint take one pass; the sample is ``sample_pairs`` pairs drawn uniformly without replacement (all pairs
    when the split is not larger), seeded by ``seed`` and in corpus order, so the same
    corpus and seed always give the same sample. Memory is bounded by the sample: the
    first pass keeps the first ``sample_pairs`` pairs; if there are more, the drawn ones
    are collected by a second pass (allocating only them: replacing strings one by one,
    as a reservoir would, fragments the heap until memory grows with the corpus).

    Raises:
      CorpusError: at the first problem with the corpus (see :meth:`CorpusSplit.pairs`).
      ValueError: ``sample_pairs`` < 1, or a split with no pair.
    """
    if sample_pairs < 1:
        raise ValueError(f"sample_pairs must be positive, got {sample_pairs}")
    identity = split.identity()
    fingerprint = _Fingerprint(split.src_lang, split.tgt_lang)
    sources: list[str] = []
    targets: list[str] = []
    for source, target in split.pairs():
        fingerprint.add(source, target)
        if len(sources) < sample_pairs:
            sources.append(source)
            targets.append(target)
    if fingerprint.pairs == 0:
        raise CorpusError(f"{split.origin} [{split.split}]: no sentence pairs")
    if fingerprint.pairs > sample_pairs:
        sources, targets = [], []
        chosen = sorted(random.Random(seed).sample(range(fingerprint.pairs), sample_pairs))
        wanted = iter(chosen)
        next_index = next(wanted)
        for index, (source, target) in enumerate(split.pairs()):
            if index == next_index:
                sources.append(source)
                targets.append(target)
                next_index = next(wanted, -1)
                if next_index < 0:
                    break
    sample = ParallelCorpus(sources, targets, split.src_lang, split.tgt_lang, split.split,
                            split.origin)
    _LOG.info("%s [%s]: %d %s-%s pairs validated, %d sampled", split.origin, split.split,
              fingerprint.pairs, split.src_lang, split.tgt_lang, len(sample))
    return CorpusScan(split, fingerprint.pairs, fingerprint.hexdigest(), sample, identity)


def batched_pairs(pairs: Iterable[tuple[str, str]], size: int) -> Iterator[tuple[list, list]]:
    """``(sources, targets)`` lists of up to ``size`` pairs from a pair stream."""
    iterator = iter(pairs)
    while chunk := list(itertools.islice(iterator, size)):
        yield [s for s, _ in chunk], [t for _, t in chunk]
