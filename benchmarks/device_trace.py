"""Where a compiled step spends its device time, from a JAX profiler trace (issue 36's aim).

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes `perfetto_trace.json.gz` (Chrome's
trace-event JSON) beside the XPlane protobuf; reading it needs the standard library only, so
the accelerator check summarises it on the GPU machine itself, which has no TensorBoard. Each
device line (a CUDA stream, or the "XLA Ops" line the profiler derives from the kernels) gets
its busy time, the share of each kind of work (matmuls, attention, copies, the rest: fused
elementwise ops and reductions) and its longest events by total time. Without a device (a CPU
test), XLA's own threads on the host stand in.

Usage: python benchmarks/device_trace.py TRACE_DIR [--top N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path
from typing import Any

# Kinds of device work, by event name (kernel or HLO op); the first match wins.
KINDS = (
    ("attention", re.compile(r"cudnn|fmha|flash|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|matmul|dot|sm\d+_", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|transpose", re.I)),
)


def kind_of(name: str) -> str:
    """The kind of an event (`KINDS`), "other" when none matches."""
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def find_trace(directory: str | Path) -> Path:
    """The newest `perfetto_trace.json.gz` under `directory`.

    Raises:
        FileNotFoundError: none there (the trace was not written with
            `create_perfetto_trace=True`).
    """
    traces = sorted(Path(directory).rglob("perfetto_trace.json.gz"),
                    key=lambda path: path.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}: trace with "
                                "jax.profiler.trace(dir, create_perfetto_trace=True)")
    return traces[-1]


def summarise(trace: str | Path, top: int = 12) -> dict[str, Any]:
    """Per device line: busy microseconds, by kind, and the `top` events by total time.

    Args:
        trace: a `perfetto_trace.json.gz` (or its directory).
        top: events listed per line.

    Returns:
        {"trace": path, "device_processes": [...], "source": "device lines" or "host
        threads (no device lines in the trace)", "lines": {"process / thread": {
        "events", "busy_us", "by_kind_us", "by_kind_share", "top": [[name, total_us, count],
        ...]}}}. Busy time sums the events' durations: events that overlap (several streams
        on one line) count twice.
    """
    path = Path(trace)
    if path.is_dir():
        path = find_trace(path)
    with gzip.open(path, "rt") as stream:
        data = json.load(stream)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") != "M":
            continue
        if event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("name") == "thread_name":
            threads[(event["pid"], event.get("tid"))] = event["args"]["name"]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}

    def wanted(event) -> bool:
        if devices:
            return event["pid"] in devices
        return threads.get((event["pid"], event.get("tid")), "").startswith("tf_XLA")

    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in events:
        if event.get("ph") != "X" or not wanted(event):
            continue
        line = (f"{processes.get(event['pid'], event['pid'])} / "
                f"{threads.get((event['pid'], event.get('tid')), event.get('tid'))}")
        totals[line][event["name"]] += float(event.get("dur", 0.0))
        counts[line][event["name"]] += 1
    lines = {}
    for line, by_name in totals.items():
        busy = sum(by_name.values())
        by_kind: collections.Counter = collections.Counter()
        for name, microseconds in by_name.items():
            by_kind[kind_of(name)] += microseconds
        lines[line] = {
            "events": sum(counts[line].values()), "busy_us": round(busy, 1),
            "by_kind_us": {k: round(v, 1) for k, v in by_kind.most_common()},
            "by_kind_share": {k: round(v / busy, 3) if busy else None
                              for k, v in by_kind.most_common()},
            "top": [[name[:160], round(us, 1), counts[line][name]]
                    for name, us in by_name.most_common(top)]}
    return {"trace": str(path), "device_processes": sorted(processes[p] for p in devices),
            "source": "device lines" if devices
            else "host threads (no device lines in the trace)", "lines": lines}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    json.dump(summarise(args.trace_dir, args.top), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
