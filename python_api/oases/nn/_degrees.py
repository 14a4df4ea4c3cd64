"""Per-layer TP degrees: where a layer of degree d runs, and moving activations between degrees.

Shared by oases.models.GPT(tp_degrees=...) and oases.parallelize(model, group, tp_degrees=...).
Ranks are positions 0..p-1 in the model's group. At degree d, rank r is TP rank r % d of replica
r // d, which holds row block r // d of the batch's p / d blocks ("data parallel inside the group"):

    x [B, ...] at degree p (every rank)  --reshard_rows(p -> d)-->  x [B d / p, ...], replica r // d's rows
    reshard_rows to a lower degree:  fwd: keep this rank's sub-block   bwd: all-gather the rows
    reshard_rows to a higher degree: fwd: all-gather the rows          bwd: keep this rank's sub-block
    (over the hi / lo ranks that share the higher degree's replica and the lower degree's TP position)

A layer of degree d < p sees 1/(p/d) of the rows, so each of its parameter gradients is summed
over its p / d replicas (`sum_over_replicas`, a gradient hook).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from oases import comm as _comm

__all__ = ["DegreeGroups", "Placement", "RowGroups", "RowsDown", "RowsUp", "check_tp_degrees", "hook_decoder_layers",
           "kwargs_rows", "make_placements", "reshard_rows", "sum_over_replicas", "sum_over_replicas_while"]


class RowsDown(torch.autograd.Function):
    """fwd: keep sub-block `index` of `parts` along dim 0 (local); bwd: all-gather dim 0 over `group`.
    Dual of RowsUp."""

    @staticmethod
    def forward(ctx, x, group, parts: int, index: int):
        ctx.group = group
        n = x.shape[0] // parts
        return x.narrow(0, index * n, n).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return _comm.ring_all_gather(grad.contiguous(), ctx.group, dim=0), None, None, None


class RowsUp(torch.autograd.Function):
    """fwd: all-gather dim 0 over `group` (`parts` ranks); bwd: keep sub-block `index`. Dual of RowsDown."""

    @staticmethod
    def forward(ctx, x, group, parts: int, index: int):
        ctx.parts, ctx.index = parts, index
        return _comm.ring_all_gather(x.contiguous(), group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[0] // ctx.parts
        return grad.narrow(0, ctx.index * n, n).clone(memory_format=torch.contiguous_format), None, None, None


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


@dataclass(frozen=True)
class Placement:
    """Where this rank runs a block of TP degree `degree` (of a group of p ranks)."""

    degree: int
    tp_group: Optional[dist.ProcessGroup]       # the replica's `degree` consecutive ranks
    replica_group: Optional[dist.ProcessGroup]  # the p / degree ranks at this TP position; None at degree p
    replica: int                                # this rank's replica: rank // degree
    replicas: int                               # p // degree

    def rows(self, batch: int) -> slice:
        n = batch // self.replicas
        return slice(self.replica * n, (self.replica + 1) * n)


def check_tp_degrees(tp_degrees: object, layers: int, p: int) -> tuple[int, ...]:
    """The degrees as a tuple, or ValueError / TypeError (local checks: the same on every rank)."""
    if isinstance(tp_degrees, (str, bytes)) or not isinstance(tp_degrees, Sequence):
        raise TypeError(f"tp_degrees: expected a list of ints (one TP degree per layer, e.g. oases.plan.load(path)), "
                        f"got {type(tp_degrees).__name__}")
    degrees = tuple(tp_degrees)
    if len(degrees) != layers:
        raise ValueError(f"tp_degrees: expected one degree per layer ({layers}), got {len(degrees)}: {list(degrees)}")
    for i, d in enumerate(degrees):
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"tp_degrees[{i}]: expected an int, got {type(d).__name__}")
        if d < 1 or d & (d - 1) or p % d:
            raise ValueError(f"tp_degrees[{i}]: {d} is not a power of two dividing the group size {p} "
                             f"(allowed: {[2 ** k for k in range(p.bit_length()) if p % 2 ** k == 0]})")
    return degrees


# {(lo, hi): (the group resharding rows between degrees lo < hi, this rank's index in it)}
RowGroups = dict[tuple[int, int], tuple[Optional[dist.ProcessGroup], int]]


def make_placements(group: Optional[dist.ProcessGroup], p: int, me: int, degrees: tuple[int, ...]
                    ) -> tuple[dict[int, Placement], RowGroups]:
    """({degree: this rank's Placement}, {(lo, hi): (resharding group, this rank's index in it)}).

    Collective on every rank of the world (group == the world), in the same order everywhere:
    for each degree d < p, the replicas' TP groups and the same-position groups; for each pair of
    neighbouring degrees lo < hi (the embedding and head count as degree p), the groups of the
    hi / lo ranks {r: r // hi, r % lo fixed}. A rank list made before is reused (so is `group`)."""
    ranks = dist.get_process_group_ranks(group) if p > 1 else [0]
    made: dict[tuple[int, ...], Optional[dist.ProcessGroup]] = {tuple(range(p)): group}

    def make(members: list[int]) -> None:  # every rank makes every group (non-members get a placeholder)
        if tuple(members) not in made:
            made[tuple(members)] = _comm.new_group([ranks[m] for m in members])

    def own(members: range) -> Optional[dist.ProcessGroup]:  # a group this rank is in
        return made[tuple(members)]

    for d in sorted(set(degrees)):
        for j in range(p // d):
            make(list(range(j * d, (j + 1) * d)))
        for t in range(d):
            make(list(range(t, p, d)))
    edges = sorted({tuple(sorted(pair)) for pair in zip((p, *degrees), (*degrees, p)) if pair[0] != pair[1]})
    for lo, hi in edges:
        for j in range(p // hi):
            for t in range(lo):
                make([j * hi + t + k * lo for k in range(hi // lo)])
    placements = {}
    for d in set(degrees):
        j = me // d
        placements[d] = Placement(d, own(range(j * d, (j + 1) * d)),
                                  None if d == p else own(range(me % d, p, d)), j, p // d)
    rows = {}
    for lo, hi in edges:
        base = (me // hi) * hi + me % lo
        rows[lo, hi] = (own(range(base, base + hi, lo)), (me % hi) // lo)
    return placements, rows


def reshard_rows(x: torch.Tensor, a: int, b: int, row_groups: RowGroups) -> torch.Tensor:
    """x [B a / p, ...] in the row layout of degree a -> [B b / p, ...], that of degree b
    (`row_groups` from make_placements; the identity when a == b)."""
    if a == b:
        return x
    lo, hi = min(a, b), max(a, b)
    group, index = row_groups[lo, hi]
    move = RowsDown if b < a else RowsUp
    return move.apply(x, group, hi // lo, index)


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


def hook_decoder_layers(layers: Sequence[torch.nn.Module], degrees: tuple[int, ...], p: int,
                        placements: dict[int, Placement], row_groups: RowGroups, *, where: str = "layers"
                        ) -> list:
    """Run decoder layer l on this rank's replica rows at degree d_l, by hooks; return their handles.

        pre-hook of layer l:   x = reshard_rows(x, d_{l-1} -> d_l)         # [B d_l / p, t, h]
                               every other argument: each [B, ...] tensor -> its rows   (d_l < p)
                                                    # masks, cos/sin, position ids, per-row scalars
        hook after layer L-1:  y = reshard_rows(y, d_{L-1} -> p)           # [B, t, h] for the final norm
    (d_{-1} = p: the embeddings run on the whole batch on every rank). x is the first positional
    argument, else the keyword hidden_states; a layer may return y or a tuple (y, ...), and the
    model must hand y (as it is) to the next layer. The model passes every layer the same
    full-batch arguments, so each layer cuts its own; the hooks keep no state, so a recomputed
    (checkpointed) layer reshards the same way. Each layer's pre-hook raises, on every rank before
    its communication (at layer 0: before any): TypeError unless x is a tensor, ValueError if an
    argument other than x requires grad (its gradient would be this replica's share only); at
    layer 0, ValueError unless the batch B divides into p / min(degrees) replicas. `where` names
    the layers in the messages."""
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
        batch = x.shape[0] * p // prev
        if layer_index == 0 and batch % most:
            raise ValueError(f"batch: tp_degrees {list(degrees)} run up to {most} replicas, each on an equal block "
                             f"of the batch; got batch size {batch} (use a multiple of {most})")
        x, rest = reshard_rows(x, prev, d, row_groups), args[1:]
        if d < p:
            rows = placements[d].rows(batch)
            rest = tuple(_rows_of(a, batch, rows) for a in rest)
            kwargs = kwargs_rows(kwargs, batch, rows)
        if args:
            return (x, *rest), kwargs
        return args, {**kwargs, "hidden_states": x}

    def after(module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> object:
        if isinstance(out, tuple):  # (hidden_states, ...): older transformers, a user's layers
            return (reshard_rows(out[0], degrees[-1], p, row_groups), *out[1:])
        return reshard_rows(out, degrees[-1], p, row_groups)

    handles = [layer.register_forward_pre_hook(functools.partial(before, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(after, with_kwargs=True))
    return handles
