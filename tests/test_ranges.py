"""oases._ranges.hot_range: a profiler range while a profiler records, nothing (no range object) otherwise."""

import contextlib

import torch

from oases._ranges import hot_range


def test_hot_range_records_only_under_a_profiler():
    assert isinstance(hot_range("oases::test"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with hot_range("oases::test"):
            torch.ones(2).add_(1)
    assert "oases::test" in {event.name for event in prof.events()}
