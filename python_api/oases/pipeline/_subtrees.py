"""Subtrees of a model's modules: the ones a stage owns whole (their state-dict keys are the model's), and
stand-ins for the modules whose parameters a rank does not hold."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch
import torch.nn as nn

from oases._sharding import tp_rules

__all__ = ["owned_modules", "standing_in", "outermost"]


def owned_modules(model: nn.Module, owned_keys: set[str]) -> Optional[nn.Module]:
    """A module tree holding, at their own qualified names, the largest submodules of `model` whose
    parameters are all in `owned_keys` (their state-dict keys are the model's); None when some owned
    parameter sits in no such submodule (e.g. directly on a module that also holds others')."""
    params = dict(model.named_parameters(remove_duplicate=False))
    whole: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(w + ".") for w in whole):
            continue
        inside = [f"{name}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)]
        if inside and all(k in owned_keys for k in inside):
            whole.append(name)
    covered = {k for k in params if any(k.startswith(w + ".") for w in whole)}
    if not owned_keys <= covered:
        return None
    sharded = {k for k in tp_rules(model) if k in owned_keys}
    if not sharded <= set(tp_rules(_tree(model, whole))):  # a tp_layout() above the owned modules
        return None
    return _tree(model, whole)


def _tree(model: nn.Module, whole: list[str]) -> nn.Module:
    """A module holding model's submodules `whole` at their own qualified names."""
    root = nn.Module()
    for name in whole:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, model.get_submodule(name))
    return root


class _StandIn(nn.Module):
    """Stands in for a module whose parameters this rank does not hold while a stage computes its
    ctx: an embedding (a module with an int `embedding_dim`) gives zeros [*ids.shape, dim], any
    other module returns its first input."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        dim = getattr(module, "embedding_dim", None)
        self.dim = dim if isinstance(dim, int) else None
        self.out_dtype = next(module.parameters()).dtype

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.dim is None:
            return x
        return torch.zeros((*x.shape, self.dim), dtype=self.out_dtype, device=x.device)


@contextlib.contextmanager
def standing_in(model: nn.Module, names: list[str]) -> Iterator[None]:
    """model's submodules `names` replaced by _StandIns for the block (restored after)."""
    saved = []
    try:
        for name in names:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent)
            saved.append((owner, leaf, getattr(owner, leaf)))
            setattr(owner, leaf, _StandIn(saved[-1][2]))
        yield
    finally:
        for owner, leaf, module in reversed(saved):
            setattr(owner, leaf, module)


def outermost(names: Iterable[str]) -> list[str]:
    """`names` (qualified module names, in named_modules order) without those inside another one."""
    kept: list[str] = []
    for name in names:
        if not any(name == k or name.startswith(k + ".") for k in kept):
            kept.append(name)
    return kept
