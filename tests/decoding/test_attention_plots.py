"""Attention heat maps (keras_transformer.decoding.attention_plots)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from keras_transformer import run_directory
from keras_transformer.decoding.attention_plots import attention_weights, plot_attention
from keras_transformer.decoding.translator import translate_batch
from tests.serving.test_saved_model import shared_artifacts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def loaded_run(tmp_path_factory):
    return run_directory.load_run(shared_artifacts(tmp_path_factory)[0])


def test_attention_weights_have_one_row_per_output_token(loaded_run):
    model, tokenizer = loaded_run
    source, output, weights = attention_weights(model, tokenizer, "Ein Hund läuft.",
                                                beam_size=2)
    assert source[-1] == "</s>"
    assert weights.shape == (2, 4, len(output), len(source))
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)


def test_a_translation_given_is_forced_and_gives_the_maps_of_its_search(loaded_run):
    """translate --plot-attention maps the output it wrote (sampled or prefixed too), not a
    second search's."""
    model, tokenizer = loaded_run
    sentence = "Ein Hund läuft im Park."
    best = translate_batch(model, tokenizer, [sentence], beam_size=2)[0].hypotheses[0]
    searched = attention_weights(model, tokenizer, sentence, beam_size=2)
    forced = attention_weights(model, tokenizer, sentence, output_pieces=best.pieces,
                               finished=best.finished)
    assert forced[:2] == searched[:2]
    np.testing.assert_allclose(forced[2], searched[2], atol=1e-6)
    sampled = translate_batch(model, tokenizer, [sentence], sampling_topk=0, seed=3,
                              beam_size=1)[0].hypotheses[0]
    _, output, weights = attention_weights(model, tokenizer, sentence,
                                           output_pieces=sampled.pieces,
                                           finished=sampled.finished)
    assert output == sampled.pieces + (["</s>"] if sampled.finished else [])
    assert weights.shape[2] == len(output)
    # A line cut at 8 tokens: mapped over the 7 pieces (and EOS) it was decoded from.
    long_line = "Ein Hund läuft im Park und zwei Kinder spielen im Schnee."
    cut = translate_batch(model, tokenizer, [long_line], beam_size=1, max_input_tokens=8,
                          long_inputs="truncate")[0]
    assert "truncated" in cut.flags and len(cut.source_pieces) == 7
    best = cut.hypotheses[0]
    source, output, weights = attention_weights(
        model, tokenizer, long_line, output_pieces=best.pieces, finished=best.finished,
        source_pieces=cut.source_pieces)
    assert source == cut.source_pieces + ["</s>"]
    assert weights.shape[2:] == (len(output), 8)


def test_plot_attention_writes_valid_pngs(loaded_run, tmp_path):
    model, tokenizer = loaded_run
    paths = plot_attention(model, tokenizer, "Zwei Kinder 🙂 spielen 漢字.", tmp_path / "out",
                           beam_size=2)
    assert [p.name for p in paths] == ["attention_layer_1.png", "attention_layer_2.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_missing_matplotlib_is_a_clear_error(loaded_run, tmp_path, monkeypatch):
    model, tokenizer = loaded_run
    # A None entry makes importing that module fail, even if it was imported before.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    # From the clone: the index's `keras-transformer` is another project.
    with pytest.raises(ImportError, match=r"pip install -e '\.\[plots\]' \(from the clone\)"):
        plot_attention(model, tokenizer, "Ein Hund.", tmp_path)
