"""The decoder layers a per-layer plan applies to (oases.parallelize(model, tp_degrees=..., layers=...)),
found and checked against the degrees: local checks, the same on every rank, before any subgroup is made.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.nn as nn

from oases.degrees.checks import check_tp_degrees, check_world_group

__all__ = ["KNOWN_LAYERS", "find_decoder_layers", "find_layer_degrees"]

# Where per-layer tp_degrees find decoder layers without `layers=` (the first that is a non-empty
# nn.ModuleList wins): Hugging Face decoders (LlamaForCausalLM's model.layers, GPTNeoXForCausalLM's
# gpt_neox.layers: base_model is the inner model), nanoGPT-style models (with or without `transformer`).
KNOWN_LAYERS = ("base_model.layers", "transformer.h", "h")


def _module_list(model: nn.Module, path: str) -> Optional[nn.ModuleList]:
    owner: object = model
    for part in path.split("."):
        owner = getattr(owner, part, None)
    return owner if isinstance(owner, nn.ModuleList) and len(owner) > 0 else None


def find_decoder_layers(model: nn.Module, layers: Optional[str]) -> tuple[str, nn.ModuleList]:
    """(qualified name, module) of the decoder layers a per-layer plan applies to: `layers` (a dotted
    path), else the first of KNOWN_LAYERS; else ValueError / TypeError naming the fix."""
    if layers is None:
        found = next((m for m in (_module_list(model, path) for path in KNOWN_LAYERS) if m is not None), None)
        if found is None:
            raise ValueError(
                f"tp_degrees: {type(model).__name__} has no decoder layers where oases looks "
                f"({', '.join('model.' + k for k in KNOWN_LAYERS)}: a non-empty nn.ModuleList); "
                f"pass layers='dotted.path' naming your nn.ModuleList of decoder layers "
                f"(e.g. layers='blocks'), or tp_degrees=None"
            )
    else:
        if not isinstance(layers, str):
            raise TypeError(
                f"layers: expected a dotted path (str) to the model's nn.ModuleList of decoder layers, "
                f"e.g. layers='model.blocks', got {type(layers).__name__}"
            )
        try:
            found = model.get_submodule(layers) if layers else None
        except AttributeError:
            found = None
        if found is None:
            raise ValueError(
                f"layers: {type(model).__name__} has no submodule {layers!r}; pass the dotted path of "
                f"its nn.ModuleList of decoder layers, as model.named_modules() names it"
            )
        if not isinstance(found, nn.ModuleList):
            raise TypeError(
                f"layers: model.{layers} is a {type(found).__name__}, not an nn.ModuleList; name the "
                f"nn.ModuleList holding the decoder layers (one tp_degrees entry per element)"
            )
        if len(found) == 0:
            raise ValueError(
                f"layers: model.{layers} is an empty nn.ModuleList; name the one holding the decoder layers"
            )
    name = next((n for n, m in model.named_modules() if m is found), "")
    if not name:  # the model itself, or a ModuleList held outside the module tree
        raise ValueError(
            f"layers: the decoder layers must be a registered submodule of {type(model).__name__} "
            f"(a name in model.named_modules()); pass layers='dotted.path' naming it"
        )
    return name, found


def find_layer_degrees(
    model: nn.Module, tp_degrees: object, layers: Optional[str], p: int
) -> tuple[str, nn.ModuleList, tuple[int, ...]]:
    """(decoder layers' name, the layers, the degrees as a tuple): the layers found (find_decoder_layers),
    one degree per layer, each a power of two dividing p (check_tp_degrees), and the group the whole
    world (check_world_group); else ValueError / TypeError naming the fix."""
    prefix, found = find_decoder_layers(model, layers)
    if isinstance(tp_degrees, Sequence) and not isinstance(tp_degrees, (str, bytes)) and len(tp_degrees) != len(found):
        raise ValueError(
            f"tp_degrees: expected one degree per layer of model.{prefix} ({len(found)} layers), got "
            f"{len(tp_degrees)}: {list(tp_degrees)}; pass {len(found)} degrees"
            + ("" if layers else ", or layers='dotted.path' naming other decoder layers")
        )
    degrees = check_tp_degrees(tp_degrees, len(found), p)
    check_world_group(p)
    return prefix, found, degrees
