"""The accelerator check of issue 36: the JAX trainer's speed on a GPU, and its agreement with
TensorFlow on the CPU, in one command (`benchmarks/accelerator_check.sh`).

Runs under Keras' JAX backend and imports no TensorFlow: the GPU machines have JAX, PyTorch and
numpy but no TensorFlow (nor Keras: the shell script installs the bundle's wheels first). The
bundle (`build/accelerator_bundle/`, made on a machine with TensorFlow by
`benchmarks/accelerator_bundle.py`) holds the Keras wheels, the Multi30k de->en folder as the
`multi30k` recipe prepares it, and the CPU reference: the seed of the initial weights (with
their SHA-256) and the per-step losses of 300 steps of the recipe's batches trained under
TensorFlow in float32.

Prints one JSON object (stdout), made of three parts, each run in its own process (a crash or
a time-out of one leaves the others' results) within a time budget (`--budget`). First, up to
30% of the budget, parallel processes compile what the parts will run (the agreement's batch
shapes, each preset's step, torch.compile's graphs) into the persistent caches (`--no-warm`:
not), since compiled one after another they take longer than the whole check may (cold on an
H200: ~13 s for each of the agreement's 10 shapes, 20-45 s for each preset and each
torch.compile). `warm` in the JSON says what each warmer did:

- `step`: the device, a measured bfloat16 matmul peak (jnp, several sizes, the best), and the
  project's real trainer step (`TransformerTrainer` compiled as `keras_transformer/training/
  fit.py` does: `GlobalTokenCrossEntropy(0.1)`, `paper_adam`, the preset's dropout,
  `mixed_bfloat16`, trained with `model.fit`) for the presets small (256 pairs x 32 source x 32
  target tokens, vocabulary 8000), base and big (400 x 64 x 64, vocabulary 37000) on synthetic
  tokens: compile time, median step time over `--steps` steps after a warm-up window (median of
  windows of `--window` steps), target tokens/s, TFLOP/s counted as `benchmarks/flops.py` does,
  and MFU against the device's spec (989 TFLOP/s bf16 dense for H100/H200 SXM) and against the
  measured matmul peak. Candidates for a faster step are written `preset+change` in
  `--presets` (`STEP_CHANGES`: `flash`, attention by lengths through cuDNN's fused kernel;
  `dropout0` and `vocab8000`, upper bounds on what cheaper masks and a fused output layer and
  loss could save; `autodiffloss`, the loss's gradient by autodiff, for what the hand-written
  one saves); `--profile` traces a preset's step after timing it and summarises where
  the device time goes (`benchmarks/device_trace.py`).
- `torch`: the PyTorch peer on the same shapes: `nn.Transformer(d, h, L, L, d_ff, dropout,
  batch_first=True)` with sinusoidal positions, one embedding tied to the output projection,
  padding and causal masks, bfloat16 autocast, fused Adam with the same schedule, label
  smoothing 0.1; eager, then `torch.compile` (forward and loss). Skipped with a note if torch
  is missing.
- `agreement`: the recipe's model (dropout 0) from the bundle's initial weights, trained on the
  first `--agreement-steps` (300) batches of the bundle's prepared folder in the order
  `pipelines.numpy_batches.prepared_batches` gives them (each batch's digest checked against
  the reference's), compared with the CPU reference: the relative difference of the mean loss
  over the last `--agreement-window` (50) steps, steps 251-300; the bar is 1%.

By role, in `benchmarks/`: this file (the settings and command line, the warmers' and the
parts' child processes, the report), `accelerator_step.py`, `accelerator_torch.py` and
`accelerator_agreement.py` (the parts; the last also holds the recipe's batches and seeded
initial weights that `accelerator_bundle.py` uses), `accelerator_warm.py` (the warmers'
pieces), `accelerator_report.py` (MFU, the summary) and `accelerator_common.py` (what they share).

Usage (on the GPU machine the shell script runs it; here for a CPU test):

    KERAS_BACKEND=jax python benchmarks/accelerator_check.py                 # everything
    KERAS_BACKEND=jax python benchmarks/accelerator_check.py --parts step --presets base
    KERAS_BACKEND=jax python benchmarks/accelerator_check.py --quick         # CPU: tiny, minutes

`--quick` (a CPU test of every code path): the tiny preset at 8 x 8 x 8 for the step and the
peer, 20 agreement steps in float32 compared with the reference's first 20.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script (by the shell script, and again as each worker): the repository's packages.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks.accelerator_agreement import agreement_worker  # noqa: E402
from benchmarks.accelerator_common import (  # noqa: E402
    DEFAULT_BUNDLE,
    REFERENCE_FILE,
    REPO,
    STEP_SHAPES,
    Results,
    jsonable,
    say,
)
from benchmarks.accelerator_report import add_mfu, spec_peak, summary  # noqa: E402
from benchmarks.accelerator_step import STEP_CHANGES, step_variant, step_worker  # noqa: E402
from benchmarks.accelerator_torch import torch_worker  # noqa: E402
from benchmarks.accelerator_warm import warm_tasks, warm_worker  # noqa: E402

# The parts, in the order they run (the agreement first: it is the check with a bar).
PARTS = ("agreement", "step", "torch")
# Shares of the time budget; time a part leaves goes to the later ones.
PART_SHARES = {"agreement": 0.40, "step": 0.35, "torch": 0.25}
# The budget's share for warming the compilation caches in parallel processes first (cold,
# one after another, the agreement's 10 shapes, the three presets and torch.compile take
# ~5 minutes of compiling: more than the whole check may take).
WARM_SHARE = 0.30


# --- Warming the compilation caches, in parallel ---


def warm_caches(settings: dict[str, Any], parts: list[str], seconds: float, log_dir: Path,
                work: Path) -> dict[str, Any]:
    """Runs `warm_tasks` in parallel processes for at most `seconds`; how each went."""
    tasks = warm_tasks(settings, parts)
    processes = []
    deadline = time.time() + seconds
    start = time.time()
    for index, task in enumerate(tasks):
        name = f"warm{index}_{task['kind']}_{task.get('preset', task.get('precision'))}"
        env = _worker_env(task["kind"], settings)
        # Many processes share the GPU: none may take most of its memory up front.
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false")
        out = work / f"{name}.json"
        log = log_dir / f"accelerator_check_{name}.log"
        command = _worker_command("warm", dict(settings, warm_task=task), deadline, out)
        stream = open(log, "w")  # noqa: SIM115 (closed below, after the process ends)
        processes.append((name, out, log, stream, subprocess.Popen(
            command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=REPO,
            start_new_session=True)))
    record: dict[str, Any] = {"tasks": len(tasks), "budget_seconds": round(seconds, 1),
                              "by_task": {}}
    for name, out, log, stream, process in processes:
        try:
            rc = process.wait(timeout=max(deadline - time.time(), 0.0) + 5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            rc = process.wait()
        stream.close()
        try:
            data = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            data = {}
        entry = {"rc": rc, "seconds": data.get("seconds")}
        if rc != 0:
            entry["log_tail"] = log.read_text(errors="replace")[-1500:]
        record["by_task"][name] = entry
    record["seconds"] = round(time.time() - start, 1)
    return record

WORKERS = {"step": step_worker, "agreement": agreement_worker, "torch": torch_worker,
           "warm": warm_worker}


def run_worker(part: str, settings: dict[str, Any], deadline: float, out: Path) -> None:
    # As on the GPU machines, where it is not installed: a TensorFlow import fails (Keras'
    # set_random_seed would import it where it is installed, to seed it too).
    sys.modules["tensorflow"] = None
    results = Results(out)
    results.data["started"] = time.time()
    results.save()
    WORKERS[part](settings, deadline, results)
    results.data["finished"] = time.time()
    results.save()


# --- The orchestrator ---


def _worker_env(part: str, settings: dict[str, Any]) -> dict[str, str]:
    """A worker's environment: the JAX backend; the agreement's XLA flags for its programs
    (also when warming them: the flags are part of the compilation cache's key)."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1")
    if part == "agreement" and settings["agreement_xla_flags"]:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"),
                                                  settings["agreement_xla_flags"]]))
    return env


def _worker_command(part: str, settings: dict[str, Any], deadline: float,
                    out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", part,
            "--worker-out", str(out), "--worker-deadline", repr(deadline),
            "--worker-settings", json.dumps(settings)]


def run_part(part: str, settings: dict[str, Any], seconds: float, log_dir: Path,
             work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs one part in a child process for at most `seconds` (+ a grace period); its
    results (partial if it was stopped) and how it ran."""
    out = work / f"{part}.json"
    log = log_dir / f"accelerator_check_{part}.log"
    env = _worker_env(part, settings)
    deadline = time.time() + seconds
    command = _worker_command(part, settings, deadline, out)
    start = time.time()
    timed_out = False
    with open(log, "w") as stream:
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT,
                                   env=env, cwd=REPO, start_new_session=True)
        try:
            rc = process.wait(timeout=seconds + settings["grace_seconds"])
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            rc = process.wait()
    text = log.read_text(errors="replace")
    info = {"seconds": round(time.time() - start, 1), "budget_seconds": round(seconds, 1),
            "rc": rc, "killed_at_budget": timed_out, "log": str(log)}
    if rc != 0:
        info["log_tail"] = text[-3000:]
    for line in text.splitlines():
        if line.startswith("[check"):
            print(line, file=sys.stderr, flush=True)
    try:
        data = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}
    return data, info


def orchestrate(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    parts = [part for part in PARTS if part in settings["parts"]]
    bundle = Path(settings["bundle"])
    report: dict[str, Any] = {"check": "accelerator_check (issue 36)", "settings": settings,
                              "python": sys.version.split()[0],
                              "keras_backend": "jax", "parts": {},
                              "jax_compilation_cache": {
                                  "dir": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
                                  "warm_at_start": bool(os.environ.get(
                                      "ACCELERATOR_CHECK_WARM_CACHE"))}}
    if "agreement" in parts and not (bundle / REFERENCE_FILE).is_file():
        report["parts"]["agreement"] = {"skipped": f"no bundle at {bundle} (build it with "
                                                   "benchmarks/accelerator_bundle.py)"}
        parts.remove("agreement")
    log_dir = Path(args.log_dir or os.environ.get("OUT") or tempfile.mkdtemp())
    log_dir.mkdir(parents=True, exist_ok=True)
    settings["trace_dir"] = str(log_dir)
    merged: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        if settings["warm"] and parts:
            seconds = settings["budget"] * settings["warm_share"]
            say(f"warming the compilation caches: up to {seconds:.0f} s")
            report["warm"] = warm_caches(settings, parts, seconds, log_dir, Path(work))
            say(f"warm in {report['warm']['seconds']} s: " + ", ".join(
                f"{name} rc {entry['rc']} {entry['seconds']} s"
                for name, entry in report["warm"]["by_task"].items()))
        for index, part in enumerate(parts):
            left = settings["budget"] - (time.time() - started)
            shares = [PART_SHARES[p] for p in parts[index:]]
            seconds = max(left * shares[0] / sum(shares), 0.0)
            if seconds < 10:
                report["parts"][part] = {"skipped": "time budget"}
                continue
            say(f"part {part}: up to {seconds:.0f} s")
            data, info = run_part(part, settings, seconds, log_dir, Path(work))
            report["parts"][part] = info
            for key, value in data.items():
                if key not in ("started", "finished"):
                    merged.setdefault(key, value)
            if "finished" not in data:
                info["incomplete"] = True
    device = merged.get("device") or {}
    torch_record = merged.get("torch") or {}
    name = device.get("device_kind") or torch_record.get("device_name") or ""
    spec, matched = spec_peak(name)
    measured = (merged.get("matmul_peak") or {}).get("tflops_per_second") or (
        torch_record.get("matmul_peak") or {}).get("tflops_per_second")
    report["device"] = device
    report["peaks"] = {"spec_bf16_dense_tflops": spec, "spec_matched": matched,
                       "measured_bf16_matmul_tflops": measured,
                       "jax_matmul": merged.get("matmul_peak"),
                       "torch_matmul": torch_record.get("matmul_peak")}
    keras_records = merged.get("keras_step") or {}
    for record in keras_records.values():
        add_mfu(record, spec, measured)
    for mode in ("eager", "compile"):
        for record in (torch_record.get(mode) or {}).values():
            add_mfu(record, spec, measured)
    report["keras_step"] = keras_records
    report["torch_peer"] = torch_record
    report["agreement"] = merged.get("agreement")
    report["summary"] = summary(report)
    report["seconds"] = round(time.time() - started, 1)
    return report


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick

    def listed(value, default):
        return [v for v in (value or default).split(",") if v]

    presets = listed(args.presets, "tiny" if quick else "small,base,big")
    for preset in presets:
        try:
            step_variant(preset)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    unknown = [name for name in listed(args.profile, "") if name not in presets]
    if unknown:
        raise SystemExit(f"--profile {','.join(unknown)}: not in --presets "
                         f"({','.join(presets)})")
    compiled = [name for name in listed(args.torch_compile_presets, "")
                if name not in STEP_SHAPES]
    if compiled:
        raise SystemExit(f"--torch-compile-presets {','.join(compiled)}: the peer runs "
                         f"presets only, of {', '.join(STEP_SHAPES)}")
    parts = listed(args.parts, ",".join(PARTS))
    if args.profile and "step" not in parts:
        raise SystemExit("--profile traces the step part's presets: add step to --parts")
    for part in parts:
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}: one of {', '.join(PARTS)}")
    return {
        "parts": parts, "presets": presets, "quick": quick,
        "bundle": str(Path(args.bundle).resolve()),
        "precision": args.precision,
        "steps": args.steps or (4 if quick else 60),
        "window": args.window or (2 if quick else 20),
        "matmul_sizes": [int(s) for s in listed(args.matmul_sizes,
                                                "512" if quick else "4096,8192,16384")],
        "matmul_flops": 1e9 if quick else 4e12,
        "agreement_steps": args.agreement_steps or (20 if quick else 300),
        "agreement_window": args.agreement_window or (10 if quick else 50),
        "agreement_xla_flags": args.agreement_xla_flags,
        "agreement_precisions": listed(args.agreement_precision,
                                       "float32" if quick else "mixed_bfloat16"),
        "profile": listed(args.profile, ""),
        "profile_steps": 3 if quick else 5,
        "profile_top": 12,
        "profile_keep_bytes": 8 << 20,
        "profile_min_seconds": 5.0 if quick else 15.0,
        "torch_modes": listed(args.torch_modes, "eager,compile"),
        # Base first (the comparison), and only presets that --presets asks for.
        "torch_compile_presets": listed(args.torch_compile_presets, ",".join(
            p for p in (presets if quick else ("base", "big", "small"))
            if p in presets and "+" not in p)),
        "budget": args.budget if args.budget is not None else (1800.0 if quick else 265.0),
        "warm": not args.no_warm,
        "warm_share": WARM_SHARE,
        "agreement_warmers": 6,
        "grace_seconds": 20.0,
        "min_seconds_per_preset": 5.0 if quick else 20.0,
    }


def unpack_wheels(wheels: Path, target: Path) -> None:
    """Unpacks the wheels whose distributions the running Python lacks into `target` (for
    a Python without pip: put `target` on PYTHONPATH)."""
    import importlib.metadata
    import zipfile

    target.mkdir(parents=True, exist_ok=True)
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            importlib.metadata.version(name)
            continue  # installed
        except importlib.metadata.PackageNotFoundError:
            pass
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        print(f"unpacked {wheel.name}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", help=f"comma-separated, of {','.join(PARTS)} (default all)")
    parser.add_argument("--presets", help="step and peer presets (default small,base,big); "
                        "`preset+change` adds a candidate to the step part: changes "
                        f"{', '.join(STEP_CHANGES)}")
    parser.add_argument("--steps", type=int, help="timed steps per preset (default 60)")
    parser.add_argument("--window", type=int, help="steps per timing window (default 20)")
    parser.add_argument("--precision", default="mixed_bfloat16", help="of the Keras step")
    parser.add_argument("--matmul-sizes", help="matmul peak sizes (default 4096,8192,16384)")
    parser.add_argument("--agreement-steps", type=int, help="default 300")
    parser.add_argument("--agreement-window", type=int,
                        help="last steps whose mean loss is compared (default 50)")
    parser.add_argument("--agreement-precision",
                        help="comma-separated dtype policies (default mixed_bfloat16)")
    parser.add_argument("--agreement-xla-flags", default="--xla_gpu_autotune_level=0",
                        help="XLA_FLAGS added for the agreement only (default: no GEMM "
                             "autotuning, to compile its 10 batch shapes faster; '' for none)")
    parser.add_argument("--profile", help="step presets (or candidates) whose step to trace "
                        "with JAX's profiler after timing it: the device time by kind of work "
                        "and the longest ops (benchmarks/device_trace.py); default none")
    parser.add_argument("--torch-modes", help="eager,compile (default both)")
    parser.add_argument("--torch-compile-presets",
                        help="presets of torch.compile, in order (default base,big,small)")
    parser.add_argument("--budget", type=float,
                        help="seconds for the warming and all parts (default 265: the run "
                             "tool's 300 s less the install and a margin)")
    parser.add_argument("--no-warm", action="store_true",
                        help="no parallel warming of the compilation caches first (each "
                             "part then compiles its programs one after another)")
    parser.add_argument("--bundle", default=str(DEFAULT_BUNDLE))
    parser.add_argument("--quick", action="store_true",
                        help="a CPU test: tiny shapes, 20 float32 agreement steps")
    parser.add_argument("--json-out", help="also write the JSON here")
    parser.add_argument("--log-dir", help="the parts' logs (default $OUT, else a temp dir)")
    parser.add_argument("--unpack-wheels", nargs=2, metavar=("WHEELS", "TARGET"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=(*PARTS, "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--worker-settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.unpack_wheels:
        unpack_wheels(Path(args.unpack_wheels[0]), Path(args.unpack_wheels[1]))
        return
    if args.worker:
        run_worker(args.worker, json.loads(args.worker_settings), args.worker_deadline,
                   Path(args.worker_out))
        return
    report = orchestrate(args, settings_of(args))
    text = json.dumps(report, indent=1, default=jsonable)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
