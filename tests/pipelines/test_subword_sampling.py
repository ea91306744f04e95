"""Subword regularization in prepared data: `prepare_corpus(subword_samples=K)` writes K
copies of the training split, each pair segmented by seeded sampling (pipelines.shard_files)."""

import collections
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from pipelines.corpora import open_corpus
from pipelines.prepared import PreparedCorpus, PreparedError, prepare_corpus, sampling_settings
from tests.pipelines.test_batching import as_numpy
from tests.pipelines.test_corpora import write
from tests.pipelines.test_prepared import batch_pairs

PAIRS = 200
COPIES = 3
SETTINGS = {"vocab_size": 400, "max_length": 256, "tokenizer_sample": 1000, "shard_pairs": 120,
            "seed": 0}


@pytest.fixture(scope="module")
def split(small_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write(root, "train.de", small_corpus.sources[:PAIRS])
    write(root, "train.en", small_corpus.targets[:PAIRS])
    return open_corpus(root, "train", "de", "en")


@pytest.fixture(scope="module")
def sampled(split, tmp_path_factory) -> PreparedCorpus:
    return prepare_corpus(split, tmp_path_factory.mktemp("sampled") / "prep", **SETTINGS,
                          subword_samples=COPIES, subword_alpha=0.3)


def shard_rows(prepared: PreparedCorpus, shard: int) -> list[tuple[int, ...]]:
    """The rows (source, target, source, ...) of one shard, as tuples of ids."""
    entry = prepared.manifest["shards"][shard]
    ids = np.fromfile(prepared.directory / entry["ids"], prepared.manifest["id_dtype"])
    lengths = np.fromfile(prepared.directory / entry["lengths"], np.int32).reshape(-1)
    return [tuple(row) for row in np.split(ids, np.cumsum(lengths)[:-1])] if len(ids) else []


def test_each_copy_is_the_corpus_in_another_segmentation(sampled, split, small_corpus):
    manifest = sampled.manifest
    shards_per_copy = 2  # 200 pairs, 120 per shard
    assert sampled.num_shards == COPIES * shards_per_copy
    assert manifest["settings"]["subword_samples"] == COPIES
    assert manifest["settings"]["subword_alpha"] == 0.3
    assert manifest["pairs_total"] == PAIRS and sampled.pairs == COPIES * PAIRS
    assert sampled.describe_pairs() == "600 pairs (200 in 3 sampled segmentations)"

    tokenizer = sampled.tokenizer()
    expected = collections.Counter(zip(small_corpus.sources[:PAIRS],
                                       small_corpus.targets[:PAIRS], strict=True))
    copies = []
    for copy in range(COPIES):
        rows = [row for shard in range(copy * shards_per_copy, (copy + 1) * shards_per_copy)
                for row in shard_rows(sampled, shard)]
        texts = [text.decode() for text in tokenizer.detokenize(
            tf.ragged.constant([list(row) for row in rows], dtype=tf.int32)).numpy()]
        # Sampled segmentations still spell the same sentences: every pair once per copy.
        assert collections.Counter(zip(texts[0::2], texts[1::2], strict=True)) == expected
        copies.append(dict(zip(texts, rows, strict=True)))
    deterministic = {text: tuple(ids) for text, ids in zip(
        small_corpus.sources[:PAIRS], tokenizer.tokenize(small_corpus.sources[:PAIRS])
        .to_list(), strict=True)}
    sources = small_corpus.sources[:PAIRS]
    for first, second in [(0, 1), (0, 2), (1, 2)]:
        differ = sum(copies[first][s] != copies[second][s] for s in sources)
        assert differ > PAIRS // 2, (first, second, differ)
    # Sampling splits words further than the deterministic segmentation: more pieces.
    assert sum(len(copies[0][s]) for s in sources) > sum(map(len, deterministic.values()))
    assert sum(copies[0][s] != deterministic[s] for s in sources) > PAIRS // 2

    # An epoch of the prepared stream is every pair once per copy.
    batches = as_numpy(sampled.batches(tokens_per_batch=512, shuffle=False, repeat=False))
    assert collections.Counter(batch_pairs(tokenizer, batches)) == collections.Counter(
        {pair: COPIES for pair in expected})


def test_sampling_is_seeded(sampled, split, tmp_path):
    again = prepare_corpus(split, tmp_path / "again", **SETTINGS, subword_samples=COPIES,
                           subword_alpha=0.3)
    checksums = [(s["ids_crc32"], s["lengths_crc32"]) for s in again.manifest["shards"]]
    assert checksums == [(s["ids_crc32"], s["lengths_crc32"]) for s in sampled.manifest["shards"]]
    other_seed = prepare_corpus(split, tmp_path / "other", **{**SETTINGS, "seed": 1},
                                subword_samples=1, subword_alpha=0.3)
    assert other_seed.manifest["shards"][0]["ids_crc32"] != sampled.manifest["shards"][0][
        "ids_crc32"]


def test_runs_must_want_the_same_sampling(sampled, split, tmp_path):
    common = {"src_lang": "de", "tgt_lang": "en", "vocab_size": 400}
    sampled.check_settings({**common, **sampling_settings(COPIES, 0.3)})
    for wanted in (sampling_settings(0, 0.3), sampling_settings(COPIES, 0.1),
                   sampling_settings(COPIES + 1, 0.3)):
        with pytest.raises(PreparedError, match="prepared differently.*subword"):
            sampled.check_settings({**common, **wanted})
    # Data prepared without sampling (manifests of before, too) record nothing about it.
    plain = prepare_corpus(split, tmp_path / "plain", **SETTINGS)
    assert "subword_samples" not in plain.settings
    plain.check_settings({**common, **sampling_settings(0, 0.1)})
    with pytest.raises(PreparedError, match="subword_samples: prepared with 0, wanted 2"):
        plain.check_settings({**common, **sampling_settings(2, 0.1)})
    assert Path(plain.directory).is_dir()
