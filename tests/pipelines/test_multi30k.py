"""The real Multi30k de-en: corpus, tfds builder, 8000-piece vocabulary, one epoch of batches."""

import logging
import time

import numpy as np
import pytest
import tensorflow as tf

from pipelines.batching import make_batches
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from pipelines.corpora import load_corpus
from pipelines.tokenizer import train_or_load_tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def train(multi30k_dir):
    return load_corpus(str(multi30k_dir), "train", "de", "en")


@pytest.fixture(scope="module")
def tokenizer(train, tmp_path_factory):
    started = time.perf_counter()
    tokenizer = train_or_load_tokenizer(
        train, tmp_path_factory.mktemp("run") / "tokenizer", vocab_size=8000
    )
    assert time.perf_counter() - started < 30  # a few seconds in practice
    return tokenizer


def test_release_splits(multi30k_dir, train):
    assert len(train) == 29000
    assert len(load_corpus(str(multi30k_dir), "val", "de", "en")) == 1014
    test = load_corpus(str(multi30k_dir), "test", "de", "en")
    assert (test.split, len(test)) == ("test_2016_flickr", 1000)


def test_tfds_builder_reads_back_the_release(multi30k_dir, tmp_path):
    data_dir = str(tmp_path / "tfds")
    for split, local_split in (
        ("validation", "val"),
        ("test", "test_2016_flickr"),
        ("train", "train"),
    ):
        via_tfds = load_corpus(
            "tfds:multi30k", split, "de", "en", data_dir=data_dir, manual_dir=str(multi30k_dir)
        )
        local = load_corpus(str(multi30k_dir), local_split, "de", "en")
        assert via_tfds.sources == local.sources and via_tfds.targets == local.targets  # same order


def test_vocabulary_round_trips_validation_text(multi30k_dir, tokenizer):
    assert tokenizer.vocab_size == 8000
    val = load_corpus(str(multi30k_dir), "val", "de", "en")
    for texts in (val.sources, val.targets):
        ids = tokenizer.tokenize(tf.constant(texts))
        assert UNK_ID not in ids.flat_values.numpy()
        assert [t.decode() for t in tokenizer.detokenize(ids).numpy()] == texts


def test_one_epoch_of_batches(train, tokenizer, caplog):
    max_length = 128  # the default, like the token budget
    lengths = np.maximum(
        tokenizer.tokenize(tf.constant(train.sources)).row_lengths().numpy(),
        tokenizer.tokenize(tf.constant(train.targets)).row_lengths().numpy(),
    )
    kept = int(np.sum(lengths + 1 <= max_length))
    with caplog.at_level(logging.DEBUG, logger="pipelines"):  # INFO only when some are dropped
        dataset = make_batches(train, tokenizer, seed=1)
    assert f"kept {kept} of 29000 pairs" in caplog.text

    pairs = real = slots = 0
    shapes = set()
    for features, labels in dataset:
        source, target, labels = (
            features["source"].numpy(),
            features["target"].numpy(),
            labels.numpy(),
        )
        batch = source.shape[0]
        assert source.dtype == target.dtype == labels.dtype == np.int32
        assert target.shape == labels.shape and target.shape[0] == batch
        assert batch * max(source.shape[1], target.shape[1]) <= 4096
        assert max(source.shape[1], target.shape[1]) <= max_length
        for ids in (source, target, labels):
            assert ids.min() >= 0 and ids.max() < tokenizer.vocab_size
        assert (target[:, 0] == BOS_ID).all()
        assert ((labels == EOS_ID).sum(axis=1) == 1).all() and (
            (source == EOS_ID).sum(axis=1) == 1
        ).all()
        assert ((target != PAD_ID) == (labels != PAD_ID)).all()
        pairs += batch
        real += np.count_nonzero(source) + np.count_nonzero(target)
        slots += source.size + target.size
        shapes.add((source.shape, target.shape))
    assert pairs == kept
    efficiency = real / slots
    logging.getLogger("pipelines").info(
        "Multi30k: efficiency %.4f, %d shapes", efficiency, len(shapes)
    )
    assert efficiency >= 0.90
    assert len(shapes) < 150
