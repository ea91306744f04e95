"""A whole training run from Python: `run_training(config)`, what `python -m
keras_transformer.train` does (OpenNMT-tf's `Runner`; the command only parses its flags into a
`TrainConfig` and calls this).

corpus -> prepared data (shared subword vocabulary and token shards, made once:
`pipelines.prepared`) -> token-budget batches -> `model.fit` under a tf.distribute strategy
(periodic/best checkpoints, resumable backup, TensorBoard: `keras_transformer.training.fit`) ->
checkpoint averaging chosen on val (6.1, `keras_transformer.training.final_weights`; with
`--choose-by bleu` also the beam and alpha, `keras_transformer.training.val_choice`) ->
BLEU/chrF on the test split -> SavedModel export -> results.json.

Every setting and the corpus are checked before the run directory is created, so a bad
config fails at once with one `UsageError` and leaves nothing behind. Running the same config
again resumes an interrupted run from its last backup; a finished run is not trained again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.cluster.strategy import select_strategy
from keras_transformer.cluster.workers import (
    Cluster,
    ClusterFailure,
    PeerRefused,
    cluster_error,
    read_cluster,
    report_refusal,
)
from keras_transformer.decoding.translator import translate_and_score
from keras_transformer.errors import TrainingDiverged, UsageError
from keras_transformer.model.transformer import build_transformer
from keras_transformer.run_directory import run_record
from keras_transformer.serving.saved_model import export_saved_model
from keras_transformer.training import auto_plan, backup, fine_tuning, fit_jax, run_data
from keras_transformer.training.config import DEFAULT_MAX_STEPS, EvaluationConfig, TrainConfig
from keras_transformer.training.convergence import convergence_report, read_validation_losses
from keras_transformer.training.final_weights import choose_final_weights
from keras_transformer.training.fit import train_model
from keras_transformer.training.keras_backend import check_backend, finishing_command
from keras_transformer.training.losses import validation_loss
from keras_transformer.training.optimizer import cooldown_start
from keras_transformer.training.recipes import AUTO
from keras_transformer.training.step_budget import StepBudget
from keras_transformer.training.val_choice import (
    check_serving_options,
    choose_on_val_bleu,
    decoding_grid,
    describe_decoding,
)
from pipelines import storage
from pipelines.batching import make_batches
from pipelines.tokenizer import SubwordTokenizer

_LOG = logging.getLogger("keras_transformer")


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def run_training(config: TrainConfig, *, dry_run: bool = False) -> dict[str, Any]:
    """Trains, averages, scores and exports one run, as `python -m keras_transformer.train`.

    Prepares the training data once (or reuses `config.data.prepared`), resumes an interrupted
    run in `config.output.out` from its backup, stops by steps, epochs, minutes, patience or
    NaN (every worker of a `TF_CONFIG` cluster at the same step), keeps the checkpoint average
    chosen on val, scores the test split with sacreBLEU and exports a SavedModel.

    Example:
        results = kt.run_training(kt.train_config(
            recipe="multi30k", data="../shared/data/multi30k", src="de", tgt="en",
            out="runs/multi30k-de-en"))
        results["bleu"]

    Args:
        config: the run's settings (`train_config` builds one from flag names).
        dry_run: check everything, log the plan and return it as {"plan": text}, creating
            and training nothing.

    Returns:
        What results.json holds (steps, stop reason, validation losses, the averaging
        chosen, test BLEU/chrF with their signatures, the export path, ...). On a finished
        run, its results.json. On a worker other than the chief: {"step", "stop_reason",
        "chief": False}.

    Raises:
        UsageError (and the other `ValueError`s of a bad setting, corpus, run directory or
            cluster): nothing was created, or what a fresh run had created was removed; the
            other workers of a cluster are told and refuse too.
        ClusterFailure: another worker was lost; run every worker again to resume.
        TrainingDiverged: the loss became NaN (earlier checkpoints are kept).
        StorageError: the disk is full or failing: nothing was half-written, and the same
            config resumes from the last intact state once space is freed.
    """
    # One training process writes a run directory at a time (the chief's lock; the other
    # workers of a cluster write nothing there).
    lock = storage.FolderLock(config.output.out)
    try:
        return _train(config, dry_run, lock)
    finally:
        lock.release()


def _train(config: TrainConfig, dry_run: bool, lock: storage.FolderLock) -> dict[str, Any]:
    """`run_training`'s work, with the run directory's `lock` taken before anything there
    is read to be resumed or written."""
    started = time.perf_counter()
    cluster = None
    try:
        model_config = config.check()
        if not config.output.no_export:
            check_serving_options(config.evaluation)
        initial = fine_tuning.initial_run(config, model_config)  # --init-from, checked
        cluster = read_cluster()
        on_jax = config.optimization.backend == "jax"
        check_backend(config.optimization.backend)
        if on_jax:
            _keep_gpus_for_jax()
            if cluster.num_workers > 1:
                raise UsageError("--backend jax trains on one machine; several workers "
                                 "(TF_CONFIG) train with --backend tensorflow.")
        # Before any other TF work (multi-worker needs it), and before the corpora: the
        # step's budget depends on the replicas and is refused before anything is read.
        strategy = None if on_jax else select_strategy(cluster, config.cluster.join_timeout)
        if cluster.is_chief and not dry_run:  # a live run there: refused before any work
            run_directory.lock_existing_run(lock)
        budget = config.batches.budget(1 if on_jax else strategy.num_replicas_in_sync,
                                       config.data.max_length)
        if config.recipe == AUTO:
            config = auto_plan.with_clean_train(config)
        corpora = run_data.load_corpora(config)
        auto = None
        if config.recipe == AUTO:  # every setting sized to the corpus and the budget
            auto = auto_plan.plan_on_this_machine(config, corpora, strategy, cluster.num_workers,
                                                  started, say)
            config = auto.config
            model_config = config.check()
            budget = config.batches.budget(1 if on_jax else strategy.num_replicas_in_sync,
                                           config.data.max_length)
        record = run_record(config, model_config)
        if auto is not None:
            record["auto"] = auto.record
            if not dry_run:
                say(auto.describe())
        out, chief = Path(config.output.out), cluster.is_chief
        if chief:
            mode = run_directory.inspect_run_dir(out, record["identity"],
                                                 overwrite=config.output.overwrite,
                                                 resume=config.output.resume)
        else:  # the chief judges (and creates) the run directory; workers only read it
            finished = (out / run_directory.RESULTS_FILE).is_file()
            mode = "finished" if finished and not config.output.overwrite else "worker"
        prepared = scan = None
        if mode != "finished":
            # Other workers read the chief's data once it has them (it may be replacing them).
            prepared = (run_data.find_prepared(config, corpora, will_overwrite=mode == "fresh",
                                               initial=initial) if chief else None)
            if dry_run:
                plan = describe_plan(config, model_config, corpora, budget, mode, prepared)
                if auto is not None:
                    plan += "\n" + auto.describe()
                say(plan)
                return {"plan": plan}
            if prepared is None and chief:  # the one pass over the text, before anything exists
                scan = run_data.scan_training_text(config, corpora["train"], say)
    except ValueError as error:  # UsageError, RunDirError, ClusterConfigError
        raise _refused(error, cluster) from None
    if mode == "finished":
        results = run_directory.read_json(out / run_directory.RESULTS_FILE)
        say(f"{out} is already trained ({results.get('steps')} steps, BLEU "
            f"{results.get('bleu')}); pass --overwrite to train again.")
        return results

    if chief:
        try:  # held from here on (taken above if a run was there)
            run_directory.take_run_dir(lock, mode, record["identity"],
                                       overwrite=config.output.overwrite,
                                       resume=config.output.resume)
        except ValueError as error:
            raise _refused(error, cluster) from None
        if mode == "fresh":
            # Written first, so that a run killed while preparing its data is resumable.
            storage.write_json(out / run_directory.CONFIG_FILE, record)
    # Non-chief workers write their (identical) files to a scratch folder removed at the end:
    # every worker must save (variables may need collective reads), only the chief's count.
    home = out if chief else Path(tempfile.mkdtemp(prefix="keras_transformer_worker_"))
    try:
        data = run_data.training_data(config, corpora["train"], prepared, scan, cluster, say,
                                      validation=corpora["val"], initial=initial)
        run_data.copy_tokenizer(data, home)
        scan = None  # its tokenizer sample (up to a few hundred MB) is no longer needed
        if on_jax:
            outcome = fit_jax.train_model(config, record, data,
                                          fit_jax.validation(config, corpora, data, budget),
                                          budget, out, started)
        else:
            outcome = train_model(config, record, corpora, data, strategy, cluster, budget,
                                  out, home, started)
    except Exception as error:
        # A bad setting here, or another worker's refusal or loss (an aborted collective).
        failure = error if isinstance(error, ValueError | ClusterFailure) else cluster_error(
            error, cluster)
        if failure is None:
            # A write of TensorFlow's or a library's own on a full disk (TensorBoard's event
            # files): one line naming the run directory, not a traceback.
            full = storage.storage_error(error, out)
            if full is not None:  # the other workers stop with its reason, not a lost worker
                report_refusal(str(full), cluster)
            if full is not None and full is not error:
                raise full from None
            raise
        if isinstance(failure, ClusterFailure):
            raise failure from None
        if chief and mode == "fresh" and not backup.list_generations(
                out / run_directory.BACKUP_DIR):
            # Nothing half-written stays behind; but a run that has trained (a shard read
            # failing at hour 9, a worker's refusal) keeps its backups, to resume.
            run_directory.delete_run_dir(out)
        raise _refused(failure, cluster) from None
    finally:
        if not chief:
            shutil.rmtree(home, ignore_errors=True)
    if outcome["diverged"]:
        raise TrainingDiverged(
            f"the loss became NaN at step {outcome['step']}; lower --lr-scale or raise "
            f"--warmup-steps. Earlier checkpoints are in {out / run_directory.CHECKPOINT_DIR}.")
    if not chief:
        say(f"{cluster.describe()}: trained to step {outcome['step']} ({outcome['reason']}); "
            "the chief evaluates and exports")
        return {"step": outcome["step"], "stop_reason": outcome["reason"], "chief": False}
    if on_jax:  # decoding, test BLEU and the SavedModel are TensorFlow's
        lock.release()  # the finishing process takes it
        return finish_with_tensorflow(config, outcome)
    results = finish_run(config, record, corpora, outcome)
    if auto is not None:
        results["budget"] = auto_plan.budget_report(record["auto"], results, started,
                                                       outcome.get("elapsed_before", 0.0))
        storage.write_json(out / run_directory.RESULTS_FILE, results)
        _LOG.info(results["budget"]["message"])
    return results


def _refused(error: Exception, cluster: Cluster | None) -> Exception:
    """A bad setting, corpus, run directory or cluster, told to the other workers of a cluster
    (unless the refusal came from them), so that they stop with the same reason at once
    instead of waiting for this one."""
    if not isinstance(error, PeerRefused):
        report_refusal(str(error), cluster)
    return error


def describe_plan(config: TrainConfig, model_config, corpora: dict[str, Any],
                  budget: StepBudget, mode: str, prepared) -> str:
    """What a run would do (`--dry-run`); everything was checked, nothing made."""
    out = Path(config.output.out)
    resume_step = backup.newest_step(out / run_directory.BACKUP_DIR)
    run = {"fresh": "new" + (" (the existing one is deleted: --overwrite)" if out.exists() else ""),
           "resume": f"resumes an interrupted run at step {resume_step}",
           "finished": "already trained (nothing to do)",
           "worker": "written by the chief"}[mode]
    splits = "; ".join(f"{role} split {corpus.split!r}: {len(corpus):,} pairs"
                       for role in ("val", "test") if (corpus := corpora.get(role)) is not None)
    data, optimization, evaluation = config.data, config.optimization, config.evaluation
    where = run_data.prepared_dir(config)
    prepared_text = (f"found, {prepared.describe_pairs()} in {prepared.num_shards} shard(s)"
                     if prepared else f"prepared once from split {data.train_split!r} "
                     f"(vocabulary {data.vocab_size}, max length {data.max_length})")
    model = ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(model_config).items())
    steps = (f"{optimization.epochs:g} epoch(s)" if optimization.epochs
             else f"{optimization.max_steps or DEFAULT_MAX_STEPS} steps")
    return ("dry run: nothing was created or trained.\n"
            + (f"  recipe         {config.recipe} (flags given override it)\n"
               if config.recipe else "")
            + f"  run directory  {out}: {run}\n"
            f"  data           {data.data} {data.src}->{data.tgt}; {splits}\n"
            f"  prepared data  {where}: {prepared_text}\n"
            f"  model          {config.model.preset} preset: {model}\n"
            f"  step           {budget.describe()}\n"
            f"  schedule       {steps}"
            + (f" or {optimization.max_minutes:g} min" if optimization.max_minutes else "")
            + f", warmup {optimization.warmup_steps}, lr scale {optimization.lr_scale:g}, "
            f"label smoothing {optimization.label_smoothing:g}\n"
            f"  checkpoints    every {config.output.checkpoint_every} steps, the last "
            f"{evaluation.average_last} averaged; "
            + (f"test BLEU with beam {evaluation.beam}, alpha {evaluation.alpha:g}"
               if evaluation.choose_by == "loss" else _describe_bleu_choice(evaluation)))


def _describe_bleu_choice(evaluation: EvaluationConfig) -> str:
    """The dry run's words for `--choose-by bleu`."""
    beams, alphas = decoding_grid(evaluation.beam, evaluation.alpha, evaluation.val_beams,
                                  evaluation.val_alphas)
    return (f"final weights chosen by val BLEU (beam {evaluation.beam}, alpha "
            f"{evaluation.alpha:g}), then test's beam and alpha among beams "
            f"{', '.join(map(str, beams))} x alphas {', '.join(f'{a:g}' for a in alphas)}"
            + (f", on up to {evaluation.val_sentences:,} val sentences spread evenly"
               if evaluation.val_sentences else ""))


def finish_run(config: TrainConfig, record: dict[str, Any], corpora: dict[str, Any],
               outcome: dict[str, Any]) -> dict[str, Any]:
    """Writes model.keras (the weights chosen on val), scores the test split, exports the
    SavedModel, writes results.json and logs a summary; returns the results.

    `--choose-by loss` chooses the weights by exact val loss and decodes with --beam/--alpha;
    `--choose-by bleu` chooses the weights by val BLEU, then the beam and alpha of test and
    the export on val too (results.json's "decoding"). Nothing is chosen on test.

    Args:
        config: the run's settings.
        record: what the run's config.json holds.
        corpora: "val" and optionally "test" `ParallelCorpus` objects, and "data_report"
            when the splits were carved or the training pairs cleaned.
        outcome: what `keras_transformer.training.fit.train_model` returned.
    """
    run, evaluation = Path(config.output.out), config.evaluation
    started = time.perf_counter()
    tokenizer = SubwordTokenizer.load(run / run_directory.TOKENIZER_DIR)
    # The saved model is float32 whatever the training precision (the weights were float32
    # anyway): decoding and serving should not inherit a training-only choice.
    model = build_transformer(**record["model"])
    # Built once (tokenized once), iterated once per candidate.
    val_batches = make_batches(corpora["val"], tokenizer,
                               tokens_per_batch=config.batches.tokens_per_batch,
                               max_length=config.data.max_length, shuffle=False)
    smoothing = config.optimization.label_smoothing

    def val_loss(candidate) -> float:
        return validation_loss(candidate, val_batches, smoothing)

    checkpoints = run / run_directory.CHECKPOINT_DIR
    if evaluation.choose_by == "bleu":
        choice, decoding = choose_on_val_bleu(
            model, tokenizer, corpora["val"], checkpoints, outcome["best_step"], evaluation,
            outcome.get("best_step_before_cooldown"))
        # One pass, so that final_val_loss compares with that of runs chosen by loss.
        final_val_loss = val_loss(model)
        beam, alpha = decoding["beam"], decoding["alpha"]
    else:
        choice = choose_final_weights(
            model, checkpoints, outcome["best_step"], evaluation.average_last, val_loss,
            best_before_cooldown=outcome.get("best_step_before_cooldown"))
        final_val_loss, decoding = choice["val_loss"], None
        beam, alpha = evaluation.beam, evaluation.alpha
    with storage.replacing(run / run_directory.MODEL_FILE) as temporary:
        model.save(temporary)
    results: dict[str, Any] = {
        "steps": outcome["step"], "stop_reason": outcome["reason"],
        "training_seconds": round(outcome["elapsed"], 1),
        "tokens_per_sec": round(outcome["tokens_per_sec"], 1),
        "best_val_loss": outcome["best_val_loss"], "best_step": outcome["best_step"],
        "final_weights": choice["chosen"], "averaged_steps": choice["steps"],
        "final_val_loss": final_val_loss,
        "averaging": {key: choice[key] for key in ("reason", "candidates", "val_sentences")
                      if key in choice},
        **({"decoding": decoding} if decoding else {}),
        # Only when val/test were carved out of train or its noise dropped (run_data).
        **({"data_report": corpora["data_report"]} if "data_report" in corpora else {}),
        **{key: outcome[key] for key in ("precision", "loss_scale", "skipped_updates",
                                         "replicas", "workers", "jit_compile",
                                         "fused_kernels")},
    }
    # The test split of the (first) source language, then of the others of a many-to-one run.
    tests = [(role, corpus) for role, corpus in corpora.items()
             if role == "test" or role.startswith("test:")]
    test_hypotheses = None  # the test split's, for a fine-tuned run's before and after
    for role, test in tests:
        limit = config.data.test_limit or len(test)
        sources, references = test.sources[:limit], test.targets[:limit]
        _LOG.info(f"translating {len(sources)} {test.split} {test.src_lang} sentences (beam "
                  f"{beam}) ...")
        suffix = "" if role == "test" else f".{test.src_lang}"
        hypotheses, scores = translate_and_score(model, tokenizer, sources, references,
                                                 run / f"test{suffix}.hyp.txt",
                                                 beam_size=beam, alpha=alpha)
        del scores["bleu_bp"]  # bleu_details has it ("BP = ...")
        if len(tests) > 1:
            results.setdefault("test_by_source", {})[test.src_lang] = {
                key: scores[key] for key in ("bleu", "chrf", "bleu_details")}
        if role == "test":
            results.update(scores, test_split=test.split, test_sentences=len(sources),
                           beam=beam, alpha=alpha)
            test_hypotheses = hypotheses
    results["export"] = None
    if not config.output.no_export:
        base = (Path(config.output.export_dir) if config.output.export_dir
                else Path("saved_models") / Path(config.output.out).name)
        results["export"] = str(export_saved_model(model, tokenizer, base, beam_size=beam,
                                                   alpha=alpha))
    results["convergence"] = convergence_report(
        read_validation_losses(run / run_directory.LOG_DIR / "metrics.csv"),
        cooldown_from=cooldown_start(outcome.get("max_steps"), config.optimization.cooldown),
        candidates=results["averaging"]["candidates"], trained_steps=outcome["step"],
        planned_steps=outcome.get("max_steps"), stop_reason=outcome["reason"])
    if config.model.init_from:
        results["fine_tuning"] = fine_tuning.before_and_after(
            config, corpora, model, tokenizer, results, test_hypotheses, beam, alpha)
    results["evaluation_seconds"] = round(time.perf_counter() - started, 1)
    storage.write_json(run / run_directory.RESULTS_FILE, results)
    summarize(run, results)
    return results


def summarize(run: Path, results: dict[str, Any]) -> None:
    """The one-screen summary at the end of a run."""
    line = "=" * 78
    _LOG.info(f"\n{line}\ntrained {results['steps']} steps in "
        f"{results['training_seconds'] / 60:.1f} min ({results['stop_reason']}); "
        f"{results['tokens_per_sec']:.0f} target tokens/s, "
        f"{results['replicas']} replica(s), {results['precision']}, "
        f"XLA {'on' if results['jit_compile'] else 'off'}, fused kernels "
        f"{'on' if results['fused_kernels'] else 'off'}")
    if results.get("skipped_updates") is not None:
        _LOG.info(f"loss scaling: {results['skipped_updates']} of {results['steps']} updates "
            f"skipped for overflow (each still counted as a step); final loss scale "
            f"{results['loss_scale']:g}")
    if results["best_val_loss"] is not None:
        _LOG.info(f"validation loss (Keras metric, batch means averaged): best "
            f"{results['best_val_loss']:.4f} at step {results['best_step']}")
    _LOG.info(f"model.keras holds {results['averaging']['reason']}")
    if results.get("convergence"):
        _LOG.info(results["convergence"]["message"])
    if results.get("decoding"):
        _LOG.info(f"decoding: {describe_decoding(results['decoding'])}")
    if results.get("bleu") is not None:
        _LOG.info(f"test {results['test_split']} ({results['test_sentences']} sentences, beam "
            f"{results['beam']}): BLEU {results['bleu']:.2f}  chrF {results['chrf']:.2f}\n"
            f"  {results['bleu_signature']}")
    for language, scores in results.get("test_by_source", {}).items():
        _LOG.info(f"  from {language}: BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}")
    for label, path in (("run directory", run), ("model", run / run_directory.MODEL_FILE),
                        ("results", run / run_directory.RESULTS_FILE),
                        ("translations", run / "test.hyp.txt"),
                        ("SavedModel", results.get("export")),
                        ("metrics", run / run_directory.LOG_DIR / "metrics.csv"),
                        ("TensorBoard", f"tensorboard --logdir {run / run_directory.LOG_DIR}"
                         if importlib.util.find_spec("tensorboard") else None)):
        if path and (not isinstance(path, Path) or path.exists()):
            _LOG.info(f"{label:<14} {path}")
    _LOG.info(line)


def finish_with_tensorflow(config: TrainConfig, outcome: dict[str, Any]) -> dict[str, Any]:
    """Ends a JAX run (`--backend jax`): the same command with `--backend tensorflow`
    (`keras_backend.finishing_command`) finds it trained, and averages, scores and exports it
    in a TensorFlow process. Returns the run's results.

    Raises:
        UsageError: the finishing command failed (its output was shown).
    """
    command = finishing_command(config, outcome["precision"], outcome["step"])
    shown = shlex.join(["python", *command[1:]])
    say(f"trained on JAX; averaging, scoring and exporting under TensorFlow: {shown}")
    status = subprocess.run(command, env={**os.environ, "KERAS_BACKEND": "tensorflow"}
                            ).returncode
    if status != 0:
        raise UsageError(f"finishing the JAX run under TensorFlow failed (exit {status}); "
                         f"run it again: {shown}")
    return run_directory.read_json(Path(config.output.out) / run_directory.RESULTS_FILE)


def _keep_gpus_for_jax() -> None:
    """Under --backend jax TensorFlow only prepares the input here: it must not take the
    GPUs' memory, which it reserves when it first runs an op on them."""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow has run on them already: too late to hide them
        pass
