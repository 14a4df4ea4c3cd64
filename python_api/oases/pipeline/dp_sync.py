"""Per-segment asynchronous data-parallel gradient sync (FOLD3D Algorithm 2, DPComm).

    sync = SegmentSync(segment_params, dp_group, scheduler, overlap_ratio=r, bucket_numel=n, chunk_bytes=c)
    sync.launch(k)          # segment k's backward is done for every micro-batch: ceil(r * b_k) of
                            # its b_k buckets start reducing on the DP thread now
    sync.launch_deferred()  # next train_step's start: the other buckets of every segment start
    sync.wait(k)            # before segment k's next forward: its gradients are summed over dp

Each segment's gradients are cut into flat buckets of at most `bucket_numel` elements (parameters
in order, a parameter never split); a bucket is summed over `dp` by the scheduler's chunked ring
reduce-scatter + all-gather on its DP thread and copied back into each `p.grad`. Buckets run in
submission order on one thread, so every DP rank runs the same rings in the same order.

`overlap_ratio` r in [0, 1]: the fraction of each segment's buckets launched as soon as its
backward ends (they overlap the backward of the segments below it, and the end of the step);
the other buckets wait for the next train_step and overlap its forward up to that segment (the
forwards of the segments before it). r = 1: everything at once; r = 0: everything deferred.

    aiao, ns = 2, r = 0.5 (stage 0)   time ->
    compute : | F⁰ F¹ | B¹ ........ | B⁰ ........ |(next step) step⁰ F⁰ | step¹ F¹ | ...
    DP      :         |             | seg 1 now   | seg 0 now ...| seg 0, 1 deferred ...
                                                                ^ wait(0)  ^ wait(1)

`hosts` (an oases.comm.hierarchical.HostGroups of the dp group's ranks): every bucket is summed
by the two-level rings (intra-host reduce-scatter, inter-host reduce-scatter, then the gathers
back; CommScheduler.all_reduce(..., hosts=hosts)), gated per ring step like the flat ones.

The main thread never touches a segment's gradients between launch(k) and wait(k): the segment's
backward is over, and its optimizer step comes after wait(k). With dp = 1 there is nothing to
sum and every call is a no-op.

On CUDA the DP thread works on a stream of its own at default (low) priority, below the
pipeline's high-priority links: a bucket's ring starts after an event recorded on the launching
thread's stream (its gradients are computed), and `wait(k)` makes the caller's stream wait for
the event recorded after the bucket's gradients were written back. Written to that contract,
not run here (no GPU).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.comm.hierarchical import HostGroups
from oases.pipeline.comm_scheduler import CommScheduler

__all__ = ["SegmentSync", "buckets_of", "chunks_for", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 18  # default bytes per ring piece: the DP sync's preemption granularity


def chunks_for(numel: int, element_size: int, dp: int, chunk_bytes: int) -> int:
    """Pieces per rank's block so that a ring piece moves at most `chunk_bytes` (at least 1).

        block = ceil(numel / dp) elements;  chunks = ceil(block * element_size / chunk_bytes)
    A PP transfer posted while the DP sync runs waits at most for the piece in flight."""
    block = max(1, -(-numel // dp))
    return max(1, min(block, -(-block * element_size // chunk_bytes)))  # never more pieces than elements


def buckets_of(params: list[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` of at most `bucket_numel` elements (at least one parameter each)."""
    buckets: list[list[nn.Parameter]] = []
    numel = 0
    for p in params:
        if buckets and numel + p.numel() <= bucket_numel:
            buckets[-1].append(p)
            numel += p.numel()
        else:
            buckets.append([p])
            numel = p.numel()
    return buckets


class SegmentSync:
    """The DP sync of one stage's segments: buckets, what is launched, what is pending."""

    def __init__(
        self,
        segment_params: list[list[nn.Parameter]],
        group: dist.ProcessGroup,
        scheduler: CommScheduler,
        *,
        overlap_ratio: float,
        bucket_numel: int,
        chunk_bytes: int = CHUNK_BYTES,
        hosts: Optional[HostGroups] = None,
    ) -> None:
        self.group, self.scheduler, self.hosts = group, scheduler, hosts  # hosts: two-level rings
        self.dp, self.bucket_numel, self.chunk_bytes = dist.get_world_size(group), bucket_numel, chunk_bytes
        self.buckets = [buckets_of(params, bucket_numel) for params in segment_params]
        self.now = [min(len(b), math.ceil(overlap_ratio * len(b) - 1e-9)) for b in self.buckets]  # at once
        self._pending: dict[int, list[Future]] = {}  # segment -> its launched buckets' futures
        self._deferred: dict[int, list[list[nn.Parameter]]] = {}  # segment -> buckets not launched yet
        device = next((b[0].device for buckets in self.buckets for b in buckets), torch.device("cpu"))
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # the DP thread's

    def launch(self, segment: int) -> None:
        """Segment `segment`'s backward is over: start its first ceil(r * b) buckets, defer the rest."""
        if self.dp == 1:
            return
        buckets = self.buckets[segment]
        self._pending[segment] = [self._submit(b) for b in buckets[: self.now[segment]]]
        self._deferred[segment] = buckets[self.now[segment] :]

    def launch_deferred(self) -> None:
        """Start every deferred bucket, lowest segment first (the order their forwards need them)."""
        for segment in sorted(self._deferred):
            self._pending[segment] += [self._submit(b) for b in self._deferred.pop(segment)]

    def pending(self, segment: int) -> bool:
        """Whether segment `segment`'s sync was launched and not yet waited for."""
        return segment in self._pending

    def wait(self, segment: int) -> None:
        """Block until segment `segment`'s gradients are summed over dp (launching what was deferred)."""
        if segment in self._deferred:
            self.launch_deferred()  # keeps every rank's submission order: lowest segment first
        futures = self._pending.pop(segment, [])
        if futures:
            with torch.profiler.record_function("oases::pipeline::dp_wait"), self.scheduler.urgent():
                for future in futures:
                    done = future.result()  # CUDA: the event after the bucket's write-back
                    if done is not None:
                        torch.cuda.current_stream(done.device).wait_event(done)

    def time_sync(self, numel: int) -> float:
        """Seconds to sum `numel` gradient elements over dp as train_step does (0 with dp = 1): the
        ring of one bucket (at most bucket_numel elements) timed on the DP thread after a warm-up
        run, scaled to `numel`. A collective over dp: every DP rank calls it."""
        if self.dp == 1 or numel == 0:
            return 0.0
        device = next(b[0].device for buckets in self.buckets for b in buckets)
        flat = torch.zeros(min(numel, self.bucket_numel), device=device)
        chunks = chunks_for(flat.numel(), flat.element_size(), self.dp, self.chunk_bytes)

        def ring() -> None:
            self.scheduler.all_reduce(flat, self.group, chunks=chunks, hosts=self.hosts)
            if flat.is_cuda:  # the ring's work is only enqueued
                torch.cuda.synchronize(flat.device)

        self.scheduler.submit(ring).result()
        start = time.perf_counter()
        self.scheduler.submit(ring).result()
        return (time.perf_counter() - start) * numel / flat.numel()

    def _submit(self, bucket: list[nn.Parameter], run: Optional[Callable[[], list[torch.Tensor]]] = None) -> Future:
        """Run `run()` (default: the bucket's sync) on the DP thread; it returns the tensors it made
        that the compute stream uses (CUDA: recorded on that stream)."""
        run = run or (lambda: self._sync_bucket(bucket))
        if self._stream is None:

            def on_cpu() -> None:
                run()

            return self.scheduler.submit(on_cpu)  # its result: None (CUDA: the event to wait for)
        compute = torch.cuda.current_stream(self._stream.device)
        ready = torch.cuda.Event()
        ready.record(compute)  # the gradients are computed (ZeRO's gather: the masters stepped)

        def on_stream() -> torch.cuda.Event:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for t in run():  # a tensor made on this stream is used (and freed) on the compute stream
                    t.record_stream(compute)
                done = torch.cuda.Event()
                done.record()
                return done

        return self.scheduler.submit(on_stream)

    def _sync_bucket(self, bucket: list[nn.Parameter]) -> list[torch.Tensor]:
        """On the DP thread: p.grad = sum over dp of p.grad, for p in the bucket, as one flat ring.
        Returns the gradients written."""
        # One flag per parameter rides along: a parameter no DP rank has a gradient for keeps
        # grad None (as in single-process training, where optimizers then skip it).
        parts = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in bucket
        ]
        flags = torch.tensor([float(p.grad is not None) for p in bucket], dtype=parts[0].dtype, device=parts[0].device)
        flat = torch.cat([*parts, flags])  # [numel + len(bucket)]
        self.scheduler.all_reduce(
            flat,
            self.group,
            hosts=self.hosts,
            chunks=chunks_for(flat.numel(), flat.element_size(), self.dp, self.chunk_bytes),
        )
        offset = 0
        for p, has in zip(bucket, flat[-len(bucket) :].tolist()):
            if has == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype, copy=True)
            else:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        return [p.grad for p in bucket if p.grad is not None]
