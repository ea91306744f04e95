"""A training run's settings as typed dataclasses, one per component (as fairseq's configs are).

`TrainConfig` holds everything `python -m keras_transformer.train` takes; its components are
`DataConfig` (the corpus and its preparation: `prepare` takes this part too), `BatchConfig`
(5.1: the tokens of a micro-batch and of an optimizer step), `ModelConfig` (a preset of 3 and
Table 3, and overrides of it), `OptimizationConfig` (5.3 Adam and its warmup, 5.4 label
smoothing, the stop rules, precision), `EvaluationConfig` (validation, 6.1 checkpoint averaging,
beam search), `OutputConfig` (the run directory, checkpoints, the export) and `ClusterConfig`.

The command line's flags are generated from these fields (`keras_transformer.flags`): each
field is a flag of the same name (`vocab_size` is `--vocab-size`), its `help` and `check` in the
field's metadata. `train_config(**flags)` builds a `TrainConfig` from flag values as the command
line does, a `--recipe`'s defaults first (`keras_transformer.training.recipes`), and
`TrainConfig.flags()` gives them back: that flat mapping is what config.json records
("arguments"), so a run's config.json rebuilds its `TrainConfig`.

Nothing here imports TensorFlow: `--help` and the checks run before it loads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from keras_transformer.cluster.workers import DEFAULT_JOIN_TIMEOUT
from keras_transformer.errors import UsageError
from keras_transformer.model.config import TransformerConfig, transformer_config
from keras_transformer.training.keras_backend import BACKENDS
from keras_transformer.training.precision import JIT_CHOICES, PRECISIONS
from keras_transformer.training.recipes import RECIPES
from keras_transformer.training.step_budget import StepBudget
from pipelines import DEFAULT_SHARD_PAIRS, DEFAULT_TOKENIZER_SAMPLE

DEFAULT_MAX_STEPS = 100_000  # paper, base model; normally --max-minutes or --epochs ends first


# --- checks of one value: shared by the flags' parsing and by configs built in Python ---

def positive(value: float) -> str | None:
    """None if `value` is a positive finite number, else what is wrong."""
    return None if value > 0 and math.isfinite(value) else "must be positive"


def non_negative(value: float) -> str | None:
    return None if value >= 0 and math.isfinite(value) else "must be >= 0"


def fraction(value: float) -> str | None:
    return None if 0.0 <= value < 1.0 else "must be in [0, 1)"


def _setting(default: Any = dataclasses.MISSING, help: str = "", check: Callable | None = None,
             choices: tuple | None = None) -> Any:
    """A config field with what its flag needs: help text, a value check, choices."""
    metadata = {"help": help, "check": check, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def comma_separated(text: str, kind: type) -> list:
    """``"4,6"`` -> ``[4, 6]`` (``""`` -> ``[]``); ValueError for an item that is no `kind`."""
    return [kind(item) for item in text.split(",")] if text else []


def _each(kind: type, check: Callable, description: str) -> Callable[[str], str | None]:
    """The check of a comma-separated list whose every item passes `check`."""
    def check_list(text: str) -> str | None:
        try:
            if not any(check(value) for value in comma_separated(text, kind)):
                return None
        except ValueError:
            pass
        return f"must be comma-separated {description}"
    return check_list


int_list = _each(int, positive, "whole numbers >= 1, e.g. 4,6")
float_list = _each(float, non_negative, "numbers >= 0, e.g. 0.6,1.0,1.4")


@dataclasses.dataclass
class DataConfig:
    """The corpus and its one-time preparation (shared vocabulary and token shards, 5.1)."""

    data: str = _setting(help="folder of {split}.{lang}[.gz] files, or tfds:NAME[/CONFIG]")
    src: str = _setting(help="source language code, e.g. de; several, comma-separated (de,fr,cs), "
                        "train one many-to-one model on all of them with the same target "
                        "(the first is validated on and gives the headline test score)")
    tgt: str = _setting(help="target language code, e.g. en")
    data_dir: str | None = _setting(None, "tensorflow-datasets data_dir (tfds: data only)")
    manual_dir: str | None = _setting(
        None, "tfds: data only: a folder of manually downloaded files, built without the "
        "network (e.g. Multi30k's {split}.{lang}.gz release files for --data tfds:multi30k)")
    train_split: str = _setting("train", "the training split")
    vocab_size: int = _setting(8000, "shared source/target subword vocabulary size (paper: "
                               "~37000)", positive)
    max_length: int = _setting(128, "longest pair kept, in subwords + EOS; longer pairs are "
                               "dropped from training", positive)
    tokenizer_sample: int = _setting(DEFAULT_TOKENIZER_SAMPLE, "pairs sampled (seeded) from "
                                     "the training split to train SentencePiece on", positive)
    shard_pairs: int = _setting(DEFAULT_SHARD_PAIRS, "pairs per prepared shard", positive)
    subword_samples: int = _setting(
        0, "subword regularization (Kudo 2018; BPE-dropout, Provilkov et al. 2020): prepare "
        "this many copies of the training split, each pair tokenized with a different seeded "
        "sampled segmentation in each copy, and train on them in turn (0: the one "
        "deterministic segmentation, the paper's). Val, test and translation always use the "
        "deterministic one", non_negative)
    subword_alpha: float = _setting(
        0.1, "with --subword-samples: for a BPE vocabulary the probability of dropping each "
        "merge (BPE-dropout; 0.1 in its paper), for a unigram one the smoothing of the "
        "sampling distribution (SentencePiece's alpha)", fraction)
    prepared: str | None = _setting(
        None, "prepared training data (tokenizer and token shards, from `python -m "
        "keras_transformer.prepare`, reusable by several runs); prepared there by the first "
        "run if absent. Default: RUN/prepared. Workers of a multi-machine run read it from "
        "this path (shared), waiting for the chief to prepare it")
    val_split: str = _setting("val", "split for validation loss, best checkpoint and early "
                              "stopping")
    test_split: str = _setting("test", "split scored with BLEU at the end; 'none' to skip")
    test_limit: int = _setting(0, "score only the first N test pairs (0 = all)", non_negative)

    def check(self) -> None:
        """The checks shared by `train` and `prepare`: languages, vocabulary, length.

        Raises:
            UsageError: with a message saying what to change.
        """
        languages = [language.strip() for language in self.src.split(",")]
        if self.src == self.tgt:
            raise UsageError(f"--src and --tgt are both {self.src!r}")
        if self.tgt in languages:
            raise UsageError(f"--src {self.src} includes the target language {self.tgt!r}")
        if "" in languages or len(set(languages)) < len(languages):
            raise UsageError(f"--src {self.src!r}: give each source language once, "
                             "comma-separated, e.g. de,fr,cs")
        if self.vocab_size < 300:
            raise UsageError("--vocab-size must be >= 300 (4 special ids + 256 byte pieces + "
                             "words)")
        if self.max_length < 2:
            raise UsageError(f"--max-length must be >= 2 (a subword and EOS), got "
                             f"{self.max_length}")


# The part of `DataConfig` that `python -m keras_transformer.prepare` takes.
PREPARE_FIELDS = ("data", "src", "tgt", "data_dir", "manual_dir", "train_split", "vocab_size",
                  "max_length", "tokenizer_sample", "shard_pairs", "subword_samples",
                  "subword_alpha")


@dataclasses.dataclass
class BatchConfig:
    """The tokens of one micro-batch (per device) and of one optimizer step (global)."""

    tokens_per_batch: int = _setting(
        4096, "PER REPLICA: most tokens in one micro-batch on one device (sentences x padded "
        "length, source or target, whichever is longer, as fairseq's --max-tokens counts): "
        "what must fit in a device's memory", positive)
    accumulate: int | None = _setting(
        None, "micro-batches per optimizer step (gradient accumulation, fairseq's "
        "--update-freq); default 1, or what --tokens-per-step needs", positive)
    tokens_per_step: int | None = _setting(
        None, "GLOBAL: tokens of one optimizer step over all replicas and micro-batches "
        "(paper: 25000). Sets --accumulate to ceil(this / (--tokens-per-batch x replicas)) and "
        "each micro-batch to this / (replicas x accumulate), so the same command makes the "
        "same step on 1 or 8 devices", positive)

    def check(self, max_length: int) -> None:
        """Raises `UsageError` if a longest pair could not fit, or both ways are given."""
        if self.tokens_per_batch < max_length:
            raise UsageError(f"--tokens-per-batch {self.tokens_per_batch} is below --max-length "
                             f"{max_length}: a longest pair would not fit in a micro-batch; "
                             f"the smallest valid value is {max_length}")
        if self.tokens_per_step is not None and self.accumulate is not None:
            raise UsageError("give --accumulate or --tokens-per-step, not both "
                             "(--tokens-per-step chooses the accumulation)")
        if self.tokens_per_step is not None and self.tokens_per_step < max_length:
            raise UsageError(f"--tokens-per-step {self.tokens_per_step} is below --max-length "
                             f"{max_length}: a longest pair would not fit in a step; the "
                             f"smallest valid value is {max_length} (on one replica)")

    def budget(self, replicas: int, max_length: int) -> StepBudget:
        """The step's budget on `replicas` replicas (after `check`).

        Raises:
            UsageError: a micro-batch would be smaller than `max_length`, naming the flag
                and its smallest valid value.
        """
        if self.tokens_per_step is None:
            return StepBudget(self.tokens_per_batch, replicas, self.accumulate or 1)
        total = self.tokens_per_step
        accumulate = math.ceil(total / (self.tokens_per_batch * replicas))
        micro_batch = total // (replicas * accumulate)
        if micro_batch < max_length:
            # With this accumulation it takes replicas x accumulate x max_length; fewer
            # micro-batches would need a step below `total`.
            smallest = replicas * accumulate * max_length
            raise UsageError(
                f"--tokens-per-step {total} over {replicas} replica(s) x {accumulate} "
                f"micro-batch(es) leaves {micro_batch} tokens per micro-batch, below "
                f"--max-length {max_length}: a longest pair would not fit; the smallest valid "
                f"--tokens-per-step from {total} up on {replicas} replica(s) is {smallest}")
        return StepBudget(micro_batch, replicas, accumulate)


@dataclasses.dataclass
class ModelConfig:
    """A preset (`keras_transformer.model.config.PRESETS`) and overrides of its fields."""

    preset: str = _setting("small", "small: 3 layers, d_model 256 (Multi30k); base/big: paper "
                           "Table 3", choices=("tiny", "small", "base", "big"))
    num_layers: int | None = _setting(None, "encoder and decoder layers (N)", positive)
    d_model: int | None = _setting(None, "model width", positive)
    num_heads: int | None = _setting(None, "attention heads (divide d_model)", positive)
    d_ff: int | None = _setting(None, "feed-forward inner width", positive)
    dropout: float | None = _setting(None, "residual/embedding dropout (P_drop)", fraction)
    attention_dropout: float | None = _setting(None, "dropout on attention weights", fraction)
    activation: str | None = _setting(None, "feed-forward activation", choices=("relu", "gelu"))
    pre_norm: bool | None = _setting(None, "layer norm before each sublayer instead of after "
                                     "(paper: after)")

    def transformer(self, vocab_size: int) -> TransformerConfig:
        """The model's hyperparameters: the preset, these overrides and `vocab_size`.

        Raises:
            UsageError: an invalid combination (e.g. heads that do not divide d_model).
        """
        overrides = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                     if field.name != "preset" and getattr(self, field.name) is not None}
        try:
            return transformer_config(self.preset, vocab_size=vocab_size, **overrides)
        except ValueError as error:
            raise UsageError(f"model: {error}") from None


@dataclasses.dataclass
class OptimizationConfig:
    """5.3 Adam with the warmup schedule, 5.4 label smoothing, when to stop, precision."""

    label_smoothing: float = _setting(0.1, "epsilon_ls", fraction)
    warmup_steps: int = _setting(4000, "learning rate warmup (paper: 4000; fewer suit short CPU "
                                 "runs)", positive)
    lr_scale: float = _setting(1.0, "multiplies the paper's learning rate schedule", positive)
    max_steps: int | None = _setting(None, f"optimizer steps (default {DEFAULT_MAX_STEPS} "
                                     "unless --epochs)", positive)
    epochs: float | None = _setting(None, "passes over the training data (converted to steps)",
                                    positive)
    max_minutes: float | None = _setting(None, "wall-clock budget for training "
                                         "(evaluation/export come after)", positive)
    seed: int = _setting(0, "seeds initialization, shuffling and the vocabulary", non_negative)
    precision: str = _setting(
        "auto", "auto: mixed_bfloat16 on GPUs of compute capability >= 8.0 and on CPUs with "
        "AVX512_BF16/AMX, mixed_float16 (dynamic loss scaling) on older GPUs, float32 "
        "otherwise", choices=PRECISIONS)
    initial_loss_scale: float = _setting(
        2.0**15, "mixed_float16 only: the dynamic loss scale's start. A step whose gradients "
        "overflow changes nothing and halves it, and still counts as a step (results.json: "
        "skipped_updates)", positive)
    jit_compile: str = _setting(
        "auto", "XLA-compile the train step: auto = on with GPUs, off on CPUs (slower there: "
        "BENCHMARKS.md). With XLA, batches come in a bounded set of shapes (coarser buckets, "
        "full batches), each compiled once", choices=JIT_CHOICES)
    backend: str = _setting(
        "tensorflow", "Keras backend of the training: jax trains (XLA always) from the prepared "
        "folder with numpy input, then scoring and export run under TensorFlow (README: which "
        "backend does what)", choices=BACKENDS)


@dataclasses.dataclass
class EvaluationConfig:
    """Validation, the weights kept (6.1: the average of the last checkpoints), test BLEU."""

    validate_every: int | None = _setting(None, "steps between validations (default: "
                                          "--checkpoint-every)", positive)
    patience: int = _setting(10, "stop after this many validations without improvement "
                             "(0 = never)", non_negative)
    average_last: int = _setting(
        5, "average the last N checkpoints (paper: 5); model.keras gets the average, or the "
        "best checkpoint if that has the lower validation loss", positive)
    beam: int = _setting(4, "beam size for test BLEU (and the export)", positive)
    alpha: float = _setting(0.6, "length penalty for test BLEU (and the export)",
                            non_negative)
    choose_by: str = _setting(
        "loss", "what chooses on the val split: 'loss' picks the final weights (averages and "
        "the best checkpoint) by exact validation loss; 'bleu' picks them by val BLEU at "
        "--beam/--alpha, then the beam and alpha for test and the export among "
        "--val-beams x --val-alphas (a few val decodings: minutes on small data)",
        choices=("loss", "bleu"))
    val_beams: str = _setting("", "with --choose-by bleu: beam sizes tried on val, "
                              "comma-separated (default: --beam)", check=int_list)
    val_alphas: str = _setting("", "with --choose-by bleu: length penalties tried on val, "
                               "comma-separated (default: --alpha)", check=float_list)


@dataclasses.dataclass
class OutputConfig:
    """The run directory, how often it is checkpointed, and the SavedModel export."""

    out: str = _setting(help="run directory")
    checkpoint_every: int = _setting(200, "steps between checkpoints (and resumable backups)",
                                     positive)
    export_dir: str | None = _setting(None, "SavedModel base (default saved_models/<run name>)")
    no_export: bool = _setting(False, "skip the SavedModel export")
    overwrite: bool = _setting(False, "delete an existing run directory and start over")
    resume: bool = _setting(False, "require an interrupted run to resume (it is resumed anyway "
                            "if found)")
    verbose: bool = _setting(False, "also show TensorFlow's own C++ logs and Keras' "
                             "per-interval lines (hidden by default, unless you set "
                             "TF_CPP_MIN_LOG_LEVEL yourself)")


@dataclasses.dataclass
class ClusterConfig:
    """Several machines (`TF_CONFIG`): see `keras_transformer.cluster.workers`."""

    join_timeout: float = _setting(DEFAULT_JOIN_TIMEOUT, "seconds each worker waits for all "
                                   "the others to start", positive)


@dataclasses.dataclass
class TrainConfig:
    """Every setting of a training run (`python -m keras_transformer.train`, `run_training`).

    Build one from flag names with `train_config(recipe=..., data=..., src=..., ...)`, or from
    its components. `flags()` is the flat mapping that config.json records.
    """

    data: DataConfig
    output: OutputConfig
    batches: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optimization: OptimizationConfig = dataclasses.field(default_factory=OptimizationConfig)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    recipe: str | None = None

    def flags(self) -> dict[str, Any]:
        """{flag name (underscores): value} of every setting, `recipe` included."""
        values = {"recipe": self.recipe}
        for component in COMPONENTS:
            values.update(dataclasses.asdict(getattr(self, component)))
        return values

    def check(self) -> TransformerConfig:
        """The checks across settings (each value was checked alone when it was set); returns
        the model's `TransformerConfig`.

        Raises:
            UsageError: with a message saying what to change.
        """
        for name, value in self.flags().items():
            check_value(name, value)
        if self.optimization.max_steps is not None and self.optimization.epochs is not None:
            raise UsageError("give --max-steps or --epochs, not both")
        self.data.check()
        self.batches.check(self.data.max_length)
        if self.output.overwrite and self.output.resume:
            raise UsageError("--overwrite and --resume contradict each other")
        return self.model.transformer(self.data.vocab_size)

    @property
    def validate_every(self) -> int:
        """Steps between validations (`--validate-every`, else `--checkpoint-every`)."""
        return self.evaluation.validate_every or self.output.checkpoint_every


# TrainConfig's component fields, in the order of the command's help.
COMPONENTS = ("data", "batches", "model", "optimization", "evaluation", "output", "cluster")
COMPONENT_TYPES = {"data": DataConfig, "batches": BatchConfig, "model": ModelConfig,
                    "optimization": OptimizationConfig, "evaluation": EvaluationConfig,
                    "output": OutputConfig, "cluster": ClusterConfig}


def setting_fields(component: type | None = None
                   ) -> Iterator[tuple[str, type, dataclasses.Field]]:
    """(component name, component class, field) of every setting, or of one component."""
    for name, cls in COMPONENT_TYPES.items():
        if component is None or cls is component:
            for field in dataclasses.fields(cls):
                yield name, cls, field


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolves every annotation of `cls`: once per class


def field_type(cls: type, field: dataclasses.Field) -> type:
    """The value type of a field (`int | None` -> int)."""
    hint = _type_hints(cls)[field.name]
    options = [option for option in typing.get_args(hint) if option is not type(None)]
    return options[0] if options else hint


def check_value(name: str, value: Any) -> None:
    """Checks one setting's value as its flag's parsing would.

    Raises:
        UsageError: naming the flag, e.g. "--vocab-size must be positive, got 0".
    """
    owner = _OWNERS.get(name)
    if owner is None or value is None:
        return
    component, field = owner
    expected = field_type(COMPONENT_TYPES[component], field)
    flag = "--" + name.replace("_", "-")
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise UsageError(f"{flag} must be {expected.__name__}, got {value!r}")
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise UsageError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
    check = field.metadata.get("check")
    problem = check(value) if check else None
    if problem:
        raise UsageError(f"{flag} {problem}, got {value!r}")


_OWNERS = {field.name: (component, field) for component, _, field in setting_fields()}


def train_config(recipe: str | None = None, **flags: Any) -> TrainConfig:
    """A `TrainConfig` from flag names and values, as `python -m keras_transformer.train` builds
    it: the recipe's values replace the defaults, and `flags` win over both.

    Example:
        config = train_config(recipe="multi30k", data="../shared/data/multi30k", src="de",
                              tgt="en", out="runs/multi30k-de-en")

    Args:
        recipe: a name in `keras_transformer.training.recipes.RECIPES`, or None.
        **flags: settings by flag name with underscores (`vocab_size=8000`); `data`, `src`,
            `tgt` and `out` are required.

    Raises:
        UsageError: an unknown recipe or setting, a missing required one, or a value its
            flag would refuse.
    """
    values = _settings(recipe, flags, _OWNERS, "train")
    parts: dict[str, dict[str, Any]] = {component: {} for component in COMPONENTS}
    for name, value in values.items():
        parts[_OWNERS[name][0]][name] = value
    return TrainConfig(recipe=recipe, **{component: COMPONENT_TYPES[component](**parts[component])
                                         for component in COMPONENTS})


def data_config(recipe: str | None = None, **flags: Any) -> DataConfig:
    """The `DataConfig` of `python -m keras_transformer.prepare`: its share of the settings
    (`PREPARE_FIELDS`), built as `train_config` builds a `TrainConfig`.

    Raises:
        UsageError: as `train_config`.
    """
    return DataConfig(**_settings(recipe, flags, PREPARE_FIELDS, "prepare"))


def _settings(recipe: str | None, flags: Mapping[str, Any], known, command: str
              ) -> dict[str, Any]:
    """The recipe's values of the settings in `known`, then `flags` over them, each checked
    as its flag would check it, the required ones present.

    Raises:
        UsageError: an unknown recipe or setting, a missing required one, a refused value.
    """
    if recipe is not None and recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}; choose one of {', '.join(sorted(RECIPES))}")
    unknown = sorted(set(flags) - set(known))
    if unknown:
        raise UsageError(f"unknown setting(s) {', '.join(unknown)}; see `python -m "
                         f"keras_transformer.{command} --help` (flag names with underscores)")
    recipe_values = {name: value for name, value in RECIPES.get(recipe, {}).items()
                     if name in known}
    values: dict[str, Any] = {**recipe_values, **flags}
    for name, value in values.items():
        check_value(name, value)
    missing = [f"--{field.name}" for _, _, field in setting_fields()
               if field.name in known and field.default is dataclasses.MISSING
               and field.name not in values]
    if missing:
        raise UsageError(f"{', '.join(missing)} required")
    return values


def config_from_flags(flags: Mapping[str, Any]) -> TrainConfig:
    """The `TrainConfig` of `TrainConfig.flags()` (a run's config.json "arguments")."""
    flags = dict(flags)
    recipe = flags.pop("recipe", None)
    # Rebuilt from the values themselves, not from the recipe's (which may change later).
    config = train_config(**flags)
    config.recipe = recipe
    return config
