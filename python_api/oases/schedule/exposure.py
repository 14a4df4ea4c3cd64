"""Why a step waits on communication: each wait of a recorded step split by cause.

::

    with comm.recording() as log:                    # a Communicator's all-reduces, logged
        oases.train_step(model, ids, labels, comm=comm)
    logs = gather_logs(log, comm.group)              # every rank's log (a collective)
    link = LinkFit.from_samples([(n, t), ...])     # all-reduces timed alone (oases.costs.link)
    causes = attribute(logs, link)[rank]             # {cause: seconds}, summing to the waits

A log holds, per asynchronous all-reduce this rank issued: its bytes, when it was issued, when it
completed (its future's callback; it runs on the backend's thread and needs the GIL, so it may
come a little late: that shows as interference), and each wait on it: [start, end) and whether
no other sub-batch's program ran between its issue and the wait (`alone`: nothing could have
covered it; a wait after the programs ended, such as a gradient sum, is alone). The
ranks' clocks must be comparable (time.perf_counter is CLOCK_MONOTONIC: ranks on one host, as the
link emulator runs them). For a wait [w0, w1) on collective i of rank r:

::

    issued_i   = max over ranks of the time i was issued (no ring step runs before every rank issued)
    T_i        = link.time(nbytes_i), of which link.latency_s is the link's per-call latency
    dependency                      the whole wait, when alone (no other program to run meanwhile:
                                    one sub-batch, a pass barrier, the others finished)
    otherwise the wait's overlap with these intervals, in order:
    issue order   [issued_i^r, issued_i)        a peer had not issued it yet (skew, interleaving)
    latency       [issued_i, issued_i + T_i) x latency share    the link's own time ...
    bandwidth     [issued_i, issued_i + T_i) x the rest         ... not covered by compute
    interference  [issued_i + T_i, end_i)       slower than the link alone: the CPU (gloo reduces
                                                on the cores that compute) or another collective
                                                sharing the link
    host          [end_i, w1)                   waking up after it completed

By construction the causes add up to the wait. CUDA waits order streams without blocking the
host: record on CPU (gloo) only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch.distributed as dist

__all__ = ["CAUSES", "CollectiveRecord", "ExposureLog", "Link", "attribute", "gather_logs"]

CAUSES = ("dependency", "issue order", "latency", "bandwidth", "interference", "host")


@dataclass
class CollectiveRecord:
    """One asynchronous all-reduce of this rank (times: time.perf_counter seconds)."""

    index: int
    phase: str
    nbytes: int
    issued: float
    others_at_issue: int = 0  # the Communicator's count of resumptions after another program, then
    ended: Optional[float] = None
    waits: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, end, alone)


class ExposureLog:
    """The records of one recording (Communicator.recording); filled from two threads (the
    caller's and the backend's completion callbacks)."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []
        self._lock = threading.Lock()

    def issue(self, phase: str, nbytes: int, others: int = 0) -> CollectiveRecord:
        """Log an all-reduce of `nbytes` issued now in `phase` and return its record."""
        with self._lock:
            record = CollectiveRecord(len(self.records), phase, nbytes, time.perf_counter(), others)
            self.records.append(record)
        return record

    @staticmethod
    def ended(record: CollectiveRecord) -> None:
        """Stamp `record`'s completion time: now."""
        record.ended = time.perf_counter()

    @property
    def waited(self) -> float:
        """Seconds spent in every wait of every record, summed."""
        return sum(w1 - w0 for r in self.records for w0, w1, _ in r.waits)


class Link(Protocol):
    """Seconds of one all-reduce alone on the link: time(n) = latency_s + n / bytes_per_s (the
    oases.costs.link.LinkFit is one: `LinkFit.from_samples` fits it to timed all-reduces)."""

    latency_s: float

    def time(self, nbytes: float) -> float:
        """Seconds of one all-reduce of `nbytes` alone on the link."""


def gather_logs(log: ExposureLog, group: Optional[dist.ProcessGroup]) -> list[list[CollectiveRecord]]:
    """Every rank's records, by rank (a collective over `group`: every rank calls it)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, log.records, group=group)
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def attribute(logs: Sequence[Sequence[CollectiveRecord]], link: Link) -> list[dict[str, float]]:
    """{cause: seconds} per rank from every rank's records (see the module docstring); each
    rank's causes add up to its waits."""
    counts = {len(records) for records in logs}
    if len(counts) != 1:
        raise ValueError(
            f"logs: the ranks recorded different numbers of all-reduces {sorted(counts)}; record "
            "the same step on every rank"
        )
    out = []
    for records in logs:
        causes = dict.fromkeys(CAUSES, 0.0)
        for record in records:
            issued = max(rs[record.index].issued for rs in logs)
            t_link = link.time(record.nbytes)
            lat_share = min(1.0, link.latency_s / t_link) if t_link > 0 else 0.0
            link_end = issued + t_link
            end = record.ended if record.ended is not None else max((w1 for _, w1, _ in record.waits), default=issued)
            for w0, w1, alone in record.waits:
                if alone:
                    causes["dependency"] += w1 - w0
                    continue
                causes["issue order"] += _overlap(w0, w1, record.issued, issued)
                on_link = _overlap(w0, w1, issued, min(link_end, end))
                causes["latency"] += on_link * lat_share
                causes["bandwidth"] += on_link * (1.0 - lat_share)
                causes["interference"] += _overlap(w0, w1, max(issued, link_end), end)
                causes["host"] += _overlap(w0, w1, max(issued, end), w1)
        out.append(causes)
    return out
