"""The Hugging Face adapter's dropout: which of a decoder layer's dropouts join a branch, and
the layers that run whole in training because a dropout cannot be placed (oases.models.hf).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.comm.topology import ring_of
from oases.degrees import LayerDegrees
from oases.models._whole import WholeLayer
from oases.models.dropout_streams import is_dropout, seeded_layer
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.parts import LayerParts, child_calls, layer_parts


class _SeededWholeLayer(WholeLayer):
    """A layer run whole whose dropout draws from the step's DropoutStreams (seeded_layer): GROUP on
    replicated activations (after its row layers' all-reduces), RANK on its heads and features."""

    def __init__(self, index: int, layer: nn.Module, group: Optional[dist.ProcessGroup], *, alone: bool) -> None:
        super().__init__(index, layer, group, alone=alone)
        self.rank = 0 if alone or not dist.is_initialized() else ring_of(group).rank

    def core(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        with seeded_layer(self.layer, ctx.where, self.index, self.rank, h.device):
            return super().core(h, ctx)


def _dropout_calls(forward: Any) -> Optional[list[tuple[bool, str]]]:
    """The calls of a forward whose callee's name says dropout, in source order, each as (whether
    it is `self.<name>(...)`, name); None where the source is unavailable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        on_self = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"
        if "dropout" in name.lower():
            found.append((on_self, name))
    return found


def _placed_dropout(
    decoder: nn.ModuleList, parts: list[LayerParts]
) -> tuple[list[LayerParts], list[tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]]]:
    """For a model training with dropout: (each layer's parts, each split layer's dropout modules on
    its (attention's, MLP's) output). A dropout module the layer calls after a branch (before the next
    norm or branch) is that branch's; a layer whose forward calls a dropout function (Falcon's
    dropout_add) or a dropout module elsewhere runs whole."""
    placed, after = [], []
    for layer, p in zip(decoder, parts):
        found = _branch_dropouts(layer, p) if p.kind != "whole" else ((), ())
        if found is None:
            p = LayerParts(
                "whole",
                p.attention,
                p.mlp,
                p.norms,
                "in training its forward applies dropout that is not a dropout module after its attention or "
                "MLP (a dropout function, or a module elsewhere)",
            )
            found = ((), ())
        placed.append(p)
        after.append(found)
    return placed, after


def _branch_dropouts(layer: nn.Module, parts: LayerParts) -> Optional[tuple[tuple[nn.Module, ...], ...]]:
    """The layer's dropout modules on its attention's and its MLP's outputs (see _placed_dropout),
    None where it applies dropout otherwise."""
    children = dict(layer.named_children())
    dropouts = _dropout_calls(type(layer).forward)
    calls = child_calls(type(layer).forward)
    if dropouts is None or calls is None:
        return None
    if any(not on_self or not is_dropout(children.get(name, nn.Identity())) for on_self, name in dropouts):
        return None  # a dropout function (or method) in the layer's forward
    owned: dict[str, list[nn.Module]] = {parts.attention: [], parts.mlp: []}
    last = None
    for name in calls:
        module = children.get(name)
        if module is None:
            continue
        if is_dropout(module):
            if last not in owned:
                return None  # not right after a branch (on the residual stream, or after a norm)
            if all(module is not m for m in owned[last]):
                owned[last].append(module)
        else:
            last = name
    return tuple(owned[parts.attention]), tuple(owned[parts.mlp])


def _seed_groups(
    model: nn.Module, degrees: Optional[LayerDegrees], tp_group: Optional[dist.ProcessGroup]
) -> tuple[Optional[dist.ProcessGroup], ...]:
    """The groups step_seed broadcasts over in turn, so that every rank of the model's TP group gets
    its first rank's seed: that group, or with per-layer degrees the first layer's TP group and then
    its replicas' group (covering the TP group between them); () on one rank."""
    if not dist.is_initialized():
        return ()
    if degrees is not None:
        at = degrees.placement(0)
        return tuple(g for g in (at.tp_group, at.replica_group) if g is not None)
    tp = any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules())
    return (tp_group,) if tp else ()


def _parts_of(decoder: nn.ModuleList) -> list[LayerParts]:
    """layer_parts of each layer, the forward's source read once per kind of layer (class and children)."""
    seen: dict[tuple, LayerParts] = {}
    found = []
    for layer in decoder:
        key = (
            type(layer),
            tuple((n, type(m)) for n, m in layer.named_children()),
            getattr(layer, "use_parallel_residual", None),
        )
        if key not in seen:
            seen[key] = layer_parts(layer)
        found.append(seen[key])
    return found
