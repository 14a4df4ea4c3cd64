"""Row blocks: how a batch's rows split into contiguous blocks, for sub-batches and replicas alike.

    block_rows(B, R, j) = rows [floor(j B / R), floor((j + 1) B / R))    # sizes differ by at most one

Every rank computes the blocks from B alone (B = 7, R = 2: 3 + 4 rows). The bounds for R are among
those for R k (floor(j B / R) = floor(j k B / (R k))), so block j of R is blocks j k .. j k + k - 1
of R k: rows move between R and R k replicas by splitting a block (locally) or concatenating its k
parts (an all-gather over the k ranks holding them). Blocks of unequal size are all-gathered as
equal pieces: each padded to the largest block, gathered, the padding cut away:

    gathered = unpadded(all_gather(padded(x, sizes)), sizes)   # [sum(sizes), ...], blocks in order
    mine = own_part(gathered, sizes, k)                         # its inverse on rank k: block k, a copy
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["block_rows", "split_rows", "part_sizes", "padded", "unpadded", "own_part"]


def block_rows(batch: int, parts: int, index: int) -> slice:
    """Block `index` of the `parts` contiguous blocks of `batch` rows (see the module docstring)."""
    return slice(index * batch // parts, (index + 1) * batch // parts)


def split_rows(batch: int, parts: int) -> list[slice]:
    """`parts` contiguous row ranges covering `batch` rows, sizes differing by at most one
    (block_rows of each part: 3 rows in 2 -> 1 + 2). The schedules' sub-batches and the pipeline's
    micro-batches are cut by it."""
    return [block_rows(batch, parts, i) for i in range(parts)]


def part_sizes(batch: int, replicas: int, replica: int, parts: int) -> tuple[int, ...]:
    """The row counts of the `parts` blocks (of replicas * parts) that make up block `replica` of
    `replicas`, for a batch of `batch` rows; their sum is that block's row count."""
    total, first = replicas * parts, replica * parts
    bounds = [(first + m) * batch // total for m in range(parts + 1)]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def padded(x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """x [n, ...] with zero rows appended up to max(sizes) rows: x itself when n is already that."""
    most = max(sizes)
    if x.shape[0] == most:
        return x
    return torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])


def unpadded(gathered: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """An all-gather of `padded` pieces [len(sizes) * max(sizes), ...] -> the real rows of each,
    concatenated [sum(sizes), ...]: `gathered` itself when the sizes are equal."""
    most = max(sizes)
    if min(sizes) == most:
        return gathered
    return torch.cat([gathered[k * most : k * most + n] for k, n in enumerate(sizes)])


def own_part(x: torch.Tensor, sizes: Sequence[int], index: int) -> torch.Tensor:
    """Block `index` of x [sum(sizes), ...] (blocks of `sizes` rows, in order) as a new contiguous
    tensor, not a view (x itself may go): the local half of a row move, both ways."""
    return x.narrow(0, sum(sizes[:index]), sizes[index]).clone(memory_format=torch.contiguous_format)
