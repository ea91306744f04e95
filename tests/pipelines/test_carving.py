"""pipelines.carving / pair_selection: val and test carved out of a train-only corpus (seeded,
deduplicated against train) and the training noise dropped, each counted."""

import gzip
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from keras_transformer.training.config import DataConfig
from keras_transformer.training.run_data import carve_missing_splits, open_training_split
from pipelines.carving import carve_corpus, carve_size
from pipelines.corpora import CorpusError, corpus_fingerprint, open_corpus
from pipelines.pair_selection import TrainSelection, noise_reason, pair_hash

NEWS = Path(__file__).resolve().parents[2].parent / "shared/data/newstest-deen"


def write_train(folder: Path, sources, targets, extra_splits=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", *extra_splits):
        (folder / f"{split}.de").write_text("".join(line + "\n" for line in sources))
        (folder / f"{split}.en").write_text("".join(line + "\n" for line in targets))
    return folder


def numbered(count: int) -> tuple[list[str], list[str]]:
    return ([f"Satz Nummer {i} ist hier." for i in range(count)],
            [f"Sentence number {i} is here." for i in range(count)])


def test_carve_size_follows_the_corpus():
    assert carve_size(4_500_000) == 1000
    assert carve_size(10_000) == 500  # 5%
    assert carve_size(1_000) == 100  # at least 100 ...
    assert carve_size(300) == 30  # ... but never more than 10%
    assert carve_size(50_000, 200) == 200


def test_carving_is_seeded_sized_and_disjoint(tmp_path):
    sources, targets = numbered(3000)
    split = open_corpus(write_train(tmp_path / "c", sources, targets), "train", "de", "en")
    carving = carve_corpus(split, ("val", "test"), seed=0)
    val, test = carving.held_out["val"], carving.held_out["test"]
    assert len(val) == len(test) == 150  # 5% of 3,000
    train = list(carving.train.pairs())
    assert len(train) == 2700 == carving.report["train"]
    held = set(zip(val.sources, val.targets, strict=True)) | set(zip(test.sources, test.targets, strict=True))
    assert len(held) == 300 and not held & set(train)
    # Corpus order kept; the same seed, the same splits; another seed, others.
    assert val.sources == sorted(val.sources, key=sources.index)
    again = carve_corpus(split, ("val", "test"), seed=0)
    assert again.held_out["val"].sources == val.sources
    assert again.train.identity() == carving.train.identity()
    other = carve_corpus(split, ("val", "test"), seed=1)
    assert other.held_out["val"].sources != val.sources
    assert other.train.identity() != carving.train.identity()
    assert corpus_fingerprint(again.train) == corpus_fingerprint(carving.train)


def test_every_copy_of_a_carved_pair_leaves_train(tmp_path):
    sources, targets = numbered(2000)
    # Each of the first 300 pairs three times over: wherever they land, all copies together.
    sources, targets = sources + sources[:300] * 2, targets + targets[:300] * 2
    split = open_corpus(write_train(tmp_path / "c", sources, targets), "train", "de", "en")
    carving = carve_corpus(split, ("val", "test"), seed=3)
    report = carving.report
    val, test = carving.held_out["val"], carving.held_out["test"]
    assert len(set(val.sources)) == len(val) and len(set(test.sources)) == len(test)
    train = Counter(carving.train.pairs())
    for corpus in (val, test):
        for pair in zip(corpus.sources, corpus.targets, strict=True):
            assert pair not in train
    tripled = set(sources[:300])
    copies = sum(2 for corpus in (val, test) for s in corpus.sources if s in tripled)
    assert report["val_copies_dropped"] + report["test_copies_dropped"] == copies > 0
    assert sum(train.values()) == report["train"] == 2600 - len(val) - len(test) - copies


def test_noise_is_counted_by_reason(tmp_path):
    long = "Dies ist ein ziemlich langer deutscher Satz über nichts."
    pairs = [("Ein Hund.", "A dog."), ("Ja.", "Yes, indeed."),  # short: kept
             (long, "No."),  # ratio
             ("Kurz.", "A sentence that is far far longer than the source."),  # ratio
             ("Ein Hund.", "A dog."), ("Ein Hund.", "A dog."),  # duplicates
             ("Eine Katze.", "A cat.")]
    assert noise_reason(long, "No.") == "length_ratio" and noise_reason("x", " ") == "empty"
    dropped = Counter()
    kept = list(TrainSelection(seed=0, clean=True).pairs(pairs, dropped))
    assert kept == [pairs[0], pairs[1], pairs[6]]
    assert dropped == {"length_ratio": 2, "duplicate": 2}
    split = open_corpus(write_train(tmp_path / "c", *zip(*pairs, strict=True), extra_splits=("val",)),
                        "train", "de", "en")
    report = carve_corpus(split, (), clean=True).report
    assert report["clean"] == {"kept": 3, "empty": 0, "length_ratio": 2, "duplicate": 2}
    assert report["pairs"] == 7 and "val" not in report
    # A pair empty on one side: the reader refuses the corpus, naming the line; cleaning
    # drops and counts it (carving never holds it out).
    one_sided = write_train(tmp_path / "one_sided", *zip(*[*pairs, ("Ein Baum.", "  ")],
                                                          strict=True), extra_splits=("val",))
    with pytest.raises(CorpusError, match="line 8 is empty"):
        list(open_corpus(one_sided, "train", "de", "en").pairs())
    carving = carve_corpus(open_corpus(one_sided, "train", "de", "en"), (), clean=True)
    assert carving.report["clean"] == {"kept": 3, "empty": 1, "length_ratio": 2,
                                       "duplicate": 2}
    assert list(carving.train.pairs()) == kept


def test_too_small_a_corpus_is_refused(tmp_path):
    split = open_corpus(write_train(tmp_path / "c", *numbered(5)), "train", "de", "en")
    with pytest.raises(CorpusError, match="too few to carve val and test"):
        carve_corpus(split, ("val", "test"))


def test_a_corpus_with_its_splits_is_unchanged(tmp_path):
    sources, targets = numbered(200)
    folder = write_train(tmp_path / "c", sources, targets, extra_splits=("val", "test"))
    data = DataConfig(data=str(folder), src="de", tgt="en")
    assert carve_missing_splits(data, seed=0) is None
    plain = open_corpus(folder, "train", "de", "en")
    identity = open_training_split(data).identity()
    assert identity == plain.identity() and "selection" not in identity
    assert corpus_fingerprint(open_training_split(data)) == corpus_fingerprint(plain)
    # Only a test split missing: only it is carved; with --carve-pairs 0 nothing is.
    (folder / "test.de").unlink()
    carving = carve_missing_splits(data, seed=0)
    assert list(carving.held_out) == ["test"] and len(carving.held_out["test"]) == 20
    assert carve_missing_splits(DataConfig(data=str(folder), src="de", tgt="en",
                                           carve_pairs=0), seed=0) is None


def test_the_news_train_file_alone(tmp_path):
    """The real check: newstest-deen's train files alone, default sizes, cleaned."""
    if not (NEWS / "train.de.gz").is_file():
        pytest.skip(f"no {NEWS}")
    folder = tmp_path / "news"
    folder.mkdir()
    for lang in ("de", "en"):
        shutil.copy(NEWS / f"train.{lang}.gz", folder)
    started = time.perf_counter()
    carving = carve_missing_splits(DataConfig(data=str(folder), src="de", tgt="en",
                                              clean_train=True), seed=0)
    seconds = time.perf_counter() - started
    report = carving.report
    print(f"\nnewstest-deen train alone ({seconds:.1f} s): {report}")
    with gzip.open(NEWS / "train.de.gz", "rt") as file:
        lines = sum(1 for _ in file)
    assert report["pairs"] == lines and report["val"] == report["test"] == 1000
    clean = report["clean"]
    assert clean["kept"] + sum(clean[key] for key in ("empty", "length_ratio", "duplicate")) \
        + 2000 + report["val_copies_dropped"] + report["test_copies_dropped"] == lines
    assert sum(1 for _ in carving.train.pairs()) == clean["kept"]
    # Hash bands: the whole corpus's pairs fall into val/test/train as the bands say.
    selection = carving.train.selection
    assert all(selection.role(pair_hash(0, s, t)) == "val"
               for s, t in zip(carving.held_out["val"].sources,
                               carving.held_out["val"].targets, strict=True))


def test_multi30k_is_not_carved(multi30k_dir):
    """The quickstart's corpus has its splits: the same data, identity and fingerprint."""
    for src, tgt in (("de", "en"), ("en", "de")):
        assert carve_missing_splits(DataConfig(data=str(multi30k_dir), src=src, tgt=tgt),
                                    seed=0) is None
