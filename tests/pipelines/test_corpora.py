"""pipelines.corpora / textfiles / multi30k_tfds on small corpora written by the tests."""

import gzip
import logging
from pathlib import Path

import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from pipelines.corpora import (
    CorpusError,
    ParallelCorpus,
    available_splits,
    corpus_fingerprint,
    load_corpus,
    open_corpus,
)
from pipelines.multi30k_tfds import LANGUAGES

DE = ["Ein Hund läuft.", "Zwei  Männer!", "Straße, 3 Kinder", "Ein Café?"]
EN = ["A dog runs.", "Two  men!", "Street, 3 children", "A café?"]


def write(folder: Path, name: str, lines=None, *, data: bytes | None = None) -> Path:
    """Write `lines` (one per line, final newline) or raw `data`; gzip if the name ends in .gz."""
    folder.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = "".join(line + "\n" for line in lines).encode("utf-8")
    path = folder / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    """A Multi30k-like folder: gzipped train, plain val, a test_2016_flickr split, a README."""
    root = tmp_path / "corpus"
    write(root, "train.de.gz", DE)
    write(root, "train.en.gz", EN)
    write(root, "val.de", DE[:2])
    write(root, "val.en", EN[:2])
    write(root, "test_2016_flickr.de", DE[2:])
    write(root, "test_2016_flickr.en", EN[2:])
    write(root, "README.md", ["# not a corpus"])
    return root


def test_loads_gzipped_and_plain_files_verbatim(folder):
    train = load_corpus(folder, "train", "de", "en")  # a Path works as well as a str
    assert (train.sources, train.targets) == (DE, EN)
    assert (train.src_lang, train.tgt_lang, train.split, train.origin) == (
        "de",
        "en",
        "train",
        str(folder),
    )
    assert len(train) == 4
    val = load_corpus(str(folder), "val", "en", "de")
    assert (val.sources, val.targets) == (EN[:2], DE[:2])


def test_split_aliases_and_exact_names(folder):
    assert load_corpus(str(folder), "validation", "de", "en").split == "val"
    assert load_corpus(str(folder), "test", "de", "en").split == "test_2016_flickr"
    assert load_corpus(str(folder), "test_2016_flickr", "de", "en").sources == DE[2:]
    assert available_splits(str(folder)) == ["test_2016_flickr", "train", "val"]



def test_a_split_is_resolved_among_those_holding_both_languages(tmp_path):
    """validation.en alone (a target-side file) does not shadow dev.de/dev.en for "val"."""
    write(tmp_path, "validation.en", EN[:2])
    write(tmp_path, "dev.de", DE[:2])
    write(tmp_path, "dev.en", EN[:2])
    assert load_corpus(tmp_path, "val", "de", "en").split == "dev"
    assert load_corpus(tmp_path, "validation", "de", "en").split == "dev"  # an alias too
    write(tmp_path, "train.en", EN)
    with pytest.raises(CorpusError, match=r"train\.de.*missing"):  # none has both: named
        load_corpus(tmp_path, "train", "de", "en")


def test_as_dataset_yields_string_pairs(folder):
    corpus = load_corpus(str(folder), "train", "de", "en")
    dataset = corpus.as_dataset()
    assert dataset.element_spec == (tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.string))
    pairs = [(s.decode(), t.decode()) for s, t in dataset.as_numpy_iterator()]
    assert pairs == list(zip(DE, EN, strict=True))


def test_crlf_bom_and_surrounding_whitespace_are_removed(tmp_path):
    write(tmp_path, "train.de", data="\ufeffEins \r\n  Zwei\tdrei\r\n".encode())
    write(tmp_path, "train.en", ["one", "two\tthree"])
    corpus = load_corpus(str(tmp_path), "train", "de", "en")
    assert corpus.sources == ["Eins", "Zwei\tdrei"]


def test_lines_blank_on_both_sides_are_dropped_and_counted(tmp_path, caplog):
    write(tmp_path, "train.de", ["a", "", "b"])
    write(tmp_path, "train.en", ["x", "  ", "y"])
    with caplog.at_level(logging.WARNING, logger="pipelines"):
        corpus = load_corpus(str(tmp_path), "train", "de", "en")
    assert (corpus.sources, corpus.targets) == (["a", "b"], ["x", "y"])
    assert "dropped 1 line(s) blank on every side (first: line 2)" in caplog.text


# --- every bad input is one CorpusError naming the file (and line) ---------------------


def expect_error(match, *args):
    with pytest.raises(CorpusError, match=match) as info:
        load_corpus(*args)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_missing_folder(tmp_path):
    expect_error("corpus folder does not exist", str(tmp_path / "nope"), "train", "de", "en")


def test_missing_split_lists_available_ones(folder):
    message = expect_error(r"no split 'dev2'", str(folder), "dev2", "de", "en")
    assert "available splits: test_2016_flickr, train, val" in message


def test_missing_language_names_the_file(folder):
    message = expect_error(r"train\.fr\[\.gz\]: missing", str(folder), "train", "de", "fr")
    assert "languages de, en" in message


def test_same_language_twice(folder):
    expect_error("both 'de'", str(folder), "train", "de", "de")


def test_empty_file(tmp_path):
    write(tmp_path, "train.de", data=b"")
    write(tmp_path, "train.en", EN)
    expect_error(r"train\.de: file is empty", str(tmp_path), "train", "de", "en")


def test_invalid_utf8_reports_the_line(tmp_path):
    write(tmp_path, "train.de.gz", data=b"gut\nauch gut\nStra\xdfe\n")  # latin-1 sharp s
    write(tmp_path, "train.en.gz", ["good", "fine", "street"])
    message = expect_error(
        r"train\.de\.gz: line 3: invalid UTF-8", str(tmp_path), "train", "de", "en"
    )
    assert "0xdf" in message and "iconv" in message


def test_mismatched_line_counts_name_both_files(tmp_path):
    write(tmp_path, "train.de", DE)
    write(tmp_path, "train.en", EN[:3])
    message = expect_error("line counts differ", str(tmp_path), "train", "de", "en")
    assert "train.de has 4 lines" in message and "train.en has 3 lines" in message


@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_line_empty_on_one_side_reports_file_and_line(tmp_path, blank):
    write(tmp_path, "train.de", ["eins", "zwei", "drei"])
    write(tmp_path, "train.en", ["one", blank, "three"])
    message = expect_error(r"train\.en: line 2 is empty", str(tmp_path), "train", "de", "en")
    assert "train.de" in message and "delete" in message


def test_plain_and_gzipped_copies_are_ambiguous(tmp_path):
    write(tmp_path, "train.de", DE)
    write(tmp_path, "train.de.gz", DE)
    write(tmp_path, "train.en", EN)
    expect_error(r"both train\.de and train\.de\.gz", str(tmp_path), "train", "de", "en")


def test_corrupt_gzip(tmp_path):
    (tmp_path / "train.de.gz").write_bytes(gzip.compress(b"a\nb\n")[:-6])
    write(tmp_path, "train.en.gz", ["a", "b"])
    expect_error(r"train\.de\.gz: not a valid gzip file", str(tmp_path), "train", "de", "en")


def test_corpus_rejects_unequal_sides():
    with pytest.raises(CorpusError, match="2 sources but 1 targets"):
        ParallelCorpus(["a", "b"], ["x"], "de", "en", "train", "memory")


# --- fingerprint and filtering -----------------------------------------------------------


def test_fingerprint_depends_on_content_only(tmp_path, folder):
    write(tmp_path / "plain", "train.de", DE)
    write(tmp_path / "plain", "train.en", EN)
    gz = load_corpus(str(folder), "train", "de", "en")
    plain = load_corpus(str(tmp_path / "plain"), "train", "de", "en")
    assert corpus_fingerprint(gz) == corpus_fingerprint(plain)
    assert len(corpus_fingerprint(gz)) == 64
    changed = ParallelCorpus(DE[:-1] + ["Ein Cafe?"], EN, "de", "en", "train", "x")
    assert corpus_fingerprint(changed) != corpus_fingerprint(gz)
    # Moving text across the pair boundary must change the hash too.
    a = ParallelCorpus(["ab"], ["c"], "de", "en", "train", "x")
    b = ParallelCorpus(["a"], ["bc"], "de", "en", "train", "x")
    assert corpus_fingerprint(a) != corpus_fingerprint(b)
    swapped = ParallelCorpus(EN, DE, "en", "de", "train", "x")
    assert corpus_fingerprint(swapped) != corpus_fingerprint(gz)


def write_multi30k(root: Path, rows: int = 3) -> Path:
    for split in ("train", "val", "test_2016_flickr"):
        for lang in LANGUAGES:
            write(root, f"{split}.{lang}.gz", [f"{split} {lang} Satz {i} ü" for i in range(rows)])
    return root


def test_multi30k_builder_reads_a_manual_folder(tmp_path):
    manual = write_multi30k(tmp_path / "manual")
    data_dir = str(tmp_path / "tfds")
    val = load_corpus("tfds:multi30k", "val", "de", "en", data_dir=data_dir, manual_dir=str(manual))
    assert val.split == "validation" and val.origin == "tfds:multi30k"
    assert val.sources == [f"val de Satz {i} ü" for i in range(3)]
    assert val.targets == [f"val en Satz {i} ü" for i in range(3)]
    # Prepared once: later loads need no manual folder, and every language pair is there.
    test = load_corpus("tfds:multi30k", "test", "fr", "cs", data_dir=data_dir)
    assert test.sources == [f"test_2016_flickr fr Satz {i} ü" for i in range(3)]
    assert available_splits("tfds:multi30k", data_dir=data_dir) == ["test", "train", "validation"]
    builder = tfds.builder("multi30k", data_dir=data_dir)
    assert builder.info.splits["train"].num_examples == 3


def test_multi30k_builder_validates_the_release_files(tmp_path):
    manual = write_multi30k(tmp_path / "manual")
    write(manual, "train.en.gz", ["only", "two"])
    with pytest.raises(CorpusError, match=r"train\.en\.gz has 2 lines"):
        load_corpus(
            "tfds:multi30k",
            "train",
            "de",
            "en",
            data_dir=str(tmp_path / "a"),
            manual_dir=str(manual),
        )
    (manual / "val.cs.gz").unlink()
    with pytest.raises(CorpusError, match=r"lacks val\.cs\[\.gz\]"):
        load_corpus(
            "tfds:multi30k",
            "train",
            "de",
            "en",
            data_dir=str(tmp_path / "b"),
            manual_dir=str(manual),
        )


def test_tfds_unknown_dataset_language_and_split(tmp_path):
    with pytest.raises(CorpusError, match="not a tensorflow-datasets dataset"):
        load_corpus("tfds:no_such_dataset_xyz", "train", "de", "en")
    with pytest.raises(CorpusError, match="no language 'xx'"):
        load_corpus("tfds:multi30k", "train", "de", "xx", data_dir=str(tmp_path))
    with pytest.raises(CorpusError, match="manual_dir does not exist"):
        load_corpus(
            "tfds:multi30k",
            "train",
            "de",
            "en",
            data_dir=str(tmp_path),
            manual_dir=str(tmp_path / "typo"),
        )
    manual = write_multi30k(tmp_path / "manual", rows=1)
    with pytest.raises(CorpusError, match="no split 'dev2'.*test, train, validation"):
        load_corpus(
            "tfds:multi30k", "dev2", "de", "en", data_dir=str(tmp_path), manual_dir=str(manual)
        )


def fake_ted(examples):
    """A stand-in for `builder._as_dataset` yielding the given {"pt": ..., "en": ...} dicts."""

    def as_dataset(self, split, **kwargs):
        del self, kwargs
        return tf.data.Dataset.from_tensor_slices(
            {lang: tf.constant([e[lang] for e in examples[split]]) for lang in ("pt", "en")}
        )

    return as_dataset


def test_generic_tfds_translation_dataset(tmp_path):
    examples = {
        "train": [
            {"pt": "olá mundo", "en": "hello world"},
            {"pt": " bom dia ", "en": "good morning"},
        ],
        "validation": [{"pt": "tchau", "en": "bye"}],
    }
    with tfds.testing.mock_data(as_dataset_fn=fake_ted(examples)):
        train = load_corpus(
            "tfds:ted_hrlr_translate/pt_to_en", "train", "pt", "en", data_dir=str(tmp_path)
        )
        val = load_corpus(
            "tfds:ted_hrlr_translate/pt_to_en", "val", "en", "pt", data_dir=str(tmp_path)
        )
    assert train.sources == ["olá mundo", "bom dia"] and train.targets == [
        "hello world",
        "good morning",
    ]
    assert (val.split, val.sources, val.targets) == ("validation", ["bye"], ["tchau"])


def test_generic_tfds_empty_side_and_bad_utf8_name_the_example(tmp_path):
    name = "tfds:ted_hrlr_translate/pt_to_en"
    empty = {"train": [{"pt": "a", "en": "b"}, {"pt": "c", "en": " "}]}
    with tfds.testing.mock_data(as_dataset_fn=fake_ted(empty)):
        with pytest.raises(CorpusError, match=r"'en': example 2 is empty"):
            load_corpus(name, "train", "pt", "en", data_dir=str(tmp_path))
    invalid = {"train": [{"pt": b"ol\xe1", "en": b"hi"}]}
    with tfds.testing.mock_data(as_dataset_fn=fake_ted(invalid)):
        with pytest.raises(CorpusError, match=r"'pt': example 1: invalid UTF-8"):
            load_corpus(name, "train", "pt", "en", data_dir=str(tmp_path))


def test_several_source_languages_make_one_many_to_one_split(tmp_path):
    root = write_multi30k(tmp_path / "multi30k")
    split = open_corpus(root, "train", "de,fr,cs", "en")
    assert (split.src_lang, [part.src_lang for part in split.parts]) == (
        "de,fr,cs", ["de", "fr", "cs"])
    # Each language's pairs with the same targets, one language after the other.
    assert list(split.pairs()) == [(f"train {lang} Satz {i} ü", f"train en Satz {i} ü")
                                   for lang in ("de", "fr", "cs") for i in range(3)]
    files = [Path(file["path"]).name for file in split.identity()["files"]]
    assert files == ["train.de.gz", "train.en.gz", "train.fr.gz", "train.en.gz",
                     "train.cs.gz", "train.en.gz"]
    val = load_corpus(root, "val", "fr,de", "en")
    assert (len(val), val.src_lang, val.sources[0], val.sources[3]) == (
        6, "fr,de", "val fr Satz 0 ü", "val de Satz 0 ü")
    with pytest.raises(CorpusError, match="both 'en'"):
        open_corpus(root, "train", "de,en", "en")
    with pytest.raises(CorpusError, match="each one once"):
        open_corpus(root, "train", "de,de", "en")
    with pytest.raises(CorpusError, match=r"train\.xx"):
        open_corpus(root, "train", "de,xx", "en")
