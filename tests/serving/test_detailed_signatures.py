"""The SavedModel's signatures beyond strings (keras_transformer.serving.detailed_signatures):
the same hypotheses, scores, token log-probs, alignments, samples and prefixes as the Python
API, hostile inputs answered on every one of them (in a process without the project:
tests/serving/test_saved_model.py)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer import run_directory
from keras_transformer.decoding.alignment import format_pharaoh
from keras_transformer.decoding.translator import force_decode, translate_batch
from tests.serving.test_saved_model import (
    _GERMAN,
    HOSTILE,
    MAX_EXTRA,
    MAX_INPUT_TOKENS,
    make_sentences,
    shared_artifacts,
)

# A line starting with a space is not empty; an empty source still scores a target.
SENTENCES = ["Ein Hund läuft im Park.", " Zwei Kinder.", "", "Eine Frau sitzt auf einem Ball."]
LIMITS = {"max_input_tokens": MAX_INPUT_TOKENS, "extra_length": MAX_EXTRA}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, tokenizer, loaded SavedModel, its folder)."""
    run, path = shared_artifacts(tmp_path_factory)
    model, tokenizer = run_directory.load_run(run)
    return model, tokenizer, tf.saved_model.load(str(path)), path


def _strings(tensor) -> list:
    return np.vectorize(lambda value: value.decode("utf-8"), otypes=[object])(
        tensor.numpy()).tolist()


def _call(loaded, name, texts, **extra):
    """A signature called with defaults for its scalar inputs."""
    inputs = {"inputs": tf.constant(texts, tf.string), "alpha": tf.constant(0.6)}
    if name in ("translate_details", "translate_prefix"):
        inputs["beam_size"] = tf.constant(extra.pop("beam_size", 3))
    if name == "translate_prefix":
        inputs["prefixes"] = tf.constant(extra.pop("prefixes", [""] * len(texts)), tf.string)
    if name == "sample":
        inputs.update(line_indices=tf.range(len(texts), dtype=tf.int64),
                      seed=tf.constant(extra.pop("seed", 3), tf.int64),
                      top_k=tf.constant(extra.pop("top_k", 0)),
                      top_p=tf.constant(extra.pop("top_p", 1.0)),
                      temperature=tf.constant(extra.pop("temperature", 1.0)))
    if name == "score":
        inputs["targets"] = tf.constant(extra.pop("targets", ["A dog."] * len(texts)),
                                        tf.string)
    return loaded.signatures[name](**inputs)


def test_details_are_the_python_apis_nbest(served):
    model, tokenizer, loaded, _ = served
    details = _call(loaded, "translate_details", SENTENCES)
    expected = translate_batch(model, tokenizer, SENTENCES, beam_size=3, num_hypotheses=3,
                               return_token_scores=True, return_alignment=True, **LIMITS)
    real = [row for row, text in enumerate(SENTENCES) if text]
    assert [_strings(details["outputs"])[row] for row in real] == [
        [h.text for h in expected[row].hypotheses] for row in real]
    for row in real:
        result = expected[row]
        for k, hypothesis in enumerate(result.hypotheses):
            assert float(details["scores"][row, k]) == pytest.approx(hypothesis.score, abs=1e-4)
            assert float(details["log_probs"][row, k]) == pytest.approx(hypothesis.log_prob, abs=1e-4)
            assert bool(details["finished"][row, k]) == hypothesis.finished
            length = len(hypothesis.token_log_probs)
            np.testing.assert_allclose(details["token_log_probs"][row, k, :length],
                                       hypothesis.token_log_probs, atol=1e-4)
            pieces = _strings(details["pieces"][row, k])
            assert pieces[: len(hypothesis.pieces)] == hypothesis.pieces
            assert set(pieces[length:]) <= {""}
            assert _strings(details["alignments"][row, k]) == format_pharaoh(
                hypothesis.alignment)
    assert _strings(details["outputs"][2]) == ["", "", ""]  # the empty line
    assert not details["truncated"].numpy().any()


def test_score_is_forced_decoding(served):
    model, tokenizer, loaded, _ = served
    targets = ["A dog runs in the park.", "Two children.", "A dog.", "A woman sits on a ball."]
    scored = _call(loaded, "score", SENTENCES, targets=targets)
    expected = force_decode(model, tokenizer, SENTENCES, targets, return_alignment=True,
                            max_input_tokens=MAX_INPUT_TOKENS)
    for row, result in enumerate(expected):
        hypothesis = result.hypotheses[0]
        assert float(scored["log_probs"][row]) == pytest.approx(hypothesis.log_prob, abs=1e-4)
        assert float(scored["scores"][row]) == pytest.approx(hypothesis.score, abs=1e-4)
        np.testing.assert_allclose(scored["token_log_probs"][row, :len(hypothesis.pieces) + 1],
                                   hypothesis.token_log_probs, atol=1e-4)
        assert _strings(scored["alignments"][row]) == format_pharaoh(hypothesis.alignment)
    assert not scored["target_truncated"].numpy().any()
    long_target = _call(loaded, "score", ["Ein Hund."], targets=["a dog " * 200])
    assert long_target["target_truncated"].numpy().tolist() == [True]


def test_samples_and_prefixes_are_the_python_apis(served):
    model, tokenizer, loaded, _ = served
    sampled = _call(loaded, "sample", SENTENCES, top_k=5, seed=9)
    expected = translate_batch(model, tokenizer, SENTENCES, beam_size=1, sampling_topk=5,
                               seed=9, **LIMITS)
    assert _strings(sampled["outputs"]) == [r.text for r in expected]
    np.testing.assert_allclose(sampled["log_probs"], [r.hypotheses[0].log_prob
                                                      for r in expected], atol=1e-4)
    # A NaN top_p means no nucleus limit (1.0), never a degenerate choice.
    nan_top_p = _call(loaded, "sample", SENTENCES, top_k=5, seed=9, top_p=float("nan"))
    assert _strings(nan_top_p["outputs"]) == _strings(sampled["outputs"])
    greedy = _call(loaded, "sample", SENTENCES, top_k=1)
    assert _strings(greedy["outputs"]) == [r.text for r in translate_batch(
        model, tokenizer, SENTENCES, beam_size=1, **LIMITS)]
    prefixes = ["Zwei Hunde", "", "", "Eine"]
    forced = _call(loaded, "translate_prefix", SENTENCES, prefixes=prefixes, beam_size=4)
    expected = translate_batch(model, tokenizer, SENTENCES, beam_size=4,
                               target_prefix=prefixes, **LIMITS)
    assert _strings(forced["outputs"]) == [r.text for r in expected]
    assert _strings(forced["outputs"])[0].startswith("Zwei Hunde")
    np.testing.assert_allclose(forced["scores"], [r.hypotheses[0].score for r in expected],
                               atol=1e-4)


def test_long_inputs_are_truncated_and_flagged(served):
    _, _, loaded, _ = served
    long_line = " ".join(make_sentences(30, _GERMAN, seed=2))
    for name in ("translate_details", "translate_prefix", "sample", "score"):
        flags = _call(loaded, name, ["Ein Hund.", long_line])["truncated"].numpy()
        assert flags.tolist() == [False, True], name


@pytest.mark.parametrize("name", ["translate_details", "translate_prefix", "sample", "score"])
def test_hostile_inputs_and_a_thousand_lines_on_every_signature(served, name):
    _, _, loaded, _ = served
    batch = list(HOSTILE.values())
    outputs = _call(loaded, name, batch)
    assert all(value.shape[0] == len(batch) for value in outputs.values())
    sentences = make_sentences(1000, _GERMAN, seed=5, lengths=(1, 4))
    outputs = _call(loaded, name, sentences)
    assert all(value.shape[0] == 1000 for value in outputs.values())
    empty = _call(loaded, name, [])
    assert all(value.shape[0] == 0 for value in empty.values())
    # Out-of-range knobs are clipped or replaced, never an error.
    if name == "sample":
        odd = _call(loaded, name, ["Ein Hund."], top_k=-4, top_p=float("nan"),
                    temperature=0.0)
        assert odd["outputs"].shape == (1,)


def test_concurrent_requests_get_their_own_answers(served):
    _, _, loaded, _ = served
    requests = [make_sentences(4, _GERMAN, seed=seed) for seed in range(6)]
    alone = [_strings(_call(loaded, "translate_details", texts)["outputs"])
             for texts in requests]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        together = list(pool.map(lambda texts: _strings(
            _call(loaded, "translate_details", texts)["outputs"]), requests))
    assert together == alone
