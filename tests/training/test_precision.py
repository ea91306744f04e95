"""Choosing the training precision and XLA from the hardware (`--precision auto`,
`--jit-compile auto`), and mixed float16 on CPUs whose TensorFlow sends float16 to oneDNN."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_transformer.training import precision
from keras_transformer.training.losses import LabelSmoothedCrossEntropy
from keras_transformer.training.precision import (
    cpu_sends_float16_to_onednn,
    describe_precision,
    float16_on_this_cpu,
    resolve_jit,
    resolve_precision,
)
from keras_transformer.training.trainer_model import build_trainer

SAPPHIRE_RAPIDS = "fpu avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile"


@pytest.mark.parametrize(
    ("flags", "gpus", "choice", "expected"),
    [
        ("fpu avx512f avx512_bf16 amx_tile", [], "auto", "mixed_bfloat16"),
        ("fpu avx2 amx_bf16", [], "auto", "mixed_bfloat16"),
        ("fpu avx2 avx512f", [], "auto", "float32"),
        ("fpu avx2", [(7, 0), (7, 0)], "auto", "mixed_float16"),  # V100: float16 + loss scaling
        ("fpu avx2", [(8, 0)], "auto", "mixed_bfloat16"),  # A100
        ("fpu avx2", [(9, 0)] * 8, "auto", "mixed_bfloat16"),  # H100
        ("fpu avx2", [(8, 6), (7, 5)], "auto", "mixed_float16"),  # mixed: the older decides
        ("fpu avx512_bf16", [], "float32", "float32"),
        ("fpu avx2", [(9, 0)], "mixed_float16", "mixed_float16"),
    ],
)
def test_precision_auto_follows_the_hardware(tmp_path, flags, gpus, choice, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert resolve_precision(choice, gpus, cpuinfo) == expected
    assert resolve_precision("auto", [], tmp_path / "missing") == "float32"


def test_the_log_says_why_auto_trains_in_float32_on_a_cpu():
    assert describe_precision("auto", "float32", 0) == (
        "float32 (precision auto: no avx512_bf16 or amx_bf16 in this CPU's flags)")
    # Asked for, or chosen for bfloat16 hardware or GPUs: just the name.
    assert describe_precision("float32", "float32", 0) == "float32"
    assert describe_precision("auto", "mixed_bfloat16", 0) == "mixed_bfloat16"
    assert describe_precision("auto", "mixed_float16", 2) == "mixed_float16"


def test_jit_auto_is_on_with_gpus_and_off_on_cpus():
    assert resolve_jit("auto", 0) is False and resolve_jit("auto", 8) is True
    assert resolve_jit("on", 0) is True and resolve_jit("off", 8) is False
    with pytest.raises(ValueError):
        resolve_jit("maybe", 0)


def _cpuinfo(tmp_path, flags: str):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    return cpuinfo


@pytest.mark.parametrize(("flags", "expected"), [
    (SAPPHIRE_RAPIDS, True),
    ("fpu avx512f avx512bw amx_fp16", True),
    ("fpu avx2 avx_ne_convert", True),  # AVX-512-less CPUs that convert float16 in hardware
    ("fpu avx512f avx512bw avx512_bf16", False),  # the AMD EPYC this project is checked on
    ("fpu avx512_fp16", False),  # TensorFlow also asks for AVX512BW
    ("fpu avx2", False),
])
def test_float16_goes_to_onednn_by_tensorflows_rule(tmp_path, flags, expected):
    assert cpu_sends_float16_to_onednn(_cpuinfo(tmp_path, flags)) is expected
    assert cpu_sends_float16_to_onednn(tmp_path / "missing") is False


def _remapping():
    return tf.config.optimizer.get_experimental_options().get("remapping")


@pytest.mark.parametrize("before", [None, True, False])
def test_the_remapper_is_off_inside_the_block_only_for_float16_on_such_a_cpu(
        tmp_path, caplog, before):
    saved = tf.config.optimizer.get_experimental_options()
    try:
        if before is not None:
            tf.config.optimizer.set_experimental_options({"remapping": before})
        cpuinfo = _cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
        with caplog.at_level(logging.INFO, "keras_transformer"):
            with float16_on_this_cpu("mixed_float16", 0, cpuinfo) as applied:
                assert applied is True and _remapping() is False
        assert "graph remapping off" in caplog.text
        assert _remapping() is (True if before is None else before)  # unset means on
        # Another precision, a GPU, another CPU: nothing changes.
        for args in (("mixed_bfloat16", 0, cpuinfo), ("float32", 0, cpuinfo),
                     ("mixed_float16", 1, cpuinfo),
                     ("mixed_float16", 0, _cpuinfo(tmp_path, "fpu avx512bw avx512_bf16"))):
            expected = _remapping()
            with float16_on_this_cpu(*args) as applied:
                assert applied is False and _remapping() is expected, args
    finally:
        tf.config.optimizer.set_experimental_options(
            {"remapping": saved.get("remapping", True)})


def test_a_float16_fit_on_such_a_cpu_trains_with_the_remapper_off(monkeypatch):
    """`TransformerTrainer.fit` applies it (the train command fits one), as do its
    `evaluate` and `predict`, and each puts the setting back after."""
    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo: set(SAPPHIRE_RAPIDS.split()))
    seen = []
    record = keras.callbacks.LambdaCallback(**{
        f"on_{mode}_batch_end": lambda *_, **__: seen.append(_remapping())
        for mode in ("train", "test", "predict")})
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 40, size=(4, 7)).astype("int32")
    inputs, labels = {"source": ids, "target": ids[:, :-1]}, ids[:, 1:]
    for policy, during in (("mixed_float16", False), ("float32", _remapping())):
        keras.utils.set_random_seed(0)
        model = build_trainer("tiny", vocab_size=40, dtype=policy)
        model.compile("adam", loss=LabelSmoothedCrossEntropy(0.1))
        seen.clear()
        model.fit(inputs, labels, epochs=1, verbose=0, callbacks=[record])
        model.evaluate(inputs, labels, verbose=0, callbacks=[record])
        model.predict(inputs, verbose=0, callbacks=[record])
        assert seen == [during] * 3, policy
        assert _remapping() in (None, True)
