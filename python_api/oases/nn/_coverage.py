"""How much of a model is tensor-parallel: `oases.summary(model)`, and parallelize's coverage check.

    s = oases.summary(model)            # on any rank, after oases.parallelize (or before: all replicated)
    s.parts                             # every module holding parameters: name, style, this rank's and
                                        #   the unsharded module's parameter counts
    s.share                             # this rank's parameters / the unsharded model's
    s.layer_coverage                    # sharded / shardable parameters of the decoder layers
    s.left_whole                        # decoder-layer projections left replicated

Shardable decoder-layer parameters are those of the layers' projections (nn.Linear, Conv1D and
the TP layers made of them) and fused routed experts (an MoE block's 3-D gate_up_proj / down_proj,
DBRX's packed mlp.w1 / v1 / w2: oases.nn.experts.expert_weights), less the replicated biases of
row-parallel layers (added once after the reduction: replicated by design), routers and gates (and
a router's own projection: DBRX's router.layer) and multi-head latent attention's low-rank
down-projections (oases.nn._latent); norms are not shardable (a norm over a sharded
width, OLMo-2's q_norm, is counted as sharded when it is). parallelize calls `check_coverage`
with its plan before changing anything: decoder layers whose shardable parameters would stay
mostly replicated (less than half sharded) raise a ValueError with the default plan (a warning
with an explicit one) that names the modules and the plan entries that would shard them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from oases._compiled import original_module
from oases._sharding import tp_rules
from oases.comm.topology import ring_of
from oases.nn.experts import expert_weights, is_experts
from oases.nn.layers import RowParallelLinear
from oases.nn.parts import (
    LATENT_PROJECTIONS,
    attention_of,
    child_calls,
    decoder_layers_of,
    find_stack,
    inner_base,
    is_projection,
    layer_parts,
    mlp_of,
    projections,
)

__all__ = ["Part", "Summary", "summary", "check_coverage", "report", "whole_layers", "ROUTERS"]

# Child names of MoE routers and gates: projections that stay replicated (their outputs pick or weigh experts).
ROUTERS = frozenset({"router", "gate", "shared_expert_gate"})


@dataclass(frozen=True)
class Part:
    """One module holding parameters: its style ("column", "column:3", "column:(64, 32, 32)", "row",
    "vocab", "vocab_head", "sharded_norm", "experts", "sharded" (per-head or per-feature parameters cut
    with their heads or features), "summed" (whole, its gradient summed over the group: each rank
    sees its shard of the features) or "replicated"), this rank's and the unsharded parameter counts."""

    name: str
    style: str
    local: int
    full: int


@dataclass(frozen=True)
class Summary:
    """What parallelize made (module doc). Counts are parameter elements."""

    world_size: int
    parts: tuple[Part, ...]
    local: int  # this rank's parameters
    full: int  # the unsharded model's
    layer_coverage: Optional[float]  # sharded / shardable decoder-layer parameters (None: no decoder layers)
    left_whole: tuple[str, ...]  # decoder-layer projections left replicated

    @property
    def share(self) -> float:
        """This rank's parameters / the unsharded model's (1/p for a fully sharded model)."""
        return self.local / self.full if self.full else 1.0

    def __str__(self) -> str:
        rows = [f"{'module':<48} {'style':<22} {'local':>10} {'full':>10}"]
        rows += [f"{p.name:<48} {p.style:<22} {p.local:>10} {p.full:>10}" for p in self.parts]
        coverage = "n/a" if self.layer_coverage is None else f"{self.layer_coverage:.1%}"
        rows.append(
            f"tp={self.world_size}: {self.local} of {self.full} parameters on this rank ({self.share:.1%}); "
            f"decoder layers sharded: {coverage}"
            + (f"; left whole: {', '.join(self.left_whole)}" if self.left_whole else "")
        )
        return "\n".join(rows)


def _style(module: nn.Module) -> str:
    kind = type(module).__name__
    if kind == "ColumnParallelLinear":
        if module.pad_vocab or module.gather_output:
            return "vocab_head"
        return (
            f"column:({', '.join(map(str, module.parts))})"
            if module.parts
            else f"column:{module.stacked}"
            if module.stacked > 1
            else "column"
        )
    return {
        "RowParallelLinear": "row",
        "VocabParallelEmbedding": "vocab",
        "ShardedRMSNorm": "sharded_norm",
        "ParallelExperts": "experts",
        "PackedExpertShards": "experts",
    }.get(
        kind, "sharded" if hasattr(module, "tp_layout") else "summed" if hasattr(module, "tp_summed") else "replicated"
    )


def _own_parameters(module: nn.Module) -> list:
    return [(n, q) for n, q in module.named_parameters(recurse=False)]


def summary(model: nn.Module) -> Summary:
    """The parts of `model` and how they are sharded on this rank (module doc). Local: no communication.

    Args:
        model: an nn.Module, sharded (e.g. by `oases.parallelize`) or not.

    Returns:
        A Summary: the TP world size, each part (name, style, this rank's and the full parameter
        counts), the totals, the decoder layers' sharded share and the projections they leave whole.

    Raises:
        TypeError: `model` is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    model = original_module(model)  # torch.compile(model): the original's names and layers
    rules = tp_rules(model)
    world = 1
    parts, seen = [], set()
    for name, module in model.named_modules():
        own = [(n, q) for n, q in _own_parameters(module) if id(q) not in seen]
        if not own:
            continue
        local = full = 0
        for leaf, q in own:
            seen.add(id(q))
            local += q.numel()
            rule = rules.get(f"{name}.{leaf}" if name else leaf)
            if rule is None:
                full += q.numel()
            else:
                size = ring_of(rule[1]).size
                world = max(world, size)
                full += rule[0].full_shape(q.shape, size).numel()
        parts.append(Part(name, _style(module), local, full))
    coverage, whole = _layer_coverage(model, rules)
    return Summary(world, tuple(parts), sum(p.local for p in parts), sum(p.full for p in parts), coverage, whole)


def _decoder_layers(model: nn.Module) -> tuple[str, Optional[nn.ModuleList]]:
    """(qualified name, list) of the model's decoder layers: the first non-empty nn.ModuleList child
    of model.base_model (else of the model), or of model.transformer (nanoGPT); ("", None) if none."""
    for owner in (getattr(model, "base_model", None), getattr(model, "transformer", None), model):
        found = decoder_layers_of(inner_base(owner)) if isinstance(owner, nn.Module) else None
        if found is not None:
            prefix = next((n for n, m in model.named_modules() if m is found[1]), "")
            return prefix, found[1]
    return "", None


def whole_layers(model: nn.Module) -> str:
    """A sentence for parallelize's warning when the schedules run some decoder layers whole."""
    stack, _ = find_stack(model)
    if stack is None:
        return ""
    said = {}
    for layer in stack.layers:
        kind = type(layer).__name__
        if kind not in said:
            parts = layer_parts(layer)
            if parts.kind == "whole":
                said[kind] = parts.reason
    return "".join(
        f" oases.train_step runs each {kind} whole, as one sublayer with its own all-reduces "
        f"(exact, without the schedules' overlap): {reason}."
        for kind, reason in said.items()
    )


def _shardable(layer_prefix: str, layer: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """{qualified name: (projection or fused experts, its shardable parameter count)} of a decoder
    layer (module doc)."""
    found = {}
    for name, module in layer.named_modules():
        if is_experts(module):
            count = sum(module.get_parameter(w).numel() for w in expert_weights(module))
            found[f"{layer_prefix}.{name}"] = (module, count)
            continue
        parent, _, leaf = name.rpartition(".")
        if not is_projection(module) or leaf in ROUTERS | LATENT_PROJECTIONS:
            continue
        if parent.rpartition(".")[2] in ROUTERS:  # a router's own projection (DBRX's router.layer)
            continue
        bias = getattr(module, "bias", None)
        count = module.weight.numel()
        if bias is not None and not isinstance(module, RowParallelLinear):
            count += bias.numel()
        found[f"{layer_prefix}.{name}"] = (module, count)
    return found


def _layer_coverage(model: nn.Module, rules: dict) -> tuple[Optional[float], tuple[str, ...]]:
    prefix, layers = _decoder_layers(model)
    if layers is None:
        return None, ()
    sharded = total = 0
    whole = []
    for i, layer in enumerate(layers):
        for name, (module, count) in _shardable(f"{prefix}.{i}", layer).items():
            weight_rule = rules.get(f"{name}.{expert_weights(module)[0] if is_experts(module) else 'weight'}")
            full = count if weight_rule is None else count * ring_of(weight_rule[1]).size
            total += full
            if weight_rule is None:
                whole.append(name)
            else:
                sharded += full
    return (sharded / total if total else None), tuple(whole)


def _suggestion(layer: nn.Module, part: str, child: str) -> str:
    """The plan entry that would shard projection `child` of the layer's part `part`."""
    module = layer.get_submodule(part)
    if is_experts(module.get_submodule(child)):
        return f"{child!r}: 'experts'"
    called = [n for n in (child_calls(type(module).forward) or []) if n in projections(module)]
    last = called[-1] if called else list(projections(module))[-1]
    return f"{child!r}: {'row' if child == last else 'column'!r}"


def check_coverage(
    model: nn.Module, planned: set[str], explicit: bool, skip_layers: frozenset[int] = frozenset()
) -> None:
    """Before parallelize changes anything: ValueError (default plan) or a warning (explicit plan)
    when the decoder layers' shardable parameters would stay mostly replicated; `planned` are
    the qualified names of the projections the plan shards, `skip_layers` layers left whole on purpose."""
    prefix, layers = _decoder_layers(model)
    if layers is None:
        return
    sharded = total = 0
    whole: dict[str, str] = {}
    for i, layer in enumerate(layers):
        if i in skip_layers:
            continue
        attention = attention_of(layer)
        parts = [p for p in (attention, mlp_of(layer, attention)) if p is not None]
        for name, (module, count) in _shardable(f"{prefix}.{i}", layer).items():
            total += count
            if name in planned:
                sharded += count
                continue
            local = name[len(f"{prefix}.{i}.") :]
            part = next((p for p in parts if local.startswith(p + ".") and local.count(".") == p.count(".") + 1), None)
            whole[name] = _suggestion(layer, part, local.rpartition(".")[2]) if part else ""
    if not total or sharded * 2 >= total:
        return
    entries = sorted({s for s in whole.values() if s})
    message = (
        f"oases.parallelize: the plan shards {sharded / total:.0%} of the decoder layers' projection "
        f"parameters of {type(model).__name__}; left whole (replicated on every rank): "
        f"{', '.join(list(whole)[:12])}{' ...' if len(whole) > 12 else ''}. "
        + (
            f"Plan entries that would shard them: {{{', '.join(entries)}}} (merge with "
            f"{{**oases.nn.DEFAULT_PLAN, ...}})"
            if entries
            else "Name them in plan= ('column' / 'row')"
        )
    )
    if explicit:
        warnings.warn(message, UserWarning, stacklevel=4)  # check_coverage <- check_plan <- parallelize <- caller
        return
    raise ValueError(message + "; pass plan= to shard them (or to keep them whole on purpose)")


def report(model: nn.Module, unplaced: list[str]) -> str:
    """The part of parallelize's warning about the decoder-layer projections left whole, with their share."""
    prefix, layers = _decoder_layers(model)
    if layers is None or not unplaced:
        return ""
    total = 0
    left = 0
    names = set(unplaced)
    for i, layer in enumerate(layers):
        for name, (module, count) in _shardable(f"{prefix}.{i}", layer).items():
            full = count * (module.world_size if hasattr(module, "tp_layout") else 1)
            total += full
            left += full if name in names else 0
    return f" Decoder-layer projections left whole: {left / total:.1%} of their parameters." if total and left else ""
