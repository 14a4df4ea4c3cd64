"""Which of a model's parameters outside its layers are the embedding's and which the head's (a Stage's Roles),
found by differentiating stack.embed and stack.head once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.schedule import Stack, SubBatch

__all__ = ["Roles", "probe_roles"]


@dataclass(frozen=True)
class Roles:
    """What a stage knows of a model's embedding and head, by parameter name (every name of a tied one).

    head:   the parameters stack.head uses (final norm, LM head)
    embed:  the parameters stack.embed uses (the others outside the layers go with it too)
    hidden, dtype: of the activations; vocab_size: of the logits (all of it when vocab-parallel)
    """

    head: frozenset[str]
    embed: frozenset[str]
    hidden: int
    dtype: torch.dtype
    vocab_size: int


def probe_roles(
    model: nn.Module, stack: Stack, rest: list[nn.Parameter], device: Optional[torch.device] = None
) -> Roles:
    """Roles found by running one token through stack.embed and stack.head and differentiating each
    once (on every rank of the stage alike: a vocab-parallel embedding or head communicates over
    TP there); `rest`: the parameters outside the layers (only their trainable ones are found)."""
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device or (rest[0].device if rest else None))
    x, ctx = stack.embed(tokens, SubBatch(slice(0, 1), 1))
    logits = stack.head(x.detach(), ctx)
    group = getattr(stack, "logits_group", None)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    head = frozenset(n for p in _used_by(logits, rest) for n in names[id(p)])
    embed = frozenset(n for p in _used_by(x, rest) for n in names[id(p)])
    vocab = logits.shape[-1] * (dist.get_world_size(group) if group is not None else 1)
    return Roles(head, embed, x.shape[-1], x.dtype, vocab)


def _used_by(out: torch.Tensor, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The trainable parameters among `params` that `out` depends on (differentiated once)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable or not out.requires_grad:
        return []
    grads = torch.autograd.grad(out.float().sum(), trainable, allow_unused=True)
    return [p for p, g in zip(trainable, grads) if g is not None]
