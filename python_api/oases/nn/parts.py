"""What a causal LM is made of, found by structure rather than by class name.

    stack = find_stack(model)          # embedding, decoder layers, final norm, LM head (or None)
    parts = layer_parts(layer)         # one decoder layer: its attention, MLP and norms, and how
                                       # its forward combines them (the schedules' sublayers)

A decoder layer's parts:
    attention   a child module with head projections (q_proj / k_proj / v_proj, a fused qkv_proj,
                query_key_value, c_attn, ...: HEAD_PROJECTIONS) and an output projection
    mlp         another child module with two or more projections (gate/up/down, gate_up/down,
                fc1/fc2, c_fc/c_proj, dense_h_to_4h/dense_4h_to_h), or an MoE block: a child holding
                fused routed experts (Mixtral's, Qwen2/3-MoE's mlp: oases.nn.experts)
    norms       children whose class is a norm (LayerNorm, RMSNorm, ...: a 1-d weight, no children)
    projections nn.Linear, Hugging Face Conv1D, or the tensor-parallel layers made of them

How the layer's forward combines them is read from its source: the order in which it calls its
children (Python's evaluation order: a call's arguments before the call), dropouts left out:

    "sequential"  [norm_a, attention, norm_b, mlp]: x + attention(norm_a x), then + mlp(norm_b .)
                  (Llama, Mistral, Qwen2/3, Gemma, Phi-3, GPT-2, GPT-NeoX with use_parallel_residual
                  False), with plain residual adds (no line that scales the residual)
    "parallel"    as sequential, and the layer's use_parallel_residual is True (GPT-NeoX):
                  x + attention(norm_a x) + mlp(norm_b x)
    "whole"       anything else (OLMo-2's norms after the branches, Gemma-2's four norms, a scaled
                  residual, a forward whose source is unavailable, an MoE block whose experts are
                  not sharded): the schedules run the layer whole, as one sublayer (oases.models.hf)
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from oases.nn._layer_args import is_conv1d
from oases.nn.experts import is_experts, is_fused_experts
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "HEAD_PROJECTIONS",
    "LATENT_PROJECTIONS",
    "LayerParts",
    "StackParts",
    "inner_base",
    "is_norm",
    "is_projection",
    "projections",
    "attention_of",
    "mlp_of",
    "layer_parts",
    "find_stack",
    "decoder_layers_of",
    "child_calls",
]

# Child names that make their parent an attention module when column-sharded.
HEAD_PROJECTIONS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "qkv_proj",
        "query_key_value",
        "c_attn",
        "wq",
        "wk",
        "wv",
        "wqkv",
        "Wqkv",
        "query",
        "key",
        "value",
        "q_b_proj",
        "kv_b_proj",
    }
)

# Low-rank down-projections of multi-head latent attention (DeepSeek-V2/V3): replicated by design,
# their latents feeding the column-parallel up-projections (q_b_proj, kv_b_proj; oases.nn._latent).
LATENT_PROJECTIONS = frozenset({"q_a_proj", "kv_a_proj_with_mqa"})


def is_projection(module: nn.Module) -> bool:
    """An nn.Linear, a Hugging Face Conv1D, or a tensor-parallel layer made of one."""
    return isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) or is_conv1d(module)


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: a leaf whose class name says Norm, with a 1-d weight (or none)."""
    if "norm" not in type(module).__name__.lower() or next(module.children(), None) is not None:
        return False
    weight = getattr(module, "weight", None)
    return weight is None or (isinstance(weight, torch.Tensor) and weight.dim() == 1)


def projections(module: nn.Module) -> dict[str, nn.Module]:
    """{child name: child} of the module's direct children that are projections, or PEFT adapter
    layers wrapping one (a LoRA layer's `base_layer`: oases.nn.lora)."""
    return {n: m for n, m in module.named_children() if is_projection(m) or _wraps_projection(m)}


def _wraps_projection(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA's) around a projection: the layer the model calls in its place."""
    base = getattr(module, "base_layer", None)
    return isinstance(base, nn.Module) and is_projection(base)


def attention_of(layer: nn.Module) -> Optional[str]:
    """The name of the layer's child that is an attention module (head projections and another)."""
    for name, child in layer.named_children():
        found = projections(child)
        if any(n in HEAD_PROJECTIONS for n in found) and len(found) >= 2:
            return name
    return None


def mlp_of(layer: nn.Module, attention: Optional[str]) -> Optional[str]:
    """The name of the layer's child, other than its attention, with two or more projections or
    with fused routed experts (an MoE block)."""
    for name, child in layer.named_children():
        found = projections(child)
        mlp = len(found) >= 2 or any(is_experts(c) for c in child.children())
        if name != attention and mlp and not any(n in HEAD_PROJECTIONS for n in found):
            return name
    return None


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's parts (child names) and how its forward combines them (module doc)."""

    kind: str  # "sequential", "parallel" or "whole"
    attention: Optional[str]
    mlp: Optional[str]
    norms: tuple[str, ...]  # sequential / parallel: (before attention, before mlp)
    reason: str = ""  # why "whole"


def child_calls(forward) -> Optional[list[str]]:
    """The `self.<name>(...)` calls of a forward's source in evaluation order (None: no source)."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(forward)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    order: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):  # arguments (and the callee) before the call itself
            visit(child)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            order.append(node.func.attr)

    visit(tree)
    return order


def _scaled_residual(forward) -> bool:
    """Whether a line of the forward mentions the residual with a product or a quotient."""
    try:
        lines = inspect.getsource(inspect.unwrap(forward)).splitlines()
    except (OSError, TypeError):
        return True
    code = [line.split("#")[0] for line in lines]
    return any("residual" in line and ("*" in line or "/" in line) for line in code)


def layer_parts(layer: nn.Module) -> LayerParts:
    """The decoder layer's parts, and whether the schedules can split it (see the module doc)."""
    attention = attention_of(layer)
    mlp = mlp_of(layer, attention)
    children = dict(layer.named_children())
    norms = tuple(n for n, m in children.items() if is_norm(m))
    if attention is None or mlp is None:
        missing = (
            "an attention module (q/k/v or fused qkv, and an output projection)"
            if attention is None
            else "an MLP (two or more projections besides the attention's)"
        )
        return LayerParts("whole", attention, mlp, norms, f"{missing} not found among its children")
    if any(is_fused_experts(c) for c in children[mlp].children()):  # a split sublayer's core must be a partial sum
        return LayerParts(
            "whole",
            attention,
            mlp,
            norms,
            f"the routed experts of its {mlp} are not sharded (the plan entry 'experts': 'experts' shards them)",
        )
    calls = child_calls(type(layer).forward)
    if calls is None:
        return LayerParts("whole", attention, mlp, norms, "the source of its forward is unavailable")
    held = [n for n, m in children.items() if any(True for _ in m.parameters())]
    order = []
    for name in calls:
        if name in children and not isinstance(children[name], nn.Dropout) and name not in order:
            order.append(name)
    shape = [("norm" if n in norms else n) for n in order]
    if shape != ["norm", attention, "norm", mlp] or set(held) - set(order):
        return LayerParts(
            "whole",
            attention,
            mlp,
            norms,
            f"its forward calls {', '.join(order)}; the schedules split a layer that calls a norm, "
            f"{attention}, a norm, {mlp} (pre-norm residual branches)",
        )
    if _scaled_residual(type(layer).forward):
        return LayerParts("whole", attention, mlp, norms, "its forward scales the residual")
    inner = [n for n in (attention, mlp) if "residual" in inspect.signature(children[n].forward).parameters]
    if inner:  # BLOOM: a branch that adds the residual itself is not a branch the schedules can sum
        return LayerParts("whole", attention, mlp, norms, f"its {' and '.join(inner)} add the residual themselves")
    pair = (order[0], order[2])
    kind = "parallel" if getattr(layer, "use_parallel_residual", False) is True else "sequential"
    return LayerParts(kind, attention, mlp, pair)


def inner_base(base: nn.Module) -> nn.Module:
    """The module that holds the decoder layers: `base`, or the one child it wraps where it holds no
    module list itself (OPT: OPTModel -> its decoder)."""
    while decoder_layers_of(base) is None:
        children = list(base.children())
        if len(children) != 1:
            break
        base = children[0]
    return base


def decoder_layers_of(base: nn.Module) -> Optional[tuple[str, nn.ModuleList]]:
    """(child name, list) of the base model's decoder layers: its first non-empty nn.ModuleList child."""
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) > 0:
            return name, child
    return None


@dataclass(frozen=True)
class StackParts:
    """A causal LM's stack: base model, its decoder layers (attribute name and list), final norm, head."""

    base: nn.Module
    layers_name: str
    layers: nn.ModuleList
    final_norm: Optional[nn.Module]
    head: Optional[nn.Module]


def find_stack(model: nn.Module) -> tuple[Optional[StackParts], str]:
    """(the model's stack, "") or (None, what is missing). The base model is Hugging Face's
    `model.base_model` (else the model itself); the final norm is the base model's one norm child."""
    base = getattr(model, "base_model", None)
    base = inner_base(base if isinstance(base, nn.Module) else model)
    found = decoder_layers_of(base)
    if found is None:
        return None, "no decoder layers (a non-empty nn.ModuleList child of model.base_model)"
    name, layers = found
    children = list(base.named_children())
    norms = [m for n, m in children if is_norm(m)]
    if len(norms) > 1:  # BLOOM's embedding norm comes before the layers: the final norm is after them
        after = [m for n, m in children[[n for n, _ in children].index(name) + 1 :] if is_norm(m)]
        norms = after if len(after) == 1 else norms
    if len(norms) != 1:
        return None, f"{len(norms)} norm children of model.base_model (one final norm expected)"
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None, "no output embeddings (model.get_output_embeddings())"
    return StackParts(base, name, layers, norms[0], head), ""
