"""Choosing the numeric precision (dtype policy) and XLA compilation for training.

`auto` picks mixed bfloat16 where bfloat16 is native: GPUs of compute capability 8.0 or
more (A100, H100, RTX 30xx/40xx) and CPUs whose instruction set multiplies bfloat16
(AVX512_BF16 or AMX; oneDNN then runs matmuls at about twice the float32 rate). Older GPUs
get mixed float16 with dynamic loss scaling (`keras_transformer.training.loss_scaling`); anything
else float32. Variables stay float32 under the mixed policies, and the model returns
float32 logits, so the loss is always computed in float32.

`float16_on_this_cpu` keeps mixed float16 usable on CPUs whose TensorFlow sends float16 ops
to oneDNN (see its docstring): there TensorFlow's fused float16 MatMul + BiasAdd is oneDNN's
reference kernel, tens of times slower than the unfused ops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

PRECISIONS = ("auto", "float32", "mixed_bfloat16", "mixed_float16")
JIT_CHOICES = ("auto", "on", "off")

# /proc/cpuinfo flags meaning "bfloat16 matmuls in hardware".
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")

_LOG = logging.getLogger("keras_transformer")


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


def cpu_sends_float16_to_onednn(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True where TensorFlow runs float16 ops through oneDNN: its own rule
    (`IsDataTypeSupportedByOneDNNOnThisCPU` in tensorflow/core/util/util.cc), AVX512BW with
    AVX512_FP16 or AMX_FP16, or AVX_NE_CONVERT. Intel Xeons since Sapphire Rapids have it;
    the AMD EPYCs and AVX2 CPUs this project is checked on do not."""
    flags = cpu_flags(cpuinfo)
    return bool(("avx512bw" in flags and flags & {"avx512_fp16", "amx_fp16"})
                or "avx_ne_convert" in flags)


class _RemapperSwitch:
    """TensorFlow's grappler remapper turned off while any `float16_on_this_cpu` block is
    open. The option is one for the whole process, so the blocks share this counter: the
    outermost entry saves and turns it off (and logs once per process), the outermost exit
    restores it, whatever the threads and nesting (`fit` runs `evaluate` inside)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = None
        self._logged = False

    def enter(self) -> None:
        import tensorflow as tf  # grappler's options

        with self._lock:
            if self._depth == 0:
                self._saved = tf.config.optimizer.get_experimental_options().get("remapping")
                tf.config.optimizer.set_experimental_options({"remapping": False})
                if not self._logged:
                    self._logged = True
                    _LOG.info("mixed_float16 on a CPU whose TensorFlow sends float16 to "
                              "oneDNN: graph remapping off while Keras fits, evaluates or "
                              "predicts (its fused float16 MatMul + BiasAdd is oneDNN's "
                              "reference kernel, ~36x slower here)")
            self._depth += 1

    def exit(self) -> None:
        import tensorflow as tf

        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                # Unset means on (TensorFlow's default); unset cannot be set back, so an
                # explicit True stands for it.
                tf.config.optimizer.set_experimental_options(
                    {"remapping": True if self._saved is None else self._saved})


_REMAPPER = _RemapperSwitch()  # mirrors a process-wide TensorFlow option (see the class)


@contextlib.contextmanager
def float16_on_this_cpu(precision: str, gpus: int | None = None,
                        cpuinfo: str | Path = "/proc/cpuinfo") -> Iterator[bool]:
    """Turns TensorFlow's grappler remapper off inside the block when `precision` is
    mixed_float16, there are no GPUs (`gpus`; None: `tensorflow_gpus()`, counted only for
    mixed_float16) and the CPU sends float16 to oneDNN; yields whether it did, and restores
    the setting after the outermost such block.

    Why: on such CPUs the remapper fuses a float16 MatMul and its BiasAdd (every Dense on 2-D
    inputs, the feed-forward layers' path) into oneDNN's reference kernel. Measured on an
    Intel Xeon with AVX512_FP16 and AMX (TensorFlow 2.21): a fused 512 x 32 x 64 float16
    matmul 28-45 ms against 0.44 ms unfused; the `tiny` training step 709 ms against 19.8 ms
    with the remapper off (float32: 15.8 ms; BENCHMARKS.md, Machines). The remapper's other
    fusions only matter for float32 ops, which a mixed_float16 step has few of.

    The setting applies to the function calls made inside the block: TensorFlow optimizes a
    function for the options of each call, so the same function called after the block runs
    fused (slow) again. It is process-wide; TensorFlow caches it per thread, so a thread that
    already ran functions before another opened the block may not see it.
    """
    hazard = (precision == "mixed_float16"
              and not (tensorflow_gpus() if gpus is None else gpus)
              and cpu_sends_float16_to_onednn(cpuinfo))
    if not hazard:
        yield False
        return
    _REMAPPER.enter()
    try:
        yield True
    finally:
        _REMAPPER.exit()


def tensorflow_gpus() -> int:
    """The GPUs TensorFlow trains on (its logical GPU devices)."""
    import tensorflow as tf

    return len(tf.config.list_logical_devices("GPU"))


def gpu_capabilities() -> list[tuple[int, int]]:
    """Compute capability (major, minor) of each visible GPU; (0, 0) where TF cannot tell."""
    import tensorflow as tf  # here: the flags read this module's choices without TensorFlow

    found = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        found.append(tuple(details.get("compute_capability") or (0, 0)))
    return found


def jax_gpu_capabilities() -> list[tuple[int, int]]:
    """`gpu_capabilities` under JAX: the compute capability of each local GPU device."""
    import jax

    found = []
    for device in jax.local_devices():
        if device.platform == "gpu":
            text = str(getattr(device, "compute_capability", "0.0"))
            major, _, minor = text.partition(".")
            found.append((int(major or 0), int(minor or 0)))
    return found


BF16_GPU_CAPABILITY = (8, 0)  # Ampere: bfloat16 tensor cores


def resolve_precision(choice: str, gpus: Sequence[tuple[int, int]] = (),
                      cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The Keras dtype policy name for `--precision choice` on this machine.

    Args:
        choice: one of `PRECISIONS`.
        gpus: compute capability of each GPU training will use (`gpu_capabilities()`).
        cpuinfo: where the CPU flags are read (no GPU).

    Returns:
        "float32", "mixed_bfloat16" or "mixed_float16".
    """
    if choice not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {choice!r}.")
    if choice != "auto":
        return choice
    if gpus:
        native = all(tuple(capability) >= BF16_GPU_CAPABILITY for capability in gpus)
        return "mixed_bfloat16" if native else "mixed_float16"
    return "mixed_bfloat16" if cpu_has_bf16(cpuinfo) else "float32"


def describe_precision(choice: str, resolved: str, num_gpus: int) -> str:
    """`resolved` for the training log, saying why when `auto` fell back to float32 on a CPU:
    the same recipe then trains another model than on a CPU with bfloat16 instructions, and
    more slowly (BENCHMARKS.md, Machines).

    Args:
        choice: `--precision`, one of `PRECISIONS`.
        resolved: what `resolve_precision` made of it.
        num_gpus: the GPUs training uses.
    """
    if choice == "auto" and resolved == "float32" and not num_gpus:
        # The flags, not a verdict on the CPU: where /proc/cpuinfo is unreadable (macOS)
        # nothing is found either.
        return f"{resolved} (precision auto: no {' or '.join(_BF16_FLAGS)} in this CPU's flags)"
    return resolved


def resolve_jit(choice: str, num_gpus: int) -> bool:
    """Whether to XLA-compile the train step for `--jit-compile choice`.

    `auto`: on with GPUs, off on CPUs. On GPUs XLA fuses the elementwise chains (LayerNorm,
    dropout, Adam) that would otherwise be many small kernels; the batches then come in a
    bounded set of shapes (`pipelines.batching.xla_bucket_boundaries`), each compiled once.
    On this project's 2-core AVX512-BF16 CPU the XLA step is slower (BENCHMARKS.md: XLA's
    CPU matmuls do not reach oneDNN's bfloat16 kernels, and the fused C++ kernels are not
    XLA ops), so CPUs stay without it; `on` forces it.
    """
    if choice not in JIT_CHOICES:
        raise ValueError(f"jit_compile must be one of {JIT_CHOICES}, got {choice!r}.")
    if choice == "auto":
        return num_gpus > 0
    return choice == "on"


def training_precision(precision: str, jit_compile: str, backend: str
                       ) -> tuple[str, bool, int]:
    """(precision, XLA on, GPUs) a run trains with on this machine: `--precision` and
    `--jit-compile` resolved for the backend's GPUs (JAX compiles every step with XLA).
    The training (`fit`, `fit_jax`) and `--recipe auto`'s measured step both read it."""
    if backend == "jax":
        capabilities = jax_gpu_capabilities()
        return resolve_precision(precision, capabilities), True, len(capabilities)
    gpus = tensorflow_gpus()
    return (resolve_precision(precision, gpu_capabilities()), resolve_jit(jit_compile, gpus),
            gpus)
