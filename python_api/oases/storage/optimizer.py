"""Optimizer state in checkpoints: an optimizer (torch.optim, or a ZeroOptimizer's inner one over
its rows) as checkpoints see it, its state as entries keyed by parameter name, and read back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from oases._sharding import rows_of, whole
from oases.storage.dcp import Chunked
from oases.storage.keys import GROUPS, MASTER, STATE
from oases.storage.unsharded import Shard

__all__ = [
    "OptimizerView",
    "optimizer_view",
    "optimizer_entries",
    "optimizer_wants",
    "optimizer_reads",
    "check_groups",
    "restore_optimizer",
]


@dataclass(frozen=True)
class OptimizerView:
    """An optimizer as checkpoints see it: the torch optimizer whose state_dict is stored (a
    ZeroOptimizer's inner one), and for each of its parameters (flat index) the model parameter
    it stands for, that parameter's name, the rows [start, stop) of it the state covers (ZeRO)
    or None (all of it), and ZeRO's fp32 master of those rows where it is a tensor of its own
    (16-bit parameters) or None; `resync(params)` refills those masters from the parameters."""

    inner: torch.optim.Optimizer
    names: list[list[str]]  # per param group: the model parameter names, in the group's order
    params: list[nn.Parameter]  # flat index -> the model parameter
    rows: list[Optional[tuple[int, int]]]  # flat index -> ZeRO rows, or None
    masters: list[Optional[torch.Tensor]] = ()  # flat index -> fp32 master of the rows [stop - start, ...], or None
    resync: Optional[Callable[[list[nn.Parameter]], None]] = None  # ZeRO: masters <- parameters

    def flat_names(self) -> list[str]:
        """The model parameter names by flat optimizer index."""
        return [name for group in self.names for name in group]


def optimizer_view(model: nn.Module, optimizer: object) -> OptimizerView:
    """The checkpoint view of a torch.optim optimizer over the model's parameters, or of an
    oases.dp.ZeroOptimizer (its inner optimizer over this dp rank's rows); local checks only."""
    names: dict[int, str] = {id(p): name for name, p in model.named_parameters()}
    zero = callable(getattr(optimizer, "master_of", None)) and isinstance(
        getattr(optimizer, "inner", None), torch.optim.Optimizer
    )
    if not zero and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: expected a torch.optim.Optimizer or an oases.dp.ZeroOptimizer, got {type(optimizer).__name__}"
        )
    inner = optimizer.inner if zero else optimizer
    stand_for = {}  # id(inner parameter) -> (model parameter, rows, master with storage of its own)
    if zero:
        for p in optimizer.params:
            master, start, stop = optimizer.master_of(p)
            if p.dim() == 0:
                raise ValueError(
                    f"optimizer: {names.get(id(p), 'a parameter')} is 0-d; ZeroOptimizer checkpoints "
                    f"need parameters with at least one dimension"
                )
            stand_for[id(master)] = (p, (start, stop), master if master.dtype != p.dtype else None)
    groups, params, rows, masters, strangers = [], [], [], [], []
    for g, group in enumerate(inner.param_groups):
        mine = []
        for i, q in enumerate(group["params"]):
            p, piece, master = stand_for.get(id(q), (q, None, None))
            if id(p) not in names:
                strangers.append(f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})")
            mine.append(names.get(id(p), ""))
            params.append(p)
            rows.append(piece)
            masters.append(master)
        groups.append(mine)
    if strangers:
        raise ValueError(
            f"optimizer: {', '.join(strangers)} is not a parameter of the model (optimizer state is "
            f"stored by model.named_parameters() name); build the optimizer from model.parameters()"
        )
    resync = getattr(optimizer, "sync_masters", None) if zero else None
    return OptimizerView(inner, groups, params, rows, masters, resync)


def _state_chunks(
    view: OptimizerView, index: int, shape: tuple[int, ...], shards: dict[str, Shard], name: str
) -> Optional[tuple[list, torch.Size, tuple[int, ...]]]:
    """How a state tensor of parameter `index` stored with global `shape` lies on this rank:
    (its boxes, the global shape, the local shape), or None when it is not shaped like the
    parameter (a scalar step: replicated). ZeRO: the boxes of its rows."""
    p, piece, shard = view.params[index], view.rows[index], shards.get(name)
    full = shard.full_shape if shard is not None else p.shape
    if tuple(shape) != tuple(full):
        return None
    chunks = shard.rule.chunks(full, shard.rank, shard.size) if shard is not None else whole(tuple(full))
    if piece is None:
        return chunks, torch.Size(full), tuple(p.shape)
    start, stop = piece
    return rows_of(chunks, start, stop), torch.Size(full), (stop - start, *p.shape[1:])


def _check_replicated(
    view: OptimizerView, index: int, name: str, state: str, shape: tuple[int, ...], shards: dict[str, Shard]
) -> None:
    """ValueError for state stored as one value for every rank (not shaped like its parameter) that
    differs between ranks: a tensor with dimensions, of a parameter this rank holds a part of (a TP
    shard, ZeRO rows), as Adafactor's factored row_var / col_var of the shard."""
    piece, whole_rows = view.rows[index], view.params[index].shape[:1]
    split = (name in shards and shards[name].size > 1) or (piece is not None and (piece[1] - piece[0],) != whole_rows)
    if len(shape) == 0 or not split:  # at TP 1 and dp 1 the state is the whole parameter's
        return
    kind = type(view.inner).__name__
    raise ValueError(
        f"optimizer: {kind}'s state {state!r} of {name} has shape {shape}, not the shape of the parameter "
        f"({tuple(view.params[index].shape)} on this rank, a part of it): it depends on this rank's part and is "
        f"not a piece of the unsharded parameter's state, so a checkpoint cannot hold it for every layout; use an "
        f"optimizer whose state is elementwise or scalar (SGD, Adam, AdamW, ...), or save that state yourself"
    )


def optimizer_entries(view: OptimizerView, shards: dict[str, Shard], *, skip: Collection[str] = ()) -> dict:
    """The optimizer's state keyed by parameter name: parameter-shaped tensors as their boxes of
    the full parameter (TP shards, ZeRO rows), the rest as they are; its param_groups under GROUPS.
    The states of the parameters named in `skip` are checked but left out (another rank writes them)."""
    names = view.flat_names()  # [optimizer index]
    saved = view.inner.state_dict()  # {"state": {index: {name: value}}, "param_groups": [{..., "params": [index]}]}
    entries: dict[str, Any] = {
        GROUPS: [dict(group, params=[names[i] for i in group["params"]]) for group in saved["param_groups"]]
    }
    for index, state in saved["state"].items():
        p, piece = view.params[index], view.rows[index]
        for name, value in state.items():
            if "." in name:
                raise ValueError(f"optimizer: state name {name!r} has a '.', which checkpoint keys use as separator")
            if isinstance(value, torch.Tensor):  # exp_avg [shard] is sharded like its parameter; step [] replicated
                local = tuple(p.shape) if piece is None else (piece[1] - piece[0], *p.shape[1:])
                full = shards[names[index]].full_shape if names[index] in shards else p.shape
                placed = _state_chunks(view, index, full, shards, names[index]) if tuple(value.shape) == local else None
                if placed is None:
                    _check_replicated(view, index, names[index], name, tuple(value.shape), shards)
                value = value.detach() if placed is None else Chunked(value.detach(), tuple(placed[0]), placed[1])
            if names[index] not in skip:
                entries[f"{STATE}{names[index]}.{name}"] = value
    for index, master in enumerate(view.masters):  # ZeRO's fp32 masters of 16-bit parameters: their rows
        if master is not None:
            full = shards[names[index]].full_shape if names[index] in shards else view.params[index].shape
            placed = _state_chunks(view, index, full, shards, names[index])
            entries[f"{MASTER}{names[index]}"] = Chunked(master.detach(), tuple(placed[0]), placed[1])
    return entries


def _stored_states(
    what: str, view: OptimizerView, stored: dict, shards: dict[str, Shard]
) -> Iterator[tuple[str, int, Optional[str], Any, Optional[tuple]]]:
    """(checkpoint key, optimizer index, state name | None for ZeRO's fp32 master, its metadata,
    its placement on this rank (`_state_chunks`) | None) of each entry the optimizer reads; local
    checks only, raised before anything is allocated."""
    if GROUPS not in stored:
        raise ValueError(
            f"optimizer: {what} holds no optimizer state (saved without optimizer=); load it with optimizer=None"
        )
    index = {name: i for i, name in enumerate(view.flat_names())}
    for key, meta in stored.items():
        if key.startswith(MASTER) and key[len(MASTER) :] in index and isinstance(meta, TensorStorageMetadata):
            i = index[key[len(MASTER) :]]
            placed = _state_chunks(view, i, tuple(meta.size), shards, key[len(MASTER) :])
            if view.masters and view.masters[i] is not None and placed is not None:
                yield key, i, None, meta, placed
            continue
        if not key.startswith(STATE):
            continue
        name, state = key[len(STATE) :].rsplit(".", 1)
        if name not in index:
            continue  # a parameter the optimizer lacks: the param_groups check names it
        i = index[name]
        if not isinstance(meta, TensorStorageMetadata):
            yield key, i, state, meta, None  # pickled: read locally first
            continue
        placed = _state_chunks(view, i, tuple(meta.size), shards, name)
        if placed is None:
            _check_replicated(view, i, name, state, tuple(meta.size), shards)
        yield key, i, state, meta, placed


def optimizer_wants(what: str, view: OptimizerView, stored: dict, shards: dict[str, Shard]) -> dict[str, Any]:
    """{checkpoint key: the boxes this rank reads of it, or None for all of it} of what
    `optimizer_reads` reads, allocating nothing; local checks only."""
    return {
        key: None if placed is None else tuple(placed[0])
        for key, _, _, _, placed in _stored_states(what, view, stored, shards)
    }


def optimizer_reads(
    what: str, view: OptimizerView, stored: dict, shards: dict[str, Shard]
) -> tuple[dict[str, tuple[int, Optional[str]]], dict[str, Any]]:
    """({checkpoint key: (optimizer index, state name | None for ZeRO's fp32 master)}, {key: buffer to
    read into | None for pickled}); local checks only. A master is read straight into the optimizer's."""
    params = [p for group in view.inner.param_groups for p in group["params"]]
    where, reads = {}, {}
    for key, i, state, meta, placed in _stored_states(what, view, stored, shards):
        where[key] = (i, state)
        if state is None:  # ZeRO's fp32 master: read in place
            reads[key] = Chunked(view.masters[i].detach(), tuple(placed[0]), placed[1])
        elif not isinstance(meta, TensorStorageMetadata):
            reads[key] = None  # pickled: read locally first
        else:
            current = view.inner.state.get(params[i], {}).get(state)
            buffer = _buffer(current, meta.size if placed is None else placed[2], meta.properties.dtype)
            reads[key] = buffer if placed is None else Chunked(buffer, tuple(placed[0]), placed[1])
    return where, reads


def _buffer(current: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Where to read an optimizer state tensor: the optimizer's own one when it fits (no new memory;
    load_state_dict then keeps it as it is), else a new CPU tensor (load_state_dict casts and moves it)."""
    if isinstance(current, torch.Tensor) and tuple(current.shape) == tuple(shape) and current.dtype == dtype:
        return current.detach()
    return torch.zeros(shape, dtype=dtype)  # zeros: a padded vocabulary's rows are in no chunk, never read


def check_groups(what: str, names: list[list[str]], saved: list[dict]) -> None:
    """ValueError unless the optimizer's param_groups hold the same parameters as the checkpoint's."""
    if len(saved) != len(names):
        raise ValueError(f"optimizer: has {len(names)} param_groups, {what} has {len(saved)}; build it as it was")
    for g, (mine, theirs) in enumerate(zip(names, saved)):
        lacking = [n for n in theirs["params"] if n not in mine]
        surplus = [n for n in mine if n not in theirs["params"]]
        if lacking or surplus:
            raise ValueError(
                f"optimizer: param_groups[{g}] does not hold the parameters {what} has there: "
                f"missing {lacking}, not in the checkpoint {surplus}; build it as it was"
            )


def restore_optimizer(
    view: OptimizerView, slots: dict[str, tuple[int, str]], values: dict[str, Any], saved_groups: list[dict]
) -> None:
    """optimizer.load_state_dict of what was read, keyed by the optimizer's own indices; ZeRO: the
    fp32 masters the checkpoint lacks are refilled from the (loaded) parameters."""
    state: dict[int, dict[str, Any]] = {}
    read_masters = set()
    for key, (i, name) in slots.items():
        if name is None:  # a master, read in place
            read_masters.add(i)
            continue
        value = values[key]
        state.setdefault(i, {})[name] = value.local if isinstance(value, Chunked) else value  # [shard] | as saved
    index = {name: i for i, name in enumerate(view.flat_names())}
    groups = [dict(saved, params=[index[n] for n in mine]) for saved, mine in zip(saved_groups, view.names)]
    view.inner.load_state_dict({"state": state, "param_groups": groups})
    if view.resync is not None:
        view.resync([p for i, p in enumerate(view.params) if i not in read_masters])
