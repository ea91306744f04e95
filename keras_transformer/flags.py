"""The flags of `python -m keras_transformer.train` and their validation.

Everything here runs before any work starts: argparse types refuse malformed values and
`validate_args` refuses contradictory or impossible ones, so a bad command creates nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from keras_transformer.cluster.workers import DEFAULT_JOIN_TIMEOUT, LOST_WORKER_SECONDS
from keras_transformer.training.precision import JIT_CHOICES, PRECISIONS
from keras_transformer.training.recipes import add_recipe_flag, parse_with_recipe
from pipelines import DEFAULT_SHARD_PAIRS, DEFAULT_TOKENIZER_SAMPLE

DEFAULT_MAX_STEPS = 100_000  # paper, base model; normally --max-minutes or --epochs ends first
# How long a non-chief worker waits for the chief to prepare the training data.
PREPARE_WAIT_SECONDS = 3 * 3600
MODEL_FLAGS = ("num_layers", "d_model", "num_heads", "d_ff", "dropout", "attention_dropout",
               "activation", "pre_norm", "vocab_size")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except absent ones ("None" would only confuse)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_data_flags(group) -> None:
    """The flags that say which corpus to read and how to prepare it, shared by `train`
    and `prepare` (checked by `validate_data_flags`)."""
    group.add_argument("--data", required=True,
                       help="folder of {split}.{lang}[.gz] files, or tfds:NAME[/CONFIG]")
    group.add_argument("--data-dir", help="tensorflow-datasets data_dir (tfds: data only)")
    group.add_argument("--manual-dir",
                       help="tfds: data only: a folder of manually downloaded files, built "
                       "without the network (e.g. Multi30k's {split}.{lang}.gz release files "
                       "for --data tfds:multi30k)")
    group.add_argument("--src", required=True, help="source language code, e.g. de")
    group.add_argument("--tgt", required=True, help="target language code, e.g. en")
    group.add_argument("--train-split", default="train", help="the training split")
    group.add_argument("--vocab-size", type=positive_int, default=8000,
                       help="shared source/target subword vocabulary size (paper: ~37000)")
    group.add_argument("--max-length", type=positive_int, default=128,
                       help="longest pair kept, in subwords + EOS; longer pairs are dropped "
                       "from training")
    group.add_argument("--tokenizer-sample", type=positive_int, default=DEFAULT_TOKENIZER_SAMPLE,
                       help="pairs sampled (seeded) from the training split to train "
                       "SentencePiece on")
    group.add_argument("--shard-pairs", type=positive_int, default=DEFAULT_SHARD_PAIRS,
                       help="pairs per prepared shard")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m keras_transformer.train",
        description="Train a Transformer (Vaswani et al., 2017) for translation: vocabulary, "
        "bucketed batches, model.fit under tf.distribute, checkpoint averaging, test BLEU, "
        "SavedModel export. The same command resumes an interrupted run.",
        formatter_class=HelpFormatter,
    )
    add_recipe_flag(p)
    g = p.add_argument_group("data")
    add_data_flags(g)
    g.add_argument("--val-split", default="val",
                   help="split for validation loss, best checkpoint and early stopping")
    g.add_argument("--test-split", default="test",
                   help="split scored with BLEU at the end; 'none' to skip")
    g.add_argument("--test-limit", type=_non_negative_int, default=0,
                   help="score only the first N test pairs (0 = all)")
    g.add_argument("--prepared",
                   help="prepared training data (tokenizer and token shards, from `python -m "
                   "keras_transformer.prepare`, reusable by several runs); prepared there by the "
                   "first run if absent. Default: RUN/prepared. Workers of a multi-machine run "
                   "read it from this path (shared), waiting up to "
                   f"{PREPARE_WAIT_SECONDS // 3600} h for the chief to prepare it")
    g.add_argument("--tokens-per-batch", type=positive_int, default=4096,
                   help="PER REPLICA: most tokens in one micro-batch on one device (sentences "
                   "x padded length, source or target, whichever is longer, as fairseq's "
                   "--max-tokens counts): what must fit in a device's memory")
    g.add_argument("--accumulate", type=positive_int,
                   help="micro-batches per optimizer step (gradient accumulation, fairseq's "
                   "--update-freq); default 1, or what --tokens-per-step needs")
    g.add_argument("--tokens-per-step", type=positive_int,
                   help="GLOBAL: tokens of one optimizer step over all replicas and "
                   "micro-batches (paper: 25000). Sets --accumulate to ceil(this / "
                   "(--tokens-per-batch x replicas)) and each micro-batch to this / (replicas x "
                   "accumulate), so the same command makes the same step on 1 or 8 devices")
    g = p.add_argument_group("model (overrides of the preset)")
    g.add_argument("--preset", default="small", choices=("tiny", "small", "base", "big"),
                   help="small: 3 layers, d_model 256 (Multi30k); base/big: paper Table 3")
    g.add_argument("--num-layers", type=positive_int, help="encoder and decoder layers (N)")
    g.add_argument("--d-model", type=positive_int, help="model width")
    g.add_argument("--num-heads", type=positive_int, help="attention heads (divide d_model)")
    g.add_argument("--d-ff", type=positive_int, help="feed-forward inner width")
    g.add_argument("--dropout", type=_fraction, help="residual/embedding dropout (P_drop)")
    g.add_argument("--attention-dropout", type=_fraction, help="dropout on attention weights")
    g.add_argument("--activation", choices=("relu", "gelu"), help="feed-forward activation")
    g.add_argument("--pre-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="layer norm before each sublayer instead of after (paper: after)")
    g = p.add_argument_group("optimization")
    g.add_argument("--label-smoothing", type=_fraction, default=0.1, help="epsilon_ls")
    g.add_argument("--warmup-steps", type=positive_int, default=4000,
                   help="learning rate warmup (paper: 4000; fewer suit short CPU runs)")
    g.add_argument("--lr-scale", type=_positive_float, default=1.0,
                   help="multiplies the paper's learning rate schedule")
    g.add_argument("--max-steps", type=positive_int,
                   help=f"optimizer steps (default {DEFAULT_MAX_STEPS} unless --epochs)")
    g.add_argument("--epochs", type=_positive_float,
                   help="passes over the training data (converted to steps)")
    g.add_argument("--max-minutes", type=_positive_float,
                   help="wall-clock budget for training (evaluation/export come after)")
    g.add_argument("--seed", type=_non_negative_int, default=0,
                   help="seeds initialization, shuffling and the vocabulary")
    g.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="auto: mixed_bfloat16 on GPUs of compute capability >= 8.0 and on CPUs "
                   "with AVX512_BF16/AMX, mixed_float16 (dynamic loss scaling) on older GPUs, "
                   "float32 otherwise")
    g.add_argument("--initial-loss-scale", type=_positive_float, default=2.0**15,
                   help="mixed_float16 only: the dynamic loss scale's start. A step whose "
                   "gradients overflow changes nothing and halves it, and still counts as a "
                   "step (results.json: skipped_updates)")
    g.add_argument("--jit-compile", choices=JIT_CHOICES, default="auto",
                   help="XLA-compile the train step: auto = on with GPUs, off on CPUs (slower "
                   "there: BENCHMARKS.md). With XLA, batches come in a bounded set of shapes "
                   "(coarser buckets, full batches), each compiled once")
    g = p.add_argument_group("checkpoints, validation, outputs")
    g.add_argument("--out", required=True, help="run directory")
    g.add_argument("--checkpoint-every", type=positive_int, default=200,
                   help="steps between checkpoints (and resumable backups)")
    g.add_argument("--validate-every", type=positive_int,
                   help="steps between validations (default: --checkpoint-every)")
    g.add_argument("--patience", type=_non_negative_int, default=10,
                   help="stop after this many validations without improvement (0 = never)")
    g.add_argument("--average-last", type=positive_int, default=5,
                   help="average the last N checkpoints (paper: 5); model.keras gets the average, or "
                   "the best checkpoint if that has the lower validation loss")
    g.add_argument("--beam", type=positive_int, default=4, help="beam size for test BLEU")
    g.add_argument("--alpha", type=float, default=0.6, help="length penalty for test BLEU")
    g.add_argument("--export-dir", help="SavedModel base (default saved_models/<run name>)")
    g.add_argument("--no-export", action="store_true", help="skip the SavedModel export")
    g.add_argument("--overwrite", action="store_true",
                   help="delete an existing run directory and start over")
    g.add_argument("--resume", action="store_true",
                   help="require an interrupted run to resume (it is resumed anyway if found)")
    g.add_argument("--verbose", action="store_true",
                   help="also show TensorFlow's own C++ logs and Keras' per-interval lines "
                   "(hidden by default, unless you set TF_CPP_MIN_LOG_LEVEL yourself)")
    g.add_argument("--dry-run", action="store_true",
                   help="check the flags, the corpus' splits, the run directory and the step's "
                   "token budget on this machine's replicas, print the plan, and exit without "
                   "creating or training anything (a tfds: corpus that is not there yet is "
                   "still downloaded and prepared by tensorflow-datasets; with TF_CONFIG, every "
                   "worker must run it: it joins the cluster to count the replicas)")
    g = p.add_argument_group(
        "several machines (TF_CONFIG)",
        "Every worker runs the same command with its own TF_CONFIG; worker 0 (or the chief) "
        "writes the run directory. A malformed TF_CONFIG or a port in use fails at once (exit "
        "status 2); peers missing after --join-timeout fail with one error naming them (exit "
        "2), and so do all workers when one refuses the command (settings other than the "
        "chief's, a bad corpus, ...). If a worker dies mid-run, the others exit with status 3 "
        f"within {LOST_WORKER_SECONDS} s instead of waiting forever; restarting every worker with the same command resumes from the last backup. Every "
        "stop (--max-steps, --max-minutes, NaN, --patience) is taken by all workers at the "
        "same step.")
    g.add_argument("--join-timeout", type=_positive_float, default=DEFAULT_JOIN_TIMEOUT,
                   help="seconds each worker waits for all the others to start")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The flags of `python -m keras_transformer.train`, with its `--recipe`'s defaults."""
    return parse_with_recipe(build_parser(), argv)


class UsageError(ValueError):
    """A bad flag, corpus or run directory, reported as one line with exit status 2."""


def validate_data_flags(args: argparse.Namespace) -> None:
    """The checks shared by `train` and `prepare`: languages, vocabulary, length.

    Raises:
        UsageError: with a message saying what to change.
    """
    if args.src == args.tgt:
        raise UsageError(f"--src and --tgt are both {args.src!r}")
    if args.vocab_size < 300:
        raise UsageError("--vocab-size must be >= 300 (4 special ids + 256 byte pieces + words)")
    if args.max_length < 2:
        raise UsageError(f"--max-length must be >= 2 (a subword and EOS), got {args.max_length}")


def validate_args(args: argparse.Namespace):
    """Semantic checks beyond argparse's; returns the `TransformerConfig`.

    Raises:
        UsageError: with a message saying what to change.
    """
    from keras_transformer.model.transformer import transformer_config

    if args.max_steps is not None and args.epochs is not None:
        raise UsageError("give --max-steps or --epochs, not both")
    if args.alpha < 0:
        raise UsageError(f"--alpha must be >= 0, got {args.alpha}")
    validate_data_flags(args)
    if args.tokens_per_batch < args.max_length:
        raise UsageError(f"--tokens-per-batch {args.tokens_per_batch} is below --max-length "
                         f"{args.max_length}: a longest pair would not fit in a micro-batch; "
                         f"the smallest valid value is {args.max_length}")
    if args.tokens_per_step is not None and args.accumulate is not None:
        raise UsageError("give --accumulate or --tokens-per-step, not both (--tokens-per-step "
                         "chooses the accumulation)")
    if args.tokens_per_step is not None and args.tokens_per_step < args.max_length:
        raise UsageError(f"--tokens-per-step {args.tokens_per_step} is below --max-length "
                         f"{args.max_length}: a longest pair would not fit in a step; the "
                         f"smallest valid value is {args.max_length} (on one replica)")
    if args.overwrite and args.resume:
        raise UsageError("--overwrite and --resume contradict each other")
    overrides = {k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None}
    try:
        return transformer_config(args.preset, **overrides)
    except ValueError as error:
        raise UsageError(f"model: {error}") from None


@dataclasses.dataclass(frozen=True)
class StepBudget:
    """How one optimizer step's tokens are spread: on each of `replicas` devices,
    `accumulate` micro-batches of at most `micro_batch` tokens each (5.1: ~25,000 source and
    25,000 target tokens a step, over 8 GPUs)."""

    micro_batch: int
    replicas: int
    accumulate: int

    @property
    def tokens_per_step(self) -> int:
        """The step's token budget over all replicas and micro-batches."""
        return self.micro_batch * self.replicas * self.accumulate

    @property
    def global_micro_batch(self) -> int:
        """One micro-step's budget over all replicas: the global `tokens_per_batch` that
        `pipelines.batching` splits over replicas."""
        return self.micro_batch * self.replicas

    def describe(self) -> str:
        return (f"{self.replicas} replica(s) x {self.accumulate} micro-batch(es) of <= "
                f"{self.micro_batch} tokens = {self.tokens_per_step} tokens per step")


def step_budget(args: argparse.Namespace, replicas: int) -> StepBudget:
    """The step's budget for `replicas` replicas (checked flags: see `validate_args`).

    Raises:
        UsageError: a micro-batch would be smaller than --max-length, naming the flag and
            its smallest valid value.
    """
    if args.tokens_per_step is None:
        return StepBudget(args.tokens_per_batch, replicas, args.accumulate or 1)
    total = args.tokens_per_step
    accumulate = math.ceil(total / (args.tokens_per_batch * replicas))
    micro_batch = total // (replicas * accumulate)
    if micro_batch < args.max_length:
        # With this accumulation it takes replicas x accumulate x max_length; fewer
        # micro-batches would need a step below `total`.
        smallest = replicas * accumulate * args.max_length
        raise UsageError(
            f"--tokens-per-step {total} over {replicas} replica(s) x {accumulate} micro-batch(es) "
            f"leaves {micro_batch} tokens per micro-batch, below --max-length {args.max_length}: "
            f"a longest pair would not fit; the smallest valid --tokens-per-step from {total} "
            f"up on {replicas} replica(s) is {smallest}")
    return StepBudget(micro_batch, replicas, accumulate)
