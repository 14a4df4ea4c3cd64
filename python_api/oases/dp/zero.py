"""ZeRO stage 1 over the data-parallel ranks: each rank keeps the optimizer state of 1/dp of every
parameter's rows (Megatron's distributed optimizer, DeepSpeed ZeRO-1), around a standard torch optimizer.

    opt = ZeroOptimizer(model, dp_group, torch.optim.AdamW, lr=1e-4)
    loss.backward()        # buckets of gradients reduce-scattered during the backward (GradientSync)
    opt.clip_grad_norm_(1.0)   # optional: by the norm of the whole averaged gradient
    opt.step()             # for every parameter p [n, ...] and this dp rank j of dp:
                           #     rows_j = rows [j*ceil(n/dp), (j+1)*ceil(n/dp)) of p (may be empty)
                           #     master_j.grad = mean over dp ranks of p.grad[rows_j]      (reduce-scatter)
                           #     inner.step()  on master_j (fp32 copies of bf16/fp16 rows; p's own dtype else)
                           #     p[rows_j] = master_j on every rank                        (all-gather)
    opt.zero_grad()

The inner optimizer sees only the masters (views of the parameter's rows for fp32 parameters, fp32
copies for 16-bit ones; call sync_masters() after loading parameters yourself: load_checkpoint does
it, and restores the fp32 masters a checkpoint holds): its states (AdamW's exp_avg, exp_avg_sq) are
1/dp of the full ones on each rank. Elementwise optimizers (SGD, Adam, AdamW, ...) give the numbers
of the same optimizer run on the averaged full gradient; optimizers that mix elements across a
tensor (LAMB's trust ratio, Shampoo) do not. Gradients: reduce-scattered in buckets overlapped with
the backward, each bucket one reduce_scatter_tensor of its parameters' padded row blocks laid out
by destination rank; `p.grad` keeps the local (unaveraged) gradient until zero_grad, so clip with
`opt.clip_grad_norm_`, not torch's on the parameters. Parameters: all-gathered in buckets at the
end of step() (blocking). 0-d parameters count as one row.

`ShardedOptimizer` is the part without communication (this rank's rows, their masters, the inner
optimizer, and the row-block layouts the collectives move); oases.pipeline's ZeRO sync uses it too.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Type

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import copied_rows, sharded_parameters
from oases.dp._sharded_optimizer import ShardedOptimizer, call_closure, row_range
from oases.dp.grad_sync import GradientSync

__all__ = ["ZeroOptimizer", "ShardedOptimizer", "row_range"]


class _ReduceScatterRows:
    """GradientSync's reducer for ZeRO-1: each rank receives the dp mean of its rows of each gradient."""

    def __init__(self, rows: ShardedOptimizer) -> None:
        self.rows = rows

    def start(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> object:
        """Reduce-scatter (async) each rank's rows of `grads` (and the flags of pack_grads)."""
        blocks = self.rows.pack_grads(params, grads)  # [dp, S]
        out = blocks.new_empty(blocks.shape[1])
        work = dist.reduce_scatter_tensor(out, blocks.reshape(-1), group=self.rows.group, async_op=True)
        return out, work

    def complete(self, params: list[nn.Parameter], pending: object) -> None:
        """Each master's gradient: the dp mean of its rows, None where no rank had a gradient (the
        optimizer then skips it, as torch's does a parameter without one)."""
        out, work = pending
        work.wait()
        self.rows.unpack_grads(params, out, divisor=self.rows.size)


class ZeroOptimizer(ShardedOptimizer):
    """`optimizer_class(masters, **kwargs)` on this dp rank's rows of every parameter of `model`
    that requires grad; see the module docstring.

    Args:
        model: the (TP-sharded or not) model, the same on every rank of `group`.
        group: the data-parallel group or a 1-D DeviceMesh such as `mesh["dp"]` (None: the world), ranks
            holding the same TP shards.
        optimizer_class: a torch.optim.Optimizer class (elementwise update: SGD, Adam, AdamW, ...).
        bucket_bytes: gradient bytes per reduce-scatter and parameter bytes per all-gather.
        **kwargs: the optimizer's hyper-parameters (lr, betas, weight_decay, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        group: Optional[dist.ProcessGroup] = None,
        optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        bucket_bytes: int = 25 * 2**20,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class: expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self.names = {}  # id(param) -> its name in model.named_parameters()
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.names.setdefault(id(p), name)
        params = [p for p in model.parameters() if id(p) in self.names]  # model.parameters() order
        super().__init__(params, group, lambda masters: optimizer_class(masters, **kwargs))
        self._tp_groups = sharded_parameters(model)  # {id(param): TP group}: clip_grad_norm_ counts shards
        self._copied = copied_rows(model)  # rows held alike by several TP ranks: counted once
        self.sync = GradientSync(params, group, bucket_bytes=bucket_bytes, reducer=_ReduceScatterRows(self))
        self.bucket_bytes = bucket_bytes

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient by its norm, as `torch.nn.utils.clip_grad_norm_` on the single-process
        model would; call it between the backward and step(), on every rank (a collective over dp and tp).

        ::

            finish the gradient reduce-scatter (if the backward did not)
            total = norm of cat(every parameter's whole averaged gradient)   # dp rows summed over dp;
                    # TP shards summed over their TP group, replicated parameters (norms) counted once
            every master.grad *= min(1, max_norm / (total + 1e-6))

        Returns `total` (an fp32 scalar, the same on every rank). norm_type: 2.0 or inf."""
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type: only 2.0 and inf are supported, got {norm_type!r}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm: expected a number > 0, got {max_norm!r}")
        self.sync.finish()
        return self.clip_master_grads_(float(max_norm), norm_type, self._tp_groups, self._copied)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """closure() if given; finish the gradient reduce-scatter, step the masters, all-gather the
        rows into the parameters; returns the closure's value."""
        loss = call_closure(closure)
        self.sync.finish()
        self._step_inner()
        bucket, size = [], 0
        for s in self.slots.values():
            bucket.append(s.param)
            size += s.block * s.param.element_size() * self.size
            if size >= self.bucket_bytes:
                self._gather(bucket)
                bucket, size = [], 0
        if bucket:
            self._gather(bucket)
        return loss

    def _gather(self, params: list[nn.Parameter]) -> None:
        """Every rank's rows of the parameters, back into them (one all-gather per dtype)."""
        for dtype in dict.fromkeys(p.dtype for p in params):
            group = [p for p in params if p.dtype == dtype]
            local = self.pack_rows(group)  # [S]
            gathered = local.new_empty(self.size * local.numel())
            dist.all_gather_into_tensor(gathered, local, group=self.group)
            self.unpack_rows(group, gathered.view(self.size, -1))  # [dp, S]
