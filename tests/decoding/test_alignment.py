"""Word alignments from attention and their evaluation (keras_transformer.decoding.alignment)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.alignment_error_rate import read_gold, read_split
from keras_transformer.decoding.alignment import (
    alignment_error_rate,
    diagonal_alignment,
    diagonal_prior,
    format_pharaoh,
    parse_pharaoh,
    piece_words,
    word_alignment,
)


def test_pieces_join_into_words_at_the_word_start_marker():
    assert piece_words(["▁Ein", "▁Hund", "e", "▁läuft", "."]) == [0, 1, 1, 2, 2]
    assert piece_words(["ab", "▁c"]) == [0, 1]  # a first piece without the marker: word 0


def test_each_target_word_links_to_the_source_word_its_pieces_attend_to_most():
    source = ["▁Ein", "▁Hund", "e", "▁läuft"]  # words: Ein, Hunde, läuft
    target = ["▁dog", "s", "▁run"]  # words: dogs, run
    attention = np.array([  # rows: predicting dog, s, run, EOS; columns: source + EOS
        [0.1, 0.3, 0.3, 0.2, 0.1],  # Hunde (0.6) beats läuft
        [0.1, 0.2, 0.2, 0.4, 0.1],
        [0.2, 0.1, 0.1, 0.5, 0.1],
        [0.0, 0.0, 0.0, 0.9, 0.1],
    ])
    # dogs: mean over its pieces of the per-word sums: Hunde (0.6 + 0.4) / 2 > läuft 0.3.
    assert word_alignment(attention, source, target, shift=False, tension=0) == [(1, 0), (2, 1)]
    # Shifted: piece t reads row t + 1; "run" reads the EOS row.
    assert word_alignment(attention, source, target, shift=True, tension=0) == [(2, 0), (2, 1)]
    assert word_alignment(attention, [], target) == []
    # The diagonal prior: "dogs" (first of 2 words) now prefers "Ein" (first of 3) over
    # "läuft" (last): 0.15 x exp(-8 x 1/12) > 0.45 x exp(-8 x 7/12).
    assert word_alignment(attention, source, target, shift=True, tension=8) == [(0, 0), (2, 1)]


def test_the_diagonal_prior_is_fast_aligns():
    prior = diagonal_prior(3, 2, 4.0)
    assert prior.shape == (2, 3)
    assert prior[0, 0] == pytest.approx(np.exp(-4.0 * abs(0.5 / 3 - 0.25)))
    np.testing.assert_array_equal(diagonal_prior(3, 2, 0.0), np.ones((2, 3)))


def test_pharaoh_round_trip_and_the_alignment_error_rate():
    sure, possible = parse_pharaoh("0-0 1-1 2?1 3-2")
    assert sure == {(0, 0), (1, 1), (3, 2)} and possible == sure | {(2, 1)}
    assert format_pharaoh(sorted(sure)) == "0-0 1-1 3-2"
    gold = [(sure, possible)]
    assert alignment_error_rate([sure], gold) == 0.0
    assert alignment_error_rate([possible], gold) == 0.0  # possible links cost nothing
    # A = {0-0, 2-2}: |A & S| = 1, |A & P| = 1, |A| = 2, |S| = 3 -> 1 - 2/5.
    assert alignment_error_rate([{(0, 0), (2, 2)}], gold) == pytest.approx(0.6)
    assert diagonal_alignment(4, 2) == [(1, 0), (3, 1)]


def test_the_hand_aligned_val_pairs_fit_their_sentences(multi30k_dir):
    gold = read_gold()
    german, english = read_split(multi30k_dir, "val", "de"), read_split(multi30k_dir, "val",
                                                                         "en")
    assert len(gold) >= 50 and len({index for index, _ in gold}) == len(gold)
    for index, (sure, possible) in gold:
        source_words, target_words = len(german[index].split()), len(english[index].split())
        assert sure and sure <= possible
        assert all(0 <= i < source_words and 0 <= j < target_words for i, j in possible)
    # The baseline the attention alignment has to beat (docs/translating.md).
    diagonal = [diagonal_alignment(len(german[i].split()), len(english[i].split()))
                for i, _ in gold]
    assert 0.3 < alignment_error_rate(diagonal, [links for _, links in gold]) < 0.9
