"""`Parallelism`: what oases.parallelize (or oases.models.GPT) made a model into, in one record.

::

    model = oases.parallelize(model, tp_group, ...)    # or oases.models.GPT(config, tp_group, ...)
    made = parallelism_of(model)                        # model.oases_parallelism
    made.group, made.size                 # the TP group its sharded modules share, and its size p
    made.layer_degrees                    # per-layer TP degrees (an oases.degrees.LayerDegrees) or None
    made.offloader                        # the model's own oases.offload.Offloader (GPT(..., offload=True))
    made.comm                             # the model's own oases.schedule.Communicator (GPT), kept across steps

A model whose tensor-parallel modules were put in by hand (ColumnParallelLinear, ... in its own
`__init__`) has no record; `find_parallelism` then finds its group from those modules (each has
`tp_layout()` and `group`). oases.train_step reads the record in one place
(oases._step_context) and never probes the model for the parts it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from oases.comm.topology import same_group
from oases.degrees import LayerDegrees
from oases.offload import Offloader

__all__ = ["Parallelism", "parallelism_of", "find_parallelism", "record", "ATTRIBUTE"]

ATTRIBUTE = "oases_parallelism"  # where parallelize and GPT keep the record on the model


@dataclass(frozen=True)
class Parallelism:
    """What a model was made into (see the module docstring); frozen, made once by parallelize or GPT.

    `group` None with `size` 1: not sharded; `comm` is typed loosely because the Communicator lives
    above this floor (oases.schedule), as does the step that uses it."""

    group: Optional[dist.ProcessGroup]
    size: int
    layer_degrees: Optional[LayerDegrees] = None
    offloader: Optional[Offloader] = None
    comm: Optional[Any] = None

    @property
    def tp_degrees(self) -> Optional[tuple[int, ...]]:
        """The per-layer degrees (None: every layer at `size`)."""
        return None if self.layer_degrees is None else self.layer_degrees.degrees


def record(model: nn.Module, made: Parallelism) -> None:
    """Keep `made` on `model` (as ATTRIBUTE), where parallelism_of finds it."""
    object.__setattr__(model, ATTRIBUTE, made)


def parallelism_of(model: object) -> Optional[Parallelism]:
    """The record parallelize or GPT kept on `model` (None: it has none)."""
    made = getattr(model, ATTRIBUTE, None)
    return made if isinstance(made, Parallelism) else None


def find_parallelism(model: object) -> Optional[Parallelism]:
    """The model's record, else one found from its tensor-parallel modules (their one shared group;
    size 1 without any, or before torch.distributed is initialized); None for an object that is not
    an nn.Module and has no record (a user's own Stack: its step is told its Communicator).
    ValueError when the modules use different groups."""
    made = parallelism_of(model)
    if made is not None:
        return made
    if not isinstance(model, nn.Module):
        return None
    groups: list[Optional[dist.ProcessGroup]] = []
    for m in model.modules():
        if hasattr(m, "tp_layout") and not any(same_group(m.group, g) for g in groups):
            groups.append(m.group)
    if len(groups) > 1:
        raise ValueError(
            "model: its tensor-parallel modules use different process groups; oases.train_step "
            "runs one TP group (parallelize the model once, with one group)"
        )
    if not groups or not dist.is_initialized():
        return Parallelism(None, 1)
    return Parallelism(groups[0], dist.get_world_size(groups[0]))
