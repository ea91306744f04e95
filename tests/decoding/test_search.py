"""Beam search and greedy decoding (keras_transformer.decoding.search)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.decoding.search import beam_search, greedy_search, length_penalty
from keras_transformer.model.transformer import build_transformer
from pipelines.constants import EOS_ID, PAD_ID

VOCAB = 40


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(1)
    return build_transformer("tiny", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def sources():
    """Three sources of different lengths, 0-padded to a common width."""
    rng = np.random.default_rng(0)
    ids = rng.integers(4, VOCAB, size=(3, 9)).astype("int32")
    ids[1, 5:] = PAD_ID
    ids[2, 2:] = PAD_ID
    return ids


def _lengths(ids: np.ndarray) -> np.ndarray:
    return (ids != PAD_ID).sum(axis=-1)


def _assert_well_formed(ids: np.ndarray) -> None:
    """Tokens, at most one EOS and only as the last token, then padding."""
    for row in ids.reshape(-1, ids.shape[-1]):
        length = int((row != PAD_ID).sum())
        assert (row[:length] != PAD_ID).all() and (row[length:] == PAD_ID).all()
        assert (row[: max(length - 1, 0)] != EOS_ID).all()


class TableModel:
    """A fake model whose next-token distribution depends only on the previous token.

    `table[previous_token]` holds next-token probabilities, so every sequence's probability is
    known in advance. Implements the encode/initial_cache/decode API that the search uses.
    """

    def __init__(self, table: np.ndarray):
        self.log_table = tf.constant(np.log(np.maximum(table, 1e-12)), tf.float32)

    def encode(self, source_ids):
        return tf.cast(source_ids, tf.float32)[:, :, None], source_ids != PAD_ID

    def initial_cache(self, encoder_output, max_length):
        batch, length = tf.shape(encoder_output)[0], tf.shape(encoder_output)[1]
        empty, source = tf.zeros([batch, 1, max_length, 1]), tf.zeros([batch, 1, length, 1])
        return ((empty, empty),), ((source, source),)

    def decode(self, target_ids, source_mask, self_cache, cross_cache, cache_update_index,
               grow_cache=False):
        return tf.gather(self.log_table, target_ids), self_cache


def _table_model() -> TableModel:
    """Greedy follows Y (0.55), a dead end; the best sequence is "X EOS" (0.45 * 0.4 = 0.18).

    At step 2 both "Y Z" (0.33) and "Y W" (0.22) have a higher log-prob than the finished
    "X EOS": a beam of 2 that let unfinished hypotheses displace finished ones would lose it.
    """
    vocab = 12
    pad, unk, bos, eos, x, y, z, w = 0, 1, 2, 3, 4, 5, 6, 7
    table = np.full((vocab, vocab), 1.0 / (vocab - 2))  # after Z, W, ...: nothing stands out
    table[:, [pad, bos]] = 0.0
    table[bos] = 0.0
    table[bos, [x, y]] = [0.45, 0.55]
    table[x] = 0.0
    table[x, [eos, z, w]] = [0.4, 0.3, 0.3]
    table[y] = 0.0
    table[y, [z, w]] = [0.6, 0.4]
    del unk
    return TableModel(table)


def test_length_penalty_matches_gnmt_formula():
    assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)
    assert float(length_penalty(10, 0.6)) == pytest.approx((15 / 6) ** 0.6)
    assert float(length_penalty(10, 0.0)) == pytest.approx(1.0)


def test_beam_search_finds_sequence_greedy_misses():
    table_model = _table_model()
    source = np.array([[5, 6, 7]], dtype="int32")
    greedy_ids, _ = greedy_search(table_model, source, extra_length=6)
    assert greedy_ids.numpy()[0, :2].tolist() == [5, 6]  # Y Z ... to the length limit
    assert greedy_ids.shape[1] == 3 + 6

    ids, scores = beam_search(table_model, source, beam_size=2, alpha=0.6, extra_length=6)
    assert ids.numpy()[0].tolist() == [4, EOS_ID]
    expected = np.log(0.45 * 0.4) / ((5 + 2) / 6) ** 0.6
    assert float(scores[0]) == pytest.approx(expected, rel=1e-5)


def test_nbest_is_sorted_and_starts_with_the_best(model, sources):
    best_ids, best_scores = beam_search(model, sources, beam_size=4, extra_length=5)
    ids, scores = beam_search(model, sources, beam_size=4, num_return=3, extra_length=5)
    assert ids.shape[:2] == (3, 3) and scores.shape == (3, 3)
    scores = scores.numpy()
    assert (np.diff(scores, axis=1) <= 0).all()
    np.testing.assert_allclose(scores[:, 0], best_scores.numpy(), rtol=1e-6)
    top = ids.numpy()[:, 0]
    np.testing.assert_array_equal(top[:, : best_ids.shape[1]], best_ids.numpy())
    _assert_well_formed(ids.numpy())
    for hypotheses in ids.numpy():  # three different hypotheses per sentence
        assert len({tuple(row) for row in hypotheses}) == 3


def test_cached_and_uncached_greedy_give_the_same_tokens(model, sources):
    cached, cached_scores = greedy_search(model, sources, extra_length=6)
    uncached, uncached_scores = greedy_search(model, sources, extra_length=6, use_cache=False)
    np.testing.assert_array_equal(cached.numpy(), uncached.numpy())
    np.testing.assert_allclose(cached_scores.numpy(), uncached_scores.numpy(), atol=1e-4)
    _assert_well_formed(cached.numpy())


def test_cached_and_uncached_beam_give_the_same_tokens(model, sources):
    cached, cached_scores = beam_search(model, sources, beam_size=3, extra_length=6)
    uncached, uncached_scores = beam_search(model, sources, beam_size=3, extra_length=6,
                                            use_cache=False)
    np.testing.assert_array_equal(cached.numpy(), uncached.numpy())
    np.testing.assert_allclose(cached_scores.numpy(), uncached_scores.numpy(), atol=1e-4)


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_xla_compiled_step_gives_the_same_tokens(model, sources, search):
    ids, scores = search(model, sources, extra_length=6)
    jit_ids, jit_scores = search(model, sources, extra_length=6, jit_compile=True)
    np.testing.assert_array_equal(ids.numpy(), jit_ids.numpy())
    np.testing.assert_allclose(scores.numpy(), jit_scores.numpy(), atol=1e-4)


def test_beam_size_one_equals_greedy(model, sources):
    # With alpha = 0 both rank by log-probability, so a single beam is greedy decoding.
    greedy_ids, greedy_scores = greedy_search(model, sources, extra_length=6)
    ids, scores = beam_search(model, sources, beam_size=1, alpha=0.0, extra_length=6)
    np.testing.assert_array_equal(ids.numpy(), greedy_ids.numpy())
    np.testing.assert_allclose(scores.numpy(), greedy_scores.numpy(), atol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_an_all_pad_prefix_and_a_tensor_num_return_search_as_without_them(model, sources,
                                                                         jit_compile):
    """What the SavedModel's shared searches rely on (`serving.detailed_signatures`): a
    request without a prefix is searched with an all-PAD one, one beam search returns 1 or
    beam_size hypotheses by a num_return tensor, and a PAD inside a prefix does not end it."""
    # All prefixes here are 3 wide: under XLA, each search compiles once for that shape.
    no_prefix = np.zeros((len(sources), 3), np.int32)
    gapped = np.zeros((len(sources), 3), np.int32)
    gapped[:, 0], gapped[:, 2] = 5, 7
    options = {"extra_length": 6, "jit_compile": jit_compile}
    ids, scores = greedy_search(model, sources, **options)
    padded_ids, padded_scores = greedy_search(model, sources, prefix_ids=no_prefix, **options)
    np.testing.assert_array_equal(padded_ids.numpy(), ids.numpy())
    np.testing.assert_allclose(padded_scores.numpy(), scores.numpy(), rtol=1e-6)

    @tf.function(autograph=False)
    def shared(num_return, prefix_ids):
        return beam_search(model, sources, beam_size=3, num_return=num_return,
                           prefix_ids=prefix_ids, **options)

    for num_return in (1, 3):
        ids, scores = beam_search(model, sources, beam_size=3, num_return=num_return,
                                  **options)
        if num_return == 1:
            ids, scores = ids[:, None], scores[:, None]
        shared_ids, shared_scores = shared(tf.constant(num_return), no_prefix)
        assert shared_ids.shape[1] == num_return
        np.testing.assert_array_equal(shared_ids.numpy(), ids.numpy())
        np.testing.assert_allclose(shared_scores.numpy(), scores.numpy(), rtol=1e-6)
    # A PAD inside a prefix does not end it: the tokens after it are forced too.
    for forced in (greedy_search(model, sources, prefix_ids=gapped, **options)[0],
                   shared(tf.constant(3), gapped)[0]):
        forced = forced.numpy().reshape(len(sources), -1, forced.shape[-1])
        assert (forced[:, :, 0] == 5).all() and (forced[:, :, 2] == 7).all()


def test_a_numpy_num_return_is_a_fixed_one(model, sources):
    """As a Python int, not a tensor (which only a tf.function's search accepts)."""
    best, _ = beam_search(model, sources, beam_size=3, num_return=np.int64(1), extra_length=6)
    assert best.shape.rank == 2


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_batch_results_equal_one_by_one(model, sources, search):
    def run(batch):
        if search == "greedy":
            return greedy_search(model, batch, extra_length=5)
        return beam_search(model, batch, beam_size=3, extra_length=5)

    ids, scores = run(sources)
    for row, source in enumerate(sources):
        alone = source[None, : _lengths(source)]  # no padding at all
        single_ids, single_scores = run(alone)
        single = single_ids.numpy()[0]
        np.testing.assert_array_equal(ids.numpy()[row, : len(single)], single)
        assert (ids.numpy()[row, len(single):] == PAD_ID).all()
        assert float(scores[row]) == pytest.approx(float(single_scores[0]), abs=1e-4)


@pytest.fixture(scope="module")
def eos_free_model():
    """A random tiny model that never emits EOS: its tied EOS embedding gives logit 0, below
    the maximum of the other (unit-variance) logits with overwhelming probability."""
    keras.utils.set_random_seed(2)
    eos_free = build_transformer("tiny", vocab_size=VOCAB)
    embeddings = eos_free.source_embedding.embeddings
    embeddings.assign(tf.tensor_scatter_nd_update(embeddings, [[EOS_ID]], tf.zeros([1, 32])))
    return eos_free


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_untrained_model_stops_exactly_at_the_length_limit(eos_free_model, sources, search):
    ids, _ = search(eos_free_model, sources, extra_length=4)
    np.testing.assert_array_equal(_lengths(ids.numpy()), _lengths(sources) + 4)
    assert (ids.numpy() != EOS_ID).all()
    capped, _ = search(eos_free_model, sources, extra_length=4, max_length=7)
    np.testing.assert_array_equal(_lengths(capped.numpy()), np.minimum(_lengths(sources) + 4, 7))


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_force_length_gives_exact_lengths_without_eos(model, sources, search):
    ids, _ = search(model, sources, force_length=11)
    assert ids.shape == (3, 11)
    assert (ids.numpy() != PAD_ID).all() and (ids.numpy() != EOS_ID).all()


def test_min_length_postpones_eos(model, sources):
    ids, _ = beam_search(model, sources, extra_length=6, min_length=4)
    lengths = _lengths(ids.numpy())
    assert (lengths >= 4).all()
    _assert_well_formed(ids.numpy())


def test_decoding_runs_under_mixed_bfloat16(sources):
    keras.utils.set_random_seed(3)
    bf16 = build_transformer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
    assert bf16.compute_dtype == "bfloat16"
    for search in (greedy_search, beam_search):
        ids, scores = search(bf16, sources, extra_length=3)
        assert ids.dtype == tf.int32 and scores.dtype == tf.float32
        assert (_lengths(ids.numpy()) <= _lengths(sources) + 3).all()
        assert np.isfinite(scores.numpy()).all()
        _assert_well_formed(ids.numpy())


def test_invalid_arguments_are_rejected(model, sources):
    with pytest.raises(ValueError, match="num_return"):
        beam_search(model, sources, beam_size=2, num_return=3)
    with pytest.raises(ValueError, match="num_return may be a tensor only inside"):
        beam_search(model, sources, beam_size=2, num_return=tf.constant(1))
    with pytest.raises(ValueError, match="alpha"):
        beam_search(model, sources, alpha=-1.0)
    with pytest.raises(ValueError, match="max_length"):
        greedy_search(model, sources, max_length=0)


def test_empty_sources_decode(model):
    ids, _ = beam_search(model, np.zeros((2, 0), "int32"), extra_length=3)
    assert ids.shape[0] == 2 and ids.shape[1] <= 3
