"""Train a Transformer end to end: `python -m keras_transformer.train --help`.

corpus -> prepared data (shared subword vocabulary and token shards, made once:
`pipelines.prepared`) -> token-budget batches -> `model.fit` under a tf.distribute strategy
(periodic/best checkpoints, resumable backup, TensorBoard: `keras_transformer.training.fit`) ->
checkpoint averaging chosen on val -> BLEU/chrF on the test split -> SavedModel export
(`keras_transformer.training.final_weights`). This module is the command line over those.

Every flag and the corpus are validated before the run directory is created, so a bad
command fails at once with one line and exit status 2 and leaves nothing behind. Running
the same command again resumes an interrupted run from its last backup.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.cluster.workers import (
    Cluster,
    ClusterFailure,
    PeerRefused,
    cluster_error,
    read_cluster,
    report_refusal,
)
from keras_transformer.flags import (
    DEFAULT_MAX_STEPS,
    StepBudget,
    parse_args,
    step_budget,
    validate_args,
)
from keras_transformer.logs import show_project_logs, stop_cli_logging
from keras_transformer.training import run_data

EXIT_WORKER_LOST = 3  # another worker was lost: restart every worker to resume


def say(*parts: Any) -> None:
    print(*parts, flush=True)



def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    show_project_logs()
    cluster = None
    try:
        model_config = validate_args(args)
        cluster = read_cluster()
        from keras_transformer.cluster import strategy as distribution

        # Before any other TF work (multi-worker needs it), and before the corpora: the
        # step's budget depends on the replicas and is refused before anything is read.
        strategy = distribution.select_strategy(cluster, args.join_timeout)
        budget = step_budget(args, strategy.num_replicas_in_sync)
        corpora = run_data.load_corpora(args)
        from keras_transformer.training.fit import run_config

        config = run_config(args, model_config)
        chief = cluster.is_chief
        if chief:
            mode = run_directory.inspect_run_dir(args.out, config["identity"],
                                             overwrite=args.overwrite, resume=args.resume)
        else:  # the chief judges (and creates) the run directory; workers only read it
            finished = (Path(args.out) / run_directory.RESULTS_FILE).is_file()
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
        results = run_directory.read_json(out / run_directory.RESULTS_FILE)
        say(f"{out} is already trained ({results.get('steps')} steps, BLEU "
            f"{results.get('bleu')}); pass --overwrite to train again.")
        return 0

    if chief:
        if mode == "fresh" and out.exists():
            shutil.rmtree(out)  # --overwrite of a run directory (checked above)
        out.mkdir(parents=True, exist_ok=True)
        if mode == "fresh":
            # Written first, so that a run killed while preparing its data is resumable.
            run_directory.write_json_atomic(out / run_directory.CONFIG_FILE, config)
    # Non-chief workers write their (identical) files to a scratch folder removed at the end:
    # every worker must save (variables may need collective reads), only the chief's count.
    home = out if chief else Path(tempfile.mkdtemp(prefix="keras_transformer_worker_"))
    try:
        data = run_data.training_data(args, corpora["train"], prepared, scan, cluster, say)
        run_data.copy_tokenizer(data, home)
        scan = None  # its tokenizer sample (up to a few hundred MB) is no longer needed
        from keras_transformer.training.fit import train_model

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
              f"--warmup-steps. Earlier checkpoints are in {out / run_directory.CHECKPOINT_DIR}.",
              file=sys.stderr)
        return 1
    if not chief:
        say(f"{cluster.describe()}: trained to step {outcome['step']} ({outcome['reason']}); "
            "the chief evaluates and exports")
        return 0
    from keras_transformer.training.final_weights import finish_run

    finish_run(args, config, corpora, outcome)
    return 0


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
    backup_state = out / run_directory.BACKUP_DIR / "state.json"
    resume_step = (run_directory.read_json(backup_state).get("step", 0)
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


if __name__ == "__main__":
    status = main()
    if status == EXIT_WORKER_LOST:
        # Aborted collectives leave TensorFlow unusable, and tearing it down waits for the
        # input pipeline's threads (22 s measured on Multi30k): leave now, within the bound.
        sys.stdout.flush()
        stop_cli_logging()
        os._exit(status)
    sys.exit(status)
