"""`decoding.scoring.paired_bootstrap`: sacreBLEU's paired bootstrap, from Python."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from keras_transformer.decoding.scoring import paired_bootstrap, score_translations


def _systems(sentences: int = 300, seed: int = 0):
    """References and two systems: the second copies the reference more often."""
    rng = random.Random(seed)
    references = [f"a man in a red shirt climbs rock number {i} today" for i in range(sentences)]
    worse = [r if rng.random() < 0.5 else "a man is climbing" for r in references]
    better = [r if rng.random() < 0.6 else "a man is climbing" for r in references]
    return references, worse, better


def test_a_clearly_better_system_is_significant_and_the_scores_are_sacrebleus():
    references, worse, better = _systems()
    result = paired_bootstrap(worse, better, references)
    assert result["bleu_baseline"] == pytest.approx(score_translations(worse, references)["bleu"])
    assert result["bleu_system"] == pytest.approx(score_translations(better, references)["bleu"])
    assert result["bleu_system"] > result["bleu_baseline"]
    assert result["p_value"] < 0.05
    assert result["ci_baseline"] > 0 and result["ci_system"] > 0
    assert "bs:1000" in result["signature"] and "tok:13a" in result["signature"]
    # The test is of the difference, whichever way it goes (the BLEU scores tell which).
    reversed_order = paired_bootstrap(better, worse, references)
    assert reversed_order["p_value"] == pytest.approx(result["p_value"])
    assert reversed_order["bleu_system"] < reversed_order["bleu_baseline"]


def test_two_systems_of_the_same_quality_are_not_told_apart():
    references, worse, _ = _systems(seed=0)
    _, other_worse, _ = _systems(seed=1)  # the same error rate, on other sentences
    result = paired_bootstrap(worse, other_worse, references)
    assert abs(result["bleu_system"] - result["bleu_baseline"]) < result["ci_baseline"]
    assert result["p_value"] > 0.05


def test_the_p_value_is_the_one_sacrebleus_command_line_gives(tmp_path):
    references, worse, better = _systems(sentences=200, seed=3)
    files = {}
    for name, lines in (("ref", references), ("a", worse), ("b", better)):
        files[name] = tmp_path / f"{name}.txt"
        files[name].write_text("".join(line + "\n" for line in lines))
    completed = subprocess.run(
        [sys.executable, "-m", "sacrebleu", str(files["ref"]), "-i", str(files["a"]),
         str(files["b"]), "-m", "bleu", "--paired-bs", "-f", "json"],
        capture_output=True, text=True, check=True)
    command_line = json.loads(completed.stdout)[1]["BLEU"]
    result = paired_bootstrap(worse, better, references)
    assert result["p_value"] == pytest.approx(command_line["p_value"])
    assert result["bleu_system"] == pytest.approx(command_line["score"])


def test_lists_of_other_lengths_are_refused_with_the_counts():
    references, worse, better = _systems(sentences=20)
    with pytest.raises(ValueError, match="20 baseline and 19 system translations but 20"):
        paired_bootstrap(worse, better[:-1], references)
    with pytest.raises(ValueError, match="no sentences"):
        paired_bootstrap([], [], [])
