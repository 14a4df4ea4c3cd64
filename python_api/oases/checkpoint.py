"""Checkpoints of tensor-parallel models in the unsharded model's own layout, loadable at any TP degree.

    full = full_state_dict(tp_model)        # on every rank: what model.state_dict() of the unsharded model is
    plain_model.load_state_dict(full)       # TP=1 ...
    load_full_state_dict(tp4_model, full)   # ... or any TP degree: each rank keeps its shard
    save_checkpoint(tp_model, path)         # the same, through torch.distributed.checkpoint on disk
    load_checkpoint(tp4_model, path)

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

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import ShardRule
from oases.comm._topology import ring_of

__all__ = ["full_state_dict", "load_full_state_dict", "save_checkpoint", "load_checkpoint"]


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
        shape = list(self.local.shape)
        shape[self.rule.dim] *= self.size
        return torch.Size(shape)


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


def save_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                    group: Optional[dist.ProcessGroup] = None) -> None:
    """Write `model`'s unsharded state dict to the directory `path` with torch.distributed.checkpoint.

        dcp.save(full_state_dict(model), checkpoint_id=path, process_group=group)

    A collective: every rank of `group` (default: the world) calls it, and each holds a replica
    of the same model (at any TP degree, over TP groups inside `group`), so DCP, which treats
    plain tensors as replicated, writes each entry once, spread over the ranks' files. `path`
    must be a directory every rank of `group` sees (a shared filesystem), as for `load_checkpoint`.

    Why DCP rather than torch.save from one rank: on gloo/CPU it works collectively, on the world
    and on a subgroup, its format is the one the rest of PyTorch reads (`dcp_to_torch_save`
    converts it), and its metadata gives every key's shape before any data is read, so
    `load_checkpoint` checks a checkpoint against the model before any communication. The price:
    entries are gathered to full size on every rank first (each rank's own shard, as a DTensor,
    would avoid that, but Oases parameters are plain tensors and stacked shards are not slices).
    """
    import torch.distributed.checkpoint as dcp  # ~0.7 s to import: only when checkpointing

    ring_of(group)  # initialized, and a member
    dcp.save(full_state_dict(model), checkpoint_id=path, process_group=group)


def load_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True,
                    group: Optional[dist.ProcessGroup] = None) -> tuple[list[str], list[str]]:
    """Load a `save_checkpoint` directory into `model` at its own TP degree (any), or an unsharded one.

        shapes = the checkpoint's metadata {key: shape}                      # read locally
        check shapes against the unsharded model as load_full_state_dict does   # ValueError
        full = {key: empty(shape)}; dcp.load(full, checkpoint_id=path, process_group=group)
        return load_full_state_dict(model, full, strict=strict)

    A collective over `group` (default: the world), like `save_checkpoint`; every rank reads the
    whole checkpoint and keeps its shard. Tensors are read in the checkpoint's dtype and cast to
    the model's on copy, as load_state_dict does. With strict=False, keys of the checkpoint that
    the model lacks are not read (nor listed in the result's unexpected_keys).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ring_of(group)
    _, shards, expected = _layout(model)
    what = f"checkpoint {os.fspath(path)!r}"
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # {key: metadata}
    non_tensors = [key for key in expected if key in stored and not isinstance(stored[key], TensorStorageMetadata)]
    if non_tensors:
        raise ValueError(f"{what}: {', '.join(non_tensors)} are not tensors there")
    _check(what, expected, {key: getattr(meta, "size", ()) for key, meta in stored.items()}, shards, strict)
    full = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
            for key in expected if key in stored}
    dcp.load(full, checkpoint_id=path, process_group=group)
    return load_full_state_dict(model, full, strict=strict)
