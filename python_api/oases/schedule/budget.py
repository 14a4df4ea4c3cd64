"""`recompute="auto"`: each layer's recomputation chosen for a memory budget, measured once per shape.

::

    probe (one row of the batch, this rank's shards, no communication, nothing kept):
        per layer, its sublayers recorded as a kept graph and as a selective one; held bytes =
        the distinct storages autograd saves (keep) or the outputs of the GEMMs and attention
        (selective), with the sublayers' inputs, normed inputs and outputs the step keeps;
        full = the inputs the schedule saves (both sublayers' with "oases", the layer's otherwise)
        head = its logits' bytes
    per step, scaled from the row to the batch (every sub-batch's forward is held at once):
        layer bytes[mode] = row bytes[mode] * batch
        base      = parameters + gradients (trainable) + optimizer states (2 fp32 moments per
                    trainable element: AdamW's; / dp under ZeRO)
        transient = per sub-batch: the largest layer's keep bytes (a recomputed layer's graph;
                    the choice is made with it, the prediction drops it when no layer recomputes)
                    + 3 * its logits (the logits, their fp32 copy in the loss, their gradient)
                    + 4 residual-stream gradients (a sublayer's backward: its output's, input's, ...)
        budget for the layers = memory_budget - base - transient
    the TP group agrees (all-reduce: the largest bytes, the smallest budget), then
    modes = every layer kept if that fits (no layer's graph rerun: its share of transient dropped),
            else oases.costs.recompute.choose_modes(layers, that budget)

`memory_budget` (bytes, the whole rank's peak) None: the device's rule, `default_budget`. An
explicit budget that not even full recomputation fits raises a ValueError naming the smallest
that does; the default falls back to full recomputation with one warning. With sequence
parallelism, offload or per-layer TP degrees every layer runs full recomputation (the only mode
they take). The result is a `RecomputeChoice`, cached by the caller per input shape.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oases.costs.recompute import FULL, KEEP, SELECTIVE, LayerModes, choose_modes, held_bytes
from oases.schedule.programs import _record
from oases.schedule.protocol import Stack, SubBatch
from oases.schedule.runtime import Communicator
from oases.schedule.selective import SAVED_OP_NAMES, SAVED_OPS

__all__ = ["AUTO", "MARGIN", "RecomputeChoice", "default_budget", "choose_recompute"]

AUTO = "auto"
MARGIN = 0.10  # the share of the device's memory the default budget leaves (allocator cache, fragments)
MOMENT_BYTES = 8  # optimizer states per trainable element: AdamW's two fp32 moments
GRADIENT_STREAMS = 4  # residual-stream-sized gradients a sublayer's backward holds (its output's, input's, ...)


@dataclass(frozen=True)
class RecomputeChoice:
    """What `recompute="auto"` chose for one input shape: `modes` (one per layer: "full",
    "selective" or "keep"), the `budget` it had (bytes, the whole rank), the `predicted` peak
    with those modes, and its parts (`base`: parameters, gradients and optimizer states;
    `transient`; `layers`: each layer's held bytes per mode; `smallest`: the least budget that fits,
    every layer recomputed)."""

    modes: tuple[str, ...]
    budget: float
    predicted: float
    base: float
    transient: float
    layers: tuple[LayerModes, ...]
    smallest: float = 0.0  # the smallest budget that fits: every layer recomputed
    reason: str = ""  # why every layer recomputes when no budget decided it (sequence parallel, ...)

    @property
    def recompute(self) -> list:
        """The modes as train_step's per-layer `recompute` values (True, "selective", False)."""
        return [{FULL: True, SELECTIVE: "selective", KEEP: False}[m] for m in self.modes]

    def describe(self) -> str:
        """One line: which layers keep, which are selective, which recompute, the predicted peak."""
        groups = {mode: [str(i) for i, m in enumerate(self.modes) if m == mode] for mode in (KEEP, SELECTIVE, FULL)}
        parts = [f"{mode}: layers {','.join(ids)}" for mode, ids in groups.items() if ids]
        return (
            f"recompute='auto': {'; '.join(parts)}; predicted peak {self.predicted / 2**20:.1f} MiB of a "
            f"{self.budget / 2**20:.1f} MiB budget{f' ({self.reason})' if self.reason else ''}"
        )


def _meminfo_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo, bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_budget(device: torch.device, held: float) -> Optional[float]:
    """The rank's budget when none is given: (what is free on its device + `held`, the bytes its
    parameters hold already) * (1 - MARGIN), shared among the ranks on that device:

        CUDA: torch.cuda.mem_get_info's free, the ranks of the node over its visible devices
              (OASES_SHARE_GPU=N, set by oases-launch --share-gpu: N ranks on this one GPU)
        CPU:  /proc/meminfo's MemAvailable, the node's ranks (LOCAL_WORLD_SIZE)
    None where the device says nothing (no /proc/meminfo)."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        shared = os.environ.get("OASES_SHARE_GPU", "").strip()
        if shared and not shared.isdigit():
            raise ValueError(f"OASES_SHARE_GPU: expected the number of ranks sharing this GPU, got {shared!r}")
        sharing = max(1, int(shared) if shared else local // max(1, torch.cuda.device_count()))
        return (free / sharing + held) * (1 - MARGIN)
    available = _meminfo_available()
    if available is None:
        return None
    return (available / local + held) * (1 - MARGIN)


class _Outputs(TorchDispatchMode):
    """Notes the outputs of the ops a selective graph saves (oases.schedule.selective)."""

    def __init__(self, note) -> None:
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS or func.name() in SAVED_OP_NAMES:
            for t in tree_flatten(out)[0]:
                self.note(t)
        return out


def _layer_row_bytes(layer, x: torch.Tensor, ctx: Any, selective: bool, skip: set) -> tuple[int, torch.Tensor]:
    """(bytes the layer's kept graphs hold, the next layer's input) on the probe's rows."""
    held: dict[int, int] = {}

    def note(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                held[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Outputs(note) if selective else nullcontext():
        for sub in layer:
            rec = _record(sub, x, ctx, selective)
            for t in (rec.x, rec.h, rec.part):
                note(t)
            with torch.no_grad():
                x = x + sub.finish(rec.part.detach(), ctx)  # unreduced: the next shapes, not its values
    return sum(held.values()), x.detach()


def _probe(stack: Stack, input_ids, where: SubBatch, fine: bool) -> tuple[list[LayerModes], float, float]:
    """Per layer, the bytes its modes hold on `where`'s rows; the head's logits' bytes there; the
    residual stream's (one layer's input)."""
    skip = set()
    for holder in (stack, getattr(stack, "model", None)):
        if isinstance(holder, torch.nn.Module):
            skip |= {t.untyped_storage().data_ptr() for t in list(holder.parameters()) + list(holder.buffers())}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        split = getattr(stack, "embed_split", None)
        parts = split(input_ids, where) if split is not None else None
        if parts is not None:
            x, ctx = parts.then(parts.partial.detach())
        else:
            x, ctx = stack.embed(input_ids, where)
        x = x.detach()
        stream = float(x.numel() * x.element_size())
        layers = []
        for layer in stack.layers():
            layer = tuple(layer)
            inputs = x.numel() * x.element_size() * (len(layer) if fine else 1)  # full: the inputs saved
            keep, _ = _layer_row_bytes(layer, x, ctx, False, skip)
            selective, x = _layer_row_bytes(layer, x, ctx, True, skip)
            layers.append(LayerModes(full=inputs, selective=max(selective, inputs), keep=max(keep, inputs)))
        with torch.no_grad():
            head_split = getattr(stack, "head_split", None)
            hparts = head_split(x, ctx) if head_split is not None else None
            logits = hparts.logits_of(hparts.h) if hparts is not None else stack.head(x, ctx)
    return layers, float(logits.numel() * 4), stream  # logits: fp32 in the loss


def _model_bytes(stack: Stack, zero_dp: int) -> tuple[float, float]:
    """(bytes of the parameters and buffers the rank holds, of their gradients and optimizer states)."""
    module = stack if isinstance(stack, torch.nn.Module) else getattr(stack, "model", None)
    if not isinstance(module, torch.nn.Module):
        return 0.0, 0.0
    seen, held, trained = set(), 0.0, 0.0
    for t in list(module.parameters()) + list(module.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        held += t.numel() * t.element_size()
        if t.requires_grad:
            trained += t.numel() * (t.element_size() + MOMENT_BYTES / zero_dp)
    return held, trained


def choose_recompute(
    stack: Stack,
    input_ids: torch.Tensor,
    where: SubBatch,
    *,
    parts: int,
    fine: bool,
    comm: Communicator,
    memory_budget: Optional[float],
    zero_dp: int = 1,
    only_full: str = "",
) -> RecomputeChoice:
    """The modes for a step of `input_ids` (see the module docstring). `where`: the step's first
    row (the probe's); `parts`: its sub-batches; `fine`: the schedule recomputes per sublayer;
    `only_full`: why only full recomputation may run (sequence parallel, ...), or "". A collective
    over `comm`'s group (one all-reduce)."""
    batch = input_ids.shape[0]
    rows = where.rows
    layers_row, head_row, stream_row = _probe(stack, input_ids[rows], where, fine)
    probe_rows = rows.stop - rows.start
    scale = batch / probe_rows
    layers = [LayerModes(m.full * scale, m.selective * scale, m.keep * scale) for m in layers_row]
    held, trained = _model_bytes(stack, zero_dp)
    base = held + trained
    per_sub_batch = -(-batch // parts) / probe_rows
    largest = max((m.keep for m in layers_row), default=0.0)
    transient = (largest + 3 * head_row + GRADIENT_STREAMS * stream_row) * per_sub_batch
    rerun = largest * per_sub_batch  # the part of it a recomputed layer's graph is: none when all are kept
    explicit = memory_budget is not None
    budget = float(memory_budget) if explicit else default_budget(input_ids.device, held)
    # the TP group agrees: the largest bytes, the smallest budget (every rank then picks the same)
    numbers = [base, transient, rerun] + [b for m in layers for b in (m.full, m.selective, m.keep)]
    agreed = torch.tensor(
        numbers + [-(budget if budget is not None else float("inf"))], dtype=torch.float64, device=input_ids.device
    )  # on the device: NCCL reduces device tensors only
    if comm.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=comm.group)
    values = agreed.tolist()
    base, transient, rerun, budget = values[0], values[1], values[2], -values[-1]
    layers = [LayerModes(*values[3 + 3 * i : 6 + 3 * i]) for i in range(len(layers))]
    least = base + transient + held_bytes(layers, [FULL] * len(layers))
    full = tuple([FULL] * len(layers))
    if only_full:
        return RecomputeChoice(full, budget, least, base, transient, tuple(layers), least, only_full)
    if budget == float("inf"):
        return RecomputeChoice(
            full, budget, least, base, transient, tuple(layers), least, "no budget: the device says nothing"
        )
    kept = tuple([KEEP] * len(layers))
    if base + transient - rerun + held_bytes(layers, kept) <= budget:  # every layer kept: nothing rerun
        modes: Optional[tuple[str, ...]] = kept
    else:
        modes = choose_modes(layers, budget - base - transient)
    if modes is None:
        if explicit:
            raise ValueError(
                f"memory_budget: {budget / 2**20:.1f} MiB is less than this step needs with every layer "
                f"recomputed ({least / 2**20:.1f} MiB: parameters, gradients and optimizer states "
                f"{base / 2**20:.1f}, the layers' saved inputs {(least - base - transient) / 2**20:.1f}, "
                f"one layer's recomputation and the logits {transient / 2**20:.1f}); give at least "
                f"{int(least)} bytes, fewer rows per step, or recompute=True"
            )
        warnings.warn(
            f"recompute='auto': the device's memory ({budget / 2**20:.1f} MiB for this rank) is less than "
            f"this step is predicted to need with every layer recomputed ({least / 2**20:.1f} MiB); "
            f"running full recomputation",
            UserWarning,
            stacklevel=4,
        )
        return RecomputeChoice(full, budget, least, base, transient, tuple(layers), least, "over the default budget")
    if FULL not in modes:  # chosen with a recomputed layer's graph counted; none is recomputed
        transient -= rerun
    predicted = base + transient + held_bytes(layers, modes)
    return RecomputeChoice(modes, budget, predicted, base, transient, tuple(layers), least)
