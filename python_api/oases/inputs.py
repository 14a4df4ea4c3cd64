"""Inputs checked across a TP group: every rank of a tensor-parallel group must get the same batch.

A TP group computes one model on one batch; a rank fed another batch either aborts inside a
collective (a different batch size: mismatched message sizes) or trains silently on a different
loss (the same shape, other tokens). At each step entry (oases.train_step, GPT.train_step,
Pipeline.train_step) and at every forward of a model after oases.parallelize, before any other
collective, the ranks exchange a fixed-size summary of their inputs and compare it:

    row(x) = [is a tensor, ndim, shape padded to 8 dims, dtype code, hash(x)]   # 12 int64 per input
    hash(x) = sum_i bits(x)_i * w_i  (mod 2^64)   # bits: the integer values, or a float's bit pattern
                                                  # w_i: 64-bit mixes of i (order-free, exact on any device)
    table = all_gather(cat(row(x) for x in inputs), group)     # [p, 12 * len(inputs)]: one collective
    any row != table[0] -> ValueError on every rank, naming the input, the ranks and what differs

`check_inputs` (the option at every entry point): True (the default) checks as above; False skips
it (for users who guarantee equal inputs: no collective, no host sync); "broadcast" makes TP
rank 0's inputs every rank's, as Megatron's `tensor_parallel.broadcast_data` does (after the same
all_gather, which carries rank 0's shapes and dtypes, one broadcast per tensor input; the other
ranks may pass None for an input rank 0 gives). Its cost: one all_gather of 12 int64 per input,
about ten elementwise passes over the tokens, and one device-to-host copy of the table per step
(`python -m bench layers` reports it beside the step's time).

A model after oases.parallelize checks at every forward (a forward pre-hook on its root module:
every tensor argument the forward's signature names, over parallelize's group, the whole group
with per-layer tp_degrees); at every forward rather than the first only, since a data loader's
last, shorter batch on one rank is as likely as a wrong first one. `set_check_inputs(model, mode)`
switches it. Not with parallelize(..., sequence_parallel=True), whose inputs are each rank's
slice; skipped while torch.compile traces and for meta tensors.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._checks import process_group

__all__ = [
    "CheckMode",
    "MODES",
    "check_mode",
    "agree_inputs",
    "agree_tp_inputs",
    "agree_step_inputs",
    "agree_mesh_inputs",
    "watch_inputs",
    "set_check_inputs",
]

CheckMode = Union[bool, str]
MODES = (True, False, "broadcast")
_DIMS = 8  # shape slots of a row; more dims fold into the last
_ROW = 4 + _DIMS  # [is a tensor, ndim, dims..., dtype code, hash]
_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits, by item size
_MIX = (-0x61C8864680B583EB, -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15)  # splitmix64's odd multipliers, signed
_TP_FIX = (
    "give every rank of a TP group the same batch (shard the data by data-parallel rank, not by global "
    'rank), or pass check_inputs="broadcast" to use TP rank 0\'s inputs on every rank; check_inputs=False '
    "skips this check"
)
_MESH_FIX = (
    "give every rank of the mesh the same global batch (each rank takes its data-parallel rows itself), "
    'or pass check_inputs="broadcast" to use rank 0\'s batch on every rank; check_inputs=False skips this '
    "check"
)
_FORWARD_FIX = (
    "give every rank of the model's TP group the same inputs, or call oases.inputs.set_check_inputs("
    'model, "broadcast") to use TP rank 0\'s inputs on every rank; set_check_inputs(model, False) '
    "turns the check off"
)


def check_mode(mode: object, name: str = "check_inputs") -> CheckMode:
    """`mode` if it is one of MODES, else ValueError naming `name` (a local check: every rank alike)."""
    if not any(mode is m or (isinstance(m, str) and mode == m) for m in MODES):
        raise ValueError(
            f"{name}: expected True (check that the TP group's ranks got the same inputs), False "
            f'(skip the check) or "broadcast" (use TP rank 0\'s inputs on every rank), got {mode!r}'
        )
    return mode  # type: ignore[return-value]


def agree_inputs(
    inputs: Mapping[str, Optional[torch.Tensor]],
    group: Optional[dist.ProcessGroup] = None,
    *,
    mode: CheckMode = True,
    device: Optional[torch.device] = None,
) -> dict[str, Optional[torch.Tensor]]:
    """The inputs the ranks of `group` (None: the world) agree on; collective over `group`.

        mode True:        all_gather(row(x) for x in inputs); rows differ -> ValueError   # returns inputs
        mode "broadcast": {name: broadcast(x from group rank 0)}                        # rank 0's everywhere
        mode False:       inputs, no communication
    `device`: where the exchange runs (a device the group's backend carries; default: the first
    tensor input's). A ValueError names the input, the ranks (global) and what differs (its batch
    size, sequence length, other dimension, dtype, or content), the same on every rank."""
    group = process_group(group)  # a 1-D DeviceMesh: its group
    return dict(zip(inputs, _agree(list(inputs.items()), group, mode, device, "ranks of the group", _TP_FIX)))


def agree_tp_inputs(
    model: object, group: Optional[dist.ProcessGroup], size: int, mode: CheckMode, **inputs: Optional[torch.Tensor]
) -> tuple:
    """A training step's inputs agreed on over the model's TP group `group` of `size` ranks (see
    agree_inputs; oases.train_step's step context names it: the group oases.parallelize or GPT
    recorded, else the step's Communicator's), exchanged on the device of `model`'s parameters;
    nothing to do at size 1. Returns the inputs in the order given."""
    mode = check_mode(mode)
    if size <= 1 or mode is False or not dist.is_initialized():
        return tuple(inputs.values())
    return tuple(_agree(list(inputs.items()), group, mode, _device_of(model), "ranks of the TP group", _TP_FIX))


def agree_step_inputs(model: object, comm: object, mode: CheckMode, **inputs: Optional[torch.Tensor]) -> tuple:
    """Deprecated (use agree_tp_inputs): agree_tp_inputs over the group found on the model: its
    forward check's (oases.parallelize), else its own Communicator's (`model.comm`), else `comm`'s."""
    warnings.warn(
        "oases.inputs.agree_step_inputs is deprecated: use agree_tp_inputs(model, group, size, mode, ...)",
        DeprecationWarning,
        stacklevel=2,
    )
    hook, own = _forward_check(model), getattr(model, "comm", None)
    if hook is not None:
        group, size = hook.group, hook.size
    elif hasattr(own, "world_size") and hasattr(own, "group"):
        group, size = own.group, own.world_size
    else:
        group, size = getattr(comm, "group", None), getattr(comm, "world_size", 1)
    return agree_tp_inputs(model, group, size, mode, **inputs)


def agree_mesh_inputs(mode: CheckMode, device: torch.device, **inputs: Optional[torch.Tensor]) -> tuple:
    """A pipeline step's global batch agreed on over the whole mesh (the world: every rank, each
    stage's TP group included, gets the same batch); see agree_inputs. Returns the inputs in order."""
    return tuple(
        _agree(list(inputs.items()), None, check_mode(mode), device, "ranks of the pipeline's mesh", _MESH_FIX)
    )


def watch_inputs(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Check `model`'s inputs across `group` (None: the world) at every forward, before it runs
    (a forward pre-hook on the root module; see the module docstring). Calling it again
    re-targets the one hook. oases.parallelize calls it."""
    hook = _forward_check(model)
    if hook is None:
        hook = _ForwardCheck(_argument_names(model))
        model.register_forward_pre_hook(hook, with_kwargs=True)
    group = process_group(group)  # a 1-D DeviceMesh: its group
    hook.group, hook.size = group, dist.get_world_size(group) if dist.is_initialized() else 1


def set_check_inputs(model: nn.Module, mode: CheckMode) -> None:
    """The forward check of a model after oases.parallelize: True (check every forward, the
    default), False (off) or "broadcast" (every forward takes TP rank 0's tensor arguments)."""
    mode = check_mode(mode, "mode")
    hook = _forward_check(model)
    if hook is None:
        raise ValueError(
            f"model: {type(model).__name__} has no input check to switch (oases.parallelize adds it; "
            f"not with sequence_parallel=True); call oases.inputs.watch_inputs(model, tp_group) first"
        )
    hook.mode = mode


# ---- the forward hook ---------------------------------------------------------------------------
class _ForwardCheck:
    """The forward pre-hook watch_inputs registers: agree on every tensor argument of forward."""

    def __init__(self, names: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
        self.positional, self.keywords = names  # forward's parameters: positional-capable, then keyword-only
        self.group: Optional[dist.ProcessGroup] = None
        self.size = 1
        self.mode: CheckMode = True

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        if self.mode is False or self.size <= 1 or torch.compiler.is_compiling():
            return None
        names = self.positional + self.keywords
        given = {name: (args[i] if i < len(args) else kwargs.get(name)) for i, name in enumerate(self.positional)}
        given.update((name, kwargs.get(name)) for name in self.keywords)
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in given.values()):
            return None  # a meta run (shape tracing): nothing to compare
        agreed = _agree(
            [(n, given[n]) for n in names],
            self.group,
            self.mode,
            _device_of(module),
            "ranks of the TP group",
            _FORWARD_FIX,
        )
        if self.mode != "broadcast":
            return None
        args, kwargs = list(args), dict(kwargs)
        for name, value in zip(names, agreed):
            i = self.positional.index(name) if name in self.positional else len(args)
            if i < len(args):
                args[i] = value
            elif value is not None or name in kwargs:
                kwargs[name] = value
        return tuple(args), kwargs


def _argument_names(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(positional-or-keyword, keyword-only) parameter names of model.forward (not *args / **kwargs)."""
    params = inspect.signature(model.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (
        tuple(p.name for p in params if p.kind in kinds),
        tuple(p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY),
    )


def _forward_check(model: object) -> Optional[_ForwardCheck]:
    hooks = getattr(model, "_forward_pre_hooks", None) or {}
    return next((h for h in hooks.values() if isinstance(h, _ForwardCheck)), None)


def _device_of(model: object) -> Optional[torch.device]:
    """The device of the model's first allocated parameter (None: not a module, or none)."""
    if isinstance(model, nn.Module):
        for p in model.parameters():
            if not p.is_meta:
                return p.device
    return None


# ---- the exchange -------------------------------------------------------------------------------
@torch.compiler.disable  # a collective and .item(): one graph break under torch.compile
def _agree(
    inputs: list[tuple[str, object]],
    group: Optional[dist.ProcessGroup],
    mode: CheckMode,
    device: Optional[torch.device],
    who: str,
    fix: str,
) -> list:
    """agree_inputs on a list of (name, value): the values agreed on, in order."""
    mode = check_mode(mode)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    values = [v for _, v in inputs]
    if mode is False or size <= 1:
        return values
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    mine = _rows(values, device)  # [n * _ROW]
    table = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(table, mine, group=group)
    rows = [[r[i * _ROW : (i + 1) * _ROW] for i in range(len(values))] for r in torch.stack(table).tolist()]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    if mode == "broadcast":
        return _broadcast(inputs, rows, ranks, group, device)
    for i, (name, _) in enumerate(inputs):
        differ = _difference([r[i] for r in rows], ranks)
        if differ:
            others = [n for j, (n, _) in enumerate(inputs) if j > i and len({tuple(r[j]) for r in rows}) > 1]
            also = f" ({', '.join(others)} differ as well)" if others else ""
            raise ValueError(
                f"{name}: the {size} {who} (global ranks {_list(ranks)}) must get the same {name}, "
                f"but {differ}{also}; {fix}"
            )
    return values


def _rows(values: Sequence[object], device: torch.device) -> torch.Tensor:
    """cat(row(x) for x in values): [len(values) * _ROW] int64 on `device` (see the module docstring)."""
    meta, hashes = [], []
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.numel()]
    most = max((t.numel() for t in tensors), default=0)
    weights = {}  # device -> w[:most]
    for v in values:
        if not isinstance(v, torch.Tensor):
            meta.append([0] * _ROW)
            continue
        shape = list(v.shape[: _DIMS - 1]) + ([_numel(v.shape[_DIMS - 1 :])] if v.dim() >= _DIMS else [])
        code = _DTYPES.index(v.dtype) if v.dtype in _DTYPES else len(_DTYPES)
        meta.append([1, v.dim(), *shape, *[-1] * (_DIMS - len(shape)), code, 0])
        if v.numel():
            if v.device not in weights:
                weights[v.device] = _weights(most, v.device)
            hashes.append((len(meta) - 1, _hash(v, weights[v.device]).to(device)))
    row = torch.tensor(meta, dtype=torch.int64).to(device)  # [n, _ROW]
    if hashes:
        row[[i for i, _ in hashes], -1] = torch.stack([h for _, h in hashes])
    return row.reshape(-1)


@torch.no_grad()
def _hash(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i bits(x)_i * w_i mod 2^64 (a 0-d int64): exact and independent of the summation order."""
    if x.dtype == torch.bool:
        bits = x.to(torch.int64)
    else:
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.is_floating_point():
            x = x.contiguous().view(_BITS[x.element_size()])
        bits = x.to(torch.int64)
    return (bits.reshape(-1) * weights[: bits.numel()]).sum()


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """w_i = splitmix64(i + 1) for i < n: [n] int64 (arithmetic shifts: any fixed mix serves)."""
    z = torch.arange(1, n + 1, dtype=torch.int64, device=device).mul_(_MIX[0])
    z.bitwise_xor_(z >> 30).mul_(_MIX[1])
    z.bitwise_xor_(z >> 27).mul_(_MIX[2])
    return z.bitwise_xor_(z >> 31)


def _broadcast(
    inputs: list[tuple[str, object]],
    rows: list[list[list[int]]],
    ranks: list[int],
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> list:
    """Every rank takes group rank 0's tensors: one broadcast per tensor rank 0 holds (its shape
    and dtype from the gathered rows, so every rank allocates alike)."""
    me = ranks.index(dist.get_rank())
    out = []
    for i, (name, value) in enumerate(inputs):
        src = rows[0][i]
        extra = [ranks[r] for r, row in enumerate(rows) if row[i][0] and not src[0]]
        if extra:
            raise ValueError(
                f'{name}: in "broadcast" mode every rank takes global rank {ranks[0]}\'s inputs, which '
                f"passes no tensor for {name} while {_ranks_text(extra)} "
                f"{'do' if len(extra) > 1 else 'does'}; pass it on global rank {ranks[0]} too (or None "
                f"everywhere)"
            )
        if not src[0]:
            out.append(value)
            continue
        ndim, code = src[1], src[2 + _DIMS]
        if ndim > _DIMS or code >= len(_DTYPES):
            raise ValueError(
                f'{name}: "broadcast" mode sends tensors of up to {_DIMS} dimensions and '
                f"dtypes {', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}; global rank "
                f"{ranks[0]}'s has {ndim} dimensions, {_dtype_name(code)}"
            )
        if me == 0:
            buffer = value.to(device).contiguous()
        else:
            buffer = torch.empty(src[2 : 2 + ndim], dtype=_DTYPES[code], device=device)
        wire = buffer.view(torch.uint8) if buffer.dtype == torch.bool else buffer
        dist.broadcast(wire, ranks[0], group=group)
        out.append(buffer)  # rank 0: `value` itself when already contiguous on `device`
    return out


def _difference(rows: list[list[int]], ranks: list[int]) -> str:
    """'' when every row is rank 0's, else what differs, in words (the first field that does)."""
    if all(r == rows[0] for r in rows):
        return ""
    fields = (
        ("whether it is a tensor", slice(0, 1), _presence_text),
        (None, slice(1, 2 + _DIMS), _shape_text),
        ("its dtype", slice(2 + _DIMS, 3 + _DIMS), lambda r: _dtype_name(r[2 + _DIMS])),
    )
    for what, field, describe in fields:
        kinds = _by_value(rows, ranks, field)
        if len(kinds) > 1:
            held = ", ".join(
                f"{_ranks_text(rs)} {'pass' if len(rs) > 1 else 'passes'} {describe(row)}" for row, rs in kinds
            )
            return f"{what or _which_dim(rows)} differs: {held}"
    groups = " vs ".join(_ranks_text(rs) for _, rs in _by_value(rows, ranks, slice(3 + _DIMS, 4 + _DIMS)))
    return (
        f"its content differs (the same {_shape_text(rows[0])} and dtype {_dtype_name(rows[0][2 + _DIMS])}, "
        f"other values: {groups})"
    )


def _by_value(rows: list[list[int]], ranks: list[int], field: slice) -> list[tuple[list[int], list[int]]]:
    """[(a row, the global ranks whose rows hold its value of `field`)], in rank order."""
    kinds: dict[tuple, tuple[list[int], list[int]]] = {}
    for rank, row in zip(ranks, rows):
        kinds.setdefault(tuple(row[field]), (row, []))[1].append(rank)
    return list(kinds.values())


def _presence_text(row: list[int]) -> str:
    return "a tensor" if row[0] else "no tensor (None, or not a torch.Tensor)"


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"global rank{'s' if len(ranks) > 1 else ''} {_list(ranks)}"


def _which_dim(rows: list[list[int]]) -> str:
    """The first dimension whose size differs, in words ("its batch size" for a [batch, seq] input)."""
    ndims = {r[1] for r in rows}
    if len(ndims) > 1:
        return "its number of dimensions"
    ndim = ndims.pop()
    dim = next(d for d in range(min(ndim, _DIMS)) if len({r[2 + d] for r in rows}) > 1)
    if ndim == 2:
        return ("its batch size", "its sequence length")[dim]
    return f"its dimension {dim}"


def _shape_text(row: list[int]) -> str:
    ndim = row[1]
    dims = row[2 : 2 + min(ndim, _DIMS)]
    text = ", ".join(map(str, dims)) + ("," if ndim == 1 else "")
    return f"shape ({text})" + (f" ({ndim} dims, the last {ndim - _DIMS + 1} folded)" if ndim > _DIMS else "")


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "another dtype"


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
