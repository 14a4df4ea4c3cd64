"""Suite `primitives`: the fused ops and ring collectives of Oases against their peers.

Fused cases (`oases.ops`), each timed per chunk count c in the sweep 1, 2, p, 2p, 4p:

    case                    this rank's x          weight    y           ring traffic sent
    all_gather_linear       [s/p, k]  (seq shard)  [o, k]    [s, o]      (p-1)/p * s k
    linear_reduce_scatter   [s, k]    (feat shard) [o, k]    [s/p, o]    (p-1)/p * s o
    linear_all_reduce       [s, k]    (feat shard) [o, k]    [s, o]      2 (p-1)/p * s o

    t_compute(c)  the op's GEMMs over the same row pieces, no communication
    t_comm(c)     the oases ring collective alone on the same tensor, same pieces
    t_overlap(c)  the fused op (ours)
    bound(c)      max(t_compute, t_comm);  efficiency = (t_serial - t_overlap) / (t_serial - bound)

Peers, each checked against the serial result once (allclose) before it is timed:

    serial          oases.ops.reference: torch's blocking collective, then F.linear (Megatron)
    serial_ring     the oases ring collective, blocking, then F.linear: same bytes on the wire as
                    ours, no overlap (separates the overlap from the collective's own speed;
                    gloo's reduce_scatter is an all-reduce and sends twice the bytes)
    torch_tp        parallelize_module(nn.Linear, 1-D mesh, ColwiseParallel(input_layouts=Shard(0))
                    | RowwiseParallel(output_layouts=Shard(0)) | RowwiseParallel())
    torch_symm_mem  torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter; where
                    the fused op has no kernel for the device (CPU), its own fallback path
                    (functional collective, wait, matmul) with the reason recorded
    torch_async     PyTorch alone, pipelined: the same row pieces, each piece's torch collective
                    issued with async_op=True beside the next GEMM (swept over the same chunk
                    counts; reported at its best)

Collective cases: oases.comm.ring_all_gather / ring_reduce_scatter / all_reduce against
dist.all_gather_into_tensor / reduce_scatter_tensor / all_reduce on the fused cases' tensors:
time, algorithm and bus bandwidth.

Hierarchical cases (when hosts are emulated: `oases-launch --hosts H`, or asked for by --cases):
oases.comm.hierarchical_reduce_scatter / hierarchical_all_gather / hierarchical_all_reduce (intra-
host rings, then inter-host rings) against the flat ring on the same tensor (--hier-mib MiB, the
full tensor), with oases.planner.partition's modelled times and choice for the launcher's links
(HostLinks.from_env) beside the measured winner, and the bytes each form sends through one
host's NIC, each way: flat (P-1)/P T, hierarchical (h-1)/h T (twice that for all-reduce).

Default shapes balance t_comm and t_compute at 1 Gbit/s, 2 ranks, 1 thread each, on the shared
topology (both directions of the ring share one 125 MB/s queue): see DEFAULT_SHAPES.

A fused case's record (times in seconds): the figures at the best chunk count (t_compute, t_comm,
bound, t_serial, t_overlap, efficiency, efficiency_vs_serial_ring, speedup {peer: x}), `sweep`
(the same per chunk count), `peers` {name: available, impl, t, reason, note}, the same figures
from per-rank minima under `min`, and `traced_call` (GEMM / wait / post / other time inside
profiled calls of ours at the best chunk count; the last call is in the Chrome trace).

Profiler ranges read (bench._trace.RING_RANGES, through torch.profiler; the library is not
patched): `oases::gemm` (ops.gemm.linear_into; linear_reduce_scatter's per-piece GEMM) -> "gemm",
`oases::ring::post` -> "post", `oases::ring::wait` -> "wait".
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import _metrics, _peers
from bench._peers import Peer
from bench._report import Panel, Table, plot_panels
from bench._trace import OP, RING_RANGES, profiled
from oases import comm, ops
from oases.comm.hierarchical import UNSHAPED_BYTES_PER_S
from oases.ops import gemm
from oases.planner import partition

FUSED = ("all_gather_linear", "linear_reduce_scatter", "linear_all_reduce")
COLLECTIVES = ("ring_all_gather", "ring_reduce_scatter", "all_reduce")
HIERARCHICAL = {
    "hierarchical_reduce_scatter": "reduce_scatter",
    "hierarchical_all_gather": "all_gather",
    "hierarchical_all_reduce": "all_reduce",
}
ALL_CASES = FUSED + COLLECTIVES + tuple(HIERARCHICAL)
# (s, k, o) per case; see the module docstring for what each means. Every case sends 4 MiB per
# rank (fp32) and does 2 * 2048 * 1024 * 1280 GEMM flops per rank. Measured on this 2-core Xeon,
# 1 thread per rank, both ranks busy: ~92 GFLOP/s per rank, so t_compute ≈ 58 ms, and at 1gbit
# shared the ring moves both ranks' 4 MiB in t_comm ≈ 60 ms.
DEFAULT_SHAPES = {
    "all_gather_linear": (2048, 1024, 1280),
    "linear_reduce_scatter": (2048, 1280, 1024),
    "linear_all_reduce": (2048, 2560, 512),
}
QUICK_SHAPES = {name: (64, 32, 32) for name in FUSED}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4)}
LOW_PRECISION_TOLERANCE = dict(rtol=3e-2, atol=6e-2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated cases (default: all; the hierarchical ones only when hosts are "
        "emulated, GROUP_WORLD_SIZE > 1): " + ", ".join(ALL_CASES),
    )
    parser.add_argument(
        "--hier-mib",
        type=float,
        default=None,
        help="full tensor of the hierarchical cases, MiB (default: 4; --quick: 1/16)",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="CASE=SxKxO",
        help="override a fused case's shape (its collective uses the same tensors)",
    )
    parser.add_argument("--chunks", help="comma-separated chunk counts instead of the sweep 1,2,p,2p,4p")
    parser.add_argument("--bidirectional", action="store_true", help="run the rings with bidirectional=True")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


# ---------------------------------------------------------------------------------------------
# Building the cases


@dataclass
class FusedCase:
    name: str
    shapes: dict[str, list[int]]
    divides: int  # chunk counts must divide this (rows per piece group)
    sent_bytes: int  # bytes this rank sends per call
    flops: int  # GEMM flops per rank per call
    ours: Callable[[int], Callable[[], torch.Tensor]]
    compute: Callable[[int], Callable[[], object]]
    comm: Callable[[int], Callable[[], object]]
    default_chunks: int
    async_pipelined: Callable[[int], Callable[[], torch.Tensor]]  # the torch_async peer per chunk count
    peers: dict[str, Peer] = field(default_factory=dict)
    collective: Optional["CollectiveCase"] = None


@dataclass
class CollectiveCase:
    name: str
    collective: str  # all_gather | reduce_scatter | all_reduce (bus bandwidth factor)
    shapes: dict[str, list[int]]
    nbytes: int  # the full tensor
    ours: Callable[[], torch.Tensor]
    torch_impl: str
    theirs: Callable[[], torch.Tensor]
    check: Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _randn(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def _row_pieces(rows: int, chunks: int, bidirectional: bool) -> list[slice]:
    """The pieces the ring schedules cut `rows` into: `chunks` pieces, halved when bidirectional."""
    m = rows // chunks
    pieces = []
    for k in range(chunks):
        if bidirectional and m >= 2:
            pieces += [slice(k * m, k * m + m // 2), slice(k * m + m // 2, (k + 1) * m)]
        else:
            pieces.append(slice(k * m, (k + 1) * m))
    return pieces


class _Env:
    """What every case builder needs: rank, world, device, dtype, the mesh (lazily), options."""

    def __init__(self, ctx, args) -> None:
        self.ctx = ctx
        self.p, self.r = ctx.world_size, ctx.rank
        self.device, self.dtype = ctx.device, DTYPES[args.dtype]
        self.bidirectional = args.bidirectional
        self.group_name = dist.group.WORLD.group_name
        self._mesh = None

    def to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.p,))
        return self._mesh


def _all_gather_linear(env: _Env, shape: tuple[int, int, int]) -> FusedCase:
    s, k, o = shape
    p, r, bi = env.p, env.r, env.bidirectional
    n = s // p
    x_full = env.to(_randn((s, k), 1))  # [s, k]
    w_full = env.to(_randn((p * o, k), 2, 1 / math.sqrt(k)))  # [p o, k], rank r holds rows r*o..
    x, w = x_full[r * n : (r + 1) * n].contiguous(), w_full[r * o : (r + 1) * o].contiguous()

    def compute(c: int) -> Callable[[], torch.Tensor]:
        pieces = [slice(b * n + q.start, b * n + q.stop) for b in range(p) for q in _row_pieces(n, c, bi)]
        return lambda: _linear_pieces(x_full, w, pieces)

    case = FusedCase(
        "all_gather_linear",
        {"x": [n, k], "weight": [o, k], "y": [s, o]},
        n,
        (p - 1) * n * k * x.element_size(),
        2 * s * k * o,
        ours=lambda c: lambda: ops.all_gather_linear(x, w, chunks=c, bidirectional=bi),
        compute=compute,
        comm=lambda c: lambda: comm.ring_all_gather(x, chunks=c, bidirectional=bi),
        default_chunks=gemm.default_chunks(n, 1),
        async_pipelined=lambda c: _peers.all_gather_linear_async(x, w, p, r, c),
    )
    case.peers = {
        "serial": Peer(
            "oases.ops.reference.all_gather_linear (dist.all_gather_into_tensor, then F.linear)",
            lambda: ops.reference.all_gather_linear(x, w),
        ),
        "serial_ring": Peer(
            "oases.comm.ring_all_gather (blocking), then F.linear",
            lambda: F.linear(comm.ring_all_gather(x, bidirectional=bi), w),
        ),
        "torch_tp": _peers.torch_tp("colwise_shard0", w_full, x, env.mesh),
        "torch_symm_mem": _peers.torch_symm_mem("fused_all_gather_matmul", x, w, env.group_name),
    }
    gathered = x_full.new_empty((s, k))
    case.collective = CollectiveCase(
        "ring_all_gather",
        "all_gather",
        {"x": [n, k], "out": [s, k]},
        s * k * x.element_size(),
        ours=lambda: comm.ring_all_gather(x, bidirectional=bi),
        torch_impl="dist.all_gather_into_tensor",
        theirs=lambda: dist.all_gather_into_tensor(gathered, x),
        check=lambda: (comm.ring_all_gather(x, bidirectional=bi), _peers.torch_all_gather(x)),
    )
    return case


def _linear_pieces(x: torch.Tensor, w: torch.Tensor, pieces: list[slice]) -> torch.Tensor:
    """y = x @ w.T computed piece by piece into a fresh y, as the ops do (allocation included)."""
    y = x.new_empty((x.shape[0], w.shape[0]))
    for rows in pieces:
        gemm.linear_into(x[rows], w, None, y[rows])
    return y


def _feature_sharded(env: _Env, shape: tuple[int, int, int], seed: int):
    """x [s, k] and weight [o, k]: this rank's slice of the input features of x_full, w_full."""
    s, k, o = shape
    p, r = env.p, env.r
    x_full = env.to(_randn((s, p * k), seed))  # [s, p k]
    w_full = env.to(_randn((o, p * k), seed + 1, 1 / math.sqrt(p * k)))  # [o, p k]
    x = x_full[:, r * k : (r + 1) * k].contiguous()
    w = w_full[:, r * k : (r + 1) * k].contiguous()
    return x, w, w_full


def _linear_reduce_scatter(env: _Env, shape: tuple[int, int, int]) -> FusedCase:
    s, k, o = shape
    p, bi = env.p, env.bidirectional
    n = s // p
    x, w, w_full = _feature_sharded(env, shape, 11)
    partial = F.linear(x, w)  # [s, o]: what the ring reduces

    def compute(c: int) -> Callable[[], None]:
        pieces = [slice(b * n + q.start, b * n + q.stop) for b in range(p) for q in _row_pieces(n, c, bi)]
        return lambda: [F.linear(x[q], w) for q in pieces]  # as the op produces each partial

    case = FusedCase(
        "linear_reduce_scatter",
        {"x": [s, k], "weight": [o, k], "y": [n, o]},
        n,
        (p - 1) * n * o * x.element_size(),
        2 * s * k * o,
        ours=lambda c: lambda: ops.linear_reduce_scatter(x, w, chunks=c, bidirectional=bi),
        compute=compute,
        comm=lambda c: lambda: comm.ring_reduce_scatter(partial, chunks=c, bidirectional=bi),
        default_chunks=gemm.default_chunks(n, 1),
        async_pipelined=lambda c: _peers.linear_reduce_scatter_async(x, w, p, c),
    )
    case.peers = {
        "serial": Peer(
            "oases.ops.reference.linear_reduce_scatter (F.linear, then dist.reduce_scatter_tensor)",
            lambda: ops.reference.linear_reduce_scatter(x, w),
        ),
        "serial_ring": Peer(
            "F.linear, then oases.comm.ring_reduce_scatter (blocking)",
            lambda: comm.ring_reduce_scatter(F.linear(x, w), bidirectional=bi),
        ),
        "torch_tp": _peers.torch_tp("rowwise_shard0", w_full, x, env.mesh),
        "torch_symm_mem": _peers.torch_symm_mem("fused_matmul_reduce_scatter", x, w, env.group_name),
    }
    scattered = partial.new_empty((n, o))
    case.collective = CollectiveCase(
        "ring_reduce_scatter",
        "reduce_scatter",
        {"t": [s, o], "out": [n, o]},
        s * o * x.element_size(),
        ours=lambda: comm.ring_reduce_scatter(partial, bidirectional=bi),
        torch_impl="dist.reduce_scatter_tensor",
        theirs=lambda: dist.reduce_scatter_tensor(scattered, partial),
        check=lambda: (comm.ring_reduce_scatter(partial, bidirectional=bi), _peers.torch_reduce_scatter(partial)),
    )
    return case


def _linear_all_reduce(env: _Env, shape: tuple[int, int, int]) -> FusedCase:
    s, k, o = shape
    p, bi = env.p, env.bidirectional
    x, w, w_full = _feature_sharded(env, shape, 21)
    zeros_ours, zeros_theirs = x.new_zeros((s, o)), x.new_zeros((s, o))  # sums stay 0 when repeated

    def compute_pieces(c: int) -> list[slice]:
        return [slice(q * s // c, (q + 1) * s // c) for q in range(c)]

    def compute(c: int) -> Callable[[], torch.Tensor]:
        pieces = compute_pieces(c)
        return lambda: _linear_pieces(x, w, pieces)

    case = FusedCase(
        "linear_all_reduce",
        {"x": [s, k], "weight": [o, k], "y": [s, o]},
        s,
        2 * (p - 1) * (s // p) * o * x.element_size(),
        2 * s * k * o,
        ours=lambda c: lambda: ops.linear_all_reduce(x, w, chunks=c),
        compute=compute,
        # linear_all_reduce uses the backend's all-reduce, piece by piece: time the same.
        comm=lambda c: lambda: [dist.all_reduce(zeros_ours[r]) for r in compute_pieces(c)],
        default_chunks=2 if s >= 128 else 1,
        async_pipelined=lambda c: _peers.linear_all_reduce_async(x, w, c),
    )
    case.peers = {
        "serial": Peer(
            "oases.ops.reference.linear_all_reduce (F.linear, then dist.all_reduce)",
            lambda: ops.reference.linear_all_reduce(x, w),
        ),
        "serial_ring": Peer(
            "F.linear, then oases.comm.all_reduce (blocking)", lambda: comm.all_reduce(F.linear(x, w), bidirectional=bi)
        ),
        "torch_tp": _peers.torch_tp("rowwise", w_full, x, env.mesh),
        "torch_symm_mem": Peer(
            "torch.distributed._symmetric_memory",
            None,
            "torch.distributed._symmetric_memory has no fused matmul + all-reduce op",
        ),
    }
    case.collective = CollectiveCase(
        "all_reduce",
        "all_reduce",
        {"t": [s, o]},
        s * o * x.element_size(),
        ours=lambda: comm.all_reduce(zeros_ours, bidirectional=bi),
        torch_impl="dist.all_reduce",
        theirs=lambda: dist.all_reduce(zeros_theirs),
        check=lambda: (comm.all_reduce(F.linear(x, w), bidirectional=bi), _peers.torch_all_reduce(F.linear(x, w))),
    )
    return case


BUILDERS = {
    "all_gather_linear": _all_gather_linear,
    "linear_reduce_scatter": _linear_reduce_scatter,
    "linear_all_reduce": _linear_all_reduce,
}
COLLECTIVE_OF = {
    "ring_all_gather": "all_gather_linear",
    "ring_reduce_scatter": "linear_reduce_scatter",
    "all_reduce": "linear_all_reduce",
}


# ---------------------------------------------------------------------------------------------
# Running


def _hosts_emulated() -> bool:
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def _parse_cases(args) -> list[str]:
    if args.cases is None:
        return list(ALL_CASES if _hosts_emulated() else FUSED + COLLECTIVES)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(ALL_CASES))
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; choose from {', '.join(ALL_CASES)}")
    return cases


def _shapes(args) -> dict[str, tuple[int, int, int]]:
    shapes = dict(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    for spec in args.shape:
        name, _, dims = spec.partition("=")
        try:
            s, k, o = (int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shape {spec!r}: expected CASE=SxKxO, e.g. all_gather_linear=2048x1024x2048")
        if name not in shapes:
            raise SystemExit(f"--shape {spec!r}: unknown case {name!r}")
        shapes[name] = (s, k, o)
    return shapes


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)


def _check(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = _peers.materialize(got), _peers.materialize(want)
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), **_tolerance(dtype)):
        err = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(
            f"{what}: result differs from the serial reference "
            f"(shape {tuple(got.shape)} vs {tuple(want.shape)}, max abs err {err})"
        )


def run(args, ctx) -> list[dict]:
    env = _Env(ctx, args)
    cases = _parse_cases(args)
    shapes = _shapes(args)
    wanted_fused = [c for c in FUSED if c in cases]
    needed = set(wanted_fused) | {COLLECTIVE_OF[c] for c in cases if c in COLLECTIVE_OF}
    builds = {name: BUILDERS[name](env, shapes[name]) for name in FUSED if name in needed}
    records = []
    for name in wanted_fused:
        records.append(_run_fused(env, builds[name], args))
    for name in COLLECTIVES:
        if name in cases:
            records.append(_run_collective(env, builds[COLLECTIVE_OF[name]].collective))
    wanted_hierarchical = [c for c in HIERARCHICAL if c in cases]
    if wanted_hierarchical:
        hosts = comm.HostGroups.from_env()  # collective: every rank runs the same cases
        for name in wanted_hierarchical:
            records.append(_run_hierarchical(env, name, hosts, args))
    return records


def _sweep(case: FusedCase, args, p: int) -> list[int]:
    if args.chunks:
        asked = [int(c) for c in args.chunks.split(",")]
        return sorted({c for c in asked if c >= 1 and case.divides % c == 0}) or [1]
    return _metrics.chunk_counts(p, case.divides)


def _run_fused(env: _Env, case: FusedCase, args) -> dict:
    ctx, dtype = env.ctx, env.dtype
    chunk_counts = _sweep(case, args, env.p)
    want = case.peers["serial"].fn()
    for c in chunk_counts:
        _check(f"{case.name} chunks={c}", case.ours(c)(), want, dtype)
    for peer_name, peer in case.peers.items():
        if peer.fn is not None:
            _check(f"{case.name} peer {peer_name}", peer.fn(), want, dtype)
    for c in chunk_counts:
        _check(f"{case.name} peer torch_async chunks={c}", case.async_pipelined(c)(), want, dtype)
    del want

    fns: dict[str, Callable[[], object]] = {}
    for peer_name, peer in case.peers.items():
        if peer.fn is not None:
            fns[peer_name] = peer.fn
    for c in chunk_counts:
        fns[f"compute/{c}"], fns[f"comm/{c}"], fns[f"overlap/{c}"] = case.compute(c), case.comm(c), case.ours(c)
        fns[f"async/{c}"] = case.async_pipelined(c)
    timings = ctx.timer.measure(fns)
    median = _figures({name: v.median for name, v in timings.items()}, chunk_counts, case.peers)
    fastest = _figures({name: v.min for name, v in timings.items()}, chunk_counts, case.peers)
    peers = {
        name: {
            "available": peer.fn is not None,
            "impl": peer.impl,
            "t": median["peer_t"][name],
            "reason": peer.reason,
            "note": peer.note,
        }
        for name, peer in case.peers.items()
    }
    peers["torch_async"] = {
        "available": True,
        "impl": _peers.TORCH_ASYNC_IMPL[case.name],
        "t": median["peer_t"]["torch_async"],
        "reason": None,
        "note": f"at its best chunk count of the sweep: {median['torch_async_chunks']}",
    }
    del median["peer_t"]
    return {
        "case": case.name,
        "kind": "fused",
        "dtype": str(dtype).replace("torch.", ""),
        "shapes": case.shapes,
        "bidirectional": env.bidirectional,
        "sent_bytes_per_rank": case.sent_bytes,
        "gemm_flops_per_rank": case.flops,
        "chunks_swept": chunk_counts,
        "default_chunks": case.default_chunks,
        **median,
        "peers": peers,
        "min": fastest,
        "traced_call": _traced_call(env, case, median["best_chunks"], 1 if args.quick else 5),
    }


def _figures(t: dict[str, float], chunk_counts: list[int], peers: dict[str, Peer]) -> dict:
    """Every figure of a fused case from one statistic of its timings (seconds per variant)."""
    t_serial = t["serial"]
    sweep = []
    for c in chunk_counts:
        compute, comm_, overlap = t[f"compute/{c}"], t[f"comm/{c}"], t[f"overlap/{c}"]
        b = _metrics.bound(compute, comm_)
        sweep.append(
            {
                "chunks": c,
                "t_compute": compute,
                "t_comm": comm_,
                "t_overlap": overlap,
                "bound": b,
                "efficiency": _metrics.efficiency(t_serial, overlap, b),
                "speedup_vs_serial": _metrics.speedup(t_serial, overlap),
                "t_torch_async": t[f"async/{c}"],
            }
        )
    best = min(sweep, key=lambda row: row["t_overlap"])
    async_chunks = min(chunk_counts, key=lambda c: t[f"async/{c}"])
    t = {**t, "torch_async": t[f"async/{async_chunks}"]}
    names = [*peers, "torch_async"]
    return {
        "best_chunks": best["chunks"],
        "t_compute": best["t_compute"],
        "t_comm": best["t_comm"],
        "t_serial": t_serial,
        "t_overlap": best["t_overlap"],
        "bound": best["bound"],
        "efficiency": best["efficiency"],
        "efficiency_vs_serial_ring": _metrics.efficiency(t["serial_ring"], best["t_overlap"], best["bound"]),
        "speedup": {name: _metrics.speedup(t.get(name), best["t_overlap"]) for name in names},
        "peer_t": {name: t.get(name) for name in names},
        "torch_async_chunks": async_chunks,
        "sweep": sweep,
    }


def _traced_call(env: _Env, case: FusedCase, chunks: int, calls: int) -> dict:
    """Profiled calls of ours (bench._trace.RING_RANGES: the library's oases::gemm,
    oases::ring::post and oases::ring::wait ranges): the last one stays in ctx.trace; per-call
    GEMM, wait and post totals, median over the calls, then MAX over ranks.

    gemm_s against t_compute shows how much the GEMMs slow down while communication runs beside
    them (shared cores and memory); wait_s is the communication left exposed; post_s the time the
    calling thread spends handing messages to the backend; other_s = call_s - the three (copies,
    allocation, adds, Python). On CUDA gemm and post are their kernels' device time, which can
    overlap: other_s may then be negative. The profiler adds a few microseconds to each op in
    the calls (visible on --quick's tiny shapes); the timed figures run without it.
    """
    ctx = env.ctx
    first = len(ctx.trace.events)
    with profiled(ctx.trace, RING_RANGES) as span:
        for _ in range(calls):
            ctx.sync()
            dist.barrier()
            with span(f"{case.name} chunks={chunks}", OP):
                case.ours(chunks)()
    events = ctx.trace.events[first:]
    per_call, last = [], []
    for op in (e for e in events if e["tid"] == OP):  # the calls, in order
        inside = [e for e in events if e["tid"] != OP and op["ts"] <= e["ts"] <= op["ts"] + op["dur"]]
        parts = [sum(e["dur"] for e in inside if e["name"] == name) / 1e6 for name in ("gemm", "wait", "post")]
        whole = op["dur"] / 1e6
        per_call.append([*parts, whole, whole - sum(parts)])
        last = [op, *inside]
    ctx.trace.events[first:] = last
    medians = torch.tensor(per_call, dtype=torch.float64).median(dim=0).values
    totals = ctx.timer.max_over_ranks(medians.contiguous())
    return {
        "chunks": chunks,
        "calls": calls,
        "gemm_s": float(totals[0]),
        "wait_s": float(totals[1]),
        "post_s": float(totals[2]),
        "call_s": float(totals[3]),
        "other_s": float(totals[4]),
        "ranges": list(RING_RANGES),
    }


def _run_collective(env: _Env, case: CollectiveCase) -> dict:
    ours, theirs = case.check()
    _check(case.name, ours, theirs, env.dtype)
    timings = env.ctx.timer.measure({"ours": case.ours, "torch": case.theirs})
    t = {name: v.median for name, v in timings.items()}
    p = env.p
    return {
        "case": case.name,
        "kind": "collective",
        "collective": case.collective,
        "dtype": str(env.dtype).replace("torch.", ""),
        "shapes": case.shapes,
        "bytes": case.nbytes,
        "bidirectional": env.bidirectional,
        "torch_impl": case.torch_impl,
        "t_ours": t["ours"],
        "t_torch": t["torch"],
        "algbw_ours": case.nbytes / t["ours"],
        "algbw_torch": case.nbytes / t["torch"],
        "busbw_ours": _metrics.bus_bandwidth(case.collective, case.nbytes, t["ours"], p),
        "busbw_torch": _metrics.bus_bandwidth(case.collective, case.nbytes, t["torch"], p),
        "speedup_vs_torch": _metrics.speedup(t["torch"], t["ours"]),
        "min": {"t_ours": timings["ours"].min, "t_torch": timings["torch"].min},
    }


def _run_hierarchical(env: _Env, name: str, hosts: comm.HostGroups, args) -> dict:
    """Flat ring against the two-level form on one tensor of T bytes, with the planner's
    prediction for the launcher's links (see the module docstring)."""
    kind, p = HIERARCHICAL[name], env.p
    mib = args.hier_mib if args.hier_mib is not None else (1 / 16 if args.quick else 4.0)
    elem = torch.empty((), dtype=env.dtype).element_size()
    cols = 256
    rows = max(1, round(mib * 2**20 / (elem * cols * p))) * p  # full tensor [rows, cols], rows % p == 0
    full = env.to(_randn((rows, cols), 31 + env.r))  # RS input / AR tensor: T bytes
    shard = full[: rows // p].contiguous()  # AG input: T / p bytes
    nbytes = full.numel() * elem
    if kind == "reduce_scatter":
        flat, hier = (lambda: comm.ring_reduce_scatter(full)), (lambda: comm.hierarchical_reduce_scatter(full, hosts))
    elif kind == "all_gather":
        flat, hier = (lambda: comm.ring_all_gather(shard)), (lambda: comm.hierarchical_all_gather(shard, hosts))
    else:  # in place on zeros: repeated calls keep the values
        zeros_flat, zeros_hier = torch.zeros_like(full), torch.zeros_like(full)
        flat = lambda: comm.all_reduce(zeros_flat)  # noqa: E731
        hier = lambda: comm.hierarchical_all_reduce(zeros_hier, hosts)  # noqa: E731
    if kind == "all_reduce":
        _check(name, comm.hierarchical_all_reduce(full.clone(), hosts), comm.all_reduce(full.clone()), env.dtype)
    else:
        _check(name, hier(), flat(), env.dtype)
    timings = env.ctx.timer.measure({"flat": flat, "hierarchical": hier})
    links = comm.HostLinks.from_env()
    h, k = hosts.hosts, hosts.ranks_per_host
    predicted = partition(kind, nbytes, k, h, links.intra, links.inter)
    t = {form: v.median for form, v in timings.items()}
    passes = 2 if kind == "all_reduce" else 1
    return {
        "case": name,
        "kind": "hierarchical",
        "collective": kind,
        "dtype": str(env.dtype).replace("torch.", ""),
        "bytes": nbytes,
        "hosts": h,
        "ranks_per_host": k,
        "links": {
            "intra_bytes_per_s": links.intra.bytes_per_s,
            "inter_bytes_per_s": links.inter.bytes_per_s,
            "latency_s": links.inter.latency_s,
        },
        "nic_bytes_per_host": {"flat": passes * (p - 1) / p * nbytes, "hierarchical": passes * (h - 1) / h * nbytes},
        "t_flat": t["flat"],
        "t_hierarchical": t["hierarchical"],
        "speedup_hierarchical": _metrics.speedup(t["flat"], t["hierarchical"]),
        "measured_winner": "hierarchical" if t["hierarchical"] < t["flat"] else "flat",
        "predicted": {"choice": predicted.choice, **{f"{f}_s": v for f, v in predicted.seconds.items()}},
        "min": {"t_flat": timings["flat"].min, "t_hierarchical": timings["hierarchical"].min},
    }


# ---------------------------------------------------------------------------------------------
# Reporting

PEER_COLUMNS = ("serial", "serial_ring", "torch_tp", "torch_symm_mem", "torch_async")


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def _fused_table(title: str, fused: list[dict], figures: Callable[[dict], dict], traced: bool) -> Table:
    columns = [
        "case",
        "chunks",
        "t_compute",
        "t_comm",
        "bound",
        "t_serial",
        "t_overlap",
        "efficiency",
        *(f"x {p}" for p in PEER_COLUMNS),
    ]
    notes = ["efficiency = (t_serial - t_overlap) / (t_serial - bound); x peer = t_peer / t_overlap"]
    if traced:
        columns += ["gemm|ovl", "wait|ovl", "post|ovl", "other|ovl"]
        notes.append(
            "gemm|ovl, wait|ovl, post|ovl, other|ovl: where an instrumented call of ours spends its "
            "time (GEMMs, waits, message posts, the rest; median over calls, MAX over ranks)"
        )
    rows = []
    for r in fused:
        f = figures(r)
        row = [
            r["case"],
            f["best_chunks"],
            _ms(f["t_compute"]),
            _ms(f["t_comm"]),
            _ms(f["bound"]),
            _ms(f["t_serial"]),
            _ms(f["t_overlap"]),
            f["efficiency"],
            *(f["speedup"][p] for p in PEER_COLUMNS),
        ]
        if traced:
            tc = r["traced_call"]
            row += [_ms(tc["gemm_s"]), _ms(tc["wait_s"]), _ms(tc["post_s"]), _ms(tc["other_s"])]
        rows.append(row)
    return Table(title, columns, rows, notes)


def _peer_note(case: str, name: str, peer: dict) -> str:
    return f"{case} {name}: " + (f"n/a: {peer['reason']}" if peer["reason"] else peer["note"])


def tables(records: list[dict]) -> list[Table]:
    fused = [r for r in records if r["kind"] == "fused"]
    collectives = [r for r in records if r["kind"] == "collective"]
    out = []
    if fused:
        out.append(
            _fused_table(
                "fused ops at the best chunk count (ms; MAX over ranks of per-rank medians)",
                fused,
                lambda r: r,
                traced=True,
            )
        )
        out.append(
            _fused_table(
                "the same run, per-rank minimum instead of median (least disturbed call)",
                fused,
                lambda r: r["min"],
                traced=False,
            )
        )
        out.append(
            Table(
                "peers (ms)",
                ["case", *PEER_COLUMNS, "ours"],
                [[r["case"], *(_ms(r["peers"][p]["t"]) for p in PEER_COLUMNS), _ms(r["t_overlap"])] for r in fused],
                [
                    _peer_note(r["case"], p, r["peers"][p])
                    for r in fused
                    for p in PEER_COLUMNS
                    if r["peers"][p]["reason"] or r["peers"][p]["note"]
                ],
            )
        )
        out.append(
            Table(
                "chunk sweep (ms)",
                [
                    "case",
                    "chunks",
                    "t_compute",
                    "t_comm",
                    "bound",
                    "t_overlap",
                    "efficiency",
                    "x serial",
                    "torch_async",
                ],
                [
                    [
                        r["case"],
                        row["chunks"],
                        _ms(row["t_compute"]),
                        _ms(row["t_comm"]),
                        _ms(row["bound"]),
                        _ms(row["t_overlap"]),
                        row["efficiency"],
                        row["speedup_vs_serial"],
                        _ms(row["t_torch_async"]),
                    ]
                    for r in fused
                    for row in r["sweep"]
                ],
            )
        )
    if collectives:
        out.append(
            Table(
                "collectives (ms; bus bandwidth MB/s)",
                ["case", "MiB", "t_ours", "t_torch", "busbw_ours", "busbw_torch", "x torch", "min ours", "min torch"],
                [
                    [
                        r["case"],
                        r["bytes"] / 2**20,
                        _ms(r["t_ours"]),
                        _ms(r["t_torch"]),
                        r["busbw_ours"] / 1e6,
                        r["busbw_torch"] / 1e6,
                        r["speedup_vs_torch"],
                        _ms(r["min"]["t_ours"]),
                        _ms(r["min"]["t_torch"]),
                    ]
                    for r in collectives
                ],
                [f"{r['case']}: torch = {r['torch_impl']}" for r in collectives],
            )
        )
    hierarchical = [r for r in records if r["kind"] == "hierarchical"]
    if hierarchical:
        out.append(
            Table(
                "hierarchical vs flat ring (ms; model: oases.planner.partition on the launcher's links)",
                [
                    "case",
                    "hosts x k",
                    "MiB",
                    "t_flat",
                    "t_hier",
                    "x hier",
                    "model flat",
                    "model hier",
                    "predicted",
                    "measured",
                    "NIC MiB flat",
                    "NIC MiB hier",
                ],
                [
                    [
                        r["case"],
                        f"{r['hosts']}x{r['ranks_per_host']}",
                        r["bytes"] / 2**20,
                        _ms(r["t_flat"]),
                        _ms(r["t_hierarchical"]),
                        r["speedup_hierarchical"],
                        _ms(r["predicted"]["flat_s"]),
                        _ms(r["predicted"]["hierarchical_s"]),
                        r["predicted"]["choice"],
                        r["measured_winner"],
                        r["nic_bytes_per_host"]["flat"] / 2**20,
                        r["nic_bytes_per_host"]["hierarchical"] / 2**20,
                    ]
                    for r in hierarchical
                ],
                [
                    f"links: inter {hierarchical[0]['links']['inter_bytes_per_s'] / 1e6:.1f} MB/s per host NIC, intra "
                    f"{hierarchical[0]['links']['intra_bytes_per_s'] / 1e6:.1f} MB/s (unshaped: the assumed "
                    f"{UNSHAPED_BYTES_PER_S / 1e6:.0f} MB/s); x hier = t_flat / t_hier; "
                    "NIC MiB: bytes through one host's NIC, each way"
                ],
            )
        )
    return out


def plot(records: list[dict], path: str, title: str) -> bool:
    panels = []
    for r in records:
        if r["kind"] != "fused":
            continue
        panels.append(
            Panel(
                title=f"{r['case']} {r['shapes']['x']}x{r['shapes']['weight']}",
                chunks=[row["chunks"] for row in r["sweep"]],
                curves={
                    "t_overlap (ours)": [row["t_overlap"] for row in r["sweep"]],
                    "torch_async": [row["t_torch_async"] for row in r["sweep"]],
                },
                levels={
                    "t_serial": r["t_serial"],
                    "t_compute": r["t_compute"],
                    "t_comm": r["t_comm"],
                    "bound": r["bound"],
                    "torch_tp": r["peers"]["torch_tp"]["t"],
                    "serial_ring": r["peers"]["serial_ring"]["t"],
                },
                best=r["best_chunks"],
            )
        )
    return plot_panels(panels, path, title)
