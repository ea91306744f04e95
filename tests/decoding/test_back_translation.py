"""Back-translation (keras_transformer.decoding.back_translation): a resumable, byte-identical
synthetic corpus that `open_corpus` reads, with its provenance, cleanup and counts.

The reverse model is the tiny untrained run directory the translate tests share
(`make_run_dir`): meaningless translations, but real decoding. It never emits EOS, so
outputs are capped at a few tokens to keep the tests fast."""

from __future__ import annotations

import gzip
import hashlib
import json
import os

import pytest

from keras_transformer import run_directory
from keras_transformer.decoding import back_translation
from keras_transformer.decoding.back_translation import (
    BackTranslationError,
    back_translate,
    clean_monolingual_line,
)
from keras_transformer.decoding.synthetic_corpus import PROGRESS_FILE, PROVENANCE_FILE
from keras_transformer.decoding.translator import translate_batch
from pipelines import storage
from pipelines.corpora import open_corpus
from tests.serving.test_saved_model import (
    _ENGLISH,
    make_model,
    make_run_dir,
    make_sentences,
)

OUTPUT_TOKENS = 6  # the untrained model never stops: every output is this long


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The translate tests' tiny run directory (`shared_artifacts` without its export)."""
    return make_run_dir(tmp_path_factory.mktemp("reverse") / "run")


@pytest.fixture(scope="module")
def loaded(run):
    """(model, tokenizer) of the run, loaded once for the module."""
    return run_directory.load_run(run)


@pytest.fixture(scope="module")
def mono(tmp_path_factory):
    """(gzipped English file, its lines): 23 sentences and two empty lines (first and 12th)."""
    lines = make_sentences(23, _ENGLISH, seed=5)
    lines = ["", *lines[:10], "", *lines[10:]]
    path = tmp_path_factory.mktemp("mono") / "mono.en.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
    return path, lines


def _bt(loaded, mono_path, out, **options):
    model, tokenizer = loaded
    options = {"max_output_tokens": OUTPUT_TOKENS, "chunk_lines": 5, **options}
    return back_translate(model, mono_path, out, src_lang="de", tgt_lang="en",
                          tokenizer=tokenizer, **options)


def _one_line(text: str) -> str:
    """A translation as written: on one line (the untrained model emits line breaks)."""
    return " ".join(text.splitlines()).strip()


def test_writes_an_aligned_corpus_that_open_corpus_reads(loaded, mono, tmp_path):
    path, lines = mono
    out = tmp_path / "bt"
    record = _bt(loaded, path, out)
    texts = [line for line in lines if line]
    pairs = list(open_corpus(out, "train", "de", "en").pairs())
    expected = translate_batch(*loaded, texts, beam_size=1, max_output_tokens=OUTPUT_TOKENS)
    assert [target for _, target in pairs] == texts  # the genuine side, in order
    assert [source for source, _ in pairs] == [_one_line(r.text) for r in expected]
    assert len((out / "train.de").read_bytes().splitlines()) == len(texts)
    assert len((out / "train.en").read_bytes().splitlines()) == len(texts)
    on_disk = json.loads((out / PROVENANCE_FILE).read_text(encoding="utf-8"))
    assert on_disk == {key: value for key, value in record.items() if key != "session"}
    assert record["complete"] and record["session"]["action"] == "started"
    assert record["direction"]["reverse_model"] == "en→de"
    assert record["input"]["lines"] == len(lines)
    assert record["input"]["fingerprint"] == {
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size}
    assert record["model"]["fingerprint"]["tokenizer_sha256"] == hashlib.sha256(
        loaded[1].model_proto).hexdigest()
    assert record["decoding"]["beam_size"] == 1
    assert record["decoding"]["max_output_tokens"] == OUTPUT_TOKENS
    counts = record["counts"]
    assert counts["lines_read"] == 25 and counts["empty_lines"] == 2
    assert counts["pairs_written"] == counts["lines_translated"] == 23
    assert counts["output_tokens"] == sum(len(r.hypotheses[0].pieces) for r in expected)
    assert record["throughput"]["lines_per_second"] > 0
    assert record["code_version"]["package"]
    assert json.loads((out / PROGRESS_FILE).read_text())["lines_done"] == 25


class Killed(Exception):
    """Stands for a kill: raised by the progress callback."""


def test_an_interrupted_run_resumes_to_the_same_bytes(loaded, mono, tmp_path):
    path, _ = mono
    sampled = {"sampling_topk": 0, "seed": 3}  # per-line seeds must survive the resume
    reference = _bt(loaded, path, tmp_path / "reference", **sampled)
    calls = []

    def kill_after_the_second_chunk(done, total):
        calls.append(done)
        if len(calls) == 4:  # per chunk: one decoded batch, then the written chunk
            raise Killed

    out = tmp_path / "interrupted"
    with pytest.raises(Killed):
        _bt(loaded, path, out, progress=kill_after_the_second_chunk, **sampled)
    progress = json.loads((out / PROGRESS_FILE).read_text())
    assert progress["lines_done"] == 10
    assert not json.loads((out / PROVENANCE_FILE).read_text())["complete"]
    for name in ("train.de", "train.en"):  # a kill between the append and the record
        with open(out / name, "ab") as handle:
            handle.write(b"half a chunk\nof junk")
    resumed = _bt(loaded, path, out, chunk_lines=7, **sampled)  # other chunks: same lines
    for name in ("train.de", "train.en"):
        assert (out / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    assert resumed["session"]["action"] == "resumed" and resumed["session"]["from_line"] == 10
    assert len(resumed["sessions"]) == 2 and resumed["complete"]
    strip = {"decode_seconds"}
    assert ({k: v for k, v in resumed["counts"].items() if k not in strip}
            == {k: v for k, v in reference["counts"].items() if k not in strip})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = _bt(loaded, path, out, **sampled)
    assert again["session"]["action"] == "already complete"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing rewritten
    # A stop (or a full disk) between the last chunk's progress.json and provenance.json:
    # the next call finds nothing to translate and brings the provenance up to date.
    stale = json.loads((out / PROVENANCE_FILE).read_text())
    stale.update(complete=False, lines_done=20)
    storage.write_json(out / PROVENANCE_FILE, stale)
    healed = _bt(loaded, path, out, **sampled)
    assert healed["session"]["action"] == "already complete" and healed["complete"]
    on_disk = json.loads((out / PROVENANCE_FILE).read_text())
    assert on_disk["complete"] and on_disk["lines_done"] == 25
    assert on_disk["counts"] == resumed["counts"]
    # Nothing to translate in a new folder (--max-lines 0): said so, nothing to bring up.
    nothing = _bt(loaded, path, tmp_path / "nothing", max_lines=0, **sampled)
    assert nothing["session"]["action"].startswith("nothing to do")
    assert not nothing["complete"]


def test_sampling_is_reproducible_for_a_seed_whatever_the_chunks(loaded, mono, tmp_path):
    path, lines = mono

    def synthetic(name, **options):
        _bt(loaded, path, tmp_path / name, sampling_topk=0, **options)
        return (tmp_path / name / "train.de").read_text(encoding="utf-8").splitlines()

    first = synthetic("seed1", seed=1)
    assert synthetic("seed1-again", seed=1, chunk_lines=100, batch_size=3) == first
    assert synthetic("seed2", seed=2) != first
    # Each line's draws come from its number in the file (empty lines count).
    numbers = [number for number, line in enumerate(lines) if line]
    direct = translate_batch(*loaded, [lines[n] for n in numbers], beam_size=1, seed=1,
                             sampling_topk=0, max_output_tokens=OUTPUT_TOKENS,
                             line_indices=numbers)
    assert first == [_one_line(result.text) for result in direct]


def test_a_folder_made_otherwise_is_refused_with_what_differs(loaded, mono, run, tmp_path):
    path, lines = mono
    out = tmp_path / "bt"
    _bt(loaded, path, out, max_lines=5)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(BackTranslationError, match=r"beam_size: recorded 1, now 2.*new --out"):
        _bt(loaded, path, out, max_lines=5, beam_size=2)
    with pytest.raises(BackTranslationError, match="cleanup: recorded 'none', now 'filter'"):
        _bt(loaded, path, out, cleanup="filter")
    other = tmp_path / "other.en"
    other.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(BackTranslationError, match=r"input\.sha256"):
        _bt(loaded, other, out)
    with pytest.raises(BackTranslationError, match=r"model\.weights_sha256"):
        _bt((make_model(loaded[1].vocab_size, seed=1), loaded[1]), path, out, max_lines=5)
    # The run directory is the model loaded: the same fingerprint, and nothing left to do.
    again = back_translate(run, path, out, src_lang="de", tgt_lang="en", max_lines=5,
                           max_output_tokens=OUTPUT_TOKENS)
    assert again["session"]["action"].startswith("nothing to do")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    foreign = tmp_path / "corpus"
    foreign.mkdir()
    (foreign / "train.de").write_text("Ein Hund.\n", encoding="utf-8")
    with pytest.raises(BackTranslationError, match="not a back-translation folder"):
        _bt(loaded, path, foreign)
    with pytest.raises(ValueError, match="sampling draws one token"):
        _bt(loaded, path, tmp_path / "new", beam_size=4, sampling_topk=0)
    assert not (tmp_path / "new").exists()


def test_a_folder_another_process_is_writing_is_refused_and_left_alone(loaded, mono,
                                                                        tmp_path):
    path, _ = mono
    out = tmp_path / "bt"
    _bt(loaded, path, out, max_lines=5)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with storage.FolderLock(out):  # as a live back-translation of the same folder holds it
        with pytest.raises(BackTranslationError, match=(
                rf"{out} is in use by another process \(pid {os.getpid()} on .*another "
                r"back-translation is writing it.*run this command again to resume")):
            _bt(loaded, path, out)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == {
            name: data for name, data in before.items() if name != ".lock"}
    resumed = _bt(loaded, path, out)  # once it has ended, the same call goes on
    assert resumed["session"]["action"] == "resumed" and resumed["complete"]


def test_a_model_trained_the_other_way_is_refused(mono, tmp_path):
    wrong = tmp_path / "de-en"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({"identity": {"src": "de", "tgt": "en"}}))
    with pytest.raises(BackTranslationError, match="translates de→en.*needs a en→de model"):
        back_translate(wrong, mono[0], tmp_path / "bt", src_lang="de", tgt_lang="en")
    with pytest.raises(BackTranslationError, match="not a run directory"):
        back_translate(tmp_path / "missing", mono[0], tmp_path / "bt", src_lang="de",
                       tgt_lang="en")
    assert not (tmp_path / "bt").exists()


HAND_MADE = [
    "Ein Hund rennt.",
    "ein Hund rennt.",           # lower-case start
    "Ein Hund rennt",            # no final punctuation
    "ein hund rennt",            # both
    "",                          # empty: skipped whatever the cleanup
    '"Zwei Kinder spielen."',    # quotes around it: fine
    "2 Hunde spielen",           # a digit first is no lower-case start; no punctuation
    "„hallo“",                   # the first letter counts, a closing quote ends it
]


def test_cleanup_of_single_lines():
    assert [clean_monolingual_line(line, "normalize") for line in HAND_MADE] == [
        ("Ein Hund rennt.", []),
        ("Ein Hund rennt.", ["lowercase_start"]),
        ("Ein Hund rennt.", ["no_final_punctuation"]),
        ("Ein hund rennt.", ["lowercase_start", "no_final_punctuation"]),
        ("", []),
        ('"Zwei Kinder spielen."', []),
        ("2 Hunde spielen.", ["no_final_punctuation"]),
        ("„Hallo“", ["lowercase_start"]),
    ]
    assert [clean_monolingual_line(line, "filter")[0] for line in HAND_MADE] == [
        "Ein Hund rennt.", None, None, None, "", '"Zwei Kinder spielen."', None, None]
    # "none" keeps every line as it is, its problems counted all the same.
    assert [clean_monolingual_line(line, "none") for line in HAND_MADE] == [
        (line, problems) for line, (_, problems) in zip(
            HAND_MADE, [clean_monolingual_line(line, "normalize") for line in HAND_MADE],
            strict=True)]


@pytest.mark.parametrize("cleanup, written, dropped, changed", [
    ("none", 7, 0, 0), ("filter", 2, 5, 0), ("normalize", 7, 0, 5)])
def test_cleanup_counts_and_what_is_written(loaded, tmp_path, cleanup, written, dropped,
                                            changed):
    path = tmp_path / "mono.de"
    path.write_text("\n".join(HAND_MADE) + "\n", encoding="utf-8")
    model, tokenizer = loaded
    record = back_translate(model, path, tmp_path / "bt", src_lang="en", tgt_lang="de",
                            tokenizer=tokenizer, cleanup=cleanup, max_output_tokens=2)
    counts = record["counts"]
    assert counts["lines_read"] == 8 and counts["empty_lines"] == 1
    assert counts["pairs_written"] == written and counts["cleanup_dropped"] == dropped
    assert counts["cleanup_changed"] == changed
    assert (counts["lowercase_start"], counts["no_final_punctuation"]) == (3, 3)
    genuine = (tmp_path / "bt" / "train.de").read_text(encoding="utf-8").splitlines()
    expected = [clean_monolingual_line(line, cleanup)[0] for line in HAND_MADE if line]
    assert genuine == [line for line in expected if line is not None]
    assert len((tmp_path / "bt" / "train.en").read_bytes().splitlines()) == written


def test_empty_translations_are_dropped_and_counted(loaded, mono, tmp_path, monkeypatch):
    path, lines = mono

    def some_empty(*args, **kwargs):
        results = translate_batch(*args, **kwargs)
        for number, result in zip(kwargs["line_indices"], results, strict=True):
            if number % 3 == 0:
                result.hypotheses[0].text = " \n "
        return results

    monkeypatch.setattr(back_translation, "translate_batch", some_empty)
    record = _bt(loaded, path, tmp_path / "bt")
    kept = [line for number, line in enumerate(lines) if line and number % 3]
    assert record["counts"]["empty_translations"] == 23 - len(kept)
    assert record["counts"]["pairs_written"] == len(kept)
    pairs = list(open_corpus(tmp_path / "bt", "train", "de", "en").pairs())
    assert [target for _, target in pairs] == kept
    assert all(source for source, _ in pairs)
