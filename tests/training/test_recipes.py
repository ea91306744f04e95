"""The README's WMT14 recipes: the exact commands pass validation here (`--dry-run`, on a mocked
`wmt14_translate/de-en`: tfds cannot download here) and make the paper's ~25,000-token step; the
same command, shrunk to the tiny preset, trains end to end on the mocked tfds dataset."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from keras_transformer.flags import parse_train_args
from keras_transformer.prepare import parse_args as parse_prepare_args
from tests.cli.test_train import REPO, write_toy_corpus

RECIPES_SECTION = "## The paper's recipes: WMT14 English→German"


def readme_recipes() -> list[list[str]]:
    """The commands (argv after `python -m`) of the README's recipes section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(RECIPES_SECTION):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    commands = [" ".join(block.replace("\\\n", " ").split()) for block in blocks]
    return [shlex.split(command)[2:] for command in commands]


def _from_toy(count: dict[str, int]) -> dict[str, list[dict[str, str]]]:
    """Toy en->de pairs (the CLI tests' toy language) for each tfds split."""
    with tempfile.TemporaryDirectory() as folder:
        toy = write_toy_corpus(Path(folder), pairs=count["train"])
        read = {split: zip((toy / f"{split}.xx").read_text().splitlines(),
                           (toy / f"{split}.yy").read_text().splitlines(), strict=True)
                for split in ("train", "val", "test")}
        return {"train": [{"en": s, "de": t} for s, t in read["train"]],
                "validation": [{"en": s, "de": t} for s, t in read["val"]],
                "test": [{"en": s, "de": t} for s, t in read["test"]]}


def _run_mocked(examples, argv: list[str], capsys) -> subprocess.CompletedProcess:
    """train's `main` on a mocked tfds wmt14_translate/de-en (toy sentences under "de" and
    "en"), in this process (what `python -m` runs, without starting TensorFlow again), as a
    finished process with its stdout and stderr."""
    import tensorflow_datasets as tfds

    from tests.pipelines.test_prepared import fake_tfds
    from tests.training.test_resume import in_this_process

    with tfds.testing.mock_data(as_dataset_fn=fake_tfds(examples, ("de", "en"))):
        return in_this_process([sys.executable, "-m", "keras_transformer.train", *argv], capsys)


def _relocated(argv: list[str], tmp_path) -> list[str]:
    """`argv` with --out and --prepared moved under tmp_path, reading tfds from there."""
    argv = list(argv)
    for flag in ("--out", "--prepared"):
        if flag in argv:
            index = argv.index(flag) + 1
            argv[index] = str(tmp_path / argv[index].strip("/").replace("/", "_"))
    return [*argv, "--data-dir", str(tmp_path / "tfds")]


def test_the_readme_lists_prepare_base_and_big():
    commands = readme_recipes()
    assert [c[0] for c in commands] == ["keras_transformer.prepare", "keras_transformer.train",
                                        "keras_transformer.train", "keras_transformer.train"]
    assert commands[2][1:3] == ["--recipe", "paper-base"]  # checked flag for flag below
    for command in commands:
        assert command[command.index("--data") + 1] == "tfds:wmt14_translate/de-en"
    prepare, _ = parse_prepare_args(commands[0][1:])
    prepare.check()
    assert prepare.vocab_size == 37000


@pytest.mark.slow
def test_readme_wmt14_commands_pass_validation_and_make_the_papers_step(tmp_path, capsys):
    examples = _from_toy({"train": 50})
    _, base, _, big = readme_recipes()
    for command, preset, steps, averaged in ((base, "base", 100000, 5),
                                             (big, "big", 300000, 20)):
        result = _run_mocked(examples, [*_relocated(command[1:], tmp_path), "--dry-run"],
                             capsys)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        plan = result.stdout
        assert "dry run: nothing was created" in plan
        # One CPU replica here: 7 micro-batches of 3,571 tokens, ~25,000 tokens a step.
        assert "1 replica(s) x 7 micro-batch(es) of <= 3571 tokens = 24997 tokens per step" in plan
        assert f"{preset} preset" in plan and f"{steps} steps" in plan
        assert "beam 4, alpha 0.6" in plan and f"the last {averaged} averaged" in plan
        assert "split 'validation'" in plan and "split 'test'" in plan
    # Nothing was created: no run directory, no prepared data.
    assert not any(p.name.startswith(("runs", "prepared")) for p in tmp_path.iterdir())


@pytest.mark.slow
def test_the_base_recipe_shrunk_to_tiny_trains_end_to_end_on_mocked_tfds(tmp_path, capsys):
    examples = _from_toy({"train": 300})
    base = readme_recipes()[1]
    # Later flags win: the recipe, made tiny (4 steps of 4 accumulated micro-batches).
    tiny = ["--preset", "tiny", "--vocab-size", "300", "--max-length", "32",
            "--tokens-per-batch", "256", "--tokens-per-step", "1024", "--max-steps", "4",
            "--checkpoint-every", "2", "--warmup-steps", "10", "--precision", "float32",
            "--beam", "2", "--no-export"]
    argv = [*_relocated(base[1:], tmp_path), *tiny]
    result = _run_mocked(examples, argv, capsys)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    run = tmp_path / "runs_wmt14-en-de-base"
    results = json.loads((run / "results.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert results["steps"] == 4 and results["test_split"] == "test"
    assert results["averaging"]["candidates"][0]["steps"] == [2, 4]  # the last 2, averaged
    assert results["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert config["step_budget"] == {"micro_batch": 256, "replicas": 1, "accumulate": 4,
                                     "tokens_per_step": 1024}
    assert config["prepared"]["corpus_fingerprint"]
    assert (tmp_path / "prepared_wmt14-en-de" / "manifest.json").is_file()
    assert "BLEU" in result.stdout and "nrefs:1" in result.stdout


def parse_args(argv: list[str]):
    """`train`'s settings by flag name, as config.json's "arguments" records them."""
    return SimpleNamespace(**parse_train_args(argv)[0].flags())


def test_a_recipe_sets_defaults_that_flags_override():
    from keras_transformer.training.recipes import RECIPES

    base = ["--data", "d", "--src", "de", "--tgt", "en", "--out", "o"]
    plain = parse_args(base)
    assert plain.recipe is None and plain.dropout is None and plain.warmup_steps == 4000
    recipe = parse_args(["--recipe", "multi30k", *base])
    for key, value in RECIPES["multi30k"].items():
        assert getattr(recipe, key) == value, key
    # A flag given on the command line wins over the recipe, wherever it stands.
    override = parse_args([*base, "--dropout", "0.3", "--recipe", "multi30k", "--max-steps", "9"])
    assert (override.dropout, override.max_steps, override.warmup_steps) == (0.3, 9, 1000)
    big = parse_args(["--recipe", "paper-big", *base])
    assert (big.preset, big.max_steps, big.average_last, big.tokens_per_step) == (
        "big", 300_000, 20, 25000)


def test_the_paper_recipes_match_the_readme_commands():
    """`--recipe paper-base` is the README's WMT14 base command, flag for flag."""
    base_command, big_command = (command for command in readme_recipes()
                                 if command[0] == "keras_transformer.train"
                                 and "--recipe" not in command)
    data = ["--data", "tfds:wmt14_translate/de-en", "--src", "en", "--tgt", "de",
            "--prepared", "prepared/wmt14-en-de"]
    for command, recipe in ((base_command, "paper-base"), (big_command, "paper-big")):
        from_readme = vars(parse_args(command[1:]))
        from_recipe = vars(parse_args(["--recipe", recipe, *data, "--out", from_readme["out"]]))
        from_recipe["recipe"] = None
        assert from_recipe == from_readme
