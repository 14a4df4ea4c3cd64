"""Which layers recompute: the fastest assignment of modes to layers whose bytes fit a budget.

Each layer runs one of three modes (train_step's `recompute` per layer); what it holds from its
forward to its backward and what its backward reruns:

    mode        held (bytes, per step)                         rerun in the backward
    full        its input(s): the schedule's recomputation      its forward (1 unit of time)
    selective   inputs + GEMM and attention outputs             its element-wise ops (SELECTIVE_RERUN)
    keep        every tensor autograd saves                     nothing

    choose_modes(layers, budget):                                # greedy, as below
        modes = [full] * L;  spare = budget - sum(layer.full)
        repeat: among the upgrades of one layer (full -> selective, full -> keep, selective -> keep)
                whose extra bytes fit in spare, apply the one saving the most time per extra byte
                (ties: the later layer first), until none fits
        -> modes (None when even every layer at full does not fit)

Greedy, not optimal in general (a knapsack), but for layers alike (a decoder's) it upgrades them
all to the better ratio first (selective, usually: it keeps most of keep's saving for well under
its bytes) and then to keep, one layer at a time: what a person would choose by hand. Times are
in units of a layer's forward: full reruns it (1), selective its element-wise share (a stated
estimate; GEMMs and attention dominate a forward), keep nothing. Pure: numbers in, names out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "FULL",
    "SELECTIVE",
    "KEEP",
    "MODES",
    "SELECTIVE_RERUN",
    "LayerModes",
    "choose_modes",
    "held_bytes",
    "mode_elements",
]

FULL, SELECTIVE, KEEP = "full", "selective", "keep"
MODES = (FULL, SELECTIVE, KEEP)
# what selective recomputation reruns, in units of the layer's forward: its element-wise ops (norms,
# rotary, the activation, casts), the GEMMs and attention kept (Korthikanti et al. 2022 measure a few
# percent of a step for GPT-3; small models on a CPU spend a larger share there): an estimate
SELECTIVE_RERUN = 0.1
_RERUN = {FULL: 1.0, SELECTIVE: SELECTIVE_RERUN, KEEP: 0.0}


@dataclass(frozen=True)
class LayerModes:
    """One layer's bytes held from its forward to its backward in each mode (per step, every
    sub-batch) and the time its backward reruns in each, in units of `forward` (seconds or any
    unit; 1.0 when only the ratio between layers matters)."""

    full: float
    selective: float
    keep: float
    forward: float = 1.0

    def bytes(self, mode: str) -> float:
        """Bytes held in `mode`."""
        return {FULL: self.full, SELECTIVE: self.selective, KEEP: self.keep}[mode]

    def rerun(self, mode: str) -> float:
        """Time the backward reruns in `mode`."""
        return _RERUN[mode] * self.forward


def mode_elements(
    hidden: int,
    kv_dim: int,
    mlp_width: int,
    heads: int,
    seq_len: int,
    degree: int,
    *,
    gated: bool,
    eager: bool = False,
) -> tuple[float, float]:
    """Elements per token one layer of a Llama- or GPT-style decoder holds at TP `degree` kept
    selectively and kept whole, (selective, keep); full recomputation holds its inputs instead
    (1 or 2 per token times hidden). `mlp_width`: the MLP's hidden width (an MoE: the widths a
    token runs, k f + f_shared); `eager`: attention's probabilities materialised (heads * seq_len
    per token) instead of a fused kernel's statistics (heads)::

        both:      6 h                   per sublayer: its input, its normed input, its output
                                         (the row-parallel GEMM's, whole on every rank)
        selective: (2 h + 2 kv + m f + a) / d      q, k, v and attention's outputs; the MLP's
                                                   column GEMMs' outputs (m = 2 gated, 1 not)
        keep:      (4 h + 2 kv + 2 m f + a) / d    and what autograd saves besides: rotary's
                                                   products, the activation's input and output
        a = heads * seq_len (eager) or heads

    Fit to what oases.schedule.budget's probe measures (HF Llama, GPT-NeoX, GPT-2; sdpa and
    eager): selective within 1-3% (TP 1 and 2); keep within 7% at TP 1 and 10% under at TP 2
    (Llama, GPT-NeoX); GPT-2's tanh GELU saves more (keep measured a third above this). The
    runtime's recompute="auto" measures instead; the planner, without the model, uses this."""
    h, d = hidden, degree
    a = heads * seq_len if eager else heads
    m = 2 if gated else 1
    selective = 6 * h + (2 * h + 2 * kv_dim + m * mlp_width + a) / d
    keep = 6 * h + (4 * h + 2 * kv_dim + 2 * m * mlp_width + a) / d
    return selective, keep


def held_bytes(layers: Sequence[LayerModes], modes: Sequence[str]) -> float:
    """Bytes the layers hold at once (the end of the forward) with one mode each."""
    return sum(layer.bytes(mode) for layer, mode in zip(layers, modes))


def choose_modes(layers: Sequence[LayerModes], budget: float) -> Optional[tuple[str, ...]]:
    """The modes, one per layer, that the greedy of the module docstring picks for `budget` bytes
    of held activations; None when every layer at full does not fit."""
    modes = [FULL] * len(layers)
    spare = budget - held_bytes(layers, modes)
    if spare < 0:
        return None
    while True:
        best: Optional[tuple[float, int, str, float]] = None  # (saving per byte, layer, mode, extra bytes)
        for i, (layer, mode) in enumerate(zip(layers, modes)):
            for target in MODES[MODES.index(mode) + 1 :]:
                extra = layer.bytes(target) - layer.bytes(mode)
                saving = layer.rerun(mode) - layer.rerun(target)
                if extra > spare or saving <= 0:
                    continue
                ratio = saving / extra if extra > 0 else float("inf")
                if best is None or (ratio, i) >= (best[0], best[1]):
                    best = (ratio, i, target, extra)
        if best is None:
            return tuple(modes)
        _, i, target, extra = best
        modes[i] = target
        spare -= extra
