"""The runtime under every schedule: sub-batch programs interleaved at their communication points.

A *program* is a generator that runs one sub-batch's work. Right after starting an asynchronous
communication it yields; when resumed it waits for that communication and goes on. `interleave`
runs programs round-robin, so while one program's communication is in flight the next program
computes:

    interleave([A, B]):
      compute: | A: sublayer 1 | B: sublayer 1 | A: sublayer 2 | B: sublayer 2 | ...
      comm   :                 | A: all-reduce | B: all-reduce | A: all-reduce | ...

A program that yields `BARRIER` is held until every unfinished program has yielded `BARRIER`: a
pass boundary (the "merak" schedule keeps them; "cross_pass" and "oases" do not). A single program
is resumed at once: its communication is blocking ("megatron").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generator, Iterator, Optional

import torch
import torch.distributed as dist

from oases._checks import process_group
from oases._ranges import hot_range
from oases.comm import all_gather_steps, reduce_scatter_steps, ring_all_gather, ring_reduce_scatter
from oases.schedule.exposure import CollectiveRecord, ExposureLog

__all__ = ["BARRIER", "Communicator", "interleave"]

_THREAD_TAG = 2  # rings run on the communicator's thread use message tags 2 and 3; the caller's 0 and 1

BARRIER = object()
Program = Generator[Any, None, Any]


class Communicator:
    """Issues a schedule's communication on one group; counts it and the time waited for it.

    ::

        work = comm.all_reduce(t, "forward")                 # t summed in place once work.wait()
        out = yield from comm.all_gather(t, dim, "forward")  # ring steps; yields between them
        out = yield from comm.reduce_scatter(t, dim, "backward")
        task = comm.submit(fn); ...; result = task.wait()   # fn runs on the communicator's thread

    `calls[pass]` counts the calls and `bytes[pass]` the bytes this rank sends (pass: "forward",
    "recompute", "backward"): an all-reduce of n bytes sends 2 (p-1)/p n, an all-gather into n
    bytes or a reduce-scatter of n bytes (p-1)/p n. `waited` is the host's seconds blocked in
    communication, the exposed communication on the CPU (on CUDA, `wait()` orders streams
    without blocking the host: time with CUDA events). With no process group (world size 1)
    nothing is sent, counted or waited for. Inside `with comm.dry_run():` it counts but sends
    nothing (results are then wrong): benchmarks time compute alone with it. Inside
    `with comm.recording() as log:` each asynchronous all-reduce is logged (issued, completed,
    each wait on it) for oases.schedule.exposure's breakdown of the waits by cause.

    `submit` runs a function on the communicator's own thread (started on first use, ended by
    `close()`), in submission order: the CPU's counterpart of a communication stream. There,
    `all_gather_sync` / `reduce_scatter_sync` run whole rings (blocking that thread only) with their own message tags,
    so they never match a ring of the caller's thread; small computations chained between them
    (a bias, a norm) run there too, while the caller's thread computes. `waited` then counts
    the caller's time blocked in `task.wait()`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int) -> None:
        group = process_group(group)  # a 1-D DeviceMesh: its group
        if world_size > 1 and dist.get_world_size(group) != world_size:
            raise ValueError(f"world_size: {world_size}, but the group has {dist.get_world_size(group)} ranks")
        self.group = group
        self.world_size = world_size
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.waited = 0.0
        self._dry_run = False  # see dry_run()
        self._log: Optional[ExposureLog] = None  # see recording()
        self._others = 0  # resumptions of a program after another one ran (interleave's on_resume)
        self._lock = threading.Lock()  # counters are updated from both threads
        self._thread: Optional[ThreadPoolExecutor] = None

    def _count(self, phase: str, nbytes: int, share: float) -> None:
        with self._lock:
            self.calls[phase] += 1
            self.bytes[phase] += round(share * (self.world_size - 1) / self.world_size * nbytes)

    @contextlib.contextmanager
    def dry_run(self) -> Iterator[None]:
        """Inside: count every call as usual but send nothing (results wrong: for timing compute)."""
        previous, self._dry_run = self._dry_run, True
        try:
            yield
        finally:
            self._dry_run = previous

    @contextlib.contextmanager
    def recording(self) -> Iterator[ExposureLog]:
        """Inside: log every asynchronous all-reduce and the waits on it (oases.schedule.exposure)."""
        previous, self._log = self._log, ExposureLog()
        try:
            yield self._log
        finally:
            self._log = previous

    def resumed(self, alone: bool) -> None:
        """`interleave` says whether a program it resumes is the only one that ran since it yielded;
        a wait is "alone" (exposure's dependency) when no resumption after another program came
        between its collective's issue and the wait."""
        if not alone:
            self._others += 1

    @property
    def has_thread(self) -> bool:
        """Whether `submit` may run rings on a thread of its own beside the caller's: on gloo,
        whose point-to-point messages are matched by tag. NCCL matches them by order on one
        communicator, so two threads must not interleave rings there (schedules then step the
        rings from the caller's thread)."""
        return self.world_size == 1 or dist.get_backend(self.group) == "gloo"

    def submit(self, fn: Callable[[], Any]) -> "_Task":
        """Run `fn()` on the communicator's thread after every task submitted before it."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oases-comm")
        return _Task(self._thread.submit(fn), self)

    def all_gather_sync(self, t: torch.Tensor, dim: int, phase: str) -> torch.Tensor:
        """cat(t from every rank, dim), blocking; for tasks on the communicator's thread."""
        if self.world_size == 1:
            return t
        self._count(phase, t.numel() * t.element_size() * self.world_size, 1)
        if self._dry_run:
            return torch.cat([t] * self.world_size, dim)
        return ring_all_gather(t, self.group, dim=dim, tag=_THREAD_TAG)

    def reduce_scatter_sync(self, t: torch.Tensor, dim: int, phase: str) -> torch.Tensor:
        """sum(t from every rank) narrowed to this rank's block of `dim`, blocking; for tasks."""
        if self.world_size == 1:
            return t
        self._count(phase, t.numel() * t.element_size(), 1)
        if self._dry_run:
            return t.chunk(self.world_size, dim)[dist.get_rank(self.group)].contiguous()
        return ring_reduce_scatter(t, self.group, dim=dim, tag=_THREAD_TAG)

    def close(self) -> None:
        """End the communicator's thread (after its pending tasks); submit starts a new one."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def all_reduce(self, t: torch.Tensor, phase: str) -> "_Work":
        """Start summing `t` over the group in place (the backend's asynchronous all-reduce)."""
        if self.world_size == 1:
            return _Work(None, self)
        self._count(phase, t.numel() * t.element_size(), 2)
        if self._dry_run:
            return _Work(None, self)
        record = None if self._log is None else self._log.issue(phase, t.numel() * t.element_size(), self._others)
        work = dist.all_reduce(t, group=self.group, async_op=True)
        if record is not None:
            work.get_future().add_done_callback(lambda _: ExposureLog.ended(record))
        return _Work(work, self, record)

    def all_gather(self, t: torch.Tensor, dim: int, phase: str) -> Generator[None, None, torch.Tensor]:
        """cat(t from every rank, dim), by ring; a generator (see the class docstring)."""
        if self.world_size == 1:
            return t
        self._count(phase, t.numel() * t.element_size() * self.world_size, 1)
        if self._dry_run:
            return torch.cat([t] * self.world_size, dim)
        return (yield from self._timed(all_gather_steps(t, self.group, dim=dim)))

    def reduce_scatter(self, t: torch.Tensor, dim: int, phase: str) -> Generator[None, None, torch.Tensor]:
        """sum(t from every rank) narrowed to this rank's block of `dim`, by ring; a generator."""
        if self.world_size == 1:
            return t
        self._count(phase, t.numel() * t.element_size(), 1)
        if self._dry_run:
            return t.chunk(self.world_size, dim)[dist.get_rank(self.group)].contiguous()
        return (yield from self._timed(reduce_scatter_steps(t, self.group, dim=dim)))

    def _timed(self, steps: Generator[None, None, torch.Tensor]) -> Generator[None, None, torch.Tensor]:
        """Drive a ring's steps, booking the time inside them (waits; small adds) as waited."""
        while True:
            start = time.perf_counter()
            try:
                next(steps)
            except StopIteration as done:
                self.waited += time.perf_counter() - start
                return done.value
            self.waited += time.perf_counter() - start
            yield

    def reset(self) -> None:
        """Zero the counters and the time waited."""
        with self._lock:
            self.calls.clear()
            self.bytes.clear()
            self.waited = 0.0


class _Task:
    """A function running on a Communicator's thread; `wait()` returns its result (or raises its
    exception) and books the time blocked."""

    def __init__(self, future: Future, owner: Communicator) -> None:
        self._future, self._owner = future, owner

    def wait(self) -> Any:
        start = time.perf_counter()
        try:
            with hot_range("oases::schedule::wait"):
                return self._future.result()
        finally:
            self._owner.waited += time.perf_counter() - start


class _Work:
    """A communication's handle; `wait()` blocks until it is done and books the time blocked."""

    def __init__(
        self, work: Optional[dist.Work], owner: Communicator, record: Optional[CollectiveRecord] = None
    ) -> None:
        self._work, self._owner, self._record = work, owner, record

    def wait(self) -> None:
        if self._work is not None:
            start = time.perf_counter()
            with hot_range("oases::schedule::wait"):
                self._work.wait()
            end = time.perf_counter()
            self._owner.waited += end - start
            if self._record is not None:
                alone = self._owner._others == self._record.others_at_issue
                self._record.waits.append((start, end, alone))


def interleave(programs: list[Program], on_resume: Optional[Callable[[bool], None]] = None) -> list[Any]:
    """Run `programs` round-robin, switching at each yield; return their return values in order.
    `on_resume(alone)` is called before each resumption: alone = no other program ran since this
    one last yielded (Communicator.resumed: the exposure breakdown's "dependency")."""
    results: list[Any] = [None] * len(programs)
    running = dict(enumerate(programs))
    held: set[int] = set()
    last = None  # the program resumed last
    while running:
        for i in list(running):
            if i in held:
                continue
            if on_resume is not None:
                on_resume(last in (None, i))
            last = i
            try:
                if next(running[i]) is BARRIER:
                    held.add(i)
            except StopIteration as stop:
                results[i] = stop.value
                del running[i]
        if held and held >= running.keys():
            held.clear()
    return results
