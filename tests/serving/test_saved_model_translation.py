"""Translating with a SavedModel through `Translator.translate_batch` and the `translate`
command (keras_transformer.serving.saved_model_translation): the same `Translation`s as the
run directory it was exported from, and a clear error for what the export cannot do."""

from __future__ import annotations

import json

import numpy as np
import pytest

from keras_transformer import translate as translate_command
from keras_transformer.decoding.long_inputs import InputTooLong
from keras_transformer.errors import UsageError
from keras_transformer.serving.saved_model_translation import (
    _detailed,
    _search_length,
    _searched,
)
from keras_transformer.serving.translator import load_translator
from keras_transformer.translate import main
from tests.serving.test_saved_model import (
    _GERMAN,
    MAX_EXTRA,
    MAX_INPUT_TOKENS,
    make_sentences,
    shared_artifacts,
)

# The run directory with the export's limits decodes what the SavedModel decodes.
LIMITS = {"max_input_tokens": MAX_INPUT_TOKENS, "extra_length": MAX_EXTRA}
LINES = ["Ein Hund läuft im Park.", "", " Zwei Kinder.", "Eine Frau sitzt auf einem Ball.",
         *make_sentences(4, _GERMAN, seed=3, lengths=(1, 4))]
LONG_LINE = " ".join(make_sentences(30, _GERMAN, seed=2))  # > 64 tokens: split


@pytest.fixture(scope="module")
def translators(tmp_path_factory):
    """(run directory's Translator, the SavedModel's Translator, the SavedModel folder)."""
    run, export = shared_artifacts(tmp_path_factory)
    return load_translator(run), load_translator(export), export


def _same_hypothesis(ours, theirs, pieces=True):
    assert ours.text == theirs.text
    assert ours.score == pytest.approx(theirs.score, abs=1e-4)
    assert ours.log_prob == pytest.approx(theirs.log_prob, abs=1e-4)
    assert ours.finished == theirs.finished
    if pieces:
        assert ours.pieces == theirs.pieces
        assert ours.alignment == theirs.alignment
        if theirs.token_log_probs is None:
            assert ours.token_log_probs is None
        else:
            np.testing.assert_allclose(ours.token_log_probs, theirs.token_log_probs, atol=1e-4)


def _same(ours, theirs):
    """The same translations; a `retokenized` line (and only such a line) has other
    pieces (those of its text tokenized again), the rest the same."""
    assert len(ours) == len(theirs)
    for mine, expected in zip(ours, theirs, strict=True):
        retokenized = "retokenized" in mine.flags
        assert [flag for flag in mine.flags if flag != "retokenized"] == expected.flags
        assert mine.source_pieces == expected.source_pieces
        assert len(mine.hypotheses) == len(expected.hypotheses)  # the n-best order too
        for ours_h, theirs_h in zip(mine.hypotheses, expected.hypotheses, strict=True):
            _same_hypothesis(ours_h, theirs_h, pieces=not retokenized)
        if retokenized:
            assert mine.hypotheses[0].pieces != expected.hypotheses[0].pieces


@pytest.mark.parametrize("search", [{"beam_size": 3, "num_hypotheses": 2},
                                    {"beam_size": 1}])
def test_beam_and_greedy_are_the_run_directorys(translators, search):
    run, saved, _ = translators
    options = {**search, "return_token_scores": True, "return_alignment": True}
    ours = saved.translate_batch(LINES, **options)
    theirs = run.translate_batch(LINES, **options, **LIMITS)
    _same(ours, theirs)
    assert not any("retokenized" in result.flags for result in ours)  # ids known: exact
    assert ours[1].flags == ["empty_input"] and ours[1].text == ""
    assert len(ours[0].hypotheses) == search.get("num_hypotheses", 1)


def test_samples_are_the_run_directorys_for_the_same_seed_and_line_indices(translators):
    run, saved, _ = translators
    texts = [*LINES, LONG_LINE]  # a split line: each segment seeded by its number
    options = {"beam_size": 1, "sampling_topk": 5, "seed": 9, "return_alignment": True,
               "line_indices": range(10, 10 + len(texts))}
    ours = saved.translate_batch(texts, **options)
    _same(ours, run.translate_batch(texts, **options, **LIMITS))
    assert "split" in ours[-1].flags
    # Resumed at line 3: the same draws for those lines; another seed, other draws.
    resumed = saved.translate_batch(texts[3:], **{**options, "line_indices": range(13, 19)})
    assert [r.text for r in resumed] == [r.text for r in ours[3:]]
    other = saved.translate_batch(texts, **{**options, "seed": 10})
    assert [r.text for r in other] != [r.text for r in ours]


def test_prefixes_are_forced_as_in_the_run_directory(translators):
    run, saved, _ = translators
    prefixes = ["Zwei Hunde", None, "", "Eine", *["A"] * 4]
    options = {"beam_size": 4, "target_prefix": prefixes, "return_token_scores": True,
               "return_alignment": True}
    ours = saved.translate_batch(LINES, **options)
    _same(ours, run.translate_batch(LINES, **options, **LIMITS))
    assert ours[0].text.startswith("Zwei Hunde") and ours[3].text.startswith("Eine")
    # Most prefixed outputs of this model tokenize back to the search's own pieces: the
    # forced decoding's pieces, token log-probs and alignments are then exactly the search's.
    assert any("retokenized" not in ours[line].flags for line in (0, 3, 4, 5, 6, 7))


def test_long_lines_are_split_truncated_or_refused_as_in_the_run_directory(translators):
    run, saved, _ = translators
    texts = ["Ein Hund.", LONG_LINE]
    for options in ({"beam_size": 2, "return_alignment": True},
                    {"beam_size": 1, "max_input_tokens": 24},
                    {"beam_size": 1, "long_inputs": "truncate"}):
        limits = {**LIMITS, **options}
        ours = saved.translate_batch(texts, **options)
        _same(ours, run.translate_batch(texts, **limits))
        assert ("split" in ours[1].flags) == (options.get("long_inputs") != "truncate")
        assert ("truncated" in ours[1].flags) == (options.get("long_inputs") == "truncate")
    with pytest.raises(InputTooLong, match="input line 2 has"):
        saved.translate_batch(texts, long_inputs="error")
    # The strings-only path (no forced pass) gives the same strings and flags.
    strings, flags = saved.translate_saved_model(texts, beam_size=2)
    full = saved.translate_batch(texts, beam_size=2)
    assert strings == [r.text for r in full] and flags == [r.flags for r in full]
    assert saved.translate(texts, beam_size=2) == strings


@pytest.mark.parametrize("options, message", [
    ({"beam_size": 17}, "beam_size at most 16"),
    ({"alpha": 10.5}, "alpha at most 10"),
    ({"max_input_tokens": MAX_INPUT_TOKENS + 1}, "above its limit 64"),
    ({"extra_length": 50}, "plus 6, fixed at export"),
    ({"max_output_tokens": 20}, "below its output limit"),
    ({"return_attention": True}, "return_attention needs the run directory"),
    ({"return_alignment": True, "alignment_layer": 0}, "decoder layer -1"),
    ({"target_prefix": ["Zwei", ""], "num_hypotheses": 2, "beam_size": 2}, "no n-best"),
    ({"target_prefix": ["Zwei", ""], "beam_size": 1, "sampling_topk": 0}, "no n-best"),
    ({"target_prefix": ["Ein Hund " * 40, ""]}, "a prefix of"),
    ({"long_inputs": "truncate", "max_input_tokens": 24}, "input line 2 would be truncated"),
])
def test_what_the_export_cannot_do_is_a_clear_error(translators, options, message):
    _, saved, _ = translators
    with pytest.raises(UsageError, match=message):
        saved.translate_batch(["Ein Hund.", LONG_LINE], **options)


def test_invalid_options_are_the_run_directorys_errors(translators):
    run, saved, _ = translators
    for options in ({"beam_size": 2, "num_hypotheses": 3}, {"beam_size": 4, "sampling_topk": 0},
                    {"sampling_topp": 0.5}, {"alpha": -1.0}):
        with pytest.raises(ValueError) as theirs:
            run.translate_batch(["Ein Hund."], **options)
        with pytest.raises(ValueError) as ours:
            saved.translate_batch(["Ein Hund."], **options)
        assert str(ours.value) == str(theirs.value)


def _out(**arrays):
    return {name: np.asarray(value) for name, value in arrays.items()}


def test_signature_rows_become_hypotheses_as_the_run_directory_makes_them():
    """Finished rows drop EOS from their pieces, unfinished ones have no EOS to drop; a
    search's text whose forced log-prob is not the search's is reported retokenized."""
    from keras_transformer.decoding.batch_decoder import DecodingOptions

    options = DecodingOptions(beam_size=2, alpha=0.6, num_hypotheses=2,
                              return_token_scores=True, return_alignment=True)
    details = _out(outputs=[[b"a b", b"a"]], log_probs=[[-1.5, -3.0]],
                   finished=[[True, False]],
                   pieces=[[[b"\xe2\x96\x81a", b"\xe2\x96\x81b", b"</s>"],
                            [b"\xe2\x96\x81a", b"", b""]]],
                   token_log_probs=[[[-0.5, -0.5, -0.5], [-3.0, 0.0, 0.0]]],
                   alignments=[[b"0-0 1-1", b"0-0"]])
    best, second = (_detailed(details, 0, k, options) for k in range(2))
    assert (best.pieces, best.token_log_probs, best.alignment) == (
        ["▁a", "▁b"], [-0.5, -0.5, -0.5], [(0, 0), (1, 1)])
    assert best.score == pytest.approx(-1.5 / ((5 + 3) / 6) ** 0.6)
    assert (second.pieces, second.token_log_probs, second.finished) == (["▁a"], [-3.0], False)
    searched = _out(outputs=[b"a b", b"a b"], log_probs=[-1.0, -7.0], scores=[-0.9, -6.0],
                    finished=[False, True])
    scored = _out(pieces=[[b"\xe2\x96\x81a", b"\xe2\x96\x81b", b"</s>"]] * 2,
                  token_log_probs=[[-0.5, -0.5, -2.0]] * 2, alignments=[b"0-0 0-1"] * 2,
                  target_truncated=[False, False])
    (cut, cut_retokenized), (other, retokenized) = (
        _searched(searched, scored, row, options) for row in range(2))
    assert not cut_retokenized and cut.token_log_probs == [-0.5, -0.5]  # no EOS scored
    assert (cut.pieces, cut.score, cut.alignment) == (["▁a", "▁b"], -0.9, [(0, 0), (0, 1)])
    assert retokenized and (other.log_prob, other.score) == (-7.0, -6.0)  # the search's
    # A retokenized output's own length, for a split line's joined score: from its score.
    assert _search_length(-7.0, -7.0 / ((5 + 41) / 6) ** 0.6, 0.6, fallback=3) == 41
    assert _search_length(-7.0, -7.0, 0.0, fallback=3) == 3  # no penalty, no length needed


# --- the translate command with --model SAVEDMODEL ---


def test_the_command_writes_marian_nbest_lists_from_a_saved_model(translators, tmp_path,
                                                                    capfd):
    run, _, export = translators
    source = tmp_path / "input.txt"
    source.write_text("Ein Hund.\nZwei Kinder.\n", encoding="utf-8")
    assert main(["--model", str(export.parent), "--input", str(source), "--beam", "3",
                 "--n-best", "2", "--alignment"]) == 0
    fields = [line.split(" ||| ") for line in capfd.readouterr().out.splitlines()]
    expected = run.translate_batch(["Ein Hund.", "Zwei Kinder."], beam_size=3,
                                   num_hypotheses=2, return_alignment=True, **LIMITS)
    hypotheses = [(line, h) for line, r in enumerate(expected) for h in r.hypotheses]
    assert len(fields) == len(hypotheses) == 4
    for field, (line, hypothesis) in zip(fields, hypotheses, strict=True):
        # LINE ||| TRANSLATION ||| ALIGNMENT ||| F0= LOG_PROB ||| SCORE
        assert field[:3] == [str(line), " ".join(hypothesis.text.splitlines()),
                             " ".join(f"{i}-{j}" for i, j in hypothesis.alignment)]
        assert float(field[3].removeprefix("F0= ")) == pytest.approx(hypothesis.log_prob,
                                                                    abs=1e-4)
        assert float(field[4]) == pytest.approx(hypothesis.score, abs=1e-4)


def test_the_command_writes_jsonl_prefixes_and_samples_from_a_saved_model(
        translators, tmp_path, capfd, monkeypatch):
    run, saved, export = translators
    # The SavedModel loaded once (loading is the previous test's): each run here is the
    # command's own work.
    monkeypatch.setattr(translate_command, "load_translator", lambda path: saved)
    source, prefixes = tmp_path / "input.txt", tmp_path / "prefixes.txt"
    source.write_text("\n".join(LINES[:3]) + "\n", encoding="utf-8")
    prefixes.write_text("Zwei\n\n\n", encoding="utf-8")
    assert main(["--model", str(export), "--input", str(source), "--format", "jsonl",
                 "--beam", "2", "--prefix", str(prefixes), "--token-scores"]) == 0
    records = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    expected = run.translate_batch(LINES[:3], beam_size=2, target_prefix=["Zwei", "", ""],
                                   return_token_scores=True, **LIMITS)
    assert [r["translation"] for r in records] == [r.text for r in expected]
    assert records[0]["translation"].startswith("Zwei")
    assert [r["score"] for r in records] == pytest.approx(
        [r.hypotheses[0].score for r in expected], abs=1e-4)
    assert records[1]["flags"] == ["empty_input"]
    assert set(records[2]) >= {"line", "log_prob", "finished", "pieces", "token_log_probs",
                               "source_pieces"}
    assert main(["--model", str(export), "--input", str(source), "--beam", "1",
                 "--sampling-topk", "0", "--seed", "4"]) == 0
    sampled = capfd.readouterr().out.splitlines()
    assert sampled == [" ".join(r.text.splitlines()) for r in run.translate_batch(
        LINES[:3], beam_size=1, sampling_topk=0, seed=4, **LIMITS)]
    assert main(["--model", str(export), "--input", str(source), "--n-best", "2",
                 "--prefix", str(prefixes)]) == 1
    assert "translate: error: " in capfd.readouterr().err
