"""The step context of oases.train_step: what one step runs on, resolved from the model once.

    ctx = step_context(model, comm, sequence_parallel, offload)
    ctx.model, ctx.stack          # the original module (torch.compile unwrapped) and its Stack view (adapt)
    ctx.made                      # what parallelize / GPT made it into (oases.nn.parallelism.Parallelism)
    ctx.comm, ctx.owned_comm      # the step's TP Communicator; made for this call (closed after it)
    ctx.per_layer, ctx.resolved_placements()   # per-layer TP degrees and their placements, made once
    ctx.offloader                 # the step's Offloader (the model's own for offload=True)
    ctx.step_seed, ctx.logits_group, ctx.vocab_size, ctx.takes_*   # the Stack's optional members

Every probe of the model and its stack for what it was made into is here, once per step; oases.training
reads those from `ctx` (besides the model's own step counters: `oases_steps`, the recompute choices).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases._compiled import original_module
from oases.comm.topology import same_group
from oases.degrees import refuse_with_degrees
from oases.models.hf import HFStack
from oases.models.nanogpt import NanoGPTStack, is_nanogpt
from oases.nn.parallelism import Parallelism, find_parallelism, parallelism_of
from oases.offload import Offloader
from oases.schedule import Communicator, Stack
from oases.schedule.protocol import LayerPlacements

__all__ = ["StepContext", "step_context", "adapt"]


def adapt(model: object) -> Stack:
    """The `oases.schedule.Stack` view of `model`: itself if it implements the protocol (as
    oases.models.GPT and a user's own stack do), an `HFStack` for a Hugging Face causal LM whose
    decoder layers the adapter knows, a `NanoGPTStack` for nanoGPT's layout; otherwise
    ValueError naming what is needed."""
    if all(inspect.ismethod(getattr(model, name, None)) for name in ("embed", "layers", "head")):
        return model  # type: ignore[return-value]
    if isinstance(model, nn.Module) and _checks.from_transformers(model):
        return HFStack(model)
    if is_nanogpt(model):
        return NanoGPTStack(model)
    raise ValueError(
        f"model: {type(model).__name__} is neither a Hugging Face causal LM nor an oases.schedule.Stack; "
        "implement embed(input_ids, where) -> (x, ctx), layers() -> [[sublayer, ...], ...] (each with "
        "norm(x), core(h, ctx), finish(z, ctx)) and head(x, ctx) -> logits (see oases.schedule.protocol)"
    )


@dataclass(frozen=True)
class StepContext:
    """What one oases.train_step runs on, resolved once (`step_context`) from the model, what
    parallelize or GPT made it into (`made`, its oases.nn.parallelism.Parallelism; None for a user's
    Stack that is not an nn.Module) and the step's own `comm` / `offload`: nothing below probes the
    model again."""

    model: object  # the original module (a torch.compile'd model's), whose steps and gradients are checked
    stack: Stack  # its oases.schedule.Stack view (adapt)
    made: Optional[Parallelism]
    comm: Communicator  # the step's TP Communicator (per-layer degrees: one of size 1, unused)
    owned_comm: bool  # made for this call: closed after it
    placements: Optional[LayerPlacements]  # a user's stack's, known before the checks
    per_layer: bool  # per-layer TP degrees (an HF model's placements made after the checks)
    offloader: Optional[Offloader]  # the step's Offloader (None: no offload)
    own_offloader: Optional[Offloader]  # the model's own (GPT(..., offload=True)), kept across steps
    step_seed: Optional[Callable[[], Optional[int]]]  # the stack's dropout seed (None: no dropout)
    takes_position_ids: bool
    takes_attention_mask: bool
    logits_group: Optional[dist.ProcessGroup]  # a vocabulary-parallel head's group (None: whole logits)
    vocab_size: Optional[int]  # V of a padded vocabulary-parallel head

    @property
    def name(self) -> str:
        return type(self.stack).__name__

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        """The group the step's inputs are agreed over: the one the model was made on (the whole
        group with per-layer degrees), else the Communicator's."""
        return self.made.group if self.made is not None else self.comm.group

    @property
    def tp_size(self) -> int:
        return self.made.size if self.made is not None else self.comm.world_size

    def resolved_placements(self) -> Optional[LayerPlacements]:
        """The per-layer placements: known already, or (an HF model's first step) made now, collectively,
        on every rank alike; None at one degree."""
        if not self.per_layer or self.placements is not None:
            return self.placements
        placements = self.stack.layer_placements()
        if placements is None:
            raise ValueError(
                f"tp_degrees: {self.name}.layer_placements() returned None for a model with per-layer tp_degrees"
            )
        return placements


def step_context(
    model: object, comm: Optional[Communicator], sequence_parallel: bool, offload: Union[bool, Offloader]
) -> StepContext:
    """The step context of `model` (see StepContext), with the checks that need only it, on every
    rank alike: per-layer degrees refuse sequence_parallel, comm and offload; an HF or nanoGPT model
    must train with seeded dropout; `comm` must be on the model's TP group."""
    model = original_module(model)  # torch.compile(model): the schedule runs the original's sublayers
    stack = adapt(model)
    made = _made(model)
    get_placements = getattr(stack, "layer_placements", None)
    if made is not None and made.layer_degrees is not None and get_placements is None:
        raise ValueError(
            f"tp_degrees: oases.train_step runs per-layer tp_degrees on oases.models.GPT, Hugging Face "
            f"causal LMs and stacks with layer_placements(), not yet on {type(stack).__name__}; train "
            f"it with loss = model(...) then loss.backward()"
        )
    per_layer = made is not None and made.layer_degrees is not None  # GPT or parallelize(..., tp_degrees=...)
    placements = None if per_layer or get_placements is None else get_placements()  # a user's stack may have them
    per_layer = per_layer or placements is not None
    if per_layer:  # local checks first: an HF model's placements are made (collectively) after the batch's checks
        refuse_with_degrees("sequence_parallel", sequence_parallel)
        refuse_with_degrees("comm", comm)
        refuse_with_degrees("offload", offload)
    if isinstance(stack, (HFStack, NanoGPTStack)):
        stack.check_trainable(seeded=True)  # dropout: masks from the step seed (step_seed)
    step_comm, owned = _step_communicator(model, made, comm, per_layer)
    own_offloader = made.offloader if made is not None else None
    if own_offloader is None and isinstance(getattr(model, "offloader", None), Offloader):
        own_offloader = model.offloader  # a user's model that keeps one, as GPT(..., offload=True) does
    logits_group = getattr(stack, "logits_group", None)  # the Stack protocol's optional members, read once
    return StepContext(
        model=model,
        stack=stack,
        made=made,
        comm=step_comm,
        owned_comm=owned,
        placements=placements,
        per_layer=per_layer,
        offloader=_offloader(own_offloader, offload),
        own_offloader=own_offloader,
        step_seed=getattr(stack, "step_seed", None),
        takes_position_ids=getattr(stack, "takes_position_ids", False),
        takes_attention_mask=getattr(stack, "takes_attention_mask", True),
        logits_group=logits_group,
        vocab_size=getattr(stack, "vocab_size", None) if logits_group is not None else None,
    )


def _made(model: object) -> Optional[Parallelism]:
    """What the model was made into: its record (parallelize, GPT); else, for a model (a user's Stack)
    that keeps its own Communicator as `model.comm` (as GPT does), one on that Communicator's group;
    else what its tensor-parallel modules share (oases.nn.parallelism.find_parallelism)."""
    made = parallelism_of(model)
    if made is not None:
        return made
    own = getattr(model, "comm", None)
    if isinstance(own, Communicator):
        return Parallelism(own.group, own.world_size, comm=own)
    return find_parallelism(model)


def _step_communicator(
    model: object, made: Optional[Parallelism], comm: Optional[Communicator], per_layer: bool
) -> tuple[Communicator, bool]:
    """(the Communicator the step runs on, whether it was made for this call): `comm`, checked to be
    on the model's TP group, else the model's own or a new one on that group (per layer: one of size
    1, unused: the layers' own). ValueError for a `comm` on another group, or none given for a model
    that is not an nn.Module on more than one rank."""
    own = made.comm if made is not None and isinstance(made.comm, Communicator) else None
    if per_layer:
        tp: Optional[Communicator] = Communicator(None, 1)  # unused: the layers' own
    else:
        tp = own if own is not None else None if made is None else Communicator(made.group, made.size)
    if comm is None and tp is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                f"comm: {type(model).__name__} is not an nn.Module, so its TP group is unknown; pass "
                "comm=oases.schedule.Communicator(tp_group, tp_group.size())"
            )
        tp = Communicator(None, 1)
    if comm is None:
        return tp, own is None  # made for this call unless the model's own
    if tp is not None and (not same_group(comm.group, tp.group) or comm.world_size != tp.world_size):
        raise ValueError(
            f"comm: its group (size {comm.world_size}) is not the model's TP group (size "
            f"{tp.world_size}); make it with Communicator(<the group passed to parallelize>, its size)"
        )
    return comm, False


def _offloader(own: Optional[Offloader], offload: Union[bool, Offloader]) -> Optional[Offloader]:
    """The Offloader a step uses: `offload` itself, the model's own (`own`) for True (else a new one), or None."""
    if isinstance(offload, Offloader):
        return offload
    if offload is True:
        return own if own is not None else Offloader()
    if offload is False:
        return None
    raise TypeError(f"offload: expected a bool or an oases.offload.Offloader, got {type(offload).__name__}")
