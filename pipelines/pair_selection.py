"""Which pairs of a training split are trained on: those not held out, and, if asked, not noise.

A :class:`TrainSelection` set on a :class:`pipelines.corpora.CorpusSplit` (its ``selection``
field) filters the pairs it streams; :mod:`pipelines.carving` makes one. It keeps no state
between passes (the duplicate set lives for one pass), so every pass over the split gives
the same pairs, in corpus order, and a prepared corpus keyed by the split's identity stays
valid.

Held out: each pair's :func:`pair_hash` (seeded, of its exact text) is compared with the
bounds of the carved val/test bands; a pair whose hash is at or below the highest bound
belongs to val or test and is never trained on. Identical pairs hash identically, so every
copy of a held-out pair is held out: the deduplication of val/test against train needs no
list of their pairs.

Noise (``clean``): a pair empty on one side; a pair whose longer side has more than
:data:`RATIO_MIN_CHARS` characters and more than :data:`MAX_LENGTH_RATIO` times the
characters of the shorter one (a misalignment: a sentence paired with a fragment or with two
sentences); an exact duplicate of an earlier training pair (the first copy is kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

# The length filter, on characters (no tokenizer is needed before the vocabulary exists).
# Moses' clean-corpus-n.perl drops pairs whose token ratio exceeds 9 (and length > 80
# tokens); WMT systems filter much tighter, e.g. a ratio of 1.5 (Ng et al. 2019, fairseq's
# WMT19 news submission). 3 on characters catches misalignments while keeping the honest
# length differences of European language pairs (German is ~10-20% longer than English);
# pairs of scripts with very different densities (Chinese-English: ~1:3) should not use it.
MAX_LENGTH_RATIO = 3.0
# Short pairs are never dropped for their ratio: "Ja." / "Yes, indeed." is a translation.
RATIO_MIN_CHARS = 20
NOISE_REASONS = ("empty", "length_ratio", "duplicate")
_HASH_FORMAT = 1


def pair_hash(seed: int, source: str, target: str) -> int:
    """A 64-bit hash of ``seed`` and the pair's exact text (BLAKE2b; length-prefixed, so
    ``("ab", "c")`` and ``("a", "bc")`` differ). The same pair and seed give the same value
    on every machine and Python version."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(seed.to_bytes(8, "little", signed=True))
    for text in (source, target):
        encoded = text.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return int.from_bytes(digest.digest(), "little")


def noise_reason(source: str, target: str) -> str | None:
    """"empty" or "length_ratio" for a noisy pair (see the module docstring), else None."""
    if not source.strip() or not target.strip():
        return "empty"
    shorter, longer = sorted((len(source), len(target)))
    if longer > RATIO_MIN_CHARS and longer > MAX_LENGTH_RATIO * shorter:
        return "length_ratio"
    return None


@dataclasses.dataclass(frozen=True)
class TrainSelection:
    """The training pairs of a split: not held out (hash above ``held_out_bound``, or none
    held out when it is -1) and, with ``clean``, not noise.

    ``bands`` names the held-out bands and the highest hash of each, ascending (e.g.
    ``(("val", b1), ("test", b2))``): pairs with hash <= b1 are val, b1 < hash <= b2 test.
    """

    seed: int
    bands: tuple[tuple[str, int], ...] = ()
    clean: bool = False

    @property
    def held_out_bound(self) -> int:
        return self.bands[-1][1] if self.bands else -1

    def role(self, hash_value: int) -> str:
        """"train" or the name of the band that a pair with this hash belongs to."""
        for name, bound in self.bands:
            if hash_value <= bound:
                return name
        return "train"

    def pairs(self, pairs: Iterable[tuple[str, str]],
              dropped: Counter | None = None) -> Iterator[tuple[str, str]]:
        """The selected pairs of ``pairs``, in order; what is left out is counted in
        ``dropped`` by reason ("held_out" and :data:`NOISE_REASONS`). Memory: with ``clean``,
        one 64-bit hash per training pair kept (for the duplicates)."""
        dropped = Counter() if dropped is None else dropped
        bound, seen = self.held_out_bound, set()
        for source, target in pairs:
            reason = noise_reason(source, target) if self.clean else None
            if reason == "empty":  # never carved out either (`pipelines.carving`)
                dropped[reason] += 1
                continue
            hash_value = pair_hash(self.seed, source, target)
            if hash_value <= bound:
                dropped["held_out"] += 1
                continue
            if self.clean:
                if reason is None and hash_value in seen:
                    reason = "duplicate"
                if reason is not None:
                    dropped[reason] += 1
                    continue
                seen.add(hash_value)
            yield source, target

    def identity(self) -> dict[str, Any]:
        """What the selection adds to its split's identity (caches of prepared data)."""
        return {"format": _HASH_FORMAT, "seed": self.seed,
                "bands": [list(band) for band in self.bands], "clean": self.clean}
