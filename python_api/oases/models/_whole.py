"""A decoder layer the schedules cannot split, run whole as one oases.schedule.Sublayer.

A schedule's sublayer is x + finish(all_reduce(core(norm(x)))), `finish` affine. A layer whose
forward is not of that form (OLMo-2's norms after its branches, Gemma-2's four norms, a scaled
residual) runs as one sublayer whose core is the whole layer, its tensor-parallel layers
communicating themselves (as in the model's own forward), and whose all-reduce the schedule
owns adds nothing but the lead rank's difference y - x:

    norm(x)      = x (a view)
    core(h, ctx) = lead_only(layer(h', **ctx.layer_kwargs[index]) - h'),  h' = grad_on_lead(h)
                     lead_only:    fwd: the value on the group's rank 0, zeros elsewhere; bwd: identity
                     grad_on_lead: fwd: identity; bwd: the gradient on rank 0, zeros elsewhere
    finish(z)    = z
    => x + all_reduce(core) = x + (layer(x) - x)       (equal to layer(x) up to one rounding)

In backward every rank gets the whole gradient of the output (the all-reduce's adjoint is the
identity), so each runs the layer's backward as the model's own loss.backward() would (its
parameters' gradients exact), and only rank 0's gradient of x enters the schedule's all-reduce
of the input gradient (the others' are the same value: summing them would count it p times).
The layer's own all-reduces make this slower than a split layer: nothing overlaps them.
Sequence parallelism is not supported (sequence_parallel_parameters raises, naming the layer).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.comm.topology import ring_of
from oases.models._branch import NOT_PASSED
from oases.nn.mappings import grad_on_lead, lead_only

__all__ = ["WholeLayer"]


class WholeLayer:
    """One decoder layer as one sublayer (module doc); `group` is the TP group its all-reduce is on
    (`alone`: none, a layer of TP degree 1 whose schedule communicator has one rank)."""

    def __init__(
        self, index: int, layer: nn.Module, group: Optional[dist.ProcessGroup], *, alone: bool = False
    ) -> None:
        self.index, self.layer = index, layer
        self.lead = alone or not dist.is_initialized() or ring_of(group).rank == 0

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)  # not x itself: the schedule differentiates it as a function of x

    def core(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        kwargs = {k: v for k, v in ctx.layer_kwargs[self.index].items() if k not in NOT_PASSED}
        h = grad_on_lead(h, self.lead)
        y = self.layer(h, **kwargs)
        y = y[0] if isinstance(y, tuple) else y
        return lead_only(y - h, self.lead)

    def finish(self, z: torch.Tensor, ctx: Any) -> torch.Tensor:
        return z

    def sequence_parallel_parameters(self) -> list[torch.Tensor]:
        """Refused: a layer run whole needs the whole sequence (ValueError naming it and the fix)."""
        raise ValueError(
            f"sequence_parallel=True: decoder layer {self.index} ({type(self.layer).__name__}) runs whole (its "
            f"forward is not norm -> branch -> residual, e.g. norms after its branches), so its input cannot be "
            f"split along the sequence; train this model with sequence_parallel=False"
        )

    def parameters(self) -> list[nn.Parameter]:
        return list(self.layer.parameters())
