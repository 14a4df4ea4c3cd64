"""The unsharded model's state dict from its TP shards and back: the sharded entries a model's
`tp_layout()` modules list (`shards_of`, `layout_of`), the checks against the unsharded model
(`check_fit`), `full_state_dict` and `load_full_state_dict` (oases.storage's module doc)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._compiled import original_module
from oases._sharding import ShardRule
from oases.comm.topology import ring_of

__all__ = [
    "Shard",
    "shards_of",
    "layout_of",
    "unsharded_shapes",
    "allocated",
    "check_fit",
    "full_state_dict",
    "load_full_state_dict",
]


@dataclass(frozen=True)
class Shard:
    """One state-dict entry held as TP shards: `local` is rank `rank`'s of `size` parts."""

    local: torch.Tensor
    rule: ShardRule
    group: Optional[dist.ProcessGroup]
    rank: int
    size: int

    @property
    def full_shape(self) -> torch.Size:
        """The unsharded tensor's shape."""
        return self.rule.full_shape(self.local.shape, self.size)


def shards_of(model: nn.Module) -> dict[str, Shard]:
    """{state-dict key: Shard} for every parameter a `tp_layout()` lists; local checks only."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    found: dict[str, Shard] = {}
    # remove_duplicate=False: a module reachable under two names has a state-dict key under each.
    for prefix, module in model.named_modules(remove_duplicate=False):
        layout = getattr(module, "tp_layout", None)
        if not callable(layout):
            continue
        where = prefix or type(model).__name__
        if not hasattr(module, "group"):
            raise TypeError(
                f"{where}: {type(module).__name__} has tp_layout() but no `group` attribute "
                f"(its process group, None for the world)"
            )
        ring = ring_of(module.group)
        for name, rule in layout().items():
            local = module
            for part in name.split("."):  # a dotted name reaches into a child ("qkv.weight")
                local = getattr(local, part, None)
            if not isinstance(rule, ShardRule) or not isinstance(local, torch.Tensor):
                raise TypeError(
                    f"{where}: tp_layout() must map tensor attribute names to ShardRule, "
                    f"got {name!r}: {rule!r} (attribute: {type(local).__name__})"
                )
            if not 0 <= rule.dim < local.dim():
                raise ValueError(
                    f"{where}.{name}: ShardRule dim={rule.dim} is out of range for a "
                    f"{local.dim()}-d shard of shape {tuple(local.shape)}"
                )
            key = f"{prefix}.{name}" if prefix else name
            found[key] = Shard(local, rule, module.group, ring.rank, ring.size)
    return found


def layout_of(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Shard], dict[str, torch.Size]]:
    """(this rank's state dict, its sharded entries, {key: shape} of the unsharded model's state dict)."""
    shards = shards_of(model)
    local = model.state_dict()
    stray = [key for key in shards if key not in local]
    if stray:
        raise ValueError(f"tp_layout() lists {', '.join(stray)}, which model.state_dict() does not hold")
    expected = {key: shards[key].full_shape if key in shards else value.shape for key, value in local.items()}
    return local, shards, expected


def unsharded_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """{state-dict key: shape} of the unsharded model's state dict (a sharded entry's full shape)."""
    return layout_of(model)[2]


def allocated(model: nn.Module) -> nn.Module:
    """`model` (torch.compile's original), or a ValueError when every tensor of it is on the meta
    device: nothing could be read into it or out of it (a pipeline stage holds some: not all)."""
    model = original_module(model)
    tensors = list(model.parameters()) + list(model.buffers())
    if tensors and all(t.is_meta for t in tensors):
        raise ValueError(
            "model: every tensor is on the meta device (built under torch.device('meta'), never allocated), so "
            "nothing can be read into it or out of it; allocate this rank's shards first: "
            "oases.parallelize(model, device=..., init_weights=False)"
        )
    return model


def check_fit(
    what: str,
    expected: Mapping[str, torch.Size],
    given: Mapping[str, torch.Size],
    shards: dict[str, Shard],
    strict: bool,
) -> None:
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

    Args:
        model: the model, plain or tensor-parallel.

    Returns:
        {key: full tensor}, the unsharded model's state dict.
    """
    local, shards, _ = layout_of(allocated(model))  # every check before the first collective
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


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> tuple[list[str], list[str]]:
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

    Args:
        model: the model to fill, plain or tensor-parallel at any TP degree.
        state_dict: the unsharded model's state dict (e.g. from `full_state_dict`), the whole of it on every rank.
        strict: if False, missing and unexpected keys are allowed (and listed in the result).

    Returns:
        (missing_keys, unexpected_keys), as nn.Module.load_state_dict's named tuple.

    Raises:
        ValueError: missing or unexpected keys (if strict) or a shape mismatch, before anything is copied.
        TypeError: `state_dict` is not a mapping of names to tensors.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    bad = [key for key, value in state_dict.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise TypeError(f"state_dict: values must be tensors; not so for {', '.join(map(str, bad))}")
    model = allocated(model)  # torch.compile(model): the original's keys
    _, shards, expected = layout_of(model)
    check_fit("state_dict", expected, {key: value.shape for key, value in state_dict.items()}, shards, strict)
    local = {}
    for key, value in state_dict.items():
        s = shards.get(key)
        local[key] = value if s is None else s.rule.shard(value, s.rank, s.size)  # a view
    return model.load_state_dict(local, strict=strict)
