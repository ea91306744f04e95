"""Word alignments from encoder-decoder attention (3.2.3), in the Pharaoh `i-j` format.

A translation's alignment links source word i to target word j (0-based). Words are the
SentencePiece pieces joined at word boundaries (a piece starting with "▁" starts a word), so
for ordinary text they are the whitespace-separated words of the input and of the output.
Each target word is linked to the one source word its pieces attend to most: the attention of
one decoder layer, averaged over its heads, summed over a source word's pieces and averaged
over a target word's pieces (EOS on either side is left out), times fast_align's diagonal
prior (Dyer et al. 2013): attention alone ties or loses to a plain diagonal on Multi30k's
near-monotone captions, the two together beat both.

Which attention: `DEFAULT_ALIGNMENT_LAYER`, `DEFAULT_SHIFT` and `DEFAULT_TENSION` were chosen
by alignment error rate on the first half of hand-aligned Multi30k val pairs
(tests/data/alignments, `benchmarks/alignment_error_rate.py`, docs/translating.md). With the
shift ("shift-att", Chen et al. 2020) target token t's attention is read from the step that
reads it as input (t + 1) instead of the step that predicts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "DEFAULT_ALIGNMENT_LAYER", "DEFAULT_SHIFT", "DEFAULT_TENSION", "alignment_error_rate",
    "diagonal_alignment", "diagonal_prior", "format_pharaoh", "parse_pharaoh", "piece_words",
    "word_alignment",
]

WORD_START = "▁"
# Chosen on the first half of the hand-aligned val pairs (docs/translating.md#alignments).
DEFAULT_ALIGNMENT_LAYER = -1
DEFAULT_SHIFT = False
DEFAULT_TENSION = 8.0

Links = list[tuple[int, int]]


def piece_words(pieces: Sequence[str]) -> list[int]:
    """The word index of each piece: a piece starting with "▁" starts a new word."""
    words, word = [], -1
    for piece in pieces:
        if piece.startswith(WORD_START) or word < 0:
            word += 1
        words.append(word)
    return words


def diagonal_prior(source_words: int, target_words: int, tension: float) -> np.ndarray:
    """fast_align's diagonal prior (Dyer et al. 2013), (target words, source words):
    exp(-tension * |(i + 0.5) / I - (j + 0.5) / J|); 1 everywhere with tension 0."""
    source = (np.arange(source_words) + 0.5) / source_words
    target = (np.arange(target_words) + 0.5) / target_words
    return np.exp(-tension * np.abs(source[None, :] - target[:, None]))


def word_alignment(attention: np.ndarray, source_pieces: Sequence[str],
                   target_pieces: Sequence[str], shift: bool = DEFAULT_SHIFT,
                   tension: float = DEFAULT_TENSION) -> Links:
    """Source-target word links (i, j), one per target word, in target order.

    Args:
        attention: float (T, S): row t is the attention of the decoder step that predicts
            target piece t (BOS in, then the pieces before t), over the S source pieces.
        source_pieces: the source's pieces without EOS (attention's first columns; further
            columns, EOS and padding, are left out).
        target_pieces: the output's pieces without EOS (attention's first rows).
        shift: read target piece t's attention from row t + 1 (the step that reads it as
            input); the last piece then uses the EOS step's row, when there is one.
        tension: the weight of the diagonal prior multiplied in (`diagonal_prior`; 0: the
            attention alone).
    """
    attention = np.asarray(attention, np.float64)
    if not source_pieces or not target_pieces:
        return []
    rows = np.arange(len(target_pieces))
    if shift:
        rows = np.minimum(rows + 1, attention.shape[0] - 1)
    weights = attention[rows][:, : len(source_pieces)]
    source_words, target_words = piece_words(source_pieces), piece_words(target_pieces)
    # Sum over a source word's pieces, mean over a target word's pieces.
    by_source = np.zeros((len(target_pieces), source_words[-1] + 1))
    np.add.at(by_source.T, source_words, weights.T)
    by_word = np.zeros((target_words[-1] + 1, by_source.shape[1]))
    np.add.at(by_word, target_words, by_source)
    by_word *= diagonal_prior(by_word.shape[1], by_word.shape[0], tension)
    return [(int(np.argmax(row)), j) for j, row in enumerate(by_word)]


def diagonal_alignment(source_words: int, target_words: int) -> Links:
    """The baseline: target word j linked to the source word at the same relative position."""
    if not source_words or not target_words:
        return []
    return [(min(int((j + 0.5) * source_words / target_words), source_words - 1), j)
            for j in range(target_words)]


def format_pharaoh(links: Iterable[tuple[int, int]]) -> str:
    """"0-0 1-2 ..." (source-target, 0-based)."""
    return " ".join(f"{i}-{j}" for i, j in links)


def parse_pharaoh(text: str) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(sure, possible) links of a Pharaoh line: "i-j" sure, "i?j" possible. The possible set
    includes the sure links, as the alignment error rate assumes."""
    sure, possible = set(), set()
    for link in text.split():
        separator = "-" if "-" in link else "?"
        i, j = (int(part) for part in link.split(separator))
        possible.add((i, j))
        if separator == "-":
            sure.add((i, j))
    return sure, possible


def alignment_error_rate(predicted: Iterable[Iterable[tuple[int, int]]],
                         gold: Iterable[tuple[set, set]]) -> float:
    """AER (Och & Ney 2003) over a corpus: 1 - (|A & S| + |A & P|) / (|A| + |S|)."""
    found = agreed_sure = agreed_possible = sure_total = 0
    for links, (sure, possible) in zip(predicted, gold, strict=True):
        links = set(links)
        found += len(links)
        sure_total += len(sure)
        agreed_sure += len(links & sure)
        agreed_possible += len(links & possible)
    if found + sure_total == 0:
        raise ValueError("no links to compare")
    return 1.0 - (agreed_sure + agreed_possible) / (found + sure_total)
