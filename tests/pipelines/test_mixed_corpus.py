"""Real and synthetic pairs in one training split (`pipelines.corpora.mixed_corpus`), and how a
run opens it (`keras_transformer.training.run_data.open_training_split`)."""

from __future__ import annotations

import json

import pytest
import tensorflow as tf

from keras_transformer.errors import UsageError
from keras_transformer.training.config import data_config
from keras_transformer.training.run_data import open_training_split
from pipelines.corpora import CorpusError, corpus_fingerprint, mixed_corpus, open_corpus
from pipelines.prepared import PreparedError, prepare_corpus


def _folder(path, pairs, src="de", tgt="en"):
    path.mkdir(parents=True, exist_ok=True)
    (path / f"train.{src}").write_text("".join(f"{s}\n" for s, _ in pairs), encoding="utf-8")
    (path / f"train.{tgt}").write_text("".join(f"{t}\n" for _, t in pairs), encoding="utf-8")
    return path


REAL = [("Ein Hund läuft.", "A dog runs."), ("Zwei Katzen.", "Two cats.")]
SYNTHETIC = [("Ein Mann singt.", "A man sings.")]


def test_real_pairs_repeat_and_synthetic_sources_are_tagged(tmp_path):
    real = open_corpus(_folder(tmp_path / "real", REAL), "train", "de", "en")
    synthetic = open_corpus(_folder(tmp_path / "bt", SYNTHETIC), "train", "de", "en")
    added = open_corpus(_folder(tmp_path / "old", [("Alt.", "Old.")]), "train", "de", "en")
    mixed = mixed_corpus(real, added=[added], synthetic=[synthetic], upsample_real=3,
                         synthetic_tag="<BT>")
    assert list(mixed.pairs()) == REAL * 3 + [("Alt.", "Old."),
                                              ("<BT> Ein Mann singt.", "A man sings.")]
    assert mixed.source_tags() == ["<BT>"]
    identity = mixed.identity()
    assert [part.get("repeat", 1) for part in identity["parts"]] == [3, 1, 1]
    assert [part.get("source_tag") for part in identity["parts"]] == [None, None, "<BT>"]
    # Another ratio or tag is another corpus (prepared data made from one are not reused).
    other = mixed_corpus(real, added=[added], synthetic=[synthetic], upsample_real=2,
                         synthetic_tag="<BT>")
    assert corpus_fingerprint(other) != corpus_fingerprint(mixed)
    # Nothing to mix: the real split itself, its identity as before.
    assert mixed_corpus(real) is real and "repeat" not in real.identity()


def test_bad_mixes_are_refused(tmp_path):
    real = open_corpus(_folder(tmp_path / "real", REAL), "train", "de", "en")
    french = open_corpus(_folder(tmp_path / "fr", SYNTHETIC, src="fr"), "train", "fr", "en")
    with pytest.raises(CorpusError, match="same languages"):
        mixed_corpus(real, synthetic=[french])
    with pytest.raises(CorpusError, match="one token"):
        mixed_corpus(real, synthetic=[real], synthetic_tag="<B T>")
    with pytest.raises(CorpusError, match=">= 1"):
        mixed_corpus(real, upsample_real=0)


def test_the_tag_is_one_piece_of_the_prepared_vocabulary(tmp_path, multi30k_dir):
    real = open_corpus(multi30k_dir, "val", "de", "en")
    synthetic = open_corpus(_folder(tmp_path / "bt", SYNTHETIC * 20), "train", "de", "en")
    prepared = prepare_corpus(mixed_corpus(real, synthetic=[synthetic], synthetic_tag="<BT>"),
                              tmp_path / "prepared", vocab_size=1000, max_length=64)
    tokenizer = prepared.tokenizer()
    pieces = tokenizer.id_to_piece(tokenizer.tokenize(tf.constant(["<BT> Ein Mann"]))
                                   .flat_values).numpy().tolist()
    assert b"<BT>" in pieces and b"<" not in pieces
    assert prepared.manifest["pairs_total"] == len(real.load()) + 20
    # Fine-tuning keeps a tokenizer: one that holds the tag is used as it is ...
    mixed = mixed_corpus(real, synthetic=[synthetic], synthetic_tag="<BT>")
    again = prepare_corpus(mixed, tmp_path / "again", vocab_size=1000, max_length=64,
                           tokenizer=tokenizer)
    assert again.manifest["pairs_total"] == prepared.manifest["pairs_total"]
    # ... one that would split it is refused before anything is written.
    with pytest.raises(PreparedError, match="'<BT2>' is not one piece"):
        prepare_corpus(mixed_corpus(real, synthetic=[synthetic], synthetic_tag="<BT2>"),
                       tmp_path / "refused", vocab_size=1000, max_length=64,
                       tokenizer=tokenizer)
    assert not (tmp_path / "refused").exists()


def test_a_run_opens_its_mix_from_flags_and_refuses_an_unfinished_back_translation(tmp_path):
    real = _folder(tmp_path / "real", REAL)
    bt = _folder(tmp_path / "bt", SYNTHETIC)
    data = data_config(data=str(real), src="de", tgt="en", synthetic=str(bt), upsample_real=2)
    assert len(list(open_training_split(data).pairs())) == 5
    (bt / "provenance.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(UsageError, match="has not finished"):
        open_training_split(data)
    (bt / "provenance.json").write_text(json.dumps(
        {"complete": False, "lines_done": 1, "input": {"lines": 9},
         "sessions": [{"max_lines": 1}]}))
    with pytest.raises(UsageError, match="1 of 9 lines.*again without --max-lines"):
        open_training_split(data)
    (bt / "provenance.json").write_text("{")
    with pytest.raises(UsageError, match="cannot be read"):
        open_training_split(data)
    (bt / "provenance.json").write_text(json.dumps({"complete": True}))
    untagged = data_config(data=str(real), src="de", tgt="en", synthetic=str(bt),
                           synthetic_tag="")
    assert list(open_training_split(untagged).pairs())[-1] == SYNTHETIC[0]
    # A folder made for the other direction: its genuine side would become the sources.
    (bt / "provenance.json").write_text(json.dumps(
        {"complete": True, "src_lang": "en", "tgt_lang": "de"}))
    with pytest.raises(UsageError, match="back-translated for a en→de model.*--src de --tgt en"):
        open_training_split(data)
    (bt / "provenance.json").write_text(json.dumps(
        {"complete": True, "src_lang": "de", "tgt_lang": "en"}))
    assert len(list(open_training_split(data).pairs())) == 5


def test_tokenizer_data_trains_the_vocabulary_not_the_model(tmp_path, multi30k_dir):
    captions = open_corpus(multi30k_dir, "val", "de", "en")
    news = open_corpus(multi30k_dir.parent / "newstest-deen", "val", "de", "en")
    alone = prepare_corpus(captions, tmp_path / "alone", vocab_size=2000, max_length=64)
    both = prepare_corpus(captions, tmp_path / "both", vocab_size=2000, max_length=64,
                          tokenizer_data=[news])
    # The same training pairs; a vocabulary that has news words as whole pieces.
    assert both.manifest["pairs_total"] == alone.manifest["pairs_total"] == len(captions.load())
    assert both.settings["tokenizer_data"] == [news.origin]
    assert "tokenizer_data" not in alone.settings

    def pieces(prepared, text):
        tokenizer = prepared.tokenizer()
        return tokenizer.id_to_piece(tokenizer.tokenize(tf.constant([text])).flat_values
                                     ).numpy().tolist()

    assert len(pieces(both, "die Regierung")) < len(pieces(alone, "die Regierung"))

    # A given tokenizer is not trained: text for training one is refused, nothing written.
    with pytest.raises(ValueError, match="give one or the other"):
        prepare_corpus(captions, tmp_path / "refused", vocab_size=2000, max_length=64,
                       tokenizer=alone.tokenizer(), tokenizer_data=[news])
    assert not (tmp_path / "refused").exists()
