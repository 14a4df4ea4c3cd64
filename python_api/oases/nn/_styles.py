"""oases.parallelize's plan entries: each style string parsed once into a Style that builds the
shard of one module itself, and a plan resolved against a model (ResolvedPlan: which module each entry places).

    "column", "column:N", "column:qkv", "column:a,b,..."   Style("column", stacked / qkv / parts)
    "row"                                                  Style("row")
    "vocab_head", "vocab", "experts"                       Style(kind)

Style.shard(module, group, ...) is the module's replacement: ColumnParallelLinear / RowParallelLinear
(from_linear, or from_conv1d for a Hugging Face Conv1D), the LM head's gathering column layer,
VocabParallelEmbedding or ParallelExperts (see oases.nn.parallelize).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch.distributed as dist
import torch.nn as nn

from oases.nn._layer_args import is_conv1d
from oases.nn._shared_entry import _SharedEntry
from oases.nn.experts import ParallelExperts
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.vocab import VocabParallelEmbedding

__all__ = ["Style", "parse_style", "ResolvedPlan", "matches", "features", "place", "vocab_entries"]


@dataclass(frozen=True)
class Style:
    """One plan entry, parsed: the kind of shard a module it places becomes (`shard` builds it)."""

    kind: str  # "column", "row", "vocab_head" (an nn.Linear), "vocab" (an nn.Embedding) or "experts"
    stacked: int = 1
    parts: tuple[int, ...] = ()  # unequal blocks' sizes ("column:a,b,c")
    qkv: bool = False  # "column:qkv": parts from the attention module's head counts
    replicas: tuple[int, ...] = ()  # key-value heads at p > kv_heads: ranks per copy, per block (oases.nn._kv)

    def shard(
        self,
        module: nn.Module,
        group: Optional[dist.ProcessGroup],
        *,
        entry: _SharedEntry,
        replica_groups: dict[int, dist.ProcessGroup],
        sequence_parallel: bool,
        chunks: Optional[int],
    ) -> nn.Module:
        """This rank's shard of `module` (checked before) over `group`, its replacement. A column layer
        enters its region through `entry` (its group's, shared by q, k, v) and sums a replicated kv
        head's gradient over its group in `replica_groups` ({c: this rank's group of c ranks})."""
        if self.kind == "vocab":
            return VocabParallelEmbedding.from_embedding(module, group)
        if self.kind == "experts":
            return ParallelExperts.from_experts(module, group)
        column, row = (
            (ColumnParallelLinear.from_conv1d, RowParallelLinear.from_conv1d)
            if is_conv1d(module)
            else (ColumnParallelLinear.from_linear, RowParallelLinear.from_linear)
        )
        if self.kind == "vocab_head":  # the full logits, for the model's own forward and loss
            return column(
                module, group, gather_output=True, pad_vocab=True, sequence_parallel=sequence_parallel, chunks=chunks
            )
        if self.kind != "column":
            return row(module, group, sequence_parallel=sequence_parallel, chunks=chunks)
        layer = column(
            module,
            group,
            stacked=self.stacked,
            parts=self.parts,
            replicas=self.replicas,
            replica_group=replica_groups.get(max(self.replicas, default=1)),
            sequence_parallel=sequence_parallel,
            chunks=chunks,
        )
        layer.use_entry(entry)
        return layer


def parse_style(pattern: str, value: object) -> Style:
    """The Style of the plan entry {pattern: value}, or a ValueError listing the forms."""
    bad = ValueError(
        f"plan[{pattern!r}]: expected 'column', 'column:N' (N equal stacked blocks), 'column:qkv' "
        f"(a fused [q | k | v], blocks from the head counts), 'column:a,b,...' (blocks of these "
        f"sizes), 'row', 'vocab_head' (an LM head nn.Linear), 'vocab' (an nn.Embedding) or 'experts' "
        f"(fused routed experts), got {value!r}"
    )
    if not isinstance(value, str):
        raise bad
    if value in ("vocab", "vocab_head", "experts"):
        return Style(value)
    kind, _, stacked = value.partition(":")
    if kind == "row" and not stacked:
        return Style("row")
    if kind != "column":
        raise bad
    if not stacked:
        return Style("column")
    if stacked == "qkv":
        return Style("column", qkv=True)
    sizes = stacked.split(",")
    if not all(n.isdigit() and int(n) >= 1 for n in sizes):
        raise bad
    if len(sizes) > 1:
        return Style("column", parts=tuple(int(n) for n in sizes))
    return Style("column", int(stacked))


@dataclass
class ResolvedPlan:
    """A plan resolved against one model: its modules, the style each places and the TP degrees;
    oases.nn._plan_checks.check_plan completes the column styles and fills the fields below them."""

    styles: dict[str, Style]  # {pattern: style}, in plan order (the default plan's vocabulary entries too)
    explicit: bool  # a plan of the caller's (not DEFAULT_PLAN): patterns matching nothing are warned about
    linears: dict[str, nn.Module]  # every nn.Linear / Conv1D, by qualified name
    embeddings: dict[str, nn.Module]  # every nn.Embedding
    experts: dict[str, nn.Module]  # every fused routed experts module
    placed: dict[str, Style]  # {projection: its style}
    placed_embeddings: dict[str, Style]
    placed_experts: dict[str, Style]
    degree: Callable[[str], int]  # a module's TP degree: its decoder layer's, else p
    prefix: Optional[str] = None  # per-layer tp_degrees: the decoder layers' name, the layers, their degrees
    decoder_layers: Optional[nn.ModuleList] = None
    degrees: Optional[tuple[int, ...]] = None
    tied: list[tuple[str, str]] = field(default_factory=list)  # (embedding, head) sharing one weight
    attention: dict[str, nn.Module] = field(default_factory=dict)  # parents of sharded head projections
    norms: dict[str, dict[str, tuple[float, bool]]] = field(default_factory=dict)  # their full-width norms
    routers: frozenset[str] = frozenset()  # replicated by design: MoE routers and gates, MLA's down-projections
    inherited: frozenset[str] = frozenset()  # an explicit plan's entries equal to DEFAULT_PLAN's
    # dense regions' whole parameters that are sharded or summed ({name: oases.nn._region_parameters.Placement})
    region_parameters: dict[str, object] = field(default_factory=dict)

    def sharded(self) -> Iterator[tuple[str, nn.Module, Style]]:
        """(name, module, style) of every placed module: projections, embeddings, then experts."""
        yield from ((n, self.linears[n], s) for n, s in self.placed.items())
        yield from ((n, self.embeddings[n], s) for n, s in self.placed_embeddings.items())
        yield from ((n, self.experts[n], s) for n, s in self.placed_experts.items())


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or a Hugging Face Conv1D."""
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features, module.out_features)


def matches(name: str, pattern: str) -> bool:
    """Whether `pattern` matches the qualified `name` or a dotted tail of it (fnmatch)."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def place(modules: dict[str, nn.Module], styles: dict[str, Style]) -> dict[str, Style]:
    """{name: the style of the first pattern matching it} for the `modules` some pattern matches."""
    placed = {}
    for name in modules:
        style = next((s for pattern, s in styles.items() if matches(name, pattern)), None)
        if style is not None:
            placed[name] = style
    return placed


def vocab_entries(model: nn.Module) -> dict[str, Style]:
    """{exact qualified name: "vocab" | "vocab_head"} for the model's input embedding and LM head
    (Hugging Face's accessors, else nanoGPT's wte / lm_head), when they are a plain nn.Embedding and
    nn.Linear, keyed by their qualified names (as plan patterns, they also match a longer name ending
    in them: harmless for the model's own embedding and head paths)."""
    found: dict[str, Style] = {}
    names = {id(m): n for n, m in model.named_modules() if n}
    pairs = []
    for getter, kind in (("get_input_embeddings", "vocab"), ("get_output_embeddings", "vocab_head")):
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            module = None
        pairs.append((module, kind))
    if all(m is None for m, _ in pairs):
        transformer = getattr(model, "transformer", model)
        pairs = [(getattr(transformer, "wte", None), "vocab"), (getattr(model, "lm_head", None), "vocab_head")]
    for module, kind in pairs:
        wanted = nn.Embedding if kind == "vocab" else nn.Linear
        if type(module) is wanted and id(module) in names:  # exactly: subclasses may change forward
            found[names[id(module)]] = Style(kind)
    (embedding, _), (head, _) = pairs
    if (
        head is not None
        and embedding is not None
        and getattr(head, "weight", None) is getattr(embedding, "weight", 0)
        and len(found) == 1
    ):  # tied to an embedding that stays whole (Gemma's scaled one): the head too
        found.clear()
    return found
