"""The overlap-aware cost model of a TP stack (Oases §V, eqs. 2-6), per layer and TP degree.

A layer at TP degree d inside a TP group of T ranks runs as T/d replicas ("data parallel inside
the group"), each on rows * d / T of the group's rows, cut into n sub-batches of r = rows * d / (T n).
Per sublayer k (attention, MLP) and sub-batch, from the profile:

    c_f, c_b = forward / backward seconds of one rank's shard on r rows      (compute)
    a        = all_reduce(d ranks, r * seq_len * hidden * element_bytes)    (communication)

Node cost (eq. 3), one pass of a sublayer: n units of (compute c, communication a). A schedule
that interleaves sub-batches hides each unit's all-reduce behind the next unit's compute, so a
pass costs the sum over its op pairs of max(compute, comm); megatron (n = 1) serialises them:

    overlapped (n >= 2):  n * max(c, a)        serial (n = 1):  c + a
                          (a device that hides only a share eta of the shorter one, measured in the
                          profile: n * (max(c, a) + (1 - eta) min(c, a)); eta = 1 analytically)
    passes per sublayer:  forward (c_f, a); backward (c_b [+ c_r recomputed], a);
                          recompute (c_r, a) only without fine-grained recomputation
                          (c_r: the forward recording autograd's graph, as recomputation runs it;
                          fine-grained, without the output projection's GEMM, whose value it
                          never reads)
    a pass boundary drains the pipeline of sub-batches: the link idles while the first unit
    computes (comm-bound) or the last all-reduce waits alone (compute-bound): + min(c_f, a)
    merak holds every sub-batch at 2 barriers per layer in backward: + 2 min(c_f, a)
    d < T: the layer's gradients all-reduced over the T/d replicas: + all_reduce(T/d, P/d * e)
    first / last layer (n >= 2): a pass starts / ends there: + min(c_f, a) each

Sequence parallel (`sequence_parallel=True`, every layer at degree T; Centauri's primitive
substitution as this runtime runs it): each all-reduce of the tensor becomes a reduce-scatter
(rs) + an all-gather (ag) of it, and recomputation re-gathers the normed input:

    forward a = rs + ag;  backward a = rs + 2 ag (fine-grained) or rs + ag;  recompute a = rs + ag
    first layer: + 2 ag exposed (the first norm's gather; the embedding gradient's gather)
    saved inputs / T (the residual stream is split along the sequence)

Edge cost (eq. 4), between consecutive layers at degrees d1 != d2 (hi, lo = max, min): the
activation [rows * hi / T, s, h] is all-gathered over hi / lo ranks once per step (forward when
the degree rises, the gradient in backward when it falls), per sub-batch:

    edge(d1, d2) = n * all_gather(hi / lo, rows * hi / T / n * s * h * e)

Memory (eq. 6), per rank: model states of the layer's shard plus the inputs kept for
recomputation; buffers (one layer's activations while it is recomputed) and the replicated
embedding / head are fixed:

    memory(l, d) = ((P_l - R) / d + R) * state_bytes + keep * rows * d / T * s * h * e  [/ T sequence parallel]
                   (keep = 2 sublayer inputs with fine-grained recomputation, else 1;
                    R = ModelShape.router_parameters(), replicated: 0 for a dense model)
    fixed = P_embed * state_bytes + max_d buffer(d) + logits (fp32, one sub-batch)
Step time (eq. 5) = sum of node costs + sum of edge costs.

Mixture of experts (ModelShape.experts E > 0, k per token; expert TP): at degree d every rank runs
1/d of every expert on all of its tokens and sums its partial outputs of a token's k experts,
weighted by the (replicated) router, before the MLP's row-parallel reduction. Hence:

    communication   the dense MLP's: one all-reduce of [r, s, h] per pass (RS + AG sequence parallel)
                    + all_reduce(d, R * e) once per step, exposed: the router's weight gradient is a
                      partial sum on each rank (its input gradient rides in the MLP's own all-reduce)
    compute         the profile's time of ModelShape.flops: router + k experts + shared MLP per token
    kept inputs     as dense: recomputation keeps the sublayer's input [r, s, h]; the rerun router
                    rebuilds the k routed copies of each token
    buffer          per token, + 2 k h + E (the k routed copies of the input and the k expert outputs
                    before the combine, whole on every rank; the router's probabilities); the MLP's
                    2 f / d becomes 2 (k f + f_shared) / d
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from oases import _checks
from oases.costs.chunks import OP_MAX_CHUNKS, chunk_count
from oases.costs.collectives import CollectiveChoice
from oases.costs.recompute import mode_elements
from oases.costs.schedules import SCHEDULES  # the runtime's own table: one source of truth
from oases.planner.model import SUBLAYERS, ModelShape
from oases.planner.profile import Profile

__all__ = [
    "Workload",
    "LayerCost",
    "StepCost",
    "layer_cost",
    "edge_cost",
    "fixed_memory",
    "step_cost",
    "tp_degrees",
    "sequence_parallel_ok",
    "sequence_parallel_form",
    "kept_input_bytes",
    "mode_bytes",
    "buffer_bytes",
    "logits_bytes",
]

DEFAULT_STATE_BYTES = 16.0  # per parameter: weights + gradients + Adam's two moments (fp32, or bf16 + fp32 master)


def _traits(schedule: str) -> tuple[int, bool, bool]:
    """(default sub-batches, fine-grained recomputation, pass barriers) of an oases schedule."""
    _checks.one_of("schedule", schedule, SCHEDULES)
    s = SCHEDULES[schedule]
    return s.sub_batches, s.fine_grained_recompute, s.pass_barriers


def tp_degrees(shape: ModelShape, tp: int) -> tuple[int, ...]:
    """TP degrees a layer may take in a group of `tp`: powers of two up to tp that divide tp, the
    heads (and KV heads) and the MLP widths (an MoE: each expert's and the shared MLP's)."""
    out, d = [], 1
    while d <= tp:
        if (
            tp % d == 0
            and shape.heads % d == 0
            and shape.kv_heads % d == 0
            and shape.ffn_hidden % d == 0
            and shape.shared_ffn_hidden % d == 0
        ):
            out.append(d)
        d *= 2
    return tuple(out)


@dataclass(frozen=True)
class Workload:
    """One TP group's step: `rows` sequences of `shape` on `tp` ranks, on `schedule` with
    `sub_batches` (None: the schedule's own)."""

    shape: ModelShape
    rows: int
    tp: int
    schedule: str = "oases"
    sub_batches: Optional[int] = None
    state_bytes: float = DEFAULT_STATE_BYTES
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "tp"):
            value = getattr(self, name)
            if not _checks.is_int(value) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        default, _, _ = _traits(self.schedule)
        n = default if self.sub_batches is None else self.sub_batches
        if not _checks.is_int(n) or not 1 <= n <= 8:
            raise ValueError(f"sub_batches: expected an int in 1..8 or None, got {self.sub_batches!r}")
        object.__setattr__(self, "sub_batches", n)
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel: expected a bool, got {self.sequence_parallel!r}")

    @property
    def n(self) -> int:
        """Sub-batches per step (`sub_batches`, the schedule's own when None was given)."""
        return int(self.sub_batches)  # type: ignore[arg-type]

    def rows_at(self, degree: int) -> float:
        """Rows one replica of a degree-`degree` layer processes per step."""
        return self.rows * degree / self.tp


@dataclass(frozen=True)
class LayerCost:
    """One layer at one degree: seconds (total, compute, communication, exposed communication), bytes."""

    degree: int
    time_s: float
    compute_s: float
    comm_s: float
    states_bytes: float  # the layer's shard of weights, gradients and optimizer states
    saved_bytes: float  # inputs kept for recomputation, per step (micro-batch)
    chunks: int = 1  # pieces per fused GEMM + collective (Centauri's Algorithm 1; 1 at degree 1)

    @property
    def memory_bytes(self) -> float:
        """Bytes per rank: the layer's states and its saved inputs."""
        return self.states_bytes + self.saved_bytes

    @property
    def exposed_comm_s(self) -> float:
        """Communication not hidden under compute: max(0, time_s - compute_s)."""
        return max(0.0, self.time_s - self.compute_s)

    @property
    def dominated_by(self) -> str:
        """ "comm" when communication takes longer than compute, else "compute"."""
        return "comm" if self.comm_s > self.compute_s else "compute"


def _unit(work: Workload, profile: Profile, sublayer: str, degree: int) -> tuple[float, float, float, float]:
    """(c_f, c_b, c_r, a) of one sub-batch of one sublayer at `degree` (see the module docstring)."""
    shape = work.shape
    tokens = work.rows_at(degree) / work.n * shape.seq_len
    c_f = profile.compute_time(sublayer, shape, tokens, degree, "forward")
    c_b = profile.compute_time(sublayer, shape, tokens, degree, "backward")
    _, fine, _ = _traits(work.schedule)  # fine-grained recomputation skips the output projection's GEMM
    c_r = profile.compute_time(sublayer, shape, tokens, degree, "recompute_unread" if fine else "recompute")
    a = profile.collective_time("all_reduce", degree, tokens * shape.hidden * profile.element_bytes)
    return c_f, c_b, c_r, a


def _sp_collectives(work: Workload, profile: Profile, degree: int) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds of one sub-batch's activation [r, s, h] at `degree`."""
    nbytes = work.rows_at(degree) / work.n * work.shape.seq_len * work.shape.hidden * profile.element_bytes
    return (
        profile.collective_time("reduce_scatter", degree, nbytes),
        profile.collective_time("all_gather", degree, nbytes),
    )


def sequence_parallel_ok(work: Workload, degree: int) -> bool:
    """Whether sequence parallelism can run a layer at `degree`: the runtime splits the sequence
    over the whole TP group (every layer at degree tp > 1, seq_len divisible by it)."""
    return degree == work.tp > 1 and work.shape.seq_len % degree == 0


def layer_cost(
    work: Workload, profile: Profile, degree: int, *, first: bool = False, last: bool = False, recompute: bool = True
) -> LayerCost:
    """Node cost (eq. 3) and memory (eq. 6) of one layer at TP degree `degree`; the LM head's
    forward + backward is counted in the `last` layer (it runs on that layer's rows).
    `recompute=False`: the layer's graphs kept from the forward (train_step's recompute=False for
    it): no recomputed forward in its backward, no recomputation pass (its time; the memory of
    its kept activations is `mode_bytes`'s)."""
    if degree not in tp_degrees(work.shape, work.tp):
        raise ValueError(
            f"degree: {degree} is not one of {tp_degrees(work.shape, work.tp)} (powers of two "
            f"dividing the TP group {work.tp}, the heads and the MLP widths)"
        )
    _, fine, barriers = _traits(work.schedule)
    n, shape, e = work.n, work.shape, profile.element_bytes
    time = compute = comm = 0.0

    def passes(c: float, a: float, count: int = 1) -> None:
        nonlocal time, compute, comm
        time += count * (n * profile.overlapped(c, a) if n >= 2 else c + a)
        compute += count * n * c
        comm += count * n * a

    sp = work.sequence_parallel
    if sp and not sequence_parallel_ok(work, degree):
        raise ValueError(
            f"sequence_parallel: needs every layer at the TP group's degree {work.tp} > 1 and seq_len "
            f"{shape.seq_len} divisible by it; got degree {degree}"
        )
    rs, ag = _sp_collectives(work, profile, degree) if sp else (0.0, 0.0)
    stall = 0.0  # what a pass boundary leaves exposed: min(one unit's compute, its all-reduce)
    widest = (0.0, 0.0)  # (compute, collective) of the forward unit with the longest collective
    for sublayer in SUBLAYERS:
        c_f, c_b, c_r, a = _unit(work, profile, sublayer, degree)
        # sequence parallel: each all-reduce is a reduce-scatter + all-gather; recomputation re-gathers
        a_fwd, a_bwd = (rs + ag, rs + (2 if fine else 1) * ag) if sp else (a, a)
        stall = max(stall, min(c_f, a_fwd))
        widest = max(widest, (c_f, a_fwd), key=lambda pair: pair[1])
        passes(c_f, a_fwd)  # forward
        passes(c_b + (c_r if fine and recompute else 0.0), a_bwd)  # backward (fine-grained: recompute inside)
        if not fine and recompute:
            passes(c_r, a_fwd)  # recomputation of the layer, with its all-reduces
    if barriers and n >= 2:
        time += 2 * stall
    if n >= 2:
        time += stall * (int(first) + int(last))
    if sp and first:  # the first norm's gather and the embedding gradient's gather: nothing to hide behind
        time += 2 * ag
        comm += 2 * n * ag
    replicas = work.tp // degree
    if replicas > 1:  # data parallel inside the group: sum the replicas' gradients
        grad = profile.collective_time("all_reduce", replicas, shape.rank_layer_parameters(degree) * e)
        time += grad
        comm += grad
    if shape.experts and degree > 1:  # the replicated router's weight gradient: a partial sum on each rank
        router = profile.collective_time("all_reduce", degree, shape.router_parameters() * e)
        time += router
        comm += router
    if last:
        head = profile.head_time(shape, work.rows_at(degree) * shape.seq_len)
        time += head
        compute += head
    states = shape.rank_layer_parameters(degree) * work.state_bytes
    # the fused ops' chunk count: Algorithm 1 on that unit, with the profile's chunked-GEMM efficiency
    # (the step's time above does not model chunking: the sub-batches' overlap is what it counts)
    # (counts the ops accept: at most OP_MAX_CHUNKS, dividing a sub-batch's rows on this rank)
    tokens = round(work.rows_at(degree) / n * shape.seq_len / (degree if sp else 1))
    allowed = [c for c in range(1, OP_MAX_CHUNKS + 1) if tokens % c == 0]
    chunks = (
        1
        if degree == 1
        else chunk_count(
            widest[0],
            widest[1],
            profile.latency_s,
            max_chunks=OP_MAX_CHUNKS,
            allowed=allowed,
            efficiency=profile.chunk_efficiency,
        )
    )
    return LayerCost(degree, time, compute, comm, states, kept_input_bytes(work, degree, e), chunks)


def mode_bytes(work: Workload, degree: int, element_bytes: float) -> tuple[float, float, float]:
    """Bytes one layer at `degree` holds from its forward to its backward per step (every
    sub-batch) in each recomputation mode, (full, selective, keep): full recomputation its saved
    inputs (kept_input_bytes), the kept modes what oases.costs.recompute.mode_elements counts per
    token (sdpa attention; an MoE: the widths a token runs), never less than full's."""
    s = work.shape
    width = s.experts_per_token * s.ffn_hidden + s.shared_ffn_hidden if s.experts else s.ffn_hidden
    selective, keep = mode_elements(
        s.hidden, s.kv_heads * s.head_dim, width, s.heads, s.seq_len, degree, gated=s.gated_mlp
    )
    tokens = work.rows_at(degree) * s.seq_len
    full = kept_input_bytes(work, degree, element_bytes)
    return full, max(full, tokens * selective * element_bytes), max(full, tokens * keep * element_bytes)


def kept_input_bytes(work: Workload, degree: int, element_bytes: float) -> float:
    """Bytes of one layer's inputs a rank keeps from its forward to its backward (eq. 6's second
    term): keep * rows_at(degree) * seq_len * hidden * element_bytes [/ degree sequence parallel],
    keep = 2 sublayer inputs with fine-grained recomputation (oases), else 1 (the layer's input);
    an MoE layer keeps the same (its routed copies are rebuilt by the recomputed router)."""
    _, fine, _ = _traits(work.schedule)
    keep = 2 if fine else 1
    s = work.shape
    return (
        keep * work.rows_at(degree) * s.seq_len * s.hidden * element_bytes / (degree if work.sequence_parallel else 1)
    )


def edge_cost(work: Workload, profile: Profile, a: int, b: int) -> float:
    """Resharding seconds between consecutive layers at degrees a and b (eq. 4; 0 when equal)."""
    if a == b:
        return 0.0
    hi, lo = max(a, b), min(a, b)
    per_sub_batch = work.rows_at(hi) / work.n * work.shape.seq_len * work.shape.hidden * profile.element_bytes
    return work.n * profile.collective_time("all_gather", hi // lo, per_sub_batch)


def buffer_bytes(work: Workload, degree: int, element_bytes: float) -> float:
    """Activations of one layer of one sub-batch while autograd holds them (recomputation):

    rows_at(degree) / n * s * per_token * element_bytes
    per_token = 2 h + (4 h + 2 f + 2 heads s) / degree                             dense
              = 2 h + 2 k h + E + (4 h + 2 (k f + f_shared) + 2 heads s) / degree   MoE (module docstring)"""
    s = work.shape
    mlp, routed = 2 * s.ffn_hidden, 0
    if s.experts:
        mlp = 2 * (s.experts_per_token * s.ffn_hidden + s.shared_ffn_hidden)
        routed = 2 * s.experts_per_token * s.hidden + s.experts
    per_token = 2 * s.hidden + routed + (4 * s.hidden + mlp + 2 * s.heads * s.seq_len) / degree
    return work.rows_at(degree) / work.n * s.seq_len * per_token * element_bytes


def logits_bytes(work: Workload, vocab_parallel: bool = False) -> float:
    """One sub-batch's fp32 logits and their gradient: 2 * rows / n * seq_len * vocab * 4
    [/ tp with a vocab-parallel head, each rank holding its slice of the vocabulary]."""
    s = work.shape
    return 2 * work.rows / work.n * s.seq_len * s.vocab_size * 4 / (work.tp if vocab_parallel else 1)


def fixed_memory(work: Workload, profile: Profile) -> float:
    """Bytes every plan pays alike: the replicated embedding and head states, one layer's
    buffers at the worst degree, one sub-batch's fp32 logits and their gradient."""
    s = work.shape
    buffers = max(buffer_bytes(work, d, profile.element_bytes) for d in tp_degrees(s, work.tp))
    return s.embedding_parameters() * work.state_bytes + buffers + logits_bytes(work)


@dataclass(frozen=True)
class StepCost:
    """A per-layer plan's predicted step: seconds, bytes per rank, and the parts."""

    degrees: tuple[int, ...]
    time_s: float
    memory_bytes: float
    layers: tuple[LayerCost, ...]
    edges_s: tuple[float, ...] = field(default=())

    @property
    def compute_s(self) -> float:
        """Compute seconds of every layer, summed."""
        return sum(c.compute_s for c in self.layers)

    @property
    def comm_s(self) -> float:
        """Communication seconds of every layer and of the resharding between layers (edges_s), summed."""
        return sum(c.comm_s for c in self.layers) + sum(self.edges_s)

    @property
    def exposed_comm_s(self) -> float:
        """Communication not hidden under compute: max(0, time_s - compute_s)."""
        return max(0.0, self.time_s - self.compute_s)

    @property
    def dominated_by(self) -> str:
        """What the step waits on most: compute, or communication left exposed."""
        return "exposed comm" if self.exposed_comm_s > self.compute_s else "compute"


def step_cost(work: Workload, profile: Profile, degrees: Sequence[int]) -> StepCost:
    """Eq. 5 for a given per-layer degree list: sum of node costs + edge costs, and memory."""
    degrees = tuple(degrees)
    if len(degrees) != work.shape.layers:
        raise ValueError(f"degrees: expected {work.shape.layers} (one per layer), got {len(degrees)}")
    layers = tuple(
        layer_cost(work, profile, d, first=i == 0, last=i == len(degrees) - 1) for i, d in enumerate(degrees)
    )
    edges = tuple(edge_cost(work, profile, a, b) for a, b in zip(degrees, degrees[1:]))
    time = sum(c.time_s for c in layers) + sum(edges)
    memory = sum(c.memory_bytes for c in layers) + fixed_memory(work, profile)
    return StepCost(degrees, time, memory, layers, edges)


def sequence_parallel_form(work: Workload, profile: Profile) -> CollectiveChoice:
    """Centauri's primitive substitution for a uniform stack at degree work.tp: keep each
    sublayer's all-reduce ("all_reduce"), or run it as reduce-scatter + all-gather with the residual
    stream split along the sequence ("rs_ag": sequence parallelism, as train_step(...,
    sequence_parallel=True)). The same comparison as collectives.all_reduce_form, on whole steps:

        seconds[form] = exposed communication of step_cost(work with that form, [tp] * layers)
        choice = "rs_ag" if seconds["rs_ag"] < seconds["all_reduce"] else "all_reduce"
    (compute is the same in both forms, so the smaller exposed communication is the faster step).
    "all_reduce" when sequence parallelism cannot run (tp = 1, seq_len not divisible by tp)."""
    degrees = [work.tp] * work.shape.layers
    plain = step_cost(replace(work, sequence_parallel=False), profile, degrees)
    seconds = {"all_reduce": plain.time_s - plain.compute_s}
    if sequence_parallel_ok(work, work.tp):
        split = step_cost(replace(work, sequence_parallel=True), profile, degrees)
        seconds["rs_ag"] = split.time_s - split.compute_s
    choice = "rs_ag" if seconds.get("rs_ag", float("inf")) < seconds["all_reduce"] else "all_reduce"
    return CollectiveChoice(choice, seconds)
