"""The back_translate command (keras_transformer.back_translate): real monolingual captions
(Multi30k task 2, `mono.en.gz`) through a reverse model into a corpus folder `train` reads."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from keras_transformer.back_translate import main
from pipelines.corpora import open_corpus
from tests.serving.test_saved_model import make_run_dir

LINES = 30
FAST = ["--max-output-tokens", "6"]  # the untrained reverse model never stops by itself


@pytest.fixture(scope="session")
def mono_en() -> Path:
    """Multi30k task 2's English captions (never copied into the repo); MULTI30K_TASK2_DIR
    overrides the folder."""
    default = Path(__file__).resolve().parents[2].parent / "shared/data/multi30k-task2"
    path = Path(os.environ.get("MULTI30K_TASK2_DIR", default)) / "mono.en.gz"
    if not path.is_file():
        pytest.fail(f"{path} not found: set MULTI30K_TASK2_DIR to the folder of mono.en.gz")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The translate tests' tiny untrained run directory, as an en→de reverse model."""
    return make_run_dir(tmp_path_factory.mktemp("reverse") / "run")


def _flags(run, mono, out, *extra):
    return ["--model", str(run), "--input", str(mono), "--out", str(out), "--src", "de",
            "--tgt", "en", *FAST, *extra]


def test_the_command_end_to_end_on_real_captions(run, mono_en, tmp_path, capfd):
    out = tmp_path / "bt"
    assert main(_flags(run, mono_en, out, "--max-lines", "20", "--chunk-lines", "8")) == 0
    err = capfd.readouterr().err
    assert "20/20 sentences" in err  # the progress bar
    assert "started: translated 20 lines" in err and "not complete (--max-lines" in err
    # The same folder, 10 lines more.
    assert main(_flags(run, mono_en, out, "--max-lines", str(LINES))) == 0
    err = capfd.readouterr().err
    assert "resumed from line 20: translated 10 lines" in err
    with gzip.open(mono_en, "rt", encoding="utf-8") as handle:
        captions = [next(handle).strip() for _ in range(LINES)]
    pairs = list(open_corpus(out, "train", "de", "en").pairs())
    assert [target for _, target in pairs] == captions
    assert all(source for source, _ in pairs)
    provenance = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
    assert provenance["lines_done"] == LINES and not provenance["complete"]
    assert provenance["input"]["lines"] == 115_548
    assert provenance["model"]["path"] == str(run.resolve())
    assert [s["action"] for s in provenance["sessions"]] == ["started", "resumed"]
    # Again: nothing to do; other options: refused in one line, status 2, nothing changed.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(_flags(run, mono_en, out, "--max-lines", str(LINES))) == 0
    assert "nothing to do" in capfd.readouterr().err
    assert main(_flags(run, mono_en, out, "--max-lines", str(LINES), "--beam", "4")) == 2
    err = capfd.readouterr().err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "beam_size: recorded 1, now 4" in error_lines[0]
    assert "new --out" in error_lines[0] and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_cleanup_and_sampling_flags_reach_the_library(run, tmp_path, capfd):
    mono = tmp_path / "mono.de"
    mono.write_text("ein hund rennt\nEin Hund rennt.\n\nZwei Kinder spielen\n",
                    encoding="utf-8")
    out = tmp_path / "bt"
    assert main(["--model", str(run), "--input", str(mono), "--out", str(out), "--src", "en",
                 "--tgt", "de", *FAST, "--cleanup", "normalize", "--sampling-topk", "0",
                 "--sampling-temperature", "0.7", "--seed", "9"]) == 0
    err = capfd.readouterr().err
    assert "1 empty lines skipped" in err and "2 changed by --cleanup normalize" in err
    assert (out / "train.de").read_text(encoding="utf-8").splitlines() == [
        "Ein hund rennt.", "Ein Hund rennt.", "Zwei Kinder spielen."]
    decoding = json.loads((out / "provenance.json").read_text())["decoding"]
    assert (decoding["sampling_topk"], decoding["sampling_temperature"], decoding["seed"]) == (
        0, 0.7, 9)


@pytest.mark.parametrize("flags, message", [
    (["--src", "en"], "--src and --tgt are both"),
    (["--sampling-topp", "0.9"], "need --sampling-topk"),
    (["--beam", "2", "--sampling-topk", "0"], "--beam 1"),
    (["--cleanup", "lower"], "invalid choice"),
    (["--max-lines", "-1"], "--max-lines must be >= 0"),
])
def test_bad_flags_exit_2(tmp_path, capfd, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), "--input", "x", "--out", str(tmp_path / "bt"),
              "--src", "de", "--tgt", "en", *flags])
    assert exit_info.value.code == 2
    assert message in capfd.readouterr().err


def test_a_bad_model_or_input_is_one_error_line(run, mono_en, tmp_path, capfd):
    wrong = tmp_path / "de-en"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({"identity": {"src": "de", "tgt": "en"}}))
    cases = [(wrong, mono_en, "translates de→en"),
             (tmp_path / "missing", mono_en, "not a run directory"),
             (run, tmp_path / "missing.en", "no such file")]
    for model, mono, message in cases:
        assert main(_flags(model, mono, tmp_path / "bt")) == 2
        err = capfd.readouterr().err
        assert [line for line in err.splitlines() if "error:" in line] == [
            line for line in err.splitlines() if message in line]
        assert "Traceback" not in err
    assert not (tmp_path / "bt").exists()
