"""pipelines.numpy_batches (and pipelines.philox): a prepared folder read with numpy alone
yields the tf.data pipeline's batches, array for array, in the same order; it imports
without TensorFlow; damage is refused in the same words."""

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from pipelines.batching import xla_bucket_boundaries
from pipelines.corpora import open_corpus
from pipelines.numpy_batches import prepared_batches, read_shard
from pipelines.philox import stateless_shuffle
from pipelines.prepared import (
    MANIFEST_FILE,
    PreparedCorpus,
    PreparedError,
    damaged_shard,
    prepare_corpus,
)
from pipelines.prepared_folder import PreparedFolder
from tests.pipelines.test_corpora import write

REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH = 48
BUDGET = 128  # tokens per batch: 79 batches per epoch of the 5 shards (273 pairs kept)
SETTINGS = {"vocab_size": 400, "max_length": MAX_LENGTH, "tokenizer_sample": 1000,
            "shard_pairs": 120, "seed": 0}


@pytest.fixture(scope="module")
def prepared(small_corpus, tmp_path_factory) -> PreparedCorpus:
    """small_corpus (600 pairs) prepared into 5 shards."""
    root = tmp_path_factory.mktemp("numpy_batches")
    write(root / "text", "train.de", small_corpus.sources)
    write(root / "text", "train.en", small_corpus.targets)
    split = open_corpus(root / "text", "train", "de", "en")
    return prepare_corpus(split, root / "prepared", **SETTINGS)


def tf_batches(prepared: PreparedCorpus, limit: int, **kwargs) -> list[tuple[np.ndarray, ...]]:
    """The first `limit` batches of `PreparedCorpus.batches(**kwargs)`; `pipelines`
    (num_input_pipelines, input_pipeline_id, num_replicas) becomes an InputContext."""
    if "pipelines" in kwargs:
        kwargs["input_context"] = tf.distribute.InputContext(*kwargs.pop("pipelines"))
    return [(f["source"].numpy(), f["target"].numpy(), labels.numpy())
            for f, labels in prepared.batches(**kwargs).take(limit)]


def np_batches(folder, limit: int, **kwargs) -> list[tuple[np.ndarray, ...]]:
    if "pipelines" in kwargs:
        kwargs.update(zip(("num_input_pipelines", "input_pipeline_id", "num_replicas"),
                          kwargs.pop("pipelines"), strict=True))
    found = []
    for features, labels in prepared_batches(folder, **kwargs):
        if len(found) == limit:
            break
        found.append((features["source"], features["target"], labels))
    return found


def assert_identical(expected, found) -> None:
    assert len(found) == len(expected)
    for index, (a, b) in enumerate(zip(expected, found, strict=True)):
        for name, x, y in zip(("source", "target", "labels"), a, b, strict=True):
            assert x.dtype == y.dtype == np.int32, (index, name)
            assert x.shape == y.shape and (x == y).all(), (index, name)


# --- the same batches as tf.data --------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 9, 100, 4097])
def test_philox_shuffle_equals_tensorflows(n):
    for seed in [(0, 0), (3, 1), (1_000_003 * 7, 2), (-5, 9), (2**63 - 1, -(2**63))]:
        expected = tf.random.experimental.stateless_shuffle(
            tf.range(n, dtype=tf.int64), tf.constant(seed, tf.int64), alg="philox").numpy()
        assert stateless_shuffle(n, seed).tolist() == expected.tolist(), seed


@pytest.mark.parametrize("kwargs", [
    dict(seed=0),
    dict(seed=11, skip_batches=157),  # resumed at the last batch of its second epoch
    dict(seed=3, shuffle=False),
    dict(seed=4, repeat=False),
    dict(seed=5, repeat=False, skip_batches=40),
    dict(seed=6, max_length=24, bucket_boundaries=xla_bucket_boundaries(24), static_shapes=True),
    dict(seed=7, tokens_per_batch=2 * BUDGET, pipelines=(2, 1, 2), skip_batches=33),
    dict(seed=-8, pipelines=(1, 0, 1), bucket_boundaries=[4, 9, 16, 30]),
], ids=lambda kwargs: ",".join(f"{k}={v}" for k, v in kwargs.items()))
def test_same_batches_in_the_same_order_as_tf_data(prepared, kwargs):
    kwargs = {"tokens_per_batch": BUDGET, **kwargs}
    expected = tf_batches(prepared, 250, **kwargs)
    assert len(expected) == (250 if kwargs.get("repeat", True) else len(expected)) > 20
    assert_identical(expected, np_batches(prepared, 250, **kwargs))


def test_a_resumed_stream_continues_the_stream(prepared):
    whole = np_batches(prepared, 300, tokens_per_batch=BUDGET, seed=2)
    for skip in (1, 78, 79, 80, 250):
        assert_identical(whole[skip:skip + 5],
                         np_batches(prepared, 5, tokens_per_batch=BUDGET, seed=2,
                                    skip_batches=skip))


@pytest.mark.integration
def test_same_batches_as_tf_data_on_multi30k(multi30k_dir, tmp_path):
    split = open_corpus(multi30k_dir, "train", "de", "en")
    prepared = prepare_corpus(split, tmp_path / "multi30k", vocab_size=8000, seed=0,
                              shard_pairs=10_000)  # 3 shards, ~40 batches each
    for kwargs in (dict(seed=1), dict(seed=1, skip_batches=281)):
        kwargs = {"tokens_per_batch": 4096, **kwargs}
        expected = tf_batches(prepared, 300, **kwargs)
        assert_identical(expected, np_batches(prepared.directory, 300, **kwargs))


# --- numpy alone ------------------------------------------------------------------------------

NO_TENSORFLOW = """
import sys
for name in ("tensorflow", "tensorflow_text", "tensorflow_datasets", "sentencepiece"):
    sys.modules[name] = None  # `import name` raises ImportError
import numpy as np
from pipelines.numpy_batches import prepared_batches
from pipelines.prepared_folder import PreparedFolder

folder = PreparedFolder.load(sys.argv[1])
folder.verify()
arrays = {}
batches = prepared_batches(folder, tokens_per_batch=int(sys.argv[2]), seed=9, skip_batches=50)
for index, (features, labels) in zip(range(80), batches):
    arrays.update({f"{index}.source": features["source"], f"{index}.target": features["target"],
                   f"{index}.labels": labels})
np.savez(sys.argv[3], **arrays)
assert not any(name.startswith(("tensorflow", "sentencepiece")) and module is not None
               for name, module in sys.modules.items())
"""


def test_reads_without_tensorflow_the_batches_tf_data_yields(prepared, tmp_path):
    output = tmp_path / "batches.npz"
    subprocess.run([sys.executable, "-c", NO_TENSORFLOW, str(prepared.directory), str(BUDGET),
                    str(output)], cwd=REPO, check=True, timeout=60)
    with np.load(output) as saved:
        found = [tuple(saved[f"{i}.{name}"] for name in ("source", "target", "labels"))
                 for i in range(80)]
    assert_identical(tf_batches(prepared, 80, tokens_per_batch=BUDGET, seed=9, skip_batches=50),
                     found)


# --- damage -----------------------------------------------------------------------------------


def test_damage_is_found_with_the_same_messages(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared.directory, copy)
    shard = prepared.manifest["shards"][1]
    ids = copy / shard["ids"]
    original = ids.read_bytes()

    # Bytes changed in place: the checksum.
    ids.write_bytes(original[:6] + bytes([original[6] ^ 1]) + original[7:])
    folder = PreparedFolder.load(copy)
    with pytest.raises(PreparedError, match=rf"{ids}: checksum [0-9a-f]{{8}}, the manifest says "
                       rf"{shard['ids_crc32']}: the prepared corpus is damaged"):
        folder.verify()
    folder.verify([0, 2])  # the other shards are intact

    # A truncated file: its size, on opening.
    ids.write_bytes(original[:-2])
    with pytest.raises(PreparedError, match=rf"{ids}: {len(original) - 2} bytes, the manifest "
                       rf"says {len(original)}"):
        PreparedFolder.load(copy)
    ids.write_bytes(original)

    # An id outside the vocabulary, its checksum made to match: the reader's check, in the
    # words of damaged_shard for the tf.data pipeline.
    ids.write_bytes(original[:10] + np.array([60000], "<u2").tobytes() + original[12:])
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["shards"][1]["ids_crc32"] = f"{zlib.crc32(ids.read_bytes()):08x}"
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    loaded = PreparedCorpus.load(copy)
    loaded.verify()
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        tf_batches(loaded, 10_000, tokens_per_batch=BUDGET, repeat=False)
    with pytest.raises(PreparedError) as found:
        np_batches(copy, 10_000, tokens_per_batch=BUDGET, repeat=False)
    assert str(found.value) == str(damaged_shard(raised.value))
    assert str(found.value).startswith(f"{ids}: token id 60000 among its")

    # Lengths that do not add up.
    ids.write_bytes(original)
    lengths = copy / shard["lengths"]
    values = np.frombuffer(lengths.read_bytes(), "<i4").copy()
    values[3] += 1
    lengths.write_bytes(values.tobytes())
    with pytest.raises(PreparedError, match=rf"{lengths}: lengths adding up to "
                       rf"{values.sum()} pieces .* holds {values.sum() - 1}: the prepared"):
        read_shard(PreparedFolder(copy, manifest), 1)


def test_arguments_are_checked_when_called(prepared):
    with pytest.raises(PreparedError, match="max_length 64 exceeds the 48"):
        prepared_batches(prepared, tokens_per_batch=BUDGET, max_length=64)
    with pytest.raises(PreparedError, match="5 shard.*6 input pipelines"):
        prepared_batches(prepared, tokens_per_batch=6 * BUDGET, num_input_pipelines=6,
                         num_replicas=6)
    with pytest.raises(ValueError, match="skip_batches must be >= 0"):
        prepared_batches(prepared, tokens_per_batch=BUDGET, skip_batches=-1)
    with pytest.raises(PreparedError, match="not a prepared corpus"):
        prepared_batches(prepared.directory / "tokenizer", tokens_per_batch=BUDGET)
