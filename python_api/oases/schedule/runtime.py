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

import time
from collections import Counter
from typing import Any, Generator, Optional

import torch
import torch.distributed as dist

__all__ = ["BARRIER", "Communicator", "interleave"]

BARRIER = object()
Program = Generator[Any, None, Any]


class Communicator:
    """Issues a schedule's asynchronous all-reduces on one group; counts them and the waiting.

        work = comm.all_reduce(t, "forward")   # t summed over the group in place once work.wait()
    `calls[pass]` and `bytes[pass]` count what was issued (pass: "forward", "recompute",
    "backward"); `waited` is the host's seconds blocked in `wait()`, the exposed communication on
    the CPU (on CUDA, `wait()` orders streams without blocking the host: time with CUDA events).
    With no process group (world size 1) nothing is sent, counted or waited for. `dry_run = True`
    counts but sends nothing (the results are then wrong): benchmarks time compute alone with it.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.waited = 0.0
        self.dry_run = False

    def all_reduce(self, t: torch.Tensor, phase: str) -> "_Work":
        if self.world_size == 1:
            return _Work(None, self)
        self.calls[phase] += 1
        self.bytes[phase] += t.numel() * t.element_size()
        if self.dry_run:
            return _Work(None, self)
        return _Work(dist.all_reduce(t, group=self.group, async_op=True), self)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.waited = 0.0


class _Work:
    """A communication's handle; `wait()` blocks until it is done and books the time blocked."""

    def __init__(self, work: Optional[dist.Work], owner: Communicator) -> None:
        self._work, self._owner = work, owner

    def wait(self) -> None:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            self._owner.waited += time.perf_counter() - start


def interleave(programs: list[Program]) -> list[Any]:
    """Run `programs` round-robin, switching at each yield; return their return values in order."""
    results: list[Any] = [None] * len(programs)
    running = dict(enumerate(programs))
    held: set[int] = set()
    while running:
        for i in list(running):
            if i in held:
                continue
            try:
                if next(running[i]) is BARRIER:
                    held.add(i)
            except StopIteration as stop:
                results[i] = stop.value
                del running[i]
        if held and held >= running.keys():
            held.clear()
    return results
