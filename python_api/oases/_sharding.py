"""How a full tensor is cut into tensor-parallel shards (rank r of p), for layers and models alike.

    column_shard(W [out, ...], r, p, stacked=s):  the r-th slice of each of the s equal blocks of
                                                  dim 0 (s = 3 for a fused q|k|v), concatenated
    row_shard(W [..., in], r, p):                 W[..., r*in/p : (r+1)*in/p]
    ShardRule(dim, parts=(n_0, ..., n_k)):        the r-th slice of each of the k+1 consecutive
                                                  blocks of `dim` (sizes n_i, unequal: a GQA q|k|v)
    ShardRule(dim, parts=..., replicas=(c_0, ..., c_k)):  block i cut into p / c_i slices, rank r holding
                                                  slice r // c_i: c_i consecutive ranks hold the same
                                                  copy (key-value heads at p > kv_heads)
column_shard and row_shard return views.

A module whose parameters are TP shards says how, as data: `tp_layout()` maps a parameter's
name (relative to the module, e.g. "weight") to a `ShardRule`; parameters it does not list are
replicated. Checkpointing, initialisation and tests read it instead of knowing module types:

    ColumnParallelLinear.tp_layout() == {"weight": ShardRule(0, stacked), "bias": ShardRule(0, stacked)}
    RowParallelLinear.tp_layout()    == {"weight": ShardRule(1)}           # bias replicated

A shard is a few boxes of the full tensor (`ShardRule.chunks`): one for a plain rule, `stacked`
for a blockwise one. Readers and writers of files (safetensors slices, torch.distributed.checkpoint
chunks) move those boxes, so no rank ever needs the full tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from oases import _checks

__all__ = [
    "ShardRule",
    "Chunk",
    "vocab_rule",
    "whole",
    "rows_of",
    "column_shard",
    "row_shard",
    "tp_rules",
    "sharded_parameters",
    "copied_rows",
    "squares_once",
]


@dataclass(frozen=True)
class Chunk:
    """One box of a shard: full[offsets : offsets + sizes] == local.narrow(dim, local_start, sizes[dim])."""

    offsets: tuple[int, ...]  # where the box starts in the full tensor
    sizes: tuple[int, ...]  # its extent (the full tensor's on every dim but `dim`)
    dim: int  # the sharded dim
    local_start: int  # where the box starts in the local shard, along `dim`

    def of(self, local: torch.Tensor) -> torch.Tensor:
        """The box's view of this rank's shard `local`."""
        return local.narrow(self.dim, self.local_start, self.sizes[self.dim])

    def index(self) -> tuple[slice, ...]:
        """The box as slices of the full tensor (for slice reads: full[chunk.index()])."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))


@dataclass(frozen=True)
class ShardRule:
    """A parameter cut along `dim` into p equal parts, blockwise when `stacked` > 1 or `parts` is given.

    Blockwise: the dim is consecutive blocks, each cut into p on its own, and rank r holds the
    r-th slice of every block, in block order: `stacked` equal blocks (a fused q|k|v of equal
    sizes: 3), or `parts`, the blocks' full sizes (a fused q|k|v with fewer key-value heads:
    (heads * d, kv_heads * d, kv_heads * d)). A Conv1D layer (weight [in, out]) is cut on dim 1.

    `size` (padded shards, stacked == 1: a vocabulary that p does not divide): the full tensor's
    length along `dim`; each rank holds ceil(size / p) entries, rank r the entries
    [r * ceil(size / p), ...) of the full tensor, and the entries past `size` (on the last ranks)
    are padding: zeros in `shard`, dropped by `unshard`, in no chunk.

    `replicas` (stacked == 1, unpadded; one entry per block: 1 without `parts`): block i is cut into
    p / replicas[i] slices and rank r holds slice r // replicas[i], so replicas[i] consecutive ranks
    hold the same copy (a GQA model's key-value heads at p > kv_heads: each rank holds the one
    kv head its query heads use). `chunks` gives every copy the same boxes (written once: a
    checkpoint deduplicates them) and `unshard` takes one copy of each slice.

        ShardRule(0, replicas=(2,)).shard(W [2d, in], r, p=4)          = W[(r // 2) * d : (r // 2 + 1) * d]
        ShardRule(0, parts=(q, k, v), replicas=(1, 2, 2)).shard(W, r, 4) = [q_r | k_{r // 2} | v_{r // 2}]
    """

    dim: int
    stacked: int = 1
    size: Optional[int] = None
    parts: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas:
            blocks = len(self.parts) or 1
            if (
                self.stacked != 1
                or self.size is not None
                or len(self.replicas) != blocks
                or any(not _checks.is_int(c) or c < 1 for c in self.replicas)
            ):
                raise ValueError(
                    f"ShardRule: replicas must be one positive int per block ({blocks}), with stacked=1 "
                    f"and no padded size; got replicas={self.replicas!r}, stacked={self.stacked}, "
                    f"size={self.size}, parts={self.parts}"
                )

    def copies(self) -> list[int]:
        """How many consecutive ranks hold each block's slice (one entry per block; 1: no replica)."""
        return list(self.replicas) if self.replicas else [1] * (len(self.parts) or max(self.stacked, 1))

    def local_copies(self, length: int, world_size: int) -> list[tuple[int, int, int]]:
        """(start, length, copies) of each block's entries along `dim` in a rank's shard of a full
        tensor of `length` entries there: which entries several ranks hold alike (copies > 1)."""
        if not self.replicas:
            return [(0, length // world_size, 1)]
        out, start = [], 0
        for block, c in zip(self.blocks(length), self.replicas):
            n = block // (world_size // c)
            out.append((start, n, c))
            start += n
        return out

    def _full_length(self, local_length: int, world_size: int) -> int:
        """The full tensor's entries along `dim` from a shard's `local_length`."""
        if self.size is not None:
            return self.size
        if self.parts:
            return sum(self.parts)
        return local_length * world_size // self.copies()[0] if self.replicas else local_length * world_size

    def blocks(self, length: int) -> list[int]:
        """The full sizes of the blocks that `length` entries along `dim` are made of."""
        if self.parts:
            return list(self.parts)
        return [length // self.stacked] * self.stacked

    def part(self, world_size: int) -> Optional[int]:
        """Entries per rank of a padded rule (None: unpadded)."""
        return None if self.size is None else -(-self.size // world_size)

    def held(self, length: int, rank: int, world_size: int) -> tuple[int, int]:
        """[start, stop) of the full tensor's `length` entries along `dim` that rank `rank` holds
        (stacked == 1; for a padded rule stop - start may be less than the shard's rows, or 0)."""
        c = self.copies()[0] if self.replicas and not self.parts else 1
        part = self.part(world_size) if self.size is not None else length // (world_size // c)
        start = min(length, (rank // c) * part)
        return start, min(length, start + part)

    def full_shape(self, local_shape: Sequence[int], world_size: int) -> torch.Size:
        """The full tensor's shape from a shard's."""
        shape = list(local_shape)
        shape[self.dim] = self._full_length(shape[self.dim], world_size)
        return torch.Size(shape)

    def shard(self, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """This rank's part of the full tensor (a view; a zero-padded copy for a padded rule)."""
        if self.size is not None:
            start, stop = self.held(self.size, rank, world_size)
            held = stop - start
            shape = list(full.shape)
            shape[self.dim] = self.part(world_size)
            out = full.new_zeros(shape)
            out.narrow(self.dim, 0, held).copy_(full.narrow(self.dim, start, held))
            return out
        if self.replicas:  # block i: slice r // c_i of p / c_i
            pieces = [
                b.chunk(world_size // c, dim=self.dim)[rank // c]
                for b, c in zip(full.split(self.blocks(full.shape[self.dim]), dim=self.dim), self.replicas)
            ]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)
        if self.dim == 0 and not self.parts:
            return column_shard(full, rank, world_size, self.stacked)
        blocks = self.blocks(full.shape[self.dim])
        if len(blocks) == 1:
            return full.chunk(world_size, dim=self.dim)[rank]
        return torch.cat(
            [b.chunk(world_size, dim=self.dim)[rank] for b in full.split(blocks, dim=self.dim)], dim=self.dim
        )

    def chunks(self, full_shape: tuple[int, ...], rank: int, world_size: int) -> list[Chunk]:
        """The boxes of the full tensor that rank `rank`'s shard holds, in the shard's order.

        stacked == 1:  [full.chunk(p, dim)[rank]]
        stacked == s:  block k of s, rank's part of it: entries k*B + rank*B/p ... (B = n/s)
        parts:         block k (size n_k, at o_k), rank's part of it: o_k + rank*n_k/p ...
        replicas:      block k's part (rank // c_k) of p / c_k: o_k + (rank // c_k)*n_k*c_k/p ...
        padded:        [entries rank*ceil(size/p) ... up to size] (none for a rank of padding only)
        """
        shape = tuple(int(n) for n in full_shape)
        if self.size is not None:
            start, stop = self.held(self.size, rank, world_size)
            held = stop - start
            if held == 0:
                return []
            offsets, sizes = [0] * len(shape), list(shape)
            offsets[self.dim], sizes[self.dim] = start, held
            return [Chunk(tuple(offsets), tuple(sizes), self.dim, 0)]
        boxes, start, local = [], 0, 0
        for block, c in zip(self.blocks(shape[self.dim]), self.copies()):  # the whole dim when stacked == 1
            part = block // (world_size // c)  # this rank's entries of the block
            offsets = [0] * len(shape)
            offsets[self.dim] = start + (rank // c) * part
            sizes = list(shape)
            sizes[self.dim] = part
            boxes.append(Chunk(tuple(offsets), tuple(sizes), self.dim, local))
            start, local = start + block, local + part
        return boxes

    def unshard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (the inverse of `shard`)."""
        if self.size is not None:
            return torch.cat(parts, dim=self.dim).narrow(self.dim, 0, self.size)
        if self.replicas:  # block i: one copy of each of its p / c_i slices (ranks 0, c_i, 2 c_i, ...)
            spans = self.local_copies(self._full_length(parts[0].shape[self.dim], len(parts)), len(parts))
            return torch.cat(
                [local.narrow(self.dim, start, n) for start, n, c in spans for local in parts[::c]], dim=self.dim
            )
        full = self.blocks(parts[0].shape[self.dim] * len(parts))
        if len(full) == 1:
            return torch.cat(parts, dim=self.dim)
        local = [n // len(parts) for n in full]
        blocks = [p.split(local, dim=self.dim) for p in parts]  # [rank][block]
        return torch.cat([blocks[r][b] for b in range(len(full)) for r in range(len(parts))], dim=self.dim)


def vocab_rule(size: int, world_size: int) -> ShardRule:
    """The rows of a [V, ...] vocabulary table: equal parts, padded when p does not divide V
    (Megatron's make_vocab_size_divisible_by, without changing V: the padding is never a token)."""
    return ShardRule(0) if size % world_size == 0 else ShardRule(0, size=size)


def whole(shape: tuple[int, ...]) -> list[Chunk]:
    """The one box of a tensor held whole (replicated)."""
    return [Chunk((0,) * len(shape), tuple(int(n) for n in shape), 0, 0)]


def rows_of(chunks: list[Chunk], start: int, stop: int) -> list[Chunk]:
    """The boxes of local rows [start, stop) (dim 0 of the local tensor), for a tensor that holds
    only those rows (ZeRO's piece of a shard): its view of each box starts at row 0.

        chunk along dim 0: its local rows intersected with [start, stop)
        chunk along another dim (covers every row): rows [start, stop) of it
    """
    out = []
    for c in chunks:
        if c.dim == 0:
            lo, hi = max(start, c.local_start), min(stop, c.local_start + c.sizes[0])
            if lo < hi:
                out.append(
                    Chunk((c.offsets[0] + lo - c.local_start, *c.offsets[1:]), (hi - lo, *c.sizes[1:]), 0, lo - start)
                )
        elif start < stop:
            out.append(
                Chunk((c.offsets[0] + start, *c.offsets[1:]), (stop - start, *c.sizes[1:]), c.dim, c.local_start)
            )
    return out


def column_shard(t: torch.Tensor, rank: int, world_size: int, stacked: int = 1) -> torch.Tensor:
    blocks = t.unflatten(0, (stacked, world_size, t.shape[0] // (stacked * world_size)))
    return blocks[:, rank].flatten(0, 1)  # [stacked * out/(stacked p), ...]


def row_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return t.chunk(world_size, dim=-1)[rank]


def tp_rules(model: torch.nn.Module) -> dict[str, tuple[ShardRule, "object"]]:
    """{qualified parameter name: (its ShardRule, its module's group)} for every parameter a
    module's `tp_layout()` lists (a name there may reach into a child: "qkv.weight")."""
    found: dict[str, tuple[ShardRule, object]] = {}
    for prefix, module in model.named_modules():
        layout = getattr(module, "tp_layout", None)
        if callable(layout):
            for name, rule in layout().items():
                found[f"{prefix}.{name}" if prefix else name] = (rule, module.group)
    return found


def sharded_parameters(model: torch.nn.Module) -> dict[int, "object"]:
    """{id(parameter): its process group (a module's None: the world's)} for every parameter a
    module's `tp_layout()` lists."""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return {id(model.get_parameter(name)): group or world for name, (_, group) in tp_rules(model).items()}


def copied_rows(model: torch.nn.Module) -> dict[int, tuple[tuple[int, int, int], ...]]:
    """{id(parameter): ((start, n, copies), ...)} for the TP shards holding rows (dim 0) that other
    ranks of their group hold alike (ShardRule replicas: key-value heads at p > kv_heads); a norm
    summed over the group counts those rows once by weighting them 1 / copies (`squares_once`)."""
    found = {}
    for name, (rule, group) in tp_rules(model).items():
        if rule.replicas and rule.dim == 0:
            param = model.get_parameter(name)
            p = dist.get_world_size(group)
            spans = rule.local_copies(rule.full_shape(param.shape, p)[0], p)
            found[id(param)] = tuple(span for span in spans if span[2] > 1)
    return found


def squares_once(g: torch.Tensor, spans: tuple[tuple[int, int, int], ...] = (), first_row: int = 0) -> torch.Tensor:
    """sum(g ** 2) in fp32, each row in `spans` ((start, n, copies) of the shard's rows) weighted
    1 / copies; `g` holds the shard's rows [first_row, first_row + g.shape[0]) (ZeRO: a dp rank's rows).

        sum over the ranks of squares_once(shard_r, spans_r) == |unsharded tensor|^2
    """
    total = g.detach().float().pow(2).sum()
    for start, n, c in spans:
        lo, hi = max(start - first_row, 0), min(start + n - first_row, g.shape[0])
        if lo < hi:
            total = total - g.detach().narrow(0, lo, hi - lo).float().pow(2).sum() * (1 - 1 / c)
    return total


def clip_sharded_(
    grads: Sequence[tuple[Optional[torch.Tensor], Optional[object], tuple[tuple[int, int, int], ...], int]],
    max_norm: float,
    norm_type: float,
    device: torch.device,
    *,
    across: Sequence[object] = (),
    also: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients by the norm of the unsharded gradient they are parts of; returns that norm
    (fp32 on `device`, the same on every rank). The one rule behind oases.nn.clip_grad_norm_,
    ZeroOptimizer.clip_grad_norm_ and the pipeline's max_grad_norm.

    ::

        grads: (g, its TP group (sharded_parameters') or None: replicated, spans of rows TP ranks
                hold alike, g's first row)
        part(g) = squares_once(g, spans, first row)  (2-norm)  |  max |g|  (inf)      # g None: 0
        total  = parts of replicated gradients, combined with each TP group's parts reduced over it
                 (groups in first-seen order: every rank lists the same ones), then reduced over each
                 group in `across` (ranks holding other rows or layers: ZeRO's dp, a pipeline's pp)
        every g, and every tensor in `also` (held here, counted elsewhere), *= min(1, max_norm / (norm + 1e-6))
    """
    inf = norm_type == math.inf
    combine, op = (torch.maximum, dist.ReduceOp.MAX) if inf else (torch.add, dist.ReduceOp.SUM)
    total = torch.zeros((), dtype=torch.float32, device=device)
    per_group: dict[int, tuple[object, torch.Tensor]] = {}
    for g, group, spans, first_row in grads:
        if group is not None:
            per_group.setdefault(id(group), (group, torch.zeros((), dtype=torch.float32, device=device)))
        if g is None or g.numel() == 0:
            continue
        part = (g.detach().float().abs().max() if inf else squares_once(g, spans, first_row)).to(device)
        if group is None:
            total = combine(total, part)
        else:
            per_group[id(group)] = (group, combine(per_group[id(group)][1], part))
    distributed = dist.is_available() and dist.is_initialized()
    for group, acc in per_group.values():
        if distributed:
            dist.all_reduce(acc, op=op, group=group)
        total = combine(total, acc)
    for group in across if distributed else ():
        dist.all_reduce(total, op=op, group=group)
    total = total if inf else total.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in [g for g, *_ in grads if g is not None] + list(also):
        g.detach().mul_(scale.to(g.device, g.dtype))
    return total
