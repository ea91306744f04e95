"""pipelines.tokenizer: round trip, special ids, graph use, SavedModel, caching on disk."""

import errno
import json
import os

import pytest
import sentencepiece as spm
import tensorflow as tf

from pipelines import tokenizer as tokenizer_module
from pipelines.corpora import ParallelCorpus, corpus_fingerprint
from pipelines.storage import StorageError
from pipelines.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    SubwordTokenizer,
    TokenizerMismatchError,
    train_or_load_tokenizer,
    train_tokenizer,
)
from tests.pipelines.test_prepared import full_disk, pages

# Casing, double and trailing spaces, tabs, punctuation, and characters never seen in
# training (emoji, CJK, Greek, ligature, NBSP) that only byte fallback can reproduce.
TRICKY = [
    "Mä ka LO, ne-su: ta?!",
    "Two  spaces and a trailing one ",
    "tab\there\t",
    "😀 Ωmega 東京 ﬁ ½\u00a0x",
    "«Zitat» — ‚quote‘ (3/4) & 100%",
]


def strings(tensor) -> list[str]:
    return [value.decode("utf-8") for value in tensor.numpy()]


def test_round_trip_is_exact(small_tokenizer, small_corpus):
    texts = small_corpus.sources[:50] + small_corpus.targets[:50] + TRICKY
    ids = small_tokenizer.tokenize(tf.constant(texts))
    assert isinstance(ids, tf.RaggedTensor) and ids.dtype == tf.int32
    assert ids.shape[0] == len(texts)
    assert strings(small_tokenizer.detokenize(ids)) == texts
    assert UNK_ID not in ids.flat_values.numpy()  # byte fallback instead of <unk>


def test_special_ids_and_vocab(small_tokenizer):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert small_tokenizer.vocab_size == 400 and isinstance(small_tokenizer.vocab_size, int)
    pieces = strings(small_tokenizer.id_to_piece(tf.constant([PAD_ID, UNK_ID, BOS_ID, EOS_ID])))
    assert pieces == ["<pad>", "<unk>", "<s>", "</s>"]
    ids = small_tokenizer.tokenize(tf.constant(["Ka lo mi.", ""])).flat_values.numpy()
    assert not {PAD_ID, BOS_ID, EOS_ID} & set(ids.tolist())  # no specials added
    assert ids.min() > EOS_ID and ids.max() < small_tokenizer.vocab_size
    labels = small_tokenizer.id_to_piece(tf.constant([[4, 5], [6, 7]]))
    assert labels.shape == (2, 2) and labels.dtype == tf.string


def test_detokenize_cuts_at_eos_and_drops_pad_and_bos(small_tokenizer):
    ids = small_tokenizer.tokenize(tf.constant(["Ka lo.", "Mi ne su!"]))
    first, second = (row.tolist() for row in ids.numpy())
    dense = tf.constant(
        [
            [BOS_ID, *first, EOS_ID, *second, PAD_ID],  # the part after EOS is ignored
            [BOS_ID, *second, *[PAD_ID] * (len(first) + 2)],
        ],
        dtype=tf.int64,
    )
    assert strings(small_tokenizer.detokenize(dense)) == ["Ka lo.", "Mi ne su!"]
    ragged = tf.ragged.constant([[*first, EOS_ID, *second], [BOS_ID, *second]])
    assert strings(small_tokenizer.detokenize(ragged)) == ["Ka lo.", "Mi ne su!"]

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
    def in_graph(batch):
        return small_tokenizer.detokenize(batch)

    assert strings(in_graph(tf.cast(dense, tf.int32))) == ["Ka lo.", "Mi ne su!"]
    with pytest.raises(ValueError, match="rank 2"):
        small_tokenizer.detokenize(tf.constant([4, 5]))


def test_tokenize_inside_tf_data(small_tokenizer):
    dataset = tf.data.Dataset.from_tensor_slices(TRICKY).batch(2)
    dataset = dataset.map(small_tokenizer.tokenize, num_parallel_calls=tf.data.AUTOTUNE)
    rows = [row.tolist() for batch in dataset for row in batch.numpy()]
    assert rows == [row.tolist() for row in small_tokenizer.tokenize(tf.constant(TRICKY)).numpy()]


def test_survives_reseeding(small_tokenizer):
    # tf.random.set_seed clears the eager kernel cache, which owns the sentencepiece resource.
    expected = small_tokenizer.tokenize(tf.constant(TRICKY)).to_list()
    tf.random.set_seed(1234)
    assert small_tokenizer.tokenize(tf.constant(TRICKY)).to_list() == expected
    tf.random.set_seed(1234)
    dataset = tf.data.Dataset.from_tensor_slices(TRICKY).batch(8).map(small_tokenizer.tokenize)
    assert next(iter(dataset)).to_list() == expected
    tf.random.set_seed(1234)
    round_trip = tf.function(
        lambda texts: small_tokenizer.detokenize(small_tokenizer.tokenize(texts))
    )
    assert strings(round_trip(tf.constant(TRICKY))) == TRICKY


def test_survives_saved_model(small_tokenizer, tmp_path):
    class Exported(tf.Module):
        def __init__(self, tokenizer):
            super().__init__()
            self.tokenizer = tokenizer

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def round_trip(self, texts):
            ids = self.tokenizer.tokenize(texts)
            with_eos = tf.concat([ids, tf.ones([ids.nrows(), 1], tf.int32) * EOS_ID], axis=1)
            return {"ids": with_eos.to_tensor(), "texts": self.tokenizer.detokenize(with_eos)}

    texts = tf.constant(TRICKY)
    module = Exported(small_tokenizer)
    expected = module.round_trip(texts)
    tf.saved_model.save(module, str(tmp_path / "exported"), signatures=module.round_trip)
    del module
    loaded = tf.saved_model.load(str(tmp_path / "exported"))
    for got in (loaded.round_trip(texts), loaded.signatures["serving_default"](texts=texts)):
        assert got["ids"].numpy().tolist() == expected["ids"].numpy().tolist()
        assert strings(got["texts"]) == TRICKY


def test_save_and_load(small_tokenizer, tmp_path):
    directory = tmp_path / "tok"
    small_tokenizer.save(directory)
    assert sorted(os.listdir(directory)) == ["spm.model", "spm.vocab", "tokenizer.json"]
    assert os.listdir(tmp_path) == ["tok"]  # no temporary directories left behind
    config = json.loads((directory / "tokenizer.json").read_text())
    assert config["vocab_size"] == 400
    assert config["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert config["settings"]["normalization_rule_name"] == "identity"
    vocab = (directory / "spm.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 400 and vocab[3].startswith("</s>\t")
    loaded = SubwordTokenizer.load(directory)
    assert loaded.model_proto == small_tokenizer.model_proto
    assert loaded.settings == small_tokenizer.settings
    small_tokenizer.save(directory)  # replacing an existing tokenizer directory is fine
    assert SubwordTokenizer.load(directory).model_proto == small_tokenizer.model_proto


def test_save_refuses_a_foreign_directory_and_leaves_nothing_half_written(
    small_tokenizer, tmp_path, monkeypatch
):
    foreign = tmp_path / "model_dir"
    foreign.mkdir()
    (foreign / "weights.h5").write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="holds other files"):
        small_tokenizer.save(foreign)
    assert os.listdir(foreign) == ["weights.h5"]

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer_module.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        small_tokenizer.save(tmp_path / "tok")
    assert sorted(os.listdir(tmp_path)) == ["model_dir"]


def test_a_full_disk_keeps_the_tokenizer_that_was_there(small_tokenizer, tmp_path):
    small_tokenizer.save(tmp_path / "sizes")
    one = pages(*(tmp_path / "sizes").iterdir())
    disk = tmp_path / "disk"
    with full_disk(disk, one):  # room for one tokenizer, not for its replacement beside it
        small_tokenizer.save(disk / "tok")
        with pytest.raises(StorageError) as raised:
            small_tokenizer.save(disk / "tok")
        assert raised.value.errno == errno.ENOSPC and raised.value.path == disk / "tok"
        assert str(raised.value).startswith(f"no space left on the device writing {disk / 'tok'}")
        assert os.listdir(disk) == ["tok"]  # no temporary folder left
        assert SubwordTokenizer.load(disk / "tok").model_proto == small_tokenizer.model_proto


def test_rejects_models_with_other_special_ids(tmp_path, small_corpus):
    import io

    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(small_corpus.sources),
        model_writer=writer,
        vocab_size=100,
        minloglevel=2,
    )  # sentencepiece defaults: unk=0, bos=1, eos=2, no pad
    with pytest.raises(ValueError, match="special ids"):
        SubwordTokenizer(writer.getvalue())
    with pytest.raises(ValueError, match="not a serialized sentencepiece model"):
        SubwordTokenizer(b"garbage")


def test_training_is_deterministic(small_corpus, tmp_path):
    texts = small_corpus.sources + small_corpus.targets
    for model_type in ("bpe", "unigram"):
        a = train_tokenizer(
            texts, tmp_path / f"{model_type}_a", vocab_size=400, model_type=model_type
        )
        b = train_tokenizer(
            texts, tmp_path / f"{model_type}_b", vocab_size=400, model_type=model_type
        )
        assert a.model_proto == b.model_proto


def test_training_argument_errors(small_corpus, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a b"], tmp_path / "t", vocab_size=10)
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(["a b"], tmp_path / "t", model_type="word-piece")
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer([], tmp_path / "t")
    with pytest.raises(ValueError, match="Vocabulary size too high"):
        train_tokenizer(small_corpus.sources[:20], tmp_path / "t", vocab_size=5000)
    assert not (tmp_path / "t").exists()


def test_train_or_load_reuses_and_never_silently_retrains(small_corpus, tmp_path, monkeypatch):
    calls = []
    original = spm.SentencePieceTrainer.train

    def counting_train(*args, **kwargs):
        calls.append(kwargs.get("vocab_size"))
        return original(*args, **kwargs)

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", counting_train)
    directory = tmp_path / "tokenizer"
    first = train_or_load_tokenizer(small_corpus, directory, vocab_size=400)
    model_mtime = (directory / "spm.model").stat().st_mtime_ns
    config = json.loads((directory / "tokenizer.json").read_text())
    assert config["settings"]["corpus_fingerprint"] == corpus_fingerprint(small_corpus)

    second = train_or_load_tokenizer(small_corpus, directory, vocab_size=400)
    assert calls == [400]  # trained once
    assert (directory / "spm.model").stat().st_mtime_ns == model_mtime
    assert second.model_proto == first.model_proto

    with pytest.raises(TokenizerMismatchError, match="vocab_size: saved 400, wanted 500"):
        train_or_load_tokenizer(small_corpus, directory, vocab_size=500)
    other = ParallelCorpus(
        small_corpus.sources[:-1], small_corpus.targets[:-1], "de", "en", "train", "x"
    )
    with pytest.raises(TokenizerMismatchError, match="corpus_fingerprint"):
        train_or_load_tokenizer(other, directory, vocab_size=400)
    assert calls == [400]
    assert (directory / "spm.model").stat().st_mtime_ns == model_mtime
