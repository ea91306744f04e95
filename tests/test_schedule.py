"""The learning-rate schedule and optimizer of paper 5.3."""

import json

import keras
import numpy as np
import pytest

from keras_transformer.schedule import NoamSchedule, paper_adam

D_MODEL, WARMUP = 512, 4000


def paper_rate(step, d_model=D_MODEL, warmup=WARMUP):
    """lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)  (paper eq. 3)."""
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def rate(schedule, step):
    return float(keras.ops.convert_to_numpy(schedule(step)))


@pytest.fixture(scope="module")
def schedule():
    return NoamSchedule(D_MODEL, WARMUP)


@pytest.mark.parametrize("step", [1, 4000, 100000])
def test_matches_paper_formula(schedule, step):
    assert rate(schedule, step) == pytest.approx(paper_rate(step), rel=1e-6)


def test_known_values(schedule):
    # The peak, at the end of warmup: 512^-0.5 * 4000^-0.5.
    assert rate(schedule, 4000) == pytest.approx(6.98771e-4, rel=1e-5)
    assert rate(schedule, 4000) > rate(schedule, 3999)
    assert rate(schedule, 4000) > rate(schedule, 4001)
    # Step 0 (the optimizer's first iteration) uses the rate of step 1, not 0 or inf.
    assert rate(schedule, 0) == pytest.approx(paper_rate(1), rel=1e-6)


@pytest.mark.parametrize("step", [1, 7, 100, 1000, 1999])
def test_warmup_is_linear(schedule, step):
    assert rate(schedule, 2 * step) == pytest.approx(2 * rate(schedule, step), rel=1e-5)


@pytest.mark.parametrize("step", [4000, 10000, 25000])
def test_decays_with_inverse_square_root_after_warmup(schedule, step):
    assert rate(schedule, 4 * step) == pytest.approx(rate(schedule, step) / 2, rel=1e-5)
    assert rate(schedule, step) == pytest.approx(D_MODEL**-0.5 * step**-0.5, rel=1e-5)


def test_accepts_integer_tensor_steps(schedule):
    steps = keras.ops.convert_to_tensor([1, 4000, 100000], "int64")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(schedule(steps)),
        [paper_rate(1), paper_rate(4000), paper_rate(100000)],
        rtol=1e-6,
    )


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_scale_multiplies_rate(schedule, scale):
    scaled = NoamSchedule(D_MODEL, WARMUP, scale=scale)
    for step in (1, 2000, 4000, 50000):
        assert rate(scaled, step) == pytest.approx(scale * rate(schedule, step), rel=1e-6)


def test_get_config_from_config(schedule):
    config = NoamSchedule(256, warmup_steps=8000, scale=2.0).get_config()
    assert config == {"d_model": 256, "warmup_steps": 8000, "scale": 2.0}
    clone = NoamSchedule.from_config(config)
    assert rate(clone, 5000) == pytest.approx(2.0 * paper_rate(5000, 256, 8000), rel=1e-6)
    restored = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(keras.saving.serialize_keras_object(schedule)))
    )
    assert isinstance(restored, NoamSchedule)
    assert restored.get_config() == schedule.get_config()


def test_serializes_inside_adam_config():
    optimizer = paper_adam(D_MODEL, warmup_steps=WARMUP, scale=1.5)
    config = json.loads(json.dumps(keras.optimizers.serialize(optimizer)))
    restored = keras.optimizers.deserialize(config)
    assert isinstance(restored, keras.optimizers.Adam)
    schedule = restored.get_config()["learning_rate"]
    assert schedule["config"] == {"d_model": D_MODEL, "warmup_steps": WARMUP, "scale": 1.5}
    # Before any update (iterations = 0) the restored optimizer uses 1.5 x the step-1 rate.
    assert float(keras.ops.convert_to_numpy(restored.learning_rate)) == pytest.approx(
        1.5 * paper_rate(1), rel=1e-6
    )


def test_paper_adam_hyperparameters():
    optimizer = paper_adam(D_MODEL, clipnorm=1.0)
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert optimizer.beta_1 == 0.9
    assert optimizer.beta_2 == 0.98
    assert optimizer.epsilon == 1e-9
    assert optimizer.clipnorm == 1.0  # extra kwargs reach Adam
    assert optimizer.get_config()["learning_rate"]["config"] == {
        "d_model": D_MODEL, "warmup_steps": 4000, "scale": 1.0
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(d_model=0),
        dict(d_model=-512),
        dict(d_model=512, warmup_steps=0),
        dict(d_model=512, warmup_steps=-10),
        dict(d_model=512, scale=0.0),
        dict(d_model=512, scale=-1.0),
    ],
)
def test_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="must be positive"):
        NoamSchedule(**kwargs)
