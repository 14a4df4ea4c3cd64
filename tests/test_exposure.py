"""The exposure breakdown (oases.schedule.exposure): each wait on communication split by cause.

The attribution on hand-made records (each cause's interval, exact seconds), then on 2 real gloo
ranks with each cause injected and seen attributed: a single program (dependency), a peer that
issues late (issue order), one large all-reduce with nothing to cover it (bandwidth), many tiny
ones (latency), CPU hogs on the cores the transfers use (interference). Every rank's causes add
up to its measured waits. The link (the planner's LinkFit) is fitted to all-reduces timed alone in the same run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from oases.costs.link import LinkFit
from oases.schedule import Communicator, interleave
from oases.schedule.exposure import CAUSES, CollectiveRecord, attribute, gather_logs

from _spawn import run_ranks, stop_process


def _record(index, issued, ended, waits, nbytes=1000):
    return CollectiveRecord(index, "forward", nbytes, issued, ended=ended, waits=list(waits))


def test_attribution_of_each_interval():
    # the link: an all-reduce costs 0.2 s of latency + 1 ms per byte -> 1000 B: 1.2 s
    link = LinkFit(latency_s=0.2, bytes_per_s=1000.0)
    assert link.time(1000) == pytest.approx(1.2)
    # rank 0 issues at 0, rank 1 at 1: the ring starts at 1, the link alone ends at 2.2; it ends at
    # 3.2 (1 s slower); rank 0 waits [0.5, 3.5): 0.5 issue order, 1.2 on the link (0.2 latency,
    # 1.0 bandwidth), 1.0 interference, 0.3 host. Rank 1 waits alone [1.5, 3.4): dependency.
    r0 = [_record(0, 0.0, 3.2, [(0.5, 3.5, False)])]
    r1 = [_record(0, 1.0, 3.2, [(1.5, 3.4, True)])]
    c0, c1 = attribute([r0, r1], link)
    assert c0 == pytest.approx(
        {"dependency": 0.0, "issue order": 0.5, "latency": 0.2, "bandwidth": 1.0, "interference": 1.0, "host": 0.3}
    )
    assert c1 == pytest.approx({**dict.fromkeys(CAUSES, 0.0), "dependency": 1.9})
    # a transfer faster than the model: no interference, the rest of the wait after it is host time
    fast = attribute([[_record(0, 0.0, 0.6, [(0.0, 0.7, False)])]] * 2, link)[0]
    assert fast == pytest.approx(
        {**dict.fromkeys(CAUSES, 0.0), "latency": 0.6 * 0.2 / 1.2, "bandwidth": 0.6 * 1.0 / 1.2, "host": 0.1}
    )
    with pytest.raises(ValueError, match="different numbers"):
        attribute([r0, []], link)


# ---- injected causes on 2 gloo ranks ----------------------------------------------------------------


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _timed_alone(group, nbytes, calls):
    """Seconds per all-reduce of `nbytes`, `calls` back to back (as a schedule issues them), median of 5."""
    t = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(5):
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t, group=group)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _link(group):
    small, large = 16, 8 << 20
    return LinkFit.from_samples([(small, _timed_alone(group, small, 50)), (large, _timed_alone(group, large, 3))])


def _reducer(comm, sizes, before_issue=lambda: None):
    """A program: each all-reduce issued, yielded, waited for."""
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        before_issue()
        work = comm.all_reduce(t, "forward")
        yield
        work.wait()


def _idle(steps, spin_s=0.0):
    """A program with nothing to cover the other's communication: it only yields (after `spin_s`)."""
    for _ in range(steps):
        _spin(spin_s)
        yield


def _recorded(comm, programs):
    dist.barrier()
    with comm.recording() as log:
        interleave(programs, on_resume=comm.resumed)
    return log


def _causes(rank, world_size, case):
    group = dist.group.WORLD
    comm = Communicator(group, world_size)
    link = _link(group)
    if case == "dependency":  # one program: nothing else to run while it waits
        log = _recorded(comm, [_reducer(comm, [1 << 20] * 3)])
    elif case == "issue order":  # rank 1 issues each all-reduce 0.15 s late
        late = (lambda: time.sleep(0.15)) if rank == 1 else (lambda: None)
        log = _recorded(comm, [_reducer(comm, [4096] * 3, late), _idle(3)])
    elif case == "bandwidth":  # 8 MiB all-reduces, the other program idle
        log = _recorded(comm, [_reducer(comm, [8 << 20] * 3), _idle(3)])
    elif case == "latency":  # 200 all-reduces of 16 bytes
        log = _recorded(comm, [_reducer(comm, [16] * 200), _idle(200)])
    elif case == "interference":  # the same all-reduces without, then with CPU hogs on every core
        log = _recorded(comm, [_reducer(comm, [8 << 20] * 3), _idle(3)])
        calm = attribute(gather_logs(log, group), link)[rank]
        count = max(4, os.cpu_count() or 1)  # every core busy, however many the machine has
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)] if rank == 0 else []
        try:
            dist.barrier()
            time.sleep(0.3)  # the hogs spinning
            log = _recorded(comm, [_reducer(comm, [8 << 20] * 3), _idle(3)])
        finally:
            for hog in hogs:
                stop_process(hog)
        causes = attribute(gather_logs(log, group), link)[rank]
        return causes, log.waited, calm
    else:
        raise AssertionError(case)
    causes = attribute(gather_logs(log, group), link)[rank]
    assert sum(causes.values()) == pytest.approx(log.waited, rel=1e-6, abs=1e-9), (causes, log.waited)
    return causes, log.waited


def _share(results, cause, ranks=(0, 1)):
    waited = sum(results[r][1] for r in ranks)
    return sum(results[r][0][cause] for r in ranks) / waited, waited


def test_cpu_hogs_are_attributed_to_interference():
    """The same 8 MiB all-reduces, calm and then with a CPU hog on every core: the hogs show up as
    interference (the link model was fitted calm)."""
    results = run_ranks(_causes, 2, "interference", timeout=90)
    share, waited = _share(results, "interference")
    calm_waited = sum(sum(r[2].values()) for r in results)
    calm = sum(r[2]["interference"] for r in results) / calm_waited
    assert waited > calm_waited and share >= 0.3 and share >= calm + 0.2, (share, calm, results)


@pytest.mark.parametrize(
    "case, cause, ranks, least, over",
    [
        ("dependency", "dependency", (0, 1), 0.99, ()),
        ("issue order", "issue order", (0,), 0.6, CAUSES),  # rank 0 waits for rank 1's late issue
        ("bandwidth", "bandwidth", (0, 1), 0.3, ("latency",)),  # large messages: bytes, not messages
        ("latency", "latency", (0, 1), 0.25, ("bandwidth",)),  # tiny messages: messages, not bytes
    ],
)
def test_injected_cause_is_attributed(case, cause, ranks, least, over):
    """`cause` takes at least `least` of the waits and 3x each cause in `over` (a loaded machine
    slows the transfers: interference may grow, the split between these does not turn)."""
    results = run_ranks(_causes, 2, case, timeout=90)
    share, waited = _share(results, cause, ranks)
    assert waited > 0, results
    totals = {c: sum(results[r][0][c] for r in ranks) for c in CAUSES}
    assert share >= least and all(totals[cause] >= 3 * totals[c] for c in over if c != cause), (case, results)
