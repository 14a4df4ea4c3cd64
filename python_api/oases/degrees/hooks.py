"""Decoder layers run at their own degrees by hooks (oases.parallelize), and the replica-gradient sums.

A layer of degree d < p sees its replica's rows only, so each of its parameter gradients is summed
over its p / d replicas (`sum_over_replicas`, a gradient hook): the loss is normalised over the
whole batch, so the sum is the full gradient whatever the blocks' sizes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from oases import comm as _comm
from oases.degrees.placements import Placement, RowGroups
from oases.degrees.rows import reshard_rows

__all__ = ["DegreeGroups", "hook_decoder_layers", "kwargs_rows", "sum_over_replicas", "sum_over_replicas_while"]


def sum_over_replicas(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A parameter gradient hook: the sum of `grad` over the replicas of its block (a new tensor)."""
    return _comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), group)


def sum_over_replicas_while(on: list[bool], grad: torch.Tensor, group: dist.ProcessGroup) -> Optional[torch.Tensor]:
    """A parameter gradient hook: sum_over_replicas while `on[0]` (a model's own forward + backward);
    a schedule that sums the replicas' gradients itself (oases.train_step) sets on[0] = False."""
    return sum_over_replicas(grad, group) if on[0] else None


@dataclass
class DegreeGroups:
    """What a model with per-layer degrees keeps: this rank's Placement per degree, the resharding
    groups, and the switch of its replica-sum hooks (`sums_on[0]`; see sum_over_replicas_while)."""

    placements: dict[int, "Placement"]
    row_groups: "RowGroups"
    sums_on: list[bool]


# --- decoder layers called as layer(hidden_states, *args, **kwargs) ------------------------------

# Keywords never cut: cache_position [t] (older transformers) indexes the sequence, not the batch.
_NOT_ROWS = frozenset({"hidden_states", "cache_position"})


def _rows_of(value: object, batch: int, rows: slice) -> object:
    """`value` with each batch-shaped tensor ([batch, ...]: first dim == batch) cut to `rows`, in
    tuples, lists and dicts too; anything else (a [1, ...] broadcast mask or rotary table, a
    number, a cache object, None) as it is."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() >= 1 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_of(v, batch, rows) for v in value)
    if isinstance(value, dict):
        return {k: _rows_of(v, batch, rows) for k, v in value.items()}
    return value


def kwargs_rows(kwargs: dict, batch: int, rows: slice) -> dict:
    """A decoder layer's keyword arguments cut to a replica's `rows` (_rows_of), except the keywords
    that never hold rows (cache_position indexes the sequence)."""
    return {k: v if k in _NOT_ROWS else _rows_of(v, batch, rows) for k, v in kwargs.items()}


def _needs_grad(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(map(_needs_grad, value))
    return isinstance(value, dict) and any(map(_needs_grad, value.values()))


# What the hooks note on the hidden states between layers: the batch size B they are rows of (a
# replica's block does not tell it: 3 rows are block 0 of 2 for B = 6 and for B = 7).
_BATCH_NOTE = "_oases_batch_rows"


def _batch_of(x: torch.Tensor, degree: int, p: int, placements: dict[int, Placement]) -> int:
    """The batch size B of which x holds this rank's replica's rows at `degree`: x's row count at
    degree p; else what the hooks noted on x; else (a copy of it: a reentrant torch.utils.checkpoint
    recomputes a layer on detached inputs) the replicas' row counts summed over the replica group
    (an all-reduce, on every rank alike: the model runs the same code on every rank)."""
    if degree == p:
        return x.shape[0]
    noted = getattr(x, _BATCH_NOTE, None)
    if noted is not None:
        return noted
    rows = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    dist.all_reduce(rows, group=placements[degree].replica_group)
    return int(rows)


def hook_decoder_layers(layers: Sequence[torch.nn.Module], degrees: tuple[int, ...], p: int,
                        placements: dict[int, Placement], row_groups: RowGroups, *, where: str = "layers"
                        ) -> list:
    """Run decoder layer l on this rank's replica rows at degree d_l, by hooks; return their handles.

        pre-hook of layer l:   x = reshard_rows(x, d_{l-1} -> d_l)         # [~B d_l / p, t, h]
                               every other argument: each [B, ...] tensor -> its rows   (d_l < p)
                                                    # masks, cos/sin, position ids, per-row scalars
        hook after layer l:    y noted with B (the next pre-hook reads it: see _batch_of)    (d_l < p)
        ... after layer L-1:   y = reshard_rows(y, d_{L-1} -> p)           # [B, t, h] for the final norm
    (d_{-1} = p: the embeddings run on the whole batch on every rank). x is the first positional
    argument, else the keyword hidden_states; a layer may return y or a tuple (y, ...), and the
    model must hand y (as it is) to the next layer. The model passes every layer the same
    full-batch arguments, so each layer cuts its own; a recomputed (checkpointed) layer reshards
    the same way. Each layer's pre-hook raises, on every rank before its communication (at layer
    0: before any): TypeError unless x is a tensor, ValueError if an argument other than x
    requires grad (its gradient would be this replica's share only); at layer 0, ValueError if
    the batch B has fewer rows than p / min(degrees) replicas (each needs one; B need not divide).
    `where` names the layers in the messages."""
    most = p // min(degrees)

    def before(layer_index: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        prev, d = (degrees[layer_index - 1] if layer_index else p), degrees[layer_index]
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(f"{where}[{layer_index}]: per-layer tp_degrees need the hidden states [b, t, h] as the "
                            f"layer's first positional argument (or keyword hidden_states), got "
                            f"{type(x).__name__}; name an nn.ModuleList of layers called as layer(x, ...)")
        others = {**{f"argument {i + 1}": a for i, a in enumerate(args[1:])},
                  **{f"keyword {k}": v for k, v in kwargs.items() if k != "hidden_states"}}
        needy = [k for k, v in others.items() if _needs_grad(v)] if torch.is_grad_enabled() else []
        if needy:
            raise ValueError(f"{where}[{layer_index}]: {needy[0]} requires grad; per-layer tp_degrees route only the "
                             f"hidden states' gradient between replicas, so the gradient of any other input of a "
                             f"layer would be partial. Compute it without grad (torch.no_grad(), .detach()), or make "
                             f"its parameters the layer's own")
        batch = _batch_of(x, prev, p, placements)
        if layer_index == 0 and batch < most:
            raise ValueError(f"batch: tp_degrees {list(degrees)} run up to {most} replicas, each on its own block "
                             f"of the batch's rows; got batch size {batch} (use at least {most} rows)")
        x, rest = reshard_rows(x, prev, d, row_groups, batch), args[1:]
        if d < p:
            setattr(x, _BATCH_NOTE, batch)  # for this layer's `after`
            rows = placements[d].rows(batch)
            rest = tuple(_rows_of(a, batch, rows) for a in rest)
            kwargs = kwargs_rows(kwargs, batch, rows)
        if args:
            return (x, *rest), kwargs
        return args, {**kwargs, "hidden_states": x}

    def after(layer_index: int, module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> object:
        batch = getattr(args[0] if args else kwargs["hidden_states"], _BATCH_NOTE)  # noted by `before`
        y = out[0] if isinstance(out, tuple) else out  # (hidden_states, ...): older transformers, a user's layers
        if layer_index < len(layers) - 1:
            setattr(y, _BATCH_NOTE, batch)  # for the next layer's `before`
            return out
        y = reshard_rows(y, degrees[-1], p, row_groups, batch)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    handles = [layer.register_forward_pre_hook(functools.partial(before, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(functools.partial(after, i), with_kwargs=True)
                for i, layer in enumerate(layers) if degrees[i] < p]  # at degree p: every row, nothing to do
    return handles
