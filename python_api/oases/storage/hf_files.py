"""A safetensors checkpoint's tensors under the names a model gives them: transformers' own
conversion mapping (transformers 5: `get_model_conversion_mapping`) applied to the file's keys.

    stored = stored_tensors(path, model)       # {model key: Stored}; reads headers only
    stored[key].shape                          # the tensor's full shape, as the model holds it
    stored[key].read(index)                    # full[index] (a tuple of slices; None: all of it)

The file's keys are renamed as transformers renames them when it loads (GPT-NeoX's `embed_out` is
`lm_head`, Mixtral's `block_sparse_moe` is `mlp`: every matching renaming, in turn), then merged
where one converter matches (at most one per key), for the two operations of routed experts:

    MergeModulelist(dim=0)                   experts.{e}.w2.weight [h, i]          -> [E, h, i]
    MergeModulelist(dim=0), Concatenate(1)   experts.{e}.w1 / w3.weight [i, h]     -> [E, 2i, h]

A box of a merged tensor reads only the experts and rows it covers, from each expert's tensor.
Keys of any other converter, and every key for a model transformers has no mapping for (or an
older transformers without one), keep their file names (the key check then names them). The
checkpoint's keys are its own model's: a file that is already in the model's layout (written by
`oases.save_pretrained`) matches no pattern and is read as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch
import torch.nn as nn

__all__ = ["Stored", "stored_tensors", "SINGLE", "INDEX", "DTYPES"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
DTYPES = MappingProxyType(  # torch dtype -> safetensors dtype name
    {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3",
        torch.float8_e5m2: "F8_E5M2",
    }
)
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint as the model names it: `key` in `file`, or, merged from several,
    `parts[source][expert]` = (file, key) (each part's dim 0 concatenated along dim 1 when
    `concatenated`)."""

    shape: torch.Size
    file: str = ""
    key: str = ""
    parts: tuple[tuple[tuple[str, str], ...], ...] = ()
    concatenated: bool = False

    def read(self, index: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
        """full[index] (all of it for None), reading only what the box covers."""
        from safetensors import safe_open

        index = index if index is not None else tuple(slice(0, n) for n in self.shape)
        if not self.parts:
            with safe_open(self.file, framework="pt") as handle:  # closed: its pages leave RSS
                return handle.get_slice(self.key)[index]
        box = [len(range(n)[i]) for n, i in zip(self.shape, index)]
        out = torch.empty(box, dtype=_BY_NAME[self._dtype()])
        if out.numel() == 0:
            return out
        with contextlib.ExitStack() as stack:  # one handle per file for the whole box
            handles: dict[str, object] = {}

            def part(file: str, key: str):
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                return handles[file].get_slice(key)

            for row, e in enumerate(range(index[0].start, index[0].stop)):
                offset, at = 0, 0
                for source in self.parts:
                    piece = part(*source[e])
                    if not self.concatenated:
                        out[row] = piece[index[1:]]
                        continue
                    rows = piece.get_shape()[0]
                    lo, hi = max(index[1].start, offset), min(index[1].stop, offset + rows)
                    if lo < hi:
                        out[row, at : at + hi - lo] = piece[(slice(lo - offset, hi - offset),) + index[2:]]
                        at += hi - lo
                    offset += rows
        return out

    def _dtype(self) -> str:
        from safetensors import safe_open

        file, key = self.parts[0][0]
        with safe_open(file, framework="pt") as handle:
            return handle.get_slice(key).get_dtype()


def _weight_map(path: str) -> dict[str, list[str]]:
    """{file: [keys the index says it holds] or [] (every key it holds)} of the checkpoint at `path`."""
    if os.path.isfile(path):
        return {path: []}
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"path: {path!r} does not exist (expected a directory as save_pretrained writes it, or a .safetensors file)"
        )
    index = os.path.join(path, INDEX)
    if os.path.isfile(os.path.join(path, SINGLE)):  # first, as transformers looks
        return {os.path.join(path, SINGLE): []}
    if not os.path.isfile(index):
        raise FileNotFoundError(f"path: {path!r} holds neither {SINGLE} nor {INDEX} (no safetensors weights)")
    with open(index) as f:
        weights = json.load(f).get("weight_map")
    if not isinstance(weights, dict):
        raise ValueError(f'{index}: no "weight_map" {{key: file}} in it')
    files: dict[str, list[str]] = {}
    for key, name in weights.items():
        files.setdefault(os.path.join(path, name), []).append(key)
    absent = [name for name in files if not os.path.isfile(name)]
    if absent:
        raise FileNotFoundError(f"{index} names files that do not exist: {', '.join(absent)}")
    return files


def _headers(path: str) -> dict[str, tuple[str, torch.Size]]:
    """{file key: (its file, its shape)} of every tensor of the checkpoint; reads headers only."""
    from safetensors import safe_open

    found: dict[str, tuple[str, torch.Size]] = {}
    for file, listed in _weight_map(path).items():
        with safe_open(file, framework="pt") as handle:  # maps the file; touches no data page
            held = set(handle.keys())
            absent = [key for key in listed if key not in held]
            if absent:
                raise ValueError(
                    f"{os.path.join(path, INDEX)} maps {', '.join(absent)} to {file}, which does not hold them"
                )
            for key in listed or sorted(held):
                found[key] = (file, torch.Size(handle.get_slice(key).get_shape()))
    return found


def _mapping(model: Optional[nn.Module]) -> tuple[list, list]:
    """(renamings, converters) transformers applies when it loads `model`'s checkpoints; ([], []) when
    it has none (not a transformers model, or a transformers without conversion mappings)."""
    if model is None or not any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    try:
        transforms = get_model_conversion_mapping(model)
    except (AttributeError, KeyError, TypeError, ValueError):  # a mapping this version cannot build: names as stored
        return [], []
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def _merge_kind(converter) -> Optional[bool]:
    """True: MergeModulelist(0) then Concatenate(1); False: MergeModulelist(0) alone; None: other."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if ops == [("MergeModulelist", 0)]:
        return False
    if ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
        return True
    return None


def stored_tensors(path: str, model: Optional[nn.Module] = None) -> dict[str, Stored]:
    """{key: Stored} of every tensor of the checkpoint at `path`, keyed as `model` names them (see
    the module docstring); reads headers only."""
    renamings, converters = _mapping(model)
    stored: dict[str, Stored] = {}
    merged: dict[str, tuple[object, dict[int, dict[int, tuple[str, str, torch.Size]]]]] = {}
    for key, (file, shape) in _headers(path).items():
        name = key
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        expert = _EXPERT.search(name)
        for converter in converters:
            target, pattern = converter.rename_source_key(name)
            if pattern is None:
                continue
            if _merge_kind(converter) is not None and expert is not None:
                sources = merged.setdefault(target, (converter, {}))[1]
                sources.setdefault(converter.source_patterns.index(pattern), {})[int(expert.group(1))] = (
                    file,
                    key,
                    shape,
                )
                name = None
            break
        if name is not None:
            stored[name] = Stored(shape, file, key)
    for target, (converter, sources) in merged.items():
        count = len(next(iter(sources.values())))
        whole = sorted(sources) == list(range(len(converter.source_patterns))) and all(
            sorted(experts) == list(range(count)) for experts in sources.values()
        )
        trailing = {s[2][1:] for experts in sources.values() for s in experts.values()}
        uneven = any(len({s[2] for s in experts.values()}) > 1 for experts in sources.values())
        if not whole or len(trailing) > 1 or uneven:  # an expert or a source missing, or parts that do not line up
            for experts in sources.values():
                stored.update((key, Stored(shape, file, key)) for file, key, shape in experts.values())
            continue
        parts = tuple(tuple((sources[i][e][0], sources[i][e][1]) for e in range(count)) for i in sorted(sources))
        first = [sources[i][0][2] for i in sorted(sources)]
        concatenated = bool(_merge_kind(converter))
        shape = (
            torch.Size([count, sum(s[0] for s in first), *first[0][1:]])
            if concatenated
            else torch.Size([count, *first[0]])
        )
        stored[target] = Stored(shape, parts=parts, concatenated=concatenated)
    return stored
