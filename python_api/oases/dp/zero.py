"""ZeRO stage 1 over the data-parallel ranks: each rank keeps the optimizer state of 1/dp of every
parameter's rows (Megatron's distributed optimizer, DeepSpeed ZeRO-1), around a standard torch optimizer.

    opt = ZeroOptimizer(model, dp_group, torch.optim.AdamW, lr=1e-4)
    loss.backward()        # buckets of gradients reduce-scattered during the backward (GradientSync)
    opt.step()             # for every parameter p [n, ...] and this dp rank j of dp:
                           #     rows_j = rows [j*ceil(n/dp), (j+1)*ceil(n/dp)) of p (may be empty)
                           #     master_j.grad = mean over dp ranks of p.grad[rows_j]      (reduce-scatter)
                           #     inner.step()  on master_j (fp32 copies of bf16/fp16 rows; p's own dtype else)
                           #     p[rows_j] = master_j on every rank                        (all-gather)
    opt.zero_grad()

The inner optimizer sees only the masters (views of the parameter's rows for fp32 parameters, fp32
copies for 16-bit ones; call sync_masters() after loading parameters yourself: load_checkpoint does): its states (AdamW's exp_avg, exp_avg_sq) are 1/dp of
the full ones on each rank. Elementwise optimizers (SGD, Adam, AdamW, ...) give the numbers of the
same optimizer run on the averaged full gradient; optimizers that mix elements across a tensor
(LAMB's trust ratio, Shampoo) do not. Gradients: reduce-scattered in buckets overlapped with the
backward, each bucket one reduce_scatter_tensor of its parameters' padded row blocks laid out by
destination rank; `p.grad` keeps the local (unaveraged) gradient until zero_grad. Parameters:
all-gathered in buckets at the end of step() (blocking). 0-d parameters count as one row.

Not yet: gradient clipping (`p.grad` is this rank's unaveraged gradient and the step reads the
masters' gradients, so torch's or oases.nn's clip_grad_norm_ on the parameters changes nothing);
and for 16-bit parameters, checkpoints hold the parameters, not the fp32 masters, so a resume
restarts the masters from the 16-bit values (not bit-exact; fp32 parameters resume exactly).
"""
from __future__ import annotations

from typing import Any, Optional, Type

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.comm._topology import ring_of
from oases.dp.grad_sync import GradientSync

__all__ = ["ZeroOptimizer", "row_range"]


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """The rows [start, stop) of an n-row tensor that dp rank `rank` of `size` owns."""
    per = -(-rows // size)  # ceil
    return min(rows, rank * per), min(rows, (rank + 1) * per)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1) if t.dim() == 0 else t.reshape(t.shape[0], -1)  # [n, k]


class _Slot:
    """One parameter: its row blocks, and this rank's fp32 (or own dtype) master of its rows."""

    def __init__(self, param: nn.Parameter, rank: int, size: int) -> None:
        self.param = param
        rows = _rows_view(param.detach())
        self.n, self.k = rows.shape
        self.per = -(-self.n // size)
        self.start, self.stop = row_range(self.n, rank, size)
        whole = param.detach().reshape(1) if param.dim() == 0 else param.detach()
        mine = whole[self.start:self.stop]  # [stop - start, *shape[1:]], a view of the parameter
        if param.dtype in (torch.float16, torch.bfloat16):
            self.master = nn.Parameter(mine.to(torch.float32, copy=True))  # an fp32 master of 16-bit rows
        else:
            self.master = nn.Parameter(mine)  # the parameter's own rows: the inner step updates them in place

    def padded(self, t: torch.Tensor, size: int) -> torch.Tensor:
        """[size, per * k]: row block j of `t` (the full parameter's shape), zero-padded."""
        rows = _rows_view(t)
        out = rows.new_zeros(size * self.per, self.k)
        out[:self.n] = rows
        return out.view(size, self.per * self.k)


class _ReduceScatterRows:
    """GradientSync's reducer for ZeRO-1: each rank receives the dp mean of its rows of each gradient."""

    def __init__(self, group: Optional[dist.ProcessGroup], slots: dict[int, _Slot]) -> None:
        self.group, self.size, self.rank = group, ring_of(group).size, ring_of(group).rank
        self.slots = slots

    def start(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> object:
        slots = [self.slots[id(p)] for p in params]
        blocks = torch.cat([s.padded(g, self.size) for s, g in zip(slots, grads)], dim=1)  # [dp, S]
        out = blocks.new_empty(blocks.shape[1])
        work = dist.reduce_scatter_tensor(out, blocks.reshape(-1), group=self.group, async_op=True)
        return out, work

    def complete(self, params: list[nn.Parameter], pending: object) -> None:
        out, work = pending
        work.wait()
        out.div_(self.size)
        offset = 0
        for p in params:
            s = self.slots[id(p)]
            mine = out[offset:offset + s.per * s.k].view(s.per, s.k)[:s.stop - s.start]
            offset += s.per * s.k
            s.master.grad = mine.to(s.master.dtype, copy=True).view(s.master.shape)


class ZeroOptimizer:
    """`optimizer_class(masters, **kwargs)` on this dp rank's rows of every parameter of `model`
    that requires grad; see the module docstring.

    Args:
        model: the (TP-sharded or not) model, the same on every rank of `group`.
        group: the data-parallel group (None: the world), ranks holding the same TP shards.
        optimizer_class: a torch.optim.Optimizer class (elementwise update: SGD, Adam, AdamW, ...).
        bucket_bytes: gradient bytes per reduce-scatter and parameter bytes per all-gather.
        **kwargs: the optimizer's hyper-parameters (lr, betas, weight_decay, ...).
    """

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup] = None,
                 optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 bucket_bytes: int = 25 * 2**20, **kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class: expected a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        ring = ring_of(group)
        self.group, self.size, self.rank = group, ring.size, ring.rank
        self.names = {}  # id(param) -> its name in model.named_parameters()
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.names.setdefault(id(p), name)
        params = [p for p in model.parameters() if id(p) in self.names]
        self.params = params  # the model parameters it steps, in model.parameters() order
        self.slots = {id(p): _Slot(p, self.rank, self.size) for p in params}
        self.inner = optimizer_class([s.master for s in self.slots.values()], **kwargs)
        self.sync = GradientSync(params, group, bucket_bytes=bucket_bytes,
                                 reducer=_ReduceScatterRows(group, self.slots))
        self.bucket_bytes = bucket_bytes

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def master_of(self, param: nn.Parameter) -> tuple[nn.Parameter, int, int]:
        """(this rank's master of `param`'s rows [start, stop) (shape [stop - start, *param.shape[1:]]),
        start, stop): what the inner optimizer steps."""
        s = self.slots[id(param)]
        return s.master, s.start, s.stop

    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient reduce-scatter, step the masters, all-gather the rows into the parameters."""
        self.sync.finish()
        self.inner.step()
        slots = list(self.slots.values())
        bucket, size = [], 0
        for s in slots:
            bucket.append(s)
            size += s.per * s.k * s.param.element_size() * self.size
            if size >= self.bucket_bytes:
                self._gather(bucket)
                bucket, size = [], 0
        if bucket:
            self._gather(bucket)

    def _gather(self, slots: list[_Slot]) -> None:
        """Every rank's rows of the parameters, back into them (one all-gather per dtype)."""
        for dtype in dict.fromkeys(s.param.dtype for s in slots):
            group = [s for s in slots if s.param.dtype == dtype]
            mine = []
            for s in group:
                block = torch.zeros(s.per, s.k, dtype=dtype, device=s.param.device)
                block[:s.stop - s.start] = s.master.reshape(-1, s.k)
                mine.append(block.reshape(-1))
            local = torch.cat(mine)  # [S]
            gathered = local.new_empty(self.size * local.numel())
            dist.all_gather_into_tensor(gathered, local, group=self.group)
            columns = gathered.view(self.size, -1)  # [dp, S]
            offset = 0
            for s in group:
                rows = columns[:, offset:offset + s.per * s.k].reshape(self.size * s.per, s.k)[:s.n]
                offset += s.per * s.k
                _rows_view(s.param.data).copy_(rows)

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Copy the parameters' rows into the fp32 masters of 16-bit parameters (after the parameters
        were loaded; fp32 parameters' masters are views of their rows already)."""
        for s in self.slots.values():
            whole = s.param.detach().reshape(1) if s.param.dim() == 0 else s.param.detach()
            if s.master.data_ptr() != whole[s.start:s.stop].data_ptr() or s.master.dtype != s.param.dtype:
                s.master.copy_(whole[s.start:s.stop])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' and the masters' gradients."""
        for s in self.slots.values():
            s.param.grad = None if set_to_none else (s.param.grad.zero_() if s.param.grad is not None else None)
            s.master.grad = None

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and masters) this rank holds."""
        total = sum(s.master.numel() * s.master.element_size() for s in self.slots.values()
                    if s.master.dtype != s.param.dtype)
        for state in self.inner.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        return total
