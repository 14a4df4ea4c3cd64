"""The exposure breakdown (oases.schedule.exposure): each wait on communication split by cause.

The attribution on hand-made records (each cause's interval, exact seconds), then on 2 real gloo
ranks with each cause injected and seen attributed: a single program (dependency), a peer that
issues late (issue order), one large all-reduce with nothing to cover it (bandwidth), many tiny
ones (latency), CPU hogs on the cores the transfers use (interference). Every rank's causes add
up to its measured waits. The link (the planner's LinkFit) is fitted to all-reduces timed alone in the same run.
Each injected case runs in 5 rounds judged by their median (calm and hogged rounds alternate), so one
round slowed by the machine's other work does not decide.
"""

from __future__ import annotations

import os
import signal
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

from _spawn import cpu_only, run_ranks, stop_process


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


def _program(comm, rank, case):
    if case == "dependency":  # one program: nothing else to run while it waits
        return [_reducer(comm, [1 << 20] * 3)]
    if case == "issue order":  # rank 1 issues each all-reduce 0.15 s late
        late = (lambda: time.sleep(0.15)) if rank == 1 else (lambda: None)
        return [_reducer(comm, [4096] * 3, late), _idle(3)]
    if case == "bandwidth":  # 8 MiB all-reduces, the other program idle
        return [_reducer(comm, [8 << 20] * 3), _idle(3)]
    if case == "latency":  # 200 all-reduces of 16 bytes
        return [_reducer(comm, [16] * 200), _idle(200)]
    raise AssertionError(case)


def _causes(rank, world_size, case, rounds):
    """`case`'s programs run `rounds` times: per round (causes, waited seconds) of this rank."""
    group = dist.group.WORLD
    comm = Communicator(group, world_size)
    link = _link(group)
    rows = []
    for _ in range(rounds):
        log = _recorded(comm, _program(comm, rank, case))
        causes = attribute(gather_logs(log, group), link)[rank]
        assert sum(causes.values()) == pytest.approx(log.waited, rel=1e-6, abs=1e-9), (causes, log.waited)
        rows.append((causes, log.waited))
    return rows


def _interference_rounds(rank, world_size, rounds):
    """The same 8 MiB all-reduces in `rounds` pairs of rounds, calm then with CPU hogs on every core
    (two per core, started once and paused with SIGSTOP between hogged rounds, so a slow start or a
    noisy minute lands on both kinds alike): per round (interference seconds, waited seconds)."""
    group = dist.group.WORLD
    comm = Communicator(group, world_size)
    link = _link(group)
    count = 2 * max(2, os.cpu_count() or 1)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)] if rank == 0 else []
    rows = {"calm": [], "hogged": []}
    try:
        for hog in hogs:
            hog.send_signal(signal.SIGSTOP)
        for _ in range(rounds):
            for kind, sig in (("calm", signal.SIGSTOP), ("hogged", signal.SIGCONT)):
                for hog in hogs:
                    hog.send_signal(sig)
                dist.barrier()
                time.sleep(0.05)  # the scheduler sees the hogs runnable (or gone)
                log = _recorded(comm, [_reducer(comm, [8 << 20] * 3), _idle(3)])
                causes = attribute(gather_logs(log, group), link)[rank]
                assert sum(causes.values()) == pytest.approx(log.waited, rel=1e-6, abs=1e-9), (causes, log.waited)
                rows[kind].append((causes["interference"], log.waited))
    finally:
        for hog in hogs:
            hog.send_signal(signal.SIGCONT)
            stop_process(hog)
    return rows


@cpu_only("CPU hogs slow gloo's transfers; the exposure log records host-side waits (gloo only)")
def test_cpu_hogs_are_attributed_to_interference():
    """The same 8 MiB all-reduces, calm and with a CPU hog on every core, in alternating rounds: the
    hogs show up as interference (the link model was fitted calm). Judged by the medians over the
    rounds of both ranks, so one noisy round of either kind does not decide."""
    results = run_ranks(_interference_rounds, 2, 5, timeout=120)
    median = {
        kind: (
            statistics.median(i for r in results for i, _ in r[kind]),
            statistics.median(w for r in results for _, w in r[kind]),
        )
        for kind in ("calm", "hogged")
    }
    (calm_s, calm_waited), (hogged_s, hogged_waited) = median["calm"], median["hogged"]
    assert hogged_waited > 1.3 * calm_waited, median  # the hogs slowed the transfers
    assert hogged_s - calm_s >= 0.6 * (hogged_waited - calm_waited), median  # and the slowdown is interference


@cpu_only("the exposure log records host-side waits: CUDA waits order streams without blocking the host")
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
    """In the median of 5 rounds, `cause` takes at least `least` of the waits of `ranks`; over all
    rounds, it is 3x each cause in `over` (a loaded machine slows the transfers: interference may
    grow, the split between these does not turn)."""
    results = run_ranks(_causes, 2, case, 5, timeout=120)
    rounds = [[results[r][i] for r in ranks] for i in range(5)]
    assert all(sum(w for _, w in row) > 0 for row in rounds), results
    share = statistics.median(sum(c[cause] for c, _ in row) / sum(w for _, w in row) for row in rounds)
    totals = {c: sum(causes[c] for row in rounds for causes, _ in row) for c in CAUSES}
    assert share >= least, (case, share, totals)
    assert all(totals[cause] >= 3 * totals[c] for c in over if c != cause), (case, totals)
