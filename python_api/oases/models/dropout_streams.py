"""Dropout in a training step: the streams every run of a branch draws its masks from.

Dropout in a training step (`Branch(..., dropout=True)`, where the step has a seed: SubBatch.seed).
The schedules run a sublayer's core two or three times (forward, recomputation, a check), so its
masks cannot come from the global generator's running state. Each branch's forward runs with the
default generators forked (`DropoutStreams`: the CPU's, and the device's on CUDA; restored after)
and seeded from (step seed, layer, sublayer, branch, the sub-batch's rows), so every run of it draws
the same masks, and a rank switches between two streams as the branch runs (Megatron's RNG tracker):

    GROUP  the same on every rank of the TP group: from the branch's entry, and again after each
           row-parallel projection. Dropout there acts on replicated activations, or on the partial
           sums after the row projection (GPT-2's resid_dropout): mask m on every rank, so
           sum_r m * z_r / (1 - p) = m * (sum_r z_r) / (1 - p), the unsharded dropout of the sum.
    RANK   this rank's own (its TP rank in the seed): after each column-parallel projection, up to
           the row projection. Dropout there acts on this rank's heads or features (attention
           probabilities, MLP features): independent masks, as the unsharded model's would be.

With dropout on, the row projections' biases are added inside core on the group's first rank
(lead_only: fwd b there and 0 elsewhere, bwd the whole gradient on every rank), so a dropout after
the projection sees the unsharded layer's biased output; finish adds nothing then. The layer's own
dropout modules applied to a branch's output (`after`: GPT-NeoX's post_attention_dropout, Phi-3's
resid_attn_dropout) run at the end of that branch, on the GROUP stream. Masks depend on the
sub-batch split (the rows are in the seed), not on recomputation, on the schedule's passes or on
sequence parallelism (the ranks' token slices are not in the seed).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.dropout import _DropoutNd

from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.mappings import lead_only
from oases.schedule.protocol import SubBatch

__all__ = [
    "GROUP",
    "RANK",
    "DropoutStreams",
    "mix_seed",
    "stream_hooks",
    "tp_rank",
    "where_of",
    "seed_key",
    "seeded",
    "seeded_branch",
    "seeded_embedding",
    "seeded_layer",
    "draw_step_seed",
    "is_dropout",
    "dropout_in",
]

GROUP, RANK = 0, 1  # DropoutStreams' streams: the same on every TP rank / this rank's own
_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A seed in [0, 2**63) from integers (splitmix64 over them): the same in every process."""
    h = 0
    for v in values:
        h = (h + (int(v) & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


class DropoutStreams:
    """Inside `with`: the default generators (the CPU's, and `device`'s on CUDA) forked, drawing
    from the GROUP stream of `key`; `use(RANK)` / `use(GROUP)` switch streams. Each switch starts
    the stream's next segment, seeded from (key, stream, `rank` for RANK, the segment's number), so
    the same code path draws the same numbers on every run and GROUP's on every rank. The
    generators' states are restored on exit."""

    def __init__(self, key: Sequence[int], rank: int, device: torch.device) -> None:
        self.key, self.rank = tuple(key), rank
        self.cuda = device.index if device.index is not None else None
        if device.type == "cuda" and self.cuda is None:
            self.cuda = torch.cuda.current_device()
        if device.type != "cuda":
            self.cuda = None
        self.current: Optional[int] = None
        self._segments = [0, 0]
        self._saved: Optional[tuple] = None

    def __enter__(self) -> "DropoutStreams":
        cuda = None if self.cuda is None else torch.cuda.get_rng_state(self.cuda)
        self._saved = (torch.get_rng_state(), cuda)
        self.current = None
        self.use(GROUP)
        return self

    def __exit__(self, *exc: Any) -> None:
        cpu, cuda = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.cuda)
        self.current, self._saved = None, None

    def use(self, stream: int) -> None:
        """Draw from `stream` (GROUP or RANK) from here on (nothing changes if it is the current one)."""
        if stream == self.current:
            return
        self.current = stream
        seed = mix_seed(*self.key, stream, self.rank if stream == RANK else 0, self._segments[stream])
        self._segments[stream] += 1
        torch.default_generator.manual_seed(seed)
        if self.cuda is not None:
            torch.cuda.default_generators[self.cuda].manual_seed(seed)


@contextlib.contextmanager
def stream_hooks(module: nn.Module, streams: Optional[DropoutStreams], lead_biases: bool = False) -> Iterator[None]:
    """Inside, `module`'s column-parallel layers switch `streams` to RANK after their forward and its
    row-parallel layers back to GROUP (see the module docstring), a LoRA layer on a column to GROUP
    before its forward (its lora_dropout masks the replicated input: one mask on every rank; a
    LoRA layer on a row draws on RANK, its input being this rank's features); `lead_biases`: a row layer that
    returns its partial sum (under no_tp_communication) adds its bias to it on the group's first
    rank (lead_only). Hooks removed on exit."""
    handles = []

    def after_column(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        if streams is not None:
            streams.use(RANK)

    def before_column_adapter(m: nn.Module, args: Any) -> None:
        if streams is not None:
            streams.use(GROUP)

    def after_row(m: nn.Module, args: Any, out: torch.Tensor) -> Optional[torch.Tensor]:
        if streams is not None:
            streams.use(GROUP)
        if lead_biases and m.bias is not None and not m._communicate:
            return out + lead_only(m.bias.to(out.dtype), m.rank == 0)
        return None

    try:
        for m in module.modules():
            if isinstance(m, ColumnParallelLinear) and streams is not None:
                handles.append(m.register_forward_hook(after_column))
            elif isinstance(getattr(m, "base_layer", None), ColumnParallelLinear) and streams is not None:
                # a LoRA layer on a column (oases.nn.lora): its dropout acts on the replicated input
                handles.append(m.register_forward_pre_hook(before_column_adapter))
            elif isinstance(m, RowParallelLinear):
                handles.append(m.register_forward_hook(after_row))
        yield
    finally:
        for h in handles:
            h.remove()


def tp_rank(module: nn.Module) -> int:
    """The TP rank of `module`'s first column- or row-parallel layer (0 without one)."""
    return next((m.rank for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))), 0)


def where_of(ctx: Any) -> Optional[SubBatch]:
    """The SubBatch of a stack's ctx: ctx itself, or its `where` attribute (None: neither)."""
    if isinstance(ctx, SubBatch):
        return ctx
    where = getattr(ctx, "where", None)
    return where if isinstance(where, SubBatch) else None


def seed_key(where: SubBatch, *place: int) -> tuple[int, ...]:
    """A DropoutStreams key: the step seed, `place` (what runs: a layer and sublayer, the
    embedding) and the sub-batch's rows of the batch."""
    rows = where.rows
    return (where.seed, *place, rows.start or 0, -1 if rows.stop is None else rows.stop, where.batch)


_BRANCH, _WHOLE, _EMBED = 1, 2, 3  # what a DropoutStreams key's place starts with


def seeded(where: Optional[SubBatch], *place: int, rank: int = 0, device: torch.device) -> Any:
    """DropoutStreams for `place` in sub-batch `where`, or a null context (None) without a step seed."""
    if where is None or where.seed is None:
        return contextlib.nullcontext(None)
    return DropoutStreams(seed_key(where, *place), rank, device)


def seeded_branch(
    where: Optional[SubBatch], index: int, position: int, branch: int, rank: int, device: torch.device
) -> Any:
    """`seeded` for branch `branch` of sublayer `position` of decoder layer `index` (a Branch's forward)."""
    return seeded(where, _BRANCH, index, position, branch, rank=rank, device=device)


def seeded_embedding(where: Optional[SubBatch], device: torch.device) -> Any:
    """`seeded` for a stack's embedding (before the decoder layers): the GROUP stream throughout."""
    return seeded(where, _EMBED, device=device)


@contextlib.contextmanager
def seeded_layer(
    layer: nn.Module, where: Optional[SubBatch], index: int, rank: int, device: torch.device
) -> Iterator[Optional[DropoutStreams]]:
    """Around decoder layer `index` run whole (its TP layers communicating themselves): its
    DropoutStreams and stream_hooks; the row layers add their own biases."""
    with seeded(where, _WHOLE, index, rank=rank, device=device) as streams:
        with stream_hooks(layer, streams):
            yield streams


def draw_step_seed(device: torch.device, groups: Sequence[Optional[dist.ProcessGroup]]) -> int:
    """A step's dropout seed: drawn from the default generator (on every rank, so each advances
    alike) and broadcast from the first rank of each of `groups` in turn (None: the world), so
    every rank of their union has the first one's."""
    seed = torch.randint(0, 2**31 - 1, (1,), device=device)
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.broadcast(seed, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return int(seed)


def is_dropout(module: nn.Module) -> bool:
    """A dropout module (nn.Dropout and its kin)."""
    return isinstance(module, _DropoutNd)


def dropout_in(module: nn.Module) -> list[tuple[str, float]]:
    """(name, p) of what draws dropout masks in `module` in training: dropout modules with p > 0
    and float attributes named like a dropout rate (`*dropout*`, `*pdrop*`) above 0 (a Hugging
    Face attention's attention_dropout, Falcon's hidden_dropout, nanoGPT's dropout)."""
    found = []
    for name, m in module.named_modules():
        if is_dropout(m):
            if m.p > 0:
                found.append((name, float(m.p)))
            continue
        for attr, v in vars(m).items():
            if isinstance(v, float) and v > 0 and ("dropout" in attr.lower() or "pdrop" in attr.lower()):
                found.append((f"{name}.{attr}" if name else attr, v))
    return found
