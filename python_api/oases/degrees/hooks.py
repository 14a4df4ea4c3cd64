"""Decoder layers run at their own degrees by hooks (oases.parallelize), and the replica-gradient sums.

A layer of degree d < p sees its replica's rows only, so each of its parameter gradients is summed
over its p / d replicas (`sum_over_replicas`, a gradient hook: hook_replica_sums, the one copy
oases.models.GPT and oases.parallelize use): the loss is normalised over the whole batch, so the sum
is the full gradient whatever the blocks' sizes.

Per-layer TP degrees (oases.parallelize(..., tp_degrees=[d_0, ..., d_{L-1}]), one per decoder layer, each a power of two
dividing p; e.g. oases.plan.load(path)): decoder layer l is sharded over the d_l consecutive ranks
of its replica and runs on that replica's block of the batch rows (p / d_l replicas; d_l = 1: left
unsharded), as oases.models.GPT does. The decoder layers are the nn.ModuleList at the dotted path
`layers` (e.g. layers="model.blocks"), else the first non-empty nn.ModuleList of KNOWN_LAYERS:
model.base_model.layers (Hugging Face Llama, Mistral, Qwen2/3: model.layers; GPT-NeoX:
gpt_neox.layers), model.transformer.h or model.h (nanoGPT-style). Rank r runs layer l as TP rank
r % d_l of replica r // d_l, on rows [floor(j B d_l / p), floor((j + 1) B d_l / p)) of the batch,
j = r // d_l (blocks differ by a row at most where p / d_l does not divide B):

    x = <the model's code before layers[0]>           # [B, ...] on every rank (degree p): embeddings
    for l, layer in enumerate(layers):                # as the model's own forward calls them
        x = reshard_rows(x, d_{l-1} -> d_l)           # [~B d_l / p, ...]: replica j's rows (d_{-1} = p)
        args, kwargs = cut(args), cut(kwargs)         # every tensor with shape[0] == B -> its rows [j]
        out = layer(x, *args, **kwargs)               # (or layer(hidden_states=x, ...))
        x = out[0] if isinstance(out, tuple) else out
    x = reshard_rows(x, d_{L-1} -> p)                 # [B, ...] on every rank, in layers[-1]'s output
    <the model's code after layers[-1]>               # final norm, head, loss: the whole batch

Hooks on the decoder layers do the resharding and the cutting (oases.degrees), and each
parameter gradient of a layer with d_l < p is summed over its replicas, so model(...) and
loss.backward() give the unsharded model's loss, logits and gradients when the model keeps this
contract (Hugging Face Llama, Mistral, Qwen2, GPT-NeoX and nanoGPT-style models do):
  - batch first: the hidden states reaching each layer are [B, ...] (not sequence-first [t, B, h]);
    they are the layer's first positional argument, or the keyword hidden_states;
  - a layer returns y or a tuple (y, ...); the model hands y to the next layer and does nothing
    between layers that mixes rows or needs the whole batch (it sees only the replica's rows); the
    other tuple elements of a layer's output stay at the replica's rows;
  - per-example arguments are tensors whose first dim is B (in tuples, lists and dicts too): masks
    [B, ...], position ids [B, t], rotary tables [B, t, d], per-row scalars [B]; they are cut.
    Everything else is passed as it is, so a tensor shared by every row must not have first dim B
    (give it a leading broadcast dim: [1, t, t], not [t, t] when t == B); cache_position is never cut;
  - only the hidden states carry a gradient into a layer: any other tensor argument that requires
    grad raises a ValueError (its gradient would be one replica's share); masks, position ids and
    Hugging Face rotary tables (computed under no_grad) do not;
  - each layer treats rows independently (no batch norm, no batch-wide reductions), its parameters
    are its own (not tied to another layer or the embedding), no dropout (replicas draw different
    masks), and the code outside the layers runs the same on every rank.
`group` must be the world (the subgroups are made on every rank); no vocabulary entries, no
sequence_parallel; oases.train_step runs Hugging Face models parallelized this way on its
schedules (oases.models.HFStack.layer_placements) and refuses the others. Bad input
raises on every rank before any communication: a `layers` path that does not name an nn.ModuleList
(ValueError / TypeError), tp_degrees of the wrong length or with a degree that is not a power of
two dividing p (ValueError), and, at the first forward, a batch of fewer rows than p / min(tp_degrees)
replicas (ValueError).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from oases import comm as _comm
from oases.degrees.checks import check_batch_rows
from oases.degrees.placements import Placement, RowGroups
from oases.degrees.rows import reshard_rows

__all__ = ["ReplicaSums", "hook_decoder_layers", "hook_replica_sums", "kwargs_rows", "sum_over_replicas"]


def sum_over_replicas(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A parameter gradient hook: the sum of `grad` over the replicas of its block (a new tensor)."""
    return _comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), group)


class ReplicaSums:
    """The switch of a model's replica-sum hooks: on for the model's own forward + backward; a
    schedule that sums the replicas' gradients itself (oases.train_step) runs inside `suspended()`.

        with sums.suspended():   # the hooks return the gradient as it is
            ...
    """

    def __init__(self) -> None:
        self._on = True

    @property
    def on(self) -> bool:
        """Whether the hooks sum the gradients now."""
        return self._on

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside, the hooks stand down; the switch is put back as it was after (nested, or after an error)."""
        previous, self._on = self._on, False
        try:
            yield
        finally:
            self._on = previous


def _sum_while_on(sums: ReplicaSums, grad: torch.Tensor, group: dist.ProcessGroup) -> Optional[torch.Tensor]:
    """A parameter gradient hook: sum_over_replicas while `sums.on`, else the gradient as it is."""
    return sum_over_replicas(grad, group) if sums.on else None


def hook_replica_sums(
    layers: Sequence[torch.nn.Module], degrees: Sequence[int], placements: dict[int, Placement], sums: ReplicaSums
) -> list:
    """Each parameter gradient of a layer of degree d < p summed over its p / d replicas (over its
    Placement's replica_group) by a hook, while `sums.on`; returns the hooks' handles.

        for layer l with d_l < p, each parameter w requiring grad:   w.grad += sum over replicas of d w
    """
    handles = []
    for layer, d in zip(layers, degrees):
        group = placements[d].replica_group
        if group is None:  # degree p: one replica, every row
            continue
        for param in layer.parameters():
            if param.requires_grad:
                handles.append(param.register_hook(functools.partial(_sum_while_on, sums, group=group)))
    return handles


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


def hook_decoder_layers(
    layers: Sequence[torch.nn.Module],
    degrees: tuple[int, ...],
    p: int,
    placements: dict[int, Placement],
    row_groups: RowGroups,
    *,
    where: str = "layers",
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

    def before(layer_index: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        prev, d = (degrees[layer_index - 1] if layer_index else p), degrees[layer_index]
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(
                f"{where}[{layer_index}]: per-layer tp_degrees need the hidden states [b, t, h] as the "
                f"layer's first positional argument (or keyword hidden_states), got "
                f"{type(x).__name__}; name an nn.ModuleList of layers called as layer(x, ...)"
            )
        others = {
            **{f"argument {i + 1}": a for i, a in enumerate(args[1:])},
            **{f"keyword {k}": v for k, v in kwargs.items() if k != "hidden_states"},
        }
        needy = [k for k, v in others.items() if _needs_grad(v)] if torch.is_grad_enabled() else []
        if needy:
            raise ValueError(
                f"{where}[{layer_index}]: {needy[0]} requires grad; per-layer tp_degrees route only the "
                f"hidden states' gradient between replicas, so the gradient of any other input of a "
                f"layer would be partial. Compute it without grad (torch.no_grad(), .detach()), or make "
                f"its parameters the layer's own"
            )
        batch = _batch_of(x, prev, p, placements)
        if layer_index == 0:
            check_batch_rows("batch", batch, degrees, p)
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

    handles = [
        layer.register_forward_pre_hook(functools.partial(before, i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    handles += [
        layer.register_forward_hook(functools.partial(after, i), with_kwargs=True)
        for i, layer in enumerate(layers)
        if degrees[i] < p
    ]  # at degree p: every row, nothing to do
    return handles
