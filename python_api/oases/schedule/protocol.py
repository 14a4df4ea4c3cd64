"""What a schedule needs from a model: a pre-LN stack seen as embed, sublayers, head.

    x, ctx = stack.embed(input_ids, where)               # x [b, t, h] replicated on the TP ranks
    for layer in stack.layers():                          # a layer: 1 or more sublayers
        for sub in layer:
            x = x + sub.finish(all_reduce(sub.core(sub.norm(x), ctx)), ctx)
    logits = stack.head(x, ctx)                           # [b, t, vocab]

`core` is this rank's share of the sublayer: column-parallel projections on its heads or
features, then the row-parallel projection *without* its reduction and bias, so the sum of
`core` over the TP ranks is the unsharded sublayer's output. `finish` is affine in its input
(the replicated bias, residual dropout): the schedules rely on that to differentiate through it
without the value it was applied to. `norm` may return anything `core` takes as one tensor (a
parallel-residual layer stacks its two norms). The schedule owns every all-reduce: of `core`'s
output forward, and of the gradient of `core`'s input backward (and, where the stack splits around
them, a vocabulary-parallel embedding's and LM head's: embed_split, head_split below).

With sequence parallelism the schedule keeps x as this rank's [b, t/p, h] slice of the sequence:
`norm` and `finish` run on it, the normed slices are all-gathered for `core` (which sees the
whole sequence, as before) and its partial sums are reduce-scattered back to slices.

Optional members a schedule reads with getattr (absent: the default in brackets):

    stack.logits_group               a process group: `head` returns vocab slices (below) [None]
    stack.step_seed()                the step's dropout seed, the same on every rank [None]
    stack.takes_attention_mask       whether `embed` applies where.attention_mask [True]
    stack.takes_position_ids         whether `embed` applies where.position_ids [False]
    stack.partial_parameters()       parameters whose gradients `core` leaves as this rank's share
                                     (a replicated factor multiplied by sharded activations: LoRA's
                                     column A and row B); train_step sums what the step added to
                                     them over the TP group after the backwards, in one all-reduce [[]]
    sublayer.sequence_parallel_parameters()   required for sequence_parallel=True: the parameters
                                     norm and finish use (their gradients are summed over the group)
    stack.layer_placements()         per-layer TP degrees: a LayerPlacements, or None (every layer
                                     on the schedule's one communicator) [None]
    stack.replica_ctx(ctx, rows)     ctx for a replica's `rows` of the sub-batch (below) [the default]
    sublayer.core_for_gradients(h, ctx)   core's graph for a backward only: the same graph and
                                     gradients, its output's value unspecified. Fine-grained
                                     recomputation differentiates core without reading its value,
                                     so the row-parallel output projection's GEMM need not run
                                     (oases.ops.linear_unread; about a third of a Llama layer's
                                     recomputed GEMMs) [core]
    stack.embed_split(input_ids, where)   an EmbedSplit, or None: `embed` around the all-reduce of
                                     a vocabulary-parallel embedding, which the schedule then runs
                                     asynchronously (the other sub-batch computes meanwhile) [embed,
                                     its all-reduce blocking]
    stack.head_split(x, ctx)         a HeadSplit, or None: `head` around the all-reduce of its
                                     input's gradient (a vocabulary-parallel LM head's), likewise
                                     [head, its all-reduce blocking inside the backward]

`finish` runs in forward and again, on a zero input, to get its gradient, so any randomness in it
(residual dropout) must come from `where.seed` and the positions in `where` (see
oases.models.GPT), never from the global generator. `ctx` is passed back as given; under
sequence parallelism a ctx that is a SubBatch, or has one as its `where` attribute, is narrowed
to this rank's tokens (a shallow copy) before `finish` sees it.

Per-layer TP degrees (`layer_placements()` not None: oases.models.GPT(tp_degrees=...), a Hugging
Face model after oases.parallelize(..., tp_degrees=...); no sequence parallelism, no offload): layer l
runs at degree d_l on its own communicator as p/d_l replicas, replica j on row block j of the
p/d_l blocks of each sub-batch (oases._rows.block_rows: rows [floor(j b d_l / p),
floor((j + 1) b d_l / p)), sizes differing by one at most; the embedding and head run at degree
p, every row on every rank):

    x, ctx = stack.embed(input_ids[rows], where)                   # [b, t, h], degree p
    for l, layer in enumerate(stack.layers()):
        at = placements.layers[l]
        x = move(at.rows_in, x, b)                                 # [~b d_l / p, t, h]: replica's rows
        ctx_l = stack.replica_ctx(ctx, at.place.rows(b))               # that replica's rows of the ctx
        x = layer(x, ctx_l) with each all-reduce on at.comm         # the degree's TP group
    logits = stack.head(move(placements.rows_out, x, b), ctx)      # [b, t, vocab], degree p
    after layer l's backward: grad of each of at.parameters summed over at.replica_comm (p/d_l replicas)

`move` is a RowMove (fwd keep a block of rows / bwd all-gather them, or the reverse); the
schedule runs it at the boundary between two layers, per sub-batch (its block sizes from the
sub-batch's row count b), so each sub-batch needs at least p / min(d_l) rows, one per replica
(ValueError before any communication). `replica_ctx` (absent: a ctx that is a SubBatch, or has
one as `where`, gets it narrowed by SubBatch.replica_rows) must narrow whatever in ctx has one
entry per row (a padding mask, position ids). While the schedule runs it enters
`placements.while_scheduled()`: the stack must not sum those gradients over the replicas itself
then (GPT's autograd hooks, used by its blocking forward, stand down).

A stack whose LM head is vocab-parallel sets `logits_group` (a process group; absent or None
means full logits): `head` then returns this rank's [b, t, vocab/p] slice of the logits, and the
loss is computed from the slices (oases.nn.vocab_parallel_cross_entropy), never gathered.

A vocabulary-parallel embedding and head each hold one all-reduce of a [b, t, h] tensor per
sub-batch. Split around it, the schedule owns that all-reduce as it owns the sublayers'::

    split = stack.embed_split(input_ids, where)     # EmbedSplit(partial, group, then)
    x, ctx = split.then(all_reduce(split.partial))  # == stack.embed(input_ids, where)
    split = stack.head_split(x, ctx)                 # HeadSplit(h, group, logits_of)
    logits = split.logits_of(h')                     # h' = h detached (a leaf): == stack.head(x, ctx),
    grad(x) = vjp(h, all_reduce(grad(h')))           # where grad(h') is this rank's share of grad(h)

`oases.models.GPT` implements `Stack` itself; `oases.models.adapt` finds adapters for models
`oases.parallelize` has sharded (Hugging Face Llama/Mistral/Qwen2/Qwen3, GPT-NeoX) and accepts
any object that implements `Stack` (a user's own model: see docs/guides/models.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from oases.degrees.placements import Placement, RowGroup
from oases.schedule.runtime import Communicator

__all__ = ["SubBatch", "Sublayer", "Stack", "EmbedSplit", "HeadSplit", "RowMove", "LayerPlacement", "LayerPlacements"]


@dataclass(frozen=True)
class SubBatch:
    """Where a sub-batch sits in the step's batch, and what comes with it.

    rows: its rows of the batch (dim 0); batch: the batch size (dropout masks are drawn over the
    whole batch and sliced, so they do not depend on the split); seed: the step's dropout seed
    (None: no dropout); attention_mask: its rows of the padding mask [b, t] (None: no padding);
    position_ids: its rows of the token positions [b, t] (None: 0..t-1 on every row; packed rows
    restart them at each document).
    With sequence parallelism, `finish` sees this rank's tokens only: `positions` is their range
    of the sequence and `seq_len` the whole sequence's length (None: all positions).
    """

    rows: slice
    batch: int
    seed: Optional[int] = None
    attention_mask: Optional[torch.Tensor] = None
    positions: slice = field(default_factory=lambda: slice(None))
    seq_len: Optional[int] = None
    position_ids: Optional[torch.Tensor] = None

    def tokens(self, positions: slice, seq_len: int) -> "SubBatch":
        """The same sub-batch, seen by `finish` on the tokens at `positions` of `seq_len`."""
        return dataclasses.replace(self, positions=positions, seq_len=seq_len)

    def replica_rows(self, rows: slice) -> "SubBatch":
        """The same sub-batch narrowed to its `rows` (relative to it): rows, padding mask and positions."""
        start = self.rows.start or 0
        return dataclasses.replace(
            self,
            rows=slice(start + rows.start, start + rows.stop),
            attention_mask=None if self.attention_mask is None else self.attention_mask[rows],
            position_ids=None if self.position_ids is None else self.position_ids[rows],
        )


@dataclass(frozen=True)
class RowMove:
    """Rows of x between two TP degrees lo < hi, over `comm` (the group of `rows`: the
    oases.degrees.RowGroup whose `parts` = hi / lo ranks hold, each, part `rows.index` of a
    sub-batch's replica block, `rows.sizes(b)` rows each; oases._rows):

        down (to the lower degree):  fwd: x [sum(sizes), ...] -> part `index` along dim 0 (local)
                                     bwd: all-gather dim 0 over comm (uneven parts padded, then cut)
        up (to the higher degree):   fwd: all-gather dim 0 over comm;  bwd: keep part `index`
    """

    comm: Communicator
    down: bool
    rows: RowGroup


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer runs under per-layer TP degrees: `place` (oases.degrees.Placement: its
    degree, this rank's replica of p / degree, on row block `place.rows(b)` of each sub-batch),
    its sublayers' all-reduces on `comm` (the replica's `degree` ranks); `rows_in` moves x from
    the previous layer's rows (the embedding's: degree p) to this layer's (None: the same
    degrees); `parameters`' gradients are summed over `replica_comm` by the schedule as the
    layer's backward ends (None, or no parameters: nothing for the schedule to sum -- one
    replica, or a stack that sums them itself in every backward call, as parallelize's hooks do)."""

    place: Placement
    comm: Communicator
    rows_in: Optional[RowMove]
    replica_comm: Optional[Communicator]
    parameters: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LayerPlacements:
    """What `stack.layer_placements()` returns: one LayerPlacement per layer; `rows_out` moves the
    last layer's rows back to degree p for the head (None: it runs at p); `while_scheduled()` is
    entered around a schedule's step (see the module docstring)."""

    layers: tuple[LayerPlacement, ...]
    rows_out: Optional[RowMove]
    while_scheduled: Callable[[], ContextManager[None]] = contextlib.nullcontext

    @property
    def most_replicas(self) -> int:
        """The largest replica count: each sub-batch needs at least this many rows (one per replica)."""
        return max((at.place.replicas for at in self.layers), default=1)


class EmbedSplit(NamedTuple):
    """What `stack.embed_split` returns: the embedding with its all-reduce left to the schedule."""

    partial: torch.Tensor  # [b, t, h]: this rank's share of the token embeddings, with its graph
    group: Optional[dist.ProcessGroup]  # the group `partial` sums over (None: the world)
    then: Callable[[torch.Tensor], tuple[torch.Tensor, Any]]  # the sum -> (x, ctx), as `embed` returns them


class HeadSplit(NamedTuple):
    """What `stack.head_split` returns: the head with its input gradient's all-reduce left to the schedule."""

    h: torch.Tensor  # the LM head's input, with its graph from x (the final norm's output)
    group: Optional[dist.ProcessGroup]  # the group that gradient sums over (None: the world)
    logits_of: Callable[[torch.Tensor], torch.Tensor]  # h' -> `head`'s logits from h'; h' gets this rank's share


@runtime_checkable
class Sublayer(Protocol):
    """One residual branch: x -> x + finish(reduce(core(norm(x), ctx)), ctx)."""

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, t, h] -> the input of `core` (differentiable; replicated parameters only)."""

    def core(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        """This rank's partial sum [b, t, h] of the branch's output, before bias and dropout."""

    def finish(self, z: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The reduced output z [b, t, h] -> what is added to x; affine in z."""

    # Sequence parallelism (optional): the parameters `norm` and `finish` use. There they see
    # this rank's tokens only, so their gradients are summed over the TP group after the step:
    #     def sequence_parallel_parameters(self) -> Iterable[nn.Parameter]


@runtime_checkable
class Stack(Protocol):
    """A decoder stack: embedding, layers of sublayers, head (see the module docstring)."""

    def embed(self, input_ids: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, Any]:
        """input_ids [b, t] (the sub-batch's rows) -> (x [b, t, h], ctx passed to every call below)."""

    def layers(self) -> Sequence[Sequence[Sublayer]]:
        """The stack's layers in order, each as its sublayers (recomputation reruns a whole layer)."""

    def head(self, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Final hidden states x [b, t, h] -> logits [b, t, vocab] (final norm included)."""


def with_tokens(ctx: Any, tokens: SubBatch) -> Any:
    """The stack's context with its SubBatch (where `finish` reads positions) narrowed to `tokens`:
    ctx itself if it is a SubBatch, else a shallow copy whose `where` attribute is replaced."""
    if isinstance(ctx, SubBatch):
        return tokens
    if isinstance(getattr(ctx, "where", None), SubBatch):
        narrowed = copy.copy(ctx)
        object.__setattr__(narrowed, "where", tokens)  # frozen dataclasses too
        return narrowed
    return ctx
