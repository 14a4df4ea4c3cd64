"""Where a pipeline stage's layers sit: the folding of L layers into ns segments of p stages (FOLD3D §3.2
step 1; the picture is in oases.pipeline.stages), and the placement checks built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

__all__ = ["StageLayout", "check_layers", "placement_of_layer", "shared_across_placements"]


@dataclass(frozen=True)
class StageLayout:
    """Where stage `stage` of `stages` sits when `layers` layers are folded into `segments` segments."""

    layers: int
    stages: int
    segments: int
    stage: int

    def __post_init__(self) -> None:
        if self.layers % (self.stages * self.segments):
            raise ValueError(
                f"config.layers: {self.layers} is not divisible by pp * segments = {self.stages} * {self.segments}"
            )

    @property
    def chunk(self) -> int:
        """Layers per (segment, stage)."""
        return self.layers // (self.stages * self.segments)

    def layers_of(self, segment: int) -> range:
        """This stage's `chunk` consecutive layers of segment `segment` (after the earlier stages')."""
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


def check_layers(what: str, layers: int, pp: int, segments: int) -> None:
    """ValueError unless `layers` layers fold into pp stages of `segments` segments."""
    if layers % (pp * segments):
        raise ValueError(f"{what}: {layers} layers are not divisible by pp * segments = {pp} * {segments}")


def placement_of_layer(index: int, layers: int, stages: int, segments: int) -> tuple[int, int]:
    """(segment, stage) holding layer `index` (StageLayout's folding, seen from any stage)."""
    per_segment = layers // segments
    return index // per_segment, (index % per_segment) // (per_segment // stages)


def shared_across_placements(
    model: nn.Module,
    layer_params: list[list[nn.Parameter]],
    embed_params: list[nn.Parameter],
    head_params: list[nn.Parameter],
    stages: int,
    segments: int,
) -> Optional[str]:
    """The name of a parameter used at two (segment, stage) placements, or None; one that only the
    embedding and the head use (tied input/output embeddings) is allowed.

        place(layer i) = placement_of_layer(i);  place(embedding) = (0, 0);  place(head) = (ns-1, p-1)"""
    places: dict[int, set[tuple[int, int]]] = {}
    for i, params in enumerate(layer_params):
        for p in params:
            places.setdefault(id(p), set()).add(placement_of_layer(i, len(layer_params), stages, segments))
    tied = {id(p) for p in embed_params} & {id(p) for p in head_params}
    for params, place in ((embed_params, (0, 0)), (head_params, (segments - 1, stages - 1))):
        for p in params:
            if id(p) not in tied or id(p) in places:  # (a tied one in a layer too: refused)
                places.setdefault(id(p), set()).add(place)
    names = {id(p): n for n, p in model.named_parameters()}
    return next((names.get(i, "?") for i, where in places.items() if len(where) > 1), None)
