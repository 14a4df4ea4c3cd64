"""Centauri's collective-level choices: the inter-/intra-host partition of a collective, and
all-reduce as reduce-scatter + all-gather (primitive substitution). Pure functions of costs.

The topology is that of `oases-launch --hosts h` and of a commodity cluster: h hosts of k ranks
(ranks packed: group rank g sits on host g // k), each host with one NIC (`inter`, full duplex:
`bytes_per_s` each way, shared by every flow leaving the host) and one internal link (`intra`:
`bytes_per_s` shared by every flow between the host's ranks, as PCIe through one host bridge, or
the launcher's shared loopback). A link is LinkFit-like: `latency_s` per message, `bytes_per_s`.

A ring step moves one message per rank; its time is the slowest link's
latency + (flows on it) * (message bytes) / bytes_per_s. For a collective over a full tensor of
T bytes (reduce-scatter: the input; all-gather: the output; all-reduce: the tensor), P = h k
ranks and m = T / P (one rank's block):

    flat ring (P - 1 steps, one m-message per rank; on a host k - 1 flows inside, 1 out its NIC):
        step = max(a_intra + (k-1) m / B_intra,  a_inter + m / B_inter)       (h > 1)
        step = a_intra + k m / B_intra                                         (h = 1)
        t_flat = (P - 1) step                       NIC bytes per host, each way: (P-1)/P T

    hierarchical reduce-scatter (all-gather: the same phases in reverse order):
        intra RS over the host's k ranks, T bytes:   (k - 1) (a_intra + k (T/k) / B_intra)
        inter RS over the h ranks of one local index, T/k bytes each, k such rings per NIC:
                                                     (h - 1) (a_inter + k m / B_inter)
        t_hier = intra + inter                      NIC bytes per host, each way: (h-1)/h T

    all-reduce (= RS + AG, flat or hierarchical): 2 t

So hierarchy cuts the bytes through each NIC from (hk-1)/(hk) T to (h-1)/h T (by 1/3 for 2 hosts
of 2 ranks, ~1/2 for many ranks per host) and pays (k-1)/k T more on the intra-host link: it wins
when the NIC is the slow link. With h = 1 or k = 1 both forms are the same rings (equal times; the
choice is "flat"). The model is for unidirectional rings (`bidirectional=False`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

__all__ = [
    "LinkLike",
    "CollectiveChoice",
    "COLLECTIVE_KINDS",
    "flat_time",
    "hierarchical_time",
    "partition",
    "all_reduce_form",
]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class LinkLike(Protocol):
    """What the model reads of a link: oases.costs.link.LinkFit has both."""

    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class CollectiveChoice:
    """A choice and the modelled seconds of every candidate (`choice` is the cheapest)."""

    choice: str
    seconds: Mapping[str, float]


def _number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _link(name: str, link: Any) -> tuple[float, float]:
    if not hasattr(link, "latency_s") or not hasattr(link, "bytes_per_s"):
        raise ValueError(f"{name}: expected a link with latency_s and bytes_per_s (a LinkFit), got {link!r}")
    return (
        _number(f"{name}.latency_s", link.latency_s),
        _number(f"{name}.bytes_per_s", link.bytes_per_s, positive=True),
    )


def _arguments(kind: str, nbytes: float, ranks_per_host: int, hosts: int, intra: Any, inter: Any):
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {COLLECTIVE_KINDS}")
    return (
        _number("nbytes", nbytes),
        _count("ranks_per_host", ranks_per_host),
        _count("hosts", hosts),
        _link("intra", intra),
        _link("inter", inter),
    )


def _passes(kind: str) -> int:
    return 2 if kind == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather


def flat_time(kind: str, nbytes: float, ranks_per_host: int, hosts: int, intra: LinkLike, inter: LinkLike) -> float:
    """Modelled seconds of the flat ring over all h k ranks (see the module docstring)."""
    t, k, h, (a_in, b_in), (a_out, b_out) = _arguments(kind, nbytes, ranks_per_host, hosts, intra, inter)
    p = h * k
    if p == 1 or t == 0:
        return 0.0
    m = t / p
    if h == 1:
        step = a_in + k * m / b_in
    else:
        inside = a_in + (k - 1) * m / b_in if k > 1 else 0.0
        step = max(inside, a_out + m / b_out)
    return _passes(kind) * (p - 1) * step


def hierarchical_time(
    kind: str, nbytes: float, ranks_per_host: int, hosts: int, intra: LinkLike, inter: LinkLike
) -> float:
    """Modelled seconds of the two-level form: intra-host rings, then inter-host rings of the
    ranks with the same local index (all-gather: the reverse order); see the module docstring."""
    t, k, h, (a_in, b_in), (a_out, b_out) = _arguments(kind, nbytes, ranks_per_host, hosts, intra, inter)
    if h * k == 1 or t == 0:
        return 0.0
    m = t / (h * k)
    inside = (k - 1) * (a_in + t / b_in)  # k flows of T/k share the host's link
    across = (h - 1) * (a_out + k * m / b_out)  # k rings share the NIC, m bytes each per step
    return _passes(kind) * (inside + across)


def partition(
    kind: str, nbytes: float, ranks_per_host: int, hosts: int, intra: LinkLike, inter: LinkLike
) -> CollectiveChoice:
    """Centauri's partition choice for one collective: "flat" or "hierarchical", whichever the
    model says is faster (ties: "flat", the single ring).

    ::

        seconds = {"flat": flat_time(...), "hierarchical": hierarchical_time(...)}

    `kind`: all_gather | reduce_scatter | all_reduce; `nbytes`: the full tensor.
    """
    flat = flat_time(kind, nbytes, ranks_per_host, hosts, intra, inter)
    hier = hierarchical_time(kind, nbytes, ranks_per_host, hosts, intra, inter)
    two_levels = hosts > 1 and ranks_per_host > 1  # otherwise both forms are the same rings
    choice = "hierarchical" if two_levels and hier < flat else "flat"
    return CollectiveChoice(choice, {"flat": flat, "hierarchical": hier})


def all_reduce_form(
    *,
    all_reduce_s: float,
    reduce_scatter_s: float,
    all_gather_s: float,
    before_s: float = 0.0,
    after_s: float = 0.0,
    overlap: float = 1.0,
) -> CollectiveChoice:
    """Primitive substitution: keep a blocking all-reduce, or run it as a reduce-scatter that
    overlaps the compute before it and an all-gather that overlaps the compute after it.
    Returns the form whose *exposed* communication is smaller (ties: "all_reduce", one call).

        all_reduce:  all_reduce_s                                          (nothing hides it)
        rs_ag:       exposed(reduce_scatter_s, before_s) + exposed(all_gather_s, after_s)
        exposed(c, w) = c - overlap * min(c, w)

    `before_s`: compute that can run while the reduce-scatter travels (the op producing the
    tensor, chunked, as oases.ops.linear_reduce_scatter); `after_s`: compute that consumes the
    gathered result piece by piece (oases.ops.all_gather_linear). `overlap` in [0, 1] is the share
    of the shorter of a (compute, comm) pair the device hides (Profile.overlap; 1: all of it).
    With before_s = after_s = 0 this compares the native all-reduce against the two rings back to
    back: rs_ag wins only where the backend's all-reduce is slower than RS + AG. For a whole
    stack on the Oases runtime, where the substitution is sequence parallelism (with its
    re-gather in recomputation and every sub-batch's overlap), the planner compares the two forms'
    steps instead: oases.planner.cost.sequence_parallel_form.
    """
    ar = _number("all_reduce_s", all_reduce_s)
    rs, ag = _number("reduce_scatter_s", reduce_scatter_s), _number("all_gather_s", all_gather_s)
    before, after = _number("before_s", before_s), _number("after_s", after_s)
    overlap = _number("overlap", overlap)
    if overlap > 1:
        raise ValueError(f"overlap: must be within [0, 1], got {overlap!r}")
    rs_ag = (rs - overlap * min(rs, before)) + (ag - overlap * min(ag, after))
    return CollectiveChoice("rs_ag" if rs_ag < ar else "all_reduce", {"all_reduce": ar, "rs_ag": rs_ag})
