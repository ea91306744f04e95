"""The end of a training run: the weights it keeps (6.1, checkpoint averaging), chosen on the
validation split; the test split's BLEU; the SavedModel export; `results.json` and a summary.

The candidates are the averages of `keras_transformer.training.checkpoints.averaging_windows` (the
last checkpoints, and for a run whose best validation step came earlier, those up to and
around it) and the best checkpoint alone. Each is scored by its exact per-token validation
loss; the lowest wins, an average winning ties (averaging is the paper's choice). The choice,
the candidates and the reason go to `results.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from keras_transformer import run_directory
from keras_transformer.training.checkpoints import (
    LAST,
    average_checkpoints,
    averaging_windows,
    list_checkpoints,
)

BEST = "best checkpoint"
_LOG = logging.getLogger("keras_transformer")


def choose_final_weights(model: keras.Model, checkpoint_dir: str | Path, best_step: int | None,
                         count: int, val_loss: Callable[[keras.Model], float]) -> dict[str, Any]:
    """Loads into `model` the candidate weights with the lowest validation loss.

    Args:
        model: a model of the run's architecture; holds the chosen weights on return.
        checkpoint_dir: the run's `checkpoints/` (periodic `ckpt-*` and `best.weights.h5`).
        best_step: the step of the best validation loss during training (None: unknown).
        count: checkpoints per average (`--average-last`).
        val_loss: the exact per-token validation loss of a model.

    Returns:
        `chosen` (a window name of `averaging_windows`, or `BEST`), `steps` (the steps whose
        weights `model` now holds), `val_loss`, `reason` (one sentence), and `candidates`:
        a list of {name, steps, val_loss}.

    Raises:
        FileNotFoundError: no periodic checkpoint in `checkpoint_dir`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    steps = [step for step, _ in list_checkpoints(checkpoint_dir)]
    if not steps:
        raise FileNotFoundError(f"{checkpoint_dir}: no ckpt-*.weights.h5 to average")
    candidates = []
    for name, window in averaging_windows(steps, best_step, count).items():
        averaged = checkpoint_dir / f"averaged-{len(candidates)}.weights.h5"
        average_checkpoints(checkpoint_dir, window, averaged)
        candidates.append({"name": name, "steps": window, "file": averaged})
    best_file = checkpoint_dir / "best.weights.h5"
    if best_file.is_file() and best_step is not None and best_step >= 0:
        candidates.append({"name": BEST, "steps": [best_step], "file": best_file})
    for candidate in candidates:
        model.load_weights(candidate["file"])
        candidate["val_loss"] = float(val_loss(model))
    # Lowest loss; on a tie the earlier candidate (an average before the best checkpoint).
    chosen = min(candidates, key=lambda candidate: candidate["val_loss"])
    model.load_weights(chosen["file"])
    for candidate in candidates:
        if candidate["file"] != best_file:
            candidate["file"].unlink(missing_ok=True)
        del candidate["file"]
    others = ", ".join(f"{_describe(c)} {c['val_loss']:.4f}" for c in candidates
                       if c is not chosen)
    reason = (f"{_describe(chosen)}, steps {chosen['steps']}: lowest exact validation loss, {chosen['val_loss']:.4f}"
              + (f" (against {others})" if others else " (the only candidate)"))
    if chosen["name"] != LAST and best_step is not None and best_step < steps[-1]:
        reason += f"; validation was best at step {best_step}, before the last checkpoints"
    return {"chosen": chosen["name"], "steps": chosen["steps"], "val_loss": chosen["val_loss"],
            "reason": reason, "candidates": candidates}


def _describe(candidate: dict[str, Any]) -> str:
    if candidate["name"] == BEST:
        return "the best checkpoint alone"
    count = len(candidate["steps"])
    if candidate["name"] == LAST:
        return f"the average of the last {count} checkpoints"
    return f"the average of {count} checkpoints {candidate['name']}"


def finish_run(args: argparse.Namespace, config: dict[str, Any], corpora: dict[str, Any],
               outcome: dict[str, Any]) -> dict[str, Any]:
    """Writes model.keras (the weights chosen on val), scores the test split, exports the
    SavedModel, writes results.json and logs a summary; returns the results.

    Args:
        args: the `train` flags.
        config: the run's config.json.
        corpora: "val" and optionally "test" `ParallelCorpus` objects.
        outcome: what `keras_transformer.training.fit.train_model` returned.
    """
    from keras_transformer.decoding.scoring import score_translations, validation_loss
    from keras_transformer.decoding.translator import translate_texts
    from keras_transformer.model.transformer import build_transformer
    from keras_transformer.serving.saved_model import export_saved_model
    from pipelines.batching import make_batches
    from pipelines.tokenizer import SubwordTokenizer

    run = Path(args.out)
    started = time.perf_counter()
    tokenizer = SubwordTokenizer.load(run / run_directory.TOKENIZER_DIR)
    # The saved model is float32 whatever the training precision (the weights were float32
    # anyway): decoding and serving should not inherit a training-only choice.
    model = build_transformer(**config["model"])
    # Built once (tokenized once), iterated once per candidate.
    val_batches = make_batches(corpora["val"], tokenizer, tokens_per_batch=args.tokens_per_batch,
                               max_length=args.max_length, shuffle=False)
    choice = choose_final_weights(
        model, run / run_directory.CHECKPOINT_DIR, outcome["best_step"], args.average_last,
        lambda candidate: validation_loss(candidate, val_batches, args.label_smoothing))
    model.save(run / run_directory.MODEL_FILE)
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
        _LOG.info(f"translating {len(sources)} {test.split} sentences (beam {args.beam}) ...")
        hypotheses = translate_texts(model, tokenizer, sources, beam_size=args.beam,
                                     alpha=args.alpha)
        scores = score_translations(hypotheses, references)
        (run / "test.hyp.txt").write_text("".join(line + "\n" for line in hypotheses))
        results.update(scores, test_split=test.split, test_sentences=len(sources),
                       beam=args.beam, alpha=args.alpha)
    results["export"] = None
    if not args.no_export:
        base = (Path(args.export_dir) if args.export_dir
                else Path("saved_models") / Path(args.out).name)
        results["export"] = str(export_saved_model(model, tokenizer, base, beam_size=args.beam,
                                                   alpha=args.alpha))
    results["evaluation_seconds"] = round(time.perf_counter() - started, 1)
    run_directory.write_json_atomic(run / run_directory.RESULTS_FILE, results)
    summarize(run, results)
    return results


def summarize(run: Path, results: dict[str, Any]) -> None:
    """The one-screen summary at the end of a run."""
    line = "=" * 78
    _LOG.info(f"\n{line}\ntrained {results['steps']} steps in {results['training_seconds'] / 60:.1f} "
        f"min ({results['stop_reason']}); {results['tokens_per_sec']:.0f} target tokens/s, "
        f"{results['replicas']} replica(s), {results['precision']}, "
        f"XLA {'on' if results['jit_compile'] else 'off'}, fused kernels "
        f"{'on' if results['fused_kernels'] else 'off'}")
    if results.get("skipped_updates") is not None:
        _LOG.info(f"loss scaling: {results['skipped_updates']} of {results['steps']} updates skipped "
            f"for overflow (each still counted as a step); final loss scale "
            f"{results['loss_scale']:g}")
    if results["best_val_loss"] is not None:
        _LOG.info(f"validation loss (Keras metric, batch means averaged): best "
            f"{results['best_val_loss']:.4f} at step {results['best_step']}")
    _LOG.info(f"model.keras holds {results['averaging']['reason']}")
    if results.get("bleu") is not None:
        _LOG.info(f"test {results['test_split']} ({results['test_sentences']} sentences, beam "
            f"{results['beam']}): BLEU {results['bleu']:.2f}  chrF {results['chrf']:.2f}\n"
            f"  {results['bleu_signature']}")
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
