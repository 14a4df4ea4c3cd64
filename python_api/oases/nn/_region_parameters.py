"""Parameters parallelize leaves whole inside a dense TP region, placed by where their gradient comes from.

A dense region is a module whose column-parallel children produce this rank's shard of its inner
features and whose row-parallel child reduces them: an MLP (gate / up / down, fc1 / fc2), or a
decoder layer holding fc1 / fc2 itself (OPT). Attention modules (oases.nn._heads) and MoE blocks
(oases.nn._moe) have their own rules. A parameter of the region outside its projections (and
outside any attention or TP module in it) sees either the whole features (a norm over the hidden
width, on the region's input) or this rank's shard of the inner features (an activation between
the column and the row layers). Each one is placed by rule, before anything is changed:

    kind           which parameter                                  what parallelize does
    "full"         a norm child's, over the hidden width H          nothing: its gradient is whole already
    "per_feature"  one dim of size I, the inner width (I != H):     sharded with the features along that dim
                   a learned per-channel scale, gate or bias        (ShardRule(dim): rank r's I/p entries; the
                   (the region's own or a child's)                  owner module's tp_layout() says so)
    "summed"       any other parameter of a child that is not a     gradient all-reduced over the group as it
                   norm or projection (a learned activation's       is computed: each rank saw its I/p features
                   scalars: Apertus' xIELU alpha_p / alpha_n), but
                   one with a hidden-width dim (whole features: left)
    "whole"        the region's own other parameters: its forward   nothing: in model(...) they see whole
                   applies them to its input or to the reduced      features; oases.train_step refuses a scale
                   output (a learned output scale)                  on the row's output (models._branch); one
                                                                    applied to the shards is caught by
                                                                    oases.check_gradients
    refused        a norm child over the inner width, a per-feature ValueError naming the parameter and the fix,
                   size that is also H, several inner-width dims    before anything is changed

The rule holds in both of the model's paths: model(...) (the row layer reduces inside the region)
and oases.train_step's sublayer core (the schedule reduces after it), since a child between the
column and the row layers sees the shard in both. What no rule can see (a hook that scales a shard
with a parameter held elsewhere) is caught by oases.check_gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import ShardRule
from oases.comm.topology import ring_of
from oases.nn import mappings
from oases.nn._styles import Style, features
from oases.nn.parts import is_norm

__all__ = ["Placement", "place_region_parameters", "apply_region_parameters"]


@dataclass(frozen=True)
class Placement:
    """Where a whole parameter of a dense region goes: `kind` "per_feature" (sharded along `dim`) or
    "summed" (its gradient all-reduced over the region's group); `region` names the region."""

    kind: str
    region: str
    dim: int = 0


def _regions(placed: dict[str, Style], attention: dict[str, nn.Module], experts: dict[str, Style]) -> dict[str, list]:
    """{dense region: its column projections' names}: parents of column projections that are not
    attention modules nor inside an MoE block."""
    blocks = [name.rpartition(".")[0] for name in experts]
    found: dict[str, list] = {}
    for name, style in placed.items():
        parent = name.rpartition(".")[0]
        if style.kind != "column" or parent in attention:
            continue
        if any(parent == b or parent.startswith(b + ".") for b in blocks if b):
            continue
        found.setdefault(parent, []).append(name)
    return found


def _inner_widths(columns: list[str], placed: dict[str, Style], linears: dict[str, nn.Module]) -> set[int]:
    """The full widths of the inner features the region's column projections produce (a fused
    gate | up: each block's)."""
    widths = set()
    for name in columns:
        out = features(linears[name])[1]
        style = placed[name]
        widths.update(style.parts or (out // max(style.stacked, 1),))
    return widths


def place_region_parameters(
    model: nn.Module,
    placed: dict[str, Style],
    linears: dict[str, nn.Module],
    attention: dict[str, nn.Module],
    experts: dict[str, Style],
    degree: Callable[[str], int],
    p: int,
) -> dict[str, Placement]:
    """{qualified parameter name: Placement} for the whole parameters of the model's dense regions
    that are not "full" (module doc); a ValueError naming a refused one. Changes nothing."""
    out: dict[str, Placement] = {}
    for region_name, columns in _regions(placed, attention, experts).items():
        if degree(region_name or columns[0]) == 1 < p:
            continue  # a decoder layer of degree 1 stays unsharded
        region = model.get_submodule(region_name) if region_name else model
        inner = _inner_widths(columns, placed, linears)
        hidden = {features(linears[c])[0] for c in columns}
        where = region_name or type(model).__name__
        for leaf, param in region.named_parameters(recurse=False):
            qualified = f"{region_name}.{leaf}" if region_name else leaf
            dim = _feature_dim(param, inner, hidden, qualified, where)
            if dim is not None:  # else "whole": the region's input or its reduced output (module doc)
                out[qualified] = Placement("per_feature", region_name, dim)
        for child_name, child in region.named_children():
            qualified_child = f"{region_name}.{child_name}" if region_name else child_name
            if _holds_tp(qualified_child, child, placed, attention, linears):
                continue
            for leaf, param in child.named_parameters():
                qualified = f"{qualified_child}.{leaf}"
                owner = child.get_submodule(leaf.rpartition(".")[0]) if "." in leaf else child
                if is_norm(owner):
                    if param.dim() == 1 and param.shape[0] in inner and param.shape[0] not in hidden:
                        raise ValueError(
                            f"{qualified}: a norm over the inner features of {where} ({param.shape[0]}), which "
                            f"are sharded: each rank would normalise its shard alone. Leave {where}'s "
                            f"projections out of the plan"
                        )
                    continue  # over the hidden width: the region's input or output, whole on every rank
                dim = _feature_dim(param, inner, hidden, qualified, where)
                if dim is not None:  # frozen too: its forward multiplies this rank's features
                    out[qualified] = Placement("per_feature", region_name, dim)
                elif param.requires_grad and not any(n in hidden for n in param.shape):
                    out[qualified] = Placement("summed", region_name)  # a hidden-width one: whole features
    for name, placement in out.items():
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name)
        taken = [a for a in ("tp_layout", "group") if placement.kind == "per_feature" and hasattr(owner, a)]
        if taken:
            raise ValueError(
                f"{name}: a per-feature parameter oases shards with the inner features, but its module "
                f"{type(owner).__name__} already has an attribute {taken[0]!r}, which oases would set to say "
                f"how; rename that attribute, or leave {placement.region or 'the region'}'s projections out of the plan"
            )
    return out


def _feature_dim(param: torch.Tensor, inner: set[int], hidden: set[int], qualified: str, where: str) -> Optional[int]:
    """The one dim of `param` of an inner width (None: none); ValueError where that is ambiguous."""
    dims = [d for d, n in enumerate(param.shape) if n in inner and n > 1]
    if not dims:
        return None
    if len(dims) > 1 or param.shape[dims[0]] in hidden:
        raise ValueError(
            f"{qualified}: shape {tuple(param.shape)} has {'several dims' if len(dims) > 1 else 'a dim'} of "
            f"the inner width of {where} ({sorted(inner)}){' that is also its hidden width' if len(dims) == 1 else ''}"
            f", so oases cannot tell which one holds the sharded features; leave {where}'s projections out "
            f"of the plan"
        )
    return dims[0]


def _holds_tp(name: str, child: nn.Module, placed: dict, attention: dict, linears: dict) -> bool:
    """Whether a region's child is (or holds) a projection or an attention module: not its to place."""
    if name in linears or name in attention:
        return True
    prefix = name + "."
    return any(n.startswith(prefix) for n in list(placed) + list(attention))


@dataclass(frozen=True)
class _FeatureLayout:
    """A module's tp_layout(): its per-feature parameters, each cut along its dim."""

    rules: tuple[tuple[str, int], ...]

    def __call__(self) -> dict[str, ShardRule]:
        return {name: ShardRule(dim) for name, dim in self.rules}


def apply_region_parameters(
    model: nn.Module, placements: dict[str, Placement], group_of: Callable[[str], Optional[dist.ProcessGroup]]
) -> None:
    """Shard the per-feature parameters (this rank's entries, values and requires_grad kept; the
    owner's tp_layout() and group say so) and hook the summed ones' gradients (module doc)."""
    per_owner: dict[str, list[tuple[str, int]]] = {}
    for name, placement in placements.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        group = group_of(placement.region)
        if placement.kind == "summed":
            mappings.sum_grads(owner, [leaf], group)
            continue
        ring = ring_of(group)
        full = owner.get_parameter(leaf)
        shard = ShardRule(placement.dim).shard(full.detach(), ring.rank, ring.size).clone()
        setattr(owner, leaf, nn.Parameter(shard, requires_grad=full.requires_grad))
        per_owner.setdefault(owner_name, []).append((leaf, placement.dim))
        owner.group = group
    for owner_name, rules in per_owner.items():
        model.get_submodule(owner_name).tp_layout = _FeatureLayout(tuple(rules))
