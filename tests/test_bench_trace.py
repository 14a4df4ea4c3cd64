"""bench._trace on a CPU: the library's profiler ranges read into a rank's trace, in the span
that opened them (no patching of the library); the device placement of ranges, from synthetic
CUDA events."""

import os
import sys
import time
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is a package at the repository root, not installed

from bench._trace import COMM, COMPUTE, OP, RING_RANGES, WAIT_RANGES, Recorder, profiled, ranges_in  # noqa: E402
from oases.ops import gemm  # noqa: E402

SLACK_US = 200  # the profiler's clock mapped onto perf_counter's: a few microseconds apart


def test_profiled_reads_the_library_ranges_inside_each_span():
    recorder = Recorder(3)
    x, w, out = torch.randn(5, 8), torch.randn(3, 8), torch.empty(5, 3)
    with profiled(recorder, {**RING_RANGES, **WAIT_RANGES}) as span:
        gemm.linear_into(x, w, None, out)  # outside every span: not read
        for label in ("first", "second"):
            with span(f"{label} call", OP, label=label):
                gemm.linear_into(x, w, None, out)  # 5 rows on the CPU: padded, one range inside another
                with torch.profiler.record_function("oases::schedule::wait"):
                    time.sleep(0.003)
    torch.testing.assert_close(out, x @ w.T)
    events = recorder.events
    assert [(e["name"], e["tid"]) for e in events if e["tid"] == OP] == [("first call", OP), ("second call", OP)]
    for label in ("first", "second"):
        (op,) = [e for e in events if e["name"] == f"{label} call"]
        mine = [e for e in events if e["args"].get("op") == label]
        assert sorted((e["tid"], e["name"]) for e in mine) == [(COMPUTE, "gemm"), (COMM, f"{label} wait")]
        for e in mine:
            assert e["pid"] == 3 and e["dur"] >= 0
            assert op["ts"] - SLACK_US <= e["ts"] and e["ts"] + e["dur"] <= op["ts"] + op["dur"] + SLACK_US
        (wait,) = [e for e in mine if e["tid"] == COMM]
        assert wait["dur"] >= 2500


def _event(name, start, end, id, thread=1, device=DeviceType.CPU, linked=0):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        id=id,
        thread=thread,
        device_type=device,
        linked_correlation_id=linked,
    )


def test_ranges_are_placed_where_their_device_work_ran():
    events = [
        _event("oases::gemm", 10, 20, 5),
        _event("aten::mm", 12, 18, 6),
        _event("gemm_kernel", 30, 45, 100, thread=7, device=DeviceType.CUDA, linked=6),
        _event("oases::ring::post", 21, 24, 8),  # NCCL's kernel linked to the range itself
        _event("nccl_kernel", 22, 60, 101, thread=8, device=DeviceType.CUDA, linked=8),
        _event("oases::ring::wait", 25, 26, 9),  # stream-ordered: no device work, its host interval
        _event("oases::gemm", 12, 14, 10, thread=2),  # another thread: its own range
        _event("other_kernel", 70, 80, 102, thread=7, device=DeviceType.CUDA, linked=11),
        _event("oases::gemm", 90, 95, 12),  # starts after the window
    ]
    got = ranges_in(events, RING_RANGES, 0, 50)
    assert sorted(got) == [
        ("oases::gemm", 12, 14),
        ("oases::gemm", 30, 45),
        ("oases::ring::post", 22, 60),
        ("oases::ring::wait", 25, 26),
    ]
    nested = [_event("oases::gemm", 0, 10, 1), _event("oases::gemm", 2, 8, 2), _event("oases::gemm", 11, 12, 3)]
    assert ranges_in(nested, ["oases::gemm"], 0, 20) == [("oases::gemm", 0, 10), ("oases::gemm", 11, 12)]
