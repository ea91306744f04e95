"""The layout of a run directory, shared by training (writer) and decoding/evaluation (readers).

```
<run>/config.json        the model config, tokenizer settings, data and training arguments
<run>/tokenizer/         spm.model, spm.vocab, tokenizer.json (pipelines.tokenizer)
<run>/model.keras        the final (checkpoint-averaged) model, loadable in a notebook
<run>/checkpoints/       periodic weights, ckpt-<step>.weights.h5, and best.weights.h5
<run>/backup/            keras.callbacks.BackupAndRestore state for resuming a killed run
<run>/logs/              TensorBoard
<run>/results.json       final metrics (validation loss, BLEU with its signature, ...)
```
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import keras

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
MODEL_FILE = "model.keras"
CHECKPOINT_DIR = "checkpoints"
BACKUP_DIR = "backup"
LOG_DIR = "logs"
RESULTS_FILE = "results.json"


def is_run_dir(path: str | Path) -> bool:
    """True if `path` holds a trained model and its tokenizer."""
    path = Path(path)
    return (path / MODEL_FILE).is_file() and (path / TOKENIZER_DIR).is_dir()


def load_run(path: str | Path):
    """Loads `(model, tokenizer)` from a run directory.

    Raises:
        FileNotFoundError: naming what is missing, if `path` is not a complete run directory.
    """
    from pipelines.tokenizer import SubwordTokenizer

    path = Path(path)
    for required in (path / MODEL_FILE, path / TOKENIZER_DIR):
        if not required.exists():
            raise FileNotFoundError(
                f"{path} is not a run directory: {required.name} is missing. Pass the --out "
                "folder of a finished `python -m keras_transformer.train` run, or a SavedModel."
            )
    import keras_transformer.model  # noqa: F401  (registers the custom layers)

    model = keras.models.load_model(path / MODEL_FILE, compile=False)
    return model, SubwordTokenizer.load(path / TOKENIZER_DIR)


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Writes `data` as JSON via a temporary file and a rename, so readers never see half."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    temporary.replace(path)


def read_json(path: str | Path) -> dict[str, Any]:
    """Reads a JSON file written by `write_json_atomic`."""
    return json.loads(Path(path).read_text())
