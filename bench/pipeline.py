"""Suite `pipeline`: PP2 x DP2 training steps of oases.pipeline on every schedule (FOLD3D's setting).

    python -m bench pipeline --nproc 4 --hosts 2 --bandwidth 500mbit     # DP across 2 emulated servers
    python -m bench pipeline --nproc 4                                   # unshaped: the same, no NIC

Mesh and placement: init_device_mesh("cpu", (dp, pp, 1), ("dp", "pp", "tp")), so global rank
r = d * pp + s; oases-launch packs ranks r // (nproc / hosts) into a host. With 4 ranks on 2
hosts: host 0 holds (d=0, s=0), (d=0, s=1), host 1 the d=1 replica. The pipeline (PP) stays
inside a host (loopback, or --intra-bandwidth), the data-parallel (DP) sync of both stages
crosses the shaped NICs (each host's NIC carries both stages' DP rings). PP transfers therefore
do not share the NIC with DP here; they share the CPU and gloo's threads with it.

Variants (same model, seed, batches, optimizer; losses of two steps checked equal before timing):

    gpipe        all forwards, then all backwards; DP sync of the whole stage after the backward
    1f1b         Megatron's one-forward-one-backward (the baseline of the x columns)
    aiao-nsK     FOLD3D's all-in-all-out over K segments: segment k's DP sync overlaps the
                 backward of the segments below it and the next step's forwards up to k
    aiao-ns2-nopre  aiao ns=2 with preemption off (DP chunks go out beside PP transfers)

A timed call is `--steps` train_steps then `pipe.close()`, which waits for every DP sync still
in flight: no variant's sync leaks out of its timed region (or into another variant's). Per
variant (medians over calls, then MAX over ranks; per iteration = per call / steps). With
--dp-overlap-ratio r < 1 the deferred buckets overlap the next train_step's forwards only
inside a call: give --steps >= 2 then (close() exposes the last step's deferred part).

Per variant:

    t_iter       wall time per iteration
    dp_exposed   time the main thread waits for DP sync (SegmentSync.wait, incl. close)
    pp_wait      time the main thread waits for a PP receive (the bubble, as seen by this rank)
    fwd, bwd     forward / backward compute of the actions (receive waits excluded; bwd
                 includes the recomputation of per-layer activation checkpointing)
    send/recv    median PP transfer latency from the CommScheduler's counters (posting to
                 completion; a receive posted one action ahead includes the sender's compute)
    deferred     DP chunks held back by a PP transfer, per iteration (forced: released at the
                 scheduler's hold timeout)
    peak MiB     rise of peak resident memory over one iteration (after all timings)

Beside them: `dp_alone`, the stage's whole DP sync (1f1b's buckets) alone on the link, and
`pp_idle`, one micro-batch activation sent between PP peers with nothing else running; the table
prints `dp_alone`, the stage's compute (1f1b's fwd + bwd) and their ratio (`dp_to_compute` in the
JSON): the regime the run was in (the table's words: > 2 DP-bound, 0.5-2 balanced, < 0.5
compute-bound).

Regimes (--regime):

    given      the sizes as given. At 500mbit the defaults (hidden 256, 8 layers, batch 16 x 64)
               are DP-bound on an idle machine: one stage's 12.2 MiB sync alone takes ~0.8 s on
               the shared link, its 1f1b backward 0.15 s in a quiet run. The compute stretches with
               the machine's load (4 ranks on 2 cores, and other jobs): the table says where a run was
    balanced   FOLD3D's own regime, where a stage's DP sync is comparable to its forward + backward
               (AIAO hides it behind the backwards below each segment and the next step's
               forwards). Measured at the start of the run: a 1f1b pipeline at the given sizes
               (--batch: where it starts) times its stage compute (fwd + bwd, receive waits
               excluded; 3 steps after 2 untimed ones) and the stage's whole DP sync alone (3
               times); medians, MAX over ranks. The global batch is scaled by their ratio (the
               sync does not grow with the batch, the compute does), rounded to a multiple of
               dp x micro-batches, at most 32 times the start; a second pass from that batch
               refines it. Every variant is then timed at that batch; the passes are in the JSON
               (config.calibration), and the table prints the ratio measured again in the run.
               A timed call there is 3 train_steps (--steps), so that each DP sync may overlap
               the next step's forwards as in training (close() exposes the last step's).

                   python -m bench pipeline --nproc 4 --bandwidth 500mbit --regime balanced
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bench import _metrics
from bench._report import Table, pyplot
from bench._threads import OtherThreadsCPU, thread_queued
from bench._trace import COMM, COMPUTE, DP, OP
from oases.models import GPTConfig
from oases.pipeline import Pipeline

BASELINE = "1f1b"
PP = 2
REGIMES = ("given", "balanced")
_CALIBRATION_WARMUP = 2  # untimed steps per calibration pass
_CALIBRATION_STEPS = 3  # timed steps (and DP syncs) per calibration pass
_CALIBRATION_PASSES = 2
_MAX_BATCH_SCALE = 32  # balanced: the batch grows at most this much over the given one
_BALANCED_STEPS = 3  # balanced: train_steps per timed call unless --steps says otherwise


def _steps(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=None, help="default 256 (--quick: 32)")
    parser.add_argument("--layers", type=int, default=None, help="default 8 (--quick: 4); divisible by 2*ns")
    parser.add_argument("--heads", type=int, default=None, help="default 8 (--quick: 4)")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch rows, default 16 (--quick: 8); --regime balanced: where it starts",
    )
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (--quick: 16)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--dp-overlap-ratio",
        type=float,
        default=1.0,
        help="Pipeline(dp_overlap_ratio=...) of every variant (default 1.0: all at once)",
    )
    parser.add_argument(
        "--steps",
        type=_steps,
        default=None,
        help="train_steps per timed call (default 1; 3 with --regime balanced, where a DP sync overlaps "
        "the next step's forwards)",
    )
    parser.add_argument(
        "--dp-chunk-kib",
        type=int,
        default=256,
        help="Pipeline(dp_chunk_bytes=...): KiB per DP ring piece, the preemption granularity",
    )
    parser.add_argument(
        "--regime",
        choices=REGIMES,
        default="given",
        help="given: the sizes as given (the defaults are DP-bound at 500mbit); balanced: the global "
        "batch scaled, by a measurement at the start of the run, until one stage's DP sync "
        "alone ~ its forward + backward (see the suite's doc)",
    )


@dataclass(frozen=True)
class _Variant:
    name: str
    schedule: str
    segments: int | str
    preemption: bool = True
    dp_overlap_ratio: Optional[float | str] = None  # None: --dp-overlap-ratio


def _variants(layers: int) -> list[_Variant]:
    out = [_Variant("gpipe", "gpipe", 1), _Variant("1f1b", "1f1b", 1)]
    out += [_Variant(f"aiao-ns{ns}", "aiao", ns) for ns in (1, 2, 4) if layers % (PP * ns) == 0]
    if layers % (PP * 2) == 0:
        out.append(_Variant("aiao-ns2-nopre", "aiao", 2, preemption=False))
    out.append(_Variant("aiao-auto", "aiao", "auto", dp_overlap_ratio="auto"))  # FOLD3D's rules, measured
    return out


# Timed parts of the main thread's time outside actions and waits ("host"), wall seconds: the
# batch's check over the mesh at a step's start (a collective) and, at its end, the wait for the
# loss's sum over dp (started after the last stage's last forward) and its broadcast over pp: where
# the ranks wait for each other; the optimizers' steps, the wait for the step's PP sends,
# launching DP buckets, ending the scheduler's threads in close(). The rest of host is Python
# between them.
HOST_PARTS = ("input_check", "optimizer", "send_wait", "dp_launch", "loss_sum", "threads_close")


@dataclass
class _Probe:
    """Observes one Pipeline through its public objects: what the main thread waits for, the
    compute of each action, PP transfers and DP buckets (intervals only while `tracing`)."""

    pipe: Pipeline
    rank: int
    dp_wait: float = 0.0
    pp_wait: float = 0.0
    fwd: float = 0.0
    bwd: float = 0.0
    host: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOST_PARTS, 0.0))  # wall, see HOST_PARTS
    queued_compute: float = 0.0  # the main thread's run-queue wait inside fwd and bwd (thread_schedstat)
    tracing: bool = False
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)  # (row, name, start, stop)
    transfers: list[Any] = field(default_factory=list)
    _recv_end: float = 0.0
    _recv_end_queued: float = 0.0
    _waiting: bool = field(default=False, init=False, repr=False)  # inside sync.wait

    def __post_init__(self) -> None:
        pipe = self.pipe
        wait, recv = pipe.sync.wait, pipe.comm.recv
        track, all_reduce = pipe.scheduler.track, pipe.scheduler.all_reduce

        def timed_wait(segment: int) -> None:
            start, self._waiting = time.perf_counter(), True
            try:
                wait(segment)  # (launches what was deferred first: dp_wait's, not dp_launch's)
            finally:
                self._waiting = False
            stop = time.perf_counter()
            self.dp_wait += stop - start
            if self.tracing and stop - start > 1e-5:
                self.spans.append(("compute", f"dp wait {segment}", start, stop))

        def timed_recv(*args, **kwargs):
            start = time.perf_counter()
            out = recv(*args, **kwargs)
            self._recv_end_queued = thread_queued()  # (read before the clock: the read is not compute)
            stop = self._recv_end = time.perf_counter()
            self.pp_wait += stop - start
            if self.tracing:
                self.spans.append(("pp", f"recv wait {args[0][0]}", start, stop))
            return out

        def traced_track(work, kind, peer, **options):
            transfer = track(work, kind, peer, **options)
            if self.tracing:
                self.transfers.append(transfer)
            return transfer

        def traced_all_reduce(flat, group, *, chunks, **options):
            start = time.perf_counter()
            out = all_reduce(flat, group, chunks=chunks, **options)
            if self.tracing:
                self.spans.append(
                    ("dp", f"bucket {flat.numel() * flat.element_size() / 2**20:.1f} MiB", start, time.perf_counter())
                )
            return out

        def timed_run(action, run) -> None:  # Pipeline.register_action_wrapper
            queued = thread_queued()
            start = time.perf_counter()
            run()
            stop = time.perf_counter()
            received = self._recv_end > start
            begin = self._recv_end if received else start  # compute starts once the input has arrived
            self.queued_compute += thread_queued() - (self._recv_end_queued if received else queued)
            if action.kind == "F":
                self.fwd += stop - begin
            else:
                self.bwd += stop - begin
            if self.tracing:
                self.spans.append(("compute", repr(action), begin, stop))

        def timed(fn: Callable[..., Any], part: str) -> Callable[..., Any]:
            def timed_fn(*args, **kwargs):
                if self._waiting:  # inside a timed DP wait: its time is the wait's
                    return fn(*args, **kwargs)
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.host[part] += time.perf_counter() - start

            return timed_fn

        def timed_phase(phase: str, run: Callable[[], None]) -> None:  # Pipeline.register_phase_wrapper
            start = time.perf_counter()
            try:
                run()
            finally:
                self.host[phase] += time.perf_counter() - start

        pipe.sync.wait, pipe.comm.recv, pipe.scheduler.track = timed_wait, timed_recv, traced_track
        pipe.scheduler.all_reduce = traced_all_reduce
        pipe.register_action_wrapper(timed_run)
        for opt in pipe.optimizers:  # the segments' optimizers (built once "auto" has chosen)
            opt.step = timed(opt.step, "optimizer")
        pipe.comm.wait_sends = timed(pipe.comm.wait_sends, "send_wait")
        pipe.sync.launch = timed(pipe.sync.launch, "dp_launch")
        pipe.sync.launch_deferred = timed(pipe.sync.launch_deferred, "dp_launch")
        pipe.scheduler.close = timed(pipe.scheduler.close, "threads_close")
        pipe.register_phase_wrapper(timed_phase)  # "input_check", "loss_sum"

    def reset(self) -> None:
        self.dp_wait = self.pp_wait = self.fwd = self.bwd = self.queued_compute = 0.0
        self.host = dict.fromkeys(HOST_PARTS, 0.0)
        self.pipe.scheduler.reset_counters()

    def figures(self) -> dict[str, float]:
        """This rank's figures of the calls since reset() (call after pipe.close())."""
        s = self.pipe.scheduler
        lat = {k: (statistics.median(v) if v else 0.0) for k, v in s.pp_latency.items()}
        return {
            "dp_wait": self.dp_wait,
            "pp_wait": self.pp_wait,
            "fwd": self.fwd,
            "bwd": self.bwd,
            **self.host,
            "queued_compute": self.queued_compute,
            "send_latency": lat["send"],
            "recv_latency": lat["recv"],
            "deferred": float(s.deferred_chunks),
            "forced": float(s.forced_chunks),
            "dp_chunks": float(s.dp_chunks),
            "overlapped": float(s.overlapped_chunks),
        }

    def timeline(self) -> list[tuple[str, str, float, float]]:
        """The traced spans and every tracked PP transfer as (row, name, start, stop)."""
        pp = [("pp", t.kind, t.posted, t.posted + (t.latency or 0.0)) for t in self.transfers]
        return self.spans + pp


def _sizes(args) -> dict[str, int]:
    q = args.quick
    return {
        "hidden": args.hidden or (32 if q else 256),
        "layers": args.layers or (4 if q else 8),
        "heads": args.heads or (4 if q else 8),
        "batch": args.batch or (8 if q else 16),
        "seq_len": args.seq_len or (16 if q else 64),
    }


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


def _calibrate(args, ctx, config: GPTConfig, mesh, batch: int) -> dict[str, float]:
    """One stage's DP sync alone and its compute per iteration (fwd + bwd of a 1f1b pipeline at
    global batch `batch`): medians over _CALIBRATION_STEPS, MAX over ranks (the same on every rank)."""
    pipe = Pipeline(
        config,
        mesh,
        schedule=BASELINE,
        segments=1,
        micro_batches=args.micro_batches,
        seed=0,
        dp_chunk_bytes=args.dp_chunk_kib << 10,
        optimizer=_optimizer,
    )
    probe = _Probe(pipe, ctx.rank)
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g) for _ in range(2))
    try:
        for _ in range(_CALIBRATION_WARMUP):  # a fresh process's first steps run slow (allocator, caches)
            pipe.train_step(tokens, targets)
            pipe.close()
        compute, sync = [], []
        for _ in range(_CALIBRATION_STEPS):
            probe.reset()
            dist.barrier()
            pipe.train_step(tokens, targets)
            pipe.close()
            f = probe.figures()
            compute.append(f["fwd"] + f["bwd"])
        for _ in range(_CALIBRATION_STEPS):
            dist.barrier()
            start = time.perf_counter()
            pipe.sync_segment(0)
            sync.append(time.perf_counter() - start)
    finally:
        pipe.close()
    local = torch.tensor([statistics.median(sync), statistics.median(compute)], dtype=torch.float64)
    dp_s, compute_s = ctx.timer.max_over_ranks(local).tolist()
    return {"batch": batch, "dp_sync_s": dp_s, "stage_compute_s": compute_s, "ratio": dp_s / compute_s}


def _balanced_batch(args, ctx, config: GPTConfig, mesh, batch: int, dp: int) -> tuple[int, list[dict[str, float]]]:
    """--regime balanced: the global batch at which one stage's DP sync alone ~ its forward +
    backward, and the calibration passes it came from (see the module doc)."""
    unit = dp * args.micro_batches  # a micro-batch holds whole rows on every dp replica
    start, passes = batch, []
    for _ in range(_CALIBRATION_PASSES):
        passes.append(_calibrate(args, ctx, config, mesh, batch))
        batch = scaled_batch(batch, passes[-1]["ratio"], unit=unit, cap=_MAX_BATCH_SCALE * start)
    return batch, passes


def scaled_batch(batch: int, ratio: float, *, unit: int, cap: int) -> int:
    """batch * ratio (DP sync / compute: the batch at which they match, compute growing with it)
    rounded to a multiple of `unit`, at least `unit`, at most `cap` rounded up to one."""
    return min(max(unit, unit * round(batch * ratio / unit)), unit * -(-cap // unit))


def _median_max(ctx, per_call: list[dict[str, float]], scale: float) -> dict[str, float]:
    """Per key: the median over this rank's calls, then the MAX over ranks, times `scale`."""
    keys = list(per_call[0])
    local = torch.tensor([statistics.median(c[k] for c in per_call) for k in keys], dtype=torch.float64)
    return dict(zip(keys, (scale * v for v in ctx.timer.max_over_ranks(local).tolist())))


def run(args, ctx) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from bench._rss import hwm_rise_mib

    if ctx.world_size % PP:
        raise SystemExit(f"pipeline: needs a multiple of pp = {PP} ranks, got {ctx.world_size}")
    if args.steps is None:  # balanced: AIAO's syncs overlap the next step's forwards, inside a call only
        args.steps = _BALANCED_STEPS if args.regime == "balanced" else 1
    dp = ctx.world_size // PP
    sizes = _sizes(args)
    config = GPTConfig(
        vocab_size=64, seq_len=sizes["seq_len"], hidden=sizes["hidden"], heads=sizes["heads"], layers=sizes["layers"]
    )
    mesh = init_device_mesh("cpu", (dp, PP, 1), mesh_dim_names=("dp", "pp", "tp"))
    calibration: list[dict[str, float]] = []
    if args.regime == "balanced":
        sizes["batch"], calibration = _balanced_batch(args, ctx, config, mesh, sizes["batch"], dp)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, 64, (sizes["batch"], sizes["seq_len"]), generator=g),
            torch.randint(0, 64, (sizes["batch"], sizes["seq_len"]), generator=g),
        )
        for _ in range(2)
    ]
    variants = _variants(config.layers)
    pipes = {
        v.name: Pipeline(
            config,
            mesh,
            schedule=v.schedule,
            segments=v.segments,
            micro_batches=args.micro_batches,
            preemption=v.preemption,
            seed=0,
            dp_overlap_ratio=args.dp_overlap_ratio if v.dp_overlap_ratio is None else v.dp_overlap_ratio,
            dp_chunk_bytes=args.dp_chunk_kib << 10,
            optimizer=_optimizer,
        )
        for v in variants
    }

    # Same losses (two steps: the second shows the first's update) before any timing.
    # Each pipeline is closed before the next trains: pipelines on one mesh share its groups and
    # message tags, so one's DP sync must not be in flight during another's.
    losses = {}
    for name, pipe in pipes.items():
        losses[name] = [float(pipe.train_step(*b)) for b in batches]
        pipe.close()
    for name, pipe in pipes.items():
        for got, want in zip(losses[name], losses[BASELINE]):
            if abs(got - want) > 1e-5 * abs(want):
                raise AssertionError(
                    f"pipeline: {name} losses {losses[name]} differ from {BASELINE}'s {losses[BASELINE]}"
                )
    # After the first steps: "auto" variants have chosen their segments (and made their DP sync).
    probes = {name: _Probe(pipe, ctx.rank) for name, pipe in pipes.items()}

    tokens, targets = batches[0]
    per_call: dict[str, list[dict[str, float]]] = {name: [] for name in pipes}

    def call(name: str) -> Callable[[], None]:
        def fn() -> None:
            probes[name].reset()
            queued, start = thread_queued(), time.perf_counter()
            with OtherThreadsCPU() as other:
                for _ in range(args.steps):
                    pipes[name].train_step(tokens, targets)
                pipes[name].close()
            wall, queued = time.perf_counter() - start, thread_queued() - queued
            # other threads' CPU is communication's only where compute runs on this thread alone
            comm_cpu = other.seconds if torch.get_num_threads() == 1 else float("nan")
            f = probes[name].figures()
            host = wall - f["dp_wait"] - f["pp_wait"] - f["fwd"] - f["bwd"]  # outside every timed region
            per_call[name].append({**f, "comm_cpu": comm_cpu, "wall": wall, "host": host, "queued": queued})

        return fn

    timed = ctx.timer.measure({name: call(name) for name in pipes})
    figures = {name: _median_max(ctx, calls[args.warmup :], 1.0) for name, calls in per_call.items()}
    by_rank = {name: _median_call_by_rank(ctx, calls[args.warmup :], args.steps) for name, calls in per_call.items()}

    # References: the whole DP sync of a stage alone (1f1b's buckets), one PP transfer on an idle link.
    base = pipes[BASELINE]
    base.train_step(tokens, targets)
    base.close()
    dp_alone = ctx.timer.measure({"dp": lambda: base.sync_segment(0)})["dp"]
    act = torch.randn(sizes["batch"] // dp // args.micro_batches, sizes["seq_len"], sizes["hidden"])
    stage, peers = dist.get_rank(base.pp_group), dist.get_process_group_ranks(base.pp_group)

    def ping() -> None:
        if stage == 0:
            dist.isend(act, peers[1], group=base.pp_group, tag=99).wait()
        elif stage == 1:
            dist.irecv(act, peers[0], group=base.pp_group, tag=99).wait()

    pp_idle = ctx.timer.measure({"pp": ping})["pp"]

    # One traced iteration per variant (timeline and Perfetto trace), then peak memory.
    timelines = {}
    for name, pipe in pipes.items():
        probe = probes[name]
        probe.spans, probe.transfers, probe.tracing = [], [], True
        dist.barrier()
        with ctx.trace.span(f"{name} iteration", OP):
            pipe.train_step(tokens, targets)
            pipe.close()
        probe.tracing = False
        rows = {"compute": COMPUTE, "pp": COMM, "dp": DP}
        for row, label, start, stop in probe.timeline():
            ctx.trace.events.append(
                {
                    "name": f"{name}: {label}",
                    "ph": "X",
                    "pid": ctx.rank,
                    "tid": rows[row],
                    "ts": start * 1e6,
                    "dur": (stop - start) * 1e6,
                    "args": {"variant": name},
                }
            )
        mine = probe.timeline()
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        origin = min(s for spans in gathered for _, _, s, _ in spans)
        timelines[name] = [[(row, label, s - origin, e - origin) for row, label, s, e in spans] for spans in gathered]
    peaks = {}
    for name, pipe in pipes.items():
        peak = hwm_rise_mib(lambda: (pipe.train_step(tokens, targets), pipe.close()))
        peaks[name] = (
            None if peak is None else float(ctx.timer.max_over_ranks(torch.tensor([peak], dtype=torch.float64)))
        )
    for pipe in pipes.values():
        pipe.close()

    link = ctx.meta["link"]
    params_stage = sum(p.numel() for p in base.stage.parameters())
    config_record = {
        **sizes,
        "micro_batches": args.micro_batches,
        "steps_per_call": args.steps,
        "dp_overlap_ratio": args.dp_overlap_ratio,
        "dp_chunk_kib": args.dp_chunk_kib,
        "dp": dp,
        "pp": PP,
        "tp": 1,
        "stage_params": params_stage,
        "dp_sync_mib": params_stage * 4 / 2**20,
        "mapping": "rank = d*pp + s; PP inside a host, DP across hosts (with --hosts 2)",
        "hosts": int(os.environ.get("OASES_HOSTS", "1")),
        "intra_bandwidth": os.environ.get("OASES_INTRA_BANDWIDTH"),
        "regime": args.regime,
        "calibration": calibration,
    }
    records = []
    base_t = timed[BASELINE].median / args.steps
    base_f = figures[BASELINE]
    stage_compute = (base_f["fwd"] + base_f["bwd"]) / args.steps  # 1f1b's forward + backward per iteration
    for v in variants:
        f = figures[v.name]
        t_iter = timed[v.name].median / args.steps
        per_iter = {
            k: f[k] / args.steps
            for k in ("dp_wait", "pp_wait", "fwd", "bwd", "deferred", "forced", "dp_chunks", "overlapped", "comm_cpu")
        }
        records.append(
            {
                "variant": v.name,
                "schedule": v.schedule,
                "segments": pipes[v.name].segments,
                "dp_overlap_ratio": pipes[v.name].dp_overlap_ratio,
                "measured": pipes[v.name].measured,
                "preemption": v.preemption,
                "t_iter": t_iter,
                "t_iter_min": timed[v.name].min / args.steps,
                "dp_exposed": per_iter["dp_wait"],
                "pp_wait": per_iter["pp_wait"],
                "fwd": per_iter["fwd"],
                "bwd": per_iter["bwd"],
                "send_latency": f["send_latency"],
                "recv_latency": f["recv_latency"],
                "comm_cpu": None if math.isnan(per_iter["comm_cpu"]) else per_iter["comm_cpu"],
                "deferred_chunks": per_iter["deferred"],
                "forced_chunks": per_iter["forced"],
                "dp_chunks": per_iter["dp_chunks"],
                "overlapped_chunks": per_iter["overlapped"],
                "speedup_vs_1f1b": _metrics.speedup(base_t, t_iter),
                "losses": losses[v.name],
                "peak_mib": peaks[v.name],
                "dp_alone": dp_alone.median,
                "pp_idle": pp_idle.median,
                "link": link["bandwidth"],
                "stage_compute": stage_compute,
                "dp_to_compute": dp_alone.median / stage_compute,
                "config": config_record,
                "timeline": timelines[v.name],
            }
        )
    for r in records:  # one rank's figures each (a sum of MAXes over ranks is no rank's iteration)
        ranks = by_rank[r["variant"]]
        critical = max(range(len(ranks)), key=lambda i: ranks[i]["t_iter"])  # the rank that finished last
        gap = gap_vs_baseline(ranks[critical], by_rank[BASELINE][critical])
        r["by_rank"] = [_nan_to_none(f) for f in ranks]  # NaN: not measured (JSON has no NaN)
        r["gap"] = {"rank": critical, **_nan_to_none(gap)}
    return records


def _nan_to_none(figures: dict[str, float]) -> dict[str, Optional[float]]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in figures.items()}


def _median_call_by_rank(ctx, per_call: list[dict[str, float]], steps: int) -> list[dict[str, float]]:
    """Every rank's median call (the call of median wall time, the lower one of an even count),
    all its figures per iteration: t_iter (its wall time), dp_exposed, pp_wait, fwd, bwd, host
    (the call's time outside them) and its HOST_PARTS, queued (the main thread's run-queue wait in
    the call), queued_compute (its part inside fwd + bwd), comm_cpu; one call's figures, so that
    per rank t_iter = dp_exposed + pp_wait + fwd + bwd + host exactly (an all_gather: every rank
    gets every rank's)."""
    keys = {
        "t_iter": "wall",
        "dp_exposed": "dp_wait",
        "pp_wait": "pp_wait",
        "fwd": "fwd",
        "bwd": "bwd",
        "host": "host",
        **{k: k for k in HOST_PARTS},
        "queued": "queued",
        "queued_compute": "queued_compute",
        "comm_cpu": "comm_cpu",
    }
    ordered = sorted(per_call, key=lambda c: c["wall"])
    median = ordered[(len(ordered) - 1) // 2]
    local = torch.tensor([median[k] / steps for k in keys.values()], dtype=torch.float64)
    gathered = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    return [dict(zip(keys, t.tolist())) for t in gathered]


GAP_PARTS = ("dp_exposed", "compute_slowed", "bubble", "meeting", "host_timed", "rest")
_MEETING = ("input_check", "loss_sum")  # HOST_PARTS where the ranks meet (blocking collectives over the mesh)
_TIMED = ("optimizer", "send_wait", "dp_launch", "threads_close")  # the other HOST_PARTS


def gap_vs_baseline(r: dict, base: dict) -> dict[str, float]:
    """Where a variant's iteration stands against the 1f1b pipeline with its DP sync hidden, from
    one rank's median call (run() takes the rank that finished last)::

        ideal          = base.t_iter - base.dp_exposed     # 1f1b's compute and bubbles, no DP wait
        gap            = r.t_iter - ideal
        dp_exposed     = r.dp_exposed                      # the DP sync the schedule did not hide
        compute_slowed = (r.fwd + r.bwd) - (base.fwd + base.bwd)   # its compute, longer beside DP
        bubble         = r.pp_wait - base.pp_wait          # waits for PP receives, more or fewer
        meeting        = the same difference of input_check + loss_sum   # the batch's check at a
                                                           #   step's start, the loss's sum and broadcast
                                                           #   at its end: where a rank waits for the
                                                           #   others (and what is queued on the links)
        host_timed     = the same of optimizer + send_wait + dp_launch + threads_close
        rest           = gap - the five above              # the untimed host time: Python between
                                                           #   the timed regions
        queued         = r.queued - base.queued            # of all of the above: the main thread
        queued_compute = r.queued_compute - base.queued_compute  # runnable, waiting for a core
        (and each HOST_PARTS' difference alone)

    Per call, t_iter = dp_exposed + pp_wait + fwd + bwd + host exactly, and host = HOST_PARTS +
    the untimed rest: every part but the rest is timed. `queued` is the machine's part, measured
    by the kernel (Linux schedstat): time this rank's main thread was ready to run but every core
    was taken (ranks and gloo's threads sharing the cores); it lies inside compute_slowed
    (queued_compute) and the other parts. The rest of compute_slowed is the same compute running
    slower on its core (caches and memory shared with the transfers) and the timing's noise (a
    call against another: schedules that overlap no more than 1f1b read tens of ms either way);
    comm_cpu (the other threads' CPU) is beside it."""
    ideal = base["t_iter"] - base["dp_exposed"]
    parts = {
        "dp_exposed": r["dp_exposed"],
        "compute_slowed": (r["fwd"] + r["bwd"]) - (base["fwd"] + base["bwd"]),
        "bubble": r["pp_wait"] - base["pp_wait"],
        "meeting": sum(r[k] - base[k] for k in _MEETING),
        "host_timed": sum(r[k] - base[k] for k in _TIMED),
    }
    gap = r["t_iter"] - ideal
    within = {k: r[k] - base[k] for k in ("queued", "queued_compute", *HOST_PARTS)}
    return {"t_iter": r["t_iter"], "ideal": ideal, "gap": gap, **parts, "rest": gap - sum(parts.values()), **within}


def tables(records: list[dict]) -> list[Table]:
    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else 1e3 * v

    rows = [
        [
            r["variant"],
            ms(r["t_iter"]),
            r["speedup_vs_1f1b"],
            ms(r["dp_exposed"]),
            ms(r["pp_wait"]),
            ms(r["fwd"]),
            ms(r["bwd"]),
            ms(r["send_latency"]),
            ms(r["recv_latency"]),
            r["deferred_chunks"],
            r["forced_chunks"],
            r["dp_chunks"],
            r["peak_mib"],
            f"{r['losses'][-1]:.6f}",
        ]
        for r in records
    ]
    c, r0 = records[0]["config"], records[0]
    title = (
        f"pipeline: GPT {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, batch {c['batch']} x "
        f"{c['seq_len']}, {c['micro_batches']} micro-batches; PP{c['pp']} x DP{c['dp']}, "
        f"{c['hosts']} host(s)"
    )
    return [
        Table(
            title,
            [
                "variant",
                "t_iter ms",
                "x 1f1b",
                "dp_exposed ms",
                "pp_wait ms",
                "fwd ms",
                "bwd ms",
                "send lat ms",
                "recv lat ms",
                "deferred/it",
                "forced/it",
                "dp chunks/it",
                "peak MiB",
                "loss (2nd step)",
            ],
            rows,
            [
                f"per iteration: medians over calls of {c['steps_per_call']} train_steps + close(), MAX over "
                "ranks; dp_exposed = main thread waiting for DP sync, pp_wait = waiting for PP receives",
                f"regime: {_regime_line(r0)}",
                f"stage DP sync {c['dp_sync_mib']:.1f} MiB: dp_alone (whole stage's sync, nothing else running) "
                f"= {ms(r0['dp_alone']):.1f} ms vs the stage's compute (1f1b fwd + bwd) "
                f"{ms(r0['stage_compute']):.1f} ms: ratio {r0['dp_to_compute']:.2f}; "
                f"pp_idle (one activation, idle link) = {ms(r0['pp_idle']):.2f} ms",
                *_preemption_lines(records),
                "send/recv lat: CommScheduler.pp_latency medians, posting to completion (a receive posted ahead "
                "includes the sender's compute)",
                f"mapping: {c['mapping']}",
            ],
        ),
        _gap_table(records),
    ]


def _gap_table(records: list[dict]) -> Table:
    """Each variant against 1f1b with its DP sync hidden (gap_vs_baseline), ms per iteration."""

    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else 1e3 * v

    rows = [
        [
            r["variant"],
            r["gap"]["rank"],
            1e3 * r["gap"]["t_iter"],
            1e3 * r["gap"]["ideal"],
            1e3 * r["gap"]["gap"],
            *(1e3 * r["gap"][k] for k in GAP_PARTS),
            ms(r["gap"]["queued"]),
            ms(r["gap"]["queued_compute"]),
            ms(r["by_rank"][r["gap"]["rank"]]["comm_cpu"]),
        ]
        for r in records
        if r["variant"] != BASELINE
    ]
    return Table(
        f"pipeline: where each schedule stands against {BASELINE} with its DP sync hidden (ms/iteration)",
        [
            "variant",
            "rank",
            "t_iter",
            "ideal",
            "gap",
            "DP exposed",
            "compute slowed",
            "bubble",
            "meeting",
            "host timed",
            "rest",
            "queued",
            "in compute",
            "comm CPU",
        ],
        rows,
        [
            f"one rank's median call (the rank that finished last; {BASELINE}'s on the same rank): ideal = "
            f"{BASELINE}'s t_iter - its DP exposed; gap = t_iter - ideal = DP exposed + compute slowed + bubble + "
            f"meeting + host timed + rest (bench.pipeline.gap_vs_baseline), each part against {BASELINE}'s",
            f"compute slowed: fwd + bwd above {BASELINE}'s (the same compute, run beside the DP sync: on CPU "
            "the transfers share the ranks' cores); bubble: PP receive waits; meeting: the batch's check at a "
            "step's start and the loss's sum and broadcast at its end, where a rank waits for the others (and "
            "for what is queued before them on the links); host timed: optimizer, the wait for PP sends, DP "
            "launches, close()'s thread ends; rest: the untimed time (Python between them)",
            f"queued: the machine's part: the main thread's time ready to run but waiting for a core (Linux "
            f"schedstat) above {BASELINE}'s, inside the columns before it; in compute: its part inside "
            "compute slowed (the rest of that is the compute running slower on its core, and noise)",
            "comm CPU: CPU time of that rank's other threads (gloo's, the DP and PP schedulers') per iteration "
            "(n/a with intra-op threads > 1: they compute too); every figure is from that rank's median call",
        ],
    )


def _regime_line(r: dict) -> str:
    c = r["config"]
    ratio = r["dp_to_compute"]
    kind = "DP-bound" if ratio > 2 else ("compute-bound" if ratio < 0.5 else "balanced")
    if c["regime"] != "balanced":
        return f"{c['regime']} sizes; this run is {kind} (dp_alone / stage compute = {ratio:.2f})"
    steps = "; ".join(
        f"batch {p['batch']}: DP sync {1e3 * p['dp_sync_s']:.0f} ms / compute "
        f"{1e3 * p['stage_compute_s']:.0f} ms = {p['ratio']:.2f}"
        for p in c["calibration"]
    )
    return (
        f"balanced: global batch {c['calibration'][0]['batch']} -> {c['batch']} from the calibration "
        f"({steps}); during the run {kind} ({ratio:.2f})"
    )


def _preemption_lines(records: list[dict]) -> list[str]:
    """AIAO vs 1F1B and the PP latency under DP with and without preemption, in words."""
    by = {r["variant"]: r for r in records}
    out = []
    for name in ("aiao-ns2", "aiao-auto"):
        if name in by:
            r, b = by[name], by[BASELINE]
            out.append(
                f"{name} vs {BASELINE}: {1e3 * r['t_iter']:.0f} vs {1e3 * b['t_iter']:.0f} ms/iteration "
                f"(x {r['speedup_vs_1f1b']:.2f}); DP exposed {1e3 * r['dp_exposed']:.0f} vs "
                f"{1e3 * b['dp_exposed']:.0f} ms"
            )
    if "aiao-ns2" in by and "aiao-ns2-nopre" in by:
        on, off = by["aiao-ns2"], by["aiao-ns2-nopre"]
        out.append(
            f"PP latency under DP (send / recv median): preemption on (aiao-ns2) "
            f"{1e3 * on['send_latency']:.1f} / {1e3 * on['recv_latency']:.1f} ms, off (aiao-ns2-nopre) "
            f"{1e3 * off['send_latency']:.1f} / {1e3 * off['recv_latency']:.1f} ms; "
            f"idle link {1e3 * on['pp_idle']:.2f} ms"
        )
    return out


_COLORS = {
    "F": "tab:blue",
    "B": "tab:green",
    "dp wait": "tab:red",
    "send": "tab:orange",
    "recv": "tab:purple",
    "recv wait": "black",
    "bucket": "tab:brown",
}


def _color(label: str) -> str:
    for key in ("dp wait", "recv wait", "bucket", "send", "recv"):
        if label.startswith(key):
            return _COLORS[key]
    return _COLORS.get(label[:1], "tab:gray")


def plot(records: list[dict], path: str, title: str) -> bool:
    """FOLD3D Fig. 4-like timelines of one traced iteration per variant: rows per rank, compute /
    PP / DP (+ close's waits)."""
    plt = pyplot()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(records), 1, figsize=(12, 2.0 + 1.6 * len(records)), squeeze=False)
    row_names = ("compute", "pp", "dp")
    for ax, r in zip(axes[:, 0], records):
        labels = []
        for rank, spans in enumerate(r["timeline"]):
            for j, row in enumerate(row_names):
                y = len(labels)
                labels.append(f"r{rank} {row}")
                for kind, label, start, stop in spans:
                    if kind == row:
                        height = 0.8 if row != "pp" else (0.4 if label in ("send", "recv") else 0.8)
                        ax.broken_barh(
                            [(1e3 * start, max(1e3 * (stop - start), 0.05))],
                            (y - 0.4, height),
                            facecolors=_color(label),
                            alpha=0.6 if row == "pp" else 0.9,
                        )
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_title(
            f"{r['variant']}: {1e3 * r['t_iter']:.0f} ms/iteration (median), traced iteration below", fontsize=8
        )
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the traced iteration's first event (one train_step + close)")
    legend = [
        Patch(color=c, label=n)
        for n, c in (
            ("forward", _COLORS["F"]),
            ("backward", _COLORS["B"]),
            ("main waits for DP", _COLORS["dp wait"]),
            ("PP send in flight", _COLORS["send"]),
            ("PP recv posted..done", _COLORS["recv"]),
            ("main waits for PP recv", _COLORS["recv wait"]),
            ("DP bucket sync (DP thread)", _COLORS["bucket"]),
        )
    ]
    fig.legend(handles=legend, loc="upper right", fontsize=7, ncol=4)
    fig.suptitle(title, fontsize=9, x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
