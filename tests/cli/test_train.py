"""The training command: flag validation (nothing written on a bad command) and a tiny
end-to-end run producing model.keras, results.json with BLEU, and a SavedModel export."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_transformer.flags import build_train_parser
from keras_transformer.run_directory import load_run
from keras_transformer.train import main
from keras_transformer.training.backup import list_generations
from keras_transformer.training.checkpoints import average_checkpoints
from keras_transformer.training.config import config_from_flags
from pipelines import storage

REPO = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess running the project's code as a user would: the CLIs hide
    TensorFlow's C++ logs themselves (a TF_CPP_MIN_LOG_LEVEL of the user's own would show
    them), so it is removed."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env.update(extra)
    return env


def write_toy_corpus(folder: Path, pairs: int = 300, seed: int = 0,
                     sentence_words: tuple[int, int] = (3, 8)) -> Path:
    """A learnable toy language pair xx -> yy: each word has one translation and the
    target reverses the word order. Sentences of `sentence_words` words (a closed range);
    splits train (`pairs`), val and test (20 each)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdgklmnprst" for v in "aeiou"]
    source_words = sorted({"".join(rng.sample(syllables, 2)) for _ in range(60)})
    dictionary = {word: "".join(rng.sample(syllables, 2)) + "x" for word in source_words}
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", pairs), ("val", 20), ("test", 20)):
        sources, targets = [], []
        for _ in range(count):
            words = [rng.choice(source_words) for _ in range(rng.randint(*sentence_words))]
            sources.append(" ".join(words))
            targets.append(" ".join(dictionary[word] for word in reversed(words)))
        (folder / f"{split}.xx").write_text("\n".join(sources) + "\n")
        (folder / f"{split}.yy").write_text("\n".join(targets) + "\n")
    return folder


TINY = ["--src", "xx", "--tgt", "yy", "--preset", "tiny", "--vocab-size", "300",
        "--tokens-per-batch", "512", "--max-length", "32", "--precision", "float32"]


def test_help_documents_every_flag():
    text = build_train_parser().format_help()
    for flag in ("--data", "--src", "--tgt", "--preset", "--d-model", "--num-layers",
                 "--num-heads", "--d-ff", "--dropout", "--label-smoothing", "--warmup-steps",
                 "--lr-scale", "--vocab-size", "--pre-norm", "--tokens-per-batch",
                 "--max-length", "--max-steps", "--epochs", "--max-minutes", "--out",
                 "--export-dir", "--seed", "--precision", "--jit-compile", "--average-last",
                 "--checkpoint-every", "--validate-every", "--patience", "--beam", "--alpha",
                 "--test-split", "--val-split", "--no-export", "--resume", "--overwrite",
                 "--accumulate", "--tokens-per-step", "--dry-run"):
        assert flag in text, flag
    # Each token budget says whether it is per replica or global.
    flat = " ".join(text.split())
    assert "--tokens-per-batch TOKENS_PER_BATCH PER REPLICA:" in flat
    assert "--tokens-per-step TOKENS_PER_STEP GLOBAL:" in flat


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data", "{missing}"], "does not exist"),
        (["--src", "fr"], "fr"),
        (["--src", "xx,yy"], "includes the target language 'yy'"),
        (["--src", "xx,xx"], "give each source language once"),
        (["--d-model", "30", "--num-heads", "4"], "divisible"),
        (["--tokens-per-batch", "16"], "--max-length 32: a longest pair would not fit in a "
         "micro-batch; the smallest valid value is 32"),
        (["--tokens-per-step", "20"], "the smallest valid value is 32"),
        (["--accumulate", "2", "--tokens-per-step", "2048"], "not both"),
        # 3 micro-batches of 30 tokens: below --max-length, refused with the next valid step.
        (["--tokens-per-batch", "40", "--tokens-per-step", "90"],
         "the smallest valid --tokens-per-step from 90 up on 1 replica(s) is 96"),
        (["--max-steps", "5", "--epochs", "1"], "not both"),
        (["--val-split", "nosuch"], "nosuch"),
        (["--resume"], "no run to resume"),
        (["--preset", "tiny", "--dropout", "0.5", "--activation", "relu", "--vocab-size",
          "100"], "--vocab-size"),
    ],
)
def test_semantic_errors_exit_2_with_one_line_and_no_run_dir(tmp_path, capsys, flags, message):
    data = write_toy_corpus(tmp_path / "corpus", pairs=30)
    out = tmp_path / "run"
    flags = [flag.format(missing=tmp_path / "missing") for flag in flags]
    argv = ["--data", str(data), *TINY, "--out", str(out)]
    # Later flags win in argparse, so the bad value overrides the good default above.
    assert main([*argv, *flags]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and len(error.splitlines()) == 1, error
    assert message in error
    assert not out.exists()


def test_dry_run_prints_the_plan_and_creates_nothing(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=30)
    out = tmp_path / "run"
    argv = ["--data", str(data), *TINY, "--tokens-per-step", "1200", "--out", str(out)]
    assert main([*argv, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "dry run: nothing was created" in printed
    assert "1 replica(s) x 3 micro-batch(es) of <= 400 tokens = 1200 tokens per step" in printed
    assert f"{out}: new" in printed and "prepared once from split 'train'" in printed
    assert not out.exists()


def test_a_vocabulary_too_large_for_the_corpus_leaves_no_run_dir(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=30)
    out = tmp_path / "run"
    argv = ["--data", str(data), *TINY, "--vocab-size", "6000", "--out", str(out)]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: preparing") and len(error.splitlines()) == 1, error
    assert "sentencepiece training failed" in error
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--max-steps", "-3"], ["--dropout", "1.5"],
                                   ["--precision", "fp8"], ["--checkpoint-every", "0"],
                                   ["--accumulate", "0"], ["--tokens-per-step", "-5"]])
def test_argparse_refuses_bad_values_with_exit_2(tmp_path, flags):
    with pytest.raises(SystemExit) as raised:
        main(["--data", str(tmp_path), *TINY, "--out", str(tmp_path / "run"), *flags])
    assert raised.value.code == 2
    assert not (tmp_path / "run").exists()


def test_refuses_a_run_dir_trained_with_other_settings_and_foreign_folders(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus", pairs=30)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--data", str(data), *TINY, "--out", str(out)]) == 2
    assert "not a training run" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    (out / "config.json").write_text(json.dumps({"identity": {"seed": 123}}))
    assert main(["--data", str(data), *TINY, "--out", str(out)]) == 2
    assert "different settings" in capsys.readouterr().err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_run_dir_another_run_is_writing_is_refused_and_left_alone(tmp_path, capsys):
    """A second command on a live run's --out (resume, --overwrite, or a fresh run in the
    folder it has just made) stops with one line naming that run's process, and changes
    nothing there."""
    data = write_toy_corpus(tmp_path / "corpus", pairs=30)
    live = tmp_path / "live"
    live.mkdir()
    (live / "config.json").write_text(json.dumps({"identity": {"seed": 123}}))
    (live / "checkpoints").mkdir()
    (live / "checkpoints" / "ckpt-10.weights.h5").write_bytes(b"weights")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for out, extra in ((live, []), (live, ["--overwrite"]), (live, ["--resume"]),
                       (fresh, [])):
        with storage.FolderLock(out):  # held as the live run's process holds it
            before = _files(out)
            assert main(["--data", str(data), *TINY, "--out", str(out), *extra]) == 2
            error = capsys.readouterr().err.strip()
            assert error.startswith("error:") and len(error.splitlines()) == 1, error
            assert f"{out} is in use by another process (pid {os.getpid()} on " in error
            assert "another training run is writing it" in error
            assert _files(out) == before, extra
    assert [p.name for p in fresh.iterdir()] == [".lock"]


@pytest.mark.slow
def test_tiny_end_to_end_run_writes_model_results_and_export(tmp_path, capsys):
    data = write_toy_corpus(tmp_path / "corpus")
    out, export = tmp_path / "run", tmp_path / "export"
    # The quickstart's recipe, shrunk by flags (which override it).
    command = [sys.executable, "-m", "keras_transformer.train", "--recipe", "multi30k",
               "--data", str(data), *TINY, "--max-steps", "30", "--checkpoint-every", "10",
               "--validate-every", "10", "--average-last", "2", "--beam", "2",
               "--val-beams", "1,2", "--val-alphas", "0.6,1.0", "--subword-samples", "3",
               "--export-dir", str(export), "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # A newcomer's log: the project's lines only, progress counted in steps and minutes; no
    # C++ banner, absl notice or Python warning anywhere, Keras' "Epoch 1/3" neither.
    noise = re.compile(r"^[IWEF]\d{4} |absl|cuInit|cuda|oneDNN|LOG\(|Warning|WARNING|^Epoch ")
    assert not [line for line in (result.stdout + result.stderr).splitlines()
                if noise.search(line)], result.stdout[:3000] + result.stderr[:3000]
    assert re.search(r"^step 10 / 30 · [\d.]+ min, ~\d+ min left · loss ", result.stdout, re.M)
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 30
    # config.json records the recipe, its values and the flags that overrode it.
    arguments = json.loads((out / "config.json").read_text())["arguments"]
    assert (arguments["recipe"], arguments["dropout"], arguments["warmup_steps"],
            arguments["lr_scale"], arguments["preset"], arguments["max_steps"]) == (
        "multi30k", 0.2, 1000, 0.5, "tiny", 30)
    # It is the run's TrainConfig serialized: it rebuilds the same settings.
    assert config_from_flags(arguments).flags() == arguments
    assert 0.0 <= results["bleu"] <= 100.0 and "tok:13a" in results["bleu_signature"]
    assert results["best_val_loss"] is not None
    for name in ("model.keras", "config.json", "tokenizer", "logs/metrics.csv",
                 "checkpoints/best.weights.h5", "test.hyp.txt"):
        assert (out / name).exists(), name
    assert [step for step, _ in list_generations(out / "backup")] == [30, 20]
    assert "BLEU" in result.stdout and str(out / "model.keras") in result.stdout
    # The recipe's training pairs: the toy corpus in 3 (here) sampled segmentations.
    manifest = json.loads((out / "prepared" / "manifest.json").read_text())
    assert manifest["settings"]["subword_samples"] == 3
    # One shard per copy, each the corpus less the pairs its segmentation made too long.
    assert [0 < shard["pairs"] <= manifest["pairs_total"] for shard in manifest["shards"]] == [
        True] * 3
    # model.keras holds the candidate (the last 2 averaged, those up to / around the best
    # step, the best checkpoint) with the highest val BLEU (the recipe's --choose-by bleu),
    # and says why; then the beam and alpha of test and the export were chosen on val.
    candidates = {c["name"]: c for c in results["averaging"]["candidates"]}
    assert candidates["last"]["steps"] == [20, 30]
    assert candidates[results["final_weights"]]["val_bleu"] == max(
        c["val_bleu"] for c in candidates.values())
    chosen_steps = candidates[results["final_weights"]]["steps"]
    assert results["averaged_steps"] == chosen_steps
    assert "val BLEU" in results["averaging"]["reason"]
    decoding = results["decoding"]
    assert [(t["beam"], t["alpha"]) for t in decoding["tried"]] == [
        (1, 0.6), (1, 1.0), (2, 0.6), (2, 1.0)]
    assert decoding["val_bleu"] == max(t["val_bleu"] for t in decoding["tried"])
    assert (results["beam"], results["alpha"]) == (decoding["beam"], decoding["alpha"])
    saved, chosen = load_run(out)[0], load_run(out)[0]
    if results["final_weights"] == "best checkpoint":
        chosen.load_weights(out / "checkpoints" / "best.weights.h5")
    else:
        average_checkpoints(out / "checkpoints", chosen_steps, tmp_path / "mean.weights.h5")
        chosen.load_weights(tmp_path / "mean.weights.h5")
    for actual, expected in zip(saved.get_weights(), chosen.get_weights(), strict=True):
        np.testing.assert_array_equal(actual, expected)
    assert (Path(results["export"]) / "saved_model.pb").is_file()
    # The same command again, its `main` in this process (what `python -m` runs, without
    # starting TensorFlow again): the run is finished, nothing is retrained.
    capsys.readouterr()
    assert main(command[3:]) == 0 and "already trained" in capsys.readouterr().out
