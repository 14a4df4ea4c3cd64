"""Which layers a pipeline stage holds, and the stage module that runs them (FOLD3D §3.2 step 1).

With p stages and ns segments, the L layers are cut into ns segments of L/ns layers and each
segment into p chunks of c = L/(ns*p) layers; stage s holds chunk s of every segment:

    layers_of(stage=s, segment=k) = range(k*L/ns + s*c, k*L/ns + (s+1)*c)
    L=12, ns=2, p=3 (c=2):  stage 0: (0,1) (6,7)   stage 1: (2,3) (8,9)   stage 2: (4,5) (10,11)

Seen as one chain, (segment k, stage s) is the *virtual stage* v = k*p + s: activations flow
v -> v+1 (from stage p-1 of segment k to stage 0 of segment k+1 between segments), gradients
v+1 -> v. The embedding (wte + wpe) sits before v = 0, the final norm, LM head and loss after
v = ns*p - 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from oases.models.gpt import GPT, GPTConfig
from oases.nn._mappings import copy_to_tp, reduce_from_tp
from oases.schedule import SubBatch

__all__ = ["StageLayout", "Stage"]


@dataclass(frozen=True)
class StageLayout:
    """Where stage `stage` of `stages` sits when `layers` layers are folded into `segments` segments."""

    layers: int
    stages: int
    segments: int
    stage: int

    def __post_init__(self) -> None:
        if self.layers % (self.stages * self.segments):
            raise ValueError(f"config.layers: {self.layers} is not divisible by pp * segments = "
                             f"{self.stages} * {self.segments}")

    @property
    def chunk(self) -> int:
        """Layers per (segment, stage)."""
        return self.layers // (self.stages * self.segments)

    def layers_of(self, segment: int) -> range:
        start = segment * (self.layers // self.segments) + self.stage * self.chunk
        return range(start, start + self.chunk)

    def virtual(self, segment: int) -> int:
        """The position of (segment, this stage) in the chain of ns * p virtual stages."""
        return segment * self.stages + self.stage

    def is_first(self, segment: int) -> bool:
        """Runs the embedding (virtual stage 0)."""
        return self.virtual(segment) == 0

    def is_last(self, segment: int) -> bool:
        """Runs the final norm, LM head and loss (virtual stage ns*p - 1)."""
        return self.virtual(segment) == self.stages * self.segments - 1


class Stage(nn.Module):
    """This rank's part of a GPT: its layers of every segment, the embedding on the first stage,
    the head on the last. State-dict keys are the GPT's own ("blocks.6.0.qkv.weight", ...).

        stage = Stage(config, layout, tp_group, seed=0)  # values: GPT(config, tp_group, seed=0)'s
        y = stage.forward_segment(k, x)       # x [b, t, h] (tokens [b, t] on virtual stage 0)
        loss_sum = stage.loss_sum(y, targets) # last virtual stage: summed token cross-entropy

    Each layer runs under torch.utils.checkpoint (non-reentrant): only its input is kept, its
    inside is recomputed in backward, TP all-reduces included.
    """

    def __init__(self, config: GPTConfig, layout: StageLayout, tp_group: Optional[dist.ProcessGroup],
                 *, seed: int = 0) -> None:
        super().__init__()
        # Build the whole (TP-sharded) GPT so initialisation is exactly GPT's, then keep our part.
        # Costs the full model's memory once, at construction (fine for the models tested here).
        full = GPT(config, tp_group, seed=seed)
        self.config, self.layout, self.tp, self.group = config, layout, full.tp, full.group
        self.key_order = list(full.state_dict())  # the GPT's state-dict order, for state_dict()
        held = [i for k in range(layout.segments) for i in layout.layers_of(k)]
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in held})
        self.wte = full.wte if layout.is_first(0) else None
        self.wpe = full.wpe if layout.is_first(0) else None
        last = layout.is_last(layout.segments - 1)
        self.norm_f = full.norm_f if last else None
        self.lm_head = full.lm_head if last else None

    def segment_parameters(self, segment: int) -> list[nn.Parameter]:
        """The parameters segment `segment` of this stage uses (embedding / head included)."""
        params = [p for i in self.layout.layers_of(segment) for p in self.blocks[str(i)].parameters()]
        if self.layout.is_first(segment):
            params = [*self.wte.parameters(), *self.wpe.parameters(), *params]
        if self.layout.is_last(segment):
            params += [*self.norm_f.parameters(), *self.lm_head.parameters()]
        return params

    def _layer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """GPT.forward's block `index`: x = x + finish(reduce_from_tp(core(copy_to_tp(norm(x))))) twice."""
        where = SubBatch(slice(0, x.shape[0]), x.shape[0])  # no dropout (checked by the Pipeline)
        for s in self.blocks[str(index)]:
            h = s.norm(x)
            if self.tp > 1:
                x = x + s.finish(reduce_from_tp(s.core(copy_to_tp(h, self.group)), self.group), where)
            else:
                x = x + s.finish(s.core(h), where)
        return x

    def forward_segment(self, segment: int, x: torch.Tensor) -> torch.Tensor:
        """Segment `segment`'s layers on x [b, t, h]; on virtual stage 0, x is tokens [b, t] (int64)."""
        if self.layout.is_first(segment):
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))  # (b, t, h)
        for i in self.layout.layers_of(segment):
            x = checkpoint(self._layer, i, x, use_reentrant=False)
        return x

    def loss_sum(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of the head on x [b, t, h] against targets [b, t] (not shifted)."""
        logits = self.lm_head(self.norm_f(x))  # (b, t, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
