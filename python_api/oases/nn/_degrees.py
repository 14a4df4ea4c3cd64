"""Per-layer TP degrees: where a layer of degree d runs, and moving activations between degrees.

Shared by oases.models.GPT(tp_degrees=...) and oases.parallelize(model, group, tp_degrees=...).
Ranks are positions 0..p-1 in the model's group. At degree d, rank r is TP rank r % d of replica
r // d, which holds row block r // d of the batch's p / d blocks ("data parallel inside the group";
oases._rows.block_rows: sizes differ by at most one when p / d does not divide B):

    x [B, ...] at degree p (every rank)  --reshard_rows(p -> d)-->  x [~B d / p, ...], replica r // d's rows
    reshard_rows to a lower degree:  fwd: keep this rank's sub-block   bwd: all-gather the rows
    reshard_rows to a higher degree: fwd: all-gather the rows          bwd: keep this rank's sub-block
    (over the hi / lo ranks that share the higher degree's replica and the lower degree's TP position)

The blocks nest (block j at degree hi is blocks j hi/lo .. (j + 1) hi/lo - 1 at degree lo < hi), so
each move stays inside one replica of the higher degree; blocks of unequal size are all-gathered
padded to the largest (oases._rows.padded / unpadded). A layer of degree d < p sees its replica's
rows only, so each of its parameter gradients is summed over its p / d replicas
(`sum_over_replicas`, a gradient hook): the loss is normalised over the whole batch, so the sum is
the full gradient whatever the blocks' sizes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from oases import _checks
from oases import comm as _comm
from oases._rows import block_rows, padded, part_sizes, unpadded

__all__ = ["DegreeGroups", "Placement", "RowGroup", "RowGroups", "RowsDown", "RowsUp", "check_tp_degrees",
           "hook_decoder_layers", "kwargs_rows", "make_placements", "reshard_rows", "sum_over_replicas",
           "sum_over_replicas_while"]


def _part(x: torch.Tensor, sizes: tuple[int, ...], index: int) -> torch.Tensor:
    """Rows of part `index` of x [sum(sizes), ...] (parts of `sizes` rows, in order), a new tensor."""
    return x.narrow(0, sum(sizes[:index]), sizes[index]).clone(memory_format=torch.contiguous_format)


def _gather_parts(x: torch.Tensor, group: Optional[dist.ProcessGroup], sizes: tuple[int, ...]) -> torch.Tensor:
    """cat(x from each rank of `group`, dim 0) [sum(sizes), ...]; rank k's x has sizes[k] rows."""
    return unpadded(_comm.ring_all_gather(padded(x.contiguous(), sizes), group, dim=0), sizes)


class RowsDown(torch.autograd.Function):
    """fwd: keep part `index` along dim 0 (parts of `sizes` rows; local); bwd: all-gather dim 0
    over `group`. Dual of RowsUp."""

    @staticmethod
    def forward(ctx, x, group, sizes: tuple[int, ...], index: int):
        ctx.group, ctx.sizes = group, sizes
        return _part(x, sizes, index)

    @staticmethod
    def backward(ctx, grad):
        return _gather_parts(grad, ctx.group, ctx.sizes), None, None, None


class RowsUp(torch.autograd.Function):
    """fwd: all-gather dim 0 over `group` (rank k holding sizes[k] rows); bwd: keep part `index`.
    Dual of RowsDown."""

    @staticmethod
    def forward(ctx, x, group, sizes: tuple[int, ...], index: int):
        ctx.sizes, ctx.index = sizes, index
        return _gather_parts(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _part(grad, ctx.sizes, ctx.index), None, None, None


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
        """This replica's rows of a batch of `batch` rows (oases._rows.block_rows)."""
        return block_rows(batch, self.replicas, self.replica)


def check_tp_degrees(tp_degrees: object, layers: int, p: int) -> tuple[int, ...]:
    """The degrees as a tuple, or ValueError / TypeError (local checks: the same on every rank)."""
    if isinstance(tp_degrees, (str, bytes)) or not isinstance(tp_degrees, Sequence):
        raise TypeError(f"tp_degrees: expected a list of ints (one TP degree per layer, e.g. oases.plan.load(path)), "
                        f"got {type(tp_degrees).__name__}")
    degrees = tuple(tp_degrees)
    if len(degrees) != layers:
        raise ValueError(f"tp_degrees: expected one degree per layer ({layers}), got {len(degrees)}: {list(degrees)}")
    for i, d in enumerate(degrees):
        if not _checks.is_int(d):
            raise TypeError(f"tp_degrees[{i}]: expected an int, got {type(d).__name__}")
        if d < 1 or d & (d - 1) or p % d:
            raise ValueError(f"tp_degrees[{i}]: {d} is not a power of two dividing the group size {p} "
                             f"(allowed: {[2 ** k for k in range(p.bit_length()) if p % 2 ** k == 0]})")
    return degrees


@dataclass(frozen=True)
class RowGroup:
    """The ranks that move rows between degrees lo < hi: the `parts` = hi / lo ranks of this rank's
    replica `replica` (of `replicas` = p / hi) at degree hi that share its TP position at degree lo.
    Each holds one lo replica's block of the hi replica's rows; this rank part `index`."""

    group: Optional[dist.ProcessGroup]
    parts: int
    index: int
    replica: int
    replicas: int

    def sizes(self, batch: int) -> tuple[int, ...]:
        """The row counts of the parts, for a batch of `batch` rows (oases._rows.part_sizes)."""
        return part_sizes(batch, self.replicas, self.replica, self.parts)


# {(lo, hi): the RowGroup of this rank resharding rows between degrees lo < hi}
RowGroups = dict[tuple[int, int], RowGroup]


def make_placements(group: Optional[dist.ProcessGroup], p: int, me: int, degrees: tuple[int, ...]
                    ) -> tuple[dict[int, Placement], RowGroups]:
    """({degree: this rank's Placement}, {(lo, hi): this rank's RowGroup between degrees lo < hi}).

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
        rows[lo, hi] = RowGroup(own(range(base, base + hi, lo)), hi // lo, (me % hi) // lo, me // hi, p // hi)
    return placements, rows


def reshard_rows(x: torch.Tensor, a: int, b: int, row_groups: RowGroups, batch: int) -> torch.Tensor:
    """x: this rank's replica's rows of a batch of `batch` rows at degree a -> its rows at degree b
    ([~batch a / p, ...] -> [~batch b / p, ...]; `row_groups` from make_placements; the identity
    when a == b)."""
    if a == b:
        return x
    move = row_groups[min(a, b), max(a, b)]
    return (RowsDown if b < a else RowsUp).apply(x, move.group, move.sizes(batch), move.index)


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
