"""pipelines.prepared, the chunk stream of pipelines.batching and the streaming parts of
pipelines.corpora, on small corpora written by the tests (and, marked integration, Multi30k)."""

import builtins
import collections
import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import pipelines.shard_files as shard_files_module
from pipelines.batching import (
    StreamPosition,
    _chunk_order,
    default_bucket_boundaries,
    padding_efficiency,
    plan_batches,
)
from pipelines.constants import BOS_ID, EOS_ID, PAD_ID
from pipelines.corpora import (
    CorpusError,
    ParallelCorpus,
    corpus_fingerprint,
    mixed_corpus,
    open_corpus,
    scan_corpus,
)
from pipelines.prepared import (
    MANIFEST_FILE,
    PreparedCorpus,
    PreparedError,
    damaged_shard,
    prepare_corpus,
)
from pipelines.storage import StorageError
from pipelines.tokenizer import train_tokenizer
from tests.pipelines.test_batching import as_numpy
from tests.pipelines.test_corpora import write

PAIRS = 400  # of small_corpus, written to a folder
MAX_LENGTH = 64  # keeps about two thirds of them
SHARD_PAIRS = 60  # -> 7 shards
BUDGET = 128  # tokens per batch: ~90 batches per epoch
RESUME_BUDGET = 256  # ~45 batches per epoch, ~6 per shard
VOCAB = 400
SETTINGS = {"vocab_size": VOCAB, "max_length": MAX_LENGTH, "tokenizer_sample": 1000,
            "shard_pairs": SHARD_PAIRS, "seed": 0}
BLANK_LINE = 100  # 0-based index of a line blank on both sides in the written corpus


# --- helpers -------------------------------------------------------------------------------


def same(a, b) -> bool:
    """Two lists of batches are equal, shape and value of every tensor."""
    return len(a) == len(b) and all(
        x.shape == y.shape and (x == y).all()
        for p, q in zip(a, b, strict=True)
        for x, y in zip(p, q, strict=True)
    )


def unpad(row):
    return row[row != PAD_ID].tolist()


def decode(tokenizer, ids) -> list[str]:
    return [t.decode() for t in tokenizer.detokenize(ids).numpy()]


def batch_pairs(tokenizer, batches) -> list[tuple[str, str]]:
    """The (source, target) texts of batches, from the source and the labels."""
    pairs = []
    for source, _, labels in batches:
        pairs += zip(decode(tokenizer, source), decode(tokenizer, labels), strict=True)
    return pairs


def epoch_pairs(prepared, **kwargs) -> list[tuple[str, str]]:
    kwargs = {"tokens_per_batch": BUDGET, "repeat": False, **kwargs}
    return batch_pairs(prepared.tokenizer(), as_numpy(prepared.batches(**kwargs)))


def positions(tokenizer, corpus: ParallelCorpus) -> np.ndarray:
    """Length of every pair in positions: max(pieces) + 1."""
    source = tokenizer.tokenize(tf.constant(corpus.sources)).row_lengths().numpy()
    target = tokenizer.tokenize(tf.constant(corpus.targets)).row_lengths().numpy()
    return np.maximum(source, target) + 1


def kept_pairs(tokenizer, corpus, max_length=MAX_LENGTH) -> list[tuple[str, str]]:
    keep = positions(tokenizer, corpus) <= max_length
    return [pair for pair, k in zip(zip(corpus.sources, corpus.targets, strict=True), keep,
                                    strict=True) if k]


def staging_folders(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-prepare-" in p.name)


def fake_tfds(examples, langs):
    """A stand-in for `builder._as_dataset` yielding the given {lang: text} dicts."""

    def as_dataset(self, split, **kwargs):
        del self, kwargs
        return tf.data.Dataset.from_tensor_slices(
            {lang: tf.constant([e[lang] for e in examples[split]]) for lang in langs})

    return as_dataset


def per_epoch(prepared, budget=BUDGET, max_length=MAX_LENGTH, boundaries=None) -> int:
    """Batches of one epoch, from the shards' batch plans."""
    ends = prepared.shard_batches(budget, max_length, bucket_boundaries=boundaries)
    return int(sum(len(e) for e in ends))


PAGE = 4096  # what tmpfs allocates a file's content in
REAL_OPEN = builtins.open


def pages(*files: Path) -> int:
    """The bytes that `files` take on a tmpfs: whole pages."""
    return sum(-(-file.stat().st_size // PAGE) * PAGE for file in files)


@contextlib.contextmanager
def full_disk(folder: Path, free: int, mount: bool = True) -> Iterator[str]:
    """`folder` (created empty) as a file system with `free` bytes: a tmpfs of that size
    (rounded up to pages) mounted there where this user may (root, as in CI's containers),
    else Python's writes of files under it failing with ENOSPC past `free` bytes (all the
    project's writes go through `open`). Yields how: "tmpfs" or "patched"."""
    folder.mkdir(parents=True)
    size = max(PAGE, -(-free // PAGE) * PAGE)
    mounted = mount and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True).returncode == 0
    try:
        with pytest.MonkeyPatch.context() as patch:
            if not mounted:
                patch.setattr(builtins, "open", _LimitedOpen(folder, free))
            yield "tmpfs" if mounted else "patched"
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


class _LimitedOpen:
    """`open` for `full_disk` without a mount: files written under `folder` get `free` bytes
    in all, then ENOSPC, as a full disk would report it."""

    def __init__(self, folder: Path, free: int):
        self.folder, self.free, self.open = folder.resolve(), free, REAL_OPEN

    def __call__(self, file, mode="r", *args, **kwargs):
        handle = self.open(file, mode, *args, **kwargs)
        if not set(mode) & set("wax+") or not isinstance(file, str | os.PathLike) or \
                self.folder not in Path(file).resolve().parents:
            return handle
        return _LimitedFile(handle, self)

    def spend(self, count: int, path: str) -> None:
        if count > self.free:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        self.free -= count


class _LimitedFile:
    def __init__(self, handle, disk: _LimitedOpen):
        self._handle, self._disk = handle, disk

    def write(self, data):
        self._disk.spend(len(data), self._handle.name)
        return self._handle.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._handle.close()

    def __getattr__(self, name):
        return getattr(self._handle, name)


def copy_of(prepared: PreparedCorpus, folder: Path, **manifest_changes) -> Path:
    """A copy of `prepared`'s directory in `folder`, its manifest changed as given."""
    shutil.copytree(prepared.directory, folder)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest.update(manifest_changes)
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return folder


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Replaces bytes of `path` in place (same size): what a failing disk does."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(small_corpus) -> ParallelCorpus:
    """The first PAIRS pairs of small_corpus (all distinct)."""
    pairs = list(zip(small_corpus.sources[:PAIRS], small_corpus.targets[:PAIRS], strict=True))
    assert len(set(pairs)) == PAIRS
    return ParallelCorpus(small_corpus.sources[:PAIRS], small_corpus.targets[:PAIRS], "de", "en",
                          "train", "synthetic")


@pytest.fixture(scope="module")
def folder(corpus, tmp_path_factory) -> Path:
    """`corpus` as gzipped train.de.gz and plain train.en, with one line blank on both sides."""
    root = tmp_path_factory.mktemp("corpus")
    sources, targets = list(corpus.sources), list(corpus.targets)
    sources.insert(BLANK_LINE, "")
    targets.insert(BLANK_LINE, "   ")
    write(root, "train.de.gz", sources)
    write(root, "train.en", targets)
    return root


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory) -> PreparedCorpus:
    split = open_corpus(folder, "train", "de", "en")
    return prepare_corpus(split, tmp_path_factory.mktemp("prepared") / "prep", **SETTINGS)


# --- 1. preparation: every kept pair once, dropped pairs counted, the tokenizer ----------------


def test_a_prepared_folder_is_readable_by_other_users(prepared):
    """Prepared once (as root in a container, say), trained by another user: the folder and
    its tokenizer get what the umask gives any folder (0755 under the usual 022), not
    mkdtemp's owner-only 0700."""
    umask = os.umask(0)
    os.umask(umask)
    for folder in (prepared.directory, prepared.directory / "tokenizer"):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask, oct(folder.stat().st_mode)


def test_every_kept_pair_appears_once_per_epoch(prepared, corpus):
    tokenizer = prepared.tokenizer()
    expected = kept_pairs(tokenizer, corpus)
    assert 0 < len(expected) < PAIRS  # some pairs are too long
    manifest = prepared.manifest
    assert manifest["pairs_total"] == PAIRS  # the blank line is no pair
    assert manifest["pairs_kept"] == prepared.pairs == len(expected)
    assert prepared.num_shards == -(-PAIRS // SHARD_PAIRS) == 7
    shard_pairs = [shard["pairs"] for shard in manifest["shards"]]
    assert sum(shard_pairs) == len(expected) and min(shard_pairs) > 0
    lengths = positions(tokenizer, corpus)
    histogram = np.sum([shard["histogram"] for shard in manifest["shards"]], axis=0)
    assert histogram.tolist() == np.bincount(lengths[lengths <= MAX_LENGTH],
                                             minlength=MAX_LENGTH + 1).tolist()
    assert prepared.settings == {"src_lang": "de", "tgt_lang": "en", "vocab_size": VOCAB,
                                 "max_length": MAX_LENGTH, "tokenizer_sample": 1000, "seed": 0}

    batches = as_numpy(prepared.batches(tokens_per_batch=BUDGET, shuffle=False, repeat=False))
    assert len(batches) == per_epoch(prepared)
    for source, target, labels in batches:
        assert source.dtype == target.dtype == labels.dtype == np.int32
        assert target.shape == labels.shape and source.shape[0] == target.shape[0]
        for src_row, tgt_row, label_row in zip(source, target, labels, strict=True):
            src, tgt, lab = unpad(src_row), unpad(tgt_row), unpad(label_row)
            assert src[-1] == EOS_ID and EOS_ID not in src[:-1] and BOS_ID not in src
            assert tgt[0] == BOS_ID and BOS_ID not in tgt[1:] and EOS_ID not in tgt
            assert lab == tgt[1:] + [EOS_ID]
            assert (src_row[len(src):] == PAD_ID).all() and (tgt_row[len(tgt):] == PAD_ID).all()
    pairs = batch_pairs(tokenizer, batches)
    assert collections.Counter(pairs) == collections.Counter(expected)

    # Without shuffling, shards come in order and each one's batches as planned.
    sizes = [source.shape[0] for source, _, _ in batches]
    planned = np.concatenate([np.diff(ends, prepend=0)
                              for ends in prepared.shard_batches(BUDGET, MAX_LENGTH)])
    assert sizes == planned.tolist()


def test_tokenizer_is_the_one_trained_on_the_sample(prepared, corpus, tmp_path):
    # tokenizer_sample (1000) exceeds the corpus: the sample is the whole corpus, in order.
    reference = train_tokenizer([*corpus.sources, *corpus.targets], tmp_path / "tokenizer",
                                vocab_size=VOCAB, seed=0)
    tokenizer = prepared.tokenizer()
    assert tokenizer.vocab_size == VOCAB == prepared.manifest["tokenizer_vocab_size"]
    assert tokenizer.model_proto == reference.model_proto
    assert tokenizer.settings["corpus_fingerprint"] == corpus_fingerprint(corpus)
    assert prepared.manifest["corpus_fingerprint"] == corpus_fingerprint(corpus)
    assert tokenizer.settings["sample_pairs"] == PAIRS


def test_small_tokenizer_sample_and_min_shards(folder, corpus, tmp_path):
    split = open_corpus(folder, "train", "de", "en")
    small = prepare_corpus(split, tmp_path / "prep", vocab_size=350, max_length=MAX_LENGTH,
                           tokenizer_sample=120, shard_pairs=10_000, min_shards=3, seed=4)
    assert small.num_shards == 3
    assert small.tokenizer().settings["sample_pairs"] == 120
    assert small.manifest["pairs_total"] == PAIRS
    expected = kept_pairs(small.tokenizer(), corpus)
    assert collections.Counter(epoch_pairs(small)) == collections.Counter(expected)


def test_shards_without_pairs_are_read_as_empty(folder, corpus, tmp_path):
    # max_length 8 keeps only a handful of the 400 pairs: some of the 7 shards get none.
    split = open_corpus(folder, "train", "de", "en")
    sparse = prepare_corpus(split, tmp_path / "prep", **{**SETTINGS, "max_length": 8})
    shard_pairs = [shard["pairs"] for shard in sparse.manifest["shards"]]
    assert 0 in shard_pairs and sum(shard_pairs) == sparse.pairs > 0
    expected = kept_pairs(sparse.tokenizer(), corpus, max_length=8)
    assert len(expected) == sparse.pairs
    for shuffle in (False, True):
        pairs = epoch_pairs(sparse, shuffle=shuffle)
        assert collections.Counter(pairs) == collections.Counter(expected)


# --- 2. token budget and bucket widths -----------------------------------------------------


def test_a_runs_batches_run_without_tf_datas_autotuning_thread(prepared):
    # A training run's pipeline, as make_batches' (tests/pipelines/test_batching.py).
    options = prepared.batches(tokens_per_batch=BUDGET, seed=1).options()
    assert options.autotune.enabled is False and options.deterministic is True


@pytest.mark.parametrize(("budget", "max_length", "boundaries"), [
    (BUDGET, None, None),
    (300, None, None),
    (200, 40, [8, 16, 24, 32]),
])
def test_token_budget_and_bucket_widths(prepared, budget, max_length, boundaries):
    grid = set(boundaries or default_bucket_boundaries(max_length or MAX_LENGTH))
    grid.add(max_length or MAX_LENGTH)
    batches = as_numpy(prepared.batches(tokens_per_batch=budget, max_length=max_length,
                                        bucket_boundaries=boundaries, seed=1, repeat=False))
    for source, target, labels in batches:
        batch, s, t = source.shape[0], source.shape[1], target.shape[1]
        assert batch * max(s, t) <= budget
        assert s in grid and t in grid and labels.shape[1] == t
        longest_source = max(len(unpad(row)) for row in source)
        longest_target = max(len(unpad(row)) for row in target)
        assert s == min(b for b in grid if b >= longest_source)
        assert t == min(b for b in grid if b >= longest_target)
    if max_length is not None:  # shorter than prepared: the longer pairs are left out
        histogram = np.sum([shard["histogram"] for shard in prepared.manifest["shards"]], axis=0)
        assert sum(source.shape[0] for source, _, _ in batches) == histogram[:max_length + 1].sum()
        assert len(batches) == per_epoch(prepared, budget, max_length, boundaries)


def test_max_length_above_the_prepared_one_is_refused(prepared):
    with pytest.raises(PreparedError, match=f"max_length 65 exceeds the {MAX_LENGTH}"):
        prepared.batches(tokens_per_batch=BUDGET, max_length=MAX_LENGTH + 1)
    with pytest.raises(ValueError, match="fewer than max_length"):
        prepared.batches(tokens_per_batch=MAX_LENGTH - 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_batches_is_greedy_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    max_length, budget = 50, 120
    histogram = rng.integers(0, 12, size=max_length + 1)
    histogram[0] = 0
    boundaries = [4, 8, 12, 16, 24, 32, 40]  # pairs longer than 40 are not batched
    ends = plan_batches(histogram, boundaries, budget)
    lengths = np.repeat(np.arange(max_length + 1), histogram)  # the pairs, sorted by length
    batched = int(histogram[:41].sum())
    assert ends[-1] == batched and (np.diff(ends, prepend=0) > 0).all()

    def bucket(length):
        return min(b for b in boundaries if b >= length)

    for start, end in zip(np.concatenate([[0], ends[:-1]]), ends, strict=True):
        size = end - start
        assert size * bucket(lengths[end - 1]) <= budget
        if end < batched:  # greedy: the next pair would not have fitted
            assert (size + 1) * bucket(lengths[end]) > budget


# --- 3. O(1) resume ------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_skip_batches_equals_replaying_the_stream(prepared, shuffle):
    epoch = per_epoch(prepared, RESUME_BUDGET)
    first_shard = len(prepared.shard_batches(RESUME_BUDGET, MAX_LENGTH)[0])
    skips = [1, 5, first_shard - 1, first_shard, first_shard + 1, epoch - 1, epoch, epoch + 7,
             2 * epoch + 20]
    look = 4
    stream = prepared.batches(tokens_per_batch=RESUME_BUDGET, seed=3, shuffle=shuffle)
    reference = as_numpy(stream, limit=max(skips) + look)
    for skip in skips:
        resumed = prepared.batches(tokens_per_batch=RESUME_BUDGET, seed=3, shuffle=shuffle,
                                   skip_batches=skip)
        assert same(as_numpy(resumed, limit=look), reference[skip:skip + look]), skip


def test_skip_batches_within_one_epoch_without_repeat(prepared):
    reference = as_numpy(prepared.batches(tokens_per_batch=BUDGET, seed=5, repeat=False))
    for skip in (3, len(reference) - 2):
        resumed = prepared.batches(tokens_per_batch=BUDGET, seed=5, repeat=False,
                                   skip_batches=skip)
        assert same(as_numpy(resumed), reference[skip:])


def test_skip_batches_past_the_end_without_repeat_is_empty(prepared):
    # One epoch skipped entirely (or more) leaves nothing, as .skip(N) of that stream does.
    once = prepared.batches(tokens_per_batch=RESUME_BUDGET, seed=5, repeat=False)
    epoch = sum(1 for _ in once)
    for skip in (epoch, epoch + 3):
        assert as_numpy(once.skip(skip)) == []
        resumed = prepared.batches(tokens_per_batch=RESUME_BUDGET, seed=5, repeat=False,
                                   skip_batches=skip)
        assert as_numpy(resumed) == [], skip


def test_skip_batches_far_beyond_the_start(prepared):
    far = 10**7
    # The same stream seen from two far points: 30 batches cross at least one shard.
    ahead = as_numpy(prepared.batches(tokens_per_batch=BUDGET, seed=2, skip_batches=far),
                     limit=3)
    behind = as_numpy(prepared.batches(tokens_per_batch=BUDGET, seed=2, skip_batches=far - 30),
                      limit=33)
    assert same(ahead, behind[30:])


def test_stream_position_is_arithmetic_on_batch_counts(prepared):
    counts = [len(ends) for ends in prepared.shard_batches(BUDGET, MAX_LENGTH)]
    total = sum(counts)
    far = 10**7
    for shuffle in (False, True):
        position = StreamPosition.after(far, counts, seed=9, shuffle=shuffle)
        order = _chunk_order(len(counts), 9, position.epoch, shuffle).numpy()
        assert position.epoch == far // total
        assert 0 <= position.batch < counts[order[position.chunk]]
        before = sum(counts[c] for c in order[:position.chunk])
        assert before + position.batch == far % total
    assert StreamPosition.after(0, counts, seed=0) == StreamPosition()

    # Chunks without batches are never a position; every batch of an epoch is one position.
    counts = [3, 0, 5, 2, 4]
    for shuffle in (False, True):
        seen = [StreamPosition.after(n, counts, seed=1, shuffle=shuffle) for n in range(2 * 14)]
        assert len(set(seen)) == len(seen)
        for epoch in (0, 1):
            order = _chunk_order(len(counts), 1, epoch, shuffle).numpy()
            expected = [StreamPosition(epoch, i, b) for i, chunk in enumerate(order)
                        for b in range(counts[chunk])]
            assert seen[14 * epoch:14 * (epoch + 1)] == expected
    with pytest.raises(ValueError, match="no batches"):
        StreamPosition.after(3, [0, 0], seed=0)


# --- 4. sharding by file -------------------------------------------------------------------


def test_input_pipelines_read_disjoint_shards(prepared, corpus):
    expected = kept_pairs(prepared.tokenizer(), corpus)
    shards = prepared.manifest["shards"]
    seen = []
    for pipeline in range(2):
        context = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline,
                                             num_replicas_in_sync=2)
        batches = as_numpy(prepared.batches(tokens_per_batch=2 * BUDGET, input_context=context,
                                            shuffle=False, repeat=False))
        for source, target, _ in batches:  # each replica gets half the global budget
            assert source.shape[0] * max(source.shape[1], target.shape[1]) <= BUDGET
        pairs = batch_pairs(prepared.tokenizer(), batches)
        assert len(pairs) == sum(shard["pairs"] for shard in shards[pipeline::2])
        seen.append(pairs)
    assert not set(seen[0]) & set(seen[1])
    assert collections.Counter(seen[0] + seen[1]) == collections.Counter(expected)

    # Resuming one pipeline: its own stream, skipped.
    context = tf.distribute.InputContext(2, 1, 2)
    reference = as_numpy(prepared.batches(tokens_per_batch=2 * BUDGET, input_context=context,
                                          seed=4), limit=60)
    resumed = prepared.batches(tokens_per_batch=2 * BUDGET, input_context=context, seed=4,
                               skip_batches=55)
    assert same(as_numpy(resumed, limit=5), reference[55:])

    with pytest.raises(PreparedError, match="7 shard.*8 input pipelines"):
        prepared.batches(tokens_per_batch=8 * BUDGET,
                         input_context=tf.distribute.InputContext(8, 3, 8))


def test_works_with_distribute_datasets_from_function(prepared):
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    distributed = strategy.distribute_datasets_from_function(
        lambda context: prepared.batches(tokens_per_batch=BUDGET, input_context=context,
                                         repeat=False))
    seen = sum(int(tf.shape(features["source"])[0]) for features, _ in distributed)
    assert seen == prepared.pairs


# --- 5. killed, incomplete, damaged ----------------------------------------------------------


def test_load_refuses_incomplete_or_damaged_directories(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared.directory, copy)
    assert PreparedCorpus.load(copy).manifest == prepared.manifest  # a copy is self-contained
    shard = prepared.manifest["shards"][2]

    ids = copy / shard["ids"]
    original = ids.read_bytes()
    ids.write_bytes(original[:-2])
    with pytest.raises(PreparedError, match=rf"{shard['ids']}: {len(original) - 2} bytes.*damaged"):
        PreparedCorpus.load(copy)
    ids.write_bytes(original)

    lengths = copy / shard["lengths"]
    lengths.unlink()
    with pytest.raises(PreparedError, match=rf"{shard['lengths']}: missing"):
        PreparedCorpus.load(copy)
    shutil.copy(prepared.directory / shard["lengths"], lengths)
    PreparedCorpus.load(copy)

    (copy / MANIFEST_FILE).write_text('{"format_version": 1, "shards": [')
    with pytest.raises(PreparedError, match="unreadable"):
        PreparedCorpus.load(copy)
    (copy / MANIFEST_FILE).unlink()
    with pytest.raises(PreparedError, match="not a prepared corpus"):
        PreparedCorpus.load(copy)
    with pytest.raises(PreparedError, match="not a prepared corpus"):
        PreparedCorpus.load(tmp_path / "never")


def test_stale_staging_of_a_dead_preparation_is_removed(folder, tmp_path):
    target = tmp_path / "prep"
    host = socket.gethostname()
    dead = tmp_path / f".prep.tmp-prepare-{host}-999999999-abc123"  # no such pid
    dead.mkdir()
    (dead / "shard-00000-of-00001.ids").write_bytes(b"\x01\x02")
    # This very process has not started a preparation yet: a folder with its pid is a
    # leftover (a container restarted under the same pid).
    ours = tmp_path / f".prep.tmp-prepare-{host}-{os.getpid()}-old"
    ours.mkdir()
    alive = tmp_path / f".prep.tmp-prepare-{host}-{os.getppid()}-other"  # a running one
    alive.mkdir()
    remote = tmp_path / ".prep.tmp-prepare-another-host-999999999-x"  # not judged from here
    remote.mkdir()
    elsewhere = tmp_path / f".other.tmp-prepare-{host}-999999999-abc"  # another directory's
    elsewhere.mkdir()
    with pytest.raises(PreparedError):
        PreparedCorpus.load(target)
    result = prepare_corpus(open_corpus(folder, "train", "de", "en"), target, **SETTINGS)
    assert result.pairs > 0 and (target / MANIFEST_FILE).is_file()
    assert not dead.exists() and not ours.exists()
    assert staging_folders(tmp_path) == sorted([alive.name, remote.name, elsewhere.name])


def test_prepare_refuses_a_non_empty_directory(folder, prepared, tmp_path):
    split = open_corpus(folder, "train", "de", "en")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(PreparedError, match="not an empty directory"):
        prepare_corpus(split, busy, **SETTINGS)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(PreparedError, match="not an empty directory"):
        prepare_corpus(split, tmp_path / "file", **SETTINGS)
    with pytest.raises(PreparedError, match="not an empty directory"):
        prepare_corpus(split, prepared.directory, **SETTINGS)  # already prepared
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_corpus(split, empty, **SETTINGS).manifest["shards"] == \
        prepared.manifest["shards"]
    assert staging_folders(tmp_path) == []


@pytest.mark.parametrize(("damage", "match"), [
    ("empty_side", r"train\.en: line 151 is empty"),
    ("short_file", "line counts differ"),
])
def test_invalid_corpus_fails_before_anything_is_written(corpus, tmp_path, damage, match):
    sources, targets = list(corpus.sources[:300]), list(corpus.targets[:300])
    if damage == "empty_side":
        targets[150] = ""
    else:
        targets.pop()
    write(tmp_path / "corpus", "train.de.gz", sources)
    write(tmp_path / "corpus", "train.en", targets)
    split = open_corpus(tmp_path / "corpus", "train", "de", "en")  # resolves, reads nothing
    out = tmp_path / "out"
    target = out / "prep"
    with pytest.raises(CorpusError, match=match):
        prepare_corpus(split, target, **SETTINGS)
    assert not target.exists()
    assert not out.exists() or staging_folders(out) == []


def test_failure_while_writing_leaves_nothing(folder, tmp_path, monkeypatch):
    split = open_corpus(folder, "train", "de", "en")
    write_shards = shard_files_module.write_shards

    def fail_after_writing(*args, **kwargs):
        write_shards(*args, **kwargs)
        raise PermissionError(errno.EACCES, "Permission denied")  # not the storage's fault

    monkeypatch.setattr(shard_files_module, "write_shards", fail_after_writing)
    with pytest.raises(PermissionError, match="Permission denied"):
        prepare_corpus(split, tmp_path / "prep", **SETTINGS)
    assert not (tmp_path / "prep").exists() and staging_folders(tmp_path) == []
    monkeypatch.setattr(shard_files_module, "write_shards", write_shards)
    assert prepare_corpus(split, tmp_path / "prep", **SETTINGS).pairs > 0


@pytest.mark.parametrize("stage", ["tokenizer", "shards"])
def test_a_full_disk_raises_storage_error_and_leaves_nothing(folder, prepared, tmp_path, stage):
    # The disk is full while the tokenizer is saved, or later, in the middle of the shards.
    tokenizer = pages(*(prepared.directory / "tokenizer").iterdir())
    free = PAGE if stage == "tokenizer" else tokenizer + PAGE
    disk = tmp_path / "disk"
    with full_disk(disk, free):
        split = open_corpus(folder, "train", "de", "en")
        with pytest.raises(StorageError) as raised:
            prepare_corpus(split, disk / "prep", **SETTINGS)
        error = raised.value
        assert error.errno == errno.ENOSPC and error.path == disk / "prep"
        message = str(error)
        assert message.startswith(f"no space left on the device writing {disk / 'prep'} (")
        assert "free space (or fix the disk) and run the same command again" in message
        assert "\n" not in message
        if stage == "shards":  # the shards' size, extrapolated from those made
            shards = sum(s["ids_bytes"] + s["lengths_bytes"] for s in prepared.manifest["shards"])
            assert 0.5 * shards < error.needed < 2 * shards
        assert list(disk.iterdir()) == []  # neither DIR nor a staging folder
    assert list(disk.iterdir()) == []


def test_the_full_disk_of_the_tests_without_a_mount(tmp_path):
    # full_disk's fallback where mounting is not permitted: Python's writes get ENOSPC.
    with full_disk(tmp_path / "disk", 10, mount=False) as how:
        assert how == "patched"
        with open(tmp_path / "disk" / "small", "wb") as handle:
            handle.write(b"0123456789")
        with pytest.raises(OSError) as raised, open(tmp_path / "disk" / "more", "wb") as handle:
            handle.write(b"x")
        assert raised.value.errno == errno.ENOSPC
        assert (tmp_path / "disk" / "small").read_bytes() == b"0123456789"  # reads are normal
        with open(tmp_path / "elsewhere", "wb") as handle:  # other folders are not full
            handle.write(b"0123456789" * 10)
    assert builtins.open is REAL_OPEN


# --- 6. damage: checksums, and the input pipeline's checks -----------------------------------


def test_each_shard_file_has_its_crc32_in_the_manifest(prepared):
    for shard in prepared.manifest["shards"]:
        for kind in ("ids", "lengths"):
            data = (prepared.directory / shard[kind]).read_bytes()
            assert shard[f"{kind}_crc32"] == f"{zlib.crc32(data):08x}"
    prepared.verify()
    # Prepared without a validation split: the manifest is as before it could hold one.
    assert "validation" not in prepared.manifest and prepared.validation is None


@pytest.mark.parametrize("kind", ["ids", "lengths"])
def test_verify_finds_bytes_changed_at_the_same_size(prepared, tmp_path, kind):
    copy = copy_of(prepared, tmp_path / "copy")
    shard = prepared.manifest["shards"][3]
    damaged = copy / shard[kind]
    overwrite(damaged, 16, b"\xde\xad\xbe\xef\xde\xad\xbe\xef")  # 8 bytes
    loaded = PreparedCorpus.load(copy)  # the sizes are right
    loaded.verify(shards=[0, 1, 2, 4, 5, 6])  # only the others
    with pytest.raises(PreparedError) as raised:
        loaded.verify()
    found = f"{zlib.crc32(damaged.read_bytes()):08x}"
    assert str(raised.value) == (
        f"{damaged}: checksum {found}, the manifest says {shard[f'{kind}_crc32']}: the "
        "prepared corpus is damaged (a failing disk or an incomplete copy); prepare it again, "
        "or copy it again from where it was prepared")
    damaged.unlink()
    with pytest.raises(PreparedError, match=rf"{damaged}: unreadable \(No such file"):
        loaded.verify([3])


def test_a_manifest_without_checksums_still_loads_and_verifies_nothing(prepared, tmp_path):
    # As written before checksums were recorded (the format version is the same).
    shards = [{key: value for key, value in shard.items() if not key.endswith("_crc32")}
              for shard in prepared.manifest["shards"]]
    copy = copy_of(prepared, tmp_path / "copy", shards=shards)
    loaded = PreparedCorpus.load(copy)
    assert loaded.manifest["shards"] == shards
    assert collections.Counter(epoch_pairs(loaded)) == collections.Counter(epoch_pairs(prepared))
    overwrite(copy / shards[0]["lengths"], 0, b"\x01\x00\x00\x00")
    loaded.verify()  # nothing to compare with; the input pipeline's checks still see it
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        epoch_pairs(loaded)
    assert str(damaged_shard(raised.value)).startswith(f"{copy / shards[0]['lengths']}: ")


def damaged_copy(prepared, folder: Path, kind: str) -> tuple[PreparedCorpus, Path]:
    """A copy whose shard 3 holds an id past the vocabulary ("ids") or a length one too
    large ("lengths"), with the manifest's checksum made to match: only the input
    pipeline's checks can find it."""
    copy = copy_of(prepared, folder)
    shard = prepared.manifest["shards"][3]
    damaged = copy / shard[kind]
    if kind == "ids":
        overwrite(damaged, 10, np.array([60000], "<u2").tobytes())
    else:
        lengths = np.frombuffer(damaged.read_bytes(), "<i4")
        overwrite(damaged, 4, np.array([lengths[1] + 1], "<i4").tobytes())
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["shards"][3][f"{kind}_crc32"] = f"{zlib.crc32(damaged.read_bytes()):08x}"
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    loaded = PreparedCorpus.load(copy)
    loaded.verify()
    return loaded, damaged


@pytest.mark.parametrize("kind", ["ids", "lengths"])
def test_the_input_pipeline_refuses_a_damaged_shard_in_one_line(prepared, tmp_path, kind):
    loaded, damaged = damaged_copy(prepared, tmp_path / "copy", kind)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        as_numpy(loaded.batches(tokens_per_batch=BUDGET, repeat=False))
    error = damaged_shard(raised.value)
    assert isinstance(error, PreparedError)
    ids = np.frombuffer(damaged.with_suffix(".ids").read_bytes(), "<u2")
    lengths = np.frombuffer(damaged.with_suffix(".lengths").read_bytes(), "<i4")
    detail = (f"token id 60000 among its {len(ids)} ids, outside the vocabulary (0 to "
              f"{VOCAB - 1})" if kind == "ids" else f"lengths adding up to {lengths.sum()} "
              f"pieces (the shortest {lengths.min()}) where its .ids file holds {len(ids)}")
    assert str(error) == (
        f"{damaged}: {detail}: the prepared corpus is damaged (a failing disk or an incomplete "
        "copy); prepare it again, or copy it again from where it was prepared")
    # Other errors are not taken for damage.
    assert damaged_shard(ValueError("assertion failed: [x]")) is None
    assert damaged_shard(tf.errors.InvalidArgumentError(None, None, "other")) is None


def test_ids_stored_as_int32_are_checked_below_zero_too(tmp_path):
    # A vocabulary above 65,536 ids is stored as int32, where a damaged id can be negative.
    (tmp_path / "a.ids").write_bytes(np.array([5, 70000, -3, 9], "<i4").tobytes())
    (tmp_path / "a.lengths").write_bytes(np.array([2, 2], "<i4").tobytes())
    files = (tf.constant(str(tmp_path / "a.ids")), tf.constant(str(tmp_path / "a.lengths")))
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        shard_files_module.read_shard(*files, tf.int32, 80000)
    assert shard_files_module.failed_check(raised.value) == (
        f"{tmp_path / 'a.ids'}: token id -3 among its 4 ids, outside the vocabulary (0 to 79999)")
    (tmp_path / "a.ids").write_bytes(np.array([5, 70000, 3, 9], "<i4").tobytes())
    rows = shard_files_module.read_shard(*files, tf.int32, 80000)
    assert rows.to_list() == [[5, 70000], [3, 9]]


# --- 7. determinism; settings and source checks; waiting ------------------------------------


def test_same_seed_same_files(folder, prepared, corpus, tmp_path, caplog):
    split = open_corpus(folder, "train", "de", "en")
    with caplog.at_level(logging.INFO, logger="pipelines"):
        again = prepare_corpus(split, tmp_path / "again", **SETTINGS)
    kept = prepared.pairs
    assert f"kept {kept} of {PAIRS} pairs, dropped {PAIRS - kept}" in caplog.text

    def files(directory):
        return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())

    assert files(again.directory) == files(prepared.directory)
    for name in files(prepared.directory):
        if name != MANIFEST_FILE:
            assert (again.directory / name).read_bytes() == \
                (prepared.directory / name).read_bytes(), name
    first, second = dict(prepared.manifest), dict(again.manifest)
    first.pop("seconds"), second.pop("seconds")
    assert first == second

    other = prepare_corpus(split, tmp_path / "other", **{**SETTINGS, "seed": 1})
    assert [s["pairs"] for s in other.manifest["shards"]] != \
        [s["pairs"] for s in prepared.manifest["shards"]]  # pairs go to other shards
    assert collections.Counter(epoch_pairs(other)) == collections.Counter(epoch_pairs(prepared))


def test_batch_order_depends_on_seed_and_epoch(prepared):
    budget = RESUME_BUDGET
    epoch = per_epoch(prepared, budget)

    def stream(seed):
        return as_numpy(prepared.batches(tokens_per_batch=budget, seed=seed), limit=2 * epoch)

    first, again, other = stream(0), stream(0), stream(1)
    assert same(first, again)
    assert not same(first[:epoch], other[:epoch])
    assert not same(first[:epoch], first[epoch:])  # each epoch is reshuffled
    tokenizer = prepared.tokenizer()
    expected = sorted(epoch_pairs(prepared, tokens_per_batch=budget, shuffle=False))
    for batches in (first[:epoch], first[epoch:], other[:epoch]):
        assert sorted(batch_pairs(tokenizer, batches)) == expected
    assert prepared.batches(tokens_per_batch=budget).cardinality() == (
        tf.data.INFINITE_CARDINALITY)


def test_check_settings_names_every_difference(prepared):
    prepared.check_settings(prepared.settings)
    prepared.check_settings({"max_length": MAX_LENGTH})
    with pytest.raises(PreparedError) as info:
        prepared.check_settings({"vocab_size": 8000, "max_length": MAX_LENGTH, "seed": 5})
    message = str(info.value)
    assert "vocab_size: prepared with 400, wanted 8000" in message
    assert "seed: prepared with 0, wanted 5" in message and "max_length" not in message


def test_check_source_judges_a_changed_file_by_size_then_content(folder, prepared, tmp_path):
    """A file of another size has changed; one only touched (copied again, a volume mounted
    again) is read and kept when its content is the same, its new time then recorded."""
    directory = tmp_path / "prep"  # a copy: this test writes the manifest
    shutil.copytree(prepared.directory, directory)
    prepared = PreparedCorpus.load(directory)

    def check():
        prepared.check_source(open_corpus(folder, "train", "de", "en"))

    def recorded_time(path: Path) -> int:
        files = json.loads((directory / MANIFEST_FILE).read_text())["corpus"]["files"]
        return {file["path"]: file["mtime_ns"] for file in files}[str(path.resolve())]

    check()
    path = folder / "train.en"
    original, stat = path.read_bytes(), path.stat()
    later = stat.st_mtime_ns + 10**9
    try:
        os.utime(path, ns=(stat.st_atime_ns, later))
        check()
        assert recorded_time(path) == prepared.manifest["corpus"]["files"][1]["mtime_ns"] == later
        lines = original.split(b"\n")
        assert lines[0] != lines[1] and len(lines[0]) != len(lines[1])
        path.write_bytes(b"\n".join([lines[1], lines[0], *lines[2:]]))  # the same size
        with pytest.raises(PreparedError, match=r"train\.en changed since .*same size, other"):
            check()
        path.write_bytes(original + b"one more line\n")
        with pytest.raises(PreparedError, match=r"train\.en changed since .*bytes, then"):
            check()
        assert recorded_time(path) == later  # refusals record nothing
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    check()  # restored: the content is the one prepared
    assert recorded_time(path) == stat.st_mtime_ns
    # A copy elsewhere (other paths) is not judged, even if it differs.
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    write(copy, "train.en", ["something else"] * (PAIRS + 1))
    prepared.check_source(open_corpus(copy, "train", "de", "en"))


def test_check_source_refuses_another_mix_of_the_same_files(folder, prepared, tmp_path):
    """The real files match one by one, but the run adds a synthetic corpus, repeats the
    real pairs or tags them: another corpus, which the prepared shards do not hold."""
    real = open_corpus(folder, "train", "de", "en")
    write(tmp_path / "bt", "train.de", ["Ein Mann singt.", "Zwei Hunde."])
    write(tmp_path / "bt", "train.en", ["A man sings.", "Two dogs."])
    synthetic = open_corpus(tmp_path / "bt", "train", "de", "en")
    mixes = {"synthetic": mixed_corpus(real, synthetic=[synthetic], synthetic_tag="<BT>"),
             "upsampled": mixed_corpus(real, upsample_real=2)}
    for name, mix in mixes.items():
        with pytest.raises(PreparedError, match="another mix of corpora") as info:
            prepared.check_source(mix)
        assert "one corpus of 2 files" in str(info.value), name
    assert "×2" in str(info.value)
    # And the other way: shards of a mix are not reused for the plain corpus.
    mixed = prepare_corpus(mixes["synthetic"], tmp_path / "mixed", **SETTINGS)
    mixed.check_source(mixes["synthetic"])
    with pytest.raises(PreparedError, match=r"2 parts: .* tagged <BT>"):
        mixed.check_source(real)


# --- 7. streaming validation and sampling ---------------------------------------------------


def test_scan_counts_fingerprints_and_samples_in_corpus_order(folder, corpus):
    split = open_corpus(folder, "train", "de", "en")
    assert split.files is not None and split.split == "train"
    loaded = split.load()
    assert (loaded.sources, loaded.targets) == (corpus.sources, corpus.targets)
    index = {pair: i for i, pair in enumerate(zip(corpus.sources, corpus.targets, strict=True))}

    scan = scan_corpus(split, sample_pairs=50, seed=1)
    assert scan.pairs == PAIRS and scan.split == split
    assert scan.fingerprint == corpus_fingerprint(split) == corpus_fingerprint(loaded) == \
        corpus_fingerprint(corpus)
    sample = scan.sample
    assert len(sample) == 50 and (sample.src_lang, sample.tgt_lang) == ("de", "en")
    rows = [index[pair] for pair in zip(sample.sources, sample.targets, strict=True)]
    assert rows == sorted(set(rows))  # distinct pairs of the corpus, in corpus order
    assert rows[-1] >= 200  # drawn from the whole corpus, not its beginning

    again = scan_corpus(split, sample_pairs=50, seed=1).sample
    other = scan_corpus(split, sample_pairs=50, seed=2).sample
    assert (again.sources, again.targets) == (sample.sources, sample.targets)
    assert other.sources != sample.sources
    whole = scan_corpus(split, sample_pairs=PAIRS + 10, seed=3).sample
    assert (whole.sources, whole.targets) == (corpus.sources, corpus.targets)
    with pytest.raises(ValueError, match="sample_pairs must be positive"):
        scan_corpus(split, sample_pairs=0)


def scan_error(folder: Path, match: str) -> str:
    split = open_corpus(folder, "train", "de", "en")  # opening reads nothing
    with pytest.raises(CorpusError, match=match) as info:
        scan_corpus(split, sample_pairs=10)
    return str(info.value)


def test_scan_names_file_and_line(corpus, tmp_path):
    sources, targets = corpus.sources[:250], corpus.targets[:250]

    bad = tmp_path / "utf8"
    data = "".join(s + "\n" for s in sources).encode()
    lines = data.split(b"\n")
    lines[199] = b"Stra\xdfe"  # latin-1 sharp s on line 200
    write(bad, "train.de.gz", data=b"\n".join(lines))
    write(bad, "train.en", targets)
    message = scan_error(bad, r"train\.de\.gz: line 200: invalid UTF-8")
    assert "0xdf" in message

    short = tmp_path / "short"
    write(short, "train.de", sources)
    write(short, "train.en.gz", targets[:-1])
    message = scan_error(short, "line counts differ")
    assert "train.de has 250 lines" in message and "train.en.gz has 249 lines" in message

    empty_side = tmp_path / "empty_side"
    write(empty_side, "train.de", [*sources[:120], "  ", *sources[121:]])
    write(empty_side, "train.en", targets)
    scan_error(empty_side, r"train\.de: line 121 is empty but line 121 of .*train\.en is not")

    empty = tmp_path / "empty"
    write(empty, "train.de", data=b"")
    write(empty, "train.en", targets)
    scan_error(empty, r"train\.de: file is empty")


# --- 8. tensorflow-datasets ------------------------------------------------------------------


def test_prepare_from_a_tfds_dataset(corpus, prepared, tmp_path):
    name = "tfds:ted_hrlr_translate/pt_to_en"
    examples = {"train": [{"pt": s, "en": t}
                          for s, t in zip(corpus.sources, corpus.targets, strict=True)]}
    with tfds.testing.mock_data(as_dataset_fn=fake_tfds(examples, ("pt", "en"))):
        split = open_corpus(name, "train", "pt", "en", data_dir=str(tmp_path / "tfds"))
        assert split.files is None and split.origin == name
        from_tfds = prepare_corpus(split, tmp_path / "prep", **SETTINGS)
    manifest = from_tfds.manifest
    assert manifest["pairs_total"] == PAIRS and from_tfds.pairs == prepared.pairs
    assert manifest["corpus"]["origin"] == name and "tfds" in manifest["corpus"]
    assert (from_tfds.settings["src_lang"], from_tfds.settings["tgt_lang"]) == ("pt", "en")
    # Same texts in the same order, same seed: same vocabulary and the same shards.
    assert from_tfds.tokenizer().model_proto == prepared.tokenizer().model_proto
    assert manifest["shards"] == prepared.manifest["shards"]
    assert collections.Counter(epoch_pairs(from_tfds)) == collections.Counter(epoch_pairs(prepared))


# --- 9. the real Multi30k ----------------------------------------------------------------------


@pytest.mark.integration
def test_prepares_real_multi30k(multi30k_dir, tmp_path):
    split = open_corpus(multi30k_dir, "train", "de", "en")
    result = prepare_corpus(split, tmp_path / "multi30k", vocab_size=8000, seed=0)
    assert result.manifest["pairs_total"] == 29000 and result.pairs == 29000
    assert result.settings["max_length"] == 128
    assert result.tokenizer().vocab_size == 8000
    result.check_source(split)
    efficiency = padding_efficiency(result.batches(tokens_per_batch=4096), max_batches=200)
    assert efficiency >= 0.90


# --- 10. static shapes (XLA) -------------------------------------------------------------------


def test_static_shapes_give_one_shape_per_bucket_as_predicted(prepared):
    from pipelines.batching import xla_bucket_boundaries

    boundaries = xla_bucket_boundaries(MAX_LENGTH)
    kwargs = dict(tokens_per_batch=BUDGET, max_length=MAX_LENGTH, bucket_boundaries=boundaries)
    seen, real = set(), 0
    for source, target, labels in as_numpy(prepared.batches(repeat=False, static_shapes=True,
                                                            **kwargs)):
        width = labels.shape[1]
        assert source.shape == target.shape == labels.shape
        assert width in boundaries and labels.shape[0] == BUDGET // width
        seen.add(labels.shape)
        real += int(np.count_nonzero(labels.any(axis=1)))
    assert seen == prepared.static_shapes(BUDGET, MAX_LENGTH, bucket_boundaries=boundaries)
    assert len(seen) <= len(boundaries)
    # The same pairs as without static shapes: padding rows only were added.
    assert real == sum(1 for _ in epoch_pairs(prepared, max_length=MAX_LENGTH,
                                              bucket_boundaries=boundaries))
