"""notebooks/multi30k.ipynb: the committed copy is well-formed and carries a full run's
outputs, and the notebook runs top to bottom on Multi30k, shrunk to a tiny model and a few
steps, through the public API only."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import nbformat
import pytest

import keras_transformer
from keras_transformer.flags import parse_train_args
from keras_transformer.training.config import setting_fields
from tests.cli.test_train import REPO

NOTEBOOK = REPO / "notebooks" / "multi30k.ipynb"

# Injected right after the "parameters" cell: the whole notebook in well under a minute.
SHRINK = """\
DATA = {data!r}
WORK = {work!r}
PRESET = "tiny"
VOCAB_SIZE = 400          # the tokenizer's minimum is 300 (4 special ids + 256 byte pieces)
TOKENS_PER_BATCH = 2048
MAX_LENGTH = 64
STEPS = 20
STEPS_PER_EPOCH = 10
WARMUP = 10
TEST_SENTENCES = 20
STRATEGY_STEPS = 2
RUN_STEPS = 20
RUN_CHECKPOINT_EVERY = 10
RUN_AVERAGE_LAST = 2
RUN_CHOOSE_BY = "loss"    # by val BLEU, a 20-step model would decode all of val 9 times
VERBOSE = 2
"""

# "UserWarning: ...", "DeprecationWarning", "WARNING:absl:...", "WARNING:tensorflow:...".
PYTHON_WARNING = re.compile(r"\w+Warning\b|WARNING:(?:absl|tensorflow|keras):")


def read_notebook() -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    return notebook


def parameters_index(notebook: nbformat.NotebookNode) -> int:
    tagged = [i for i, cell in enumerate(notebook.cells)
              if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell must be tagged 'parameters'"
    return tagged[0]


def text_outputs(cell: nbformat.NotebookNode, stream: str = "stdout") -> str:
    return "".join(output.get("text", "") for output in cell.get("outputs", [])
                   if output.output_type == "stream" and output.name == stream)


def cell_with(notebook: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    matches = [cell for cell in notebook.cells
               if cell.cell_type == "code" and source in cell.source]
    assert len(matches) == 1, f"expected one code cell containing {source!r}"
    return matches[0]


def check_outputs(notebook: nbformat.NotebookNode) -> None:
    """What every executed copy (the test's and the committed one) must show."""
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in code), "a cell was not executed"
    for cell in code:
        for output in cell.outputs:
            assert output.output_type != "error", cell.source
            # Python warnings (from how the notebook calls Keras or the package) land here;
            # TensorFlow's C++ log lines ("WARNING: All log messages before absl...") do not
            # count.
            assert not PYTHON_WARNING.search(output.get("text", "")), output.text
    bleu = text_outputs(cell_with(notebook, "kt.score_translations"))
    assert re.search(r"BLEU \d+\.\d\d +chrF \d+\.\d\d", bleu), bleu
    assert re.search(r"nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:", bleu), bleu
    saved = text_outputs(cell_with(notebook, "kt.Translator.load"))
    translation = re.search(r"^SavedModel: (.*)$", saved, re.MULTILINE)
    assert translation and translation.group(1).strip(), saved
    reload = text_outputs(cell_with(notebook, "keras.models.load_model"))
    assert "same translations after reloading: True" in reload
    fit = text_outputs(cell_with(notebook, "history = model.fit("))
    assert re.search(r"\d+ steps in [\d.]+ min", fit), fit
    mirrored = text_outputs(cell_with(notebook, "tf.distribute.MirroredStrategy()"))
    assert "optimizer steps under MirroredStrategy" in mirrored, mirrored
    run = text_outputs(cell_with(notebook, "kt.run_training("))
    assert re.search(r"^kt\.run_training: \d+ steps \(.+\), BLEU \d+\.\d\d, chrF \d+\.\d\d",
                     run, re.MULTILINE), run
    assert re.search(r"^  python -m keras_transformer\.train --recipe multi30k --data ", run,
                     re.MULTILINE), run
    images = [output for cell in code for output in cell.outputs
              if "image/png" in output.get("data", {})]
    assert len(images) == 3, "learning-rate schedule, training history and attention plots"


def test_notebook_uses_only_the_public_api():
    notebook = read_notebook()
    source = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert "import keras_transformer as kt" in source
    assert not re.search(r"\bfrom (keras_transformer|pipelines)\b|\bimport pipelines\b",
                         source)
    used = set(re.findall(r"\bkt\.(\w+)", source))
    assert used <= set(keras_transformer.__all__), used - set(keras_transformer.__all__)
    params = notebook.cells[parameters_index(notebook)].source
    for name in ("DATA", "WORK", "PRESET", "VOCAB_SIZE", "TOKENS_PER_BATCH", "MAX_LENGTH",
                 "STEPS", "STEPS_PER_EPOCH", "WARMUP", "LR_SCALE", "DROPOUT",
                 "LABEL_SMOOTHING", "TEST_SENTENCES", "STRATEGY_STEPS", "RUN_STEPS",
                 "RUN_CHECKPOINT_EVERY", "RUN_AVERAGE_LAST"):
        assert re.search(rf"^{name} = ", params, re.MULTILINE), name


def test_committed_notebook_carries_a_full_run():
    notebook = read_notebook()
    check_outputs(notebook)
    # One kernel session, top to bottom, with the parameters as committed (nothing injected).
    counts = [cell.execution_count for cell in notebook.cells if cell.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1))
    params = notebook.cells[parameters_index(notebook)].source
    assert 'PRESET = "small"' in params and "VOCAB_SIZE = 8000" in params
    steps = int(re.search(r"^STEPS = (\d+)", params, re.MULTILINE).group(1))
    fit = text_outputs(cell_with(notebook, "history = model.fit("))
    assert f"{steps} steps in " in fit, fit
    bleu = text_outputs(cell_with(notebook, "kt.score_translations"))
    assert "1000 test sentences translated" in bleu, bleu
    assert float(re.search(r"BLEU (\d+\.\d+)", bleu).group(1)) > 10.0, bleu
    run_steps = int(re.search(r"^RUN_STEPS = (\d+)", params, re.MULTILINE).group(1))
    run = text_outputs(cell_with(notebook, "kt.run_training("))
    assert f"kt.run_training: {run_steps} steps " in run, run
    assert "on 1000 test sentences" in run, run
    # Small enough to review and to keep in git.
    assert NOTEBOOK.stat().st_size < 300_000


@pytest.mark.integration
@pytest.mark.slow
def test_notebook_runs_end_to_end(multi30k_dir, tmp_path):
    from nbclient import NotebookClient

    notebook = read_notebook()  # executed in memory: the committed file is left as it is
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    shrink = SHRINK.format(data=str(multi30k_dir), work=str(tmp_path / "work"))
    notebook.cells.insert(parameters_index(notebook) + 1, nbformat.v4.new_code_cell(shrink))
    client = NotebookClient(notebook, kernel_name="python3", timeout=300,
                            coalesce_streams=True,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    check_outputs(notebook)
    assert (tmp_path / "work" / "model.keras").is_file()
    assert (tmp_path / "work" / "saved_model" / "1" / "saved_model.pb").is_file()

    # Section 10's kt.run_training is the train command: the command line the notebook
    # prints parses to every setting config.json recorded for the notebook's run (the
    # recipe's values and the flags given), and so does config.json's "arguments" written
    # back as flags. That the same settings train to the same results from the command
    # line is tests/training/test_resume.py's (the same command, killed or not).
    run = tmp_path / "work" / "run"
    arguments = json.loads((run / "config.json").read_text())["arguments"]
    assert arguments["prepared"] == str(tmp_path / "work" / "prepared")
    assert not arguments["no_export"]
    printed = text_outputs(cell_with(notebook, "kt.run_training("))
    command = re.search(r"^  python -m keras_transformer\.train (.*)$", printed,
                        re.MULTILINE).group(1)
    assert parse_train_args(shlex.split(command))[0].flags() == arguments, command
    assert parse_train_args(train_argv(arguments))[0].flags() == arguments
    results = json.loads((run / "results.json").read_text())
    assert (Path(results["export"]) / "saved_model.pb").is_file()
    assert results["bleu"] is not None and results["test_sentences"] == 20


def train_argv(arguments: dict[str, Any]) -> list[str]:
    """`python -m keras_transformer.train`'s argv for config.json's "arguments": `--flag value`
    for each setting, a true boolean as a bare flag (a false one with a default of None as
    `--no-flag`), unset (None) ones left out."""
    defaults = {field.name: field.default for _, _, field in setting_fields()}
    argv = []
    for name, value in arguments.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            if defaults[name] is None:
                argv.append("--no-" + name.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv
