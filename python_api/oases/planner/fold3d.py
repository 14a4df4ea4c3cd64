"""FOLD3D's two pipeline numbers (eqs. 2-5) as plain functions of measured or modelled seconds:
the segment count ns of the folded (aiao) layout and the share r of a segment's DP sync launched
at once. For `oases.pipeline.Pipeline(segments=..., dp_overlap_ratio=...)`.

Per pipeline stage and micro-batch: `forward_s`, `backward_s` (the stage's whole share of layers),
`pp_comm_s` (one activation sent to the next stage), and `dp_comm_s` (the stage's whole gradient
sync over dp). With ns segments each segment holds 1/ns of the stage's layers, so:

    a segment's DP sync          dp_comm_s / ns       (the last one to finish backward is exposed)
    PP transfers per stage       2 m ns pp_comm_s     (each micro-batch crosses every segment's stages,
                                                       both ways), hidden under m (F + B) of compute
    exposed(ns) = dp_comm_s / ns + max(0, 2 m ns pp_comm_s - m (forward_s + backward_s))     (eq. 3)

choose_segments raises ns through the counts that divide the layers (layers % (pp ns) == 0)
while exposed(ns) keeps falling: more segments hide more DP sync until the PP transfers no
longer fit under the computation (eq. 4). dp_overlap_ratio (eq. 5) launches the whole segment
sync at once when it fits under the next segment's backward (m B / ns), else splits it between
that backward and the next iteration's forward in proportion to the two windows.
"""

from __future__ import annotations

import math

from oases import _checks

__all__ = ["choose_segments", "dp_overlap_ratio", "exposed_comm"]


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _count(name: str, value: int) -> int:
    if not _checks.is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def exposed_comm(
    segments: int, forward_s: float, backward_s: float, pp_comm_s: float, dp_comm_s: float, *, micro_batches: int
) -> float:
    """Seconds of PP + DP communication left exposed per iteration with `segments` (eq. 3)."""
    m = micro_batches
    return dp_comm_s / segments + max(0.0, 2 * m * segments * pp_comm_s - m * (forward_s + backward_s))


def choose_segments(
    layers: int,
    pp: int,
    forward_s: float,
    backward_s: float,
    pp_comm_s: float,
    dp_comm_s: float,
    *,
    micro_batches: int,
    max_segments: int = 8,
) -> int:
    """FOLD3D's segment count for `layers` on `pp` stages (see the module docstring)::

        ns = 1
        for c in counts 2..max_segments with layers % (pp * c) == 0, ascending:
            if exposed(c) < exposed(ns): ns = c  else: stop

    Raises ValueError when `layers` is not divisible by `pp`."""
    layers, pp = _count("layers", layers), _count("pp", pp)
    m, max_segments = _count("micro_batches", micro_batches), _count("max_segments", max_segments)
    f, b = _seconds("forward_s", forward_s), _seconds("backward_s", backward_s)
    pp_s, dp_s = _seconds("pp_comm_s", pp_comm_s), _seconds("dp_comm_s", dp_comm_s)
    if layers % pp:
        raise ValueError(f"layers: {layers} is not divisible by pp = {pp}")
    ns = 1
    for c in range(2, max_segments + 1):
        if layers % (pp * c):
            continue
        if exposed_comm(c, f, b, pp_s, dp_s, micro_batches=m) < exposed_comm(ns, f, b, pp_s, dp_s, micro_batches=m):
            ns = c
        else:
            break
    return ns


def dp_overlap_ratio(
    forward_s: float, backward_s: float, dp_comm_s: float, *, segments: int, micro_batches: int
) -> float:
    """FOLD3D eq. 5: the share r in [0, 1] of a segment's DP sync to launch at once.

    sync = dp_comm_s / ns;  under_backward = m backward_s / ns;  under_forward = m forward_s / ns
    r = 1                                                 if sync <= under_backward
    r = under_backward / (under_backward + under_forward) otherwise"""
    f, b, dp_s = _seconds("forward_s", forward_s), _seconds("backward_s", backward_s), _seconds("dp_comm_s", dp_comm_s)
    ns, m = _count("segments", segments), _count("micro_batches", micro_batches)
    sync, under_b, under_f = dp_s / ns, m * b / ns, m * f / ns
    if sync <= under_b or under_b + under_f == 0:
        return 1.0
    return under_b / (under_b + under_f)
