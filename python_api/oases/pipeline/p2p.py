"""Point-to-point transfers between pipeline stages (FOLD3D Algorithm 2, PPComm).

    comm = StageComm(pp_group, stages, micro_batches, scheduler)
    comm.post_recv(key, shape)        # irecv posted early (before the computation before its use)
    x = comm.recv(key, shape)         # waits for it (posts it first if it was not posted)
    comm.send(key, tensor)            # isend; never waited before wait_sends()
    comm.post_lazy(keys, shapes)      # receives needed only later: into host memory, not tracked
    comm.wait_sends()                 # end of the step: every send delivered

A key is (kind, edge, micro_batch): over edge e, "act" travels from virtual stage e to e+1 and
"grad" from e+1 to e, where (segment k, stage s) is virtual stage k*p + s (oases.pipeline.stages).
Each key is its own message tag, so messages match by key whatever order the two ends post
them in. With one stage (p = 1) the peer is this rank: the tensor is handed over in memory.
Every transfer is tracked by the rank's CommScheduler (oases.pipeline.comm_scheduler): while one
is in flight, the data-parallel sync holds back its next chunk, and its latency is recorded.

Inter-segment lazy communication (FOLD3D §3.2): the activations that cross from segment k to
segment k+1 (stage p-1 to stage 0) are produced long before stage 0 needs them under aiao (it
first runs segment k for every micro-batch). `post_lazy` posts their receives at once into host
memory (pinned on CUDA), so they travel as soon as they are sent and hold no device memory;
`recv` loads one to the device when it is used. They are not tracked by the scheduler: nothing
waits on them meanwhile, so they do not hold back the DP sync.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from oases.pipeline.comm_scheduler import CommScheduler, Transfer

__all__ = ["StageComm"]

Key = tuple[str, int, int]  # (kind "act" | "grad", edge, micro_batch)
_TAG_BASE = 16  # above the tags rings use (0-5: oases.comm, the Communicator, the DP thread)
_TIMING_TAG = _TAG_BASE - 1  # time_transfer's messages


class StageComm:
    """Async sends and receives of one rank's pipeline stage over the `pp` group; owns its handles."""

    def __init__(self, group: dist.ProcessGroup, stages: int, micro_batches: int,
                 scheduler: CommScheduler, device: torch.device = torch.device("cpu")) -> None:
        self.group, self.stages, self.micro_batches, self.scheduler = group, stages, micro_batches, scheduler
        self.device = torch.device(device)
        self.lazy_receives = 0  # receives posted by post_lazy (a counter over the comm's life)
        self._lazy: dict[Key, tuple[dist.Work, torch.Tensor]] = {}
        self.stage = dist.get_rank(group)
        self._ranks = dist.get_process_group_ranks(group)
        self._pending: dict[Key, tuple[Transfer, torch.Tensor]] = {}
        self._sends: list[tuple[Transfer, torch.Tensor]] = []
        self._local: dict[Key, torch.Tensor] = {}  # p = 1: messages to this rank itself

    def _tag(self, key: Key) -> int:
        kind, edge, micro_batch = key
        return _TAG_BASE + 2 * (edge * self.micro_batches + micro_batch) + (kind == "grad")

    def _peer(self, key: Key, *, sending: bool) -> int:
        """Global rank of the other end: activations go to stage s+1, gradients to s-1 (mod p)."""
        ahead = (key[0] == "act") == sending
        return self._ranks[(self.stage + (1 if ahead else -1)) % self.stages]

    def post_recv(self, key: Key, shape: torch.Size, dtype: torch.dtype = torch.float32) -> None:
        """Post the receive of `key` into a new buffer (no-op if already posted). Receives must be
        posted in the order they are waited for (their scheduler lane is waited in that order)."""
        if key in self._pending or key in self._lazy or self.stages == 1:
            return
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        peer = self._peer(key, sending=False)
        work = dist.irecv(buf, peer, group=self.group, tag=self._tag(key))
        self._pending[key] = (self.scheduler.track(work, "recv", peer), buf)

    def recv(self, key: Key, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor of `key` ([shape]), once it has arrived."""
        if self.stages == 1:
            return self._local.pop(key)
        if key in self._lazy:
            work, host = self._lazy.pop(key)
            work.wait()
            return host.to(self.device, non_blocking=True)
        self.post_recv(key, shape, dtype)
        work, buf = self._pending.pop(key)
        work.wait()
        return buf

    def post_lazy(self, keys: list[Key], shapes: list[torch.Size], dtype: torch.dtype = torch.float32) -> None:
        """Post the receives of `keys` now, into host memory, untracked by the scheduler; `recv` of
        one of them waits for it and moves it to the device. Keys already posted are skipped."""
        if self.stages == 1:
            return
        for key, shape in zip(keys, shapes):
            if key in self._pending or key in self._lazy:
                continue
            host = torch.empty(shape, dtype=dtype, device="cpu")
            self._lazy[key] = (dist.irecv(host, self._peer(key, sending=False), group=self.group,
                                          tag=self._tag(key)), host)
            self.lazy_receives += 1

    def send(self, key: Key, tensor: torch.Tensor) -> None:
        """Start sending `tensor` as `key`; it is kept alive until wait_sends()."""
        tensor = tensor.detach().contiguous()
        if self.stages == 1:
            self._local[key] = tensor
            return
        peer = self._peer(key, sending=True)
        work = dist.isend(tensor, peer, group=self.group, tag=self._tag(key))
        self._sends.append((self.scheduler.track(work, "send", peer), tensor))

    def time_transfer(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> float:
        """Seconds for one [shape] tensor to reach the next stage while the previous stage's reaches
        this one (a ring exchange over pp, timed after a warm-up; 0 with p = 1). Every stage calls it."""
        if self.stages == 1:
            return 0.0
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        into = torch.empty(shape, dtype=dtype, device=self.device)
        ahead, behind = (self._ranks[(self.stage + d) % self.stages] for d in (1, -1))
        for _ in range(2):
            start = time.perf_counter()
            works = [dist.isend(out, ahead, group=self.group, tag=_TIMING_TAG),
                     dist.irecv(into, behind, group=self.group, tag=_TIMING_TAG)]
            for work in works:
                work.wait()
        return time.perf_counter() - start

    def wait_sends(self) -> None:
        """Wait for every send; after it, nothing of this step is in flight (checked)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._pending or self._local or self._lazy:
            raise RuntimeError("pipeline step ended with unreceived messages: "
                               f"{sorted(self._pending or self._local or self._lazy)}")
