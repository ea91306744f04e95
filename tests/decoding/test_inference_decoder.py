"""The decoding step in the serving layout (keras_transformer.decoding.inference_decoder)
computes what the Keras layers compute."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.decoding import inference_decoder
from keras_transformer.decoding.inference_decoder import InferenceDecoder, InferenceModel
from keras_transformer.decoding.search import beam_search, greedy_search
from keras_transformer.model.transformer import build_transformer
from pipelines.constants import BOS_ID, PAD_ID

VOCAB = 40
STEPS = 6
VARIANTS = {
    "paper": {},  # post-norm, tied embeddings, relu
    "pre_norm_untied_gelu": dict(pre_norm=True, tie_embeddings=False, activation="gelu"),
}


def _model(**overrides):
    keras.utils.set_random_seed(3)
    model = build_transformer("tiny", vocab_size=VOCAB, **overrides)
    # Untrained LayerNorms are the identity: give them values, so that a mix-up shows.
    for weight in model.weights:
        if "norm" in weight.path:
            weight.assign(np.random.default_rng(len(weight.path)).normal(
                1.0, 0.3, weight.shape).astype("float32"))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model(request):
    return _model(**VARIANTS[request.param])


@pytest.fixture(scope="module")
def sources():
    rng = np.random.default_rng(0)
    ids = rng.integers(4, VOCAB, size=(3, 7)).astype("int32")
    ids[1, 4:] = PAD_ID
    return ids


def _tokens(rows: int) -> np.ndarray:
    """(rows, STEPS) target tokens, BOS first."""
    tokens = np.random.default_rng(1).integers(4, VOCAB, size=(rows, STEPS)).astype("int32")
    tokens[:, 0] = BOS_ID
    return tokens


@pytest.mark.parametrize("fixed_length", [False, True], ids=["growing", "fixed"])
def test_steps_give_the_layers_log_probs(model, sources, fixed_length):
    """Step by step, with a cache that grows or one of fixed length (XLA's), the log-probs
    equal `Transformer.decode`'s over the whole prefix."""
    tokens = _tokens(len(sources))
    encoder_output, source_mask = model.encode(sources)
    decoder = InferenceDecoder(model, STEPS)
    cache, encoder_side = decoder.start(encoder_output, source_mask, STEPS if fixed_length else 0)
    self_cache, cross_cache = model.initial_cache(encoder_output, STEPS)
    logits, _ = model.decode(tokens, source_mask, self_cache, cross_cache, 0)
    expected = tf.nn.log_softmax(logits).numpy()
    for index in range(STEPS):
        log_probs, cache = decoder.step(tokens[:, index], index, cache, encoder_side,
                                        grow_cache=not fixed_length)
        np.testing.assert_allclose(log_probs.numpy(), expected[:, index], atol=2e-5)
    assert cache[0][0].shape[2] == STEPS


def test_searches_give_the_same_tokens_through_the_layers(model, sources):
    """Greedy and beam search with the step layout (a float32 Transformer) and through the
    layers (`ModelDecoder`, for any object with the decode API) agree token for token."""

    class ThroughLayers:  # not a Transformer: the stepper calls its decode
        encode, initial_cache, decode = model.encode, model.initial_cache, model.decode

    assert inference_decoder.supports(model)
    assert not inference_decoder.supports(ThroughLayers())
    for search in (greedy_search, beam_search):
        fast, fast_scores = search(model, sources, extra_length=8)
        slow, slow_scores = search(ThroughLayers(), sources, extra_length=8)
        np.testing.assert_array_equal(fast.numpy(), slow.numpy())
        np.testing.assert_allclose(fast_scores.numpy(), slow_scores.numpy(), atol=1e-4)


def test_inference_model_decodes_as_its_transformer(sources):
    """An `InferenceModel` (what an export holds) decodes as its Transformer, from stored
    copies of the fused and transposed weights only: the fused Q/K/V and K/V kernels and
    biases per layer, and the output projection."""
    model = _model()
    stored = InferenceModel(model)
    for search in (greedy_search, beam_search):
        np.testing.assert_array_equal(search(stored, sources, extra_length=8)[0].numpy(),
                                      search(model, sources, extra_length=8)[0].numpy())
    copies = stored.variables
    assert len(copies) == 4 * len(model.decoder_layers) + 1
    assert not {id(v) for v in copies} & {id(v) for v in model.weights}
    d_model = model.config.d_model
    assert stored.fused[0].self_qkv_kernel.shape == (d_model, 3 * d_model)
    np.testing.assert_array_equal(stored.output_kernel.numpy(),
                                  model.target_embedding.embeddings.numpy().T)


def test_other_dtypes_decode_through_the_layers(sources):
    model = build_transformer("tiny", vocab_size=VOCAB, dtype="mixed_bfloat16")
    assert not inference_decoder.supports(model)
    with pytest.raises(ValueError, match="float32"):
        InferenceModel(model)
    ids, _ = greedy_search(model, sources, extra_length=4)
    assert ids.shape[0] == len(sources)
