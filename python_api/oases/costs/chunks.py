"""Centauri's operation-level choices: how many chunks to cut a fused op into (Algorithm 1) and
which backward GEMM to run first (eq. 1). Pure functions of costs in seconds.

Cutting an op whose compute costs `comp` and communication `comm` into n chunks pipelines
them; each chunk pays a fixed `in_cost` (a message's latency, a kernel launch):

    overlapped_time(n) = max(comp, comm) + min(comp, comm) / n + n * in_cost

    | comm 1 | comm 2 | comm 3 |                  the first chunk's communication (or the last
             | comp 1 | comp 2 | comp 3 |         chunk's compute) is the exposed tail: 1/n of it

Algorithm 1 doubles n from 1 while the modelled time falls and n stays within `max_chunks`
(and among the counts the op accepts); the tail term shrinks as 1/n and the overheads grow as n.

A GEMM cut into n pieces runs slower than one GEMM (smaller tiles, less reuse: on an H200 the
Llama GEMMs at n = 2, 4, 8, 16 ran at 0.98, 0.93, 0.83, 0.68 of one). With the measured
efficiency e(n) (a profile's "chunk_efficiency", `python -m bench profile`) the compute is
comp / e(n) in every term; e(1) = 1, and counts between measured ones are interpolated in log2 n.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

__all__ = [
    "overlapped_time",
    "chunk_count",
    "chunk_efficiency",
    "backward_priority",
    "op_chunks",
    "MAX_CHUNKS",
    "OP_MAX_CHUNKS",
    "OP_FLOPS_PER_S",
    "OP_BYTES_PER_S",
    "OP_IN_COST_S",
]

MAX_CHUNKS = 16
OP_MAX_CHUNKS = 8  # the most pieces the fused ops pick for themselves (op_chunks), and plans suggest
# The rates `op_chunks` assumes when an op is called with chunks=None (no profile at hand): one CPU
# core's GEMM rate, a 1 Gbit link, and the cost of one more ring message + GEMM call on gloo.
OP_FLOPS_PER_S = 50e9
OP_BYTES_PER_S = 125e6
OP_IN_COST_S = 150e-6


def _check_cost(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")
    return float(value)


def chunk_efficiency(efficiency: Optional[Mapping[int, float]], chunks: int) -> float:
    """e(chunks) from measured {count: time of one GEMM / time of the same GEMM in `count` pieces}:
    1 at one chunk or with nothing measured; between measured counts linear in log2(count); beyond
    the largest measured count, that count's figure (no extrapolated fall)."""
    if not efficiency or chunks <= 1:
        return 1.0
    points = sorted({**{int(c): float(e) for c, e in efficiency.items()}, 1: 1.0}.items())  # e(1) is 1 by definition
    if chunks >= points[-1][0]:
        return points[-1][1]
    for (c0, e0), (c1, e1) in zip(points, points[1:]):
        if c0 <= chunks <= c1:
            w = (math.log2(chunks) - math.log2(c0)) / (math.log2(c1) - math.log2(c0))
            return e0 + w * (e1 - e0)
    return 1.0  # unreachable: points start at 1 and chunks > 1


def check_efficiency(efficiency: Optional[Mapping[int, float]], what: str = "efficiency") -> dict[int, float]:
    """{count: e} with counts >= 1 and 0 < e <= 2 (a chunked GEMM may even run a little faster)."""
    if efficiency is None:
        return {}
    if not isinstance(efficiency, Mapping):
        raise TypeError(f"{what}: expected a mapping {{chunk count: efficiency}}, got {type(efficiency).__name__}")
    out = {}
    for count, e in efficiency.items():
        try:
            n, value = int(count), float(e)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: {count!r}: {e!r} is not a chunk count and a number") from None
        if n < 1 or not 0.0 < value <= 2.0:
            raise ValueError(f"{what}: expected counts >= 1 and efficiencies in (0, 2], got {count!r}: {e!r}")
        out[n] = value
    return out


def overlapped_time(comp_cost: float, comm_cost: float, in_cost: float, chunks: int, efficiency: float = 1.0) -> float:
    """Modelled seconds of an op cut into `chunks` pipelined pieces whose GEMMs run at `efficiency`
    of one GEMM (see the module docstring)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks: expected a positive int, got {chunks!r}")
    if not efficiency > 0:
        raise ValueError(f"efficiency: expected a number > 0, got {efficiency!r}")
    comp = comp_cost / efficiency
    return max(comp, comm_cost) + min(comp, comm_cost) / chunks + chunks * in_cost


def chunk_count(
    comp_cost: float,
    comm_cost: float,
    in_cost: float,
    *,
    max_chunks: int = MAX_CHUNKS,
    allowed: Optional[Iterable[int]] = None,
    efficiency: Optional[Mapping[int, float]] = None,
) -> int:
    """Centauri Algorithm 1: the chunk count for an op of `comp_cost` compute and `comm_cost`
    communication seconds, `in_cost` seconds of overhead per chunk.

    ::

        t(n) = overlapped_time(comp, comm, in_cost, n, chunk_efficiency(efficiency, n))
        n = 1
        while 2n <= max_chunks and t(2n) < t(n): n = 2n

    With `allowed` (e.g. the counts that divide the op's rows) the walk goes through the allowed
    counts in ascending order instead of doubling, and 1 is always allowed. `efficiency`: the
    measured {count: e(count)} of chunked GEMMs (None: every count at 1, the ideal)."""
    comp_cost, comm_cost = _check_cost("comp_cost", comp_cost), _check_cost("comm_cost", comm_cost)
    in_cost = _check_cost("in_cost", in_cost)
    efficiency = check_efficiency(efficiency)
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise ValueError(f"max_chunks: expected a positive int, got {max_chunks!r}")
    if allowed is None:
        steps = [2**i for i in range(int(math.log2(max_chunks)) + 1)]
    else:
        steps = sorted({1, *(int(c) for c in allowed if 1 <= int(c) <= max_chunks)})

    def t(n: int) -> float:
        return overlapped_time(comp_cost, comm_cost, in_cost, n, chunk_efficiency(efficiency, n))

    best = steps[0]
    for n in steps[1:]:
        if t(n) >= t(best):
            break
        best = n
    return best


def backward_priority(dgrad_comp: float, wgrad_comp: float, dgrad_comm: float, next_comp: float = 0.0) -> str:
    """Centauri eq. 1: which backward GEMM of a TP linear to run first.

    ::

        activation first: dgrad_comp + max(dgrad_comm, wgrad_comp)           (dX's reduction hides behind dW)
        weight first:     wgrad_comp + dgrad_comp + max(0, dgrad_comm - next_comp)
                          (dX's reduction can only hide behind the next layer's compute)

    Returns "activation_first" or "weight_first", whichever costs less (ties: activation first)."""
    dgrad_comp, wgrad_comp = _check_cost("dgrad_comp", dgrad_comp), _check_cost("wgrad_comp", wgrad_comp)
    dgrad_comm, next_comp = _check_cost("dgrad_comm", dgrad_comm), _check_cost("next_comp", next_comp)
    activation_first = dgrad_comp + max(dgrad_comm, wgrad_comp)
    weight_first = wgrad_comp + dgrad_comp + max(0.0, dgrad_comm - next_comp)
    return "activation_first" if activation_first <= weight_first else "weight_first"


def op_chunks(
    rows: int,
    row_elems: int,
    out_features: int,
    *,
    comm_bytes: float,
    divides: Optional[int] = None,
    max_chunks: int = OP_MAX_CHUNKS,
) -> int:
    """Chunk count for a fused GEMM + collective called with chunks=None, from the default rates:

    comp = 2 * rows * row_elems * out_features / OP_FLOPS_PER_S
    comm = comm_bytes / OP_BYTES_PER_S;  in_cost = OP_IN_COST_S
    chunk_count(comp, comm, in_cost) among the counts dividing `divides` (any count when None)."""
    comp = 2.0 * rows * row_elems * out_features / OP_FLOPS_PER_S
    comm = max(0.0, float(comm_bytes)) / OP_BYTES_PER_S
    allowed = None if divides is None else [c for c in range(1, max_chunks + 1) if divides % c == 0]
    if allowed is None:
        allowed = range(1, max_chunks + 1)
    return chunk_count(comp, comm, OP_IN_COST_S, max_chunks=max_chunks, allowed=allowed)
