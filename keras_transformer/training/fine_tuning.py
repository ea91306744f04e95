"""Fine-tuning from a trained run (`--init-from RUN`): its weights and its vocabulary, a fresh
optimizer with this run's own warmup and learning rate.

Domain adaptation by continued training (Luong & Manning 2015, "Stanford NMT systems for
spoken language domains"): a model trained on one domain is trained further on the new
domain's pairs, optionally with some of the old pairs mixed in (`--add-data`) so that it does
not forget the old domain (Chu et al. 2017, "An Empirical Comparison of Domain Adaptation
Methods for NMT"). What breaks it in other tools is refused here before anything is
prepared, with the flags that fix it: another architecture or vocabulary size (a shape error
deep in weight loading, fairseq#1909, OpenNMT-tf#269), prepared data tokenized with another
vocabulary. The optimizer is never restored from the old run (OpenNMT-py PR 2030): its
moments belong to another data distribution and its step to another schedule.

`finish_run` scores the model before (the old run's weights) and after on this run's test
split and on the old run's own test split (`evaluate_before_and_after`): what was gained on
the new domain and what was forgotten on the old one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.errors import UsageError
from keras_transformer.training.config import TrainConfig

_LOG = logging.getLogger("keras_transformer")

# Settings of the model that may change between the two runs (no weight depends on them).
UNCONSTRAINED = ("preset", "dropout", "attention_dropout")
# The old run's flags that give its architecture (for the refusal's advice).
ARCHITECTURE_FLAGS = ("preset", "num_layers", "d_model", "num_heads", "d_ff", "activation",
                      "pre_norm", "vocab_size")


@dataclasses.dataclass(frozen=True)
class InitialRun:
    """A finished run to start from: its directory, config.json and results.json."""

    path: Path
    record: dict[str, Any]
    results: dict[str, Any]

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / run_directory.TOKENIZER_DIR

    @property
    def model_file(self) -> Path:
        return self.path / run_directory.MODEL_FILE

    def tokenizer_sha256(self) -> str:
        return hashlib.sha256((self.tokenizer_dir / "spm.model").read_bytes()).hexdigest()


def initial_run(config: TrainConfig, model_config) -> InitialRun | None:
    """The run of `--init-from`, checked against this run's model (None without the flag).

    Raises:
        UsageError: not a finished run, the same directory as --out, or another architecture
            or vocabulary size than this run's (naming each difference and the flags to pass).
    """
    if not config.model.init_from:
        return None
    path = Path(config.model.init_from)
    if path.resolve() == Path(config.output.out).resolve():
        raise UsageError(f"--init-from {path} is this run's own --out: fine-tune into another "
                         "directory")
    run = read_initial_run(path)
    record, old = run.record, run.record.get("model", {})
    new = {"preset": config.model.preset, **dataclasses.asdict(model_config)}
    differences = [f"{key}: {old.get(key)!r} there, {value!r} here" for key, value in new.items()
                   if key not in UNCONSTRAINED and old.get(key) != value]
    if differences:
        arguments = record.get("arguments", {})
        advice = " ".join(
            f"--{name.replace('_', '-')}" + ("" if arguments[name] is True
                                              else f" {arguments[name]}")
            for name in ARCHITECTURE_FLAGS if arguments.get(name) not in (None, False))
        raise UsageError(f"--init-from {path}: its model differs from this run's "
                         f"({'; '.join(differences)}). Fine-tuning keeps the architecture and "
                         f"the vocabulary: pass the run's own settings ({advice}), or train "
                         "from scratch without --init-from")
    return run


def read_initial_run(path: str | Path) -> InitialRun:
    """A finished run directory's config.json and results.json.

    Raises:
        UsageError: not a finished run (naming what is missing).
    """
    path = Path(path)
    missing = [name for name in (run_directory.MODEL_FILE, run_directory.TOKENIZER_DIR,
                                 run_directory.CONFIG_FILE) if not (path / name).exists()]
    if missing:
        raise UsageError(f"--init-from {path}: not a finished training run ({', '.join(missing)} "
                         "missing); pass the --out folder of a finished `python -m "
                         "keras_transformer.train` run")
    results_file = path / run_directory.RESULTS_FILE
    return InitialRun(path, run_directory.read_json(path / run_directory.CONFIG_FILE),
                      run_directory.read_json(results_file) if results_file.is_file() else {})


def check_prepared_tokenizer(run: InitialRun, prepared) -> None:
    """Refuses prepared data (a `PreparedFolder`) whose tokenizer is not the initial run's:
    the bytes of their sentencepiece models compared (no TensorFlow needed: a JAX run).

    Raises:
        UsageError: naming both, and how to fix it.
    """
    model_file = Path(prepared.directory) / run_directory.TOKENIZER_DIR / "spm.model"
    if hashlib.sha256(model_file.read_bytes()).hexdigest() != run.tokenizer_sha256():
        raise UsageError(f"{prepared.directory} was tokenized with another vocabulary than "
                         f"--init-from {run.path}: prepare the data again for this run (leave "
                         "out --prepared, or give a new folder)")


def load_initial_weights(model, run: InitialRun) -> None:
    """Copies the weights of `run`'s model.keras into `model` (same architecture; matched by
    weight path, so a trainer and a plain `Transformer` agree).

    Raises:
        UsageError: a weight missing or of another shape (a run whose config.json does not
            describe its model.keras).
    """
    import keras

    by_path = {weight.path: weight for weight in saved_model(run).weights}
    problems = []
    for weight in model.weights:
        source = by_path.get(weight.path)
        if source is None or tuple(source.shape) != tuple(weight.shape):
            problems.append(f"{weight.path} {tuple(weight.shape)}: "
                            + ("absent" if source is None else f"{tuple(source.shape)} there"))
            continue
        weight.assign(keras.ops.cast(source.value, weight.dtype))
    if problems:
        raise UsageError(f"--init-from {run.model_file}: its weights do not fit this model "
                         f"({'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''})")


def saved_model(run: InitialRun):
    """The initial run's model.keras, loaded (uncompiled)."""
    import keras

    import keras_transformer.model.transformer  # noqa: F401  (registers the custom layers)

    return keras.models.load_model(run.model_file, compile=False)


def old_test_corpus(run: InitialRun, load: Callable[..., Any]):
    """The initial run's own test split (`load(data, split, src, tgt, data_dir=...,
    manual_dir=...)`, from where that run read it), or None when it had none or it cannot
    be read here (a run trained elsewhere)."""
    arguments = run.record.get("arguments", {})
    split = arguments.get("test_split", "test")
    if not arguments.get("data") or str(split).lower() == "none":
        return None
    manual_dir = arguments.get("manual_dir")  # only needed to build tfds' data: not if gone
    try:
        return load(arguments["data"], split, arguments["src"].split(",")[0].strip(),
                    arguments["tgt"], data_dir=arguments.get("data_dir"),
                    manual_dir=manual_dir if manual_dir and os.path.isdir(manual_dir) else None)
    except ValueError:  # CorpusError: moved or absent
        return None


def evaluate_before_and_after(run: InitialRun, tokenizer, tests: dict[str, Any],
                              score: Callable[[Any, Any, Any, str], dict[str, Any]],
                              after: dict[str, Any],
                              compare: Callable[[Any, Any, Any], dict[str, Any]]
                              ) -> dict[str, Any]:
    """results.json's "fine_tuning": BLEU before (the initial run's weights) and after (this
    run's final weights, `after`, by role) on each test split, the difference, and whether
    the difference is more than chance (a paired bootstrap's p-value).

    Args:
        run: the initial run (its model.keras is the model before).
        tokenizer: the shared tokenizer.
        tests: {"test": this run's test split, "old_test": the initial run's}, each a
            `ParallelCorpus` or None.
        score: `score(model, tokenizer, corpus, name) -> {"bleu", "chrf", "hypotheses",
            ...}`; `name` ("test.before", ...) names the translations where they are kept.
        after: {role: scores of the final model, with its "hypotheses"} for the roles
            already scored.
        compare: `compare(before, after, references) -> {"p_value", ...}` on two lists of
            translations (`decoding.scoring.paired_bootstrap`).
    """
    summary: dict[str, Any] = {"init_from": str(run.path)}
    model = saved_model(run)
    for role, corpus in tests.items():
        if corpus is None:
            continue
        before = score(model, tokenizer, corpus, f"{role}.before")
        entry = {"data": corpus.origin, "split": corpus.split,
                 "sentences": len(before["hypotheses"]),
                 "bleu_before": before["bleu"], "chrf_before": before["chrf"]}
        if role in after:
            entry.update(bleu_after=after[role]["bleu"], chrf_after=after[role]["chrf"],
                         bleu_change=round(after[role]["bleu"] - before["bleu"], 2))
            references = corpus.targets[:len(before["hypotheses"])]
            entry["p_value"] = compare(before["hypotheses"], after[role]["hypotheses"],
                                       references)["p_value"]
        summary[role] = entry
    return summary


def before_and_after(config: TrainConfig, corpora: dict[str, Any],
                      model, tokenizer, results: dict[str, Any],
                      test_hypotheses: list[str] | None, beam: int,
                      alpha: float) -> dict[str, Any]:
    """A fine-tuned run's test scores before and after, on its test split and on the initial
    run's (`keras_transformer.training.fine_tuning`), at this run's beam and alpha, with a
    paired bootstrap's p-value for each change. The translations are kept beside
    test.hyp.txt (`test.before.hyp.txt`, `old_test.hyp.txt`, `old_test.before.hyp.txt`) for
    comparisons with other systems (`sacrebleu REF -i A B --paired-bs`)."""
    # Here, not at the top: fit_jax imports this module on a machine that may lack TensorFlow.
    from keras_transformer.decoding.scoring import paired_bootstrap
    from keras_transformer.decoding.translator import translate_and_score
    from pipelines.corpora import load_corpus

    run = Path(config.output.out)
    initial = read_initial_run(config.model.init_from)
    limit = config.data.test_limit

    def score(candidate, tokenizer, corpus, name: str) -> dict[str, Any]:
        count = min(limit or len(corpus), len(corpus))
        _LOG.info(f"translating {count} {corpus.origin} [{corpus.split}] sentences "
                  f"(fine-tuning: {name}) ...")
        hypotheses, scores = translate_and_score(
            candidate, tokenizer, corpus.sources[:count], corpus.targets[:count],
            run / f"{name}.hyp.txt", beam_size=beam, alpha=alpha)
        return {**scores, "hypotheses": hypotheses}

    old_test = old_test_corpus(initial, load_corpus)
    after = {}
    if test_hypotheses is not None:
        after["test"] = {**results, "hypotheses": test_hypotheses}
    if old_test is not None:
        after["old_test"] = score(model, tokenizer, old_test, "old_test")
    return evaluate_before_and_after(
        initial, tokenizer, {"test": corpora.get("test"), "old_test": old_test}, score, after,
        compare=paired_bootstrap)
