"""`TrainConfig`, every setting of a run, made of the components, and how it is built from
flag values (`train_config`, `data_config`, `config_from_flags`) and checked (`check_value`)."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from keras_transformer.errors import UsageError
from keras_transformer.model.config import TransformerConfig
from keras_transformer.training.config.batches import BatchConfig
from keras_transformer.training.config.data import PREPARE_FIELDS, DataConfig
from keras_transformer.training.config.evaluation import EvaluationConfig
from keras_transformer.training.config.model import ModelConfig
from keras_transformer.training.config.optimization import OptimizationConfig
from keras_transformer.training.config.output import ClusterConfig, OutputConfig
from keras_transformer.training.recipes import AUTO, RECIPES


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
    # The settings given as flags (or by name in Python), which --recipe auto leaves alone.
    given: frozenset[str] = dataclasses.field(default_factory=frozenset, compare=False)

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
        if self.recipe == "multi30k-bt" and not self.data.synthetic:
            raise UsageError("--recipe multi30k-bt trains on real and back-translated pairs: "
                             "give --synthetic FOLDER (made by `python -m keras_transformer."
                             "back_translate`: docs/back_translation.md)")
        self._check_budget()
        if self.model.init_from and self.data.tokenizer_data:
            raise UsageError("--tokenizer-data trains a new vocabulary; --init-from keeps the "
                             "trained run's: give one or the other")
        if self.output.overwrite and self.output.resume:
            raise UsageError("--overwrite and --resume contradict each other")
        return self.model.transformer(self.data.vocab_size)

    def _check_budget(self) -> None:
        """--budget-* belong to --recipe auto, which needs one of them."""
        optimization = self.optimization
        budgets = [flag for flag, value in (("--budget-minutes", optimization.budget_minutes),
                                            ("--budget-steps", optimization.budget_steps))
                   if value is not None]
        if self.recipe != AUTO:
            extra = budgets + (["--assume-step-seconds"]
                               if optimization.assume_step_seconds is not None else [])
            if extra:
                raise UsageError(f"{', '.join(extra)} size a --recipe auto run; add --recipe "
                                 "auto, or give --max-steps/--max-minutes instead")
            return
        if len(budgets) != 1:
            raise UsageError("--recipe auto needs one budget: --budget-minutes M (the whole "
                             "command, measured on this machine) or --budget-steps N (the same "
                             "run anywhere)" + (", not both" if budgets else ""))
        if "max_steps" in self.given or "epochs" in self.given:
            raise UsageError("--recipe auto sets the steps from its budget: give "
                             "--budget-steps N instead of --max-steps/--epochs")

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


def component_of(name: str) -> str:
    """The `TrainConfig` component ("data", "model", ...) that holds setting `name`."""
    return _OWNERS[name][0]


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
    return TrainConfig(recipe=recipe, given=frozenset(flags),
                       **{component: COMPONENT_TYPES[component](**parts[component])
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
