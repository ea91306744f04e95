"""In-graph pieces of the SavedModel's signatures: chunked decoding of a request, subword
pieces, and word alignments (the graph twin of `decoding.alignment.word_alignment`).

Everything here is stock TensorFlow (plus tensorflow_text's sentencepiece ops), traced with
autograph off, so TF Serving runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from keras_transformer.decoding.alignment import WORD_START
from pipelines.constants import EOS_ID, PAD_ID

__all__ = ["map_chunks", "pieces_of", "pad_last", "word_alignments"]


def map_chunks(order, chunk_size: int, compute: Callable, trailing: Sequence[Sequence],
               dtypes: Sequence[tf.DType]):
    """`compute(rows)` over chunks of `order`, its outputs put back in input order.

    Decoding a request in chunks of `chunk_size` sentences bounds memory for any request
    size; sorting by length (`order`) keeps each chunk's padding and step count low.

    Args:
        order: int32 (N,), a permutation: the rows in decoding order.
        chunk_size: rows per chunk.
        compute: rows (n,) -> a tuple of tensors (n, *trailing[i]).
        trailing: each output's dimensions after the first (ints or scalar tensors), the same
            for every chunk.
        dtypes: each output's dtype.

    Returns:
        A list of tensors (N, *trailing[i]).
    """
    count = tf.size(order)
    num_chunks = (count + chunk_size - 1) // chunk_size
    arrays = tuple(tf.TensorArray(dtype, size=num_chunks, infer_shape=False,
                                  element_shape=[None] * (1 + len(dims)))
                   for dtype, dims in zip(dtypes, trailing, strict=True))

    def body(index, *arrays):
        values = compute(order[index * chunk_size: (index + 1) * chunk_size])
        return (index + 1, *(array.write(index, value)
                             for array, value in zip(arrays, values, strict=True)))

    _, *arrays = tf.while_loop(lambda index, *_: index < num_chunks, body,
                               (tf.constant(0), *arrays))
    inverse = tf.math.invert_permutation(order)
    return [tf.cond(tf.equal(count, 0),
                    lambda dtype=dtype, dims=dims: tf.zeros(tf.stack([0, *dims]), dtype),
                    lambda array=array: tf.gather(array.concat(), inverse))
            for array, dtype, dims in zip(arrays, dtypes, trailing, strict=True)]


def pad_last(tensor, width):
    """`tensor` zero-padded (or cut) along its last axis to `width`."""
    missing = tf.maximum(width - tf.shape(tensor)[-1], 0)
    paddings = tf.concat([tf.zeros([tf.rank(tensor) - 1, 2], tf.int32),
                          [[0, missing]]], axis=0)
    # Zero of the dtype: "" for strings.
    return tf.pad(tensor, paddings, constant_values=tf.zeros([], tensor.dtype))[..., :width]


def pieces_of(tokenizer, ids):
    """The subword strings of ids (...), "" at PAD (EOS is "</s>")."""
    return tf.where(ids == PAD_ID, tf.constant(""), tokenizer.id_to_piece(ids))


def _word_ids(tokenizer, ids):
    """(word index of each piece (n, L) int32, real pieces (n, L) bool): a piece starting
    with "▁" starts a word; PAD and EOS are not pieces of a word."""
    real = (ids != PAD_ID) & (ids != EOS_ID)
    starts = tf.strings.regex_full_match(tokenizer.id_to_piece(ids), f"{WORD_START}.*")
    # The first piece starts a word, with or without the marker (as `piece_words`).
    first = tf.range(tf.shape(ids)[1])[None, :] == 0
    starts = (starts | first) & real
    words = tf.maximum(tf.cumsum(tf.cast(starts, tf.int32), axis=1) - 1, 0)
    return words, real


def word_alignments(tokenizer, attention, source_ids, target_ids, shift: bool,
                    tension: float):
    """Pharaoh strings (n,) ("0-0 1-2 ..."), as `decoding.alignment.word_alignment` gives.

    Args:
        tokenizer: the `SubwordTokenizer`.
        attention: float32 (n, T, S): row t is the step predicting target token t, one layer's
            heads averaged.
        source_ids: int32 (n, S), each row ending with EOS, 0-padded.
        target_ids: int32 (n, T): the output tokens (EOS included when finished), 0-padded.
        shift: read target token t's attention from row t + 1.
        tension: the diagonal prior's weight (`decoding.alignment.diagonal_prior`).
    """
    length = tf.shape(target_ids)[1]
    if shift:
        # Each row's own last token (EOS or the last piece), as the Python side slices it.
        last = tf.maximum(tf.reduce_sum(tf.cast(target_ids != PAD_ID, tf.int32), axis=1) - 1, 0)
        rows = tf.minimum(tf.range(length)[None, :] + 1, last[:, None])
        attention = tf.gather(attention, rows, batch_dims=1)
    source_words, source_real = _word_ids(tokenizer, source_ids)
    target_words, target_real = _word_ids(tokenizer, target_ids)
    # Sum over a source word's pieces, mean over a target word's pieces: one-hot matmuls.
    source_one_hot = tf.one_hot(source_words, tf.shape(source_ids)[1]) * tf.cast(
        source_real, tf.float32)[:, :, None]
    target_one_hot = tf.one_hot(target_words, length) * tf.cast(
        target_real, tf.float32)[:, :, None]
    by_source = tf.matmul(attention, source_one_hot)  # (n, T, source words)
    by_word = tf.matmul(target_one_hot, by_source, transpose_a=True)  # (n, target words, .)
    source_word_count = tf.reduce_max(tf.where(source_real, source_words + 1, 0), axis=1)
    target_word_count = tf.reduce_max(tf.where(target_real, target_words + 1, 0), axis=1)
    # fast_align's diagonal prior over each row's own word counts.
    source_position = (tf.cast(tf.range(tf.shape(source_ids)[1]), tf.float32)[None, :] + 0.5) \
        / tf.cast(tf.maximum(source_word_count, 1), tf.float32)[:, None]
    target_position = (tf.cast(tf.range(length), tf.float32)[None, :] + 0.5) \
        / tf.cast(tf.maximum(target_word_count, 1), tf.float32)[:, None]
    by_word *= tf.exp(-tension * tf.abs(source_position[:, None, :]
                                        - target_position[:, :, None]))
    # Only real source words compete (the rest of the one-hot width is empty).
    valid_source = tf.range(tf.shape(source_ids)[1])[None, :] < source_word_count[:, None]
    by_word = tf.where(valid_source[:, None, :], by_word, -1.0)
    links = tf.argmax(by_word, axis=-1, output_type=tf.int32)  # (n, target words)
    # No source word (an empty source): no links, as on the Python side.
    target_word_count = tf.where(source_word_count > 0, target_word_count, 0)
    pairs = tf.strings.as_string(links) + "-" + tf.strings.as_string(
        tf.broadcast_to(tf.range(length)[None, :], tf.shape(links)))
    kept = tf.ragged.boolean_mask(
        pairs, tf.range(length)[None, :] < target_word_count[:, None])
    return tf.strings.reduce_join(kept, axis=-1, separator=" ")
