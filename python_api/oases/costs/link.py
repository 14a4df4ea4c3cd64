"""A link's cost: t(nbytes) = latency_s + nbytes / bytes_per_s, measured or assumed.

fit = LinkFit.from_samples([(nbytes, seconds), ...])    # all-reduces (or p2p) timed alone
fit.time(2**20)                                         # seconds for a 1 MiB message
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

__all__ = ["LinkFit", "DEFAULT_LATENCY_S"]

DEFAULT_LATENCY_S = 30e-6  # per message on a ring step; an Ethernet / PCIe figure when none is measured


@dataclass(frozen=True)
class LinkFit:
    """t(nbytes) = latency_s + nbytes / bytes_per_s."""

    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: float) -> float:
        """Seconds for `nbytes` on the link: latency_s + nbytes / bytes_per_s."""
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[float, float]]) -> "LinkFit":
        """The fit of measured (nbytes, seconds), each term from the samples where it dominates:
        the bandwidth from the two largest sizes (the slope between them, where the latency is
        negligible; at least a quarter of the largest sample's own rate, so a noisy pair cannot
        make the link free), the latency as the median of t - nbytes / bytes_per_s (clipped at 0).
        Least squares instead lets noisy small messages set the slope (on a 750 Mbit/s link:
        58 MB/s from samples whose 6 MB message ran at 47 MB/s)."""
        if not samples:
            raise ValueError("samples: expected (nbytes, seconds) pairs, got none")
        pairs = sorted((float(n), float(t)) for n, t in samples)
        (n_hi, t_hi) = pairs[-1]
        slope = t_hi / n_hi
        if len(pairs) > 1 and n_hi > pairs[-2][0]:
            slope = max((t_hi - pairs[-2][1]) / (n_hi - pairs[-2][0]), slope / 4)
        slope = max(slope, 1e-15)
        latency = max(statistics.median([t - n * slope for n, t in pairs]), 0.0)
        return cls(latency, 1.0 / slope)
