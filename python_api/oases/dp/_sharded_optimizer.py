"""ZeRO-1's communication-free part: this rank's rows of every parameter, their masters, the inner
optimizer, and the row-block layouts the collectives move (oases.dp.zero's ZeroOptimizer and
oases.pipeline's ZeRO sync communicate around it).

    rows_j = rows [j*ceil(n/dp), (j+1)*ceil(n/dp)) of a parameter [n, ...] on dp rank j (row_range)
    master_j = a view of rows_j (fp32 parameters) or an fp32 copy (bf16 / fp16)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._checks import process_group
from oases._sharding import clip_sharded_
from oases.comm.topology import ring_of

__all__ = ["ShardedOptimizer", "row_range"]


def row_range(rows: int, rank: int, size: int) -> tuple[int, int]:
    """The rows [start, stop) of an n-row tensor that dp rank `rank` of `size` owns."""
    per = -(-rows // size)  # ceil
    return min(rows, rank * per), min(rows, (rank + 1) * per)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1) if t.dim() == 0 else t.reshape(t.shape[0], -1)  # [n, k]


_MASTERS, _LAYOUT = "oases_masters", "oases_layout"  # ShardedOptimizer.state_dict's own entries


def call_closure(closure: Optional[Callable[[], Any]]) -> Any:
    """closure() with gradients enabled (as torch optimizers call it), None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class _Slot:
    """One parameter: its row blocks, and this rank's fp32 (or own dtype) master of its rows."""

    def __init__(self, param: nn.Parameter, rank: int, size: int) -> None:
        self.param = param
        rows = _rows_view(param.detach())
        self.n, self.k = rows.shape
        self.per = -(-self.n // size)
        self.start, self.stop = row_range(self.n, rank, size)
        mine = self.mine(param.detach())  # [stop - start, *shape[1:]], a view of the parameter
        if param.dtype in (torch.float16, torch.bfloat16):
            self.master = nn.Parameter(mine.to(torch.float32, copy=True))  # an fp32 master of 16-bit rows
        else:
            self.master = nn.Parameter(mine)  # the parameter's own rows: the inner step updates them in place

    @property
    def block(self) -> int:
        """Elements of one rank's (padded) row block: per * k."""
        return self.per * self.k

    def mine(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `t` (shaped like the parameter), a view [stop - start, *shape[1:]]."""
        return (t.reshape(1) if t.dim() == 0 else t)[self.start : self.stop]

    def owns_storage(self) -> bool:
        """Whether the master is a tensor of its own (an fp32 copy), not a view of the parameter."""
        return self.master.dtype != self.param.dtype


class ShardedOptimizer(torch.optim.Optimizer):
    """`make_inner(masters)` on this rank's rows of each of `params`, over `group`'s ranks; no
    communication (ZeroOptimizer and oases.pipeline's ZeRO sync move the row blocks).

    A torch.optim.Optimizer whose `param_groups` and `state` are the inner optimizer's: LR schedulers
    (`LambdaLR(opt, ...)`) set the inner's hyper-parameters, step hooks run around step().
    `state_dict()` is this rank's part (the inner's, the fp32 masters of 16-bit rows, and the row
    layout); `load_state_dict` takes it back on the same layout only (another dp size: save and load
    with oases.save_checkpoint / load_checkpoint).

    ::

        rows of p [n, ...] held here: [start, stop) = row_range(n, rank, size)
        master of p: those rows (a view for fp32 p, an fp32 copy for 16-bit p)
        step():  inner.step() on the masters' .grad          (set by whoever reduced the gradients)

    Row blocks, the layout the collectives use (S: every parameter's ceil(n/size) * k elements, then
    `extra` columns, padded to a multiple of `align`)::

        pack_grads(params, grads)  -> [size, S]: block j = rows_j of every gradient,  (reduce-scatter in)
                                      then one flag per parameter: this rank had its gradient
        unpack_grads(params, own)  : master.grad = own's rows [/ divisor],            (reduce-scatter out)
                                      None where no rank had a gradient (every flag 0)
        pack_rows(params)          -> [S]: this rank's masters in the params' dtype   (all-gather in)
        unpack_rows(params, all)   : p = rows of every rank's block of all [size, S]  (all-gather out)

    Args:
        params: the parameters (each once), the same shapes on every rank of `group`.
        group: the data-parallel group (None: the world).
        make_inner: builds the inner optimizer from the masters (a torch.optim.Optimizer).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Optional[dist.ProcessGroup],
        make_inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        group = process_group(group)  # a 1-D DeviceMesh: its group
        ring = ring_of(group)
        self.group, self.size, self.rank = group, ring.size, ring.rank
        self.params = list(params)
        self.slots = {id(p): _Slot(p, self.rank, self.size) for p in self.params}
        self.inner = make_inner([s.master for s in self.slots.values()])
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected it to build a torch.optim.Optimizer, got {type(self.inner).__name__}")
        groups, state = self.inner.param_groups, self.inner.state
        super().__init__([s.master for s in self.slots.values()], self.inner.defaults)  # hooks; it sets groups
        self.inner.param_groups, self.inner.state = groups, state  # and state, which are the inner's
        self._built = True

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param_groups (over the masters)."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's state (the masters')."""
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the rows and masters are fixed at construction (build another optimizer)."""
        if getattr(self, "_built", False):
            raise TypeError(
                f"{type(self).__name__}.add_param_group: its parameters are fixed when it is built; "
                f"give every parameter to the constructor (or build a second optimizer for the others)"
            )
        super().add_param_group(param_group)

    def master_of(self, param: nn.Parameter) -> tuple[nn.Parameter, int, int]:
        """(this rank's master of `param`'s rows [start, stop) (shape `[stop - start, *param.shape[1:]]`),
        start, stop): what the inner optimizer steps."""
        s = self.slots[id(param)]
        return s.master, s.start, s.stop

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """inner.step() on the masters (their .grad set beforehand); returns closure() if given."""
        loss = call_closure(closure)
        self._step_inner()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This rank's part: the inner optimizer's state_dict, the fp32 masters of 16-bit rows (by
        flat index), and the layout (dp rank, dp size, each parameter's shape and rows); the state
        dict hooks registered on this optimizer run around it, as torch's."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        masters = {i: s.master.detach().clone() for i, s in enumerate(self.slots.values()) if s.owns_storage()}
        state_dict = {**self.inner.state_dict(), _MASTERS: masters, _LAYOUT: self._layout()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what state_dict() gave on the same layout (the masters copied back in place: call
        sync_masters() before it, not after); the load hooks registered on this optimizer run
        around it, as torch's.

        Raises ValueError when it was saved by another dp rank, dp size or set of parameters."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        self._load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:
        """The whole object (torch's Optimizer keeps only defaults, groups and state: here the inner's)."""
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _step_inner(self) -> None:
        """inner.step() without torch's hook wrapper around it: the step hooks (global ones too)
        run once, around this optimizer's step()."""
        step = type(self.inner).step
        (step.__wrapped__ if getattr(step, "hooked", False) else step)(self.inner)

    def _load(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or _LAYOUT not in state_dict:
            raise ValueError(
                f"state_dict: not a {type(self).__name__}.state_dict() (no {_LAYOUT!r} entry); a plain "
                f"optimizer's state goes into .inner (rows of this rank), a checkpoint through oases.load_checkpoint"
            )
        if state_dict[_LAYOUT] != self._layout():
            raise ValueError(
                f"state_dict: saved with layout {state_dict[_LAYOUT]}, this optimizer's is {self._layout()}; "
                f"a state_dict is one dp rank's rows: load it on the same rank, dp size and parameters "
                f"(across dp sizes: oases.save_checkpoint / load_checkpoint)"
            )
        self.inner.load_state_dict({k: v for k, v in state_dict.items() if k not in (_MASTERS, _LAYOUT)})
        slots = list(self.slots.values())
        with torch.no_grad():
            for i, master in state_dict[_MASTERS].items():
                slots[i].master.copy_(master)

    def _layout(self) -> dict[str, Any]:
        shapes = [[list(s.param.shape), s.start, s.stop] for s in self.slots.values()]
        return {"dp_rank": self.rank, "dp_size": self.size, "params": shapes}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' and the masters' gradients."""
        for s in self.slots.values():
            s.param.grad = None if set_to_none else (s.param.grad.zero_() if s.param.grad is not None else None)
            s.master.grad = None

    @torch.no_grad()
    def sync_masters(self, params: Optional[Iterable[nn.Parameter]] = None) -> None:
        """Copy the parameters' rows into the fp32 masters of 16-bit parameters (after the parameters
        were loaded; fp32 parameters' masters are views of their rows already). `params`: only
        these parameters' masters (default: every one)."""
        for s in self.slots.values() if params is None else [self.slots[id(p)] for p in params]:
            rows = s.mine(s.param.detach())
            if s.owns_storage() or s.master.data_ptr() != rows.data_ptr():
                s.master.copy_(rows)

    def state_bytes(self) -> int:
        """Bytes of optimizer state (and masters with storage of their own) this rank holds."""
        total = sum(s.master.numel() * s.master.element_size() for s in self.slots.values() if s.owns_storage())
        for state in self.inner.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
        return total

    # --- row blocks -------------------------------------------------------------------------------

    def columns(self, params: Sequence[nn.Parameter], extra: int = 0, align: int = 1) -> int:
        """S: the elements of one rank's block of `params` (plus `extra`), padded to a multiple of `align`."""
        used = sum(self.slots[id(p)].block for p in params) + extra
        return -(-used // align) * align

    def pack_grads(
        self,
        params: Sequence[nn.Parameter],
        grads: Sequence[torch.Tensor],
        *,
        align: int = 1,
        dtype: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """[size, S]: block j holds rows_j of each gradient (zero-padded to ceil(n/size) rows), then
        one flag per parameter (1 where this rank had its gradient: p.grad not None; `grads` holds
        zeros there), then zeros up to S = columns(params, len(params), align)."""
        dtype = dtype or grads[0].dtype
        out = torch.zeros(self.size, self.columns(params, len(params), align), dtype=dtype, device=grads[0].device)
        offset = 0
        for p, g in zip(params, grads):
            s = self.slots[id(p)]
            rows = _rows_view(g)  # [n, k]
            if s.n < self.size * s.per:
                rows = torch.cat([rows, rows.new_zeros(self.size * s.per - s.n, s.k)])  # [size * per, k]
            out[:, offset : offset + s.block] = rows.reshape(self.size, s.block)  # block j: rows [j*per, (j+1)*per)
            offset += s.block
        had = [float(p.grad is not None) for p in params]
        out[:, offset : offset + len(params)] = torch.tensor(had, dtype=dtype, device=out.device)
        return out

    def unpack_grads(
        self,
        params: Sequence[nn.Parameter],
        own: torch.Tensor,
        *,
        divisor: int = 1,
    ) -> None:
        """master.grad = this rank's rows of each parameter in `own` [S] (pack_grads' block of this
        rank, reduced) / divisor; None where its flag says no rank had a gradient."""
        flags = sum(self.slots[id(p)].block for p in params)
        present = (own[flags : flags + len(params)] > 0).tolist()
        offset = 0
        for i, p in enumerate(params):
            s = self.slots[id(p)]
            mine = own[offset : offset + s.block].view(s.per, s.k)[: s.stop - s.start]
            offset += s.block
            if not present[i]:
                s.master.grad = None
                continue
            grad = mine.to(s.master.dtype, copy=True).view(s.master.shape)
            s.master.grad = grad.div_(divisor) if divisor != 1 else grad

    def pack_rows(self, params: Sequence[nn.Parameter], *, align: int = 1) -> torch.Tensor:
        """[S]: this rank's masters of `params` in their parameters' dtype (all the same), each
        zero-padded to ceil(n/size) rows."""
        dtype = params[0].dtype
        out = torch.zeros(self.columns(params, 0, align), dtype=dtype, device=params[0].device)
        offset = 0
        for p in params:
            s = self.slots[id(p)]
            out[offset : offset + (s.stop - s.start) * s.k] = s.master.detach().reshape(-1)
            offset += s.block
        return out

    @torch.no_grad()
    def unpack_rows(self, params: Sequence[nn.Parameter], gathered: torch.Tensor) -> None:
        """Every parameter of `params` = its rows in each rank's block of `gathered` [size, S]."""
        offset = 0
        for p in params:
            s = self.slots[id(p)]
            rows = gathered[:, offset : offset + s.block].reshape(self.size * s.per, s.k)[: s.n]
            offset += s.block
            p.detach().copy_(rows.reshape(p.shape))  # through the parameter's own strides (channels_last too)

    # --- clipping ---------------------------------------------------------------------------------

    @torch.no_grad()
    def clip_master_grads_(
        self, max_norm: float, norm_type: float, tp_groups: dict[int, object], copied: Optional[dict[int, tuple]] = None
    ) -> torch.Tensor:
        """Clip the masters' gradients by the norm of the whole gradient they are rows of (see
        `ZeroOptimizer.clip_grad_norm_`); `tp_groups`: {id(param): its TP group} for TP shards;
        `copied`: oases._sharding.copied_rows (rows several TP ranks hold alike, counted once)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        grads = []
        for p in self.params:
            slot = self.slots[id(p)]
            grads.append((slot.master.grad, tp_groups.get(id(p)), (copied or {}).get(id(p), ()), slot.start))
        return clip_sharded_(grads, max_norm, norm_type, device, across=[self.group] if self.size > 1 else [])
