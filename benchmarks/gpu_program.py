"""What XLA compiles the real trainer step into for an NVIDIA GPU, on a machine without one:
the kernels of one `base` (or any preset's, or candidate's) step, the bytes each reads and
writes and the matmul FLOPs each does, grouped by the model's layers, and the roofline lower
bound they give. Issue 36's GPU aim without a GPU: where a step's memory traffic goes, and
whether a candidate (`benchmarks/accelerator_step.STEP_CHANGES`) removes some of it, before
the accelerator check (`accelerator_check.sh`) times it on a device.

How: JAX lowers and compiles for a described GPU without one (`jax.experimental.topologies`,
"deviceless" compilation), given the CUDA plugin of the installed JAX and autotuning off
(nothing to time kernels on). The step is the one `accelerator_step.keras_step` times:
`compiled_trainer` (the paper's Adam, the label-smoothed global-token loss, the run's
metrics, mixed_bfloat16) on the preset's synthetic batch shapes, `train_step` as Keras'
`fit` compiles it. The accounting reads XLA's optimized HLO: every kernel of the entry
computation (fusions, library calls, copies) reads its operands and writes its result, so
their sizes are its memory traffic; its matmul FLOPs are those of the `dot`s it holds. The
lower bound takes each kernel at the spec's bf16 peak or bandwidth, whichever binds: it is
not a prediction (no launch gaps, no tile effects, and no cuBLAS kernels chosen by
autotuning), only a measure that moves when the program does.

Setup (a separate environment: the plugin must not reach the test suite's JAX; CUDA 13 was
on the machine that measured BENCHMARKS.md's figures, for ptxas):
    python -m venv /tmp/gpu-program
    /tmp/gpu-program/bin/pip install "jax==$(python -c 'import jax; print(jax.__version__)')" \\
        "jax-cuda13-plugin==<the same>" "jax-cuda13-pjrt==<the same>" \\
        "keras==$(python -c 'import keras; print(keras.__version__)')"
Usage (BENCHMARKS.md, "On JAX"):
    /tmp/gpu-program/bin/python benchmarks/gpu_program.py --device h200 \\
        --presets base,base+separatestats,base+autodiffloss,big
Untuned, XLA writes every matmul as a Triton kernel; on a GPU autotuning chooses between
those and cuBLAS calls, whose bias epilogues save a pass. `XLA_FLAGS=
--xla_gpu_enable_triton_gemm=false` compiles every matmul as a cuBLAS call: the other end.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Device descriptions (XLA's GpuTargetConfig) and spec sheets: bf16 dense TFLOP/s, TB/s.
_SM90 = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{name}"
"""
DEVICES = {
    "h100": {"config": _SM90.format(bandwidth=3352320000000, memory=84929347584,
                                    name="NVIDIA H100 80GB HBM3"),
             "peak_tflops": 989.0, "bandwidth_tbps": 3.35},
    "h200": {"config": _SM90.format(bandwidth=4800000000000, memory=150754820096,
                                    name="NVIDIA H200"),
             "peak_tflops": 989.0, "bandwidth_tbps": 4.8},
}

_BITS = {"f64": 64, "s64": 64, "u64": 64, "c64": 64, "c128": 128, "f32": 32, "s32": 32,
         "u32": 32, "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "s8": 8, "u8": 8, "pred": 8,
         "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3": 8,
         "f8e3m4": 8, "f8e8m0fnu": 8, "s4": 4, "u4": 4, "f4e2m1fn": 4, "s2": 2, "u2": 2,
         "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
# Instructions that launch nothing: views, tuples and constants.
_NO_KERNEL = {"bitcast", "get-tuple-element", "tuple", "parameter", "constant", "after-all",
              "opt-barrier", "partition-id", "replica-id"}
# Instructions whose kernels live in other computations, or that pair with another: a
# program holding them is not the straight line this accounting reads.
_NOT_COUNTED = {"while", "conditional", "call", "async-start", "async-update", "async-done"}


def step_program(name: str, device: str) -> str:
    """The optimized HLO text of preset (or candidate) `name`'s trainer step compiled for
    `device` (a key of `DEVICES`)."""
    import jax
    from jax.experimental import topologies

    from benchmarks.accelerator_common import STEP_SHAPES
    from benchmarks.accelerator_step import (
        compiled_trainer,
        statistics_as,
        step_variant,
        synthetic_batch,
        trainer_state,
    )

    preset, changes = step_variant(name)
    batch, source_length, target_length, vocab_size = STEP_SHAPES[preset]
    vocab_size = 8000 if "vocab8000" in changes else vocab_size
    model = compiled_trainer(preset, changes, vocab_size, "mixed_bfloat16")
    data = synthetic_batch(batch, source_length, target_length, vocab_size)
    model._symbolic_build(data_batch=data)  # what `fit` builds before its first step
    model.optimizer.build(model.trainable_variables)
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=DEVICES[device]["config"])
    replicated = jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("data",)),
                                            jax.sharding.PartitionSpec())

    def abstract(value):
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=replicated)

    with statistics_as(changes):
        lowered = jax.jit(model.train_step, donate_argnums=0).lower(
            *jax.tree.map(abstract, (trainer_state(model), data)))
    return lowered.compile().as_text()


def kernels(hlo: str) -> list[dict]:
    """The entry computation's kernels: name, kind (fusion kind or library), bytes read and
    written, matmul FLOPs, and the op name of the JAX code it came from."""
    computations, entry = _computations(hlo)
    shapes = {name: shape for name, shape, *_ in computations[entry]}
    found = []
    for name, shape, opcode, operands, attributes in computations[entry]:
        if opcode in _NO_KERNEL:
            continue
        if opcode in _NOT_COUNTED or opcode.endswith(("-start", "-done")):
            raise ValueError(f"{name}: a {opcode} in the entry computation, whose work this "
                             "accounting does not count (it reads straight-line programs)")
        called = re.findall(r"calls=%([^\s,]+)", attributes)
        kind = (re.search(r'"kind":"([^"]+)"', attributes)
                or re.search(r"kind=(\w+)", attributes)
                or re.search(r'custom_call_target="([^"]+)"', attributes))
        op_name = re.search(r'op_name="([^"]+)"', attributes)
        flops = sum(_dot_flops(computations, computation) for computation in called)
        written = _bytes(shape)
        if opcode == "custom-call" and '"gemm_backend_config"' in attributes:
            # A cuBLAS call: (result, s8 workspace); the workspace is scratch, not traffic.
            written = _bytes(_ARRAY.search(shape).group(0))
            flops = _gemm_flops(shapes.get(operands[0], ""), shape, attributes)
        found.append({
            "name": name, "kind": kind.group(1) if kind else opcode,
            "read": sum(_bytes(shapes.get(operand, "")) for operand in dict.fromkeys(operands)),
            "written": written, "flops": flops,
            "op_name": op_name.group(1) if op_name else ""})
    return found


def _gemm_flops(left: str, result: str, attributes: str) -> int:
    """2 x result elements x contracted size of a cuBLAS call (its `gemm_backend_config`)."""
    contracted = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attributes)
    axes = re.findall(r"\d+", contracted.group(1)) if contracted else []
    dims = _dims(left)
    return 2 * math.prod(_dims(result)) * math.prod(dims[int(axis)] for axis in axes)


def summary(found: list[dict], device: str, top: int) -> dict:
    """Totals, by kernel kind and by layer group, and the roofline lower bound."""
    spec = DEVICES[device]
    peak, bandwidth = spec["peak_tflops"] * 1e12, spec["bandwidth_tbps"] * 1e12

    def bound(kernel):
        return max(kernel["flops"] / peak, (kernel["read"] + kernel["written"]) / bandwidth)

    groups = collections.defaultdict(lambda: {"kernels": 0, "gb": 0.0, "tflop": 0.0,
                                              "bound_ms": 0.0})
    kinds = collections.defaultdict(lambda: {"kernels": 0, "gb": 0.0, "tflop": 0.0,
                                             "bound_ms": 0.0})
    for kernel in found:
        for table, key in ((groups, _group(kernel["op_name"])), (kinds, kernel["kind"])):
            row = table[key]
            row["kernels"] += 1
            row["gb"] += (kernel["read"] + kernel["written"]) / 1e9
            row["tflop"] += kernel["flops"] / 1e12
            row["bound_ms"] += bound(kernel) * 1e3
    flops = sum(kernel["flops"] for kernel in found)
    lower_bound = sum(bound(kernel) for kernel in found)
    return {"kernels": len(found),
            "gb": sum(kernel["read"] + kernel["written"] for kernel in found) / 1e9,
            "matmul_tflop": flops / 1e12,
            "matmul_kernels_gb": sum(kernel["read"] + kernel["written"] for kernel in found
                                     if kernel["flops"]) / 1e9,
            "lower_bound_ms": lower_bound * 1e3,
            "mfu_at_the_bound": flops / (lower_bound * peak) if lower_bound else math.nan,
            "by_kind": _rounded(kinds, len(kinds)), "by_group": _rounded(groups, top)}


def _computations(hlo: str) -> tuple[dict[str, list], str]:
    """{computation: [(name, shape, opcode, operands, attributes)]}, and the entry's name."""
    computations, current, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(.*\{\s*$", line)
        if head:
            current = head.group(2)
            computations[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (instruction := _instruction(line)):
            computations[current].append(instruction)
    return computations, entry


def _instruction(line: str):
    match = re.match(r"\s*(?:ROOT )?%([^\s=]+) = (.*)$", line)
    if not match:
        return None
    name, rest = match.groups()
    if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
        end = _closing(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 2:]
    else:
        shape, _, rest = rest.partition(" ")
    opcode = re.match(r"([a-z][a-z0-9-]*)\(", rest)
    if not opcode:
        return None
    end = _closing(rest, opcode.end() - 1)
    operands = re.findall(r"%([^\s,()]+)", rest[opcode.end() - 1:end + 1])
    return name, shape, opcode.group(1), operands, rest[end + 1:]


def _closing(text: str, start: int) -> int:
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return index
    return len(text) - 1


def _bytes(shape: str) -> int:
    total = 0
    for dtype, sizes in _ARRAY.findall(shape):
        if dtype not in _BITS:
            raise ValueError(f"unknown XLA element type {dtype!r} in {shape!r}")
        total += _BITS[dtype] * math.prod(int(size) for size in sizes.split(",") if size)
    return (total + 7) // 8


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(size) for size in match.group(2).split(",") if size] if match else []


def _dot_flops(computations: dict, name: str) -> int:
    """2 x output elements x contracted size of every `dot` in computation `name` and the
    computations it calls."""
    shapes = {instruction[0]: instruction[1] for instruction in computations.get(name, [])}
    flops = 0
    for _, shape, opcode, operands, attributes in computations.get(name, []):
        if opcode == "dot":
            left = _dims(shapes.get(operands[0], ""))
            contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attributes)
            size = math.prod(left[int(axis)] for axis in contracted.group(1).split(",")
                             if axis) if contracted else 1
            flops += 2 * math.prod(_dims(shape)) * size
        for called in re.findall(r"(?:calls|to_apply)=%([^\s,]+)", attributes):
            flops += _dot_flops(computations, called)
    return flops


def _group(op_name: str) -> str:
    """The op name without the step's prefix and with layer numbers folded: one row for the
    same operation of every layer."""
    name = op_name.removeprefix("jit(train_step)/")
    return re.sub(r"(encoder|decoder)_layer_\d+", r"\1_layer_N", name) or "(unnamed)"


def _rounded(table: dict, top: int) -> dict:
    rows = sorted(table.items(), key=lambda item: -item[1]["bound_ms"])[:top]
    return {key: {field: round(value, 3) if isinstance(value, float) else value
                  for field, value in row.items()} for key, row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="base",
                        help="comma-separated presets or candidates, e.g. base+separatestats")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200")
    parser.add_argument("--top", type=int, default=12, help="layer groups listed")
    parser.add_argument("--hlo-dir", type=Path, help="also write each program's HLO here")
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # for the description, not a GPU
    # The plugin checks for cuDNN and cuBLAS at start; compiling untuned needs neither.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0"
    import jax
    import keras

    report = {"device": args.device, "jax": jax.__version__, "keras": keras.__version__,
              "spec": {key: DEVICES[args.device][key]
                       for key in ("peak_tflops", "bandwidth_tbps")}, "programs": {}}
    for name in args.presets.split(","):
        if "flash" in name.split("+"):
            # `attention_jax.attention_implementation` picks cuDNN's kernel on a GPU present
            # only; here the reference would be compiled under flash's name.
            report["programs"][name] = {"skipped": "flash attention is cuDNN's kernel, chosen "
                                                   "where a GPU is present"}
            continue
        start = time.perf_counter()
        try:
            hlo = step_program(name, args.device)
        except Exception as error:  # noqa: BLE001 (recorded; the next program compiles)
            report["programs"][name] = {"error": f"{type(error).__name__}: {error}"[:1000]}
            continue
        finally:
            keras.backend.clear_session()
        if args.hlo_dir:
            args.hlo_dir.mkdir(parents=True, exist_ok=True)
            (args.hlo_dir / f"{name.replace('+', '_')}.hlo.txt").write_text(hlo)
        report["programs"][name] = {"compile_seconds": round(time.perf_counter() - start, 1),
                                    **summary(kernels(hlo), args.device, args.top)}
        totals = {key: value for key, value in report["programs"][name].items()
                  if not key.startswith("by_")}
        print(f"{name}: {json.dumps(totals)}", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
