"""ZeRO-1 inside the pipeline's per-segment DP sync (`Pipeline(..., zero=True)`).

    sync = ZeroSegmentSync(segment_params, dp_group, scheduler, rows, overlap_ratio=r, bucket_numel=n,
                           chunk_bytes=c)     # rows: each segment's oases.dp.ShardedOptimizer
    sync.launch(k) / launch_deferred() / wait(k)   # as SegmentSync, but each bucket's gradients are
                                                   # reduce-scattered by rows into the masters' .grad
    rows[k].step()                                 # the caller: segment k's optimizer, this rank's rows
    sync.gather(k)                                 # segment k's parameters all-gathered on the DP thread
    sync.wait_gather(k)                            # ... and written (before segment k's next forward)

A gradient bucket (parameters p_1..p_m; `rows` the ShardedOptimizer holding them), on the DP thread:

    blocks = rows.pack_grads(bucket, grads), m presence flags after each block  # [dp, S]: block j = rows_j
    own    = reduce_scatter(blocks)                                              # [S]: this rank's, summed
    master.grad = own's rows of p_i (None where no dp rank had a gradient)       # a plain sum: the loss
                                                                                 # is already / N (the
                                                                                 # global target count)
and once the caller stepped segment k, per bucket of its parameters (one dtype each):

    p = rows.unpack_rows(all_gather(rows.pack_rows(bucket)))                     # every rank's rows

Both rings are the scheduler's, cut into pieces of at most `chunk_bytes` and gated per piece like
SegmentSync's all-reduces: PP transfers preempt them. The pipeline steps segment k+1 and starts its
gather when segment k's forwards begin, so that the gather runs under them (oases.pipeline._updates.Updates.apply):

    aiao, ns = 2 (stage 0), the step after   time ->
    compute : | wait RS⁰ step⁰ | wait RS¹ step¹ | wait AG⁰ | F⁰ (all i) ........ | wait AG¹ | F¹ ...
    DP      : (RS⁰, RS¹ launched by the last step) | AG⁰ ... | AG¹ (under F⁰) ... |

With dp = 1 nothing moves: the masters' gradients are the parameters' (16-bit masters copied back
after the step). The main thread never touches a bucket's parameters or masters between a launch or
gather and its wait (the segment's backward is over; its forward comes after wait_gather).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.dp.zero import ShardedOptimizer
from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import SegmentSync, buckets_of, chunks_for

__all__ = ["ZeroSegmentSync"]


class ZeroSegmentSync(SegmentSync):
    """SegmentSync whose buckets are reduce-scattered into `rows`' masters, with the parameters'
    all-gather after each segment's step (see the module doc). `segment_params` may list a
    parameter of segment k's optimizer under another sync index (oases.pipeline.tied's copies)."""

    def __init__(
        self,
        segment_params: list[list[nn.Parameter]],
        group: dist.ProcessGroup,
        scheduler: CommScheduler,
        rows: list[ShardedOptimizer],
        *,
        overlap_ratio: float,
        bucket_numel: int,
        chunk_bytes: int,
    ) -> None:
        super().__init__(
            segment_params,
            group,
            scheduler,
            overlap_ratio=overlap_ratio,
            bucket_numel=bucket_numel,
            chunk_bytes=chunk_bytes,
        )
        self.rows = rows
        self._owner = {id(p): r for r in rows for p in r.params}
        self.gather_buckets = [  # per segment: its parameters in buckets of one dtype
            [
                b
                for dtype in dict.fromkeys(p.dtype for p in r.params)
                for b in buckets_of([p for p in r.params if p.dtype == dtype], bucket_numel)
            ]
            for r in rows
        ]
        self._gathers: dict[int, list[Future]] = {}  # segment -> its all-gathers in flight

    def launch(self, segment: int) -> None:
        """As SegmentSync.launch; with dp = 1 the masters take the gradients at once."""
        if self.dp > 1:
            super().launch(segment)
            return
        for bucket in self.buckets[segment]:
            self._sync_bucket(bucket)

    def _sync_bucket(self, bucket: list[nn.Parameter]) -> list[torch.Tensor]:
        """On the DP thread: the masters' gradients = this rank's rows of the sum over dp (module doc)."""
        made = []
        for rows in dict.fromkeys(self._owner[id(p)] for p in bucket):  # one ShardedOptimizer in practice
            params = [p for p in bucket if self._owner[id(p)] is rows]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            dtype = grads[0].dtype
            for g in grads[1:]:
                dtype = torch.promote_types(dtype, g.dtype)
            used = rows.columns(params, extra=len(params))
            chunks = chunks_for(self.dp * used, torch.empty((), dtype=dtype).element_size(), self.dp, self.chunk_bytes)
            blocks = rows.pack_grads(params, grads, align=chunks, dtype=dtype)  # [dp, S], presence flags included
            own = (
                blocks[0]
                if self.dp == 1
                else self.scheduler.reduce_scatter(blocks.reshape(-1), self.group, chunks=chunks)
            )  # [S]
            rows.unpack_grads(params, own)
            made += [rows.master_of(p)[0].grad for p in params if rows.master_of(p)[0].grad is not None]
        return made

    def gather(self, segment: int) -> None:
        """Start the all-gather of segment `segment`'s parameters (after its optimizer stepped)."""
        if self.dp == 1:
            for bucket in self.gather_buckets[segment]:
                self._gather_bucket(self.rows[segment], bucket)
            return
        self._gathers[segment] = [
            self._submit(b, lambda b=b: self._gather_bucket(self.rows[segment], b))
            for b in self.gather_buckets[segment]
        ]

    def wait_gather(self, segment: int) -> None:
        """Block until segment `segment`'s parameters hold every rank's stepped rows."""
        futures = self._gathers.pop(segment, [])
        if futures:
            with torch.profiler.record_function("oases::pipeline::zero_gather_wait"), self.scheduler.urgent():
                for future in futures:
                    done = future.result()  # CUDA: the event after the parameters were written
                    if done is not None:
                        torch.cuda.current_stream(done.device).wait_event(done)

    def _gather_bucket(self, rows: ShardedOptimizer, bucket: list[nn.Parameter]) -> list[torch.Tensor]:
        """On the DP thread: every parameter of `bucket` = every rank's rows of it."""
        if self.dp == 1 and not any(rows.slots[id(p)].owns_storage() for p in bucket):
            return []  # the masters are the parameters
        used = rows.columns(bucket)
        chunks = chunks_for(self.dp * used, bucket[0].element_size(), self.dp, self.chunk_bytes)
        own = rows.pack_rows(bucket, align=chunks)  # [S]
        full = own if self.dp == 1 else self.scheduler.all_gather(own, self.group, chunks=chunks)  # [dp * S]
        rows.unpack_rows(bucket, full.view(self.dp, -1))
        return []
