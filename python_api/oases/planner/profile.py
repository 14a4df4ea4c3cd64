"""What the cost model knows of a device and its links: measured (a profile JSON written by
`python -m bench profile`) or analytical (FLOP rate and link bandwidth).

    profile = load_profile("bench/profiles/cpu-....json")          # measured
    profile = analytical_profile(flops_per_s=100e12, link="25gbit")  # no profile: eqs. from rates
    profile.compute_time("mlp", shape, tokens=4096, tp=2, direction="forward")   # seconds
    profile.collective_time("all_reduce", group=4, nbytes=2**24)                # seconds

Collectives follow `t = latency_s + nbytes / bytes_per_s` per (kind, group size), nbytes being
the full tensor (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: its
input, timed as the all-gather when not profiled; p2p: the message).
Analytically, on a ring of p ranks over a link of B bytes/s with per-message latency a:

    all_reduce:  2 (p-1) a + 2 (p-1)/p n / B       all_gather, reduce_scatter: (p-1) a + (p-1)/p n / B
    p2p:         a + n / B

Compute comes from the profile's samples of the same sublayer, shape and TP degree, piecewise
linear in the tokens between them (a CPU's time per token is not one line from 64 to 512 tokens:
caches), proportional beyond the largest; for other shapes it scales the nearest sample's time by
FLOPs (same sublayer, the same TP degree when sampled; always so for an MoE's MLP, whose
router and experts the dense samples did not time), and without samples it is
FLOPs / flops_per_s. A sample's figures are the forward (no autograd), the backward, the
forward recording autograd's graph that recomputation runs before each backward, and that
recording without the output projection's GEMM (fine-grained recomputation never reads its
value: oases.schedule.protocol's core_for_gradients; profiles without it scale the recording by
its FLOPs, ModelShape.projection_flops).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

import numpy as np

from oases._files import read_json
from oases.costs.chunks import check_efficiency
from oases.costs.link import DEFAULT_LATENCY_S, LinkFit
from oases.costs.rate import parse_bandwidth
from oases.planner.model import SUBLAYERS, ModelShape

__all__ = [
    "LinkFit",
    "ComputeSample",
    "Profile",
    "analytical_profile",
    "load_profile",
    "parse_bytes",
    "parse_link",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "COLLECTIVES",
]

PROFILE_FORMAT = "oases-profile"
PROFILE_VERSION = 1
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
DIRECTIONS = ("forward", "backward", "recompute", "recompute_unread")

_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: Union[str, int, float], *, what: str = "device_memory") -> int:
    """Bytes of "24GB", "24GiB", "512MB" or a plain number (bytes). GB = 10**9, GiB = 2**30."""
    if isinstance(text, bool):
        raise TypeError(f"{what}: expected a size such as 24GB, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        stripped = text.strip().lower()
        unit = next((u for u in sorted(_BYTE_UNITS, key=len, reverse=True) if stripped.endswith(u)), "b")
        number = stripped[: len(stripped) - len(unit)] if stripped.endswith(unit) else stripped
        try:
            value = float(number) * _BYTE_UNITS[unit]
        except ValueError:
            raise ValueError(f"{what}: {text!r} is not a size; write e.g. 24GB, 80GiB or 512MB") from None
    else:
        raise TypeError(f"{what}: expected a size such as 24GB, got {type(text).__name__}")
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{what}: must be positive, got {text!r}")
    return int(value)


def parse_link(text: Union[str, float, int]) -> float:
    """Bytes/s of a tc-style rate ("25gbit", "750mbit") or a number of bytes/s."""
    if isinstance(text, bool):
        raise TypeError(f"link: expected a rate such as 25gbit, got {text!r}")
    if isinstance(text, (int, float)):
        if not text > 0:
            raise ValueError(f"link: must be positive bytes/s, got {text!r}")
        return float(text)
    try:
        return parse_bandwidth(text)
    except ValueError as err:
        raise ValueError(f"link: {err}") from None


@dataclass(frozen=True)
class ComputeSample:
    """Measured seconds of one rank's shard of a sublayer (norm + core + finish) on `rows` sequences."""

    sublayer: str
    tp: int
    rows: int
    seq_len: int
    hidden: int
    heads: int
    ffn_hidden: int
    forward_s: float
    backward_s: float
    record_s: Optional[float] = None  # the forward again with autograd recording (recomputation); None: forward_s
    # the same without the output projection's GEMM (fine-grained recomputation); None: record_s scaled by FLOPs
    record_unread_s: Optional[float] = None

    def seconds(self, direction: str) -> float:
        """Seconds of `direction`: "forward", "backward", else the recomputation (record_s, or
        forward_s where it was not measured)."""
        if direction == "forward":
            return self.forward_s
        if direction == "backward":
            return self.backward_s
        return self.forward_s if self.record_s is None else self.record_s

    def projection_rate(self) -> Optional[float]:
        """Seconds per FLOP of the output projection the recording skips when fine-grained
        (record_s - record_unread_s over its FLOPs); None where record_unread_s was not measured."""
        if self.record_unread_s is None:
            return None
        tokens = self.rows * self.seq_len
        proj = self.shape().projection_flops(self.sublayer, tokens, self.tp)
        return max(self.seconds("recompute") - self.record_unread_s, 0.0) / proj if proj else None

    def matches(self, shape: ModelShape, tokens: int, tp: int) -> bool:
        """Whether this sample timed `shape`'s sublayer on `tokens` at `tp` (samples are of dense
        MLPs: never an MoE's MLP, which compute_time scales from them by FLOPs)."""
        return (
            self.tp == tp
            and self.rows * self.seq_len == tokens
            and self.seq_len == shape.seq_len
            and self.hidden == shape.hidden
            and self.heads == shape.heads
            and self.ffn_hidden == shape.ffn_hidden
            and not (self.sublayer == "mlp" and shape.experts)
        )

    def shape(self) -> ModelShape:
        """A one-layer ModelShape of the sample's sizes (vocab_size 1)."""
        return ModelShape(1, self.hidden, self.heads, self.seq_len, 1, ffn_hidden=self.ffn_hidden)


@dataclass(frozen=True)
class Profile:
    """Rates of one device type and its links (see the module docstring)."""

    device: str
    flops_per_s: float
    link_bytes_per_s: float
    latency_s: float = DEFAULT_LATENCY_S
    element_bytes: int = 2
    compute: tuple[ComputeSample, ...] = ()
    head: tuple[tuple[int, float, float], ...] = ()  # (tokens * hidden * vocab, forward_s, backward_s)
    collectives: Mapping[tuple[str, int], LinkFit] = field(default_factory=dict)
    source: str = "analytical"
    overlap: float = 1.0  # share of the shorter of an overlapped (compute, comm) pair that is hidden
    # {n: time of one GEMM / time of it cut into n pieces}, measured (empty: every count ideal)
    chunk_efficiency: Mapping[int, float] = field(default_factory=dict)

    def overlapped(self, compute_s: float, comm_s: float) -> float:
        """Seconds of a compute and a communication run at once: max(c, a) (eq. 3) when the device
        hides all of the shorter one, plus (1 - overlap) of it when it does not (a CPU whose cores
        also drive the transfers; measured by `python -m bench profile`)."""
        return max(compute_s, comm_s) + (1.0 - self.overlap) * min(compute_s, comm_s)

    def compute_time(self, sublayer: str, shape: ModelShape, tokens: float, tp: int, direction: str) -> float:
        """Seconds of `direction` of one rank's shard of `sublayer`: "forward" (no autograd, as the
        schedules run it), "backward", "recompute" (the forward again, recording autograd's graph),
        or "recompute_unread" (that without the output projection's GEMM: fine-grained recomputation)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: {direction!r} is not one of {DIRECTIONS}")
        if sublayer not in SUBLAYERS:
            raise ValueError(f"sublayer: {sublayer!r} is not one of {SUBLAYERS}")
        if tokens <= 0:
            return 0.0
        if direction == "recompute_unread":
            return self._recompute_unread(sublayer, shape, tokens, tp)
        flops = shape.flops(sublayer, int(round(tokens)), tp)
        samples = [s for s in self.compute if s.sublayer == sublayer]
        same = sorted((s for s in samples if s.matches(shape, s.rows * s.seq_len, tp)), key=lambda s: s.rows)
        if same:  # this shape and degree, sampled: piecewise linear through the samples (see the module docstring)
            xs = [float(s.rows * s.seq_len) for s in same]
            ys = [s.seconds(direction) for s in same]
            return _through(xs, ys, float(tokens))
        if samples:
            same_tp = [s for s in samples if s.tp == tp] or samples

            def distance(s: ComputeSample) -> float:
                return abs(math.log(s.shape().flops(sublayer, s.rows * s.seq_len, s.tp) / flops))

            near = min(same_tp, key=distance)
            near_flops = near.shape().flops(sublayer, near.rows * near.seq_len, near.tp)
            return near.seconds(direction) * flops / near_flops
        return flops * (2 if direction == "backward" else 1) / self.flops_per_s

    def _recompute_unread(self, sublayer: str, shape: ModelShape, tokens: float, tp: int) -> float:
        """The recomputation less the output projection: its FLOPs (of `shape`, gated MLP or not)
        at the seconds per FLOP measured for it (the nearest sample with record_unread_s, the
        same degree preferred), else at the recording's own rate; an MoE MLP recomputes in full."""
        full = self.compute_time(sublayer, shape, tokens, tp, "recompute")
        proj = shape.projection_flops(sublayer, int(round(tokens)), tp)
        if not proj:
            return full
        measured = [s for s in self.compute if s.sublayer == sublayer and s.projection_rate() is not None]
        if measured:
            same_tp = [s for s in measured if s.tp == tp] or measured
            near = min(same_tp, key=lambda s: abs(math.log(s.rows * s.seq_len / tokens)))
            rate = near.projection_rate()
        else:
            rate = full / shape.flops(sublayer, int(round(tokens)), tp)
        return max(full - proj * rate, 0.0)

    def head_time(self, shape: ModelShape, tokens: float) -> float:
        """Seconds of the LM head's forward + backward (embedding lookups are negligible)."""
        size = tokens * shape.hidden * shape.vocab_size
        if size <= 0:
            return 0.0
        if self.head:
            near = min(self.head, key=lambda h: abs(math.log(h[0] / size)))
            return (near[1] + near[2]) * size / near[0]
        return 3 * shape.head_flops(int(tokens)) / self.flops_per_s

    def collective_time(self, kind: str, group: int, nbytes: float) -> float:
        """Seconds of one collective of `kind` on `group` ranks over a full tensor of `nbytes`
        (0 on one rank or with nothing to send)."""
        if kind not in COLLECTIVES:
            raise ValueError(f"kind: {kind!r} is not one of {COLLECTIVES}")
        if group <= 1 and kind != "p2p" or nbytes <= 0:
            return 0.0
        fit = self.collectives.get((kind, group))
        if fit is None and kind == "reduce_scatter":  # the all-gather's ring run backwards: the same messages
            fit = self.collectives.get(("all_gather", group))
        if fit is not None:
            return fit.time(nbytes)
        p, a, bw = group, self.latency_s, self.link_bytes_per_s
        if kind == "all_reduce":
            return 2 * (p - 1) * a + 2 * (p - 1) / p * nbytes / bw
        if kind in ("all_gather", "reduce_scatter"):
            return (p - 1) * a + (p - 1) / p * nbytes / bw
        return a + nbytes / bw

    def to_dict(self) -> dict[str, Any]:
        """The summary a plan records (not the full profile)."""
        return {
            "device": self.device,
            "source": self.source,
            "flops_per_s": self.flops_per_s,
            "link_bytes_per_s": self.link_bytes_per_s,
            "latency_s": self.latency_s,
            "element_bytes": self.element_bytes,
            "overlap": self.overlap,
            "compute_samples": len(self.compute),
            "chunk_efficiency": {str(n): e for n, e in sorted(self.chunk_efficiency.items())},
            "collective_fits": {f"{k}@{g}": [f.latency_s, f.bytes_per_s] for (k, g), f in self.collectives.items()},
        }


def _through(xs: list[float], ys: list[float], x: float) -> float:
    """Seconds at `x` tokens from samples (xs ascending): linear between the two samples around x;
    above the largest, proportional to it (the work grows with the tokens); below the smallest,
    the line through the two smallest, never under the proportional share of the smallest."""
    if len(xs) == 1 or x >= xs[-1]:
        return ys[-1] * x / xs[-1] if x > xs[-1] or len(xs) == 1 else ys[-1]
    i = max(1, int(np.searchsorted(xs, x)))
    (x0, y0), (x1, y1) = (xs[i - 1], ys[i - 1]), (xs[i], ys[i])
    line = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(line, ys[0] * x / xs[0]) if x < xs[0] else line


def analytical_profile(
    *,
    flops_per_s: float,
    link: Union[str, float],
    latency_s: float = DEFAULT_LATENCY_S,
    element_bytes: int = 2,
    device: str = "analytical",
) -> Profile:
    """A profile from rates alone: compute = FLOPs / flops_per_s, collectives by the ring formulas."""
    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s: must be positive, got {flops_per_s!r}")
    if element_bytes not in (1, 2, 4, 8):
        raise ValueError(f"element_bytes: expected 1, 2, 4 or 8, got {element_bytes!r}")
    return Profile(
        device=device,
        flops_per_s=float(flops_per_s),
        link_bytes_per_s=parse_link(link),
        latency_s=float(latency_s),
        element_bytes=element_bytes,
    )


def load_profile(path: str, *, link: Optional[Union[str, float]] = None) -> Profile:
    """Read a profile written by `python -m bench profile`. `link` replaces the measured link
    (its bandwidth, keeping the measured latency): plan for another network with this device's compute."""
    return profile_from_dict(read_json(path, "profile"), link=link, source=path)


def profile_from_dict(
    doc: Mapping[str, Any], *, link: Optional[Union[str, float]] = None, source: str = "dict"
) -> Profile:
    """The Profile of a profile document (see bench/profile.py for its layout)."""
    if not isinstance(doc, Mapping) or doc.get("format") != PROFILE_FORMAT:
        raise ValueError(
            f'profile: {source} is not an oases profile (expected "format": "{PROFILE_FORMAT}"; '
            "write one with `python -m bench profile`)"
        )
    if doc.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"profile: {source} has version {doc.get('version')!r}; this planner reads {PROFILE_VERSION} "
            "(profile again with `python -m bench profile`)"
        )
    try:
        optional = {"record_s", "record_unread_s"}  # profiles written before they were measured lack them
        compute = tuple(
            ComputeSample(**{k: c[k] for k in ComputeSample.__dataclass_fields__ if k in c or k not in optional})
            for c in doc["compute"]
        )
        head = tuple(
            (h["tokens"] * h["hidden"] * h["vocab_size"], h["forward_s"], h["backward_s"]) for h in doc.get("head", [])
        )
        collectives = {
            (kind, int(group)): LinkFit(fit["latency_s"], fit["bytes_per_s"])
            for kind, fits in doc["collectives"].items()
            for group, fit in fits.items()
        }
        flops_per_s = float(doc["flops_per_s"])
        element_bytes = int(doc.get("element_bytes", 4))
        overlap = min(max(float(doc.get("overlap_efficiency", 1.0)), 0.0), 1.0)
    except (KeyError, TypeError) as err:
        raise ValueError(f"profile: {source} lacks {err} (profile again with `python -m bench profile`)") from None
    # profiles written before it was measured lack it: every chunk count ideal
    efficiency = check_efficiency(doc.get("chunk_efficiency"), f"profile: {source}: chunk_efficiency")
    link_fit = collectives.get(("p2p", 2)) or LinkFit(DEFAULT_LATENCY_S, 1e9)
    bytes_per_s, latency_s = link_fit.bytes_per_s, link_fit.latency_s
    if link is not None:  # another network: ring formulas from the new rate, the measured latency
        bytes_per_s = parse_link(link)
        collectives = {}
    return Profile(
        device=str(doc.get("device", {}).get("name", "unknown")),
        flops_per_s=flops_per_s,
        link_bytes_per_s=bytes_per_s,
        latency_s=latency_s,
        element_bytes=element_bytes,
        compute=compute,
        head=head,
        collectives=collectives,
        source=source,
        overlap=overlap,
        chunk_efficiency=efficiency,
    )
