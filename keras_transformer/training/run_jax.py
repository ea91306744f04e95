"""A JAX run where TensorFlow is not installed (a GPU machine): `train --backend jax --prepared
DIR`, from a folder prepared elsewhere.

Everything that needs no TensorFlow, as `run.run_training` does it: the run directory
(refused, resumed or finished as there), training from the prepared shards
(`fit_jax.train_model`), validation by exact loss on the folder's val split, backups and
resume, and the weights chosen on val loss (6.1's averages or the best checkpoint) in
model.keras. Decoding, test BLEU and the SavedModel are TensorFlow's: the run ends with one
line naming the command that finishes it on a machine with TensorFlow (the same flags with
`--backend tensorflow`; it finds the run trained and only finishes it).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.errors import TrainingDiverged, UsageError
from keras_transformer.model.transformer import build_transformer
from keras_transformer.training import auto_plan, fine_tuning, fit_jax, prepared_checks
from keras_transformer.training.config import TrainConfig
from keras_transformer.training.final_weights import choose_final_weights
from keras_transformer.training.keras_backend import check_backend, finishing_command
from keras_transformer.training.losses import validation_loss
from keras_transformer.training.recipes import AUTO
from pipelines import storage
from pipelines.prepared_folder import PreparedFolder

_LOG = logging.getLogger("keras_transformer")


def train_prepared_on_jax(config: TrainConfig, say: Callable[..., None] = print
                          ) -> dict[str, Any]:
    """Trains `config` on JAX from `config.data.prepared`, without TensorFlow.

    Returns:
        What training reports (steps, stop reason, best val loss, the weights chosen), with
        "finished": False and "finish_command": the command that scores and exports the run.

    Raises:
        UsageError: no --prepared folder, a damaged one, or a bad setting or run directory
            (another training run writing it, too: `run.run_training`'s lock).
    """
    lock = storage.FolderLock(config.output.out)
    try:
        return _train(config, say, lock)
    finally:
        lock.release()


def _train(config: TrainConfig, say: Callable[..., None], lock: storage.FolderLock
           ) -> dict[str, Any]:
    started = time.perf_counter()
    check_backend("jax")
    if not config.data.prepared:
        raise UsageError("without TensorFlow, --backend jax trains from a folder prepared on "
                         "a machine with TensorFlow: pass --prepared DIR (made by python -m "
                         "keras_transformer.prepare).")
    plan = None
    if config.recipe == AUTO:  # planned where TensorFlow read the corpus, or refused
        plan = auto_plan.recorded_plan(config)
        if plan is None:
            raise UsageError("--recipe auto counts the corpus, which needs TensorFlow: start "
                             "the run on a machine with it (or take the settings its --dry-run "
                             "prints, with --budget-steps); a run planned there resumes here")
        config = plan.config
    model_config = config.check()
    folder = PreparedFolder.load(config.data.prepared)
    folder.verify()
    # What run.py checks too, before the run directory is touched: the folder's settings
    # (and, fine-tuning, the old run's architecture and tokenizer), the validation split.
    prepared_checks.check_prepared(config, folder, fine_tuning.initial_run(config, model_config))
    budget = config.batches.budget(1, config.data.max_length)
    validation = fit_jax.validation(config, None, folder, budget)
    record = run_directory.run_record(config, model_config)
    if plan is not None:  # config.json is written again: its plan stays in it
        record["auto"] = plan.record
    out = Path(config.output.out)
    run_directory.lock_existing_run(lock)
    mode = run_directory.inspect_run_dir(out, record["identity"],
                                         overwrite=config.output.overwrite,
                                         resume=config.output.resume)
    if mode == "finished":
        return run_directory.read_json(out / run_directory.RESULTS_FILE)
    run_directory.take_run_dir(lock, mode, record["identity"],
                               overwrite=config.output.overwrite, resume=config.output.resume)
    if mode == "fresh":  # written first, so that a run stopped from here on is resumable
        storage.write_json(out / run_directory.CONFIG_FILE, record)
    _copy_tokenizer(folder, out)  # the finishing command decodes with it
    outcome = fit_jax.train_model(config, record, folder, validation, budget, out, started)
    if outcome["diverged"]:
        raise TrainingDiverged(
            f"the loss became NaN at step {outcome['step']}; lower --lr-scale or raise "
            f"--warmup-steps. Earlier checkpoints are in {out / run_directory.CHECKPOINT_DIR}.")
    model = build_transformer(**record["model"])
    smoothing = config.optimization.label_smoothing
    choice = choose_final_weights(
        model, out / run_directory.CHECKPOINT_DIR, outcome["best_step"],
        config.evaluation.average_last,
        lambda candidate: validation_loss(candidate, validation, smoothing),
        best_before_cooldown=outcome.get("best_step_before_cooldown"))
    with storage.replacing(out / run_directory.MODEL_FILE) as temporary:
        model.save(temporary)
    command = finishing_command(config, outcome["precision"], outcome["step"])
    say(f"trained to step {outcome['step']} ({outcome['reason']}) on JAX; model.keras holds "
        f"{choice['reason']}.\nTo choose the decoding, score test BLEU and export, run on a "
        f"machine with TensorFlow (the same command, --backend tensorflow):\n"
        f"{shlex.join(['python', *command[1:]])}")
    return {**outcome, "final_weights": choice["chosen"], "averaged_steps": choice["steps"],
            "final_val_loss": choice["val_loss"], "finished": False,
            "finish_command": shlex.join(["python", *command[1:]])}


def _copy_tokenizer(folder: PreparedFolder, out: Path) -> None:
    """The folder's tokenizer into the run directory, whole or not at all (copied beside it,
    then renamed); a resumed run's must be the folder's.

    Raises:
        UsageError: the run directory holds another tokenizer.
    """
    source, target = folder.directory / run_directory.TOKENIZER_DIR, out / run_directory.TOKENIZER_DIR
    model_file = "spm.model"
    if (target / model_file).is_file():
        if (target / model_file).read_bytes() != (source / model_file).read_bytes():
            raise UsageError(f"{target} differs from {source}: this run was trained with another "
                             "vocabulary; use its original --prepared")
        return
    staging = out / f".{run_directory.TOKENIZER_DIR}.partial"
    with storage.errors_about(out):
        for stale in (staging, target):  # a copy cut short earlier
            if stale.exists():
                shutil.rmtree(stale)
        shutil.copytree(source, staging)
        os.replace(staging, target)
