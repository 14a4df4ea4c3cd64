"""Checkpoints of tensor-parallel models in the unsharded model's own layout, loadable at any TP degree.

    full = full_state_dict(tp_model)        # on every rank: what model.state_dict() of the unsharded model is
    plain_model.load_state_dict(full)       # TP=1 ...
    load_full_state_dict(tp4_model, full)   # ... or any TP degree: each rank keeps its shard
    save_checkpoint(tp_model, path, optimizer=opt, step=n, extra=..., keep=3)   # -> path/step-{n:09d}
    state = load_checkpoint(tp4_model, path, optimizer=opt4)   # the newest complete step-*; resume at state.step

On disk (torch.distributed.checkpoint) no rank gathers the model: each writes the boxes of the
unsharded tensors its shards hold (oases._dcp), and reads those it needs at its own TP degree.

Sharded modules are found by contract, never by type: a submodule with a `tp_layout()` method
({param_name: ShardRule}, see oases._sharding) and a `group` attribute (its process group, None
for the world) holds, for each parameter its layout lists, this rank's part of the full tensor:

    local == rule.shard(full, dist.get_rank(group), dist.get_world_size(group))
    full  == rule.unshard([local of rank 0, ..., local of rank p-1])

Everything else in the state dict (replicated parameters, buffers) is the same on every rank and
is taken as it is. Every check runs on local metadata before any communication or any copy, so a
bad model or checkpoint raises the same error on every rank, none is left waiting, and the model
is left unchanged.
"""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases._sharding import ShardRule, rows_of, whole
from oases.comm._topology import ring_of

if TYPE_CHECKING:
    from oases._dcp import Chunked

__all__ = ["full_state_dict", "load_full_state_dict", "save_checkpoint", "load_checkpoint", "CheckpointState"]


@dataclass(frozen=True)
class _Shard:
    """One state-dict entry held as TP shards: `local` is rank `rank`'s of `size` parts."""

    local: torch.Tensor
    rule: ShardRule
    group: Optional[dist.ProcessGroup]
    rank: int
    size: int

    @property
    def full_shape(self) -> torch.Size:
        return self.rule.full_shape(self.local.shape, self.size)


def _shards(model: nn.Module) -> dict[str, _Shard]:
    """{state-dict key: _Shard} for every parameter a `tp_layout()` lists; local checks only."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    found: dict[str, _Shard] = {}
    # remove_duplicate=False: a module reachable under two names has a state-dict key under each.
    for prefix, module in model.named_modules(remove_duplicate=False):
        layout = getattr(module, "tp_layout", None)
        if not callable(layout):
            continue
        where = prefix or type(model).__name__
        if not hasattr(module, "group"):
            raise TypeError(f"{where}: {type(module).__name__} has tp_layout() but no `group` attribute "
                            f"(its process group, None for the world)")
        ring = ring_of(module.group)
        for name, rule in layout().items():
            local = module
            for part in name.split("."):  # a dotted name reaches into a child ("qkv.weight")
                local = getattr(local, part, None)
            if not isinstance(rule, ShardRule) or not isinstance(local, torch.Tensor):
                raise TypeError(f"{where}: tp_layout() must map tensor attribute names to ShardRule, "
                                f"got {name!r}: {rule!r} (attribute: {type(local).__name__})")
            if not 0 <= rule.dim < local.dim():
                raise ValueError(f"{where}.{name}: ShardRule dim={rule.dim} is out of range for a "
                                 f"{local.dim()}-d shard of shape {tuple(local.shape)}")
            key = f"{prefix}.{name}" if prefix else name
            found[key] = _Shard(local, rule, module.group, ring.rank, ring.size)
    return found


def _layout(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, _Shard], dict[str, torch.Size]]:
    """(this rank's state dict, its sharded entries, {key: shape} of the unsharded model's state dict)."""
    shards = _shards(model)
    local = model.state_dict()
    stray = [key for key in shards if key not in local]
    if stray:
        raise ValueError(f"tp_layout() lists {', '.join(stray)}, which model.state_dict() does not hold")
    expected = {key: shards[key].full_shape if key in shards else value.shape for key, value in local.items()}
    return local, shards, expected


def _check(what: str, expected: Mapping[str, torch.Size], given: Mapping[str, torch.Size],
           shards: dict[str, _Shard], strict: bool) -> None:
    """Raise one ValueError listing every missing/unexpected key (if strict) and shape mismatch."""
    problems = []
    if strict:
        missing = [key for key in expected if key not in given]
        unexpected = [key for key in given if key not in expected]
        if missing:
            problems.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {', '.join(unexpected)}")
    source = what.split()[0]  # "state_dict" or "checkpoint"
    for key, shape in expected.items():  # in the model's order
        if key in given and tuple(given[key]) != tuple(shape):
            held = ""
            if key in shards:
                s = shards[key]
                held = f" (unsharded; this rank holds {tuple(s.local.shape)} of it at TP={s.size})"
            problems.append(f"{key}: {source} has shape {tuple(given[key])}, the model expects {tuple(shape)}{held}")
    if problems:
        raise ValueError(f"{what} does not fit the model; nothing was loaded:\n  " + "\n  ".join(problems))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict, on every rank (a collective over each sharded module's group).

        for key, value in model.state_dict().items():
            sharded (listed by its module's tp_layout()):
                full[key] = rule.unshard(all_gather(value, module.group))   # full shape
            else (replicated parameter, buffer):
                full[key] = value.clone()

    Every rank of every sharded module's group must call it (same model, same order). The result
    has the unsharded model's keys, shapes, dtypes and devices, and is a snapshot: every tensor is
    a fresh copy that later training does not change. Ready for `load_state_dict` of the plain
    model, `load_full_state_dict` at any TP degree, or `torch.save`.
    """
    local, shards, _ = _layout(model)  # every check before the first collective
    gathered: dict[int, torch.Tensor] = {}  # tied parameters are gathered once
    full: dict[str, torch.Tensor] = {}
    for key, value in local.items():
        s = shards.get(key)
        if s is None:
            full[key] = value.detach().clone()
            continue
        if id(s.local) not in gathered:
            shard = s.local.detach()
            parts = [torch.empty_like(shard) for _ in range(s.size)]  # rank order, equal shapes
            if s.size == 1:
                parts[0].copy_(shard)
            else:
                dist.all_gather(parts, shard.contiguous(), group=s.group)
            gathered[id(s.local)] = s.rule.unshard(parts)  # [full_shape]
        full[key] = gathered[id(s.local)]
    return full


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *,
                         strict: bool = True) -> tuple[list[str], list[str]]:
    """Load an unsharded state dict into `model` at its TP degree; return load_state_dict's result.

    ::

        check keys (if strict) and every shape against the unsharded model   # ValueError, nothing copied
        for key, full in state_dict.items():
            sharded:    param.copy_(rule.shard(full, rank, p))    # rank, p of the module's group
            otherwise:  param.copy_(full)                         # replicated, buffers

    No communication: each rank cuts its own shard, so every rank needs the whole state dict.
    Returns nn.Module.load_state_dict's (missing_keys, unexpected_keys) named tuple: with
    strict=False missing keys are left as they are and unexpected ones ignored, and listed there;
    shapes are checked regardless.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    bad = [key for key, value in state_dict.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise TypeError(f"state_dict: values must be tensors; not so for {', '.join(map(str, bad))}")
    _, shards, expected = _layout(model)
    _check("state_dict", expected, {key: value.shape for key, value in state_dict.items()}, shards, strict)
    local = {}
    for key, value in state_dict.items():
        s = shards.get(key)
        local[key] = value if s is None else s.rule.shard(value, s.rank, s.size)  # a view
    return model.load_state_dict(local, strict=strict)


# --- on-disk checkpoints: each rank writes and reads its own shards -----------------------------------

_MODEL = "model."  # model.<state-dict key>: the unsharded model's tensor
_STATE = "optim.state."  # optim.state.<parameter name>.<state name>, e.g. optim.state.lm_head.weight.exp_avg
_MASTER = "optim.master."  # optim.master.<parameter name>: ZeRO's fp32 master of a 16-bit parameter
_GROUPS = "optim.param_groups"  # the optimizer's param_groups, params as parameter names
_EXTRA = "oases.extra"
_RNG = "oases.rng."  # oases.rng.<rank in the group>: that rank's RNG states


@dataclass(frozen=True)
class CheckpointState:
    """What `load_checkpoint` restored besides tensors, and which model keys did not match.

    ::

        step, extra:      what save_checkpoint was given (None for a checkpoint of older Oases)
        path:             the checkpoint directory loaded (a root resolves to its newest step-*)
        missing_keys:     model keys the checkpoint lacks, left as they were (strict=False only)
        unexpected_keys:  checkpoint keys the model lacks, not read (strict=False only)
    """

    step: Optional[int]
    extra: Any
    path: str
    missing_keys: list[str]
    unexpected_keys: list[str]


def _sharded(value: torch.Tensor, s: _Shard) -> "Chunked":
    """`value` (shaped like the shard s.local) as its boxes of the unsharded tensor."""
    from oases._dcp import Chunked

    return Chunked(value.detach(), tuple(s.rule.chunks(s.full_shape, s.rank, s.size)), s.full_shape)


def _count(name: str, value: object, least: int) -> None:
    if not _checks.is_int(value):
        raise TypeError(f"{name}: expected an int >= {least} or None, got {value!r}")
    if value < least:
        raise ValueError(f"{name}: must be >= {least}, got {value}")


@dataclass(frozen=True)
class _OptimizerView:
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
        return [name for group in self.names for name in group]


def _optimizer_view(model: nn.Module, optimizer: object) -> _OptimizerView:
    """The checkpoint view of a torch.optim optimizer over the model's parameters, or of an
    oases.dp.ZeroOptimizer (its inner optimizer over this dp rank's rows); local checks only."""
    names: dict[int, str] = {id(p): name for name, p in model.named_parameters()}
    zero = callable(getattr(optimizer, "master_of", None)) and isinstance(getattr(optimizer, "inner", None),
                                                                           torch.optim.Optimizer)
    if not zero and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or an oases.dp.ZeroOptimizer, got "
                        f"{type(optimizer).__name__}")
    inner = optimizer.inner if zero else optimizer
    stand_for = {}  # id(inner parameter) -> (model parameter, rows, master with storage of its own)
    if zero:
        for p in optimizer.params:
            master, start, stop = optimizer.master_of(p)
            if p.dim() == 0:
                raise ValueError(f"optimizer: {names.get(id(p), 'a parameter')} is 0-d; ZeroOptimizer checkpoints "
                                 f"need parameters with at least one dimension")
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
        raise ValueError(f"optimizer: {', '.join(strangers)} is not a parameter of the model (optimizer state is "
                         f"stored by model.named_parameters() name); build the optimizer from model.parameters()")
    resync = getattr(optimizer, "sync_masters", None) if zero else None
    return _OptimizerView(inner, groups, params, rows, masters, resync)


def _state_chunks(view: _OptimizerView, index: int, shape: tuple[int, ...], shards: dict[str, _Shard],
                  name: str) -> Optional[tuple[list, torch.Size, tuple[int, ...]]]:
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


def _optimizer_entries(view: _OptimizerView, shards: dict[str, _Shard]) -> dict:
    """The optimizer's state keyed by parameter name: parameter-shaped tensors as their boxes of
    the full parameter (TP shards, ZeRO rows), the rest as they are."""
    from oases._dcp import Chunked

    names = view.flat_names()  # [optimizer index]
    saved = view.inner.state_dict()  # {"state": {index: {name: value}}, "param_groups": [{..., "params": [index]}]}
    entries: dict[str, Any] = {_GROUPS: [dict(group, params=[names[i] for i in group["params"]])
                                         for group in saved["param_groups"]]}
    for index, state in saved["state"].items():
        p, piece = view.params[index], view.rows[index]
        for name, value in state.items():
            if "." in name:
                raise ValueError(f"optimizer: state name {name!r} has a '.', which checkpoint keys use as separator")
            if isinstance(value, torch.Tensor):  # exp_avg [shard] is sharded like its parameter; step [] replicated
                local = tuple(p.shape) if piece is None else (piece[1] - piece[0], *p.shape[1:])
                full = shards[names[index]].full_shape if names[index] in shards else p.shape
                placed = _state_chunks(view, index, full, shards, names[index]) if tuple(value.shape) == local else None
                value = value.detach() if placed is None else Chunked(value.detach(), tuple(placed[0]), placed[1])
            entries[f"{_STATE}{names[index]}.{name}"] = value
    for index, master in enumerate(view.masters):  # ZeRO's fp32 masters of 16-bit parameters: their rows
        if master is not None:
            full = shards[names[index]].full_shape if names[index] in shards else view.params[index].shape
            placed = _state_chunks(view, index, full, shards, names[index])
            entries[f"{_MASTER}{names[index]}"] = Chunked(master.detach(), tuple(placed[0]), placed[1])
    return entries


def _save_target(path: Union[str, os.PathLike], step: object, keep: object, extra: object) -> str:
    """Where a checkpoint of `step` under `path` is published, after the local checks of the
    arguments every saver shares (step, keep, extra picklable)."""
    from oases import _dcp

    if step is not None:
        _count("step", step, 0)
    if keep is not None:
        _count("keep", keep, 1)
        if step is None:
            raise ValueError("keep: rotation needs step= (it keeps the newest path/step-* checkpoints)")
    try:
        torch.save(extra, io.BytesIO())
    except Exception as e:
        raise TypeError(f"extra: cannot be pickled ({type(e).__name__}: {e}); pass plain data") from e
    root = os.path.normpath(os.fspath(path))
    return root if step is None else _dcp.step_dir(root, step)


def _run_entries(extra: Any, rank: int) -> dict[str, Any]:
    """The entries of a checkpoint besides model and optimizer: the format, `extra`, this rank's RNG."""
    from oases import _dcp

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {_dcp.FORMAT_KEY: _dcp.FORMAT_VERSION, _EXTRA: extra,
            f"{_RNG}{rank}": {"cpu": torch.get_rng_state(), "cuda": cuda}}


def save_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                    optimizer: Optional[torch.optim.Optimizer] = None, step: Optional[int] = None,
                    extra: Any = None, keep: Optional[int] = None,
                    group: Optional[dist.ProcessGroup] = None) -> str:
    """Write model (and optimizer) state, step, `extra` and RNG states; return the directory published.

    ::

        where = path if step is None else path/step-{step:09d}
        dcp.save({"model.<key>": each rank's shards as boxes of the unsharded tensor | replicated tensor,
                  "optim.state.<param name>.<state>": likewise (shard-shaped state is sharded),
                  "optim.master.<param name>": a ZeroOptimizer's fp32 masters of 16-bit parameters (rows),
                  "optim.param_groups": param_groups with parameter names,
                  "oases.extra": extra, "oases.rng.<rank>": this rank's RNG states}, .<where>.partial)
        rank 0: write oases_checkpoint.json (format, world size, step), rename to `where`
        keep=N: delete all but the N newest (highest step) complete path/step-*, never `where`, and stale partials

    A collective over `group` (default: the world; ranks holding replicas of the model, at any TP
    degrees inside it): no rank gathers the model; each writes its own shards, a replicated entry
    or a shard held by several replicas is written once. The stored tensors have the unsharded
    model's shapes, so `load_checkpoint` reads them at any TP degree. `path` must be a directory
    every rank sees; saving replaces a checkpoint already at `where`, never other files.

    Args:
        optimizer: any torch.optim optimizer over the model's parameters.
        step: the training step (an int >= 0) or None.
        extra: anything picklable (e.g. {"data": position}), returned by load_checkpoint; one value
            is stored (the same on every rank: a per-rank position belongs in a list indexed by rank).
        keep: with step, the number of newest step-* checkpoints to keep (>= 1).
    Returns:
        The published checkpoint directory.
    """
    from oases import _dcp

    ring = ring_of(group)
    where = _save_target(path, step, keep, extra)
    _, shards, _ = _layout(model)
    entries: dict[str, Any] = {_MODEL + key: _sharded(value, shards[key]) if key in shards else value
                               for key, value in model.state_dict().items()}
    if optimizer is not None:
        entries.update(_optimizer_entries(_optimizer_view(model, optimizer), shards))
    entries.update(_run_entries(extra, ring.rank))
    _dcp.check_target(where)  # every check above and here is local: no rank is left waiting
    marker = {"format": _dcp.FORMAT_VERSION, "world_size": ring.size, "step": step, "optimizer": optimizer is not None}
    _dcp.save(entries, where, ring, marker, keep)
    return where


def _optimizer_reads(what: str, view: _OptimizerView, stored: dict,
                     shards: dict[str, _Shard]) -> tuple[dict[str, tuple[int, str]], dict[str, Any]]:
    """({checkpoint key: (optimizer index, state name | None for ZeRO's fp32 master)}, {key: buffer to
    read into | None for pickled}); local checks only. A master is read straight into the optimizer's."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from oases._dcp import Chunked

    if _GROUPS not in stored:
        raise ValueError(f"optimizer: {what} holds no optimizer state (saved without optimizer=); "
                         f"load it with optimizer=None")
    index = {name: i for i, name in enumerate(view.flat_names())}
    params = [p for group in view.inner.param_groups for p in group["params"]]
    where, reads = {}, {}
    for key, meta in stored.items():
        if key.startswith(_MASTER) and key[len(_MASTER):] in index and isinstance(meta, TensorStorageMetadata):
            i = index[key[len(_MASTER):]]
            placed = _state_chunks(view, i, tuple(meta.size), shards, key[len(_MASTER):])
            if view.masters and view.masters[i] is not None and placed is not None:
                where[key] = (i, None)
                reads[key] = Chunked(view.masters[i].detach(), tuple(placed[0]), placed[1])
            continue
        if not key.startswith(_STATE):
            continue
        name, state = key[len(_STATE):].rsplit(".", 1)
        if name not in index:
            continue  # a parameter the optimizer lacks: the param_groups check names it
        i = index[name]
        where[key] = (i, state)
        if not isinstance(meta, TensorStorageMetadata):
            reads[key] = None  # pickled: read locally first
            continue
        placed = _state_chunks(view, i, tuple(meta.size), shards, name)
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


def _check_groups(what: str, names: list[list[str]], saved: list[dict]) -> None:
    """ValueError unless the optimizer's param_groups hold the same parameters as the checkpoint's."""
    if len(saved) != len(names):
        raise ValueError(f"optimizer: has {len(names)} param_groups, {what} has {len(saved)}; build it as it was")
    for g, (mine, theirs) in enumerate(zip(names, saved)):
        lacking = [n for n in theirs["params"] if n not in mine]
        surplus = [n for n in mine if n not in theirs["params"]]
        if lacking or surplus:
            raise ValueError(f"optimizer: param_groups[{g}] does not hold the parameters {what} has there: "
                             f"missing {lacking}, not in the checkpoint {surplus}; build it as it was")


def _open(path: Union[str, os.PathLike]) -> tuple[str, dict, Optional[dict]]:
    """(the checkpoint directory `path` names, its DCP metadata {key: metadata}, its marker or None)."""
    from oases import _dcp

    where = _dcp.find(os.path.normpath(os.fspath(path)))
    stored = _dcp.read_metadata(where).state_dict_metadata
    marker = _dcp.read_marker(where)
    if _dcp.FORMAT_KEY in stored and marker is None:
        raise ValueError(f"path: checkpoint {where!r} is incomplete (no {_dcp.MARKER}: its writer died before "
                         f"publishing it); load an earlier one, or the root directory to pick the newest complete one")
    return where, stored, marker


def _rng_key(what: str, stored: dict, marker: dict, size: int, rank: int) -> Optional[str]:
    """This rank's RNG entry if the checkpoint was saved by a group of `size` ranks, else None (a warning)."""
    if marker.get("world_size") == size and f"{_RNG}{rank}" in stored:
        return f"{_RNG}{rank}"
    warnings.warn(f"load_checkpoint: {what} was saved by {marker.get('world_size')} ranks, this group has {size}: "
                  f"RNG states not restored")
    return None


def _set_rng(what: str, saved: dict) -> None:
    torch.set_rng_state(saved["cpu"])
    if saved["cuda"] is None:
        return
    if torch.cuda.is_available() and len(saved["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved["cuda"])
    else:
        warnings.warn(f"load_checkpoint: {what} holds the RNG states of {len(saved['cuda'])} GPUs, this rank sees "
                      f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: CUDA RNG not restored")


def _restore_optimizer(view: _OptimizerView, slots: dict[str, tuple[int, str]], values: dict[str, Any],
                       saved_groups: list[dict]) -> None:
    """optimizer.load_state_dict of what was read, keyed by the optimizer's own indices; ZeRO: the
    fp32 masters the checkpoint lacks are refilled from the (loaded) parameters."""
    from oases._dcp import Chunked

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


def load_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                    optimizer: Optional[torch.optim.Optimizer] = None, strict: bool = True,
                    group: Optional[dist.ProcessGroup] = None) -> CheckpointState:
    """Load a `save_checkpoint` directory (or the newest complete step-* under a root) at any TP degree.

        where = path if path holds a checkpoint else newest complete path/step-*
        check the checkpoint against the model (keys if strict, shapes) and the optimizer   # local only
        dcp.load: each rank reads the boxes of its own shards, straight into the model's tensors
        optimizer.load_state_dict(the saved state, re-sharded to this layout, keyed by its indices)
        ZeroOptimizer: fp32 masters read as its rows (those not saved: refilled from the parameters)
        restore this rank's RNG states if the group has as many ranks as the one that saved
        return CheckpointState(step, extra, where, missing_keys, unexpected_keys)

    A collective over `group` (default: the world), like `save_checkpoint`. Every check runs on
    local metadata before any communication, so a bad model, optimizer or checkpoint raises the
    same error on every rank and changes nothing. Tensors are cast to the model's dtype on copy;
    the optimizer's state follows torch's load_state_dict rules (cast, moved to its parameter's
    device), its hyper-parameters (lr, ...) are the checkpoint's. Checkpoints of older Oases (the
    unsharded model's state dict at the top level) load too, without optimizer.

    Args:
        optimizer: an optimizer over the model's parameters, grouped as the saved one was.
        strict: if False, keys on one side only are skipped and listed in the result.
    Returns:
        CheckpointState(step, extra, path, missing_keys, unexpected_keys).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from oases import _dcp

    ring = ring_of(group)
    _, shards, expected = _layout(model)
    view = _optimizer_view(model, optimizer) if optimizer is not None else None
    where, stored, marker = _open(path)
    what = f"checkpoint {where!r}"
    ours = _dcp.FORMAT_KEY in stored  # else one of older Oases: the model's keys at the top level, nothing else
    held = {key[len(_MODEL):]: meta for key, meta in stored.items() if key.startswith(_MODEL)} if ours else stored
    non_tensors = [key for key in expected if key in held and not isinstance(held[key], TensorStorageMetadata)]
    if non_tensors:
        raise ValueError(f"{what}: {', '.join(non_tensors)} are not tensors there")
    _check(what, expected, {key: getattr(meta, "size", ()) for key, meta in held.items()}, shards, strict)
    small: dict[str, Any] = {}  # pickled entries, read by this rank alone before any collective
    rng = None
    if ours:
        small[_EXTRA] = None
        rng = _rng_key(what, stored, marker, ring.size, ring.rank)
        if rng is not None:
            small[rng] = None
    if optimizer is not None:
        if not ours:
            raise ValueError(f"optimizer: {what} was written by an older oases.save_checkpoint and holds no "
                             f"optimizer state; load it with optimizer=None")
        slots, reads = _optimizer_reads(what, view, stored, shards)
        small.update({key: None for key, value in reads.items() if value is None})
        small[_GROUPS] = None
    if small:
        _dcp.read_local(small, where)
    if optimizer is not None:
        _check_groups(what, view.names, small[_GROUPS])

    local = model.state_dict()  # detached views of the model's own tensors: reads land in them
    prefix = _MODEL if ours else ""
    entries: dict[str, Any] = {prefix + key: _sharded(local[key], shards[key]) if key in shards else local[key]
                               for key in expected if key in held}
    if optimizer is not None:
        entries.update({key: value for key, value in reads.items() if value is not None})
    _dcp.load(entries, where, ring)  # the one collective
    if optimizer is not None:
        values = {key: small[key] if value is None else value for key, value in reads.items()}
        _restore_optimizer(view, slots, values, small[_GROUPS])  # ZeroOptimizer: and its fp32 masters
    if rng is not None:
        _set_rng(what, small[rng])
    return CheckpointState(step=marker["step"] if ours else None, extra=small.get(_EXTRA), path=where,
                           missing_keys=[key for key in expected if key not in held],
                           unexpected_keys=[key for key in held if key not in expected])
