"""Choosing the training precision and XLA from the hardware (`--precision auto`,
`--jit-compile auto`)."""

from __future__ import annotations

import pytest

from keras_transformer.training.precision import (
    describe_precision,
    resolve_jit,
    resolve_precision,
)


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
