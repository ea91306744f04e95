"""What a training corpus holds, in words: pairs, words a side, distinct words and how long
its longest sentences are. `keras_transformer.training.auto_recipe` sizes a run from them
(vocabulary, dropout, model, length limit) before a tokenizer exists, so they are counted on
whitespace words, the one unit every language and corpus here shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

# Enough distinct words to tell a caption corpus (40k) from a news one (130k) or WMT (>1M);
# counting stops growing the set there (the memory of a few hundred MB at most).
MAX_COUNTED_TYPES = 2_000_000


@dataclasses.dataclass(frozen=True)
class CorpusStatistics:
    """Whitespace-word statistics of a parallel training corpus.

    Attributes:
        pairs: sentence pairs.
        source_words, target_words: words on each side, over all pairs.
        word_types: distinct words of both sides together (at most `MAX_COUNTED_TYPES`).
        long_source, long_target: the 99.9th percentile of a sentence's words, each side.
    """

    pairs: int
    source_words: int
    target_words: int
    word_types: int
    long_source: int
    long_target: int

    @property
    def words(self) -> int:
        """Words of both sides."""
        return self.source_words + self.target_words

    @property
    def mean_pair_words(self) -> float:
        """Mean words a pair, the longer side of each (how token budgets count a pair)."""
        return max(self.source_words, self.target_words) / max(self.pairs, 1)

    def describe(self) -> str:
        return (f"{self.pairs:,} pairs, {self.source_words:,} + {self.target_words:,} words "
                f"({self.source_words / max(self.pairs, 1):.1f} + "
                f"{self.target_words / max(self.pairs, 1):.1f} a pair), "
                f"{self.word_types:,} distinct words, 99.9% of sentences within "
                f"{self.long_source} / {self.long_target} words")


def corpus_statistics(pairs: Iterable[tuple[str, str]]) -> CorpusStatistics:
    """One streaming pass over `(source, target)` pairs (a `CorpusSplit.pairs()`).

    Raises:
        ValueError: no pairs, or no words in them.
    """
    count = source_words = target_words = 0
    types: set[str] = set()
    lengths: dict[str, dict[int, int]] = {"source": {}, "target": {}}
    for source, target in pairs:
        count += 1
        for side, sentence in (("source", source), ("target", target)):
            words = sentence.split()
            lengths[side][len(words)] = lengths[side].get(len(words), 0) + 1
            if len(types) < MAX_COUNTED_TYPES:
                types.update(words)
            if side == "source":
                source_words += len(words)
            else:
                target_words += len(words)
    if count == 0:
        raise ValueError("the training split holds no sentence pairs")
    if not types:
        raise ValueError(f"the training split's {count:,} pairs hold no words (empty or "
                         "blank lines only)")
    return CorpusStatistics(count, source_words, target_words, len(types),
                            _percentile(lengths["source"], 0.999),
                            _percentile(lengths["target"], 0.999))


def _percentile(histogram: dict[int, int], fraction: float) -> int:
    """The smallest length that `fraction` of the sentences do not exceed."""
    total, seen = sum(histogram.values()), 0
    for length in sorted(histogram):
        seen += histogram[length]
        if seen >= fraction * total:
            return length
    return max(histogram)
