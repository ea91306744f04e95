"""Choosing the training precision and XLA from the hardware (`--precision auto`,
`--jit-compile auto`), and mixed float16 on CPUs whose TensorFlow sends float16 to oneDNN."""

from __future__ import annotations

import logging
import threading

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


@pytest.fixture
def remapping_as_found(monkeypatch):
    """Puts grappler's remapping option back after the test; the once-per-process log line
    is due again."""
    monkeypatch.setattr(precision._REMAPPER, "_logged", False)
    saved = tf.config.optimizer.get_experimental_options()
    yield
    tf.config.optimizer.set_experimental_options({"remapping": saved.get("remapping", True)})


@pytest.mark.parametrize("before", [True, False])
def test_the_remapper_is_off_inside_the_block_only_for_float16_on_such_a_cpu(
        tmp_path, caplog, remapping_as_found, before):
    tf.config.optimizer.set_experimental_options({"remapping": before})
    cpuinfo = _cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.INFO, "keras_transformer"):
        with float16_on_this_cpu("mixed_float16", 0, cpuinfo) as applied:
            assert applied is True and _remapping() is False
            # Nested (fit runs evaluate): the inner exit leaves it off.
            with float16_on_this_cpu("mixed_float16", 0, cpuinfo):
                assert _remapping() is False
            assert _remapping() is False
        assert _remapping() is before
        with float16_on_this_cpu("mixed_float16", 0, cpuinfo):
            assert _remapping() is False
    assert _remapping() is before
    assert caplog.text.count("graph remapping off") == 1  # once per process
    # Another precision, a GPU, another CPU: nothing changes.
    for args in (("mixed_bfloat16", 0, cpuinfo), ("float32", 0, cpuinfo),
                 ("mixed_float16", 1, cpuinfo),
                 ("mixed_float16", 0, _cpuinfo(tmp_path, "fpu avx512bw avx512_bf16"))):
        with float16_on_this_cpu(*args) as applied:
            assert applied is False and _remapping() is before, args


def test_threads_in_overlapping_blocks_restore_the_setting_once_all_have_left(
        tmp_path, remapping_as_found):
    tf.config.optimizer.set_experimental_options({"remapping": True})
    cpuinfo = _cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
    first_in, second_in, first_out = (threading.Event() for _ in range(3))
    seen = {}

    def first():
        with float16_on_this_cpu("mixed_float16", 0, cpuinfo):
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with float16_on_this_cpu("mixed_float16", 0, cpuinfo):
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = _remapping()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"after the first left": False}
    assert _remapping() is True


def test_a_float16_fit_on_such_a_cpu_trains_with_the_remapper_off(monkeypatch,
                                                                    remapping_as_found):
    """`TransformerTrainer.fit` applies it (the train command fits one), as do its `evaluate`,
    `predict` and `*_on_batch` (`--recipe auto` times `train_on_batch`), each putting the
    setting back after."""
    monkeypatch.setattr(precision, "cpu_flags", lambda cpuinfo: set(SAPPHIRE_RAPIDS.split()))
    monkeypatch.setattr(precision, "tensorflow_gpus", lambda: 0)  # as on a CPU
    tf.config.optimizer.set_experimental_options({"remapping": True})
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda *_, **__: seen.append(_remapping()))
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 40, size=(4, 7)).astype("int32")
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=40, dtype="mixed_float16")
    model.compile("adam", loss=LabelSmoothedCrossEntropy(0.1))
    model.fit({"source": ids, "target": ids[:, :-1]}, ids[:, 1:], epochs=1, verbose=0,
              callbacks=[record])
    assert seen == [False] and _remapping() is True
    # Every entry point, each policy: Keras' own method (replaced by a recorder) sees the
    # remapper off under mixed_float16 only.
    entry_points = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                    "predict_on_batch")
    for name in entry_points:
        monkeypatch.setattr(keras.Model, name,
                            lambda self, *_, **__: seen.append((self.dtype_policy.name,
                                                                _remapping())))
    for policy, during in (("mixed_float16", False), ("float32", True)):
        model = build_trainer("tiny", vocab_size=40, dtype=policy)
        seen.clear()
        for name in entry_points:
            getattr(model, name)(None)
        assert seen == [(policy, during)] * len(entry_points), policy
        assert _remapping() is True
