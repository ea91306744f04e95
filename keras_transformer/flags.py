"""Command-line flags generated from the typed configs (as fairseq's `gen_parser_from_dataclass`).

Each field of a config dataclass (`keras_transformer.training.config`) becomes one flag: its
name with dashes, its type, its `help`, `choices` and value `check` from the field's metadata;
a field without a default is a required flag. Only the flags given on the command line are
returned (`argparse.SUPPRESS` defaults), so `train_config` can apply a `--recipe`'s values
under them. Used only by the command-line modules; the library never parses argv.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from keras_transformer.cluster.workers import LOST_WORKER_SECONDS
from keras_transformer.errors import EXIT_STORAGE, StorageError, UsageError
from keras_transformer.training.config import (
    TrainConfig,
    field_type,
    positive,
    setting_fields,
    train_config,
)
from keras_transformer.training.recipes import RECIPES, describe_recipes

# The help's group of each config component, in the order they are shown.
GROUPS = {
    "data": ("data", None),
    "batches": ("batches", "5.1: the tokens of a micro-batch and of an optimizer step"),
    "model": ("model (overrides of the preset)", None),
    "optimization": ("optimization", None),
    "evaluation": ("validation, checkpoint averaging, test BLEU", None),
    "output": ("run directory, checkpoints, export", None),
    "cluster": (
        "several machines (TF_CONFIG)",
        "Every worker runs the same command with its own TF_CONFIG; worker 0 (or the chief) "
        "writes the run directory. A malformed TF_CONFIG or a port in use fails at once (exit "
        "status 2); peers missing after --join-timeout fail with one error naming them (exit "
        "2), and so do all workers when one refuses the command (settings other than the "
        "chief's, a bad corpus, ...). If a worker dies mid-run, the others exit with status 3 "
        f"within {LOST_WORKER_SECONDS} s instead of waiting forever; restarting every worker "
        "with the same command resumes from the last backup. Every stop (--max-steps, "
        "--max-minutes, NaN, --patience) is taken by all workers at the same step."),
}


def _value_parser(kind: type, check) -> Any:
    """An argparse `type`: converts the text, then applies the field's check."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind.__name__}, got {text}") from None
        problem = check(value) if check else None
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def positive_int(text: str) -> int:
    """An argparse `type` for a count of at least 1."""
    return _value_parser(int, positive)(text)


def add_field_flag(group, cls: type, field: dataclasses.Field) -> None:
    """Adds the flag of one config field (see the module docstring)."""
    flag = "--" + field.name.replace("_", "-")
    meta = field.metadata
    kind = field_type(cls, field)
    required = field.default is dataclasses.MISSING
    help_text = meta.get("help", "")
    if field.default not in (None, False, dataclasses.MISSING):
        help_text += f" (default: {field.default})"
    options: dict[str, Any] = {"help": help_text, "dest": field.name,
                               "default": argparse.SUPPRESS}
    if kind is bool:
        options["action"] = ("store_true" if field.default is False
                             else argparse.BooleanOptionalAction)
    else:
        options.update(type=_value_parser(kind, meta.get("check")), required=required)
        if meta.get("choices"):
            options["choices"] = meta["choices"]
    group.add_argument(flag, **options)


def add_config_flags(parser: argparse.ArgumentParser, cls: type,
                     only: Sequence[str] | None = None) -> None:
    """Adds a flag for each field of config class `cls` (or those named in `only`)."""
    for _, _, field in setting_fields(cls):
        if only is None or field.name in only:
            add_field_flag(parser, cls, field)


def add_recipe_flag(parser: argparse.ArgumentParser) -> None:
    """`--recipe NAME`: a named set of defaults, overridden by any flag given."""
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                        help="a named set of defaults, overridden by any flag given: "
                        + describe_recipes())


def add_verbose_flag(parser) -> None:
    """`--verbose` for a command-line tool; `start_cli_logging` reads it from the arguments."""
    parser.add_argument("--verbose", action="store_true",
                        help="also show TensorFlow's own C++ logs (hidden by default, unless "
                        "you set TF_CPP_MIN_LOG_LEVEL yourself)")


def add_sampling_flags(group) -> None:
    """The sampling flags of `translate` and `back_translate` (`decoding.sampling`)."""
    group.add_argument("--sampling-topk", type=int, default=1, metavar="K",
                       help="1: search; 0: sample from the whole vocabulary; K > 1: from "
                            "the K most likely tokens (with --beam 1)")
    group.add_argument("--sampling-topp", type=float, default=1.0, metavar="P",
                       help="nucleus sampling: the fewest tokens with probability mass P")
    group.add_argument("--sampling-temperature", type=float, default=1.0, metavar="T",
                       help="divides the log-probs before sampling")
    group.add_argument("--seed", type=int, default=0,
                       help="sampling seed; with each line's number it fixes the line's draws")


def check_search_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of `translate`'s and `back_translate`'s search, sampling and length flags
    (`--beam`, `--alpha`, `--batch-size`, `--batch-tokens`, `add_sampling_flags`',
    `--max-input-tokens`, `--max-output-tokens`); `parser.error` at the first problem."""
    # --beam and --alpha may be left out (None: the model's own, `Translator.resolve_search`)
    alpha = 0.0 if args.alpha is None else args.alpha
    finite = all(math.isfinite(value) for value in (
        alpha, args.sampling_topp, args.sampling_temperature))
    if not finite:
        parser.error("--alpha, --sampling-topp and --sampling-temperature must be finite")
    if (args.beam is not None and args.beam < 1) or args.batch_size < 1 \
            or args.batch_tokens < 1 or alpha < 0:
        parser.error("--beam, --batch-size and --batch-tokens must be >= 1, --alpha >= 0")
    if not 0 <= args.seed < 2**32:
        parser.error("--seed must be in [0, 2**32)")
    if args.sampling_topk != 1 and args.beam not in (None, 1):
        parser.error("sampling (--sampling-topk other than 1) draws one token a step: --beam 1")
    if args.sampling_topk < 0 or not 0 < args.sampling_topp <= 1 or args.sampling_temperature <= 0:
        parser.error("--sampling-topk must be >= 0, --sampling-topp in (0, 1], "
                     "--sampling-temperature > 0")
    if args.sampling_topk == 1 and (args.sampling_topp != 1 or args.sampling_temperature != 1):
        parser.error("--sampling-topp and --sampling-temperature need --sampling-topk 0 "
                     "(the whole vocabulary) or K > 1")
    if (args.max_input_tokens is not None and args.max_input_tokens < 2) or (
            args.max_output_tokens is not None and args.max_output_tokens < 1):
        parser.error("--max-input-tokens must be >= 2, --max-output-tokens >= 1")


def build_train_parser() -> argparse.ArgumentParser:
    """The flags of `python -m keras_transformer.train`, one per `TrainConfig` setting."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.train",
        description="Train a Transformer (Vaswani et al., 2017) for translation: vocabulary, "
        "bucketed batches, model.fit under tf.distribute, checkpoint averaging, test BLEU, "
        "SavedModel export. The same command resumes an interrupted run. Every flag is a "
        "field of keras_transformer.TrainConfig (kt.run_training runs the same from Python).")
    add_recipe_flag(parser)
    groups = {name: parser.add_argument_group(title, description)
              for name, (title, description) in GROUPS.items()}
    for component, cls, field in setting_fields():
        add_field_flag(groups[component], cls, field)
    groups["output"].add_argument(
        "--dry-run", action="store_true",
        help="check the flags, the corpus' splits, the run directory and the step's token "
        "budget on this machine's replicas, print the plan, and exit without creating or "
        "training anything (a tfds: corpus that is not there yet is still downloaded and "
        "prepared by tensorflow-datasets; with TF_CONFIG, every worker must run it: it joins "
        "the cluster to count the replicas)")
    return parser


def given_flags(namespace: argparse.Namespace, *, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The flags given on the command line (defaults were suppressed), as a dict."""
    return {key: value for key, value in vars(namespace).items() if key not in exclude}


def parse_train_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, bool]:
    """Parses `train`'s argv into its `TrainConfig` and whether `--dry-run` was given.

    A value its flag refuses exits with status 2 (argparse's usage error); settings that only
    `TrainConfig.check` can judge are checked by the library (`run_training`).
    """
    parser = build_train_parser()
    namespace = parser.parse_args(argv)
    flags = given_flags(namespace, exclude=("dry_run",))
    try:
        config = train_config(**flags)
    except UsageError as error:  # e.g. a recipe value its flag would refuse
        parser.error(str(error))
    return config, namespace.dry_run


def storage_errors_as_status(command: Callable[[Sequence[str] | None], int],
                             argv: Sequence[str] | None, prefix: str = "error") -> int:
    """Runs a command line's body `command(argv)`; a full or failing disk (`StorageError`:
    nothing was half-written) becomes one `<prefix>: ...` line on stderr and the status
    `EXIT_STORAGE` (4), never a traceback."""
    try:
        return command(argv)
    except StorageError as error:
        print(f"{prefix}: {error}", file=sys.stderr)
        return EXIT_STORAGE
