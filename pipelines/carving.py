"""Val and test splits carved out of a training split, and its noise dropped: :func:`carve_corpus`.

A corpus of only ``train.{src}``/``train.{tgt}`` still trains: :func:`carve_corpus` holds
out, for each missing split, :func:`carve_size` pairs (``carve_pairs``, 1,000 by default;
at most 5% of a small corpus, yet at least 100 where that leaves 80% to train on).

The rule: each pair gets :func:`pipelines.pair_selection.pair_hash` of (seed, its exact
text); the pairs with the smallest hashes form the bands, val first, then test: the same
corpus and seed always give the same splits, wherever the files are, and a different seed
different ones. Identical pairs hash identically, so every copy of a val or test pair falls
in its band: deduplicated against train for free (no copy of a test sentence pair is
trained on), and within val/test each distinct pair is kept once (the other copies are
counted). The bands are found in one streaming pass that keeps only the candidates (a heap
of the ``carve_pairs`` x bands smallest distinct hashes); memory does not grow with the
corpus. The training split left is the same files with a
:class:`~pipelines.pair_selection.TrainSelection` (the bands' highest hashes), streamed as
before. ``clean`` drops the training side's noise (see :mod:`pipelines.pair_selection`);
counting it takes one more pass.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pipelines import DEFAULT_CARVE_PAIRS
from pipelines.corpora import CorpusError, CorpusSplit, ParallelCorpus
from pipelines.pair_selection import NOISE_REASONS, TrainSelection, noise_reason, pair_hash

CARVE_PAIRS = DEFAULT_CARVE_PAIRS
# Each carved split is at most this share of a corpus... unless that is below
# MIN_CARVE_PAIRS, when up to MAX_SMALL_SHARE is taken to reach it.
MAX_CARVE_SHARE = 0.05
MIN_CARVE_PAIRS = 100
MAX_SMALL_SHARE = 0.10
_LOG = logging.getLogger("pipelines")


@dataclasses.dataclass(frozen=True)
class Carving:
    """What :func:`carve_corpus` made: the training split left (streamed, with its
    selection), the carved splits in memory by name, and ``report``: the counts (for a log
    and results.json)."""

    train: CorpusSplit
    held_out: dict[str, ParallelCorpus]
    report: dict[str, Any]


def carve_size(total_pairs: int, carve_pairs: int = CARVE_PAIRS) -> int:
    """Pairs in each carved split of a corpus of ``total_pairs``: ``carve_pairs``, at most
    5% of the corpus, but at least 100 when that is at most 10% of it.

    >>> carve_size(4_500_000), carve_size(10_000), carve_size(1_000), carve_size(300)
    (1000, 500, 100, 30)
    """
    share = max(int(total_pairs * MAX_CARVE_SHARE),
                min(MIN_CARVE_PAIRS, int(total_pairs * MAX_SMALL_SHARE)))
    return min(carve_pairs, share)


def carve_corpus(split: CorpusSplit, bands: Sequence[str] = ("val", "test"), *,
                 carve_pairs: int = CARVE_PAIRS, seed: int = 0,
                 clean: bool = False) -> Carving:
    """Carve ``bands`` (e.g. ``("val", "test")``, or ``()`` to only clean) out of ``split``.

    Args:
      split: a training split as :func:`pipelines.corpora.open_corpus` returns it (no
        selection yet).
      bands: the names of the splits to carve, in the order of their hash bands.
      carve_pairs: the pairs wanted in each (see :func:`carve_size`).
      seed: seeds the hash: the same seed, the same splits.
      clean: also drop the training side's noise (empty, length-mismatched, duplicate).

    Raises:
      CorpusError: the corpus is invalid, or too small to carve from.
    """
    if split.selection is not None or not (bands or clean):
        raise ValueError(f"{split.origin} [{split.split}]: already carved, or nothing to do")
    wanted = carve_pairs * len(bands)
    # Max-heap (negated hashes) of the `wanted` smallest distinct hashes seen so far, with
    # each one's first index, pair and copies.
    heap: list[tuple[int, int, str, str]] = []
    copies: dict[int, int] = {}
    total = 0
    # With clean, pairs empty on one side are read (not refused) and never carved: the
    # training selection drops and counts them.
    raw = dataclasses.replace(split, keep_one_sided=clean)
    for index, (source, target) in enumerate(raw.pairs() if bands else ()):
        total += 1
        if clean and noise_reason(source, target) == "empty":
            continue
        hash_value = pair_hash(seed, source, target)
        if hash_value in copies:
            copies[hash_value] += 1
        elif len(heap) < wanted:
            heapq.heappush(heap, (-hash_value, index, source, target))
            copies[hash_value] = 1
        elif hash_value < -heap[0][0]:
            evicted = heapq.heapreplace(heap, (-hash_value, index, source, target))
            del copies[-evicted[0]]
            copies[hash_value] = 1
    held_out: dict[str, ParallelCorpus] = {}
    selection_bands: list[tuple[str, int]] = []
    report: dict[str, Any] = {"seed": seed}
    held_out_copies = 0  # every copy of the carved pairs, the first ones included
    if bands:
        size = carve_size(total, carve_pairs)
        candidates = sorted((-negated, index, source, target)
                            for negated, index, source, target in heap)
        # Too few distinct pairs for the bands, or too little left to train on.
        if size < 1 or len(candidates) < size * len(bands) or size * len(bands) * 5 > total:
            raise CorpusError(f"{split.origin} [{split.split}]: {total} pairs are too few to "
                              f"carve {' and '.join(bands)} splits from; add those splits")
        report.update(pairs=total, carve_pairs=carve_pairs)
        for number, name in enumerate(bands):
            band = candidates[number * size:(number + 1) * size]
            band.sort(key=lambda candidate: candidate[1])  # corpus order
            held_out[name] = ParallelCorpus(
                [source for _, _, source, _ in band], [target for _, _, _, target in band],
                split.src_lang, split.tgt_lang, name, split.origin)
            selection_bands.append((name, max(candidate[0] for candidate in band)))
            report[name] = size
            report[f"{name}_copies_dropped"] = sum(copies[candidate[0]] - 1
                                                   for candidate in band)
            held_out_copies += sum(copies[candidate[0]] for candidate in band)
    selection = TrainSelection(seed, tuple(selection_bands), clean)
    train = dataclasses.replace(split, selection=selection)
    if clean:
        dropped: Counter = Counter()
        kept = sum(1 for _ in selection.pairs(raw.pairs(), dropped))
        report["clean"] = {"kept": kept, **{reason: dropped[reason]
                                            for reason in NOISE_REASONS}}
        report.setdefault("pairs", kept + sum(dropped.values()))
    report["train"] = report["clean"]["kept"] if clean else total - held_out_copies
    for line in describe_carving(report, f"{split.origin} [{split.split}]"):
        _LOG.info(line)
    return Carving(train, held_out, report)


def describe_carving(report: dict[str, Any], origin: str) -> list[str]:
    """The log lines of a :class:`Carving`'s report, e.g. "carved 1,000 val and 1,000 test
    pairs from train (seed 0); 12 exact duplicates of them removed from train"."""
    lines = []
    names = [name for name in ("val", "test") if name in report]
    if names:
        copies = sum(report[f"{name}_copies_dropped"] for name in names)
        lines.append(f"{origin}: carved " + " and ".join(f"{report[name]:,} {name}"
                                                        for name in names)
                     + f" pairs from {report['pairs']:,} (seed {report['seed']}); {copies:,} "
                     "exact duplicates of them removed from train")
    if "clean" in report:
        clean = report["clean"]
        lines.append(f"{origin}: --clean-train kept {clean['kept']:,} training pairs, dropped "
                     f"{clean['empty']:,} with an empty side, {clean['length_ratio']:,} "
                     f"length-mismatched, {clean['duplicate']:,} exact duplicates")
    return lines
