"""The learning-rate schedule and optimizer of paper 5.3."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.training.optimizer import (
    FusedAdam,
    NoamSchedule,
    cooldown_start,
    paper_adam,
)

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
    assert config == {"d_model": 256, "warmup_steps": 8000, "scale": 2.0, "total_steps": None,
                      "cooldown": 0.0}
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
    assert schedule["config"] == {"d_model": D_MODEL, "warmup_steps": WARMUP, "scale": 1.5,
                                  "total_steps": None, "cooldown": 0.0}
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
        "d_model": D_MODEL, "warmup_steps": 4000, "scale": 1.0, "total_steps": None,
        "cooldown": 0.0
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


# --- FusedAdam: keras' Adam with one fused kernel per dense variable ---
# Same hyperparameters, initial values and gradients; after STEPS updates the variables agree
# to 1e-6 (float32 round-off of the two formulations; one step moves them by up to ~1e-2).

STEPS = 4
ADAM_ATOL = 1e-6
SHAPES = [(4, 3), (3,)]
ADAM_SETTINGS = {
    "constant_rate": lambda: dict(learning_rate=0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-7),
    "paper": lambda: dict(learning_rate=NoamSchedule(16, warmup_steps=2), beta_1=0.9,
                          beta_2=0.98, epsilon=1e-9),
}


def initial_values(shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype("float32") for shape in shapes]


def gradient_steps(shapes=SHAPES, seed=1):
    """STEPS lists of per-variable gradients, of mixed signs and magnitudes."""
    rng = np.random.default_rng(seed)
    return [[(rng.normal(size=shape) * rng.choice([0.01, 1.0, 10.0])).astype("float32")
             for shape in shapes] for _ in range(STEPS)]


def train(optimizer_fn, values, loss_fn, steps, strategy=None, gradient_types=None):
    """Variables after `apply_gradients` in a tf.function, one call per element of `steps`.

    The gradients are those of `loss_fn(variables, step)`, taken inside the replica under
    `strategy` (whose scope then holds the variables and the optimizer too); their types
    are appended to `gradient_types` if given.
    """
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        variables = [keras.Variable(value) for value in values]
        optimizer = optimizer_fn()

    def replica_step(step):
        with tf.GradientTape() as tape:
            loss = loss_fn(variables, step)
        gradients = tape.gradient(loss, variables)
        if gradient_types is not None:
            gradient_types.extend(type(gradient) for gradient in gradients)
        optimizer.apply_gradients(zip(gradients, variables, strict=True))

    @tf.function
    def train_step(step):
        strategy.run(replica_step, args=(step,))

    for step in steps:
        train_step(step)
    assert int(optimizer.iterations.numpy()) == len(steps)
    return [variable.numpy() for variable in variables], optimizer


def linear_loss(variables, gradients):
    """A loss whose gradient with respect to each variable is the given one."""
    return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, gradients, strict=True)])


@pytest.fixture
def fused_kernel_calls(monkeypatch):
    """Shapes of the gradients that `tf.raw_ops.ResourceApplyAdam` is traced with."""
    calls = []
    apply_adam = tf.raw_ops.ResourceApplyAdam

    def spy(**kwargs):
        calls.append(tuple(kwargs["grad"].shape))
        return apply_adam(**kwargs)

    monkeypatch.setattr(tf.raw_ops, "ResourceApplyAdam", spy)
    return calls


def assert_variables_match(fused, reference, values):
    for a, b, initial in zip(fused, reference, values, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=ADAM_ATOL)
        assert np.abs(a - initial).max() > 1e-3  # the updates are not vacuous


@pytest.mark.parametrize("settings", ADAM_SETTINGS.values(), ids=ADAM_SETTINGS.keys())
def test_fused_adam_matches_keras_adam(settings, fused_kernel_calls):
    values, steps = initial_values(), gradient_steps()
    fused, optimizer = train(lambda: FusedAdam(**settings()), values, linear_loss, steps)
    reference, keras_optimizer = train(lambda: keras.optimizers.Adam(**settings()), values,
                                       linear_loss, steps)
    assert sorted(set(fused_kernel_calls)) == sorted(SHAPES)  # the fused kernel did the update
    assert_variables_match(fused, reference, values)
    # The optimizer state is keras' too (so checkpoints of either load into the other): the
    # same variables, in the same order, holding the same iteration count and moments.
    state = [(v.name.rsplit("_", 1)[-1], v.shape, v.dtype) for v in optimizer.variables]
    assert state == [(v.name.rsplit("_", 1)[-1], v.shape, v.dtype)
                     for v in keras_optimizer.variables]
    assert [name for name, _, _ in state].count("momentum") == len(SHAPES)
    for v, keras_v in zip(optimizer.variables, keras_optimizer.variables, strict=True):
        np.testing.assert_allclose(v.numpy(), keras_v.numpy(), rtol=1e-6, atol=ADAM_ATOL)


def test_paper_adam_is_fused_and_matches_keras_adam(fused_kernel_calls):
    values, steps = initial_values(), gradient_steps()
    fused, optimizer = train(lambda: paper_adam(16, warmup_steps=2), values, linear_loss, steps)
    assert type(optimizer) is FusedAdam
    assert fused_kernel_calls
    reference, _ = train(
        lambda: keras.optimizers.Adam(NoamSchedule(16, 2), beta_1=0.9, beta_2=0.98, epsilon=1e-9),
        values, linear_loss, steps)
    assert_variables_match(fused, reference, values)


def test_fused_adam_matches_keras_adam_under_mirrored_strategy(fused_kernel_calls):
    strategy = tf.distribute.MirroredStrategy()  # the one CPU
    values, steps = initial_values(), gradient_steps()
    settings = ADAM_SETTINGS["constant_rate"]
    fused, optimizer = train(lambda: FusedAdam(**settings()), values, linear_loss, steps, strategy)
    assert isinstance(optimizer.variables[-1].value, tf.distribute.DistributedValues)
    assert sorted(set(fused_kernel_calls)) == sorted(SHAPES)
    reference, _ = train(lambda: keras.optimizers.Adam(**settings()), values, linear_loss, steps,
                         strategy)
    assert_variables_match(fused, reference, values)
    # And the same as without a strategy.
    alone, _ = train(lambda: FusedAdam(**settings()), values, linear_loss, steps)
    assert_variables_match(fused, alone, values)


def test_sparse_gradients_use_keras_update(fused_kernel_calls):
    table_shape, bias_shape = (5, 3), (3,)
    values = initial_values([table_shape, bias_shape])
    rows = tf.constant([0, 3, 0])  # row 0 twice, rows 1, 2 and 4 never
    steps = gradient_steps([(3, 3), bias_shape])

    def gather_loss(variables, gradients):
        table, bias = variables
        return tf.reduce_sum(tf.gather(table, rows) * gradients[0]) + tf.reduce_sum(
            bias * gradients[1])

    settings = ADAM_SETTINGS["constant_rate"]
    gradient_types = []
    fused, _ = train(lambda: FusedAdam(**settings()), values, gather_loss, steps,
                     gradient_types=gradient_types)
    assert gradient_types[0] is tf.IndexedSlices and gradient_types[1] is not tf.IndexedSlices
    reference, _ = train(lambda: keras.optimizers.Adam(**settings()), values, gather_loss, steps)
    # Only the dense bias went through the fused kernel; the table's IndexedSlices did not.
    assert set(fused_kernel_calls) == {bias_shape}
    np.testing.assert_allclose(fused[0], reference[0], rtol=0, atol=ADAM_ATOL)
    assert_variables_match(fused[1:], reference[1:], values[1:])
    moved = np.abs(fused[0] - values[0]).max(axis=1) > 1e-3
    assert moved.tolist() == [True, False, False, True, False]


def test_amsgrad_uses_keras_update(fused_kernel_calls):
    values, steps = initial_values(), gradient_steps()
    settings = dict(ADAM_SETTINGS["constant_rate"](), amsgrad=True)
    fused, _ = train(lambda: FusedAdam(**settings), values, linear_loss, steps)
    reference, _ = train(lambda: keras.optimizers.Adam(**settings), values, linear_loss, steps)
    assert not fused_kernel_calls
    assert_variables_match(fused, reference, values)
    # amsgrad changes the result (else this test would not tell the two updates apart).
    plain, _ = train(lambda: keras.optimizers.Adam(**ADAM_SETTINGS["constant_rate"]()), values,
                     linear_loss, steps)
    assert max(np.abs(a - b).max() for a, b in zip(fused, plain, strict=True)) > 1e-4


def test_fused_adam_serialization_round_trip():
    optimizer = paper_adam(D_MODEL, warmup_steps=WARMUP, scale=1.5, clipnorm=1.0)
    config = json.loads(json.dumps(keras.optimizers.serialize(optimizer)))
    restored = keras.optimizers.deserialize(config)
    assert type(restored) is FusedAdam
    assert restored.get_config() == optimizer.get_config()
    assert isinstance(restored._learning_rate, NoamSchedule)
    clone = FusedAdam.from_config(FusedAdam(0.5, beta_2=0.9, amsgrad=True).get_config())
    assert type(clone) is FusedAdam
    assert (clone.beta_2, clone.amsgrad) == (0.9, True)
    assert float(keras.ops.convert_to_numpy(clone.learning_rate)) == pytest.approx(0.5)


def test_the_cooldown_begins_where_cooldown_start_says_and_ends_at_zero():
    schedule = NoamSchedule(64, warmup_steps=10, total_steps=100, cooldown=0.2)
    plain = NoamSchedule(64, warmup_steps=10)
    start = cooldown_start(100, 0.2)
    assert start == pytest.approx(80.0)
    assert rate(schedule, 80) == pytest.approx(rate(plain, 80), rel=1e-6)
    assert rate(schedule, 90) == pytest.approx(0.5 * rate(plain, 90), rel=1e-5)
    assert rate(schedule, 100) == 0.0
    # The schedule's own arithmetic, not a rounded one: 90 * (1 - 0.7) is 62.99...
    assert cooldown_start(90, 0.7) == 90 - 0.7 * 90 < 63
    assert cooldown_start(100, 0.0) is None and cooldown_start(None, 0.2) is None


def test_fused_adam_makes_its_scalar_inputs_once_per_update():
    """The step count's powers, rate, betas and epsilon are made once for all variables of
    a dtype (not once per variable: 8 ops less each to trace), and the update's cache is
    gone after it."""
    shapes = [(4, 3), (3,), (2, 2)]
    variables = [keras.Variable(value) for value in initial_values(shapes)]
    optimizer = FusedAdam(**ADAM_SETTINGS["constant_rate"]())
    optimizer.build(variables)

    @tf.function
    def step(gradients):
        optimizer.apply_gradients(zip(gradients, variables, strict=True))

    gradients = [tf.constant(g) for g in gradient_steps(shapes)[0]]
    graph = step.get_concrete_function(gradients).graph
    kinds = [op.type for op in graph.get_operations()]
    assert kinds.count("ResourceApplyAdam") == len(shapes)
    assert kinds.count("Pow") == 2  # beta_1 ** step and beta_2 ** step, for all three
    step(gradients)
    assert optimizer._shared_scalars is None
    reference, _ = train(lambda: keras.optimizers.Adam(**ADAM_SETTINGS["constant_rate"]()),
                         initial_values(shapes), linear_loss, gradient_steps(shapes)[:1])
    for variable, expected in zip(variables, reference, strict=True):
        np.testing.assert_allclose(variable.numpy(), expected, rtol=0, atol=ADAM_ATOL)
