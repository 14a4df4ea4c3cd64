"""A Pipeline's per-segment optimizers and DP syncs, and when each segment's update is applied: the
`Updates` of one stage's layout (rebuilt when segments="auto" reconfigures it).

    updates = Updates(settings, scheduler, device, dp_group=.., pp_group=.., dp_hosts=..)
    updates.arrange(stage, segment_params, r)   # a stage layout's optimizers and DP sync
    updates.launch(k)        # segment k's backward is over: its DP sync starts, its update is pending
    updates.sum_tied()       # end of the step: a tied copy's gradient + the other copy's, then its sync
    updates.apply(k)         # before segment k's next forward: wait for its sync, step, zero grads
    updates.apply_pending()  # every pending update (state_dict, checkpoints, eval_step, close)

Per-segment DP sync (FOLD3D Algorithm 2, DPComm; oases.pipeline.dp_sync): a segment's gradients
start reducing over dp on this rank's DP thread as soon as its backward is over for every
micro-batch, while the segments below it run their backward (aiao: segments finish one after
another from the last; gpipe / 1f1b with ns = 1: one segment, at the end). `dp_overlap_ratio` of
its buckets start then, the rest at the next train_step, under its forwards. Each segment has
its own optimizer (`optimizer(segment's parameters)`), stepped right before the segment's next
forward, after its sync: bulk synchronous, so parameters and losses are those of sequential
training; only *when* the step of iteration n is applied moves (into iteration n + 1, or
`state_dict()`, which applies every pending update first). A scheduler's step in between does not
leak into it: the update runs with the hyper-parameters its optimizer had when its backward ended.

    aiao, ns = 2, pp = 2, stage 0, r = 1     time ->
    compute : .. F⁰ F¹ | B¹ (all i) | B⁰ (all i) |  wait⁰ step⁰ F⁰ (all i) | wait¹ step¹ F¹ ...
    DP      :                       | sync seg 1 | sync seg 0 ......|
    PP      : PP transfers preempt DP chunks (oases.pipeline.comm_scheduler)

Tied input/output embeddings (oases.pipeline.tied): the first stage (embedding) and the last
(head) each hold a copy of the weight, trained by the segment that places it (0 there, ns - 1
here). At the end of each step the pair of ranks holding it at the same (dp, tp) position sums
the copies' gradients (a group of two), then the weight's own DP bucket starts (sync segment ns);
that segment's optimizer step waits for both. Both copies take the single-process step,
bit-identical to each other. With pp = 1, one copy, trained by segment 0.

ZeRO-1 (`zero=True`, oases.pipeline.zero_sync): the sync of segment k reduce-scatters its gradient
rows (each dp rank receives the sum of its 1/dp of every parameter's rows), optimizer[k] steps
those rows only, and the rows are all-gathered back into the parameters in chunks under the
same gate, before segment k's next forward (segment k+1's step and all-gather run when segment
k's forwards start, overlapping them).

With a loss scaler, one unscale and one inf/NaN verdict for every pending segment; with
max_grad_norm, one clip of every pending segment by the whole model's gradient norm.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import clip_sharded_, copied_rows, sharded_parameters
from oases.comm.hierarchical import HostGroups
from oases.dp.zero import ShardedOptimizer
from oases.pipeline._config import Settings
from oases.pipeline._hierarchy import hierarchy_is_faster
from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import SegmentSync
from oases.pipeline.stages import Stage
from oases.pipeline.tied import sum_copies
from oases.pipeline.zero_sync import ZeroSegmentSync

__all__ = [
    "Updates",
    "frozen_segment",
    "make_optimizers",
    "sync_parameters",
    "make_sync",
    "hyper_parameters",
]


class Updates:
    """A stage's per-segment optimizers and DP sync, and its pending updates (see the module doc).

    Args:
        settings: the pipeline's checked arguments (optimizer, zero, buckets, loss scaler, max_grad_norm).
        scheduler: the CommScheduler the DP sync runs on.
        device: the stage's device (the gradient norm's).
        dp_group, pp_group: the mesh's groups.
        dp_hosts: the dp group's HostGroups for two-level rings (None: flat rings).

    `arrange(stage, ...)` makes the optimizers and the sync of a stage layout (again when "auto"
    chooses another); `tied_group`, the pair holding a tied copy, is set once the stage is known.
    """

    def __init__(
        self,
        settings: Settings,
        scheduler: CommScheduler,
        device: torch.device,
        *,
        dp_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup,
        dp_hosts: Optional[HostGroups],
    ) -> None:
        self.settings, self.scheduler, self.device, self.dp_hosts = settings, scheduler, device, dp_hosts
        self.zero, self.loss_scaler, self.max_grad_norm = settings.zero, settings.loss_scaler, settings.max_grad_norm
        self.dp_group, self.pp_group = dp_group, pp_group
        self.tied_group: Optional[dist.ProcessGroup] = None  # the pair holding a tied copy (pp > 1)
        self.prepared = False  # this step's pending gradients unscaled and clipped
        self.grad_norm: Optional[torch.Tensor] = None  # the last applied update's gradient norm (max_grad_norm)

    def arrange(self, stage: Stage, segment_params: list[list[nn.Parameter]], overlap_ratio: float) -> None:
        """The optimizers (one per segment of `segment_params`, the stage's) and the DP sync (r =
        `overlap_ratio`) of `stage`'s layout; nothing pending."""
        settings, dp_hosts = self.settings, self.dp_hosts
        self.model, self.layout, self.segments = stage.model, stage.layout, stage.layout.segments
        self.optimizers = make_optimizers(segment_params, settings.optimizer, zero=self.zero, dp_group=self.dp_group)
        # A copy of a tied embedding / head (pp > 1, first or last stage): trained by segment
        # tied_home, its gradient summed with the other copy's and then over dp as sync segment ns.
        self.tied_home = stage.tied_segment() if self.layout.stages > 1 else None
        self.tied: list[nn.Parameter] = stage.tied if self.tied_home is not None else []
        sync_params = sync_parameters(segment_params, self.tied)
        # Two-level DP rings: always with dp_hierarchy=True; with "auto" where the planner says so.
        self.hierarchical = dp_hosts is not None and (
            settings.dp_links is None
            or hierarchy_is_faster(sync_params, settings.dp_bucket_numel, dp_hosts, settings.dp_links)
        )
        self.sync = make_sync(
            sync_params,
            self.dp_group,
            self.scheduler,
            self.optimizers,
            zero=self.zero,
            overlap_ratio=overlap_ratio,
            bucket_numel=settings.dp_bucket_numel,
            chunk_bytes=settings.dp_chunk_bytes,
            hosts=dp_hosts if self.hierarchical else None,
        )
        self.pending: set[int] = set()  # segments whose optimizer step is not applied yet
        self.hyper: dict[int, list[dict]] = {}  # their optimizers' hyper-parameters when they became pending

    def launch(self, segment: int) -> None:
        """Segment `segment`'s gradients are final (its last backward): its DP sync starts, its update is
        pending. It is applied before the segment's next forward, in the next train_step: after a
        scheduler's step() in between; it runs with the hyper-parameters of now, as one process's would."""
        self.sync.launch(segment)
        self.pending.add(segment)
        self.hyper[segment] = hyper_parameters(self.optimizers[segment])

    def apply(self, segment: int) -> None:
        """Segment `segment`'s pending optimizer step, before its forward. ZeRO: then segment
        k+1's step, whose all-gather runs under segment k's forwards (oases.pipeline.zero_sync);
        and segment k's all-gather is waited for."""
        if segment in self.pending:
            self._step(segment)
        if self.zero:
            if segment + 1 in self.pending:
                self._step(segment + 1)
            self.sync.wait_gather(segment)

    def apply_pending(self) -> None:
        """Every segment's pending update (a collective over dp where one is pending), outside
        inference mode whatever the caller's: optimizer state made there would be inference
        tensors, which the next step could not update in place."""
        with torch.inference_mode(False):
            for k in range(self.segments):
                self.apply(k)

    def sum_tied(self) -> None:
        """End of a step, on a copy of a tied embedding / head (first and last stage): add the
        other copy's gradient (a collective with that stage), then start the weight's DP sync."""
        if self.tied and self.tied_group is not None:
            sum_copies(self.tied, self.tied_group)
            self.sync.launch(self.segments)

    def sync_segment(self, segment: int) -> None:
        """Pipeline.sync_segment: sum segment `segment`'s gradients over dp now, blocking (a tied
        copy's summed with the other copy's first); RuntimeError with zero=True or while the last
        train_step's own sync of the segment is pending."""
        if self.zero:
            raise RuntimeError(
                "sync_segment: with zero=True gradients are reduce-scattered into each dp rank's "
                "optimizer rows (train_step does it); there is no in-place sum"
            )
        if segment in self.pending:
            raise RuntimeError(
                f"sync_segment({segment}): the last train_step already syncs this segment's "
                "gradients; call state_dict() or close() to finish it first"
            )
        self.sync.launch(segment)
        self.sync.wait(segment)
        if segment == self.tied_home:
            self.sum_tied()
            self.sync.wait(self.segments)

    def _wait_sync(self, segment: int) -> None:
        self.sync.wait(segment)
        if segment == self.tied_home:
            self.sync.wait(self.segments)

    def _step(self, segment: int) -> None:
        """Wait for the segment's DP sync (and a tied copy's), step, clear its grads (ZeRO: start
        the all-gather of its parameters). With a loss scaler or max_grad_norm, the first pending
        step of a train step waits for every pending segment's sync, then unscales them all (one
        verdict for all of them over the scaler's group) and clips them all (one norm of the whole
        model's gradient); each segment then steps or skips by the verdict, and the scale is
        updated after the last."""
        scaler = self.loss_scaler
        if (scaler is not None or self.max_grad_norm is not None) and not self.prepared:
            pending = sorted(self.pending)
            for k in pending:
                self._wait_sync(k)
            if scaler is not None:
                scaler.unscale_together_([self.optimizers[k] for k in pending])
            if self.max_grad_norm is not None:
                self.grad_norm = self.clip_gradients(self.max_grad_norm)
            self.prepared = True
        self._wait_sync(segment)
        optimizer = self.optimizers[segment]
        then = self.hyper.pop(segment, None)
        now = _swap_in(optimizer, then) if then is not None else []  # the hyper-parameters of the step it belongs to
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
        if then is not None:
            _swap_back(optimizer, then, now)  # a scheduler's values for the next step, kept
        optimizer.zero_grad(set_to_none=True)
        self.pending.discard(segment)
        if not self.pending:
            if scaler is not None:
                scaler.update()
            self.prepared = False
        if self.zero:
            self.sync.gather(segment)

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient the stage's optimizers step by min(1, max_norm / (total + 1e-6)), total
        the 2-norm of the whole model's gradient (torch.nn.utils.clip_grad_norm_ on the single-process
        model); returns total (fp32, the same on every rank). Call it after every segment's DP sync.

        ::

            oases._sharding.clip_sharded_ of the gradients the optimizers step (ZeRO: this dp rank's
            master rows), TP shards summed over their group, across dp (ZeRO's rows) and pp (stages);
            a tied embedding / head copy counted on the first stage only (scaled on both)
        """
        sharded, copied = sharded_parameters(self.model), copied_rows(self.model)
        other_copy = {id(p) for p in self.tied} if self.layout.stage != 0 else set()  # the first stage counts it
        held = [(p, g, row) for optimizer in self.optimizers for p, g, row in _gradients(optimizer)]
        counted = [(g, sharded.get(id(p)), copied.get(id(p), ()), row) for p, g, row in held if id(p) not in other_copy]
        tied = [g for p, g, _ in held if id(p) in other_copy and g is not None]
        dp = dist.get_world_size(self.dp_group)
        across = ([self.dp_group] if self.zero and dp > 1 else []) + ([self.pp_group] if self.layout.stages > 1 else [])
        return clip_sharded_(counted, max_norm, 2.0, self.device, across=across, also=tied)


def frozen_segment(
    segment_params: list[list[nn.Parameter]], pp_group: dist.ProcessGroup, device: torch.device
) -> Optional[ValueError]:
    """The error when a segment of some stage has no parameter that requires grad (torch makes it no
    optimizer), else None: agreed over the stages (a MAX all-reduce over pp), so that every rank raises
    alike rather than one, leaving the others waiting."""
    pp = dist.get_world_size(pp_group)
    empty = torch.tensor([sum(1 for params in segment_params if not params)], device=device)
    if pp > 1:
        dist.all_reduce(empty, op=dist.ReduceOp.MAX, group=pp_group)
    if not int(empty):
        return None
    return ValueError(
        f"model: a segment of a pipeline stage has no parameter that requires grad (frozen layers: "
        f"pp = {pp}, segments = {len(segment_params)}); every (stage, segment) needs one for its optimizer. "
        f"Freeze fewer layers, or use fewer stages or segments (not segments='auto'), so that each holds a "
        f"trainable parameter"
    )


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


def _gradients(optimizer: torch.optim.Optimizer) -> list[tuple[nn.Parameter, Optional[torch.Tensor], int]]:
    """(model parameter, the gradient the optimizer steps, its first row of the parameter) for each
    parameter: ZeRO, this dp rank's master rows; else the parameter's own .grad."""
    if isinstance(optimizer, ShardedOptimizer):
        return [(p, optimizer.slots[id(p)].master.grad, optimizer.slots[id(p)].start) for p in optimizer.params]
    return [(p, p.grad, 0) for group in optimizer.param_groups for p in group["params"]]
