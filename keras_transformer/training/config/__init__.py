"""A training run's settings as typed dataclasses, one per component (as fairseq's configs are).

`TrainConfig` holds everything `python -m keras_transformer.train` takes; its components are
`DataConfig` (`data.py`: the corpus and its preparation: `prepare` takes this part too), `BatchConfig`
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

One module a component (`data`, `batches`, `model`, `optimization`, `evaluation`, `output`),
`fields` for what they share, `train` for the whole; every name is importable from here.

Nothing here imports TensorFlow: `--help` and the checks run before it loads.
"""

from keras_transformer.training.config.batches import BatchConfig
from keras_transformer.training.config.data import PREPARE_FIELDS, DataConfig
from keras_transformer.training.config.evaluation import EvaluationConfig
from keras_transformer.training.config.fields import (
    comma_separated,
    float_list,
    fraction,
    int_list,
    non_negative,
    positive,
    setting,
)
from keras_transformer.training.config.model import ModelConfig
from keras_transformer.training.config.optimization import DEFAULT_MAX_STEPS, OptimizationConfig
from keras_transformer.training.config.output import ClusterConfig, OutputConfig
from keras_transformer.training.config.train import (
    COMPONENT_TYPES,
    COMPONENTS,
    TrainConfig,
    check_value,
    config_from_flags,
    data_config,
    field_type,
    setting_fields,
    train_config,
)

__all__ = ["BatchConfig", "COMPONENTS", "COMPONENT_TYPES", "ClusterConfig", "DEFAULT_MAX_STEPS",
           "DataConfig", "EvaluationConfig", "ModelConfig", "OptimizationConfig",
           "OutputConfig", "PREPARE_FIELDS", "TrainConfig", "check_value", "comma_separated",
           "config_from_flags", "data_config", "field_type", "float_list", "fraction",
           "int_list", "non_negative", "positive", "setting", "setting_fields", "train_config"]
