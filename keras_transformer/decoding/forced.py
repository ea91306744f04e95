"""Forced decoding: the model's log-probability of given target tokens (teacher forcing).

What `fairseq-generate --score-reference`, `marian-scorer`, OpenNMT-tf's `score` run type and
CTranslate2's `score_batch` compute. The decoder reads BOS and the target tokens before each
position in one pass (as in training, 3.1 "masked" self-attention), and the log-softmax of its
output at position t is read at target token t. A search's scores are sums of the same
log-probabilities, so forcing a search's output gives back its score (within float32 rounding
of the incremental and the one-pass computation).

The encoder-decoder attention of that pass is what alignments are read from
(`decoding.alignment`).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from keras_transformer.decoding.search import compiled_per_model
from pipelines.constants import BOS_ID, PAD_ID

__all__ = ["ForcedOutput", "forced_log_probs", "forced_pass"]


class ForcedOutput(NamedTuple):
    """One batch forced through the model."""

    token_log_probs: tf.Tensor  # float32 (batch, T): log p(target_t | source, target_<t); 0 at PAD
    attention: tf.Tensor | None  # float32 (batch, T, S): one layer's heads averaged, or None


def forced_pass(model, source_ids, target_ids, attention_layer: int | None):
    """(token log-probs float32 (batch, T), attention (batch, T, S) or an empty tensor): the
    traceable body of `forced_log_probs` (`attention_layer` in [0, layers) or None)."""
    decoder_input = tf.concat([tf.fill([tf.shape(target_ids)[0], 1], BOS_ID),
                               target_ids[:, :-1]], axis=1)
    encoder_output, source_mask = model.encode(source_ids)
    self_cache, cross_cache = model.initial_cache(encoder_output, tf.shape(decoder_input)[1])
    outputs = model.decode(decoder_input, source_mask, self_cache, cross_cache, 0,
                           return_attention_scores=attention_layer is not None)
    log_probs = tf.nn.log_softmax(tf.cast(outputs[0], tf.float32))
    token_log_probs = tf.gather(log_probs, target_ids, batch_dims=2)
    token_log_probs = tf.where(target_ids != PAD_ID, token_log_probs, 0.0)
    if attention_layer is None:
        return token_log_probs, tf.zeros([0])
    attention = tf.reduce_mean(tf.cast(outputs[2][attention_layer], tf.float32), axis=1)
    return token_log_probs, attention


def forced_log_probs(model, source_ids, target_ids,
                     attention_layer: int | None = None) -> ForcedOutput:
    """Per-token log-probabilities of `target_ids` given `source_ids`.

    Args:
        model: a `Transformer` (any dtype; log-probs come back float32).
        source_ids: int32 (batch, S), 0-padded, each row ending with EOS (as `encode_texts`).
        target_ids: int32 (batch, T), 0-padded: the target tokens without BOS; include EOS
            to score the end of the sentence.
        attention_layer: also return this decoder layer's encoder-decoder attention, averaged
            over heads (negative counts from the last layer); None for none.

    Returns:
        `ForcedOutput`; a row's log-probability is `token_log_probs[row].sum()`.
    """
    source_ids = tf.cast(tf.convert_to_tensor(source_ids), tf.int32)
    target_ids = tf.cast(tf.convert_to_tensor(target_ids), tf.int32)
    if attention_layer is not None:
        layers = len(model.decoder_layers)
        if not -layers <= attention_layer < layers:
            raise ValueError(f"attention_layer {attention_layer} is out of range for "
                             f"{layers} decoder layers.")
        attention_layer %= layers
    if tf.shape(target_ids)[1] == 0:  # nothing to score
        batch = tf.shape(target_ids)[0]
        return ForcedOutput(tf.zeros([batch, 0]), None if attention_layer is None
                            else tf.zeros([batch, 0, tf.shape(source_ids)[1]]))

    def build():
        return tf.function(lambda source, target: forced_pass(model, source, target,
                                                          attention_layer),
                           reduce_retracing=True, autograph=False)

    search = compiled_per_model(model, ("forced", attention_layer), build)
    token_log_probs, attention = search(source_ids, target_ids)
    return ForcedOutput(token_log_probs, None if attention_layer is None else attention)
