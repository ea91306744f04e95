"""The report of the accelerator check of issue 36 (`benchmarks/accelerator_check.py`): each
step's MFU against the device's spec (`SPEC_BF16_TFLOPS`) and against the measured matmul
peak, and the headline numbers, one line each (`summary`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.accelerator_agreement import AGREEMENT_BAR

# bfloat16 dense tensor-core peak of the device's spec, TFLOP/s (NVIDIA data sheets; the
# sparse figures are twice these). First match in the device name wins.
SPEC_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0),
                    ("GH200", 989.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def spec_peak(name: str) -> tuple[float | None, str | None]:
    for key, tflops in SPEC_BF16_TFLOPS:
        if key.lower() in name.lower():
            return tflops, key
    return None, None


def add_mfu(record: dict[str, Any], spec: float | None, measured: float | None) -> None:
    if "tflops_per_second" not in record:
        return
    record["mfu_spec"] = record["tflops_per_second"] / spec if spec else None
    record["mfu_measured_matmul"] = (record["tflops_per_second"] / measured
                                     if measured else None)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, one line each."""
    lines: dict[str, Any] = {}

    def describe(record):
        if "step_seconds" not in record:
            return (record.get("skipped") or record.get("error", "")[:200]
                    or record.get("incomplete"))
        mfu = record.get("mfu_spec")
        return (f"{record['step_seconds'] * 1e3:.2f} ms/step, "
                f"{record['target_tokens_per_second']:,.0f} tok/s, "
                f"{record['tflops_per_second']:.1f} TFLOP/s"
                + (f", MFU {mfu:.1%} of spec" if mfu else "")
                + (f", {record['mfu_measured_matmul']:.1%} of matmul"
                   if record.get("mfu_measured_matmul") else ""))

    for preset, record in (report.get("keras_step") or {}).items():
        lines[f"keras {preset}"] = describe(record)
    for mode in ("eager", "compile"):
        for preset, record in ((report.get("torch_peer") or {}).get(mode) or {}).items():
            lines[f"torch {mode} {preset}"] = describe(record)
    if (report.get("torch_peer") or {}).get("skipped"):
        lines["torch"] = report["torch_peer"]["skipped"]
    for precision, run in ((report.get("agreement") or {}).get("runs") or {}).items():
        if "relative_difference" in run:
            lines[f"agreement {precision}"] = (
                f"mean loss of steps {run['window'][0]}-{run['window'][1]}: "
                f"{run['mean_loss']:.4f} vs CPU {run['reference_mean_loss']:.4f}, relative "
                f"difference {run['relative_difference']:.2e} "
                + {True: f"(within the {AGREEMENT_BAR:.0%} bar); ",
                   False: f"(OUTSIDE the {AGREEMENT_BAR:.0%} bar); ",
                   None: f"(not judged: {run['stopped']}); "}[run["within_bar"]]
                + f"batches identical: {run['batches_identical']}")
        else:
            lines[f"agreement {precision}"] = (run.get("error") or run.get("stopped")
                                               or run.get("incomplete"))
    return lines
