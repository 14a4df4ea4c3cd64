"""Resident memory per rank through a training job's phases, from the planner's model of the layout.

    shape = shape_from_config(llama_config, seq_len=128)
    job = MemoryJob(rows=2, tp=2)                       # TP 2, AdamW, vocab-parallel embedding / head
    for p in phase_memory(shape, job):
        p.phase, p.resident_bytes, p.peak_bytes          # build, load_pretrained, train, ...

Per rank, P = this rank's parameters (eq. 6's P_l / d for every layer at degree tp; the embedding
and head split by the vocabulary when the plan says "vocab" / "vocab_head", else replicated):

    P = layers * (layer_parameters - R) / tp + layers * R       R: an MoE's router (h E per layer, replicated;
                                                                0 dense), every expert held, 1/tp of each
        + 2 V h / (tp if vocab_parallel else 1)
        + (embedding_parameters - 2 V h)                       replicated: positions, final norm
    W = P * param_bytes                                         weights
    G = P * param_bytes                                         gradients, from the backward to zero_grad
    S = moments * P * state_bytes / (dp if zero else 1)         optimizer states (AdamW: 2 moments)
        state_bytes = 4 under ZeRO (states of fp32 masters), param_bytes with a plain optimizer
    M = 4 * P / dp  if zero and param_bytes < 4, else 0         ZeRO's fp32 masters of its rows
    A = layers * kept_input_bytes(tp) + buffer_bytes(tp) + logits_bytes    (cost.py, eq. 6)

    R = 4 * P / dp  if zero, else 0                             ZeRO's gradient rows (the masters' .grad, fp32)
    T = the largest local tensor's bytes; B = max(bucket_bytes, T); T_step = T, or under ZeRO the
        fp32 rows of it this rank steps (4 T / (param_bytes dp))
    sync = (B + (in_flight - 1) bucket_bytes) * (1 + 1/dp if zero else 1)   if dp > 1, else 0
                                                                the gradient buckets in flight in the
                                                                backward (flat copies; ZeRO: padded
                                                                blocks and the received rows)
    step = max(temps * T_step, (1 + 1/dp) B if zero else 0)     the optimizer step: AdamW's per-tensor
                                                                temporaries (temps = 2: sqrt and its
                                                                quotient; torch's foreach step, the
                                                                default on CUDA, makes them per group),
                                                                ZeRO's parameter all-gather buffers

    phase            resident after     peak during
    build            0, or W            0, or W                 (meta build + parallelize(device=)); W
                                                                with init_weights=True; 0 on a host
                                                                with init_weights=False: the
                                                                shards' pages come on first write (in
                                                                load_pretrained); a device allocator
                                                                counts W here either way
    load_pretrained  W                  W + read                read: the file pages one handle maps for
                                                                the largest tensor (copied into W in place)
    train            W + S + M          W + S + M + G + R + max(A + sync, step)
                                                                A only while the step runs
    save_checkpoint  W + S + M          W + S + M               each shard written from its tensor
    load_checkpoint  W + S + M          W + S + M + chunk       chunk: the largest shard, twice (DCP reads
                                                                its bytes, then deserialises a tensor)
    save_pretrained  W + S + M          W + S + M + full        full: the largest unsharded tensor and one
                                                                received shard, on the writer (rank 0);
                                                                0 at tp 1 (the writer writes its own tensors)

A row-sharded tensor (column-parallel weights, vocab-parallel embedding and head: dim 0 split) is
a contiguous slice of the file; a column-sharded one (row-parallel weights: dim 1 split) touches
every page of the tensor. Pure: numbers in, bytes out; nothing here allocates or measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from oases import _checks
from oases.planner.cost import Workload, buffer_bytes, kept_input_bytes, logits_bytes, tp_degrees
from oases.planner.model import ModelShape

__all__ = ["PHASES", "OPTIMIZER_MOMENTS", "MemoryJob", "RankMemory", "PhaseMemory", "rank_memory", "phase_memory"]

PHASES = ("build", "load_pretrained", "train", "save_checkpoint", "load_checkpoint", "save_pretrained")
OPTIMIZER_MOMENTS: Mapping[str, int] = MappingProxyType({"adamw": 2, "adam": 2, "sgd": 1, "none": 0})
# temporaries of the size of one tensor that torch's per-tensor (CPU default) step makes at once
_STEP_TEMPORARIES: Mapping[str, int] = MappingProxyType({"adamw": 2, "adam": 2, "sgd": 0, "none": 0})


def _positive(name: str, value: object) -> None:
    if not _checks.is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True)
class MemoryJob:
    """One rank's place in a training job: `rows` sequences per step per data-parallel replica, on
    `tp` x `dp` ranks, `optimizer` (a key of OPTIMIZER_MOMENTS) wrapped in ZeRO-1 over dp when
    `zero`, the oases `schedule`, parameters of `param_bytes` each (4: fp32; 2: bf16 / fp16);
    gradients averaged over dp in buckets of `bucket_bytes`, `in_flight` at once during the backward
    (oases.dp.GradientSync's defaults); `init_weights`: parallelize(..., init_weights=) (False: the
    weights come from load_pretrained)."""

    rows: int
    tp: int = 1
    dp: int = 1
    optimizer: str = "adamw"
    zero: bool = False
    schedule: str = "oases"
    vocab_parallel: bool = True
    param_bytes: int = 4
    bucket_bytes: int = 25 * 2**20
    in_flight: int = 2
    init_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "tp", "dp", "bucket_bytes", "in_flight"):
            _positive(name, getattr(self, name))
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(f"optimizer: {self.optimizer!r} is not one of {sorted(OPTIMIZER_MOMENTS)}")
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes: expected 2 (bf16 / fp16) or 4 (fp32), got {self.param_bytes!r}")
        for name in ("zero", "vocab_parallel", "init_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RankMemory:
    """The parts of one rank's memory (bytes; `parameters` is a count). See the module docstring."""

    parameters: float
    weights: float
    gradients: float
    optimizer_states: float
    masters: float
    activations: float
    read_pretrained: float  # transient of load_pretrained: the largest tensor's mapped file pages
    read_chunk: float  # transient of load_checkpoint: the largest shard's bytes and its tensor
    write_full: float  # transient of save_pretrained on the writer: a gathered tensor + a received shard
    gradient_rows: float  # ZeRO's fp32 gradient rows (R), from their bucket's reduce-scatter to zero_grad
    sync_in_flight: float  # transient of the dp gradient sync in the backward (flat bucket copies)
    step_transient: float  # transient of the optimizer step (its temporaries; ZeRO's all-gather buffers)

    @property
    def states(self) -> float:
        """What stays resident once training started: W + S + M."""
        return self.weights + self.optimizer_states + self.masters


@dataclass(frozen=True)
class PhaseMemory:
    """Predicted bytes above the process's own (imports, process group) after and during a phase."""

    phase: str
    resident_bytes: float
    peak_bytes: float


def _tensors(shape: ModelShape, vocab_parallel: bool) -> list[tuple[int, str]]:
    """(elements, split) of each sharded kind of tensor of one layer and the embedding / head:
    split "rows" (dim 0, contiguous in the file), "columns" (dim 1) or "none" (replicated)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    vocab = "rows" if vocab_parallel else "none"
    tensors = [
        (h * h, "rows"),
        (kv * h, "rows"),
        (h * h, "columns"),  # q (k, v), o
        (shape.ffn_hidden * h, "rows"),
        (h * shape.ffn_hidden, "columns"),  # gate / up (fc), down (proj)
        (shape.vocab_size * h, vocab),
    ]  # embedding, head
    if shape.experts:  # each expert's tensors are the MLP's above (one file tensor per expert)
        tensors.append((shape.experts * h, "none"))  # router
    if shape.shared_ffn_hidden:
        f = shape.shared_ffn_hidden
        tensors += [(f * h, "rows"), (h * f, "columns")]  # the shared MLP
    return tensors


def rank_memory(shape: ModelShape, job: MemoryJob) -> RankMemory:
    """The parts of one rank's memory for `job` on a model of `shape` (see the module docstring)."""
    if job.tp not in tp_degrees(shape, job.tp):
        raise ValueError(
            f"tp: {job.tp} does not divide the heads ({shape.heads}), KV heads ({shape.kv_heads}) "
            f"and MLP widths ({shape.ffn_hidden}, shared {shape.shared_ffn_hidden}) of the model"
        )
    tp, dp, pb = job.tp, job.dp, job.param_bytes
    vocab = 2 * shape.vocab_size * shape.hidden
    router = shape.router_parameters()
    parameters = (
        shape.layers * (shape.layer_parameters() - router) / tp
        + shape.layers * router
        + vocab / (tp if job.vocab_parallel else 1)
        + shape.embedding_parameters()
        - vocab
    )
    state_bytes = 4 if job.zero else pb
    states = OPTIMIZER_MOMENTS[job.optimizer] * parameters * state_bytes / (dp if job.zero else 1)
    masters = 4 * parameters / dp if job.zero and pb < 4 else 0.0
    work = Workload(shape, job.rows, tp, schedule=job.schedule)
    activations = (
        shape.layers * kept_input_bytes(work, tp, pb)
        + buffer_bytes(work, tp, pb)
        + logits_bytes(work, job.vocab_parallel)
    )
    split = tp > 1
    tensors = _tensors(shape, job.vocab_parallel)
    local = [n / tp if split and how != "none" else n for n, how in tensors]
    touched = [n if how != "rows" or not split else n / tp for n, how in tensors]
    read = max(touched) * pb
    chunk = 2 * max(local) * pb  # a plain optimizer's states are shaped and typed as their parameters
    full = max((n + n / tp) * pb for n, how in tensors if how != "none") if split else 0.0
    rows = 4 * parameters / dp if job.zero else 0.0
    largest = max(local) * pb
    bucket = max(job.bucket_bytes, largest)
    relayed = 1 + 1 / dp if job.zero else 1.0
    sync = (bucket + (job.in_flight - 1) * job.bucket_bytes) * relayed if dp > 1 else 0.0
    stepped = max(local) * 4 / dp if job.zero else largest
    step = max(_STEP_TEMPORARIES[job.optimizer] * stepped, (1 + 1 / dp) * bucket if job.zero else 0.0)
    return RankMemory(
        parameters, parameters * pb, parameters * pb, states, masters, activations, read, chunk, full, rows, sync, step
    )


def phase_memory(shape: ModelShape, job: MemoryJob) -> tuple[PhaseMemory, ...]:
    """Per phase (PHASES, in order): predicted resident bytes after it and peak bytes during it."""
    m = rank_memory(shape, job)
    w, kept = m.weights, m.states
    built = w if job.init_weights else 0.0
    training = kept + m.gradients + m.gradient_rows + max(m.activations + m.sync_in_flight, m.step_transient)
    return (
        PhaseMemory("build", built, built),
        PhaseMemory("load_pretrained", w, w + m.read_pretrained),
        PhaseMemory("train", kept, training),
        PhaseMemory("save_checkpoint", kept, kept),
        PhaseMemory("load_checkpoint", kept, kept + m.read_chunk),
        PhaseMemory("save_pretrained", kept, kept + m.write_full),
    )
