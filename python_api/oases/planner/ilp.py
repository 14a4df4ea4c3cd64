"""The Oases ILP: one strategy per layer of a chain, minimising node + edge costs under a memory limit.

    x[l, i] in {0, 1}, sum_i x[l, i] = 1                    one-hot strategy of layer l     (eq. 5)
    minimise  sum_l node[l] . x[l]  +  sum_l x[l]^T E[l] x[l+1]
    subject to  sum_l memory[l] . x[l] <= budget                                           (eq. 6)

The quadratic edge term is linearised with y[l, i, j] in [0, 1] (the pair of strategies of
layers l and l+1): sum_j y[l, i, j] = x[l, i] and sum_i y[l, i, j] = x[l+1, j]; with x one-hot
these force y[l] to the single pair chosen, so y need not be integral. Solved by
`scipy.optimize.milp` (HiGHS), `method="milp"`.

Two exact shortcuts give the same optimum faster (`method="auto"`, the default):
  - the cheapest chain ignoring memory (dynamic programming over the layers) already fits: done;
  - otherwise a Pareto dynamic programme: for each layer and strategy, the chains ending there
    that no other chain beats in both memory and time (memory in whole bytes). Exact like the
    ILP, and fast where HiGHS is slow: a stack of identical layers makes the ILP's LP relaxation
    weak (a fractional mix of two degrees on every layer pays no edge cost) and its optima many
    (every order of the same degrees), so branch and bound takes 0.2-1 s per memory-bound solve
    of 24 layers x 4 degrees where the Pareto programme takes milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

__all__ = ["Solution", "solve_chain"]


@dataclass(frozen=True)
class Solution:
    """Chosen strategy index per layer, its objective (seconds), memory (bytes) and how it was found."""

    choice: tuple[int, ...]
    objective: float
    memory: float
    method: str  # "dp" (memory not binding), "pareto" or "milp"


def _as_arrays(node, edge, memory):
    node = np.asarray(node, dtype=float)
    memory = np.asarray(memory, dtype=float)
    if node.ndim != 2 or node.shape[0] < 1 or node.shape[1] < 1:
        raise ValueError(f"node_cost: expected [layers][strategies], got shape {node.shape}")
    if memory.shape != node.shape:
        raise ValueError(f"memory: expected shape {node.shape} like node_cost, got {memory.shape}")
    layers, k = node.shape
    edge = np.asarray(edge, dtype=float)
    if edge.shape == (k, k):
        edge = np.broadcast_to(edge, (max(layers - 1, 0), k, k))
    if edge.shape != (max(layers - 1, 0), k, k):
        raise ValueError(f"edge_cost: expected [{k}][{k}] or [{layers - 1}][{k}][{k}], got shape {edge.shape}")
    if not (np.isfinite(node).all() and np.isfinite(edge).all() and np.isfinite(memory).all()):
        raise ValueError("node_cost, edge_cost, memory: every entry must be finite")
    return node, edge, memory


def _chain_dp(node: np.ndarray, edge: np.ndarray) -> tuple[list[int], float]:
    """Cheapest strategy chain ignoring memory (Viterbi)."""
    layers, k = node.shape
    best = node[0].copy()
    back = np.zeros((layers, k), dtype=int)
    for l in range(1, layers):
        total = best[:, None] + edge[l - 1]  # [from, to]
        back[l] = np.argmin(total, axis=0)
        best = total[back[l], np.arange(k)] + node[l]
    choice = [int(np.argmin(best))]
    for l in range(layers - 1, 0, -1):
        choice.append(int(back[l, choice[-1]]))
    return choice[::-1], float(best.min())


METHODS = ("auto", "milp", "pareto")


def solve_chain(
    node_cost: Sequence[Sequence[float]],
    edge_cost: Union[Sequence, np.ndarray],
    memory: Sequence[Sequence[float]],
    budget: float,
    *,
    method: str = "auto",
) -> Solution:
    """Strategy index per layer minimising eq. 5 under sum(memory) <= budget (eq. 6).

    node_cost[l][i], memory[l][i]: layer l with strategy i; edge_cost[i][j] (every edge alike) or
    edge_cost[l][i][j] (layers l, l+1). `method`: "milp" (the ILP by scipy's HiGHS), "pareto"
    or "auto" (see the module docstring; all exact). Raises ValueError naming `budget` when no
    choice fits."""
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one of {METHODS}")
    node, edge, mem = _as_arrays(node_cost, edge_cost, memory)
    layers, k = node.shape
    if mem.min(axis=1).sum() > budget:
        raise ValueError(
            f"budget: even the smallest strategy per layer needs {mem.min(axis=1).sum():.4g} bytes, "
            f"over the {budget:.4g} available (more memory, more ranks, or a smaller batch)"
        )
    choice, objective = _chain_dp(node, edge)
    used = float(mem[np.arange(layers), choice].sum())
    if used <= budget and method != "milp":
        return Solution(tuple(choice), objective, used, "dp")
    if method == "milp":
        return _milp(node, edge, mem, budget)
    return _pareto(node, edge, mem, budget)


def _pareto(node: np.ndarray, edge: np.ndarray, mem: np.ndarray, budget: float) -> Solution:
    """Exact: per (layer, strategy) the chains no other beats in both memory and time."""
    layers, k = node.shape
    units = np.rint(mem).astype(np.int64)  # whole bytes: sums of equal terms stay equal
    limit = int(np.floor(budget))
    tail = np.concatenate([np.cumsum(units.min(axis=1)[::-1])[::-1][1:], [0]])  # least memory of later layers
    # an entry: (memory, time, strategy, parent entry or None)
    fronts = [
        [(int(units[0, i]), float(node[0, i]), i, None)] if units[0, i] + tail[0] <= limit else [] for i in range(k)
    ]
    for l in range(1, layers):
        new = []
        for j in range(k):
            candidates = [
                (e[0] + int(units[l, j]), e[1] + float(edge[l - 1, i, j]) + float(node[l, j]), j, e)
                for i in range(k)
                for e in fronts[i]
            ]
            candidates = [c for c in candidates if c[0] + tail[l] <= limit]
            candidates.sort(key=lambda c: (c[0], c[1]))
            front, best_time = [], float("inf")
            for c in candidates:  # ascending memory: keep only strictly faster chains
                if c[1] < best_time:
                    front.append(c)
                    best_time = c[1]
            new.append(front)
        fronts = new
    ends = [e for front in fronts for e in front]
    if not ends:
        raise ValueError(f"budget: no per-layer choice fits in {budget:.4g} bytes")
    best = min(ends, key=lambda e: e[1])
    choice, entry = [], best
    while entry is not None:
        choice.append(entry[2])
        entry = entry[3]
    choice.reverse()
    return Solution(tuple(choice), best[1], float(mem[np.arange(layers), choice].sum()), "pareto")


def _milp(node: np.ndarray, edge: np.ndarray, mem: np.ndarray, budget: float) -> Solution:
    from scipy.optimize import Bounds, LinearConstraint, milp

    layers, k = node.shape
    nx, ny = layers * k, (layers - 1) * k * k
    c = np.concatenate([node.ravel(), edge.ravel()])
    rows, lo, hi = [], [], []

    def row() -> np.ndarray:
        r = np.zeros(nx + ny)
        rows.append(r)
        return r

    for l in range(layers):  # one-hot
        row()[l * k : (l + 1) * k] = 1.0
        lo.append(1.0)
        hi.append(1.0)
    for l in range(layers - 1):  # y[l] has x[l] and x[l+1] as marginals
        base = nx + l * k * k
        for i in range(k):
            r = row()
            r[base + i * k : base + (i + 1) * k] = 1.0
            r[l * k + i] = -1.0
            lo.append(0.0)
            hi.append(0.0)
        for j in range(k):
            r = row()
            r[base + j : base + k * k : k] = 1.0
            r[(l + 1) * k + j] = -1.0
            lo.append(0.0)
            hi.append(0.0)
    row()[:nx] = mem.ravel()
    lo.append(-np.inf)
    hi.append(float(budget))
    integrality = np.concatenate([np.ones(nx), np.zeros(ny)])
    result = milp(
        c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality, bounds=Bounds(0.0, 1.0)
    )
    if result.x is None:
        raise ValueError(f"budget: no per-layer choice fits in {budget:.4g} bytes ({result.message})")
    x = result.x[:nx].reshape(layers, k)
    choice = tuple(int(i) for i in np.argmax(x, axis=1))
    objective = float(
        node[np.arange(layers), choice].sum() + sum(edge[l, choice[l], choice[l + 1]] for l in range(layers - 1))
    )
    return Solution(choice, objective, float(mem[np.arange(layers), choice].sum()), "milp")
