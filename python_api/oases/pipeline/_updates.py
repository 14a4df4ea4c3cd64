"""A Pipeline's per-segment optimizers and DP syncs, and when each segment's update is applied: before
the segment's next forward, after its DP sync (and a tied copy's) is over; with a loss scaler, one
unscale and one inf/NaN verdict for every pending segment; with max_grad_norm, one clip of every
pending segment by the whole model's gradient norm (see the oases.pipeline.pipeline module doc)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import clip_sharded_, copied_rows, sharded_parameters
from oases.comm.hierarchical import HostGroups
from oases.dp._sharded_optimizer import ShardedOptimizer
from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import SegmentSync
from oases.pipeline.tied import sum_copies
from oases.pipeline.zero_sync import ZeroSegmentSync

if TYPE_CHECKING:
    from oases.pipeline.pipeline import Pipeline

__all__ = [
    "make_optimizers",
    "sync_parameters",
    "make_sync",
    "apply_update",
    "sum_tied",
    "sync_segment",
    "hyper_parameters",
    "clip_gradients",
]


def make_optimizers(
    segment_params: list[list[nn.Parameter]], make: Callable, *, zero: bool, dp_group: dist.ProcessGroup
) -> list[torch.optim.Optimizer]:
    """One optimizer per segment: make(its parameters), or with zero a ShardedOptimizer of this dp rank's rows."""
    if zero:  # ZeRO-1: each segment's optimizer steps this dp rank's rows (oases.dp.ShardedOptimizer)
        return [ShardedOptimizer(params, dp_group, make) for params in segment_params]
    return [make(params) for params in segment_params]  # one per segment


def sync_parameters(segment_params: list[list[nn.Parameter]], tied: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """What each DP sync segment sums: segment k's parameters but a tied copy; the tied copy as segment ns."""
    ids = {id(p) for p in tied}
    sync_params = [[p for p in params if id(p) not in ids] for params in segment_params]
    return sync_params + ([tied] if tied else [])


def make_sync(
    sync_params: list[list[nn.Parameter]],
    dp_group: dist.ProcessGroup,
    scheduler: CommScheduler,
    optimizers: list[torch.optim.Optimizer],
    *,
    zero: bool,
    overlap_ratio: float,
    bucket_numel: int,
    chunk_bytes: int,
    hosts: Optional[HostGroups],
) -> SegmentSync:
    """The per-segment DP sync: with zero a reduce-scatter into the optimizers' rows, all-gathered after
    their steps (ZeroSegmentSync), else a sum of whole gradients (SegmentSync; two-level rings on `hosts`)."""
    if zero:  # reduce-scatter into the optimizers' rows, all-gather after their steps
        return ZeroSegmentSync(
            sync_params,
            dp_group,
            scheduler,
            optimizers,
            overlap_ratio=overlap_ratio,
            bucket_numel=bucket_numel,
            chunk_bytes=chunk_bytes,
        )
    return SegmentSync(
        sync_params,
        dp_group,
        scheduler,
        overlap_ratio=overlap_ratio,
        bucket_numel=bucket_numel,
        chunk_bytes=chunk_bytes,
        hosts=hosts,
    )


def apply_update(pipe: Pipeline, segment: int) -> None:
    """Segment `segment`'s pending optimizer step, before its forward. ZeRO: then segment
    k+1's step, whose all-gather runs under segment k's forwards (oases.pipeline.zero_sync);
    and segment k's all-gather is waited for."""
    if pipe._failed is not None:  # ranks may hold different pending steps: their collectives would not match
        raise RuntimeError(
            "pipeline: an earlier step failed mid-way (see the cause); its pending updates are "
            "not applied; build a new Pipeline"
        ) from pipe._failed
    if segment in pipe._update_pending:
        _step(pipe, segment)
    if pipe.zero:
        if segment + 1 in pipe._update_pending:
            _step(pipe, segment + 1)
        pipe.sync.wait_gather(segment)


def hyper_parameters(optimizer: object) -> list[dict]:
    """Each param group's hyper-parameters (lr, betas, weight_decay, ...: every entry but the
    params), tensors copied (a scheduler fills a tensor lr in place)."""
    return [
        {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return a is b


def _put(group: dict, key: str, value: object) -> None:
    if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
        group[key].copy_(value)  # in place: whoever holds the tensor (a scheduler) sees it
    else:
        group[key] = value


def _swap_in(optimizer: object, then: list[dict]) -> list[dict]:
    """Set the entries that changed since `then` (a scheduler's step in between) back to `then`'s;
    returns their values of now, per group."""
    now: list[dict] = []
    for group, saved in zip(optimizer.param_groups, then):
        changed = {}
        for key, value in saved.items():
            current = group.get(key)
            if not _same(current, value):
                changed[key] = current.detach().clone() if isinstance(current, torch.Tensor) else current
                _put(group, key, value)
        now.append(changed)
    return now


def _swap_back(optimizer: object, then: list[dict], now: list[dict]) -> None:
    """Restore now's values of the swapped entries, but for those the optimizer's step itself wrote
    (per-group state some optimizers keep in param_groups: their value is the step's)."""
    for group, saved, changed in zip(optimizer.param_groups, then, now):
        for key, value in changed.items():
            if _same(group.get(key), saved[key]):
                _put(group, key, value)


def _wait_sync(pipe: Pipeline, segment: int) -> None:
    pipe.sync.wait(segment)
    if segment == pipe._tied_home:
        pipe.sync.wait(pipe.segments)


def _step(pipe: Pipeline, segment: int) -> None:
    """Wait for the segment's DP sync (and a tied copy's), step, clear its grads (ZeRO: start
    the all-gather of its parameters). With a loss scaler or max_grad_norm, the first pending
    step of a train step waits for every pending segment's sync, then unscales them all (one
    verdict for all of them over the scaler's group) and clips them all (one norm of the whole
    model's gradient); each segment then steps or skips by the verdict, and the scale is
    updated after the last."""
    scaler = pipe.loss_scaler
    if (scaler is not None or pipe.max_grad_norm is not None) and not pipe._prepared:
        pending = sorted(pipe._update_pending)
        for k in pending:
            _wait_sync(pipe, k)
        if scaler is not None:
            scaler.unscale_together_([pipe.optimizers[k] for k in pending])
        if pipe.max_grad_norm is not None:
            pipe.grad_norm = clip_gradients(pipe, pipe.max_grad_norm)
        pipe._prepared = True
    _wait_sync(pipe, segment)
    optimizer = pipe.optimizers[segment]
    then = pipe._update_hyper.pop(segment, None)
    now = _swap_in(optimizer, then) if then is not None else []  # the hyper-parameters of the step it belongs to
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
    if then is not None:
        _swap_back(optimizer, then, now)  # a scheduler's values for the next step, kept
    optimizer.zero_grad(set_to_none=True)
    pipe._update_pending.discard(segment)
    if not pipe._update_pending:
        if scaler is not None:
            scaler.update()
        pipe._prepared = False
    if pipe.zero:
        pipe.sync.gather(segment)


def _gradients(optimizer: torch.optim.Optimizer) -> list[tuple[nn.Parameter, Optional[torch.Tensor], int]]:
    """(model parameter, the gradient the optimizer steps, its first row of the parameter) for each
    parameter: ZeRO, this dp rank's master rows; else the parameter's own .grad."""
    if isinstance(optimizer, ShardedOptimizer):
        return [(p, optimizer.slots[id(p)].master.grad, optimizer.slots[id(p)].start) for p in optimizer.params]
    return [(p, p.grad, 0) for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def clip_gradients(pipe: Pipeline, max_norm: float) -> torch.Tensor:
    """Scale every gradient the stage's optimizers step by min(1, max_norm / (total + 1e-6)), total
    the 2-norm of the whole model's gradient (torch.nn.utils.clip_grad_norm_ on the single-process
    model); returns total (fp32, the same on every rank). Call it after every segment's DP sync.

    ::

        oases._sharding.clip_sharded_ of the gradients the optimizers step (ZeRO: this dp rank's
        master rows), TP shards summed over their group, across dp (ZeRO's rows) and pp (stages);
        a tied embedding / head copy counted on the first stage only (scaled on both)
    """
    sharded, copied = sharded_parameters(pipe.model), copied_rows(pipe.model)
    other_copy = {id(p) for p in pipe._tied} if pipe.layout.stage != 0 else set()  # the first stage counts it
    held = [(p, g, row) for optimizer in pipe.optimizers for p, g, row in _gradients(optimizer)]
    counted = [(g, sharded.get(id(p)), copied.get(id(p), ()), row) for p, g, row in held if id(p) not in other_copy]
    tied = [g for p, g, _ in held if id(p) in other_copy and g is not None]
    across = ([pipe.dp_group] if pipe.zero and pipe.dp > 1 else []) + ([pipe.pp_group] if pipe.pp > 1 else [])
    return clip_sharded_(counted, max_norm, 2.0, pipe.comm.device, across=across, also=tied)


def sum_tied(pipe: Pipeline) -> None:
    """End of a step, on a copy of a tied embedding / head (first and last stage): add the
    other copy's gradient (a collective with that stage), then start the weight's DP sync."""
    if pipe._tied and pipe._tied_group is not None:
        sum_copies(pipe._tied, pipe._tied_group)
        pipe.sync.launch(pipe.segments)


def sync_segment(pipe: Pipeline, segment: int) -> None:
    """Pipeline.sync_segment: sum segment `segment`'s gradients over dp now, blocking (a tied
    copy's summed with the other copy's first); RuntimeError with zero=True or while the last
    train_step's own sync of the segment is pending."""
    if pipe.zero:
        raise RuntimeError(
            "sync_segment: with zero=True gradients are reduce-scattered into each dp rank's "
            "optimizer rows (train_step does it); there is no in-place sum"
        )
    if segment in pipe._update_pending:
        raise RuntimeError(
            f"sync_segment({segment}): the last train_step already syncs this segment's "
            "gradients; call state_dict() or close() to finish it first"
        )
    pipe.sync.launch(segment)
    pipe.sync.wait(segment)
    if segment == pipe._tied_home:
        sum_tied(pipe)
        pipe.sync.wait(pipe.segments)
