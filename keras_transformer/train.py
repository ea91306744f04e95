"""Train a Transformer end to end: `python -m keras_transformer.train --help`.

corpus -> prepared data (shared subword vocabulary and token shards, made once:
`pipelines.prepared`) -> token-budget batches -> `model.fit` under a tf.distribute strategy
(periodic/best checkpoints, resumable backup, TensorBoard) -> the average of the last N
checkpoints -> BLEU/chrF on the test split -> SavedModel export.

Every flag and the corpus are validated before the run directory is created, so a bad
command fails at once with one line and exit status 2 and leaves nothing behind. Running
the same command again resumes an interrupted run from its last backup.

Keras "epochs" here are fixed intervals of optimizer steps over an endless, seeded batch
stream (see `keras_transformer.callbacks`), which is what makes mid-run resumption exact.
With gradient accumulation (`--accumulate`, `--tokens-per-step`) Keras' steps are
micro-batches, `accumulate` of them per optimizer step (`keras_transformer.accumulation`).
"""

from __future__ import annotations

import os

# Before TensorFlow loads (the imports below load it): in a cluster, its C++ log repeats in a
# screen of lines what this command reports in one (a lost worker, a worker that did not come
# up). TF_CPP_MIN_LOG_LEVEL=0 shows it again.
if os.environ.get("TF_CONFIG"):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse
import dataclasses
import importlib.util
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keras_transformer import artifacts, run_data
from keras_transformer.cluster import (
    Cluster,
    ClusterFailure,
    PeerRefused,
    cluster_error,
    read_cluster,
    report_refusal,
)
from keras_transformer.train_flags import (
    DEFAULT_MAX_STEPS,
    StepBudget,
    UsageError,
    parse_args,
    step_budget,
    validate_args,
)

EXIT_WORKER_LOST = 3  # another worker was lost: restart every worker to resume


def say(*parts: Any) -> None:
    print(*parts, flush=True)



def run_config(args: argparse.Namespace, model_config) -> dict[str, Any]:
    """What config.json records. `identity` must match for a resume to be allowed."""
    model = {"preset": args.preset, **dataclasses.asdict(model_config)}
    identity = {
        "data": args.data, "src": args.src, "tgt": args.tgt, "train_split": args.train_split,
        "prepared": args.prepared, "tokenizer_sample": args.tokenizer_sample,
        "model": model, "tokens_per_batch": args.tokens_per_batch,
        "accumulate": args.accumulate, "tokens_per_step": args.tokens_per_step,
        "max_length": args.max_length, "label_smoothing": args.label_smoothing,
        "warmup_steps": args.warmup_steps, "lr_scale": args.lr_scale, "seed": args.seed,
        "checkpoint_every": args.checkpoint_every,
        "validate_every": args.validate_every or args.checkpoint_every,
    }
    return {"identity": identity, "model": model, "arguments": vars(args).copy()}


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    run_data.log_pipelines_to_stdout()
    cluster = None
    try:
        model_config = validate_args(args)
        cluster = read_cluster()
        from keras_transformer import distribution

        # Before any other TF work (multi-worker needs it), and before the corpora: the
        # step's budget depends on the replicas and is refused before anything is read.
        strategy = distribution.select_strategy(cluster, args.join_timeout)
        budget = step_budget(args, strategy.num_replicas_in_sync)
        corpora = run_data.load_corpora(args)
        config = run_config(args, model_config)
        chief = cluster.is_chief
        if chief:
            mode = artifacts.inspect_run_dir(args.out, config["identity"],
                                             overwrite=args.overwrite, resume=args.resume)
        else:  # the chief judges (and creates) the run directory; workers only read it
            finished = (Path(args.out) / artifacts.RESULTS_FILE).is_file()
            mode = "finished" if finished and not args.overwrite else "worker"
        prepared = scan = None
        if mode != "finished":
            # Other workers read the chief's data once it has them (it may be replacing them).
            prepared = (run_data.find_prepared(args, corpora, will_overwrite=mode == "fresh")
                        if chief else None)
            if args.dry_run:
                dry_run(args, model_config, corpora, budget, mode, prepared)
                return 0
            if prepared is None and chief:  # the one pass over the text, before anything exists
                scan = run_data.scan_training_text(args, corpora["train"], say)
    except ValueError as error:  # UsageError, RunDirError, ClusterConfigError
        return refuse(error, cluster)
    out = Path(args.out)
    if mode == "finished":
        results = artifacts.read_json(out / artifacts.RESULTS_FILE)
        say(f"{out} is already trained ({results.get('steps')} steps, BLEU "
            f"{results.get('bleu')}); pass --overwrite to train again.")
        return 0

    if chief:
        if mode == "fresh" and out.exists():
            shutil.rmtree(out)  # --overwrite of a run directory (checked above)
        out.mkdir(parents=True, exist_ok=True)
        if mode == "fresh":
            # Written first, so that a run killed while preparing its data is resumable.
            artifacts.write_json_atomic(out / artifacts.CONFIG_FILE, config)
    # Non-chief workers write their (identical) files to a scratch folder removed at the end:
    # every worker must save (variables may need collective reads), only the chief's count.
    home = out if chief else Path(tempfile.mkdtemp(prefix="keras_transformer_worker_"))
    try:
        data = run_data.training_data(args, corpora["train"], prepared, scan, cluster, say)
        run_data.copy_tokenizer(data, home)
        scan = None  # its tokenizer sample (up to a few hundred MB) is no longer needed
        outcome = train_model(args, config, corpora, data, strategy, cluster, budget, out,
                              home, started)
    except Exception as error:
        # A bad setting here, or another worker's refusal or loss (an aborted collective).
        failure = error if isinstance(error, ValueError | ClusterFailure) else cluster_error(
            error, cluster)
        if failure is None:
            raise
        if isinstance(failure, ClusterFailure):
            print(f"error: {failure}", file=sys.stderr)
            return EXIT_WORKER_LOST
        if chief and mode == "fresh":
            shutil.rmtree(out, ignore_errors=True)  # nothing half-written stays behind
        return refuse(failure, cluster)
    finally:
        if not chief:
            shutil.rmtree(home, ignore_errors=True)
    if outcome["diverged"]:
        print(f"error: the loss became NaN at step {outcome['step']}; lower --lr-scale or raise "
              f"--warmup-steps. Earlier checkpoints are in {out / artifacts.CHECKPOINT_DIR}.",
              file=sys.stderr)
        return 1
    if not chief:
        say(f"{cluster.describe()}: trained to step {outcome['step']} ({outcome['reason']}); "
            "the chief evaluates and exports")
        return 0
    return finish(args, config, corpora, outcome)


def refuse(error: Exception, cluster: Cluster | None) -> int:
    """Reports a bad command, corpus, run directory or cluster: one line, exit status 2.

    The other workers of a cluster are told (unless the refusal came from them), so that
    they exit with the same reason at once instead of waiting for this one.
    """
    if not isinstance(error, PeerRefused):
        report_refusal(str(error), cluster)
    print(f"error: {error}", file=sys.stderr)
    return 2


def dry_run(args: argparse.Namespace, model_config, corpora: dict[str, Any], budget: StepBudget,
            mode: str, prepared) -> None:
    """Prints what the command would do (`--dry-run`); everything was checked, nothing made."""
    out = Path(args.out)
    backup_state = out / artifacts.BACKUP_DIR / "state.json"
    resume_step = (artifacts.read_json(backup_state).get("step", 0)
                   if backup_state.is_file() else 0)
    run = {"fresh": "new" + (" (the existing one is deleted: --overwrite)" if out.exists() else ""),
           "resume": f"resumes an interrupted run at step {resume_step}",
           "finished": "already trained (nothing to do)",
           "worker": "written by the chief"}[mode]
    splits = "; ".join(f"{role} split {corpus.split!r}: {len(corpus):,} pairs"
                       for role in ("val", "test") if (corpus := corpora.get(role)) is not None)
    where = run_data.prepared_dir(args)
    data = (f"found, {prepared.pairs:,} pairs in {prepared.num_shards} shard(s)" if prepared
            else f"prepared once from split {args.train_split!r} (vocabulary {args.vocab_size}, "
            f"max length {args.max_length})")
    model = ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(model_config).items())
    steps = (f"{args.epochs:g} epoch(s)" if args.epochs
             else f"{args.max_steps or DEFAULT_MAX_STEPS} steps")
    say("dry run: nothing was created or trained.\n"
        + (f"  recipe         {args.recipe} (flags given override it)\n" if args.recipe else "")
        + f"  run directory  {out}: {run}\n"
        f"  data           {args.data} {args.src}->{args.tgt}; {splits}\n"
        f"  prepared data  {where}: {data}\n"
        f"  model          {args.preset} preset: {model}\n"
        f"  step           {budget.describe()}\n"
        f"  schedule       {steps}"
        + (f" or {args.max_minutes:g} min" if args.max_minutes else "")
        + f", warmup {args.warmup_steps}, lr scale {args.lr_scale:g}, label smoothing "
        f"{args.label_smoothing:g}\n"
        f"  checkpoints    every {args.checkpoint_every} steps, the last {args.average_last} "
        f"averaged; test BLEU with beam {args.beam}, alpha {args.alpha:g}")


def train_model(args: argparse.Namespace, config: dict[str, Any], corpora: dict[str, Any],
                prepared, strategy, cluster: Cluster, budget: StepBudget, out: Path,
                home: Path, started: float) -> dict[str, Any]:
    """Pipelines, model and `model.fit`; returns what `finish` reports.

    `cluster` is the `TF_CONFIG` cluster `strategy` spans; `budget` spreads each optimizer
    step over replicas and accumulated micro-batches; Keras steps are micro-batches, every other count (schedule, checkpoints, resume) is of
    optimizer steps. `out` is the run directory (read for resuming), `home` where this
    worker writes (`out` on the chief, a scratch folder on other workers), `started` when
    the command started.
    """
    import keras
    import tensorflow as tf

    from keras_transformer import callbacks as cb
    from keras_transformer import distribution
    from keras_transformer.cluster import any_worker, check_same_settings
    from keras_transformer.kernels import fused_kernels
    from keras_transformer.loss_scaling import LossScaleOptimizer
    from keras_transformer.losses import MaskedAccuracy, Perplexity
    from keras_transformer.model import build_transformer
    from keras_transformer.precision import gpu_capabilities, resolve_jit, resolve_precision
    from keras_transformer.schedule import paper_adam
    from pipelines.batching import make_batches, xla_bucket_boundaries

    keras.utils.set_random_seed(args.seed)
    gpus = len(tf.config.list_logical_devices("GPU"))
    precision = resolve_precision(args.precision, gpu_capabilities())
    jit = resolve_jit(args.jit_compile, gpus)
    fused = not jit and fused_kernels() is not None  # XLA-compiled steps use TF ops
    replicas, accumulate = strategy.num_replicas_in_sync, budget.accumulate
    # XLA compiles one step per batch shape: coarser buckets, every batch padded to its
    # bucket's full shape (pipelines.batching.xla_bucket_boundaries).
    shapes = dict(bucket_boundaries=xla_bucket_boundaries(args.max_length),
                  static_shapes=True) if jit else {}
    if jit:
        config["train_batch_shapes"] = len(prepared.static_shapes(
            budget.micro_batch, args.max_length, bucket_boundaries=shapes["bucket_boundaries"]))
        say(f"XLA: the training batches come in {config['train_batch_shapes']} shapes (each "
            "compiled once)")
    tokenizer = prepared.tokenizer()
    config.update(precision=precision, jit_compile=jit, replicas=replicas,
                  step_budget={**dataclasses.asdict(budget),
                               "tokens_per_step": budget.tokens_per_step},
                  tokenizer_vocab_size=tokenizer.vocab_size,
                  prepared={"directory": str(prepared.directory.resolve()),
                            "corpus_fingerprint": prepared.manifest["corpus_fingerprint"],
                            "pairs": prepared.pairs, "shards": prepared.num_shards})
    check_same_settings({**config["identity"], **{key: config[key] for key in (
        "precision", "jit_compile", "replicas", "step_budget")}}, cluster, args.join_timeout)
    run_data.check_resumed_data(out, config)
    artifacts.write_json_atomic(home / artifacts.CONFIG_FILE, config)

    with strategy.scope():
        model = build_transformer(**config["model"], dtype=precision)
        optimizer = paper_adam(model.config.d_model, args.warmup_steps, args.lr_scale)
        if precision == "mixed_float16":  # steps skipped on overflow still count as steps
            optimizer = LossScaleOptimizer(optimizer, initial_scale=args.initial_loss_scale)
        model.compile(
            optimizer=optimizer,
            loss=distribution.GlobalTokenCrossEntropy(args.label_smoothing),
            metrics=[MaskedAccuracy(), Perplexity(), cb.TokenCount()],
            jit_compile=jit,
            accumulate_steps=accumulate,
        )
        if not model.optimizer.built:  # (accumulation builds it; building twice duplicates)
            model.optimizer.build(model.trainable_variables)
    # Resume: every worker restores the chief's backup (a shared filesystem is assumed).
    backup = out / artifacts.BACKUP_DIR / "latest.weights.h5"
    state: dict[str, Any] = {}
    if backup.is_file():
        model.load_weights(backup)
        if (out / artifacts.BACKUP_DIR / "state.json").is_file():
            state = artifacts.read_json(out / artifacts.BACKUP_DIR / "state.json")
    step = cb.global_step(model)
    if state and state.get("step") != step:  # e.g. an optimizer whose variables changed
        raise UsageError(f"{backup} holds step {step}, {out / artifacts.BACKUP_DIR} says "
                         f"{state.get('step')}: the backup does not match this run's settings")

    batching = dict(tokenizer=tokenizer, tokens_per_batch=budget.global_micro_batch,
                    max_length=args.max_length, seed=args.seed, **shapes)
    contexts: list[tf.distribute.InputContext] = []

    def train_batches(context: tf.distribute.InputContext) -> tf.data.Dataset:
        contexts.append(context)
        # The stream is seeded and its shards' batch counts known, so a resumed run starts
        # exactly where the interrupted one was, reading one shard (no replay).
        per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
        return prepared.batches(tokens_per_batch=budget.global_micro_batch,
                                max_length=args.max_length, seed=args.seed,
                                input_context=context,
                                skip_batches=step * accumulate * per_pipeline, **shapes)

    train_data = strategy.distribute_datasets_from_function(train_batches)
    context = contexts[0]
    per_pipeline = context.num_replicas_in_sync // context.num_input_pipelines
    # Every worker must run the same number of validation steps (collectives), so all take
    # the longest shard's count, padding the others from the (repeated) stream.
    val_steps = max(
        math.ceil(_count(make_batches(corpora["val"], shuffle=False, input_context=tf.distribute
                                      .InputContext(context.num_input_pipelines, pipeline,
                                                    context.num_replicas_in_sync), **batching))
                  / per_pipeline)
        for pipeline in range(context.num_input_pipelines)
    )
    # One pass (repeat=True would fill partial buckets from further passes), wrapped around
    # only to give every worker the same number of batches.
    val_data = strategy.distribute_datasets_from_function(
        lambda ctx: make_batches(corpora["val"], shuffle=False, input_context=ctx, **batching)
        .repeat().take(val_steps * per_pipeline))

    if args.epochs:  # micro-batches of one replica per epoch, over replicas x accumulate
        micro_batches = sum(len(ends) for ends in prepared.shard_batches(
            budget.micro_batch, args.max_length, bucket_boundaries=shapes.get("bucket_boundaries")))
        max_steps = max(1, math.ceil(args.epochs * micro_batches / (replicas * accumulate)))
    else:
        max_steps = args.max_steps or DEFAULT_MAX_STEPS
    validate_every = args.validate_every or args.checkpoint_every
    interval = math.gcd(args.checkpoint_every, validate_every)
    stopper = cb.StopAt(max_steps, args.max_minutes * 60 if args.max_minutes else None,
                        elapsed_before=float(state.get("elapsed_seconds", 0.0)))
    throughput = cb.ThroughputLogger()
    checkpointer = cb.RunCheckpointer(
        home / artifacts.CHECKPOINT_DIR, home / artifacts.BACKUP_DIR, args.checkpoint_every,
        keep=args.average_last, patience=args.patience, stopper=stopper, state=state)
    (home / artifacts.LOG_DIR).mkdir(parents=True, exist_ok=True)
    callbacks = [cb.FirstStepTimer(started, say), stopper, throughput, checkpointer,
                 keras.callbacks.TerminateOnNaN(),
                 keras.callbacks.CSVLogger(str(home / artifacts.LOG_DIR / "metrics.csv"),
                                           append=True)]
    if importlib.util.find_spec("tensorboard") is not None:
        callbacks.append(keras.callbacks.TensorBoard(str(home / artifacts.LOG_DIR)))
    else:  # tf.summary needs the tensorboard package; the CSV log has the same numbers
        say("note: tensorboard is not installed; metrics go to logs/metrics.csv only")
    # Last: every stop is taken by all workers together, between optimizer updates.
    agree = any_worker(strategy) or bool
    callbacks.append(cb.AgreedStop(agree, stopper))
    say(f"training {model.count_params():,} parameters ({args.preset} preset, vocabulary "
        f"{tokenizer.vocab_size}) on {prepared.pairs:,} pairs: {budget.describe()}; "
        f"{precision}, XLA {'on' if jit else 'off'}, steps {step} -> {max_steps}; one Keras "
        f"epoch = {interval} steps" + (f" = {interval * accumulate} micro-batches"
                                       if accumulate > 1 else ""))
    distribution.build_for_distributed_fit(
        model, next(iter(make_batches(corpora["val"], shuffle=False, **batching))))
    # A run that already ended (but was killed while evaluating) is not trained further.
    # (Agreed, as every stop: workers given different --max-minutes could disagree.)
    done = agree(bool(step >= max_steps or state.get("stopped_early") or (
        stopper.max_seconds is not None and stopper.elapsed_before >= stopper.max_seconds)))
    if not done:
        model.fit(
            train_data, epochs=math.ceil(max_steps / interval), initial_epoch=step // interval,
            steps_per_epoch=interval * accumulate, validation_data=val_data,
            validation_freq=validate_every // interval, callbacks=callbacks,
            verbose=args.verbose if args.verbose is not None else ("auto" if sys.stdout.isatty()
                                                                  else 2),
        )
    step = cb.global_step(model)
    return {
        "step": step, "diverged": checkpointer.diverged,
        "reason": stopper.reason or state.get("stop_reason") or f"reached step {step}",
        "elapsed": stopper.elapsed if not done else stopper.elapsed_before,
        "tokens_per_sec": throughput.total_tokens / max(throughput.total_seconds, 1e-9),
        "best_val_loss": checkpointer.best_val_loss
        if math.isfinite(checkpointer.best_val_loss) else None,
        "best_step": checkpointer.best_step, "replicas": replicas,
        "workers": cluster.num_workers,
        "precision": precision, "jit_compile": jit,
        "fused_kernels": fused, **loss_scaling_state(model.optimizer),
    }


def loss_scaling_state(optimizer) -> dict[str, Any]:
    """The loss scale and the updates it skipped (mixed_float16), else None for both."""
    if not hasattr(optimizer, "skipped_updates"):
        return {"loss_scale": None, "skipped_updates": None}
    return {"loss_scale": float(optimizer.dynamic_scale.numpy()),
            "skipped_updates": int(optimizer.skipped_updates.numpy())}


def _count(dataset) -> int:
    """Number of elements of a finite dataset."""
    return int(dataset.reduce(0, lambda count, _: count + 1))


def evaluate_loss(model, tokenizer, corpus, args: argparse.Namespace) -> float:
    """Label-smoothed cross-entropy per target token of `model` on `corpus` (exact token mean)."""
    from keras_transformer.losses import masked_token_loss_sum
    from pipelines.batching import make_batches

    total = tokens = 0.0
    for features, labels in make_batches(corpus, tokenizer, tokens_per_batch=args.tokens_per_batch,
                                         max_length=args.max_length, shuffle=False):
        loss_sum, count = masked_token_loss_sum(labels, model(features, training=False),
                                                args.label_smoothing, differentiable=False)
        total += float(loss_sum)
        tokens += float(count)
    return total / max(tokens, 1.0)


def translate_and_score(model, tokenizer, sources: list[str], references: list[str],
                        args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Beam-search translations of `sources` and their sacreBLEU/chrF against `references`."""
    from keras_transformer.evaluate import score, translate_texts

    hypotheses = translate_texts(model, tokenizer, sources, beam_size=args.beam, alpha=args.alpha)
    return score(hypotheses, references), hypotheses


def export(model, tokenizer, args: argparse.Namespace) -> Path | None:
    """The SavedModel export into --export-dir (default saved_models/<run name>)."""
    from keras_transformer.export import export_saved_model

    base = Path(args.export_dir) if args.export_dir else Path("saved_models") / Path(args.out).name
    return Path(export_saved_model(model, tokenizer, base, beam_size=args.beam, alpha=args.alpha))


def finish(args: argparse.Namespace, config: dict, corpora: dict, outcome: dict) -> int:
    """Average checkpoints into model.keras, score the test split, export, summarize."""
    from keras_transformer.final_model import choose_final_weights
    from keras_transformer.model import build_transformer
    from pipelines.tokenizer import SubwordTokenizer

    run = Path(args.out)
    started = time.perf_counter()
    tokenizer = SubwordTokenizer.load(run / artifacts.TOKENIZER_DIR)
    # The saved model is float32 whatever the training precision (the weights were float32
    # anyway): decoding and serving should not inherit a training-only choice.
    model = build_transformer(**config["model"])
    choice = choose_final_weights(
        model, run / artifacts.CHECKPOINT_DIR, outcome["best_step"], args.average_last,
        lambda candidate: evaluate_loss(candidate, tokenizer, corpora["val"], args))
    model.save(run / artifacts.MODEL_FILE)
    results: dict[str, Any] = {
        "steps": outcome["step"], "stop_reason": outcome["reason"],
        "training_seconds": round(outcome["elapsed"], 1),
        "tokens_per_sec": round(outcome["tokens_per_sec"], 1),
        "best_val_loss": outcome["best_val_loss"], "best_step": outcome["best_step"],
        "final_weights": choice["chosen"], "averaged_steps": choice["steps"],
        "final_val_loss": choice["val_loss"],
        "averaging": {key: choice[key] for key in ("reason", "candidates")},
        **{key: outcome[key] for key in ("precision", "loss_scale", "skipped_updates",
                                         "replicas", "workers", "jit_compile",
                                         "fused_kernels")},
    }
    test = corpora.get("test")
    if test is not None:
        limit = args.test_limit or len(test)
        sources, references = test.sources[:limit], test.targets[:limit]
        say(f"translating {len(sources)} {test.split} sentences (beam {args.beam}) ...")
        scores, hypotheses = translate_and_score(model, tokenizer, sources, references, args)
        (run / "test.hyp.txt").write_text("".join(line + "\n" for line in hypotheses))
        results.update(scores, test_split=test.split, test_sentences=len(sources),
                       beam=args.beam, alpha=args.alpha)
    export_path = None if args.no_export else export(model, tokenizer, args)
    results["export"] = None if export_path is None else str(export_path)
    results["evaluation_seconds"] = round(time.perf_counter() - started, 1)
    artifacts.write_json_atomic(run / artifacts.RESULTS_FILE, results)
    summarize(run, results)
    return 0


def summarize(run: Path, results: dict[str, Any]) -> None:
    """The one-screen summary at the end of a run."""
    line = "=" * 78
    say(f"\n{line}\ntrained {results['steps']} steps in {results['training_seconds'] / 60:.1f} "
        f"min ({results['stop_reason']}); {results['tokens_per_sec']:.0f} target tokens/s, "
        f"{results['replicas']} replica(s), {results['precision']}, "
        f"XLA {'on' if results['jit_compile'] else 'off'}, fused kernels "
        f"{'on' if results['fused_kernels'] else 'off'}")
    if results.get("skipped_updates") is not None:
        say(f"loss scaling: {results['skipped_updates']} of {results['steps']} updates skipped "
            f"for overflow (each still counted as a step); final loss scale "
            f"{results['loss_scale']:g}")
    if results["best_val_loss"] is not None:
        say(f"validation loss (Keras metric, batch means averaged): best "
            f"{results['best_val_loss']:.4f} at step {results['best_step']}")
    say(f"model.keras holds {results['averaging']['reason']}")
    if results.get("bleu") is not None:
        say(f"test {results['test_split']} ({results['test_sentences']} sentences, beam "
            f"{results['beam']}): BLEU {results['bleu']:.2f}  chrF {results['chrf']:.2f}\n"
            f"  {results['bleu_signature']}")
    for label, path in (("run directory", run), ("model", run / artifacts.MODEL_FILE),
                        ("results", run / artifacts.RESULTS_FILE),
                        ("translations", run / "test.hyp.txt"),
                        ("SavedModel", results.get("export")),
                        ("metrics", run / artifacts.LOG_DIR / "metrics.csv"),
                        ("TensorBoard", f"tensorboard --logdir {run / artifacts.LOG_DIR}"
                         if importlib.util.find_spec("tensorboard") else None)):
        if path and (not isinstance(path, Path) or path.exists()):
            say(f"{label:<14} {path}")
    say(line)


if __name__ == "__main__":
    status = main()
    if status == EXIT_WORKER_LOST:
        # Aborted collectives leave TensorFlow unusable, and tearing it down waits for the
        # input pipeline's threads (22 s measured on Multi30k): leave now, within the bound.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
