"""The translation interface (keras_transformer.decoding.translator): scores with an exact
meaning, n-best lists, forced decoding, sampling, forced prefixes, alignments, long inputs."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.decoding.alignment import piece_words
from keras_transformer.decoding.long_inputs import InputTooLong, split_sentences
from keras_transformer.decoding.results import penalized_score
from keras_transformer.decoding.sampling import (
    Sampling,
    choose_tokens,
    line_seeds,
    line_seeds_numpy,
)
from keras_transformer.decoding.scoring import score_translations
from keras_transformer.decoding.search import greedy_search
from keras_transformer.decoding.translator import (
    force_decode,
    length_batches,
    translate_and_score,
    translate_batch,
    translate_texts,
)
from pipelines.constants import EOS_ID
from tests.serving.test_saved_model import (
    _ENGLISH,
    _GERMAN,
    make_model,
    make_sentences,
    make_tokenizer,
)

ALPHA = 0.6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def model(tokenizer):
    """An untrained tiny model nudged towards EOS (its last LayerNorm's beta along the EOS
    embedding), so that searches end some hypotheses with EOS and cut others at the limit."""
    model = make_model(tokenizer.vocab_size)
    embeddings = model.target_embedding.embeddings.numpy()
    norm = model.decoder_layers[-1].feed_forward_block.norm
    norm.beta.assign(norm.beta.numpy()
                     + 2.3 * embeddings[EOS_ID] / np.linalg.norm(embeddings[EOS_ID]))
    return model


@pytest.fixture(scope="module")
def lines():
    """Unseen sentences: made from the tokenizer's words with another seed."""
    return make_sentences(24, _GERMAN, seed=11)


@pytest.fixture(scope="module")
def nbest(model, tokenizer, lines):
    return translate_batch(model, tokenizer, lines, beam_size=4, num_hypotheses=4, alpha=ALPHA,
                           return_token_scores=True, return_attention=True, max_output_tokens=20)


def test_scores_have_their_documented_meaning(nbest):
    hypotheses = [h for result in nbest for h in result.hypotheses]
    assert any(h.finished for h in hypotheses) and not all(h.finished for h in hypotheses)
    for hypothesis in hypotheses:
        length = len(hypothesis.pieces) + int(hypothesis.finished)  # EOS counts when emitted
        assert len(hypothesis.token_log_probs) == length
        assert sum(hypothesis.token_log_probs) == pytest.approx(hypothesis.log_prob, abs=1e-4)
        assert hypothesis.score == pytest.approx(
            hypothesis.log_prob / ((5 + length) / 6) ** ALPHA, abs=1e-5)
        if not hypothesis.finished:
            assert length == 20  # only the length limit ends a hypothesis without EOS


def test_nbest_lists_are_distinct_and_best_first(nbest):
    for result in nbest:
        assert len(result.hypotheses) == 4
        scores = [h.score for h in result.hypotheses]
        assert scores == sorted(scores, reverse=True)
        assert len({(tuple(h.pieces), h.finished) for h in result.hypotheses}) == 4
        assert ("length_limit" in result.flags) == (not result.hypotheses[0].finished)


def test_the_best_of_the_nbest_is_the_one_best_translation(model, tokenizer, lines, nbest):
    best = translate_batch(model, tokenizer, lines, beam_size=4, alpha=ALPHA,
                           max_output_tokens=20)
    assert [r.text for r in best] == [result.text for result in nbest]
    assert [r.hypotheses[0].score for r in best] == pytest.approx(
        [result.hypotheses[0].score for result in nbest], abs=1e-5)
    assert translate_texts(model, tokenizer, lines[:4]) == [
        r.text for r in translate_batch(model, tokenizer, lines[:4])]


def test_forcing_a_hypothesis_gives_back_its_score(model, tokenizer, lines, nbest):
    pairs = [(line, h) for line, result in zip(lines, nbest, strict=True)
             for h in result.hypotheses if h.finished]
    forced = force_decode(model, tokenizer, [line for line, _ in pairs],
                          [h.pieces for _, h in pairs], alpha=ALPHA, batch_size=7)
    for (_, hypothesis), result in zip(pairs, forced, strict=True):
        assert result.hypotheses[0].log_prob == pytest.approx(hypothesis.log_prob, abs=1e-4)
        assert result.hypotheses[0].score == pytest.approx(hypothesis.score, abs=1e-4)
        assert result.hypotheses[0].token_log_probs == pytest.approx(
            hypothesis.token_log_probs, abs=1e-4)


def test_forced_decoding_of_text_scores_eos_and_refuses_or_flags_long_sources(model, tokenizer):
    sources, targets = ["Ein Hund läuft.", ""], ["A dog runs.", ""]
    results = force_decode(model, tokenizer, sources, targets)
    for result in results:
        hypothesis = result.hypotheses[0]
        assert hypothesis.finished
        assert len(hypothesis.token_log_probs) == len(hypothesis.pieces) + 1
        assert hypothesis.log_prob < 0
    assert results[1].flags == ["empty_input"] and results[1].hypotheses[0].pieces == []
    long_source = "Ein Hund läuft. " * 40
    with pytest.raises(InputTooLong, match="line 2"):
        force_decode(model, tokenizer, ["Ein Hund.", long_source], ["A dog.", "A dog."],
                     max_input_tokens=32)
    truncated = force_decode(model, tokenizer, [long_source], ["A dog."], max_input_tokens=32,
                             long_inputs="truncate")
    assert truncated[0].flags == ["truncated"] and len(truncated[0].source_pieces) == 31
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        force_decode(model, tokenizer, sources, targets[:1])


def test_topk_one_is_greedy_and_tiny_topp_is_greedy(model, tokenizer, lines):
    from keras_transformer.decoding.search import encode_texts
    source = encode_texts(tokenizer, tf.constant(lines[:8])).to_tensor()
    seeds = line_seeds(5, tf.range(8))
    greedy, greedy_scores = greedy_search(model, source, max_length=20)
    for sampling in (Sampling(top_k=1, seed=5), Sampling(top_p=1e-6, seed=5)):
        sampled, scores = greedy_search(model, source, max_length=20, sampling=sampling,
                                        seeds=seeds)
        np.testing.assert_array_equal(sampled.numpy(), greedy.numpy())
        np.testing.assert_allclose(scores.numpy(), greedy_scores.numpy(), atol=1e-5)


def test_sampling_draws_follow_the_distribution():
    """Inverse transform sampling over the kept candidates: frequencies match the softmax of
    log-probs / temperature, restricted to the top k."""
    log_probs = tf.math.log(tf.constant([[0.5, 0.3, 0.15, 0.05]]))
    rows = 20000
    uniforms = tf.range(rows, dtype=tf.float32) / rows  # an even grid over [0, 1)
    tiled = tf.tile(log_probs, [rows, 1])
    counts = np.bincount(choose_tokens(tiled, uniforms, Sampling()).numpy(), minlength=4) / rows
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=1e-3)
    top2 = np.bincount(choose_tokens(tiled, uniforms, Sampling(top_k=2)).numpy(),
                       minlength=4) / rows
    np.testing.assert_allclose(top2, [0.625, 0.375, 0, 0], atol=1e-3)
    # Top-p draws again after a rejection, from hashed uniforms: tests/decoding/test_sampling.py.
    hot = np.bincount(choose_tokens(tiled, uniforms, Sampling(temperature=0.5)).numpy(),
                      minlength=4) / rows
    squared = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(hot, squared / squared.sum(), atol=1e-3)


def test_line_seeds_are_the_same_in_numpy_and_tensorflow():
    indices = [0, 1, 2, 7, 10**6, 2**31 - 1]
    np.testing.assert_array_equal(line_seeds(123, indices).numpy(),
                                  line_seeds_numpy(123, indices))
    assert len(set(line_seeds_numpy(0, range(1000)).tolist())) == 1000


def test_samples_depend_on_seed_and_line_not_on_batching_or_order(model, tokenizer, lines):
    options = {"beam_size": 1, "sampling_topk": 0, "seed": 3, "max_output_tokens": 20}
    whole = translate_batch(model, tokenizer, lines, **options)
    reversed_small = translate_batch(model, tokenizer, lines[::-1], batch_size=3,
                                     line_indices=list(range(len(lines)))[::-1], **options)
    assert [r.hypotheses[0].pieces for r in whole] == [
        r.hypotheses[0].pieces for r in reversed_small[::-1]]
    # A run resumed at line 10 draws what the whole run drew there.
    resumed = translate_batch(model, tokenizer, lines[10:], line_indices=range(10, len(lines)),
                              **options)
    assert [r.text for r in resumed] == [r.text for r in whole[10:]]
    with pytest.raises(ValueError, match="3 line indices for"):
        translate_batch(model, tokenizer, lines, line_indices=[0, 1, 2], **options)
    other_seed = translate_batch(model, tokenizer, lines, **{**options, "seed": 4})
    assert [r.text for r in other_seed] != [r.text for r in whole]
    greedy = translate_batch(model, tokenizer, lines, beam_size=1, max_output_tokens=20)
    assert [r.text for r in whole] != [r.text for r in greedy]
    finished = [(line, r.hypotheses[0]) for line, r in zip(lines, whole, strict=True)
                if r.hypotheses[0].finished]
    forced = force_decode(model, tokenizer, [line for line, _ in finished],
                          [h.pieces for _, h in finished])
    for (_, sampled), result in zip(finished, forced, strict=True):  # the model's log-prob
        assert result.hypotheses[0].log_prob == pytest.approx(sampled.log_prob, abs=1e-4)


def test_invalid_sampling_options_are_refused(model, tokenizer):
    with pytest.raises(ValueError, match="sampling_topk"):
        translate_batch(model, tokenizer, ["x"], beam_size=1, sampling_topp=0.9)
    with pytest.raises(ValueError, match="beam_size 1"):
        translate_batch(model, tokenizer, ["x"], beam_size=4, sampling_topk=0)
    with pytest.raises(ValueError, match="num_hypotheses"):
        translate_batch(model, tokenizer, ["x"], beam_size=2, num_hypotheses=3)


@pytest.mark.parametrize("options", [{"beam_size": 4, "num_hypotheses": 2}, {"beam_size": 1},
                                     {"beam_size": 1, "sampling_topk": 5, "seed": 1}])
def test_a_forced_prefix_starts_the_output_and_counts_in_the_score(model, tokenizer, lines,
                                                                    options):
    prefixes = [make_sentences(1, _ENGLISH, seed=i, lengths=(1, 3))[0].rstrip(".")
                if i % 3 else None for i in range(len(lines))]
    results = translate_batch(model, tokenizer, lines, target_prefix=prefixes,
                              max_output_tokens=20, **options)
    for prefix, result in zip(prefixes, results, strict=True):
        for hypothesis in result.hypotheses:
            if prefix:
                prefix_pieces = [p.decode() for p in tokenizer.id_to_piece(
                    tokenizer.tokenize(tf.constant([prefix]))[0]).numpy()]
                assert hypothesis.pieces[: len(prefix_pieces)] == prefix_pieces
                assert hypothesis.text.startswith(prefix)
    pairs = [(line, h) for line, result in zip(lines, results, strict=True)
             for h in result.hypotheses if h.finished]
    forced = force_decode(model, tokenizer, [line for line, _ in pairs],
                          [h.pieces for _, h in pairs])
    assert pairs
    for (_, hypothesis), result in zip(pairs, forced, strict=True):
        assert result.hypotheses[0].log_prob == pytest.approx(hypothesis.log_prob, abs=1e-4)


def test_long_lines_are_split_truncated_or_refused_and_flagged(model, tokenizer):
    sentences = make_sentences(12, _GERMAN, seed=3, lengths=(6, 9))
    long_line = " ".join(sentences)
    texts = ["Ein Hund.", long_line, "", "Zwei Kinder."]
    split = translate_batch(model, tokenizer, texts, max_input_tokens=24, beam_size=2,
                            return_token_scores=True, return_alignment=True)
    assert len(split) == 4 and split[1].flags[:1] == ["split"]
    assert split[2].text == "" and split[2].flags == ["empty_input"]
    assert split[0].flags in ([], ["length_limit"])
    joined = split[1].hypotheses[0]
    assert sum(joined.token_log_probs) == pytest.approx(joined.log_prob, abs=1e-3)
    source_words = len(long_line.split())
    assert all(0 <= i < source_words for i, _ in joined.alignment)
    # Each segment alone gives the same output: the line's output is its segments' outputs.
    segments = translate_batch(model, tokenizer, _segments_of(long_line, tokenizer, 24),
                               max_input_tokens=24, beam_size=2, return_token_scores=True)
    assert joined.text == " ".join(r.text for r in segments if r.text)
    # token_log_probs: one entry per piece, segment after segment, then the segments' EOS
    # log-probs together in one last entry.
    bests = [r.hypotheses[0] for r in segments]
    assert len(joined.token_log_probs) == len(joined.pieces) + any(b.finished for b in bests)
    assert joined.token_log_probs[:len(joined.pieces)] == pytest.approx(
        [value for b in bests for value in b.token_log_probs[:len(b.pieces)]], abs=1e-4)
    truncated = translate_batch(model, tokenizer, texts, max_input_tokens=24, beam_size=2,
                                long_inputs="truncate")
    assert truncated[1].flags[:1] == ["truncated"] and len(truncated[1].source_pieces) == 23
    with pytest.raises(InputTooLong, match="line 2 has"):
        translate_batch(model, tokenizer, texts, max_input_tokens=24, long_inputs="error")


def _segments_of(text, tokenizer, max_input_tokens):
    from keras_transformer.decoding.long_inputs import segment_lines

    def count(items):
        return [int(n) for n in tokenizer.tokenize(tf.constant(list(items))).row_lengths()]
    segments, _ = segment_lines([text], count, max_input_tokens)
    return [segment.text for segment in segments]


def test_sentences_are_split_after_final_punctuation():
    assert split_sentences('Ein Hund. "Zwei Katzen!" Drei?  Vier… fünf') == [
        "Ein Hund.", '"Zwei Katzen!"', "Drei?", "Vier…", "fünf"]
    assert split_sentences("3.5 Meter hoch") == ["3.5 Meter hoch"]


def test_outputs_do_not_depend_on_batching(model, tokenizer, lines):
    texts = [*lines, "Ein Hund. " * 30, ""]
    options = {"beam_size": 4, "num_hypotheses": 2, "max_input_tokens": 32}
    together = translate_batch(model, tokenizer, texts, **options)
    alone = translate_batch(model, tokenizer, texts, batch_size=1, **options)
    by_tokens = translate_batch(model, tokenizer, texts, batch_tokens=300, **options)
    for results in (alone, by_tokens):
        assert [[h.text for h in r.hypotheses] for r in results] == [
            [h.text for h in r.hypotheses] for r in together]
        assert np.allclose([r.hypotheses[0].score for r in results],
                           [r.hypotheses[0].score for r in together], atol=1e-4)


def test_batches_are_bounded_in_rows_and_tokens():
    costs = np.array([5, 100, 7, 3000, 50, 50, 8])
    batches = length_batches(costs, batch_size=3, batch_tokens=200)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(costs)))
    for rows in batches:
        assert len(rows) <= 3
        assert len(rows) == 1 or len(rows) * costs[rows].max() <= 200
    assert [3] in [rows.tolist() for rows in batches]  # over the budget: alone


def test_alignments_link_every_output_word_once(nbest, lines):
    """Words are pieces joined at "▁": for text, its words (this untrained model's outputs
    are mostly byte pieces, so their words are counted from the pieces)."""
    for line, result in zip(lines, nbest, strict=True):
        assert len(set(piece_words(result.source_pieces))) == len(line.split())
        for hypothesis in result.hypotheses:
            target_words = len(set(piece_words(hypothesis.pieces)))
            assert [j for _, j in hypothesis.alignment] == list(range(target_words))
            assert all(0 <= i < len(line.split()) for i, _ in hypothesis.alignment)
            assert hypothesis.attention.shape[1] == len(result.source_pieces) + 1  # and EOS


def test_penalized_score_is_gnmt():
    assert penalized_score(-6.0, 7, 0.6) == pytest.approx(-6.0 / 2.0 ** 0.6)
    assert penalized_score(-6.0, 7, 0.0) == -6.0


def test_extreme_temperatures_never_sample_forbidden_tokens(model, tokenizer, lines):
    from keras_transformer.decoding.search import encode_texts
    from pipelines.constants import BOS_ID, PAD_ID
    source = encode_texts(tokenizer, tf.constant(lines[:8])).to_tensor()
    seeds = line_seeds(2, tf.range(8))
    greedy, _ = greedy_search(model, source, max_length=20)
    cold, _ = greedy_search(model, source, max_length=20, seeds=seeds,
                            sampling=Sampling(temperature=1e-30))
    np.testing.assert_array_equal(cold.numpy(), greedy.numpy())  # all mass on the best
    hot, scores = greedy_search(model, source, max_length=20, seeds=seeds,
                                sampling=Sampling(temperature=1e30))
    for row in hot.numpy():
        length = int((row != PAD_ID).sum())
        assert (row[:length] != PAD_ID).all() and (row != BOS_ID).all()
    assert np.isfinite(scores.numpy()).all() and (scores.numpy() > -1e6).all()
    with pytest.raises(ValueError, match="finite"):
        Sampling(temperature=float("inf"))


def test_translate_and_score_keeps_the_translations_it_scores(model, tokenizer, lines,
                                                             tmp_path):
    """What a run's test split and a fine-tuning's before and after use: the file holds one
    line per source, the same lines `translate_texts` gives, and the scores are theirs."""
    references = make_sentences(len(lines[:6]), _ENGLISH, seed=12)
    kept = tmp_path / "test.hyp.txt"
    hypotheses, scores = translate_and_score(model, tokenizer, lines[:6], references, kept,
                                             beam_size=2, alpha=ALPHA)
    assert hypotheses == translate_texts(model, tokenizer, lines[:6], beam_size=2, alpha=ALPHA)
    assert kept.read_text(encoding="utf-8").split("\n") == [*hypotheses, ""]
    assert scores == score_translations(hypotheses, references)
