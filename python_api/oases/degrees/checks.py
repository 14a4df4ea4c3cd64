"""The local checks of per-layer TP degrees (no communication, the same on every rank, before any
subgroup is made), and the one refusal of what does not combine with them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional, Sequence

import torch.distributed as dist

from oases import _checks

__all__ = ["check_batch_rows", "check_tp_degrees", "check_world_group", "refuse_with_degrees"]

# Why each option does not combine with per-layer degrees (refuse_with_degrees names it).
_WHY: Mapping[str, str] = MappingProxyType(
    {
        "sequence_parallel": "layers of different degrees split the batch rows, not the sequence",
        "vocab_parallel": "the embedding and the LM head run replicated on every rank",
        "offload": "the per-degree programs keep their recompute inputs on the device",
        "comm": "the layers communicate on Communicators of their own, one per degree: model.layer_placements()",
    }
)
_UNSET: Mapping[str, None] = MappingProxyType({"comm": None})  # an option's value that asks for nothing (others: False)


def check_tp_degrees(tp_degrees: object, layers: int, p: int) -> tuple[int, ...]:
    """The degrees as a tuple, or ValueError / TypeError (local checks: the same on every rank)."""
    if isinstance(tp_degrees, (str, bytes)) or not isinstance(tp_degrees, Sequence):
        raise TypeError(
            f"tp_degrees: expected a list of ints (one TP degree per layer, e.g. oases.plan.load(path)), "
            f"got {type(tp_degrees).__name__}"
        )
    degrees = tuple(tp_degrees)
    if len(degrees) != layers:
        raise ValueError(f"tp_degrees: expected one degree per layer ({layers}), got {len(degrees)}: {list(degrees)}")
    for i, d in enumerate(degrees):
        if not _checks.is_int(d):
            raise TypeError(f"tp_degrees[{i}]: expected an int, got {type(d).__name__}")
        if d < 1 or d & (d - 1) or p % d:
            raise ValueError(
                f"tp_degrees[{i}]: {d} is not a power of two dividing the group size {p} "
                f"(allowed: {[2**k for k in range(p.bit_length()) if p % 2**k == 0]})"
            )
    return degrees


def check_batch_rows(what: str, batch: int, degrees: Sequence[int], p: int) -> None:
    """ValueError unless a batch of `batch` rows gives every replica of every layer a row: at least
    p / min(degrees) rows (they need not divide evenly)."""
    most = p // min(degrees)
    if batch < most:
        raise ValueError(
            f"{what}: tp_degrees {list(degrees)} run up to {most} replicas, each on its own block "
            f"of the batch's rows; got batch size {batch} (use at least {most} rows)"
        )


def check_world_group(p: int) -> None:
    """ValueError unless a group of `p` ranks is the whole world (or one rank): per-layer degrees
    make their subgroups collectively, on every rank of the world."""
    if p > 1 and p != dist.get_world_size():
        raise ValueError(
            f"group: per-layer tp_degrees make subgroups on every rank of the world, so the group "
            f"must be the whole world ({dist.get_world_size()} ranks), got {p} ranks"
        )


def refuse_with_degrees(option: str, value: object, *, fix: Optional[str] = None) -> None:
    """ValueError if `option` (sequence_parallel, vocab_parallel, offload or comm) is set, i.e. neither
    None nor False, on a model with per-layer degrees:

        "{option}[=True]: not supported with per-layer tp_degrees ({why}); {fix}"

    `fix` (default: pass the option unset) says what to do instead."""
    if value is None or value is False:
        return
    unset = _UNSET.get(option, False)
    raise ValueError(
        f"{option}{'=True' if value is True else ''}: not supported with per-layer tp_degrees "
        f"({_WHY[option]}); {fix or f'pass {option}={unset}'}"
    )
