"""pipelines.numpy_batches (and pipelines.philox): a prepared folder read with numpy alone
yields the tf.data pipeline's batches, array for array, in the same order, and the
validation batches that make_batches(shuffle=False) makes from the val text; it imports
without TensorFlow; damage is refused in the same words."""

import errno
import gzip
import json
import logging
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from pipelines.batching import make_batches, xla_bucket_boundaries
from pipelines.corpora import corpus_fingerprint, load_corpus, open_corpus
from pipelines.numpy_batches import prepared_batches, read_shard, validation_batches
from pipelines.philox import stateless_shuffle
from pipelines.prepared import (
    MANIFEST_FILE,
    PreparedCorpus,
    PreparedError,
    damaged_shard,
    prepare_corpus,
)
from pipelines.prepared_folder import VALIDATION, PreparedFolder
from pipelines.storage import StorageError
from tests.pipelines.test_corpora import write
from tests.pipelines.test_prepared import PAGE, full_disk

REPO = Path(__file__).resolve().parents[2]
MAX_LENGTH = 48
BUDGET = 128  # tokens per batch: 79 batches per epoch of the 5 shards (273 pairs kept)
SETTINGS = {"vocab_size": 400, "max_length": MAX_LENGTH, "tokenizer_sample": 1000,
            "shard_pairs": 120, "seed": 0}
VAL_PAIRS = 150  # the val split: the last pairs of small_corpus, 1 to 30 words


@pytest.fixture(scope="module")
def prepared(small_corpus, tmp_path_factory) -> PreparedCorpus:
    """small_corpus (600 pairs) prepared into 5 shards, with a val split of VAL_PAIRS."""
    root = tmp_path_factory.mktemp("numpy_batches")
    write(root / "text", "train.de", small_corpus.sources)
    write(root / "text", "train.en", small_corpus.targets)
    write(root / "text", "val.de", small_corpus.sources[-VAL_PAIRS:])
    write(root / "text", "val.en", small_corpus.targets[-VAL_PAIRS:])
    split = open_corpus(root / "text", "train", "de", "en")
    return prepare_corpus(split, root / "prepared", **SETTINGS,
                          validation=load_corpus(root / "text", "val", "de", "en"),
                          validation_split="validation")


@pytest.fixture(scope="module")
def val_corpus(prepared):
    return load_corpus(prepared.validation["origin"], "val", "de", "en")


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
from pipelines.numpy_batches import prepared_batches, validation_batches
from pipelines.prepared_folder import PreparedFolder

folder = PreparedFolder.load(sys.argv[1])
folder.verify()
arrays = {}
batches = prepared_batches(folder, tokens_per_batch=int(sys.argv[2]), seed=9, skip_batches=50)
for index, (features, labels) in zip(range(80), batches):
    arrays.update({f"{index}.source": features["source"], f"{index}.target": features["target"],
                   f"{index}.labels": labels})
val = validation_batches(folder, tokens_per_batch=int(sys.argv[2]), max_length=32)
for index, (features, labels) in enumerate(val):
    arrays.update({f"val.{index}.source": features["source"],
                   f"val.{index}.target": features["target"], f"val.{index}.labels": labels})
np.savez(sys.argv[3], **arrays, val_batches=len(val))
assert not any(name.startswith(("tensorflow", "sentencepiece")) and module is not None
               for name, module in sys.modules.items())
"""


def test_reads_without_tensorflow_the_batches_tf_data_yields(prepared, val_corpus, tmp_path):
    output = tmp_path / "batches.npz"
    subprocess.run([sys.executable, "-c", NO_TENSORFLOW, str(prepared.directory), str(BUDGET),
                    str(output)], cwd=REPO, check=True, timeout=60)
    names = ("source", "target", "labels")
    with np.load(output) as saved:
        found = [tuple(saved[f"{i}.{name}"] for name in names) for i in range(80)]
        val = [tuple(saved[f"val.{i}.{name}"] for name in names)
               for i in range(int(saved["val_batches"]))]
    assert_identical(tf_batches(prepared, 80, tokens_per_batch=BUDGET, seed=9, skip_batches=50),
                     found)
    assert_identical(tf_val_batches(val_corpus, prepared.tokenizer(), tokens_per_batch=BUDGET,
                                    max_length=32), val)


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


# --- the validation split ---------------------------------------------------------------------


def tf_val_batches(corpus, tokenizer, **kwargs) -> list[tuple[np.ndarray, ...]]:
    """make_batches(corpus, shuffle=False, **kwargs), one pass, as numpy; `pipelines` as in
    tf_batches; max_length the prepared one unless given (make_batches' default is 128)."""
    if "pipelines" in kwargs:
        kwargs["input_context"] = tf.distribute.InputContext(*kwargs.pop("pipelines"))
    kwargs.setdefault("max_length", MAX_LENGTH)
    return [(f["source"].numpy(), f["target"].numpy(), labels.numpy())
            for f, labels in make_batches(corpus, tokenizer, shuffle=False, **kwargs)]


def np_val_batches(folder, **kwargs) -> list[tuple[np.ndarray, ...]]:
    if "pipelines" in kwargs:
        kwargs.update(zip(("num_input_pipelines", "input_pipeline_id", "num_replicas"),
                          kwargs.pop("pipelines"), strict=True))
    return [(f["source"], f["target"], labels)
            for f, labels in validation_batches(folder, **kwargs)]


def dropped_lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if "longer than" in r.getMessage()]
    caplog.clear()
    return lines


def test_the_val_split_is_prepared_beside_the_shards(prepared, val_corpus):
    entry = prepared.validation
    assert entry["pairs"] == len(val_corpus) == VAL_PAIRS
    assert (entry["split"], entry["requested_split"]) == ("val", "validation")
    assert (entry["src_lang"], entry["tgt_lang"]) == ("de", "en")
    assert entry["corpus_fingerprint"] == corpus_fingerprint(val_corpus)
    # Every pair, in corpus order, tokenized as make_batches tokenizes it; CRC-32s recorded.
    tokenizer = prepared.tokenizer()
    ids = np.frombuffer((prepared.directory / entry["ids"]).read_bytes(), "<u2")
    lengths = np.frombuffer((prepared.directory / entry["lengths"]).read_bytes(), "<i4")
    sources, targets = (tokenizer.tokenize(tf.constant(texts)).to_list()
                        for texts in (val_corpus.sources, val_corpus.targets))
    expected = [s + t for s, t in zip(sources, targets, strict=True)]
    assert ids.tolist() == [piece for pair in expected for piece in pair]
    assert lengths.reshape(-1, 2).sum(axis=1).tolist() == [len(e) for e in expected]
    assert lengths.max() + 1 > MAX_LENGTH  # kept although longer than the prepared max_length
    for kind in ("ids", "lengths"):
        data = (prepared.directory / entry[kind]).read_bytes()
        assert (entry[f"{kind}_bytes"], entry[f"{kind}_crc32"]) == (
            len(data), f"{zlib.crc32(data):08x}")
    assert prepared.check_validation("val") == prepared.check_validation("validation") == entry
    with pytest.raises(PreparedError, match=r"holds the validation split 'val' of .*, not "
                       r"'test'; prepare the corpus again .*--val-split test --out NEW"):
        prepared.check_validation("test")


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(max_length=24, seed=5),  # about half the pairs dropped, and counted as make_batches does
    dict(max_length=64),  # above the prepared max_length: the val ids hold every pair
    dict(tokens_per_batch=2 * BUDGET, max_length=32, bucket_boundaries=xla_bucket_boundaries(32),
         static_shapes=True),
    dict(tokens_per_batch=4 * BUDGET, pipelines=(2, 1, 4), bucket_boundaries=[4, 9, 16, 30]),
], ids=lambda kwargs: ",".join(f"{k}={v}" for k, v in kwargs.items()) or "defaults")
def test_validation_batches_are_make_batches_without_shuffling(prepared, val_corpus, kwargs,
                                                              caplog):
    kwargs = {"tokens_per_batch": BUDGET, **kwargs}
    caplog.set_level(logging.DEBUG, logger="pipelines")
    expected = tf_val_batches(val_corpus, prepared.tokenizer(), **kwargs)
    logged = dropped_lines(caplog)
    assert len(expected) >= 3
    assert_identical(expected, np_val_batches(prepared.directory, **kwargs))
    assert dropped_lines(caplog) == logged and len(logged) == 1


def test_no_pair_within_max_length_is_refused_as_make_batches_refuses_it(prepared, val_corpus):
    with pytest.raises(ValueError) as raised:
        tf_val_batches(val_corpus, prepared.tokenizer(), tokens_per_batch=BUDGET, max_length=2)
    with pytest.raises(ValueError) as found:
        validation_batches(prepared, tokens_per_batch=BUDGET, max_length=2)
    assert str(found.value) == str(raised.value)
    assert "fits max_length=2; raise it" in str(found.value)


@pytest.fixture(scope="module")
def multi30k_prepared(multi30k_dir, tmp_path_factory) -> PreparedCorpus:
    """The first 3,000 pairs of Multi30k's train split (a vocabulary of 1,000: seconds to
    prepare) with its val split, all 1,014 pairs."""
    root = tmp_path_factory.mktemp("multi30k_val")
    for lang in ("de", "en"):
        with gzip.open(multi30k_dir / f"train.{lang}.gz", "rt", encoding="utf-8") as handle:
            (root / f"train.{lang}").write_text("".join(handle.readlines()[:3000]))
    return prepare_corpus(open_corpus(root, "train", "de", "en"), root / "prepared",
                          vocab_size=1000, max_length=128, shard_pairs=2000,
                          validation=load_corpus(multi30k_dir, "val", "de", "en"))


@pytest.mark.integration
@pytest.mark.parametrize("kwargs", [
    dict(),  # the multi30k recipe's: default buckets
    dict(bucket_boundaries=xla_bucket_boundaries(128), static_shapes=True),  # under XLA
    dict(max_length=32, pipelines=(2, 0, 2)),  # pairs dropped; pipeline 0 of 2, 2 replicas
], ids=["default-buckets", "xla-static-shapes", "dropped,pipelines"])
def test_validation_batches_are_make_batches_on_multi30k_val(multi30k_prepared, multi30k_dir,
                                                             kwargs):
    val = load_corpus(multi30k_dir, "val", "de", "en")
    assert len(val) == multi30k_prepared.validation["pairs"] == 1014
    kwargs = {"tokens_per_batch": 4096, "max_length": 128, **kwargs}
    expected = tf_val_batches(val, multi30k_prepared.tokenizer(), **kwargs)
    assert len(expected) >= 5
    assert_identical(expected, np_val_batches(multi30k_prepared.directory, **kwargs))


def test_damaged_validation_files_are_refused_in_one_line(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared.directory, copy)
    entry = prepared.validation
    ids, lengths = copy / entry["ids"], copy / entry["lengths"]
    original = ids.read_bytes()

    # Bytes changed in place: verify() checks the validation files too.
    ids.write_bytes(original[:6] + bytes([original[6] ^ 1]) + original[7:])
    folder = PreparedFolder.load(copy)
    with pytest.raises(PreparedError, match=rf"{ids}: checksum [0-9a-f]{{8}}, the manifest says "
                       rf"{entry['ids_crc32']}: the prepared corpus is damaged"):
        folder.verify()
    folder.verify(range(folder.num_shards))  # the shards alone are intact

    # A truncated file: its size, on opening.
    ids.write_bytes(original[:-2])
    with pytest.raises(PreparedError, match=rf"{ids}: {len(original) - 2} bytes, the manifest "
                       rf"says {len(original)}: the prepared corpus is damaged"):
        PreparedFolder.load(copy)

    # An id outside the vocabulary, or lengths that do not add up: the reader's checks.
    ids.write_bytes(original[:10] + np.array([60000], "<u2").tobytes() + original[12:])
    with pytest.raises(PreparedError) as found:
        validation_batches(copy, tokens_per_batch=BUDGET)
    assert str(found.value).startswith(f"{ids}: token id 60000 among its ")
    assert str(found.value).endswith("the prepared corpus is damaged (a failing disk or an "
                                     "incomplete copy); prepare it again, or copy it again "
                                     "from where it was prepared")
    ids.write_bytes(original)
    values = np.frombuffer(lengths.read_bytes(), "<i4").copy()
    values[3] += 1
    lengths.write_bytes(values.tobytes())
    with pytest.raises(PreparedError, match=rf"{lengths}: lengths adding up to "
                       rf"{values.sum()} pieces .* holds {values.sum() - 1}: the prepared"):
        validation_batches(copy, tokens_per_batch=BUDGET)


def test_a_folder_prepared_without_validation_data(prepared, tmp_path):
    """As an earlier version left it: the training batches are the same (TensorFlow's and
    numpy's); the validation batches are refused, saying how to prepare them."""
    copy = tmp_path / "older"
    shutil.copytree(prepared.directory, copy)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    for kind in ("ids", "lengths"):
        (copy / manifest[VALIDATION][kind]).unlink()
    del manifest[VALIDATION]
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    older = PreparedCorpus.load(copy)
    older.verify()
    assert older.validation is None
    kwargs = dict(tokens_per_batch=BUDGET, seed=1)
    expected = tf_batches(prepared, 30, **kwargs)
    assert_identical(expected, tf_batches(older, 30, **kwargs))
    assert_identical(expected, np_batches(copy, 30, **kwargs))
    with pytest.raises(PreparedError, match=rf"^{copy} holds no validation split \(prepared by an "
                       r"earlier version, or without one\); prepare the corpus again with this "
                       r"version, into a new folder \(`python -m keras_transformer.prepare \.\.\. "
                       r"--val-split SPLIT --out NEW`, then --prepared NEW\)$"):
        validation_batches(copy, tokens_per_batch=BUDGET)
    with pytest.raises(PreparedError, match="--val-split val --out NEW"):
        older.check_validation("val")


def test_a_full_disk_while_writing_the_validation_split_leaves_nothing(prepared, tmp_path):
    text = Path(prepared.validation["origin"])
    written = sum(file.stat().st_size for file in prepared.directory.rglob("*")
                  if file.is_file() and not file.name.startswith((VALIDATION, MANIFEST_FILE)))
    disk = tmp_path / "disk"
    with full_disk(disk, written + 64, mount=False):  # bytes counted exactly: no tmpfs pages
        with pytest.raises(StorageError) as raised:
            prepare_corpus(open_corpus(text, "train", "de", "en"), disk / "prep", **SETTINGS,
                           validation=load_corpus(text, "val", "de", "en"))
    error = raised.value
    assert error.errno == errno.ENOSPC and error.path == disk / "prep"
    assert str(error).startswith(f"no space left on the device writing {disk / 'prep'} (")
    validation = prepared.validation["ids_bytes"] + prepared.validation["lengths_bytes"]
    assert written + validation <= error.needed < written + validation + PAGE
    assert list(disk.iterdir()) == []
