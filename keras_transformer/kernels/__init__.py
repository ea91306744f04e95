"""Fused CPU kernels for training: C++ TensorFlow ops compiled on first use.

On a CPU, what the matmuls leave of a training step is long chains of small memory-bound
ops (casts, dropout masks, LayerNorm moments, the softmax over the vocabulary), each a pass
over memory plus a dispatch. The C++ ops here do each chain in one pass:

- `smoothed_cross_entropy` (`cross_entropy.cc`): 5.4 label-smoothed cross-entropy; the
  gradient is computed in the backward pass from the logits and the stored log-normalizer,
  already scaled by the upstream gradient.
- `residual_norm` (`residual_norm.cc`): 3.1 post-norm LayerNorm(residual + Dropout(x)) with
  5.4's dropout drawn from a counter-based hash of (seed, element index), so the backward
  pass recomputes the mask instead of storing it.

They are used only where nothing is exported: the training loss and training-mode layers
(exported SavedModels and inference graphs contain standard TensorFlow ops only). The library
is built with the system's `g++` against the installed TensorFlow's headers into a cache
(`$KERAS_TRANSFORMER_CACHE`, default `~/.cache/keras_transformer`), keyed by the sources, the
TensorFlow build, the compiler and the CPU; processes that start together build it once (a
lock file beside it). `KERAS_TRANSFORMER_FUSED_KERNELS` selects: `auto`
(default: use them when no GPU is visible and they build, else TensorFlow ops, with one warning
if the build failed), `off`, or `on` (raise if they cannot be built). XLA-compiled steps
(`jit_compile=True`) always use TensorFlow ops, and under another Keras backend (JAX)
`fused_kernels()` is None without importing TensorFlow: the model then runs `keras.ops` only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import keras

from keras_transformer.kernels.custom_gradient import custom_gradient

_HERE = Path(__file__).parent
SOURCES = (_HERE / "cross_entropy.cc", _HERE / "residual_norm.cc")  # one library
_HEADERS = (_HERE / "common.h",)
MODE_VARIABLE = "KERAS_TRANSFORMER_FUSED_KERNELS"
CACHE_VARIABLE = "KERAS_TRANSFORMER_CACHE"
_MODES = ("auto", "on", "off")
# -fno-trapping-math lets g++ vectorize the float reductions and selects; nothing here relies
# on floating-point exceptions.
_OPTIMIZATION_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math",
                       "-fno-math-errno", "-fno-strict-aliasing", "-w"]


class KernelBuildError(RuntimeError):
    """The fused kernels could not be compiled or loaded."""


def mode() -> str:
    """The selected mode from `KERAS_TRANSFORMER_FUSED_KERNELS` (auto, on or off)."""
    value = os.environ.get(MODE_VARIABLE, "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(f"{MODE_VARIABLE}={value!r} is not one of {', '.join(_MODES)}.")
    return value


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    except OSError:
        return "unavailable"
    return result.stdout.partition("\n")[0]


@functools.cache
def _target_flags(compiler: str) -> tuple[str, ...]:
    """Flags that keep `-march=native` compilable against TensorFlow's bundled Eigen.

    On CPUs with AVX512-FP16 (Intel Sapphire Rapids and later), `-march=native` defines
    `__AVX512FP16__` and Eigen's `PacketMathFP16.h` in TensorFlow 2.x headers then fails to
    compile under g++ 12 ("expected initializer before '<' token"). Our kernels compute in
    float32 and bfloat16, so those half-precision packets are not needed: turn them off.
    """
    try:
        result = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True)
    except OSError:
        return ()
    return ("-mno-avx512fp16",) if "__AVX512FP16__" in result.stdout else ()


def _build_command(output: Path) -> list[str]:
    import tensorflow as tf

    return [_compiler(), "-std=c++17", "-shared", "-fPIC", *_OPTIMIZATION_FLAGS,
            *_target_flags(_compiler()),
            *tf.sysconfig.get_compile_flags(), *map(str, SOURCES), "-o", str(output),
            *tf.sysconfig.get_link_flags()]


def library_path() -> Path:
    """Where the compiled library for this source, TensorFlow build, compiler and CPU is
    cached."""
    import tensorflow as tf

    key = hashlib.sha256()
    compiler = _compiler()
    for part in (*(path.read_bytes() for path in SOURCES + _HEADERS), tf.__version__,
                 tf.sysconfig.get_lib(), *tf.sysconfig.get_compile_flags(),
                 *_OPTIMIZATION_FLAGS, *_target_flags(compiler), compiler,
                 _compiler_version(compiler), _cpu_signature(), sys.platform,
                 platform.machine()):
        key.update(part if isinstance(part, bytes) else part.encode())
    cache = Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "keras_transformer")
    return cache / "kernels" / f"fused_ops-{key.hexdigest()[:16]}.so"


def build(path: Path) -> Path:
    """Compiles `SOURCES` into `path` (atomically: a failed build leaves nothing there)."""
    compiler = _compiler()
    if shutil.which(compiler) is None:
        raise KernelBuildError(
            f"no C++ compiler {compiler!r} on PATH to build the fused kernels; install g++ "
            f"(e.g. apt-get install g++) or set {MODE_VARIABLE}=off.")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        partial = Path(scratch) / path.name
        result = subprocess.run(_build_command(partial), capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(
                f"compiling the fused kernels ({', '.join(p.name for p in SOURCES)}) failed "
                f"(exit {result.returncode}):\n"
                + result.stderr[-2000:])
        os.replace(partial, path)
    return path


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive `flock` on `<path>.lock` (waiting for it). Where locks are missing
    (no `fcntl`, a file system without them, an unwritable cache) nothing is held: the
    build's atomic replace still leaves a whole library, only the compiling is repeated."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (held below)
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield  # closing the file releases the lock (as a killed process's exit does)


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of `path`, None if it is missing: `build`'s `os.replace` always
    gives a new file a new inode."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns


def build_once(path: Path, replace: tuple[int, int] | None = None) -> Path:
    """`build(path)` unless the library is there: processes that start together (pytest's
    workers, a cluster's workers on one machine, a run and its subprocesses) wait for the
    first one's build and load its library instead of each compiling it (~21 s of g++).
    A compiler that hangs makes the others wait for it too.

    Args:
        path: the library (`library_path()`).
        replace: the `_file_identity` of a library that did not load: it is rebuilt unless
            another process already replaced it.
    """
    def wanted() -> bool:
        identity = _file_identity(path)
        return identity is None or (replace is not None and identity == replace)

    if wanted():
        with _build_lock(path):
            if wanted():
                build(path)
    return path


@functools.cache
def _load():
    """(library, None) or (None, the KernelBuildError): one attempt per process, so a failing
    build is not retried at every layer call. A cached library that does not load (e.g. a
    truncated file) is rebuilt once."""
    import tensorflow as tf

    try:
        path = library_path()
        build_once(path)
        tried = _file_identity(path)  # before loading: another process may replace it
        try:
            return tf.load_op_library(str(path)), None
        except (tf.errors.NotFoundError, OSError):
            build_once(path, replace=tried)
            return tf.load_op_library(str(path)), None
    except KernelBuildError as error:
        return None, error
    except (tf.errors.OpError, OSError, RuntimeError) as error:
        return None, KernelBuildError(f"loading the fused kernels failed: {error}")


def _in_xla_context() -> bool:
    """Whether the current trace is XLA-compiled (`jit_compile=True`), which cannot run
    custom ops. TensorFlow has no public API for this; the check is best-effort."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        return False
    import tensorflow as tf

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def fused_kernels():
    """The loaded op library, or None when the fused kernels are off or unavailable, when
    tracing an XLA-compiled function (XLA compiles the TensorFlow ops instead), or when Keras
    runs on another backend than TensorFlow (they are TensorFlow ops).

    Raises:
        KernelBuildError: in mode `on`, when the library cannot be built or loaded.
    """
    selected = mode()
    if keras.backend.backend() != "tensorflow":
        if selected == "on":
            raise KernelBuildError(
                f"{MODE_VARIABLE}=on, but the fused kernels are TensorFlow ops and Keras runs "
                f"on {keras.backend.backend()!r}; unset {MODE_VARIABLE} or set it to auto.")
        return None
    import tensorflow as tf

    if selected == "off" or _in_xla_context():
        return None
    if selected == "auto" and tf.config.list_logical_devices("GPU"):
        return None  # CPU kernels: on a GPU machine they would pull the step onto the CPU
    library, error = _load()
    if error is not None:
        if selected == "on":
            raise error
        _warn_fallback(str(error))
    return library


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fused CPU kernels unavailable, training uses TensorFlow ops (slower): "
                  f"{reason}", RuntimeWarning, stacklevel=3)


def _kernel_dtype(tensor):
    """`tensor` as float32 or bfloat16, the dtypes the kernels take."""
    import tensorflow as tf

    tensor = tf.convert_to_tensor(tensor)
    return tensor if tensor.dtype in (tf.float32, tf.bfloat16) else tf.cast(tensor, tf.float32)


def smoothed_cross_entropy_value(library, labels, logits, label_smoothing: float):
    """`smoothed_cross_entropy`'s forward pass alone (metrics, validation): float32 (...,)."""
    loss, _ = library.kt_smoothed_cross_entropy(
        _kernel_dtype(logits), labels, label_smoothing=float(label_smoothing))
    return loss


def smoothed_cross_entropy(library, labels, logits, label_smoothing: float):
    """Per-token label-smoothed cross-entropy with the fused kernels.

    Args:
        library: `fused_kernels()`.
        labels: int32 (...,), each in [0, vocab).
        logits: (..., vocab); float32 or bfloat16 (other dtypes are cast to float32).
        label_smoothing: eps; the target is (1 - eps) * one_hot + eps / vocab.

    Returns:
        float32 (...,) losses; the gradient comes back in the logits' dtype.
    """
    import tensorflow as tf

    eps = float(label_smoothing)

    @custom_gradient
    def cross_entropy(logits):
        loss, log_normalizer = library.kt_smoothed_cross_entropy(
            logits, labels, label_smoothing=eps)

        def grad(upstream):
            return library.kt_smoothed_cross_entropy_grad(
                logits, labels, log_normalizer, tf.cast(upstream, tf.float32),
                label_smoothing=eps)

        return loss, grad

    return cross_entropy(_kernel_dtype(logits))


def residual_norm(library, x, residual, gamma, beta, seed, epsilon: float, rate: float):
    """LayerNorm(residual + Dropout(x)) over the last axis with the fused kernels.

    Args:
        library: `fused_kernels()`.
        x: the sub-layer output (..., features), float32 or bfloat16.
        residual: the sub-layer input, same shape and dtype.
        gamma, beta: float32 (features,).
        seed: int (2,); the dropout mask is a function of it, so use a fresh one per step.
        epsilon: added to the variance.
        rate: dropout rate in [0, 1); 0 disables dropout.

    Returns:
        a tensor like `x`.
    """
    import tensorflow as tf

    seed = tf.cast(seed, tf.int64)
    rate = float(rate)

    @custom_gradient
    def normalize(x, residual, gamma, beta):
        outputs, mean, inverse_std = library.kt_residual_norm(
            x, residual, gamma, beta, seed, epsilon=float(epsilon), rate=rate)

        def grad(upstream):
            return library.kt_residual_norm_grad(
                tf.cast(upstream, x.dtype), x, residual, gamma, seed, mean, inverse_std,
                rate=rate)

        return outputs, grad

    return normalize(x, residual, tf.cast(gamma, tf.float32), tf.cast(beta, tf.float32))
