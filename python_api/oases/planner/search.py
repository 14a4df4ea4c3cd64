"""The search: per-layer TP degrees by the ILP inside an outer search over the 3D layout.

    p = plan(load_model("llama-7b"), world=16, device_memory="24GB", link="25gbit", batch=32)
    p.tp_degrees        # one TP degree per layer, e.g. (2, 2, 4, 4, ..., 2)
    p.step_s, p.memory_bytes, p.dp, p.pp, p.tp, p.schedule, p.sub_batches, p.segments
    p.sequence_parallel # run train_step(..., sequence_parallel=True): RS + AG instead of each all-reduce

Outer loop, for every layout with dp * pp * tp = world (tp a power of two up to `tp_max`, pp
dividing the layers, dp dividing the batch), micro-batch count m (1 without a pipeline; pp, 2 pp,
4 pp with one), schedule and sub-batch count:

    stage = Workload(shape with layers / pp layers, rows = batch / dp / m, tp, schedule, n)
    degrees, t_mb = solve_chain(node, edge, memory of states + in-flight saved inputs, budget)  # ILP
    ns, r = choose_segments(...), dp_overlap_ratio(...)             # FOLD3D, with a pipeline and dp > 1
    step = (m + pp - 1) t_mb + 2 (pp - 1) ns p2p(activation) + exposed DP sync
    exposed DP sync = dp_sync / ns - (1 - r) m forward / ns      (pp > 1: the last segment's, FOLD3D)
                    = dp_sync                                     (pp = 1: summed after the step)
Each layout is costed in both collective forms (Centauri's primitive substitution, see
cost.sequence_parallel_form): per-layer degrees with all-reduces, and every layer at degree tp
with each all-reduce as reduce-scatter + all-gather (sequence parallelism: more bytes, a
re-gather in recomputation, half the saved activations; without a pipeline, whose stages do not
run it); `Plan.sequence_parallel` says which won.
Then each layer's recomputation (train_step's `recompute` per layer, oases.costs.recompute): the
memory the chosen degrees leave is spent on keeping layers instead of recomputing them, greedily
by time saved per byte (choose_modes), with each mode's bytes from cost.mode_bytes (times the
micro-batches in flight) and its time from the layer's cost with and without recomputation;
t_mb drops by what the kept layers no longer rerun. Sequence parallelism recomputes every layer
(the runtime's only mode there). `Plan.recompute` carries the modes, `full_recompute_step_s` the
step with every layer recomputed.
The plan with the least predicted step time wins; `uniform_step_s` is the best plan of the same
layout with one degree everywhere, so a reader sees what the per-layer choice bought.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Optional, Sequence, Union

from oases import _checks
from oases.costs.recompute import FULL, LayerModes, choose_modes, held_bytes
from oases.planner.cost import (
    LayerCost,
    Workload,
    edge_cost,
    fixed_memory,
    layer_cost,
    mode_bytes,
    sequence_parallel_ok,
    tp_degrees,
)
from oases.planner.fold3d import choose_segments, dp_overlap_ratio
from oases.planner.ilp import solve_chain
from oases.planner.model import ModelShape
from oases.planner.profile import Profile, analytical_profile, parse_bytes

__all__ = ["Plan", "DegreePlan", "plan", "plan_degrees", "PLAN_FORMAT", "PLAN_VERSION", "DEFAULT_VARIANTS"]

PLAN_FORMAT = "oases-plan"
PLAN_VERSION = 1
# (schedule, sub-batches) the outer search tries
DEFAULT_VARIANTS = (("megatron", 1), ("merak", 2), ("cross_pass", 2), ("oases", 2), ("oases", 4))


@dataclass(frozen=True)
class DegreePlan:
    """The ILP's answer for one TP group's stack: a degree per layer and the costs it predicts."""

    degrees: tuple[int, ...]
    time_s: float
    memory_bytes: float  # per rank, fixed memory included
    layers: tuple[LayerCost, ...]
    edges_s: tuple[float, ...]
    method: str  # "dp" (memory not binding) or "milp"

    @property
    def compute_s(self) -> float:
        """Compute seconds of every layer, summed."""
        return sum(c.compute_s for c in self.layers)


def plan_degrees(
    work: Workload,
    profile: Profile,
    memory_budget: float,
    *,
    in_flight: int = 1,
    degrees: Optional[Sequence[int]] = None,
) -> DegreePlan:
    """One degree per layer of `work.shape` minimising the step time (eq. 5) with per-rank memory
    (eq. 6, saved inputs counted `in_flight` times: micro-batches a pipeline stage holds) within
    `memory_budget` bytes. `degrees`: the candidates (default: every power of two up to work.tp)."""
    options = tuple(tp_degrees(work.shape, work.tp) if degrees is None else degrees)
    if not options:
        raise ValueError(f"degrees: no TP degree fits tp = {work.tp} and the model's heads / MLP width")
    layers = work.shape.layers
    kinds = {}  # (first, last) -> cost per option: the layers of a stack differ only at its ends
    for first, last in {(i == 0, i == layers - 1) for i in range(layers)}:
        kinds[first, last] = [layer_cost(work, profile, d, first=first, last=last) for d in options]
    per_layer = [kinds[i == 0, i == layers - 1] for i in range(layers)]
    node = [[c.time_s for c in row] for row in per_layer]
    memory = [[c.states_bytes + in_flight * c.saved_bytes for c in row] for row in per_layer]
    edge = [[edge_cost(work, profile, a, b) for b in options] for a in options]
    fixed = fixed_memory(work, profile)
    try:
        solution = solve_chain(node, edge, memory, memory_budget - fixed)
    except ValueError as err:
        raise ValueError(
            f"memory_budget: {memory_budget:.4g} bytes per rank minus {fixed:.4g} fixed leaves too "
            f"little for the layers ({str(err).removeprefix('budget: ')})"
        ) from None
    chosen = tuple(options[i] for i in solution.choice)
    costs = tuple(per_layer[l][i] for l, i in enumerate(solution.choice))
    edges = tuple(edge[a][b] for a, b in zip(solution.choice, solution.choice[1:]))
    return DegreePlan(chosen, solution.objective, solution.memory + fixed, costs, edges, solution.method)


@dataclass(frozen=True)
class Plan:
    """A planned training layout and what the cost model predicts for it (see `plan`)."""

    model: ModelShape
    world: int
    batch: int
    device_memory: int
    dp: int
    pp: int
    tp: int
    schedule: str
    sub_batches: int
    micro_batches: int
    segments: int
    dp_overlap_ratio: float
    tp_degrees: tuple[int, ...]  # one per layer of the whole model
    step_s: float
    memory_bytes: float
    compute_s: float
    exposed_comm_s: float
    dominated_by: str
    uniform_step_s: float  # best single-degree plan of the same layout (inf: none fits)
    layers: tuple[dict[str, Any], ...] = ()  # per layer of one stage: degree, time, compute, comm, memory
    profile: dict[str, Any] = field(default_factory=dict)
    planner_s: float = 0.0
    candidates: int = 0
    # Centauri's primitive substitution: each sublayer's all-reduce as reduce-scatter + all-gather,
    # i.e. train_step(..., sequence_parallel=True); the step of each form ("all_reduce", "rs_ag";
    # None where it does not fit or cannot run)
    sequence_parallel: bool = False
    form_step_s: dict[str, Optional[float]] = field(default_factory=dict)
    # pieces per fused GEMM + collective for parallelize(..., chunks=): the layers' most common
    # count (Centauri's Algorithm 1 with the profile's chunked-GEMM efficiency; 1 without TP)
    chunks: int = 1
    # each layer's recomputation ("full", "selective", "keep"; one per layer of the whole model)
    # for train_step(recompute=...), and the step had every layer been recomputed
    recompute: tuple[str, ...] = ()
    full_recompute_step_s: float = 0.0

    @property
    def mixed(self) -> bool:
        """Whether the layers' TP degrees differ."""
        return len(set(self.tp_degrees)) > 1

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data: {"format": PLAN_FORMAT, "version": PLAN_VERSION, ...} with its fields
        (uniform_step_s None where no uniform plan fits)."""
        doc = asdict(self)
        doc["model"] = self.model.to_dict()
        doc["tp_degrees"] = list(self.tp_degrees)
        doc["layers"] = [dict(x) for x in self.layers]
        doc["uniform_step_s"] = None if self.uniform_step_s == float("inf") else self.uniform_step_s
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **doc}

    def save(self, path: str) -> None:
        """Write to_dict() to `path` as JSON (NaN or inf raise ValueError)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=False)
            f.write("\n")


def _powers_of_two(limit: int) -> Iterable[int]:
    d = 1
    while d <= limit:
        yield d
        d *= 2


def _count(name: str, value: int) -> int:
    if not _checks.is_int(value) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def plan(
    model: ModelShape,
    *,
    world: int,
    device_memory: Union[int, str],
    batch: int,
    link: Union[str, float, None] = None,
    profile: Optional[Profile] = None,
    tp_max: int = 8,
    flops_per_s: float = 100e12,
    variants: Sequence[tuple[str, int]] = DEFAULT_VARIANTS,
) -> Plan:
    """The fastest predicted layout for `world` ranks of `device_memory` bytes training `model`
    on `batch` sequences per step (see the module docstring). `profile` gives the device's and
    links' costs; without one, `link` (bytes/s or "25gbit") and `flops_per_s` make an analytical
    profile. Raises ValueError naming the argument when nothing fits."""
    started = time.perf_counter()
    if not isinstance(model, ModelShape):
        raise TypeError(f"model: expected an oases.planner.ModelShape (see load_model), got {type(model).__name__}")
    world, batch, tp_max = _count("world", world), _count("batch", batch), _count("tp_max", tp_max)
    budget = parse_bytes(device_memory)
    if profile is None:
        if link is None:
            raise ValueError("link: give the link's rate (e.g. 25gbit) or a measured profile")
        profile = analytical_profile(flops_per_s=flops_per_s, link=link)
    best: Optional[Plan] = None
    count = 0
    for tp in _powers_of_two(min(tp_max, world)):
        if world % tp or not tp_degrees(model, tp) or tp_degrees(model, tp)[-1] != tp:
            continue
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0 and model.layers % p == 0):
            dp = world // (tp * pp)
            if batch % dp:
                continue
            rows = batch // dp
            for m in [1] if pp == 1 else [pp, 2 * pp, 4 * pp]:
                if rows % m:
                    continue
                for schedule, n in variants:
                    if rows // m < n:
                        continue
                    count += 1
                    candidate = _evaluate(model, profile, budget, world, batch, dp, pp, tp, m, schedule, n)
                    if candidate is not None and (best is None or candidate.step_s < best.step_s):
                        best = candidate
    if best is None:
        raise ValueError(
            f"device_memory: no layout of {world} ranks fits {model.name} with batch {batch} in "
            f"{budget / 1e9:.3g} GB per rank (more memory or ranks, or a smaller batch)"
        )
    return replace(best, planner_s=time.perf_counter() - started, candidates=count)


def _forms(work: Workload, profile: Profile, budget: int, in_flight: int, pp: int) -> dict[str, Optional[DegreePlan]]:
    """The best plan of each collective form (see `sequence_parallel_form`): "all_reduce" with
    per-layer degrees, "rs_ag" (sequence parallel: every layer at degree tp, no pipeline: the
    pipeline's stages do not run it); None: does not fit or cannot run."""
    out: dict[str, Optional[DegreePlan]] = {"all_reduce": None, "rs_ag": None}
    try:
        out["all_reduce"] = plan_degrees(work, profile, budget, in_flight=in_flight)
    except ValueError:
        pass
    if pp == 1 and sequence_parallel_ok(work, work.tp):
        try:
            out["rs_ag"] = plan_degrees(
                replace(work, sequence_parallel=True), profile, budget, in_flight=in_flight, degrees=(work.tp,)
            )
        except ValueError:
            pass
    return out


def _pipeline_and_dp(
    model: ModelShape, profile: Profile, work: Workload, dp: int, pp: int, tp: int, m: int, t_mb: float
) -> tuple[float, int, float, float]:
    """(one activation's send between stages, segments, dp_overlap_ratio, the DP sync's exposed
    seconds): FOLD3D's per-segment sync where there is a pipeline, else one all-reduce after the step."""
    stage, e = work.shape, profile.element_bytes
    pp_comm = profile.collective_time("p2p", 2, work.rows * stage.seq_len * stage.hidden * e) if pp > 1 else 0.0
    router = stage.router_parameters()  # an MoE's router: replicated over tp (0 dense)
    rank_params = (stage.layer_parameters() - router) * stage.layers / tp + router * stage.layers
    dp_comm = profile.collective_time("all_reduce", dp, rank_params * e)
    forward, backward = t_mb / 3, 2 * t_mb / 3
    if pp > 1 and dp > 1:  # the pipeline's per-segment DP sync (FOLD3D)
        ns = choose_segments(model.layers, pp, forward, backward, pp_comm, dp_comm, micro_batches=m)
        ratio = dp_overlap_ratio(forward, backward, dp_comm, segments=ns, micro_batches=m)
        return pp_comm, ns, ratio, max(0.0, dp_comm / ns - (1 - ratio) * m * forward / ns)
    return pp_comm, 1, 1.0, dp_comm  # no pipeline: the gradients summed over dp after the step


def _layer_rows(chosen: Any, in_flight: int) -> tuple[dict, ...]:
    """The plan's per-layer table: degree, times, memory with `in_flight` micro-batches' activations."""
    return tuple(
        {
            "layer": i,
            "degree": c.degree,
            "time_s": c.time_s,
            "compute_s": c.compute_s,
            "comm_s": c.comm_s,
            "memory_bytes": c.states_bytes + in_flight * c.saved_bytes,
            "dominated_by": c.dominated_by,
            "chunks": c.chunks,
        }
        for i, c in enumerate(chosen.layers)
    )


def _evaluate(
    model: ModelShape,
    profile: Profile,
    budget: int,
    world: int,
    batch: int,
    dp: int,
    pp: int,
    tp: int,
    m: int,
    schedule: str,
    n: int,
) -> Optional[Plan]:
    stage = replace(model, layers=model.layers // pp)
    work = Workload(stage, rows=batch // dp // m, tp=tp, schedule=schedule, sub_batches=n)
    in_flight = min(pp, m)
    forms = _forms(work, profile, budget, in_flight, pp)
    fitting = {form: p for form, p in forms.items() if p is not None}
    if not fitting:
        return None
    form = min(fitting, key=lambda f: (fitting[f].time_s, f != "all_reduce"))  # ties: the plain all-reduce
    chosen = fitting[form]
    full_t_mb = chosen.time_s
    modes, saved_s, extra_bytes = (
        ((FULL,) * len(chosen.layers), 0.0, 0.0)
        if form == "rs_ag"
        else _recompute_modes(work, profile, chosen, budget, in_flight)
    )
    uniform = float("inf")
    try:
        uniform = plan_degrees(work, profile, budget, in_flight=in_flight, degrees=(tp,)).time_s
    except ValueError:
        pass
    t_mb = chosen.time_s - saved_s
    pp_comm, ns, ratio, exposed_dp = _pipeline_and_dp(model, profile, work, dp, pp, tp, m, t_mb)
    pipeline = (m + pp - 1) * t_mb + 2 * (pp - 1) * ns * pp_comm
    step = pipeline + exposed_dp
    full_step = (m + pp - 1) * full_t_mb + 2 * (pp - 1) * ns * pp_comm + exposed_dp
    uniform_step = (m + pp - 1) * uniform + 2 * (pp - 1) * ns * pp_comm + exposed_dp
    form_step = {
        f: None if p is None else (m + pp - 1) * p.time_s + 2 * (pp - 1) * ns * pp_comm + exposed_dp
        for f, p in forms.items()
    }
    form_step[form] = step  # the chosen form with its layers' recomputation chosen
    compute = m * chosen.compute_s
    exposed = max(0.0, step - compute)
    counts = [c.chunks for c in chosen.layers if c.degree > 1] or [1]
    chunks = max(set(counts), key=lambda k: (counts.count(k), -k))  # ties: fewer pieces
    return Plan(
        model=model,
        world=world,
        batch=batch,
        device_memory=budget,
        dp=dp,
        pp=pp,
        tp=tp,
        schedule=schedule,
        sub_batches=n,
        micro_batches=m,
        segments=ns,
        dp_overlap_ratio=ratio,
        tp_degrees=chosen.degrees * pp,
        step_s=step,
        memory_bytes=chosen.memory_bytes + extra_bytes,
        compute_s=compute,
        exposed_comm_s=exposed,
        dominated_by="exposed comm" if exposed > compute else "compute",
        uniform_step_s=uniform_step,
        layers=_layer_rows(chosen, in_flight),
        profile=profile.to_dict(),
        sequence_parallel=form == "rs_ag",
        form_step_s=form_step,
        chunks=chunks,
        recompute=tuple(modes) * pp,
        full_recompute_step_s=full_step,
    )


def _recompute_modes(
    work: Workload, profile: Profile, chosen: DegreePlan, budget: float, in_flight: int
) -> tuple[tuple[str, ...], float, float]:
    """(each layer's mode, the micro-batch time they save, the bytes they add) for the degrees
    `chosen`: the memory `budget` leaves above it spent by choose_modes (module docstring)."""
    last = len(chosen.layers) - 1
    layers = []
    for i, c in enumerate(chosen.layers):
        kept = layer_cost(work, profile, c.degree, first=i == 0, last=i == last, recompute=False)
        full, selective, keep = (in_flight * b for b in mode_bytes(work, c.degree, profile.element_bytes))
        layers.append(LayerModes(full, selective, keep, forward=max(0.0, c.time_s - kept.time_s)))
    held = held_bytes(layers, [FULL] * len(layers))
    modes = choose_modes(layers, budget - (chosen.memory_bytes - held))
    if modes is None:  # (the degrees were chosen to fit with every layer recomputed)
        return (FULL,) * len(layers), 0.0, 0.0
    saved = sum(layer.rerun(FULL) - layer.rerun(mode) for layer, mode in zip(layers, modes))
    return modes, saved, held_bytes(layers, modes) - held
