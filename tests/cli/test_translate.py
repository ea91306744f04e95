"""The translate command (keras_transformer.translate)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_transformer import run_directory
from keras_transformer.decoding.translator import force_decode, translate_batch, translate_texts
from keras_transformer.errors import EXIT_STORAGE
from keras_transformer.force_decode import main as force_decode_main
from keras_transformer.logs import is_native_log_line
from keras_transformer.serving.translator import ModelError, load_translator
from keras_transformer.translate import main
from tests.cli.test_train import cli_env
from tests.serving.test_saved_model import shared_artifacts
from tests.storage_faults import fill, no_space_at_sync, small_filesystem

LINES = ["Ein Hund läuft im Park.", "", "Zwei Kinder spielen mit einem Ball."]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """(run directory, saved_models/<name> base holding versions 1 and 2)."""
    run, export = shared_artifacts(tmp_path_factory)
    base = tmp_path_factory.mktemp("served") / "demo"
    shutil.copytree(export, base / "1")
    shutil.copytree(export, base / "2")
    (base / ".tmp-export-1-x").mkdir()  # an unfinished export is not a version
    return run, base


@pytest.mark.parametrize("verbose", [False, True])
def test_stdin_to_stdout_in_a_subprocess_with_tensorflows_logs_only_if_verbose(
        paths, tmp_path, verbose):
    run, _ = paths
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer.translate", "--model", str(run),
         "--beam", "1", "--batch-size", "2", *(["--verbose"] if verbose else [])],
        input="\n".join(LINES) + "\n", capture_output=True, text=True, env=cli_env(),
        cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    native = [line for line in result.stderr.splitlines()
              if is_native_log_line(line.encode())]
    # TensorFlow logs at least "oneDNN custom operations are on" when it loads.
    assert bool(native) == verbose, result.stderr[-3000:]
    model, tokenizer = run_directory.load_run(run)
    expected = translate_texts(model, tokenizer, LINES, beam_size=1)
    assert result.stdout.splitlines() == [" ".join(t.splitlines()) for t in expected]
    assert "sentences" not in result.stderr  # no progress bar for stdin


def test_saved_models_base_uses_the_highest_version(paths, tmp_path, capfd):
    _, base = paths
    highest = load_translator(base)  # (each load is most of this test's time)
    assert highest.path == base / "2"
    source = tmp_path / "input.txt"
    source.write_bytes("\n".join(LINES).encode() + b"\n\xff\xfe broken\r\n")
    output = tmp_path / "out.txt"
    assert main(["--model", str(base), "--input", str(source), "--output", str(output),
                 "--batch-size", "2"]) == 0
    lines = output.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(LINES) + 1
    served = highest.saved_model.signatures["translate"](
        inputs=tf.constant(LINES), beam_size=tf.constant(4), alpha=tf.constant(0.6))
    assert lines[:3] == [t.decode() for t in served["outputs"].numpy()]
    assert "4/4 sentences" in capfd.readouterr().err  # the progress bar


def test_plot_attention_flag_writes_pngs(paths, tmp_path, capfd):
    run, _ = paths
    source = tmp_path / "input.txt"
    source.write_text("Ein Hund.\n" + "Ein Hund läuft im Park. " * 8 + "\n", encoding="utf-8")
    assert main(["--model", str(run), "--input", str(source), "--beam", "1",
                 "--max-input-tokens", "32", "--plot-attention", str(tmp_path / "plots")]) == 0
    pngs = sorted((tmp_path / "plots" / "line_1").glob("*.png"))
    assert [p.name for p in pngs] == ["attention_layer_1.png", "attention_layer_2.png"]
    captured = capfd.readouterr()
    assert len(captured.out.splitlines()) == 2
    # Line 2 was decoded a sentence at a time: no map of the whole line, and a note.
    assert not (tmp_path / "plots" / "line_2").exists()
    assert "line 2 was split into sentences" in captured.err
    assert "no attention plot" in captured.err


@pytest.mark.parametrize("problem", ["no_dir", "not_a_model", "no_input", "plot_saved_model"])
def test_bad_input_is_one_clear_line(paths, tmp_path, capfd, problem):
    run, base = paths
    source = tmp_path / "input.txt"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    args = {
        "no_dir": ["--model", str(tmp_path / "missing"), "--input", str(source)],
        "not_a_model": ["--model", str(tmp_path), "--input", str(source)],
        "no_input": ["--model", str(run), "--input", str(tmp_path / "missing.txt")],
        "plot_saved_model": ["--model", str(base), "--input", str(source),
                             "--plot-attention", str(tmp_path / "plots")],
    }[problem]
    assert main(args) == 1
    err = capfd.readouterr().err
    # Only our line (sentencepiece's native code may log an INFO line when a model loads).
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("translate: error: ")
    assert "Traceback" not in err


def test_load_translator_rejects_an_empty_folder(tmp_path):
    with pytest.raises(ModelError, match="not a model directory"):
        load_translator(tmp_path)


def test_a_full_disk_at_output_exits_4_with_one_line_and_keeps_the_old_file(
        paths, tmp_path, capfd, monkeypatch):
    run, _ = paths
    source = tmp_path / "input.txt"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    disk = tmp_path / "disk"
    with small_filesystem(disk, 64 * 1024) as mounted:
        output = disk / "out.txt"
        output.write_text("earlier translations\n", encoding="utf-8")
        if mounted:
            fill(disk)
        else:
            no_space_at_sync(monkeypatch, disk)
        assert main(["--model", str(run), "--input", str(source), "--output", str(output),
                     "--beam", "1"]) == EXIT_STORAGE
        err = capfd.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("translate: error: no space left")
        assert str(output) in errors[0] and "free space" in errors[0]
        assert "Traceback" not in err
        assert output.read_text(encoding="utf-8") == "earlier translations\n"
        assert not list(disk.glob(".tmp-*"))


# --- n-best lists, scores, sampling, prefixes, alignments and long inputs (issue 37) ---


def _run_translate(args, capfd) -> tuple[int, list[str], str]:
    status = main(args)
    captured = capfd.readouterr()
    return status, captured.out.splitlines(), captured.err


def test_jsonl_holds_what_the_python_api_gives(paths, tmp_path, capfd):
    run, _ = paths
    source = tmp_path / "input.txt"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    status, out, _ = _run_translate(
        ["--model", str(run), "--input", str(source), "--format", "jsonl", "--beam", "3",
         "--n-best", "2", "--token-scores", "--alignment"], capfd)
    assert status == 0 and len(out) == len(LINES)
    records = [json.loads(line) for line in out]
    model, tokenizer = run_directory.load_run(run)
    expected = translate_batch(model, tokenizer, LINES, beam_size=3, num_hypotheses=2,
                               return_token_scores=True, return_alignment=True)
    for number, (record, result) in enumerate(zip(records, expected, strict=True)):
        assert record == json.loads(json.dumps(result.as_json(number, nbest=True)))
    assert set(records[0]) >= {"line", "translation", "score", "log_prob", "finished",
                               "pieces", "token_log_probs", "alignment", "flags",
                               "source_pieces", "nbest"}
    assert records[1]["flags"] == ["empty_input"] and records[1]["translation"] == ""
    assert len(records[0]["nbest"]) == 2
    # With --n-best 2 every record has its n-best list, an empty line's of one.
    assert records[1]["nbest"] == [{key: records[1][key] if key != "text" else "" for key in
                                    records[0]["nbest"][0]}]


def test_moses_nbest_and_alignment_text_formats(paths, tmp_path, capfd):
    run, _ = paths
    source = tmp_path / "input.txt"
    source.write_text("Ein Hund.\nZwei Kinder.\n", encoding="utf-8")
    status, out, _ = _run_translate(["--model", str(run), "--input", str(source), "--beam", "2",
                                     "--n-best", "2", "--alignment"], capfd)
    assert status == 0 and len(out) == 4
    fields = [line.split(" ||| ") for line in out]
    assert [f[0] for f in fields] == ["0", "0", "1", "1"]
    # LINE ||| TRANSLATION ||| ALIGNMENT ||| F0= LOG_PROB ||| SCORE, as Marian writes them
    assert all(len(f) == 5 and f[3].startswith("F0= ") and float(f[4]) <= 0 for f in fields)
    assert float(fields[0][4]) >= float(fields[1][4])  # best first


def test_prefixes_sampling_and_long_inputs_from_the_command_line(paths, tmp_path, capfd):
    run, base = paths
    source, prefixes = tmp_path / "input.txt", tmp_path / "prefixes.txt"
    long_line = "Ein Hund läuft im Park. " * 30
    source.write_text(f"Ein Hund.\n{long_line}\n", encoding="utf-8")
    prefixes.write_text("Zwei\n\n", encoding="utf-8")
    status, out, err = _run_translate(["--model", str(run), "--input", str(source), "--beam", "1",
                                       "--prefix", str(prefixes), "--max-input-tokens", "32"],
                                      capfd)
    assert status == 0 and out[0].startswith("Zwei") and len(out) == 2
    assert "1 line(s) split" in err and "line 2" in err
    # Sampling without --beam: beam 1 (the run's own beam is for its search).
    sampled = [_run_translate(["--model", str(run), "--input", str(source), *beam,
                               "--sampling-topk", "0", "--seed", str(seed)], capfd)[1]
               for seed, beam in ((1, ["--beam", "1"]), (1, []), (2, []))]
    assert sampled[0] == sampled[1] != sampled[2]
    status, _, err = _run_translate(["--model", str(run), "--input", str(source),
                                     "--max-input-tokens", "32", "--long-inputs", "error"],
                                    capfd)
    assert status == 1 and "input line 2 has" in err
    # A SavedModel splits long lines too (at its own limit, 64 tokens), or truncates them.
    status, out, _ = _run_translate(["--model", str(base), "--input", str(source),
                                     "--format", "jsonl"], capfd)
    flags = [json.loads(line)["flags"] for line in out]
    assert status == 0 and "split" not in flags[0] and flags[1][0] == "split"
    status, out, err = _run_translate(["--model", str(base), "--input", str(source),
                                       "--long-inputs", "truncate"], capfd)
    assert status == 0 and len(out) == 2
    assert "1 line(s) truncated" in err and "line 2" in err


@pytest.mark.parametrize("flags", [["--n-best", "5", "--beam", "4"],
                                   ["--sampling-topk", "0", "--beam", "4"],
                                   ["--sampling-topk", "0", "--n-best", "2"],
                                   ["--sampling-topp", "0.9"], ["--token-scores"],
                                   ["--seed", "-1"], ["--alpha", "nan"],
                                   ["--sampling-topk", "0", "--beam", "1",
                                    "--sampling-temperature", "inf"],
                                   ["--max-output-tokens", "0"]])
def test_inconsistent_decoding_flags_are_usage_errors(paths, flags, capfd):
    run, _ = paths
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(run), *flags])
    assert exit_info.value.code == 2
    assert "error:" in capfd.readouterr().err


def test_force_decode_scores_pairs_as_the_python_api(paths, tmp_path, capfd):
    run, base = paths
    source, target = tmp_path / "source.txt", tmp_path / "target.txt"
    source.write_text("Ein Hund.\nZwei Kinder.\n", encoding="utf-8")
    target.write_text("A dog.\nTwo children.\n", encoding="utf-8")
    assert force_decode_main(["--model", str(run), "--source", str(source),
                              "--target", str(target)]) == 0
    out = capfd.readouterr().out.splitlines()
    model, tokenizer = run_directory.load_run(run)
    expected = force_decode(model, tokenizer, ["Ein Hund.", "Zwei Kinder."],
                            ["A dog.", "Two children."])
    assert [tuple(map(float, line.split("\t"))) for line in out] == [
        pytest.approx((r.hypotheses[0].log_prob, r.hypotheses[0].score), abs=1e-5)
        for r in expected]
    pieces = tmp_path / "pieces.txt"
    pieces.write_text("\n".join(" ".join(r.hypotheses[0].pieces) for r in expected) + "\n",
                      encoding="utf-8")
    assert force_decode_main(["--model", str(run), "--source", str(source), "--target",
                              str(pieces), "--pieces", "--format", "jsonl",
                              "--alignment"]) == 0
    records = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert [r["log_prob"] for r in records] == pytest.approx(
        [r.hypotheses[0].log_prob for r in expected], abs=1e-5)
    assert all("alignment" in r and "token_log_probs" in r for r in records)
    target.write_text("A dog.\n", encoding="utf-8")
    assert force_decode_main(["--model", str(run), "--source", str(source),
                              "--target", str(target)]) == 1
    assert "--target 1" in capfd.readouterr().err
    assert force_decode_main(["--model", str(base), "--source", str(source),
                              "--target", str(source)]) == 1
    assert "needs a run directory" in capfd.readouterr().err
