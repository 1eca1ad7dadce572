"""tools/trace_summary.py on a small hand-made Chrome trace: busy time per stream, top-level host
operations (nested ones not counted twice), one layer's events between two attention kernels."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).parents[1] / "tools" / "trace_summary.py"


def _tool():
    spec = importlib.util.spec_from_file_location("trace_summary", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu(name, cat, ts, dur, stream, device=0):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"device": device, "stream": stream}}


def _cpu(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_the_summary_of_a_small_trace(tmp_path):
    tool = _tool()
    events = [
        _gpu("sdpa_flash", "kernel", 0, 900, 7), _gpu("gemm", "kernel", 1000, 500, 7),
        _gpu("Memcpy HtoD", "gpu_memcpy", 1200, 1500, 14), _gpu("sdpa_flash", "kernel", 3000, 900, 7),
        _gpu("gemm", "kernel", 4000, 100, 7),
        _cpu("aten::matmul", 0, 300), _cpu("aten::mm", 10, 200),  # nested: counted once, as matmul
        _cpu("aten::matmul", 400, 100), _cpu("aten::copy_", 600, 50, tid=2),
        {"ph": "i", "name": "an instant event"},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    loaded = tool.load_events(str(path))
    assert len(loaded) == 9
    assert tool.stream_busy(loaded) == {("0", "7"): {"kernel": pytest.approx(2.4)},
                                        ("0", "14"): {"gpu_memcpy": pytest.approx(1.5)}}
    assert tool.host_ops(loaded) == {"aten::matmul": (2, pytest.approx(0.4)), "aten::copy_": (1, pytest.approx(0.05))}
    assert [e["name"] for e in tool.layer_events(loaded, 0)] == ["sdpa_flash", "gemm", "Memcpy HtoD"]
