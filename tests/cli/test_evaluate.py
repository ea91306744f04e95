"""Scoring and the evaluate command (keras_transformer.evaluate)."""

from __future__ import annotations

import json
import shutil

import pytest
import sacrebleu

from keras_transformer import run_directory
from keras_transformer.decoding.scoring import score_translations as score
from keras_transformer.decoding.search import beam_search, encode_texts
from keras_transformer.decoding.translator import translate_texts
from keras_transformer.errors import EXIT_STORAGE
from keras_transformer.evaluate import main
from keras_transformer.serving.saved_model import METADATA_FILE
from tests.serving.test_saved_model import shared_artifacts
from tests.storage_faults import fill, no_space_at_sync, small_filesystem

SOURCES = ["Ein Hund läuft im Park.", "Zwei Kinder spielen.", "Eine Frau.",
           "Ein Mann sitzt auf einem roten Fahrrad.", "Hund."]
REFERENCES = ["A dog runs in the park.", "Two children play.", "A woman.",
              "A man sits on a red bicycle.", "Dog."]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return shared_artifacts(tmp_path_factory)[0]


@pytest.fixture(scope="module")
def loaded_run(run_dir):
    return run_directory.load_run(run_dir)


def test_score_matches_sacrebleu_and_reports_signatures():
    hypotheses = ["A dog runs in a park.", "Two kids play.", "A woman.", "A man on a bike.",
                  "Dog."]
    result = score(hypotheses, REFERENCES)
    expected = sacrebleu.corpus_bleu(hypotheses, [REFERENCES]).score
    assert result["bleu"] == pytest.approx(expected)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [REFERENCES]).score)
    assert "tok:13a" in result["bleu_signature"] and "case:mixed" in result["bleu_signature"]
    assert result["chrf_signature"].startswith("nrefs:1")
    assert score(REFERENCES, REFERENCES)["bleu"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="references"):
        score(hypotheses, REFERENCES[:2])


def test_translate_texts_keeps_order_and_matches_batch_decoding(loaded_run):
    model, tokenizer = loaded_run
    done = []
    outputs = translate_texts(model, tokenizer, SOURCES, beam_size=2, batch_size=2,
                              extra_length=4, progress=done.append)
    assert done == [2, 4, 5]
    ids, _ = beam_search(model, encode_texts(tokenizer, SOURCES).to_tensor(), beam_size=2,
                         extra_length=4)
    assert outputs == [t.decode() for t in tokenizer.detokenize(ids).numpy()]
    greedy = translate_texts(model, tokenizer, SOURCES[::-1], beam_size=1, extra_length=4)
    assert len(greedy) == len(SOURCES) and translate_texts(model, tokenizer, []) == []


def test_cli_scores_files_as_json(run_dir, tmp_path, capsys):
    src, ref = tmp_path / "test.de", tmp_path / "test.en"
    src.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
    hypotheses = tmp_path / "hyp.en"
    code = main(["--model", str(run_dir), "--src-file", str(src), "--ref-file", str(ref),
                 "--beam", "1", "--json", "--output", str(hypotheses)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 5 and "tok:13a" in result["bleu_signature"]
    lines = hypotheses.read_text(encoding="utf-8").splitlines()
    assert result["bleu"] == pytest.approx(score(lines, REFERENCES)["bleu"])


def test_cli_reads_a_corpus_folder_and_a_saved_model(tmp_path_factory, tmp_path, capsys):
    _, export = shared_artifacts(tmp_path_factory)
    (tmp_path / "test_2016_flickr.de").write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    (tmp_path / "test_2016_flickr.en").write_text("\n".join(REFERENCES) + "\n",
                                                  encoding="utf-8")
    # (One call: each loads the SavedModel, most of this test's time. The text report:
    # test_without_beam_or_alpha_a_run_decodes_as_its_test_bleu_was_scored.)
    code = main(["--model", str(export.parent), "--data", str(tmp_path), "--src", "de",
                 "--tgt", "en", "--beam", "2", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    # The corpus' "loaded N pairs" line goes to stderr: --json's stdout is JSON alone.
    assert "loaded 5 de-en pairs" in captured.err
    result = json.loads(captured.out)
    assert result["sentences"] == 5 and result["beam_size"] == 2
    assert "tok:13a" in result["bleu_signature"]


@pytest.mark.parametrize("problem", ["missing_file", "mismatch", "not_a_model"])
def test_cli_bad_input_is_one_clear_line(run_dir, tmp_path, capsys, problem):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("a\nb\nc\n", encoding="utf-8")
    ref.write_text("a\nb\n" if problem == "mismatch" else "a\nb\nc\n", encoding="utf-8")
    model = tmp_path if problem == "not_a_model" else run_dir
    if problem == "missing_file":
        src = tmp_path / "nope.txt"
    code = main(["--model", str(model), "--src-file", str(src), "--ref-file", str(ref)])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("evaluate: error: ")
    expected = {"missing_file": "nope.txt", "mismatch": "has 3 lines but",
                "not_a_model": "not a model directory"}[problem]
    assert expected in err


def test_cli_full_disk_at_output_exits_4_with_one_line(run_dir, tmp_path, capsys,
                                                       monkeypatch):
    src, ref = tmp_path / "test.de", tmp_path / "test.en"
    src.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
    disk = tmp_path / "disk"
    with small_filesystem(disk, 64 * 1024) as mounted:
        if mounted:
            fill(disk)
        else:
            no_space_at_sync(monkeypatch, disk)
        hypotheses = disk / "hyp.en"
        code = main(["--model", str(run_dir), "--src-file", str(src), "--ref-file", str(ref),
                     "--beam", "1", "--output", str(hypotheses)])
        err = capsys.readouterr().err
        assert code == EXIT_STORAGE and "Traceback" not in err
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("evaluate: error: no space left")
        assert str(hypotheses) in errors[0]
        assert not hypotheses.exists() and not list(disk.glob(".tmp-*"))


def test_cli_usage_errors_exit_non_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "x", "--src-file", "only-one.txt"])
    assert exit_info.value.code == 2
    assert "--ref-file" in capsys.readouterr().err


def test_without_beam_or_alpha_a_run_decodes_as_its_test_bleu_was_scored(run_dir, tmp_path,
                                                                          capsys):
    """evaluate (and translate) decode with the run's val choice from its results.json, as
    training scored its test BLEU and `export` writes serving_default; else beam 4, α 0.6."""
    src, ref = tmp_path / "test.de", tmp_path / "test.en"
    src.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    ref.write_text("\n".join(REFERENCES) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "results.json").write_text(json.dumps({"beam": 1, "alpha": 0.0}))
    outputs = {}
    for name, model, flags in (("own", run, []), ("given", run, ["--beam", "1", "--alpha", "0"]),
                               ("beam 2", run, ["--beam", "2"]), ("paper", run_dir, [])):
        outputs[name] = tmp_path / f"{name}.en"
        assert main(["--model", str(model), "--src-file", str(src), "--ref-file", str(ref),
                     "--json", "--output", str(outputs[name]), *flags]) == 0
        result = json.loads(capsys.readouterr().out)
        expected = {"own": (1, 0.0), "given": (1, 0.0), "beam 2": (2, 0.0), "paper": (4, 0.6)}
        assert (result["beam_size"], result["alpha"]) == expected[name], name
    assert outputs["own"].read_bytes() == outputs["given"].read_bytes()
    model, tokenizer = run_directory.load_run(run)
    assert outputs["own"].read_text(encoding="utf-8").splitlines() == translate_texts(
        model, tokenizer, SOURCES, beam_size=1, alpha=0.0)
    # A damaged value: one clear line without the flags; with both given, nothing is read.
    (run / "results.json").write_text(json.dumps({"beam": "four"}))
    files = ["--model", str(run), "--src-file", str(src), "--ref-file", str(ref)]
    assert main(files) == 1
    error = capsys.readouterr().err
    assert error.startswith("evaluate: error: ") and "'beam' is 'four'" in error
    assert main([*files, "--beam", "1", "--alpha", "0"]) == 0
    report = capsys.readouterr().out  # the text report
    assert report.startswith("BLEU = ") and "chrF = " in report and "tok:13a" in report


def test_a_saved_model_decodes_with_its_serving_default_settings(tmp_path_factory, tmp_path):
    """A SavedModel's own beam and α (its metadata, what serving_default uses) unless given;
    left out, sampling decodes with beam 1 and an n-best list with a beam that holds it."""
    from keras_transformer.serving.translator import load_translator

    _, export = shared_artifacts(tmp_path_factory)
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    metadata_file = copy / METADATA_FILE
    metadata = json.loads(metadata_file.read_text())
    assert (metadata["beam_size"], metadata["alpha"]) == (4, 0.6)  # the export's defaults
    metadata.update(beam_size=1, alpha=0.0)
    metadata_file.write_text(json.dumps(metadata))
    translator = load_translator(copy)
    assert translator.decoding == (1, 0.0)
    assert translator.translate(SOURCES) == translator.translate(SOURCES, beam_size=1,
                                                                 alpha=0.0)
    assert translator.resolve_search(None, None, sampling_topk=0) == (1, 0.0)
    assert translator.resolve_search(None, 0.6, num_hypotheses=3) == (3, 0.6)
    assert translator.resolve_search(5, None) == (5, 0.0)
