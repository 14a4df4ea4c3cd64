"""Argument checks of the parallel linears (oases.nn.layers), and the Conv1D detection: local
checks that raise before any tensor is built or any collective runs."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks


def check_shardable(
    owner: str,
    arg: str,
    size: int,
    world_size: int,
    stacked: int = 1,
    parts: tuple[int, ...] = (),
    replicas: tuple[int, ...] = (),
) -> None:
    """`size` features (in `stacked` equal blocks, or blocks of the sizes `parts`) must split into
    whole per-rank shards; with `replicas` (one per block), block i into world_size / replicas[i]."""
    if not _checks.is_int(stacked) or stacked < 1:
        raise ValueError(f"{owner}: stacked must be an int >= 1, got {stacked!r}")
    if replicas:
        if parts:
            check_shardable(owner, arg, size, 1, 1, parts)  # the blocks' own sizes
        blocks = parts or (size,)
        if (
            stacked != 1
            or not isinstance(replicas, tuple)
            or len(replicas) != len(blocks)
            or any(not _checks.is_int(c) or c < 1 or world_size % c for c in replicas)
        ):
            raise ValueError(
                f"{owner}: replicas must be a tuple of one int per block ({len(blocks)}), each dividing "
                f"the tensor-parallel world size {world_size}, with stacked=1; got {replicas!r}"
            )
        for n, c in zip(blocks, replicas):
            if n % (world_size // c):
                raise ValueError(
                    f"{owner}: {arg}={size} has a block of {n} features held by groups of {c} ranks; "
                    f"{n} is not divisible by {world_size // c} (world size {world_size} / {c})"
                )
        return
    if parts:
        if stacked != 1:
            raise ValueError(f"{owner}: pass stacked (equal blocks) or parts (their sizes), not both")
        if not isinstance(parts, tuple) or any(not _checks.is_int(n) or n < 1 for n in parts) or sum(parts) != size:
            raise ValueError(
                f"{owner}: parts must be a tuple of positive block sizes summing to {arg}={size} "
                f"(e.g. (q, k, v) widths), got {parts!r}"
            )
        bad = [n for n in parts if n % world_size]
        if bad:
            raise ValueError(
                f"{owner}: {arg}={size} is made of blocks {parts}, and {bad[0]} is not divisible by the "
                f"tensor-parallel world size {world_size}; each block must split into whole shards "
                f"(whole heads: head counts divisible by {world_size})"
            )
        return
    if size % stacked:
        raise ValueError(
            f"{owner}: {arg}={size} does not split into stacked={stacked} equal blocks; "
            f"use the number of blocks the features are made of (3 for q|k|v)"
        )
    block = size // stacked
    if block % world_size:
        what = f"{arg}={size}" if stacked == 1 else f"{arg}={size} ({stacked} blocks of {block})"
        raise ValueError(
            f"{owner}: {what} is not divisible by the tensor-parallel world size {world_size}; "
            f"choose {arg} so that each block is a multiple of {world_size} (or pad the layer)"
        )


def _check_flag(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {value!r}")


def _resolve_chunks(chunks: Optional[int]) -> Optional[int]:
    if chunks is not None:
        _checks.chunks_arg(chunks)
    return chunks


def _check_replicas(
    owner: str, replicas: tuple[int, ...], replica_group: Optional[dist.ProcessGroup], ring, other_mode: bool
) -> None:
    """replicas > 1 need their replica_group: the c consecutive ranks of the layer's group holding
    this rank's copies (one c for every replicated block); not with a padded, transposed, gathered
    or gradient-fused layer."""
    if other_mode:
        raise ValueError(
            f"{owner}: replicas (blocks held alike by several ranks) are for a plain column layer: "
            f"not with pad_vocab, transposed, gather_output or gradient_accumulation_fusion"
        )
    counts = {c for c in replicas if c > 1}
    if len(counts) > 1:
        raise ValueError(f"{owner}: replicas {replicas} name several replica counts; one replica_group serves one")
    c = counts.pop()
    first = ring.rank // c * c
    want = ring.global_ranks[first : first + c]
    held = tuple(dist.get_process_group_ranks(replica_group)) if replica_group is not None else None
    if held is None or sorted(held) != sorted(want):
        raise ValueError(
            f"{owner}: replicas={replicas} needs replica_group: the process group of global ranks "
            f"{list(want)} (the {c} consecutive ranks of the layer's group holding this rank's "
            f"copies), got {'None' if held is None else list(held)}"
        )


def _check_transposed(owner: str, transposed: object, fusion: bool) -> None:
    _check_flag(owner, "transposed", transposed)
    if transposed and fusion:
        raise ValueError(
            f"{owner}: gradient_accumulation_fusion is not supported with transposed=True (a Conv1D "
            f"layout); pass gradient_accumulation_fusion=False"
        )


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is a Hugging Face Conv1D: y = x @ weight + bias, weight [nx, nf] (GPT-2's projections)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(getattr(module, "nx", None), int)
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (module.nx, module.nf)
    )
