"""`python -m keras_transformer.prepare` and `train --prepared`: prepare once, train from it
(as on another machine), refuse mismatched or damaged preparations, validate before creating;
the validation split's token ids prepared too (--val-split)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from keras_transformer.errors import EXIT_STORAGE
from keras_transformer.prepare import main as prepare_main
from keras_transformer.train import main as train_main
from pipelines.corpora import corpus_fingerprint, load_corpus
from tests.cli.test_train import REPO, TINY, cli_env, write_toy_corpus
from tests.pipelines.test_prepared import PAGE, full_disk

PREPARE = ["--src", "xx", "--tgt", "yy", "--vocab-size", "300", "--max-length", "32"]


def test_prepare_then_train_from_the_prepared_directory_elsewhere(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=200)
    prepared = tmp_path / "machine-a" / "prepared"
    assert prepare_main(["--data", str(data), *PREPARE, "--shard-pairs", "64",
                         "--out", str(prepared)]) == 0
    manifest = json.loads((prepared / "manifest.json").read_text())
    kept = manifest["pairs_kept"]
    assert 150 < kept <= 200 and manifest["pairs_total"] == 200  # some exceed --max-length 32
    printed = capsys.readouterr().out
    assert f"prepared {kept} of 200 pairs (4 shards" in printed
    assert sum(shard["pairs"] for shard in manifest["shards"]) == kept
    # The val split (train's default --val-split) too, every pair of it.
    validation = manifest["validation"]
    assert (validation["split"], validation["requested_split"], validation["pairs"]) == (
        "val", "val", 20)
    assert validation["corpus_fingerprint"] == corpus_fingerprint(
        load_corpus(data, "val", "xx", "yy"))
    assert f"validation: the 20 pairs of {data} [val]" in printed

    # "Another machine": the prepared directory copied elsewhere, the training text gone;
    # and without its validation split, as an earlier version prepared it: TensorFlow's
    # training validates on the val text, as before.
    copied = tmp_path / "machine-b" / "prepared"
    shutil.copytree(prepared, copied)
    for kind in ("ids", "lengths"):
        (copied / validation[kind]).unlink()
    del manifest["validation"]
    (copied / "manifest.json").write_text(json.dumps(manifest))
    (data / "train.xx").unlink()
    (data / "train.yy").unlink()
    out = tmp_path / "machine-b" / "run"
    argv = ["--data", str(data), *TINY, "--prepared", str(copied), "--max-steps", "4",
            "--checkpoint-every", "2", "--test-split", "none", "--no-export",
            "--out", str(out)]
    assert train_main(argv) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["prepared"]["corpus_fingerprint"] == manifest["corpus_fingerprint"]
    assert config["prepared"]["shards"] == 4
    assert not (out / "prepared").exists()  # nothing prepared again
    assert (out / "tokenizer" / "spm.model").read_bytes() == (
        copied / "tokenizer" / "spm.model").read_bytes()
    assert json.loads((out / "results.json").read_text())["steps"] == 4


def test_the_validation_split_to_prepare(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=40)

    def prepare(*flags: str) -> tuple[int, dict | None, str, str]:
        out = tmp_path / f"prepared-{len(list(tmp_path.iterdir()))}"
        status = prepare_main(["--data", str(data), *PREPARE, *flags, "--out", str(out)])
        printed = capsys.readouterr()
        manifest = json.loads((out / "manifest.json").read_text()) if status == 0 else None
        assert status != 0 or (manifest is not None and out.is_dir())
        return status, manifest and manifest.get("validation"), printed.out, printed.err

    status, validation, _, _ = prepare("--val-split", "test")
    assert status == 0 and (validation["split"], validation["pairs"]) == ("test", 20)
    status, validation, out, _ = prepare("--val-split", "none")
    assert status == 0 and validation is None and "\nvalidation: " not in out
    # A --val-split given must exist; the default may be absent (carved, or a note).
    status, _, _, err = prepare("--val-split", "nosuch")
    assert status == 2 and err.startswith("error: val data: ") and "no split 'nosuch'" in err
    assert len(err.splitlines()) == 1
    for kind in ("xx", "yy"):
        (data / f"val.{kind}").unlink()
    # A folder without one gets it carved out of train (pipelines.carving): 10% of 40 pairs.
    status, validation, out, _ = prepare()
    assert status == 0 and (validation["split"], validation["pairs"]) == ("val", 4)
    status, validation, out, _ = prepare("--carve-pairs", "0")
    assert status == 0 and validation is None
    assert "note: no validation split prepared" in out and "give --val-split" in out
    # An invalid val split is refused before anything is written.
    (data / "val.xx").write_text("ba\n\n")
    (data / "val.yy").write_text("ka\nko\n")
    status, _, _, err = prepare()
    assert status == 2 and "val data: " in err and "val.xx: line 2 is empty" in err
    assert not list(tmp_path.glob(".prepared*"))


def test_train_refuses_a_preparation_made_with_other_settings(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=60)
    prepared = tmp_path / "prepared"
    assert prepare_main(["--data", str(data), *PREPARE, "--out", str(prepared)]) == 0
    out = tmp_path / "run"
    argv = ["--data", str(data), *TINY, "--vocab-size", "320", "--prepared", str(prepared),
            "--out", str(out)]
    assert train_main(argv) == 2
    error = capsys.readouterr().err
    assert "vocab_size: prepared with 300, wanted 320" in error and len(error.splitlines()) == 1
    assert not out.exists()

    # A corpus file changed since the preparation is noticed without reading it.
    with open(data / "train.xx", "a") as handle:
        handle.write("ba ba\n")
    with open(data / "train.yy", "a") as handle:
        handle.write("ka ka\n")
    assert train_main(["--data", str(data), *TINY, "--prepared", str(prepared),
                       "--out", str(out)]) == 2
    assert "changed since" in capsys.readouterr().err and not out.exists()


def test_a_damaged_preparation_is_refused(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=60)
    prepared = tmp_path / "prepared"
    assert prepare_main(["--data", str(data), *PREPARE, "--out", str(prepared)]) == 0
    shard = sorted(prepared.glob("*.ids"))[0]
    original = shard.read_bytes()
    shard.write_bytes(original[:8] + bytes(8) + original[16:])  # changed at the same size
    out = tmp_path / "run"
    assert train_main(["--data", str(data), *TINY, "--prepared", str(prepared),
                       "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {shard}: checksum ") and "the manifest says" in error
    assert len(error.splitlines()) == 1 and not out.exists()
    shard.write_bytes(original[:-2])
    assert train_main(["--data", str(data), *TINY, "--prepared", str(prepared),
                       "--out", str(out)]) == 2
    assert "damaged" in capsys.readouterr().err and not out.exists()
    # A folder that holds no manifest (e.g. a user's own files) is not prepared into.
    (prepared / "manifest.json").unlink()
    assert train_main(["--data", str(data), *TINY, "--prepared", str(prepared),
                       "--out", str(out)]) == 2
    assert "holds no prepared corpus" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("line", [2, 57])
def test_a_bad_training_line_fails_before_anything_exists(tmp_path, capsys, line):
    data = write_toy_corpus(tmp_path / "corpus", pairs=60)
    lines = (data / "train.yy").read_text().splitlines()
    lines[line - 1] = "   "
    (data / "train.yy").write_text("\n".join(lines) + "\n")
    out, prepared = tmp_path / "run", tmp_path / "prepared"
    assert train_main(["--data", str(data), *TINY, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"train.yy: line {line} is empty" in error and len(error.splitlines()) == 1
    assert not out.exists()
    assert prepare_main(["--data", str(data), *PREPARE, "--out", str(prepared)]) == 2
    assert f"train.yy: line {line} is empty" in capsys.readouterr().err
    assert not prepared.exists() and list(tmp_path.glob(".prepared*")) == []


def test_prepare_refuses_an_existing_directory_and_bad_flags(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=30)
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert prepare_main(["--data", str(data), *PREPARE, "--out", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "keep me"
    assert prepare_main(["--data", str(data), "--src", "xx", "--tgt", "xx",
                         "--out", str(tmp_path / "p2")]) == 2
    assert "both 'xx'" in capsys.readouterr().err and not (tmp_path / "p2").exists()


def test_a_full_disk_is_one_line_and_exit_status_4(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=60)
    disk = tmp_path / "disk"
    with full_disk(disk, PAGE) as how:  # the tokenizer does not fit
        argv = ["--data", str(data), *PREPARE, "--out", str(disk / "prepared")]
        if how == "tmpfs":  # as a user runs it
            result = subprocess.run([sys.executable, "-m", "keras_transformer.prepare", *argv],
                                    cwd=REPO, env=cli_env(), capture_output=True, text=True,
                                    timeout=300)
            status, out, err = result.returncode, result.stdout, result.stderr
        else:  # Python's writes patched: in this process
            status = prepare_main(argv)
            out, err = capsys.readouterr()
        assert status == EXIT_STORAGE == 4, out + err
        assert err.startswith(f"error: no space left on the device writing {disk / 'prepared'} ")
        assert len(err.splitlines()) == 1 and "Traceback" not in out + err
        assert list(disk.iterdir()) == []
