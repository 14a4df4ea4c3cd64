"""oases.parallelize's checks: its arguments, a per-layer plan's decoder layers and degrees, and a
plan resolved against the model (check_plan). Every one is local (no communication), the same on
every rank, and runs before anything is replaced, so a bad input raises a ValueError / TypeError
naming the fix and leaves the model as it was, on every rank alike.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from oases import _checks
from oases.degrees import find_layer_degrees, refuse_with_degrees
from oases.nn import _alibi, _heads, _kv, _moe, lora
from oases.nn import _coverage as _summary
from oases.nn._layer_args import check_shardable, is_conv1d
from oases.nn._region_parameters import place_region_parameters
from oases.nn._styles import ResolvedPlan, Style, features, matches
from oases.nn.materialize import check_replayable, is_on_meta
from oases.nn.parts import HEAD_PROJECTIONS, LATENT_PROJECTIONS
from oases.nn.vocab import check_embedding, check_vocab

__all__ = ["check_model", "check_arguments", "check_degree_plan", "check_plan"]

# Attention modules whose forward fixes how the fused projection's features map to heads, whatever
# the module's head counts say (the exceptions to sharding by parts).
_UNSHARDABLE_ATTENTION: Mapping[str, str] = MappingProxyType(
    {"CodeGenAttention": "splits its fused qkv_proj into mp_num = 4 groups fixed in its forward"}
)


def check_model(model: object, device: object, init_weights: object, allocate: object) -> Optional[torch.device]:
    """The device a meta-built `model` is materialised on (None: the model has real tensors), after
    checking the model, device, init_weights and allocate arguments."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    target = _target_device(model, device, init_weights)
    if allocate is not None and (target is None or not callable(allocate)):
        raise TypeError("allocate: a callable name -> bool, only with device= (a model built on meta)")
    if target is not None and init_weights:
        check_replayable(model)
    return target


def _target_device(model: nn.Module, device: object, init_weights: object) -> Optional[torch.device]:
    """The device a meta-built model is materialised on (None: the model has real tensors)."""
    if not isinstance(init_weights, bool):
        raise TypeError(f"init_weights: expected a bool, got {init_weights!r}")
    on_meta = is_on_meta(model)
    if device is None:
        if on_meta:
            raise ValueError(
                "model: has tensors on the meta device; pass device='cpu' (or 'cuda', ...) so that "
                "parallelize allocates this rank's shards there"
            )
        return None
    try:
        target = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise TypeError(f"device: expected a torch.device or a device string such as 'cpu', got {device!r}") from err
    if target.type == "meta":
        raise ValueError("device: 'meta' allocates nothing; pass the device this rank's shards live on")
    if not on_meta:
        raise ValueError(
            "device: is for models built on the meta device (`with torch.device('meta'): "
            "model = Cls(config)`); this one has real tensors: drop device= (or move the model "
            "with model.to(device) first)"
        )
    return target


def check_arguments(
    model: nn.Module,
    chunks: Optional[int],
    tp_degrees: object,
    layers: Optional[str],
    sequence_parallel: bool,
    vocab_parallel: object,
) -> None:
    """The model is not a single layer nor wrapped with adapters, and the options go together."""
    if isinstance(model, nn.Linear):
        raise TypeError(
            "model: is itself an nn.Linear; use ColumnParallelLinear.from_linear or "
            "RowParallelLinear.from_linear for a single layer"
        )
    if isinstance(model, nn.Embedding):
        raise TypeError("model: is itself an nn.Embedding; use VocabParallelEmbedding.from_embedding")
    if chunks is not None:
        _checks.chunks_arg(chunks)
    if layers is not None and tp_degrees is None:
        raise ValueError(
            f"layers={layers!r}: names the decoder layers of a per-layer plan, and no tp_degrees "
            f"was given; pass tp_degrees=[one degree per layer] too, or drop layers"
        )
    if tp_degrees is not None:
        refuse_with_degrees("sequence_parallel", sequence_parallel)
    _check_no_adapters(model)
    hf = _transformers_module(model) if sequence_parallel else None
    if hf is not None:
        raise ValueError(
            f"sequence_parallel=True: {hf} is a Hugging Face transformers model, whose embeddings, "
            "norms and attention expect the whole sequence on every rank; sequence parallelism needs "
            "a model written for [s/p, b, h] activations. Use sequence_parallel=False here, and "
            "oases.train_step(model, ..., sequence_parallel=True) for sequence parallelism in training"
        )
    if not isinstance(vocab_parallel, bool):
        raise TypeError(f"vocab_parallel: expected a bool, got {vocab_parallel!r}")


def _check_no_adapters(model: nn.Module) -> None:
    """A module wrapping a `base_layer` with adapters beside it is refused (ValueError naming the
    modules), unless it is PEFT's own LoRA layer on a linear with settings oases' LoRA layers take
    (oases.nn.lora.peft_lora_layers, which names what it does not take): parallelize shards those
    with their adapters. A look-alike of PEFT's layers is not one of them."""
    accepted = set(lora.peft_lora_layers(model))
    wrapped = [
        name
        for name, m in model.named_modules()
        if name not in accepted
        and isinstance(getattr(m, "base_layer", None), nn.Module)
        and any(n != "base_layer" for n, _ in m.named_children())
    ]
    if wrapped:
        is_lora = all(hasattr(model.get_submodule(n), "lora_A") for n in wrapped)
        raise ValueError(
            f"model: {wrapped[0]}"
            + (f" (and {len(wrapped) - 1} more)" if len(wrapped) > 1 else "")
            + f" wraps its base_layer with {'LoRA adapters (lora_A / lora_B)' if is_lora else 'adapters'} that are "
            f"not PEFT's LoRA layers (peft.tuners.lora.Linear, which oases.parallelize shards with their adapters); "
            f"oases.parallelize shards plain projections, not other adapters. Merge them into the weights before "
            f"parallelize (model = model.merge_and_unload()), or train without them"
        )


def _transformers_module(model: nn.Module) -> Optional[str]:
    """The class name of the first Hugging Face transformers module in `model`, if any."""
    for module in model.modules():
        if _checks.from_transformers(module):
            return type(module).__name__
    return None


def check_degree_plan(
    model: nn.Module, tp_degrees: object, layers: Optional[str], styles: dict[str, Style], p: int
) -> tuple[str, nn.ModuleList, tuple[int, ...]]:
    """(decoder layers' name, the layers, the degrees) of a per-layer plan, or ValueError / TypeError
    (local checks, the same on every rank, before any subgroup is made): oases.degrees.find_layer_degrees,
    and no vocabulary-parallel style in the plan."""
    prefix, found, degrees = find_layer_degrees(model, tp_degrees, layers, p)
    for pattern, style in styles.items():
        if style.kind in ("vocab", "vocab_head"):
            raise ValueError(
                f"plan[{pattern!r}]: {style.kind!r} is not supported with per-layer tp_degrees (the "
                f"embedding and the LM head run replicated on every rank); remove it or pass "
                f"tp_degrees=None"
            )
    return prefix, found, degrees


def check_plan(model: nn.Module, plan: ResolvedPlan, p: int) -> None:
    """Every check of a resolved plan, in this order: completes its column styles (a fused qkv's
    blocks, kv heads' replicas) and records in `plan` its ties, attention modules, their full-width
    norms and the MoE blocks' routers. Nothing of the model is changed."""
    _check_kinds(plan.styles, plan.linears, plan.embeddings)
    _resolve_qkv(model, plan.placed, plan.linears)
    columns = {n: (s.stacked, s.parts) for n, s in plan.placed.items() if s.kind == "column"}
    for name, replicas in _kv.plan_replicas(model, columns, plan.degree, plan.degrees is not None).items():
        plan.placed[name] = dataclasses.replace(plan.placed[name], replicas=replicas)  # kv heads at p > kv_heads
    for name, style in plan.placed.items():
        _check_layers({name: style}, plan.linears, plan.degree(name))
        _check_plain(name, plan.linears[name], style)
    for name in plan.placed_embeddings:
        embedding = plan.embeddings[name]
        check_embedding(
            f"{name} (nn.Embedding {embedding.num_embeddings} x {embedding.embedding_dim}, planned as 'vocab')",
            embedding,
            p,
        )
    vocab_heads = [n for n, s in plan.placed.items() if s.kind == "vocab_head"]
    plan.tied = _check_ties(model, list(plan.placed) + list(plan.placed_embeddings), frozenset(vocab_heads))
    plan.attention = _attention_modules(model, plan.placed)
    plan.norms = {name: _check_attention(name, module, plan) for name, module in plan.attention.items()}
    plan.routers = _moe.check_blocks(
        model,
        {n: plan.experts[n] for n in plan.placed_experts},
        {n: s.kind for n, s in plan.placed.items()},
        plan.degree,
        p,
    ) | frozenset(
        f"{name}.{child}" if name else child
        for name, module in plan.attention.items()
        for child, _ in module.named_children()
        if child in LATENT_PROJECTIONS
    )
    if p > 1:
        skip = frozenset(i for i, d in enumerate(plan.degrees or ()) if d == 1)
        _summary.check_coverage(
            model,
            {n for n, s in plan.placed.items() if s.kind in ("column", "row")} | set(plan.placed_experts),
            plan.explicit,
            skip,
        )
    _check_parts(model, plan.placed, plan.linears, plan.degree)
    plan.region_parameters = place_region_parameters(
        model, plan.placed, plan.linears, plan.attention, plan.placed_experts, plan.degree, p
    )


def _check_kinds(styles: dict[str, Style], linears: dict[str, nn.Linear], embeddings: dict[str, nn.Embedding]) -> None:
    """A vocabulary entry that would place no module of its kind but names one of the other kind is a slip."""
    for pattern, style in styles.items():
        if style.kind not in ("vocab", "vocab_head"):
            continue
        own, other = (embeddings, linears) if style.kind == "vocab" else (linears, embeddings)
        if any(matches(n, pattern) for n in own):
            continue
        wrong = next((n for n in other if matches(n, pattern)), None)
        if wrong is not None:
            is_a, use = ("an nn.Linear", "'vocab_head'") if style.kind == "vocab" else ("an nn.Embedding", "'vocab'")
            raise ValueError(f"plan[{pattern!r}]: {style.kind!r} matches {wrong}, {is_a}; use {use} for it")


def _resolve_qkv(model: nn.Module, placed: dict[str, Style], linears: dict[str, nn.Module]) -> None:
    """Fused q/k/v projections get their blocks. Where the attention class's forward fixes the layout
    (_heads.fused_layout: DBRX, GPTBigCode, Falcon, ...) it decides, whatever column variant the plan
    gives: [q | k | v] blocks -> (q, k, v) widths from the head counts, head by head or group by group
    -> whole-width shards ("column"). Elsewhere 'column:qkv' entries get (q, k, v) widths."""
    for name, style in placed.items():
        if style.kind != "column":
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layout = _heads.fused_layout(parent, leaf)
        if layout is None and style.qkv:
            layout = "qkv"
        if layout == "qkv":
            parts = _heads.qkv_parts(name, parent, features(linears[name])[1])
            placed[name] = Style("column", parts=parts)
        elif layout in ("heads", "groups"):
            placed[name] = Style("column")
        elif layout is not None:
            raise ValueError(
                f"{name}: {type(parent).__name__}'s {leaf} is a cross-attention's fused [k | v] (its queries "
                f"come from another projection), a layout oases does not shard; leave this attention "
                f"unsharded (plan= without {leaf!r} and its output projection)"
            )


def _check_layers(placed: dict[str, Style], linears: dict[str, nn.Module], p: int) -> None:
    for name, style in placed.items():
        linear = linears[name]
        n_in, n_out = features(linear)
        kind = "Conv1D" if is_conv1d(linear) else "nn.Linear"
        owner = f"{name} ({kind} {n_in} -> {n_out}, planned as {style.kind!r})"
        if style.kind == "column":
            check_shardable(owner, "out_features", n_out, p, style.stacked, style.parts, style.replicas)
        elif style.kind == "vocab_head":
            if is_conv1d(linear):
                raise ValueError(f"{owner}: a vocabulary-parallel head must be an nn.Linear; remove it from the plan")
            check_vocab(owner, "out_features", n_out, p)
        else:
            check_shardable(owner, "in_features", n_in, p)


# nn.Linear subclasses whose forward is F.linear's, written out: x @ weight.T + bias (FalconLinear
# adds the bias after the matmul, as its checkpoints were trained).
_LINEAR_FORWARDS = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_plain(name: str, module: nn.Module, style: Style) -> None:
    """A planned projection is replaced by a parallel layer holding its weight and bias only: one
    that does more (its own forward, other parameters, buffers or submodules, hooks, a
    parametrization) would silently lose it, so it is refused (ValueError naming what)."""
    kind = "Conv1D" if is_conv1d(module) else "nn.Linear"
    base = next(c for c in type(module).__mro__ if c is nn.Linear or (kind == "Conv1D" and c.__name__ == "Conv1D"))
    extra = [n for n, t in module._parameters.items() if t is not None and n not in ("weight", "bias")]
    extra += [n for n, t in module._buffers.items() if t is not None]
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    hooks = [h for h in kinds if getattr(module, h, None)]
    if parametrize.is_parametrized(module):
        what = f"has a parametrization of {', '.join(module.parametrizations)} (e.g. weight_norm)"
    elif type(module).forward is not base.forward and _qualified(type(module)) not in _LINEAR_FORWARDS:
        what = f"is a {type(module).__name__} whose forward is not {base.__name__}'s"
    elif extra:
        what = f"holds {', '.join(extra)} beside its weight and bias"
    elif any(True for _ in module.children()):
        what = f"has submodules ({', '.join(n for n, _ in module.named_children())})"
    elif hooks:
        what = f"has {hooks[0].strip('_').replace('_', ' ')} on it"
    else:
        return
    raise ValueError(
        f"{name} (planned as {style.kind!r}) {what}; oases replaces it by a parallel layer that keeps its weight and "
        f"bias only, which would silently drop that. Make it a plain {kind} (do the rest in its parent's forward), "
        f"or leave it out of the plan (replicated)"
    )


def _check_ties(model: nn.Module, names: list[str], vocab: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The (embedding, head) pairs among the planned modules `names` that share one weight
    (tie_word_embeddings; `vocab`: the heads planned 'vocab_head'): both sharded, they keep sharing
    one shard. Any other tie of a planned module (to another module, or the module itself under
    several names) raises a ValueError (sharding it alone would silently untie it)."""
    holders: dict[int, list[str]] = {}
    for qualified, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(qualified)
    planned = {f"{name}.weight": name for name in names}
    pairs = []
    for name in names:
        others = [n for n in holders[id(model.get_submodule(name).weight)] if n != f"{name}.weight"]
        if len(others) == 1 and others[0] in planned:
            a, b = name, planned[others[0]]
            embedding = a if isinstance(model.get_submodule(a), nn.Embedding) else b
            head = b if embedding == a else a
            if (
                isinstance(model.get_submodule(embedding), nn.Embedding)
                and isinstance(model.get_submodule(head), nn.Linear)
                and head in vocab
            ):
                if (embedding, head) not in pairs:
                    pairs.append((embedding, head))
                continue
        if others:
            raise ValueError(
                f"{name}: its weight is tied to {', '.join(others)} (the same Parameter, e.g. "
                f"tie_word_embeddings=True, or one module under several names); sharding it alone would silently "
                f"untie them. "
                + (
                    "Plan both ends of the tie (the embedding as 'vocab', the head as 'vocab_head': they share one "
                    "shard), untie them "
                    if isinstance(model.get_submodule(name), nn.Embedding) or name in vocab
                    else "Untie them "
                )
                + f"({name}.weight = nn.Parameter({name}.weight.detach().clone())), or leave the tied modules "
                f"replicated (remove {name} from the plan)"
            )
    return pairs


def _attention_modules(model: nn.Module, placed: dict[str, Style]) -> dict[str, nn.Module]:
    """Parents of column-sharded head projections, checked to have all their head projections sharded."""
    found: dict[str, nn.Module] = {}
    for name, style in placed.items():
        parent, _, leaf = name.rpartition(".")
        if style.kind == "column" and leaf in HEAD_PROJECTIONS and parent not in found:
            found[parent] = model.get_submodule(parent)
    for parent, module in found.items():
        for child, sub in module.named_children():
            qualified = f"{parent}.{child}" if parent else child
            if child in HEAD_PROJECTIONS and (isinstance(sub, nn.Linear) or is_conv1d(sub)):
                style = placed.get(qualified)
                if style is None or style.kind != "column":
                    raise ValueError(
                        f"{parent or type(model).__name__}: its head projections must all be column-parallel, "
                        f"but {child} is planned as {style.kind if style else 'nothing (left unsharded)'}; "
                        f"add {child!r}: 'column' to the plan"
                    )
    return found


def _check_attention(name: str, module: nn.Module, plan: ResolvedPlan) -> dict[str, tuple[float, bool]]:
    """The attention module `name`'s heads split at its TP degree, its widths agreeing with its head
    counts; returns its norms over a sharded projection's whole width ({child: (eps, unit_offset)})."""
    if type(module).__name__ in _UNSHARDABLE_ATTENTION:
        raise ValueError(
            f"{name}: {type(module).__name__} {_UNSHARDABLE_ATTENTION[type(module).__name__]}, so its "
            f"heads cannot be split across ranks; leave its projections out of the plan (plan= "
            f"without them) or use TP degree 1 for this model"
        )
    if plan.degrees is not None and any(child in LATENT_PROJECTIONS for child, _ in module.named_children()):
        raise ValueError(
            f"{name}: tp_degrees with multi-head latent attention ({type(module).__name__}) is not supported "
            f"yet; parallelize without tp_degrees"
        )
    if plan.degrees is not None and _alibi.takes_head_biases(module):
        raise ValueError(
            f"{name}: tp_degrees with an attention that takes per-head biases from the base model "
            f"(ALiBi: {type(module).__name__}) is not supported yet (its rows are not cut to a "
            f"replica's); parallelize without tp_degrees"
        )
    _heads.check_heads(name, module, plan.degree(name))
    widths = {
        child: features(sub)[1]
        for child, sub in module.named_children()
        if plan.placed.get(f"{name}.{child}" if name else child, Style("row")).kind == "column"
    }
    if not any(child in LATENT_PROJECTIONS for child, _ in module.named_children()):
        _heads.check_widths(name, module, widths)  # MLA's heads are qk_head_dim wide, its head_dim the rotary part
    found = _heads.full_width_norms(module, widths)
    return {child: _heads.check_norm_form(f"{name}.{child}", module.get_submodule(child)) for child in found}


def _check_parts(
    model: nn.Module, placed: dict[str, Style], linears: dict[str, nn.Module], degree: Callable[[str], int]
) -> None:
    """Every module a column or row layer is planned in (an attention, an MLP) is sharded whole: its
    column layers' outputs reach a row layer, so it needs one, and no projection of it is left out."""
    children: dict[str, list[str]] = {}
    for name in linears:
        children.setdefault(name.rpartition(".")[0], []).append(name)
    for parent, names in children.items():
        kinds = {n: placed[n].kind if n in placed else None for n in names}
        where = parent or type(model).__name__
        if "column" not in kinds.values():
            rows = [n.rpartition(".")[2] for n, k in kinds.items() if k == "row" and degree(n) > 1]  # 1: F.linear
            if rows:
                raise ValueError(
                    f"{where}: {', '.join(rows)} is planned as 'row' (its input a shard of the features), but no "
                    f"projection of {where} is column-parallel to produce that shard, so it would get the whole "
                    f"width; plan the projection feeding it as 'column' (a fused one: 'column:2', 'column:qkv'), or "
                    f"leave {rows[0]} out of the plan"
                    + (
                        " (nn.MultiheadAttention reads out_proj.weight itself: never plan it)"
                        if isinstance(model.get_submodule(parent), nn.MultiheadAttention)
                        else ""
                    )
                )
            continue
        left = [n.rpartition(".")[2] for n, k in kinds.items() if k is None]
        left = [n for n in left if n not in LATENT_PROJECTIONS]  # MLA's down-projections: replicated
        if "row" not in kinds.values():
            raise ValueError(
                f"{where}: its projections are planned as column-parallel with no row-parallel one to "
                f"reduce their sharded outputs; plan its output projection as 'row'"
            )
        if left:
            raise ValueError(
                f"{where}: {', '.join(left)} would stay whole while the other projections of the same "
                f"module are sharded (its input or output would be a shard); plan "
                f"{', '.join(repr(n) for n in left)} as 'column' or 'row'"
            )
