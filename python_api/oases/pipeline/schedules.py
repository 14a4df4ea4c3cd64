"""Pipeline schedules as data: the ordered list of actions each stage runs in one training step.

An action is F(k, i) (forward of micro-batch i through this stage's part of segment k) or
B(k, i) (its backward). A schedule is a pure function of (stage s, stages p, segments ns,
micro-batches m); the executor (oases.pipeline.pipeline) runs the list in order, receiving
each action's input just before it (posted one action ahead) and sending its output without
waiting. Every list is a subsequence of one global topological order of the actions, and sends
never block, so no ordering of them deadlocks.

gpipe (all forwards, then all backwards; with ns > 1 micro-batch-major: F(0,i) F(1,i) ...):

    p=2, m=3     time ->
    stage 0:  F0 F1 F2 .. .. .. .. B0 B1 B2
    stage 1:  .. F0 F1 F2 B0 B1 B2 ..

1f1b (Megatron's non-interleaved: p-s-1 warm-up forwards, then one forward / one backward,
then the cool-down backwards; ns = 1, m >= p):

    p=2, m=3     time ->
    stage 0:  F0 F1 .. B0 F2 B1 .. B2
    stage 1:  .. F0 B0 F1 B1 F2 B2

aiao (FOLD3D Algorithm 1, all-in-all-out: for each segment, every micro-batch's forward; then
from the last segment down, every micro-batch's backward), segments as superscripts:

    p=2, ns=2, m=2   time ->
    stage 0:  F0⁰ F1⁰ .. .. F0¹ F1¹ .. .. .. .. B0¹ B1¹ .. .. B0⁰ B1⁰
    stage 1:  .. F0⁰ F1⁰ .. .. F0¹ F1¹ B0¹ B1¹ .. .. B0⁰ B1⁰ ..

A segment's backward of all micro-batches ends before the next (lower) segment's begins, so its
gradients are final there: the per-segment data-parallel sync starts (oases.pipeline.dp_sync).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from oases import _checks

__all__ = ["Action", "SCHEDULES", "actions"]


class Action(NamedTuple):
    """One action of a stage: the forward (kind "F") or backward ("B") of micro-batch `micro_batch`
    through this stage's part of segment `segment`; written F<i>^<k>."""

    kind: str  # "F" forward or "B" backward
    segment: int
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}^{self.segment}"


def _gpipe(stage: int, stages: int, segments: int, m: int) -> list[Action]:
    forward = [Action("F", k, i) for i in range(m) for k in range(segments)]
    return forward + [Action("B", k, i) for i in range(m) for k in reversed(range(segments))]


def _one_f_one_b(stage: int, stages: int, segments: int, m: int) -> list[Action]:
    warmup = min(stages - stage - 1, m)
    plan = [Action("F", 0, i) for i in range(warmup)]
    for j in range(m - warmup):  # steady state: one forward, one backward
        plan += [Action("F", 0, warmup + j), Action("B", 0, j)]
    return plan + [Action("B", 0, j) for j in range(m - warmup, m)]


def _aiao(stage: int, stages: int, segments: int, m: int) -> list[Action]:
    forward = [Action("F", k, i) for k in range(segments) for i in range(m)]
    return forward + [Action("B", k, i) for k in reversed(range(segments)) for i in range(m)]


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "aiao": _aiao,
}


def actions(
    schedule: str, *, stage: int, stages: int, segments: int, micro_batches: int, forward_only: bool = False
) -> list[Action]:
    """The actions stage `stage` runs in one step, in order; each F(k, i) and B(k, i) exactly once.

    gpipe: [F(k, i) for i, k] + [B(k, i) for i, k reversed]
    1f1b:  F(0, 0..w-1), (F(0, w+j), B(0, j)) for j < m-w, B(0, m-w..m-1)   (w = min(p-s-1, m))
    aiao:  [F(k, i) for k, i] + [B(k, i) for k descending, i]
    forward_only (an evaluation, any schedule): [F(k, i) for k, i]
    """
    _checks.one_of("schedule", schedule, SCHEDULES)
    if schedule == "1f1b" and segments != 1:
        raise ValueError(f"segments: the 1f1b schedule runs one segment, got {segments} (use 'aiao')")
    if forward_only:
        return [Action("F", k, i) for k in range(segments) for i in range(micro_batches)]
    return SCHEDULES[schedule](stage, stages, segments, micro_batches)
