"""`benchmarks/device_trace.py`: the accelerator check's summary of a JAX profiler trace."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.device_trace import kind_of, summarise


def _trace(folder, events):
    path = folder / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as stream:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, stream)
    return path


def test_device_lines_are_summed_by_kind_and_host_threads_left_out(tmp_path):
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name",
             "args": {"name": "tf_XLAEigen/1"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 3, "name": "thread_name",
             "args": {"name": "Stream #13(Compute)"}}]

    def kernel(name, dur, pid=2, tid=3):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": 0.0, "dur": dur, "name": name}

    _trace(tmp_path, [*meta, kernel("sm90_xmma_gemm_bf16bf16", 30.0),
                      kernel("sm90_xmma_gemm_bf16bf16", 20.0),
                      kernel("cudnn_generated_fort_native_sdpa_sm90", 15.0),
                      kernel("loop_multiply_fusion_3", 25.0),
                      kernel("input_reduce_fusion", 10.0),
                      kernel("dot_general.1", 999.0, pid=1, tid=7)])  # host: not counted
    summary = summarise(tmp_path, top=2)
    assert summary["device_processes"] == ["/device:GPU:0"]
    assert summary["source"] == "device lines"
    (line,) = summary["lines"].values()
    assert line["events"] == 5 and line["busy_us"] == 100.0
    assert line["by_kind_us"] == {"matmul": 50.0, "other": 35.0, "attention": 15.0}
    assert line["by_kind_share"]["matmul"] == 0.5
    assert line["top"] == [["sm90_xmma_gemm_bf16bf16", 50.0, 2],
                           ["loop_multiply_fusion_3", 25.0, 1]]


def test_kinds_by_event_name():
    assert kind_of("cutlass_80_tensorop_bf16_s16816gemm") == "matmul"
    assert kind_of("custom-call.12 (cudnn flash attention)") == "attention"
    assert kind_of("transpose_fusion.4") == "copy"
    assert kind_of("loop_add_fusion") == "other"


def test_a_folder_without_a_trace_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace=True"):
        summarise(tmp_path)
