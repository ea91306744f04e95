"""The sampler's draws (`decoding.sampling`): each sort-free way against its plain reference."""

import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.decoding import sampling
from keras_transformer.decoding.sampling import (
    Sampling,
    choose_tokens,
    line_seeds,
    next_uniforms,
    next_uniforms_numpy,
    step_uniforms,
)


def _log_probs(rows, vocab, sharpness, seed=0):
    rng = np.random.default_rng(seed)
    return tf.nn.log_softmax(rng.normal(size=(rows, vocab)).astype(np.float32) * sharpness)


def _uniforms(rows, step=3):
    return step_uniforms(line_seeds(11, tf.range(rows)), step)


def test_next_uniforms_are_their_numpy_twin_and_new_draws():
    first = _uniforms(4000)
    draws = [first.numpy()]
    for draw in (1, 2, 15):
        uniforms = next_uniforms(first, draw).numpy()
        np.testing.assert_array_equal(uniforms, next_uniforms_numpy(first.numpy(), draw))
        assert 0 <= uniforms.min() and uniforms.max() < 1
        draws.append(uniforms)
    correlations = np.corrcoef(np.stack(draws))
    assert np.abs(correlations[np.triu_indices(4, 1)]).max() < 0.05
    assert abs(np.mean(draws[1]) - 0.5) < 0.02


# Blocks of 12 tokens for 1,000 and 997, of 40 for 8,000: k = 200 and 900 take the plain
# `tf.math.top_k` (two stages would read half the vocabulary or more).
@pytest.mark.parametrize(("vocab", "k"), [(1000, 1), (1000, 7), (1000, 40), (997, 5),
                                          (8000, 10), (8000, 100), (8000, 200), (8000, 900)])
def test_top_k_in_two_stages_is_tf_top_k(vocab, k):
    """The k best blocks hold the k best tokens: the same values and ids as `tf.math.top_k`,
    ties included (bfloat16-rounded logits), with forbidden (-1e9) and -inf tokens about, and
    a vocabulary that blocks do not divide."""
    logits = tf.cast(tf.cast(_log_probs(16, vocab, 3.0), tf.bfloat16), tf.float32).numpy()
    logits[:, ::7] = -1e9
    logits[:, 3::11] = -np.inf
    logits = tf.constant(logits)
    expected = tf.math.top_k(logits, k=k)
    for top_k in (k, tf.constant(k)):
        values, ids = sampling._top_k(logits, top_k, compiled=False)
        np.testing.assert_array_equal(values.numpy(), expected.values.numpy())
        np.testing.assert_array_equal(ids.numpy(), expected.indices.numpy())

    @tf.function(jit_compile=True)
    def compiled(logits, k):
        return sampling._top_k(logits, k, compiled=True)

    values, ids = compiled(logits, tf.constant(k))
    np.testing.assert_array_equal(values.numpy()[:, :k], expected.values.numpy())
    np.testing.assert_array_equal(ids.numpy()[:, :k], expected.indices.numpy())
    assert np.isneginf(values.numpy()[:, k:]).all()


def test_top_k_with_fewer_finite_tokens_than_k_returns_valid_ids():
    logits = np.full((2, 997), -np.inf, np.float32)
    logits[:, 996] = 0.0
    values, ids = sampling._top_k(tf.constant(logits), 5, compiled=False)
    assert ids.numpy()[:, 0].tolist() == [996, 996] and (ids.numpy() < 997).all()
    drawn = choose_tokens(tf.constant(logits), _uniforms(2), Sampling(top_k=5))
    assert drawn.numpy().tolist() == [996, 996]


@pytest.mark.parametrize("vocab", [1000, 997, 8000])
def test_vocabulary_draw_in_two_levels_is_the_flat_inverse_transform(vocab):
    log_probs = _log_probs(256, vocab, 3.0).numpy()
    log_probs[:, 1::3] = -1e9  # forbidden: no mass
    log_probs[-1] = -1e9  # a row without any mass: its argmax
    log_probs[-1, 5] = -1e8
    probs = tf.exp(tf.constant(log_probs))
    uniforms = tf.range(256, dtype=tf.float32) / 256
    chosen = sampling._vocabulary_choice(probs, uniforms, tf.constant(log_probs)).numpy()
    flat = sampling._inverse_transform(probs, uniforms).numpy()
    assert (chosen[:-1] == flat[:-1]).mean() >= 0.99  # float32 sums in another order
    assert (probs.numpy()[np.arange(255), chosen[:-1]] > 0).all()
    assert chosen[-1] == 5


def _nucleus_draw_numpy(log_probs, u, top_p, max_draws=sampling.MAX_NUCLEUS_DRAWS):
    """`_nucleus_choice` for one row in numpy (float64): rejection sampling from the tokens
    above the floor, keeping a token when the tokens more likely than it hold less than
    top_p of the mass; after max_draws draws, the sorted nucleus with the next uniform."""
    probs = np.exp(log_probs.astype(np.float64))
    target = top_p * probs.sum()
    best = int(np.argmax(log_probs))
    if probs[best] >= target:
        return best
    floor = -np.inf
    for draw in range(max_draws):
        uniform = u if draw == 0 else next_uniforms_numpy(np.float32(u), draw)
        cumulative = np.cumsum(np.where(log_probs > floor, probs, 0.0))
        token = min(int((cumulative <= uniform * cumulative[-1]).sum()), len(probs) - 1)
        if probs[log_probs > log_probs[token]].sum() < target:
            return token
        floor = log_probs[token]
    return _sorted_nucleus_draw_numpy(log_probs, next_uniforms_numpy(np.float32(u), max_draws),
                                      top_p)


def _sorted_nucleus_draw_numpy(log_probs, u, top_p):
    probs = np.exp(log_probs.astype(np.float64))
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order] / probs.sum()
    kept = sorted_probs * ((np.cumsum(sorted_probs) - sorted_probs) < top_p)
    cumulative = np.cumsum(kept)
    return order[min(int((cumulative <= u * cumulative[-1]).sum()), len(probs) - 1)]


def _in_nucleus(log_probs, token, top_p):
    """Whether `token` is in the row's nucleus (float32 rounding allowed): the tokens more
    likely than it hold less than top_p of the mass (no ties in these tests' rows)."""
    probs = np.exp(log_probs.astype(np.float64))
    return probs[log_probs > log_probs[token]].sum() < top_p * probs.sum() + 1e-5


@pytest.mark.parametrize("sharpness", [0.2, 3.0, 8.0])  # nuclei of ~850, tens, a few tokens
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_nucleus_draws_are_their_numpy_mirror_and_in_the_nucleus(sharpness, top_p):
    log_probs = _log_probs(128, 1000, sharpness)
    uniforms = _uniforms(128)
    chosen = choose_tokens(log_probs, uniforms, Sampling(top_p=top_p)).numpy()
    rows = log_probs.numpy()
    expected = [_nucleus_draw_numpy(row, u, top_p) for row, u in zip(rows, uniforms.numpy(),
                                                                     strict=True)]
    assert (chosen == np.array(expected)).mean() >= 0.97  # float32 sums at boundaries
    assert all(_in_nucleus(row, token, top_p) for row, token in zip(rows, chosen, strict=True))


def test_nucleus_draws_follow_the_renormalized_nucleus():
    """Rejections draw again from hashed uniforms: frequencies within sampling error."""
    rows = 40000
    uniforms = tf.range(rows, dtype=tf.float32) / rows
    tiled = tf.tile(tf.math.log(tf.constant([[0.5, 0.3, 0.15, 0.05]])), [rows, 1])
    for top_p, expected in ((0.7, [0.625, 0.375, 0, 0]), (0.85, [0.5 / 0.95, 0.3 / 0.95,
                                                                 0.15 / 0.95, 0])):
        drawn = choose_tokens(tiled, uniforms, Sampling(top_p=top_p)).numpy()
        np.testing.assert_allclose(np.bincount(drawn, minlength=4) / rows, expected, atol=0.01)
    # A label-smoothed model's step: one token with 0.85, the rest a near-flat tail, so
    # the nucleus of 0.9 is the best token and the tail's most likely ~5% of the mass.
    tail = np.linspace(1.2, 0.8, 2000)
    probs = np.concatenate([[0.85], 0.15 * tail / tail.sum()])
    log_probs = tf.tile(tf.math.log(tf.constant(probs[None], tf.float32)), [rows, 1])
    drawn = choose_tokens(log_probs, uniforms, Sampling(top_p=0.9)).numpy()
    nucleus = int(np.searchsorted(np.cumsum(probs) - probs, 0.9))  # tokens 0 .. nucleus-1
    assert drawn.max() < nucleus
    assert abs((drawn == 0).mean() - 0.85 / probs[:nucleus].sum()) < 0.01


def test_rows_still_rejected_after_the_last_draw_take_the_sorted_nucleus(monkeypatch):
    log_probs = _log_probs(64, 1000, 3.0)
    uniforms = _uniforms(64)
    pairs = list(zip(log_probs.numpy(), uniforms.numpy(), strict=True))
    for max_draws in (0, 1):
        monkeypatch.setattr(sampling, "MAX_NUCLEUS_DRAWS", max_draws)
        chosen = choose_tokens(log_probs, uniforms, Sampling(top_p=0.9)).numpy()
        expected = [_nucleus_draw_numpy(row, u, 0.9, max_draws) for row, u in pairs]
        assert (chosen == np.array(expected)).mean() >= 0.97
    # With max_draws 0 every row not settled by its best token draws from the sorted nucleus.
    monkeypatch.setattr(sampling, "MAX_NUCLEUS_DRAWS", 0)
    for row, u in pairs:
        drawn = choose_tokens(row[None], tf.constant([u]), Sampling(top_p=0.9))
        assert _in_nucleus(row, int(drawn[0]), 0.9)


def test_tokens_tied_at_the_nucleus_boundary(monkeypatch):
    """Rejection sampling keeps every token tied with the nucleus' least likely one; the
    sorted nuclei (with top-k, and the fallback) keep ties in id order, up to top_p."""
    rows = 20000
    uniforms = tf.range(rows, dtype=tf.float32) / rows
    tiled = tf.tile(tf.math.log(tf.constant([[0.4, 0.2, 0.2, 0.2]])), [rows, 1])
    drawn = choose_tokens(tiled, uniforms, Sampling(top_p=0.5)).numpy()
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / rows, [0.4, 0.2, 0.2, 0.2],
                               atol=0.01)
    drawn = choose_tokens(tiled, uniforms, Sampling(top_k=4, top_p=0.5)).numpy()
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / rows, [2 / 3, 1 / 3, 0, 0],
                               atol=0.01)
    monkeypatch.setattr(sampling, "MAX_NUCLEUS_DRAWS", 0)
    drawn = choose_tokens(tiled, uniforms, Sampling(top_p=0.5)).numpy()
    np.testing.assert_allclose(np.bincount(drawn, minlength=4) / rows, [2 / 3, 1 / 3, 0, 0],
                               atol=0.01)


def test_draws_do_not_depend_on_the_batch():
    log_probs = _log_probs(24, 700, 2.0, seed=1)
    uniforms = _uniforms(24)
    for options in (Sampling(), Sampling(top_p=0.8), Sampling(top_p=0.8, temperature=1.7),
                    Sampling(top_k=5), Sampling(top_k=5, top_p=0.6)):
        together = choose_tokens(log_probs, uniforms, options).numpy()
        alone = [int(choose_tokens(log_probs[i:i + 1], uniforms[i:i + 1], options)[0])
                 for i in range(24)]
        reversed_ = choose_tokens(log_probs[::-1], uniforms[::-1], options).numpy()[::-1]
        assert together.tolist() == alone == reversed_.tolist()


def test_options_as_tensors_and_under_xla_draw_the_same_tokens():
    """A SavedModel's options are tensors (branches chosen at run time); an XLA-compiled
    search traces every branch with a static shape (a tensor top_k sorts the vocabulary)."""
    log_probs = _log_probs(32, 1000, 3.0)
    uniforms = _uniforms(32)

    def tensors(options):
        return Sampling(*(tf.constant(value) for value in (options.top_k, options.top_p,
                                                           options.temperature, options.seed)))

    @tf.function(jit_compile=True)
    def compiled(log_probs, uniforms, top_k, top_p, temperature):
        return choose_tokens(log_probs, uniforms, Sampling(top_k, top_p, temperature),
                             compiled=True)

    for options in (Sampling(), Sampling(top_p=0.9), Sampling(top_k=10),
                    Sampling(top_k=10, top_p=0.5), Sampling(top_p=0.9, temperature=0.7),
                    Sampling(top_k=1, top_p=0.5, temperature=0.3)):
        expected = choose_tokens(log_probs, uniforms, options).numpy()
        np.testing.assert_array_equal(choose_tokens(log_probs, uniforms, tensors(options)),
                                      expected)
        np.testing.assert_array_equal(
            compiled(log_probs, uniforms, tf.constant(options.top_k),
                     tf.constant(options.top_p), tf.constant(options.temperature)), expected)
