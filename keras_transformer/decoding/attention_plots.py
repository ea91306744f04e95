"""Encoder-decoder attention heat maps, as in the paper's appendix figures.

Needs matplotlib (the optional extra: `pip install -e ".[plots]"` from the clone), imported only
when plotting. Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so plotting
works without a display and never changes the caller's pyplot backend.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorflow as tf

from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_MAX_INPUT_TOKENS,
    beam_search,
    encode_texts,
)
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID

__all__ = ["attention_weights", "plot_attention"]


def attention_weights(model, tokenizer, sentence: str | bytes,
                      beam_size: int = DEFAULT_BEAM_SIZE, alpha: float = DEFAULT_ALPHA,
                      max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS,
                      output_pieces: Sequence[str] | None = None, finished: bool = True,
                      source_pieces: Sequence[str] | None = None):
    """Translates `sentence` (or takes the translation given) and returns the
    cross-attention behind each output token.

    Row t of a map is the attention while predicting output token t (the decoder is fed
    BOS and the tokens before t, exactly as during the search).

    Args:
        output_pieces: a translation already made (`Hypothesis.pieces`: sampled, prefixed,
            from any search), forced instead of searching with beam_size and alpha, so
            that the maps show what was written; `finished`: it ended with EOS.
        source_pieces: the pieces that translation was decoded from
            (`Translation.source_pieces`: cut at that decoding's max_input_tokens), instead
            of `sentence` tokenized again.

    Returns:
        (source pieces [S] (EOS included), output pieces [T] (EOS included if emitted),
         weights float32 (num_layers, num_heads, T, S)).
    """
    if source_pieces is None:
        source = encode_texts(tokenizer, [sentence], max_input_tokens).to_tensor()
    else:
        source = _ids(tokenizer, source_pieces, end=True)
    if output_pieces is None:
        output, _ = beam_search(model, source, beam_size=beam_size, alpha=alpha)
        output = output[:, : max(int(tf.reduce_sum(tf.cast(output != PAD_ID, tf.int32))), 1)]
    else:
        output = _ids(tokenizer, output_pieces, end=finished)
        if not int(tf.size(output)):
            output = tf.fill([1, 1], EOS_ID)
    decoder_input = tf.concat([tf.fill([1, 1], BOS_ID), output[:, :-1]], axis=1)
    encoder_output, source_mask = model.encode(source)
    self_cache, cross_cache = model.initial_cache(encoder_output, tf.shape(decoder_input)[1])
    _, _, scores = model.decode(decoder_input, source_mask, self_cache, cross_cache, 0,
                                return_attention_scores=True)
    weights = np.stack([tf.cast(layer[0], tf.float32).numpy() for layer in scores])

    def pieces(ids):
        return [p.decode("utf-8", errors="replace") for p in
                tokenizer.id_to_piece(ids[0]).numpy()]
    return pieces(source), pieces(output), weights


def _ids(tokenizer, pieces: Sequence[str], end: bool) -> tf.Tensor:
    """int32 (1, len(pieces) [+ 1]): the pieces' ids, then EOS where `end`."""
    ids = tf.cast(tokenizer.piece_to_id(tf.constant(list(pieces), tf.string)), tf.int32)
    return tf.concat([ids, [EOS_ID] if end else []], axis=0)[tf.newaxis, :]


def _figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "plotting attention needs matplotlib: pip install -e '.[plots]' (from the clone) "
            "(or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


def plot_attention(model, tokenizer, sentence: str | bytes, out_dir: str | Path,
                   beam_size: int = DEFAULT_BEAM_SIZE, alpha: float = DEFAULT_ALPHA,
                   output_pieces: Sequence[str] | None = None,
                   finished: bool = True,
                   source_pieces: Sequence[str] | None = None) -> list[Path]:
    """Writes one PNG per decoder layer, one heat map per head, for `sentence`'s translation
    (searched with beam_size and alpha, or the one given: `attention_weights`).

    Axes: source subword pieces (x) against output pieces (y); brighter = more attention
    (each map scaled to its own maximum).

    Returns:
        The PNG paths, `out_dir/attention_layer_<n>.png` for n = 1..num_layers.

    Raises:
        ImportError: if matplotlib is not installed.
    """
    figure_class, canvas_class = _figure_class()
    source, output, weights = attention_weights(model, tokenizer, sentence, beam_size, alpha,
                                                output_pieces=output_pieces, finished=finished,
                                                source_pieces=source_pieces)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_layers, num_heads = weights.shape[:2]
    columns = min(num_heads, 4)
    rows = math.ceil(num_heads / columns)
    # Enough room per cell for the labels of long sentences, within sane bounds.
    cell_w = min(max(0.22 * len(source), 2.5), 12)
    cell_h = min(max(0.22 * len(output), 2.5), 12)
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # glyphs missing from the font for rare scripts
        for layer in range(num_layers):
            figure = figure_class(figsize=(columns * cell_w + 1, rows * cell_h + 1))
            canvas_class(figure)
            for head in range(num_heads):
                axes = figure.add_subplot(rows, columns, head + 1)
                axes.imshow(weights[layer, head], cmap="viridis", vmin=0.0,
                            aspect="auto")
                axes.set_xticks(range(len(source)), source, rotation=90, fontsize=7)
                axes.set_yticks(range(len(output)), output, fontsize=7)
                axes.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
            figure.tight_layout()
            path = out_dir / f"attention_layer_{layer + 1}.png"
            figure.savefig(path, format="png", dpi=100)
            paths.append(path)
    return paths
