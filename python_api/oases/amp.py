"""Loss scaling whose inf/NaN verdict is the whole group's, so every rank skips the same steps.

torch.amp.GradScaler checks the gradients a rank holds. After oases.parallelize each rank holds
shards (and a pipeline stage only its layers), so an overflow in one rank's shard would make
that rank skip the step while the others take it: the replicas of one model diverge. Here::

    scaler.unscale_(optimizer):   grads /= scale;  found = any inf/NaN in this rank's grads
                                  found = max(found over `group`)      # one all_reduce, every rank
    scaler.unscale_together_(optimizers): the same, one verdict for all of them (a pipeline's segments)
    scaler.step(optimizer):       optimizer.step() unless found        # the same decision everywhere
    scaler.update():              scale *= backoff if found else (growth after growth_interval)

Use it as torch.amp.GradScaler (scale / step / update; `unscale_` before clipping). `group`: the
ranks that train one model together (default: the world, which covers TP, pipeline stages and
dp replicas at once). Each call of step() (or `unscale_`) is a collective over `group`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from oases._checks import process_group

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose found-inf flag is all-reduced (max) over `group`; see the module
    docstring. Other arguments as torch.amp.GradScaler's."""

    def __init__(self, device: str = "cuda", *, group: Optional[dist.ProcessGroup] = None, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.group = process_group(group)  # a 1-D DeviceMesh: its group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """grads /= scale for `optimizer`, with the found-inf verdict taken over `group`:
        unscale_together_([optimizer])."""
        self.unscale_together_([optimizer])

    def unscale_together_(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """`unscale_` each optimizer, then one verdict for all of them over `group` (one all_reduce):
        the optimizers of one model's parts (a pipeline's segments) step or skip together, as the
        model's single optimizer would."""
        for optimizer in optimizers:
            super().unscale_(optimizer)
        if not self.is_enabled() or not dist.is_initialized() or not optimizers:
            return
        states = [self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] for optimizer in optimizers]
        flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for per_device in states:
            for found in per_device.values():
                flag += found.to(flag.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        for per_device in states:
            for found in per_device.values():
                found.copy_(flag)  # every device's entry carries the group's verdict
            if not per_device:  # an optimizer without gradients (a frozen stage) still learns the verdict
                per_device[flag.device] = flag.clone()
