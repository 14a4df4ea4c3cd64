"""One rank's communication scheduler: pipeline transfers first, data-parallel sync in preemptible chunks.

    sched = CommScheduler(preemption=True)
    t = sched.track(dist.irecv(buf, src, group=pp_group, tag=tag), "recv", src)   # a PP transfer
    t.wait()                                   # main thread: done (reaped on the scheduler's thread)
    fut = sched.submit(lambda: sched.all_reduce(flat, dp_group, chunks=4))   # on the DP thread
    with sched.urgent(): fut.result()          # the caller now waits for DP: no more holding back
    sched.deferred_chunks, sched.pp_latency["send"], ...                     # counters

FOLD3D §5.1 (preemptive communication), CPU path. Two kinds of traffic share this rank's links:
pipeline (PP) activations and gradients, small and on the critical path, and the data-parallel
(DP) gradient sync, large and overlappable. The DP sync runs on the scheduler's DP thread as ring
reduce-scatter + all-gather (oases.comm) cut into chunks, one ring step of one piece at a time.
Before each chunk is posted, the DP thread asks the gate: while a PP send or receive of this rank
is pending or in flight, the chunk is held back (`deferred_chunks` counts chunks held at least
once) until every PP transfer has completed. Preemption is at chunk boundaries: pieces already
posted keep travelling and what was received is kept; nothing is re-sent.

    time ->          (preemption=True)
    main (compute) : | B(1,*) ........ | B(0,0) | B(0,1) | ...
    PP transfers   :          | recv g(0,0) |  | send g |
    DP thread      : launch(seg 1) c0 c1 ..held.. c2 c3 ..held.. c4 ...

PP transfers are observed by reaper threads, one per lane (kind and peer: the caller posts each
lane's transfers in the order they complete, e.g. receives in the order it waits for them; each
reaper waits its lane's transfers in posting order), since a gloo work's `is_completed()` stays
False until `wait()`: a
transfer counts as in flight from `track` until its reaper's `wait()` returns, and the main thread
waits on the reaper's event, never on the work itself (a gloo work must have one waiter).
`pp_latency[kind]` lists, per transfer, the seconds from posting to completion as the reaper saw
it (for a receive posted ahead this includes the sender's compute; compare runs with
`preemption=False` on the same schedule, never absolute values).

Liveness. The main thread waits for a segment's DP sync before that segment's next forward; it
does so inside `urgent()`, which lifts the hold on this rank (priority inheritance: the PP work
now waits for DP anyway). A hold can still be part of a cycle across ranks (rank X waits for its
sync, which needs DP peer Y's chunk, which Y holds for a PP transfer whose peer waits for its own
sync, ...), so a hold lasts at most `hold_timeout` seconds; a chunk released that way is counted
in `forced_chunks`. `overlapped_chunks` counts chunks posted while a PP transfer was in flight:
with preemption on it is `forced_chunks + inherited_chunks` (the latter posted while the main
thread waited for DP), with it off every such chunk. Decided under the scheduler's lock when the
chunk is posted: a PP transfer posted a moment later overlaps that chunk, by design of
chunk-boundary preemption.

On CUDA (NCCL) the same design maps to streams: PP transfers go over the links of
oases.pipeline.p2p, groups with high-priority NCCL streams; DP chunks over the dp group at
default priority, posted from the DP thread on a stream of its own (oases.pipeline.dp_sync); the
gate is unchanged. A CUDA transfer's `wait()` makes the caller's current stream wait for it (no
host block, as ProcessGroupNCCL's wait does), and its reaper polls `is_completed()` to count it
in flight until the GPU has finished it. That path is written to this contract but has not run:
it needs several ranks on NCCL, which no machine here had (docs/verified.md).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Generator, Iterator, Optional

import torch
import torch.distributed as dist

from oases.comm import all_gather_steps, reduce_scatter_steps
from oases.comm.hierarchical import HostGroups, hierarchical_all_gather_steps, hierarchical_reduce_scatter_steps

__all__ = ["CommScheduler", "Transfer"]

_POLL_S = 50e-6  # how often a CUDA transfer's reaper asks whether it completed
DP_TAG = 4  # the DP thread's rings use message tags 4 and 5 (main thread's rings 0-1, Communicator 2-3)


class Transfer:
    """One tracked PP send or receive; `wait()` returns once its reaper saw it complete."""

    def __init__(self, work: dist.Work, kind: str, cuda: bool = False) -> None:
        self.work, self.kind, self.cuda = work, kind, cuda
        self.posted = time.perf_counter()
        self.latency: Optional[float] = None  # seconds from posting to completion
        self.error: Optional[BaseException] = None
        self._done = threading.Event()

    def wait(self) -> None:
        """CPU: block until the reaper saw it complete. CUDA: the current stream waits for it."""
        if self.cuda:
            self.work.wait()
            return
        self._done.wait()
        if self.error is not None:
            raise self.error


class _Worker:
    """A daemon thread running callables from a queue in order (started on first use)."""

    def __init__(self, name: str, run: Callable[[Any], None]) -> None:
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, args=(run,), name=name, daemon=True)
        self._thread.start()

    def _loop(self, run: Callable[[Any], None]) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            run(item)

    def put(self, item: Any) -> None:
        self._queue.put(item)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class CommScheduler:
    """This rank's PP transfers and DP sync chunks, with PP preempting DP (see the module doc).

    `preemption`: hold DP chunks back while a PP transfer is in flight (False: DP chunks go at
    once; the counters still count, to measure PP latency without preemption). `hold_timeout`:
    the longest a chunk is held (liveness guard, see the module doc)."""

    def __init__(self, *, preemption: bool = True, hold_timeout: float = 0.5) -> None:
        self.preemption, self.hold_timeout = preemption, hold_timeout
        self._cond = threading.Condition()
        self._in_flight = 0  # PP transfers tracked and not yet reaped
        self._urgent = 0  # main-thread waits for DP in progress
        self._dp: Optional[_Worker] = None
        self._reapers: dict[str, _Worker] = {}
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero every counter."""
        with self._cond:
            self.dp_chunks = 0  # DP chunks posted
            self.deferred_chunks = 0  # DP chunks held back at least once by a PP transfer
            self.forced_chunks = 0  # ... posted at hold_timeout while PP was still in flight
            self.inherited_chunks = 0  # ... posted with PP in flight as the main thread waited for DP
            self.overlapped_chunks = 0  # DP chunks posted while a PP transfer was in flight
            self.hierarchical_syncs = 0  # all_reduce calls run in two levels (hosts given)
            self.pp_latency: dict[str, list[float]] = {"send": [], "recv": []}

    # --- PP side (main thread) ------------------------------------------------------------------

    def track(self, work: dist.Work, kind: str, peer: int, *, device: Optional[torch.device] = None) -> Transfer:
        """Register a posted PP transfer (`kind` "send" | "recv", with global rank `peer`, of a
        tensor on `device`, CPU if None); DP chunks wait while it flies. Transfers of one (kind,
        peer) lane are waited in posting order."""
        transfer = Transfer(work, kind, cuda=device is not None and torch.device(device).type == "cuda")
        with self._cond:
            self._in_flight += 1
        lane = f"{kind}-{peer}"
        if lane not in self._reapers:
            self._reapers[lane] = _Worker(f"oases-pp-{lane}", self._reap)
        self._reapers[lane].put(transfer)
        return transfer

    def _reap(self, transfer: Transfer) -> None:
        try:
            if transfer.cuda:  # wait() would only make this thread's stream wait: poll the GPU's progress
                while not transfer.work.is_completed():
                    time.sleep(_POLL_S)
            else:
                transfer.work.wait()
        except BaseException as error:  # handed to the waiter
            transfer.error = error
        transfer.latency = time.perf_counter() - transfer.posted
        with self._cond:
            self._in_flight -= 1
            self.pp_latency[transfer.kind].append(transfer.latency)
            self._cond.notify_all()
        transfer._done.set()

    # --- DP side --------------------------------------------------------------------------------

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the DP thread after everything submitted before it; its Future."""
        if self._dp is None:
            self._dp = _Worker("oases-dp", self._run)
        future: Future = Future()
        self._dp.put((fn, future))
        return future

    @staticmethod
    def _run(item: tuple[Callable[[], Any], Future]) -> None:
        fn, future = item
        try:
            future.set_result(fn())
        except BaseException as error:
            future.set_exception(error)

    @contextlib.contextmanager
    def urgent(self) -> Iterator[None]:
        """Inside: the caller waits for DP work, so DP chunks are no longer held back."""
        with self._cond:
            self._urgent += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._urgent -= 1

    def gate(self) -> None:
        """Called by the DP thread before posting each chunk: holds it while PP is in flight."""
        with self._cond:
            if self.preemption and self._in_flight and not self._urgent:
                self.deferred_chunks += 1
                deadline = time.monotonic() + self.hold_timeout
                while self._in_flight and not self._urgent:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            self.dp_chunks += 1
            if self._in_flight:  # posted beside a PP transfer: why?
                self.overlapped_chunks += 1
                if self.preemption and self._urgent:
                    self.inherited_chunks += 1
                elif self.preemption:
                    self.forced_chunks += 1

    def _gated(self, steps: Generator[None, None, torch.Tensor]) -> torch.Tensor:
        """Drive a ring generator (oases.comm *_steps), passing the gate before each ring step."""
        while True:
            self.gate()
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def all_reduce(
        self, flat: torch.Tensor, group: dist.ProcessGroup, *, chunks: int, hosts: Optional[HostGroups] = None
    ) -> torch.Tensor:
        """Sum the 1-D `flat` over `group` in place by ring reduce-scatter + all-gather, gated per
        chunk; for the DP thread (tags DP_TAG, DP_TAG + 1).

            padded = flat padded to a multiple of p * chunks         # [p * n]
            own = reduce_scatter(padded)                             # [n]: this rank's summed block
            flat[...] = all_gather(own)[:flat.numel()]               # [p * n] -> [numel]

        `hosts` (an oases.comm.hierarchical.HostGroups of `group`'s ranks): both rings run in two
        levels (hierarchical_reduce_scatter_steps / _all_gather_steps: intra-host, then inter-host
        rings, and back), gated before each of their ring steps alike; counted in
        `hierarchical_syncs`. None: the flat rings over `group`."""
        p = dist.get_world_size(group)
        if hosts is not None and hosts.size != p:
            raise ValueError(f"hosts: splits {hosts.size} ranks, but the group has {p}")
        quantum = p * chunks
        padded = flat.new_zeros(-(-flat.numel() // quantum) * quantum)  # [p * n]
        padded[: flat.numel()].copy_(flat)
        if hosts is None:
            own = self._gated(reduce_scatter_steps(padded, group, chunks=chunks, tag=DP_TAG))  # [n]
            full = self._gated(all_gather_steps(own, group, chunks=chunks, tag=DP_TAG))  # [p * n]
        else:
            with torch.profiler.record_function("oases::pipeline::dp_sync[hierarchical]"):
                own = self._gated(hierarchical_reduce_scatter_steps(padded, hosts, chunks=chunks, tag=DP_TAG))
                full = self._gated(hierarchical_all_gather_steps(own, hosts, chunks=chunks, tag=DP_TAG))
            with self._cond:
                self.hierarchical_syncs += 1
        flat.copy_(full[: flat.numel()])
        return flat

    def reduce_scatter(self, flat: torch.Tensor, group: dist.ProcessGroup, *, chunks: int) -> torch.Tensor:
        """This rank's block of the sum over `group` of the 1-D `flat` [p * n] (n a multiple of
        `chunks`), by ring reduce-scatter gated per chunk; for the DP thread (ZeRO's gradients).

            own = sum over ranks r' of (flat of r')[rank * n : (rank + 1) * n]      # [n]"""
        return self._gated(reduce_scatter_steps(flat, group, chunks=chunks, tag=DP_TAG))

    def all_gather(self, own: torch.Tensor, group: dist.ProcessGroup, *, chunks: int) -> torch.Tensor:
        """cat(every rank's 1-D `own` [n], in rank order) [p * n] (n a multiple of `chunks`), by ring
        all-gather gated per chunk; for the DP thread (ZeRO's parameters)."""
        return self._gated(all_gather_steps(own, group, chunks=chunks, tag=DP_TAG))

    def close(self) -> None:
        """End the threads (after their queued work); later use starts new ones."""
        workers = ([self._dp] if self._dp is not None else []) + list(self._reapers.values())
        self._dp, self._reapers = None, {}
        for worker in workers:
            worker.close()
