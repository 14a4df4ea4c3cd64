"""Centauri's operation-level choices: how many chunks to cut a fused op into (Algorithm 1) and
which backward GEMM to run first (eq. 1). Pure functions of costs in seconds.

Cutting an op whose compute costs `comp` and communication `comm` into n chunks pipelines
them; each chunk pays a fixed `in_cost` (a message's latency, a kernel launch):

    overlapped_time(n) = max(comp, comm) + min(comp, comm) / n + n * in_cost

    | comm 1 | comm 2 | comm 3 |                  the first chunk's communication (or the last
             | comp 1 | comp 2 | comp 3 |         chunk's compute) is the exposed tail: 1/n of it

Algorithm 1 doubles n from 1 while the modelled time falls and n stays within `max_chunks`
(and among the counts the op accepts); the tail term shrinks as 1/n and the overheads grow as n.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

__all__ = ["overlapped_time", "chunk_count", "backward_priority", "op_chunks", "MAX_CHUNKS",
           "OP_FLOPS_PER_S", "OP_BYTES_PER_S", "OP_IN_COST_S"]

MAX_CHUNKS = 16
# The rates `op_chunks` assumes when an op is called with chunks=None (no profile at hand): one CPU
# core's GEMM rate, a 1 Gbit link, and the cost of one more ring message + GEMM call on gloo.
OP_FLOPS_PER_S = 50e9
OP_BYTES_PER_S = 125e6
OP_IN_COST_S = 150e-6


def _check_cost(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")
    return float(value)


def overlapped_time(comp_cost: float, comm_cost: float, in_cost: float, chunks: int) -> float:
    """Modelled seconds of an op cut into `chunks` pipelined pieces (see the module docstring)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks: expected a positive int, got {chunks!r}")
    return max(comp_cost, comm_cost) + min(comp_cost, comm_cost) / chunks + chunks * in_cost


def chunk_count(comp_cost: float, comm_cost: float, in_cost: float, *, max_chunks: int = MAX_CHUNKS,
                allowed: Optional[Iterable[int]] = None) -> int:
    """Centauri Algorithm 1: the chunk count for an op of `comp_cost` compute and `comm_cost`
    communication seconds, `in_cost` seconds of overhead per chunk.

    ::

        n = 1
        while 2n <= max_chunks and overlapped_time(2n) < overlapped_time(n): n = 2n

    With `allowed` (e.g. the counts that divide the op's rows) the walk goes through the allowed
    counts in ascending order instead of doubling, and 1 is always allowed."""
    comp_cost, comm_cost = _check_cost("comp_cost", comp_cost), _check_cost("comm_cost", comm_cost)
    in_cost = _check_cost("in_cost", in_cost)
    if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1:
        raise ValueError(f"max_chunks: expected a positive int, got {max_chunks!r}")
    if allowed is None:
        steps = [2 ** i for i in range(int(math.log2(max_chunks)) + 1)]
    else:
        steps = sorted({1, *(int(c) for c in allowed if 1 <= int(c) <= max_chunks)})
    best = steps[0]
    for n in steps[1:]:
        if overlapped_time(comp_cost, comm_cost, in_cost, n) >= overlapped_time(comp_cost, comm_cost, in_cost, best):
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


def op_chunks(rows: int, row_elems: int, out_features: int, *, comm_bytes: float,
              divides: Optional[int] = None, max_chunks: int = 8) -> int:
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
