"""The typed run configuration: `train_config` builds a `TrainConfig` as the train command does
(a recipe's values, then the settings given), refuses what its flags would refuse, and
`flags()` is the flat mapping config.json records and `config_from_flags` reads back."""

from __future__ import annotations

import dataclasses
import json

import pytest

from keras_transformer.errors import UsageError
from keras_transformer.flags import build_train_parser, parse_train_args
from keras_transformer.training.config import (
    COMPONENTS,
    PREPARE_FIELDS,
    BatchConfig,
    TrainConfig,
    config_from_flags,
    data_config,
    setting_fields,
    train_config,
)
from keras_transformer.training.recipes import RECIPES

REQUIRED = dict(data="corpus", src="de", tgt="en", out="runs/x")


def test_a_recipe_sets_defaults_and_the_settings_given_win():
    plain = train_config(**REQUIRED)
    assert plain.recipe is None and plain.model.dropout is None
    assert plain.optimization.warmup_steps == 4000
    config = train_config(recipe="multi30k", **REQUIRED, dropout=0.3, max_steps=9)
    assert (config.model.dropout, config.optimization.max_steps) == (0.3, 9)
    assert config.optimization.warmup_steps == RECIPES["multi30k"]["warmup_steps"]
    assert config.check().dropout == 0.3  # the model's hyperparameters, overrides applied


@pytest.mark.parametrize(("settings", "message"), [
    (dict(vocab_size=0), "--vocab-size must be positive, got 0"),
    (dict(dropout=1.5), "--dropout must be in [0, 1), got 1.5"),
    (dict(precision="fp8"), "--precision must be one of"),
    (dict(max_steps="10"), "--max-steps must be int"),
    (dict(max_steps=True), "--max-steps must be int"),
    (dict(vocab_sise=10), "unknown setting(s) vocab_sise"),
])
def test_values_the_flags_would_refuse_are_refused_in_python_too(settings, message):
    with pytest.raises(UsageError) as raised:
        train_config(**REQUIRED, **settings)
    assert message in str(raised.value)


def test_required_settings_and_unknown_recipes_are_named():
    with pytest.raises(UsageError, match="--out required"):
        train_config(data="corpus", src="de", tgt="en")
    with pytest.raises(UsageError, match="unknown recipe 'nosuch'"):
        train_config(recipe="nosuch", **REQUIRED)


def test_checks_across_settings_say_what_to_change():
    with pytest.raises(UsageError, match="not both"):
        train_config(**REQUIRED, max_steps=5, epochs=1.0).check()
    with pytest.raises(UsageError, match="divisible"):
        train_config(**REQUIRED, d_model=30, num_heads=4).check()
    config = train_config(**REQUIRED)
    config.data.vocab_size = -1  # set on the dataclass directly: check() still catches it
    with pytest.raises(UsageError, match="--vocab-size must be positive"):
        config.check()


def test_flags_round_trip_through_json_as_config_json_records_them():
    config = train_config(recipe="paper-base", **REQUIRED, max_minutes=30.0, pre_norm=True)
    recorded = json.loads(json.dumps(config.flags()))
    assert config_from_flags(recorded) == config
    assert set(recorded) == {"recipe"} | {field.name for _, _, field in setting_fields()}


def test_the_command_line_and_python_build_the_same_config():
    config, dry_run = parse_train_args(["--recipe", "multi30k", "--data", "corpus", "--src", "de",
                                        "--tgt", "en", "--out", "runs/x", "--dropout", "0.3",
                                        "--pre-norm", "--no-export"])
    assert not dry_run
    assert config == train_config(recipe="multi30k", **REQUIRED, dropout=0.3, pre_norm=True,
                                  no_export=True)


def test_every_setting_is_a_flag_with_help_and_each_component_a_group():
    parser = build_train_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    for _, _, field in setting_fields():
        assert "--" + field.name.replace("_", "-") in flags, field.name
        assert field.metadata["help"], field.name
    titles = [group.title for group in parser._action_groups]
    assert len(titles) == 2 + len(COMPONENTS)  # argparse's own two, then one per component
    assert [field.name for field in dataclasses.fields(TrainConfig)][:2] == ["data", "output"]


@pytest.mark.parametrize(
    ("flags", "replicas", "expected"),
    [
        # The paper's step on 1, 2 and 8 devices with the same flags: ~25,000 tokens.
        (dict(tokens_per_step=25000), 1, (3571, 7, 24997)),
        (dict(tokens_per_step=25000), 2, (3125, 4, 25000)),
        (dict(tokens_per_step=25000), 8, (3125, 1, 25000)),
        (dict(accumulate=4), 2, (4096, 4, 32768)),
        (dict(), 8, (4096, 1, 32768)),
    ],
)
def test_step_budget_spreads_a_step_over_replicas_and_micro_batches(flags, replicas, expected):
    batches = BatchConfig(**{"tokens_per_batch": 4096, "tokens_per_step": None,
                             "accumulate": None, **flags})
    budget = batches.budget(replicas, max_length=128)
    assert (budget.micro_batch, budget.accumulate, budget.tokens_per_step) == expected
    assert budget.replicas == replicas
    assert budget.global_micro_batch == budget.micro_batch * replicas


def test_step_budget_refuses_micro_batches_below_max_length_naming_the_smallest_step():
    batches = BatchConfig(tokens_per_batch=4096, tokens_per_step=200, accumulate=None)
    with pytest.raises(UsageError, match="from 200 up on 2 replica.s. is 256"):
        batches.budget(2, max_length=128)
    batches.tokens_per_step = 256
    assert batches.budget(2, max_length=128).micro_batch == 128


def test_prepare_takes_its_share_of_the_settings_as_train_does():
    data = data_config("paper-base", data="corpus", src="en", tgt="de", max_length=128)
    assert (data.vocab_size, data.max_length) == (37000, 128)  # the recipe's, then the flag's
    train = train_config(recipe="paper-base", **{**REQUIRED, "src": "en", "tgt": "de"},
                         max_length=128).data
    assert all(getattr(data, name) == getattr(train, name) for name in PREPARE_FIELDS)
    with pytest.raises(UsageError, match="unknown setting.s. out; .*keras_transformer.prepare"):
        data_config(data="corpus", src="en", tgt="de", out="runs/x")
    with pytest.raises(UsageError, match="--vocab-size must be positive"):
        data_config(data="corpus", src="en", tgt="de", vocab_size=0)


def test_the_back_translation_recipe_needs_its_synthetic_pairs():
    config = train_config(recipe="multi30k-bt", data="d", src="de", tgt="en", out="o")
    assert (config.data.upsample_real, config.data.synthetic_tag) == (5, "<BT>")
    with pytest.raises(UsageError, match="--synthetic FOLDER"):
        config.check()
    train_config(recipe="multi30k-bt", data="d", src="de", tgt="en", out="o",
                 synthetic="bt").check()
