"""Choosing the numeric precision (dtype policy) and XLA compilation for training.

`auto` picks mixed bfloat16 on CPUs whose instruction set multiplies bfloat16 natively
(AVX512_BF16 or AMX: oneDNN then runs the matmuls at about twice the float32 rate), mixed
float16 on GPUs (Keras adds dynamic loss scaling for it), and float32 otherwise. Variables
stay float32 under the mixed policies, and the model returns float32 logits, so the loss is
always computed in float32.
"""

from __future__ import annotations

from pathlib import Path

PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
JIT_CHOICES = ("auto", "on", "off")

# /proc/cpuinfo flags meaning "bfloat16 matmuls in hardware".
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The `flags` of the first CPU listed in `cpuinfo` (empty if unreadable, e.g. macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True if the CPU has native bfloat16 dot products (AVX512_BF16 or AMX-BF16)."""
    return bool(cpu_flags(cpuinfo) & set(_BF16_FLAGS))


def resolve_precision(choice: str, num_gpus: int, cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The Keras dtype policy name for `--precision choice` on this machine.

    Args:
        choice: one of `PRECISIONS`.
        num_gpus: GPUs training will use.

    Returns:
        "float32", "mixed_bfloat16" or "mixed_float16".
    """
    if choice not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {choice!r}.")
    if choice != "auto":
        return choice
    if num_gpus:
        return "mixed_float16"
    return "mixed_bfloat16" if cpu_has_bf16(cpuinfo) else "float32"


def resolve_jit(choice: str, num_gpus: int) -> bool:
    """Whether to XLA-compile the train step for `--jit-compile choice`.

    `auto` is off. Measured uncontended on this project's 2-core AVX512-BF16 CPU (small
    preset, 64 x 32 x 32, mixed_bfloat16; BENCHMARKS.md): the XLA-compiled step takes
    0.67-0.74 s against 0.35-0.38 s without XLA, whatever the XLA oneDNN/XNNPACK flags, since
    XLA's CPU matmuls do not reach oneDNN's bfloat16 kernels; and each new batch shape costs
    seconds of compilation. Only the loss, which has no matmul, is XLA-compiled. On GPUs it
    has not been measured here; `on` forces it.
    """
    if choice not in JIT_CHOICES:
        raise ValueError(f"jit_compile must be one of {JIT_CHOICES}, got {choice!r}.")
    del num_gpus  # kept in the signature: the choice is per device type once measured there
    return choice == "on"
