"""What Oases is measured against: PyTorch's own ways to run the same tensor-parallel linear.

    Peer(impl, fn, reason, note)     one peer: fn() -> the result; fn None: n/a here, with a reason
    torch_tp(...)                    DTensor tensor parallelism (parallelize_module on nn.Linear)
    torch_symm_mem(...)              torch.ops.symm_mem fused all-gather-matmul / matmul-reduce-scatter,
                                     or its fallback path where the fused op has no kernel
    *_async(...)                     PyTorch alone, pipelined: per row piece, the torch collective
                                     issued with async_op=True beside the next GEMM
    torch_all_gather / ...           torch's blocking collectives into fresh outputs
    CollectiveLog()                  what a DTensor peer sends: its functional collectives, counted

Every peer is built on every rank, and is available on all of them or on none (`agree`), so a
collective is never entered by a subset of the ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from oases.ops import gemm

__all__ = [
    "Peer",
    "agree",
    "materialize",
    "torch_tp",
    "torch_symm_mem",
    "TORCH_ASYNC_IMPL",
    "all_gather_linear_async",
    "linear_reduce_scatter_async",
    "linear_all_reduce_async",
    "torch_all_gather",
    "torch_reduce_scatter",
    "torch_all_reduce",
    "CollectiveLog",
]


@dataclass
class Peer:
    impl: str
    fn: Optional[Callable[[], torch.Tensor]] = None  # None: n/a here
    reason: Optional[str] = None  # why it is n/a
    note: Optional[str] = None  # what ran instead of what was asked, when that differs


def agree(ok: bool, device: torch.device) -> bool:
    """True on every rank iff `ok` on every rank."""
    flag = torch.tensor([1 if ok else 0], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def materialize(y: Any) -> torch.Tensor:
    """Wait for a functional collective's result (DTensor TP returns AsyncCollectiveTensor)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(y, AsyncCollectiveTensor):
        return y.trigger_wait()
    return y


# ---------------------------------------------------------------------------------------------
# DTensor tensor parallelism

TP_STYLES = ("colwise_shard0", "rowwise_shard0", "rowwise")


def _tp_style(name: str):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        # input Shard(0) (sequence-sharded) -> redistribute to Replicate (all-gather) -> local linear
        "colwise_shard0": lambda: ColwiseParallel(input_layouts=Shard(0)),
        # input Shard(-1) (feature-sharded) -> local linear -> partial sums -> reduce-scatter dim 0
        "rowwise_shard0": lambda: RowwiseParallel(output_layouts=Shard(0)),
        # input Shard(-1) -> local linear -> partial sums -> all-reduce
        "rowwise": lambda: RowwiseParallel(),
    }[name]()


def torch_tp(style_name: str, weight_full: torch.Tensor, x: torch.Tensor, mesh_of: Callable[[], Any]) -> Peer:
    """parallelize_module(nn.Linear(bias=False) holding `weight_full`, 1-D mesh, style); called on x.

    `weight_full` is the unsharded [out, in] weight (identical on every rank); the style shards it.
    """
    style = module = None
    try:
        style = _tp_style(style_name)
        from torch.distributed.tensor.parallel import parallelize_module

        linear = nn.Linear(
            weight_full.shape[1], weight_full.shape[0], bias=False, device=weight_full.device, dtype=weight_full.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(weight_full)
        mesh = mesh_of()
        module = parallelize_module(linear, mesh, style)
        reason = None
    except Exception as err:  # a torch without DTensor TP, or a style it does not know
        reason = f"{type(err).__name__}: {err}"
    impl = "torch.distributed.tensor.parallel.parallelize_module"
    if module is not None:
        impl = f"parallelize_module(nn.Linear, {mesh!r}, {style!r})"
    if not agree(module is not None, weight_full.device):
        return Peer(impl, None, reason or "unavailable on another rank")
    return Peer(impl, lambda: materialize(module(x)))


# ---------------------------------------------------------------------------------------------
# Symmetric-memory fused ops

_FALLBACKS = {
    "fused_all_gather_matmul": "_fused_all_gather_matmul_fallback",
    "fused_matmul_reduce_scatter": "_fused_matmul_reduce_scatter_fallback",
}


def torch_symm_mem(op: str, x: torch.Tensor, w: torch.Tensor, group_name: str) -> Peer:
    """torch.ops.symm_mem.<op> on (x, w.T) if it runs on x's device, else the op's own fallback
    (the functional collective, wait, matmul: no overlap), with the reason; n/a if neither exists.

        fused_all_gather_matmul:     all_gather(x, dim 0) @ w.T
        fused_matmul_reduce_scatter: reduce_scatter(x @ w.T, dim 0)
    """
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as err:
        return Peer("torch.distributed._symmetric_memory", None, f"does not import: {err}")

    def call_op() -> torch.Tensor:
        if op == "fused_all_gather_matmul":
            return torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], 0, group_name, return_A=False)[1][0]
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, group_name)

    def call_fallback() -> torch.Tensor:
        fallback = getattr(symm_mem, _FALLBACKS[op])
        if op == "fused_all_gather_matmul":
            return fallback(x, [w.t()], 0, group_name, return_A=False)[1][0]
        return fallback(x, w.t(), "sum", 0, group_name)

    op_error = None
    try:
        if x.is_cuda:
            symm_mem.enable_symm_mem_for_group(group_name)
        call_op()
    except Exception as err:  # no kernel for this device (CPU), or no symmetric memory
        first = str(err).split(". ")[0].splitlines()[0] if str(err) else ""
        op_error = f"torch.ops.symm_mem.{op} does not run on {x.device.type}: {type(err).__name__}: {first}"
    if agree(op_error is None, x.device):
        return Peer(f"torch.ops.symm_mem.{op}", call_op)
    op_error = op_error or f"torch.ops.symm_mem.{op} fails on another rank"
    if not hasattr(symm_mem, _FALLBACKS[op]):
        return Peer(f"torch.ops.symm_mem.{op}", None, op_error)
    note = (
        f"{op_error}; timed its fallback path instead (symm_mem.{_FALLBACKS[op]}: functional collective, wait, matmul)"
    )
    return Peer(f"torch.distributed._symmetric_memory.{_FALLBACKS[op]}", call_fallback, note=note)


# ---------------------------------------------------------------------------------------------
# torch_async: the same row pieces as ours; each piece's torch collective issued with
# async_op=True and progressed by the backend's own threads (gloo) or stream (NCCL) while the
# next GEMM runs; waited where its result is needed.

TORCH_ASYNC_IMPL = {
    "all_gather_linear": "per piece: dist.all_gather_into_tensor(async_op=True); own rows' GEMM, then each "
    "piece's GEMM after its wait",
    "linear_reduce_scatter": "per piece: GEMM, then dist.reduce_scatter_tensor(async_op=True); wait all at the end",
    "linear_all_reduce": "per piece: GEMM, then dist.all_reduce(async_op=True); wait all at the end",
}


def all_gather_linear_async(x, w, p: int, r: int, chunks: int) -> Callable[[], torch.Tensor]:
    """y [p n, o] = all_gather(x [n, k]) @ w.T, gathered piece by piece."""
    n, k = x.shape
    m = n // chunks

    def run() -> torch.Tensor:
        y = x.new_empty((p * n, w.shape[0]))
        pieces = [x.new_empty((p * m, k)) for _ in range(chunks)]  # piece q of every rank's shard
        works = [dist.all_gather_into_tensor(pieces[q], x[q * m : (q + 1) * m], async_op=True) for q in range(chunks)]
        gemm.linear_into(x, w, None, y[r * n : (r + 1) * n])  # own rows while the pieces travel
        for q, work in enumerate(works):
            work.wait()
            for b in range(p):
                if b != r:
                    gemm.linear_into(pieces[q][b * m : (b + 1) * m], w, None, y[b * n + q * m : b * n + (q + 1) * m])
        return y

    return run


def linear_reduce_scatter_async(x, w, p: int, chunks: int) -> Callable[[], torch.Tensor]:
    """y [n, o] = reduce_scatter(x [p n, k] @ w.T), produced and reduced piece by piece."""
    n = x.shape[0] // p
    m = n // chunks

    def run() -> torch.Tensor:
        out = x.new_empty((n, w.shape[0]))
        works = []
        for q in range(chunks):
            partial = x.new_empty((p * m, w.shape[0]))  # piece q of every block, block-major
            for b in range(p):
                gemm.linear_into(x[b * n + q * m : b * n + (q + 1) * m], w, None, partial[b * m : (b + 1) * m])
            works.append(dist.reduce_scatter_tensor(out[q * m : (q + 1) * m], partial, async_op=True))
        for work in works:
            work.wait()
        return out

    return run


def linear_all_reduce_async(x, w, chunks: int) -> Callable[[], torch.Tensor]:
    """y [s, o] = all_reduce(x [s, k] @ w.T), produced and reduced piece by piece."""
    s = x.shape[0]

    def run() -> torch.Tensor:
        y = x.new_empty((s, w.shape[0]))
        works = []
        for q in range(chunks):
            rows = slice(q * s // chunks, (q + 1) * s // chunks)
            gemm.linear_into(x[rows], w, None, y[rows])
            works.append(dist.all_reduce(y[rows], async_op=True))
        for work in works:
            work.wait()
        return y

    return run


# ---------------------------------------------------------------------------------------------
# torch's blocking collectives, into fresh outputs


def torch_all_gather(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x)
    return out


def torch_reduce_scatter(t: torch.Tensor) -> torch.Tensor:
    out = t.new_empty((t.shape[0] // dist.get_world_size(), *t.shape[1:]))
    dist.reduce_scatter_tensor(out, t)
    return out


def torch_all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------
# What a DTensor peer sends


_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class CollectiveLog(TorchDispatchMode):
    """Counts the functional collectives (torch.ops._c10d_functional.*) run inside the block, as
    DTensor issues them in forward and backward, with the bytes of each one's full tensor:

        with CollectiveLog() as log:
            step()
        log.calls["all_gather_into_tensor"], log.bytes["all_gather_into_tensor"]
    full tensor: the gathered output of an all-gather, the unscattered input of a reduce-scatter,
    the tensor of an all-reduce (bench._metrics.bus_bandwidth's convention). Other ops of the
    namespace (wait_tensor, autograd wrappers) are not collectives and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # A mode runs before tensor subclasses, and is off while its op runs: let DTensor run
            # this op with the mode on, so the collectives it issues inside (redistributions,
            # loss_parallel's reductions) come back here as ops on plain tensors.
            return NotImplemented
        if func.namespace.startswith("_c10d_functional"):
            name = func._schema.name.split("::")[-1]
            if name.startswith(_COLLECTIVES):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                if name.startswith("all_gather"):
                    nbytes *= next(a for a in args[1:] if isinstance(a, int))  # group_size
                self.calls[name] += 1
                self.bytes[name] += nbytes
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        return {name: {"calls": self.calls[name], "bytes": self.bytes[name]} for name in sorted(self.calls)}
