"""One-GPU micro-benchmarks: the ceilings and the pieces the overlap schedules are built from.

    python -m bench.cuda_micro --out DIR [--quick] [--sections a,b] [--watchdog S] [--no-plots]

Single process, `cuda:0`; exits 2 (nothing measured) when torch.cuda.is_available() is False.
Writes DIR/cuda_micro.json (GPU, versions, every section's tables and its error, if any) and
DIR/cuda_micro.md (the tables), both rewritten after every section (and every case of the long
ones), so a run cut short still leaves what it measured; at the end, the PNG plots of
bench.cuda_plots beside them. Every section runs inside its own
try/except: a failure is recorded (traceback in the JSON) and the next section runs. Sections
have soft time budgets (checked between cases; what was skipped is noted), and a watchdog
(faulthandler) dumps every thread's stack and exits after --watchdog seconds, so nothing hangs.

Method: random data (never zeros); GEMMs for ~0.5 s before anything is timed (working clocks);
warm-up calls first; medians of repeats. GPU times come from CUDA events around each call, the
variants of one comparison run round-robin (a, b, a, b, ...) with no host synchronisation
between calls (the queue stays full: the GPU's time is what is timed, unless issuing is slower
than running, which then shows). Where one call's inputs fit in L2, k input sets are rotated
(call i reads set i % k; k sets hold > 3x L2) so every call reads its operands from HBM.

    ceilings          device-to-device copy of 2 GiB (GB/s counting read + write bytes); bf16
                      8192^3 torch.mm (TFLOP/s); pinned host -> device and device -> host of
                      256 MiB (GB/s). Section batched_copies divides by the pinned ones.
    chunked_gemm      the four GEMMs of a Llama-7B (h 4096, ffn 11008) and a Llama-13B (h 5120,
                      ffn 13824) layer under TP tp in (2, 4, 8), T in (4096, 8192) token rows,
                      bf16, y = x @ W.T:
                          qkv      [T, h]      x [3h/tp, h]        attn_out [T, h/tp]   x [h, h/tp]
                          gate_up  [T, h]      x [2 ffn/tp, h]     down     [T, ffn/tp] x [h, ffn/tp]
                      rows split into c in (1, 2, 4, 8, 16) chunks, chunk i computed as
                      torch.matmul(x[rows_i], W.T, out=y[rows_i]) into one preallocated y;
                      efficiency(c) = t(c = 1) / t(c) (1.0: chunking costs nothing). Tables:
                      per GEMM; per layer (sum of the four GEMMs' medians); geometric mean over
                      all GEMM shapes per c. Every chunked result is checked against the
                      unchunked one (rel_err) after y was filled with NaN. host_bound lists the
                      c whose host issue time reached 0.8x their GPU time (eager launch cost).
    triton_vs_cublas  oases_kernels on Llama-7B shapes, T = 8192, tp in (2, 8), bf16 (+ one fp16
                      case): linear_into (out[T:2T] = x @ W.T, the column-parallel GEMMs) against
                      torch.matmul(x, W.T, out=out[T:2T]); linear_accumulate (out = x @ W.T + acc,
                      acc fp32, out bf16; the row-parallel GEMMs) against
                      torch.add(acc, torch.mm(x, W.T), out=out) (and torch.addmm with acc cast
                      to bf16: ratio_addmm). ratio = t_torch / t_triton (target >= 0.9);
                      rel_err = ||out - ref|| / ||ref|| over the first 256 rows, ref in float64
                      on the GPU; warmup_s = the first call (autotuning over the kernel's
                      configs, and compiling them for the first case of a kernel and dtype).
    batched_copies    oases.offload.CopyEngine (one copy_out / copy_in call for n tensors, a
                      pinned HostSlab) against per-tensor t.to(..., non_blocking=True) and
                      per-tensor copy_ into preallocated pinned tensors; n in (16, 64, 256)
                      fp32 tensors of 16 KiB .. 16 MiB (at most 2 GiB a batch); D2H and H2D.
                      Timed on the host: synchronize; perf_counter; the batch; synchronize (issue
                      overhead included, which is the point). GB/s = n size / t; x_to, x_copy =
                      t_peer / t_engine; of_ceiling = engine GB/s / section ceilings' pinned GB/s.
    stream_priority   latency (host perf_counter, issue -> event.synchronize()) of a small op
                      (an add of 1024 floats; an H2D copy of 64 KiB) issued on a priority -1
                      stream while a priority-0 stream runs ~50 ms of bf16 GEMMs, at random
                      points of that queue, against the same op on a second priority-0 stream
                      (and on an idle GPU); median and p90 over the trials.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

EXIT_NO_GPU = 2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "bench", "results")
JSON_NAME, MD_NAME = "cuda_micro.json", "cuda_micro.md"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_L2_BYTES = 50 * MIB  # when the device properties do not say


# ---- what a section produces ------------------------------------------------------------------------


@dataclass
class Table:
    """One table: `rows` are dicts; `columns` the keys shown, in order (rows may carry more keys,
    which only the JSON has)."""

    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class Section:
    name: str
    tables: list[Table] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # section-level facts (paths, ranges, checks)
    headline: str = ""  # one line for the final summary
    error: Optional[str] = None  # the traceback, when the section raised
    seconds: Optional[float] = None

    def table(self, title: str, columns: Sequence[str], notes: Sequence[str] = ()) -> Table:
        t = Table(title, list(columns), [], list(notes))
        self.tables.append(t)
        return t


@dataclass
class Report:
    out_dir: str
    meta: dict[str, Any]
    sections: list[Section] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "sections": {
                s.name: {
                    "error": s.error,
                    "seconds": s.seconds,
                    "headline": s.headline,
                    "info": s.info,
                    "tables": [
                        {"title": t.title, "columns": t.columns, "rows": t.rows, "notes": t.notes} for t in s.tables
                    ],
                }
                for s in self.sections
            },
        }

    def write(self) -> None:
        """Rewrite DIR/cuda_micro.json and .md (each through a temporary file and a rename)."""
        os.makedirs(self.out_dir, exist_ok=True)
        _write_atomic(
            os.path.join(self.out_dir, JSON_NAME),
            json.dumps(_jsonable(self.document()), indent=1, allow_nan=False) + "\n",
        )
        _write_atomic(os.path.join(self.out_dir, MD_NAME), render_markdown_report(self))


@dataclass
class Ctx:
    """What the sections share: the device, the mode, the L2 size, the report (to save partial
    results), the pinned-copy ceilings of section `ceilings`, and the running section's deadline."""

    device: torch.device
    quick: bool
    l2_bytes: int
    report: Report
    ceilings: dict[str, float] = field(default_factory=dict)  # "h2d", "d2h": GB/s
    deadline: float = math.inf  # perf_counter() time

    def over_budget(self) -> bool:
        return time.perf_counter() > self.deadline

    def save(self) -> None:
        self.report.write()


# ---- pure helpers (tested on CPU) -------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    ffn: int


@dataclass(frozen=True)
class Gemm:
    """y [M, N] = x [M, K] @ W.T, W [N, K]."""

    name: str
    M: int
    N: int
    K: int

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K


LLAMA_7B = Model("llama-7b", 4096, 11008)
LLAMA_13B = Model("llama-13b", 5120, 13824)
TINY = Model("tiny", 256, 688)  # --quick
GEMM_NAMES = ("qkv", "attn_out", "gate_up", "down")


def layer_gemms(model: Model, tp: int, tokens: int) -> list[Gemm]:
    """The four GEMMs of one transformer layer on one of tp ranks, T = tokens rows:

    qkv      [T, h]      x [3h/tp, h]^T       attn_out [T, h/tp]   x [h, h/tp]^T
    gate_up  [T, h]      x [2 ffn/tp, h]^T    down     [T, ffn/tp] x [h, ffn/tp]^T
    """
    h, f = model.hidden, model.ffn
    for what, size in (("3 * hidden", 3 * h), ("hidden", h), ("2 * ffn", 2 * f), ("ffn", f)):
        if size % tp:
            raise ValueError(f"tp: {what} = {size} of {model.name} is not divisible by tp = {tp}")
    return [
        Gemm("qkv", tokens, 3 * h // tp, h),
        Gemm("attn_out", tokens, h, h // tp),
        Gemm("gate_up", tokens, 2 * f // tp, h),
        Gemm("down", tokens, h, f // tp),
    ]


def row_chunks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """[start, stop) of `chunks` consecutive pieces of range(rows), sizes differing by at most 1
    (the first rows % chunks pieces one longer); empty pieces are dropped."""
    if rows < 0 or chunks < 1:
        raise ValueError(f"row_chunks: need rows >= 0 and chunks >= 1, got {rows}, {chunks}")
    base, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


def rotation_sets(set_bytes: int, l2_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to rotate so that successive calls read from HBM: enough to hold more
    than 3x L2 together (1 when one set already does), at most max_sets."""
    if set_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(3 * l2_bytes / set_bytes)))


def efficiencies(times: Mapping[int, float]) -> dict[int, float]:
    """efficiency(c) = times[1] / times[c] for every chunk count c (needs times[1])."""
    return {c: times[1] / t for c, t in times.items()}


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"geomean: needs positive values, got {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile: no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize_by_chunks(rows: Sequence[Mapping[str, Any]], chunks: Sequence[int]) -> list[dict[str, Any]]:
    """One row per c > 1 from per-GEMM rows carrying "eff_c<c>": the geometric mean, min and max
    of the efficiency over the rows that have it, and how many."""
    out = []
    for c in chunks:
        if c == 1:
            continue
        values = [r[f"eff_c{c}"] for r in rows if isinstance(r.get(f"eff_c{c}"), (int, float))]
        out.append(
            {
                "chunks": c,
                "shapes": len(values),
                "geomean_eff": geomean(values) if values else None,
                "min_eff": min(values) if values else None,
                "max_eff": max(values) if values else None,
            }
        )
    return out


def copy_combos(counts: Sequence[int], sizes: Sequence[int], max_total: int) -> list[tuple[int, int]]:
    """(n, size) for every n in counts and size in sizes with n * size <= max_total, by size then n."""
    return [(n, s) for s in sizes for n in counts if n * s <= max_total]


def fmt(value: Any) -> str:
    """A table cell: None as n/a, floats to 4 significant digits (whole from 1000 up), the rest str()."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def size_label(nbytes: int) -> str:
    """16384 -> '16 KiB', 1 << 20 -> '1 MiB', 3 -> '3 B'."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def render_text(table: Table) -> str:
    """The table as aligned plain text (bench._report.render's layout), cells by `fmt`."""
    from bench import _report

    cells = [[fmt(row.get(c)) for c in table.columns] for row in table.rows]
    return _report.render(_report.Table(table.title, table.columns, cells, [f"  {n}" for n in table.notes]))


def render_markdown(table: Table) -> str:
    """The table in GitHub markdown: '### title', header, |---| row, rows ('|' escaped), notes."""

    def cell(value: Any) -> str:
        return fmt(value).replace("|", "\\|")

    lines = [
        f"### {table.title}",
        "",
        "| " + " | ".join(cell(c) for c in table.columns) + " |",
        "|" + "|".join("---" for _ in table.columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in table.columns) + " |" for row in table.rows]
    if table.notes:
        lines.append("")
        lines += [f"- {n}" for n in table.notes]
    return "\n".join(lines) + "\n"


def render_markdown_report(report: Report) -> str:
    lines = ["# cuda_micro", ""]
    lines += [f"- {k}: {fmt(v)}" for k, v in report.meta.items()]
    lines.append("")
    for s in report.sections:
        status = "FAILED" if s.error else "ok"
        lines += [f"## {s.name} ({status}, {fmt(s.seconds)} s)", ""]
        if s.headline:
            lines += [s.headline, ""]
        if s.info:
            lines += [f"- {k}: {fmt(v)}" for k, v in s.info.items()] + [""]
        lines += [render_markdown(t) for t in s.tables]
        if s.error:
            lines += ["```", s.error.rstrip(), "```", ""]
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    """The value with tuples as lists, non-finite floats as strings, other objects as str()."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- timing -----------------------------------------------------------------------------------------


def cuda_times(
    variants: Mapping[str, Callable[[int], object]],
    *,
    sets: int = 1,
    warmup: int = 2,
    reps: int = 10,
    issue: Optional[dict[str, float]] = None,
) -> dict[str, float]:
    """Median seconds per call of each variant, from CUDA events around each call.

    warmup rounds of every variant, then reps rounds, round-robin (a, b, a, b, ...);
    call k (counted over all variants) gets k % sets, the input set to read;
    no host synchronisation between calls, one at the end
    issue: if given, gets each variant's median host seconds to issue one call (when that
    is close to the event time, the GPU waited for the host: the call is host-bound)
    """
    names = list(variants)
    k = 0
    for _ in range(warmup):
        for name in names:
            variants[name](k % sets)
            k += 1
    torch.cuda.synchronize()
    events: dict[str, list[tuple[Any, Any]]] = {name: [] for name in names}
    issued: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            variants[name](k % sets)
            issued[name].append(time.perf_counter() - begin)
            stop.record()
            events[name].append((start, stop))
            k += 1
    torch.cuda.synchronize()
    if issue is not None:
        issue.update({name: statistics.median(v) for name, v in issued.items()})
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3 for name, pairs in events.items()}


def host_times(variants: Mapping[str, Callable[[], object]], *, warmup: int = 2, reps: int = 10) -> dict[str, float]:
    """Median seconds per call of each variant, host clock: synchronize; start; fn(); synchronize;
    stop (launch and issue overhead included). Round-robin; what fn returns lives until the sync."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            kept = variants[name]()
            torch.cuda.synchronize()
            del kept
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name in names:
            torch.cuda.synchronize()
            start = time.perf_counter()
            kept = variants[name]()
            torch.cuda.synchronize()
            samples[name].append(time.perf_counter() - start)
            del kept
    return {name: statistics.median(v) for name, v in samples.items()}


def _rand(shape: Sequence[int], dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times scale) of a floating dtype: never zeros."""
    t = torch.randn(tuple(shape), device=device, dtype=dtype)
    return t.mul_(scale) if scale != 1.0 else t


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN in out gives NaN)."""
    ref64 = ref.double()
    return float(torch.linalg.vector_norm(out.double() - ref64) / torch.linalg.vector_norm(ref64))


def _spin_up(fn: Callable[[], object], seconds: float) -> float:
    """Call fn (a GEMM) until `seconds` of host time passed, synchronizing every 10 calls, so the
    GPU is at its working clocks before anything is timed; returns the seconds spent."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    return time.perf_counter() - start


# ---- section 1: ceilings ----------------------------------------------------------------------------


def _ceilings(ctx: Ctx, section: Section) -> None:
    dev, quick = ctx.device, ctx.quick
    warmup, reps = (1, 2) if quick else (2, 10)
    copy_bytes = 16 * MIB if quick else 2 * GIB
    n = 512 if quick else 8192
    pinned_bytes = 4 * MIB if quick else 256 * MIB
    table = section.table(
        "ceilings: one GPU's peaks (median of CUDA-event timed calls)",
        ["measure", "size", "t_ms", "rate", "unit"],
        [
            "d2d copy: GB/s counts the bytes read plus the bytes written (2x the size)",
            "matmul: torch.mm bf16, 2 n^3 flops; pinned copies: copy_(non_blocking=True)",
        ],
    )

    # F821 on the lambdas below is a false positive: they are called before the `del` of their names
    a, b = _rand((n, n), torch.bfloat16, dev), _rand((n, n), torch.bfloat16, dev)
    c = torch.empty((n, n), device=dev, dtype=torch.bfloat16)
    section.info["spin_up_s"] = _spin_up(lambda: torch.mm(a, b, out=c), 0.05 if quick else 0.5)  # noqa: F821

    src = _rand((copy_bytes // 4,), torch.float32, dev)
    dst = torch.empty_like(src)
    t = cuda_times({"d2d": lambda k: dst.copy_(src)}, warmup=warmup, reps=reps)["d2d"]  # noqa: F821
    ctx.ceilings["d2d"] = 2 * copy_bytes / t / 1e9
    table.rows.append(
        {
            "measure": "d2d copy",
            "size": size_label(copy_bytes),
            "t_ms": t * 1e3,
            "rate": ctx.ceilings["d2d"],
            "unit": "GB/s",
        }
    )
    del src, dst

    t = cuda_times({"mm": lambda k: torch.mm(a, b, out=c)}, warmup=warmup, reps=reps)["mm"]  # noqa: F821
    ctx.ceilings["bf16_tflops"] = 2 * n**3 / t / 1e12
    table.rows.append(
        {
            "measure": "bf16 matmul",
            "size": f"{n}^3",
            "t_ms": t * 1e3,
            "rate": ctx.ceilings["bf16_tflops"],
            "unit": "TFLOP/s",
        }
    )
    del a, b, c

    device_buf = torch.randint(0, 256, (pinned_bytes,), dtype=torch.uint8, device=dev)
    host_buf = torch.empty(pinned_bytes, dtype=torch.uint8, pin_memory=True)
    host_buf.copy_(device_buf)
    section.info["host_buffer_pinned"] = host_buf.is_pinned()
    times = cuda_times(
        {
            "h2d": lambda k: device_buf.copy_(host_buf, non_blocking=True),
            "d2h": lambda k: host_buf.copy_(device_buf, non_blocking=True),
        },
        warmup=warmup,
        reps=reps,
    )
    for name in ("h2d", "d2h"):
        ctx.ceilings[name] = pinned_bytes / times[name] / 1e9
        table.rows.append(
            {
                "measure": f"pinned {name}",
                "size": size_label(pinned_bytes),
                "t_ms": times[name] * 1e3,
                "rate": ctx.ceilings[name],
                "unit": "GB/s",
            }
        )
    section.info["ceilings"] = dict(ctx.ceilings)
    section.headline = (
        "ceilings: d2d {d2d:.0f} GB/s, bf16 mm {bf16_tflops:.0f} TFLOP/s, pinned h2d {h2d:.1f} / "
        "d2h {d2h:.1f} GB/s".format(**ctx.ceilings)
    )


# ---- section 2: chunked_gemm ------------------------------------------------------------------------


def _matmul_into_slices(device: torch.device) -> Callable[..., torch.Tensor]:
    """torch.matmul when matmul(x[rows], w.t(), out=y[rows]) writes into y's rows in place (checked
    here on a small bf16 case), else torch.mm (checked the same way); raises when neither does."""
    x = _rand((96, 64), torch.bfloat16, device)
    w = _rand((80, 64), torch.bfloat16, device)
    ref = torch.mm(x, w.t())
    for mm in (torch.matmul, torch.mm):
        y = torch.full((96, 80), float("nan"), dtype=torch.bfloat16, device=device)
        for a, b in row_chunks(96, 3):
            mm(x[a:b], w.t(), out=y[a:b])
        if torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2):
            return mm
    raise RuntimeError("neither torch.matmul nor torch.mm writes into a row slice given as out=")


def _chunked_variant(
    mm: Callable[..., torch.Tensor], sets: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], chunks: int
) -> Callable[[int], None]:
    """fn(k): y = x @ w.T of input set k % len(sets), computed in `chunks` row chunks, each into
    its own rows of y."""
    rows = sets[0][0].shape[0]
    pieces = [[(x[a:b], w.t(), y[a:b]) for a, b in row_chunks(rows, chunks)] for x, w, y in sets]

    def run(k: int) -> None:
        for xi, wt, yi in pieces[k % len(pieces)]:
            mm(xi, wt, out=yi)

    return run


HOST_BOUND = 0.8  # issue time / event time from which a chunked call counts as host-bound


def _chunked_gemm(ctx: Ctx, section: Section) -> None:
    dev, quick = ctx.device, ctx.quick
    models = (TINY,) if quick else (LLAMA_7B, LLAMA_13B)
    tps = (2,) if quick else (2, 4, 8)
    token_counts = (256,) if quick else (4096, 8192)
    chunk_counts = (1, 2, 4) if quick else (1, 2, 4, 8, 16)
    warmup, reps = (1, 2) if quick else (2, 8)
    mm = _matmul_into_slices(dev)
    section.info["chunk_call"] = f"torch.{mm.__name__}(x[rows], w.t(), out=y[rows])"
    eff_cols = [f"eff_c{c}" for c in chunk_counts if c > 1]
    per_gemm = section.table(
        "chunked_gemm: per GEMM, bf16, t_c1 = one unchunked GEMM; eff_cN = t_c1 / t(N row chunks)",
        ["model", "tp", "T", "gemm", "M", "N", "K", "t_c1_ms", "tflops_c1", *eff_cols, "rel_err", "host_bound"],
        [
            "rel_err: max over N of ||y_N - y_1|| / ||y_1|| (chunked vs one GEMM; y filled with NaN first)",
            f"host_bound: the chunk counts whose host time to issue the calls was >= {HOST_BOUND} x their GPU time "
            "(the GPU waited for Python: eager launch overhead, not the GEMMs)",
            "times: median of CUDA-event timed calls, variants round-robin; small shapes rotate input sets (L2)",
        ],
    )
    cases = [(m, tp, T, g) for m in models for tp in tps for T in token_counts for g in layer_gemms(m, tp, T)]
    done = 0
    for model, tp, T, gemm in cases:
        if ctx.over_budget():
            per_gemm.notes.append(f"stopped by the time budget after {done} of {len(cases)} GEMMs")
            break
        set_bytes = 2 * (gemm.M * gemm.K + gemm.N * gemm.K + gemm.M * gemm.N)
        n_sets = rotation_sets(set_bytes, ctx.l2_bytes)
        sets = [
            (
                _rand((gemm.M, gemm.K), torch.bfloat16, dev),
                _rand((gemm.N, gemm.K), torch.bfloat16, dev),
                torch.empty((gemm.M, gemm.N), dtype=torch.bfloat16, device=dev),
            )
            for _ in range(n_sets)
        ]
        variants = {c: _chunked_variant(mm, sets, c) for c in chunk_counts}
        x0, w0, y0 = sets[0]
        ref = torch.mm(x0, w0.t())
        err = 0.0
        for run in variants.values():
            y0.fill_(float("nan"))
            run(0)
            e = _rel_err(y0, ref)
            err = e if math.isnan(e) else max(err, e)  # NaN: some rows were never written
            if math.isnan(err):
                break
        del ref
        issue: dict[str, float] = {}
        times = cuda_times(
            {f"c{c}": v for c, v in variants.items()}, sets=n_sets, warmup=warmup, reps=reps, issue=issue
        )
        by_c = {c: times[f"c{c}"] for c in chunk_counts}
        eff = efficiencies(by_c)
        host_bound = [c for c in chunk_counts if issue[f"c{c}"] >= HOST_BOUND * by_c[c]]
        per_gemm.rows.append(
            {
                "model": model.name,
                "tp": tp,
                "T": T,
                "gemm": gemm.name,
                "M": gemm.M,
                "N": gemm.N,
                "K": gemm.K,
                "t_c1_ms": by_c[1] * 1e3,
                "tflops_c1": gemm.flops / by_c[1] / 1e12,
                **{f"eff_c{c}": eff[c] for c in chunk_counts if c > 1},
                "rel_err": err,
                "host_bound": ",".join(map(str, host_bound)) or "-",
                "sets": n_sets,
                "t_ms": {str(c): t * 1e3 for c, t in by_c.items()},
                "issue_ms": {str(c): issue[f"c{c}"] * 1e3 for c in chunk_counts},
            }
        )
        del sets, variants, x0, w0, y0
        done += 1
        if done % 8 == 0:
            ctx.save()

    layers = section.table(
        "chunked_gemm: per layer = sum of its 4 GEMMs' medians; eff_cN = t_c1 / t(N chunks)",
        ["model", "tp", "T", "t_c1_ms", *eff_cols],
    )
    for model in models:
        for tp in tps:
            for T in token_counts:
                rows = [r for r in per_gemm.rows if (r["model"], r["tp"], r["T"]) == (model.name, tp, T)]
                if len(rows) != len(GEMM_NAMES):
                    continue
                total = {c: sum(r["t_ms"][str(c)] for r in rows) for c in chunk_counts}
                eff = efficiencies(total)
                layers.rows.append(
                    {
                        "model": model.name,
                        "tp": tp,
                        "T": T,
                        "t_c1_ms": total[1],
                        **{f"eff_c{c}": eff[c] for c in chunk_counts if c > 1},
                        "t_ms": {str(c): t for c, t in total.items()},
                    }
                )
    summary = section.table(
        "chunked_gemm: summary over all GEMM shapes, per chunk count",
        ["chunks", "shapes", "geomean_eff", "min_eff", "max_eff"],
    )
    summary.rows.extend(summarize_by_chunks(per_gemm.rows, chunk_counts))
    section.headline = "chunked_gemm geomean efficiency: " + ", ".join(
        f"c={r['chunks']} {fmt(r['geomean_eff'])}" for r in summary.rows
    )


# ---- section 3: triton_vs_cublas --------------------------------------------------------------------


@dataclass(frozen=True)
class KernelCase:
    kernel: str  # "linear_into" | "linear_accumulate"
    dtype: torch.dtype
    tp: int
    gemm: Gemm


def kernel_cases(model: Model, tps: Sequence[int], tokens: int, fp16: bool) -> list[KernelCase]:
    """linear_into on the column-parallel GEMMs (qkv, gate_up: all-gather then GEMM), linear_accumulate
    on the row-parallel ones (attn_out, down: GEMM then reduce-scatter), bf16, for every tp; plus,
    with fp16, linear_into on the first tp's qkv in fp16."""
    cases = []
    for tp in tps:
        for g in layer_gemms(model, tp, tokens):
            kernel = "linear_into" if g.name in ("qkv", "gate_up") else "linear_accumulate"
            cases.append(KernelCase(kernel, torch.bfloat16, tp, g))
    if fp16:
        cases.append(KernelCase("linear_into", torch.float16, tps[0], layer_gemms(model, tps[0], tokens)[0]))
    return cases


def _best_config() -> Optional[str]:
    try:
        from oases_kernels._gemm import _gemm_kernel_tuned

        best = getattr(_gemm_kernel_tuned, "best_config", None)
        return None if best is None else str(best)
    except Exception:  # a private attribute: report nothing rather than fail the case
        return None


def _triton_case(case: KernelCase, device: torch.device, warmup: int, reps: int, ref_rows: int) -> dict[str, Any]:
    import oases_kernels

    g, dt = case.gemm, case.dtype
    x = _rand((g.M, g.K), dt, device)
    w = _rand((g.N, g.K), dt, device, scale=g.K**-0.5)
    r = min(ref_rows, g.M)
    if case.kernel == "linear_into":
        out = torch.empty((2 * g.M, g.N), dtype=dt, device=device)  # rows [M, 2M) are written
        rows = out[g.M :]

        def triton_fn(k: int) -> object:
            return oases_kernels.linear_into(x, w, out, g.M)

        def torch_fn(k: int) -> object:
            return torch.matmul(x, w.t(), out=rows)

        ref = x[:r].double() @ w.double().t()
        peers = {"torch": torch_fn}
    else:
        acc = _rand((g.M, g.N), torch.float32, device)
        rows = torch.empty((g.M, g.N), dtype=dt, device=device)

        def triton_fn(k: int) -> object:
            return oases_kernels.linear_accumulate(x, w, acc, rows)

        def torch_fn(k: int) -> object:
            return torch.add(acc, torch.mm(x, w.t()), out=rows)

        acc_low = acc.to(dt)

        def addmm_fn(k: int) -> object:  # one cuBLAS call (beta = 1), but acc rounded to x's dtype
            return torch.addmm(acc_low, x, w.t(), out=rows)

        ref = x[:r].double() @ w.double().t() + acc[:r].double()
        peers = {"torch": torch_fn, "addmm": addmm_fn}
    torch.cuda.synchronize()
    start = time.perf_counter()
    triton_fn(0)  # autotunes (and compiles the configs, the first time per kernel and dtypes)
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - start
    best = _best_config()
    rows.fill_(float("nan"))
    triton_fn(0)
    err_triton = _rel_err(rows[:r], ref)
    rows.fill_(float("nan"))
    torch_fn(0)
    err_torch = _rel_err(rows[:r], ref)
    times = cuda_times({"triton": triton_fn, **peers}, warmup=warmup, reps=reps)
    addmm = times.get("addmm")
    return {
        "kernel": case.kernel,
        "dtype": str(dt).replace("torch.", ""),
        "tp": case.tp,
        "gemm": g.name,
        "M": g.M,
        "N": g.N,
        "K": g.K,
        "warmup_s": warmup_s,
        "triton_ms": times["triton"] * 1e3,
        "torch_ms": times["torch"] * 1e3,
        "ratio": times["torch"] / times["triton"],
        "addmm_ms": addmm * 1e3 if addmm else None,
        "ratio_addmm": addmm / times["triton"] if addmm else None,
        "triton_tflops": g.flops / times["triton"] / 1e12,
        "torch_tflops": g.flops / times["torch"] / 1e12,
        "err_triton": err_triton,
        "err_torch": err_torch,
        "best_config": best,
    }


def _triton_vs_cublas(ctx: Ctx, section: Section) -> None:
    import triton

    quick = ctx.quick
    model, tps, tokens = (TINY, (2,), 256) if quick else (LLAMA_7B, (2, 8), 8192)
    warmup, reps = (1, 2) if quick else (2, 10)
    cases = kernel_cases(model, tps, tokens, fp16=not quick)
    if quick:
        cases = [c for c in cases if c.gemm.name in ("qkv", "down")]
    section.info["triton"] = triton.__version__
    table = section.table(
        f"triton_vs_cublas: oases_kernels vs torch, {model.name}, T = {tokens}; ratio = t_torch / t_triton "
        "(target >= 0.9)",
        [
            "kernel",
            "dtype",
            "tp",
            "gemm",
            "M",
            "N",
            "K",
            "warmup_s",
            "triton_ms",
            "torch_ms",
            "ratio",
            "ratio_addmm",
            "triton_tflops",
            "err_triton",
            "err_torch",
        ],
        [
            "linear_into: out[M:2M] of a (2M, N) buffer; peer torch.matmul(x, w.t(), out=out[M:2M])",
            "linear_accumulate: acc fp32, out in x's dtype; peer torch.add(acc, torch.mm(x, w.t()), out=out) "
            "(two kernels and a temporary: what the fused epilogue saves); ratio_addmm = t / t_triton of "
            "torch.addmm(acc.to(x.dtype), x, w.t(), out=out), one cuBLAS call but acc rounded to x's dtype",
            "warmup_s: the first call, timed on the host: autotuning over the kernel's configs; the first case "
            "of each kernel and dtype also compiles them",
            "err_*: ||out - ref|| / ||ref|| over the first 256 rows, ref in float64 on the GPU",
        ],
    )
    for i, case in enumerate(cases):
        if ctx.over_budget():
            table.notes.append(f"stopped by the time budget after {i} of {len(cases)} cases")
            break
        try:
            table.rows.append(_triton_case(case, ctx.device, warmup, reps, ref_rows=256))
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr, flush=True)
            last = err.strip().splitlines()[-1]
            table.rows.append(
                {
                    "kernel": case.kernel,
                    "dtype": str(case.dtype).replace("torch.", ""),
                    "tp": case.tp,
                    "gemm": case.gemm.name,
                    "error": last,
                }
            )
            table.notes.append(f"FAILED {case.kernel} {case.gemm.name} tp {case.tp}: {last}")
            section.info.setdefault("case_errors", []).append(err)
        gc.collect()
        torch.cuda.empty_cache()
        ctx.save()
    ratios = [r["ratio"] for r in table.rows if "ratio" in r]
    if ratios:
        section.headline = (
            f"triton_vs_cublas: ratio t_torch/t_triton min {min(ratios):.3f}, median "
            f"{statistics.median(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} cases"
        )
    if section.info.get("case_errors"):
        raise RuntimeError(f"{len(section.info['case_errors'])} case(s) failed; tracebacks in info.case_errors")


# ---- section 4: batched_copies ----------------------------------------------------------------------


def _import_offload() -> Any:
    """oases.offload, from the installed package or else from this checkout's python_api/."""
    try:
        import oases.offload as offload
    except ImportError:
        sys.path.insert(0, os.path.join(REPO_ROOT, "python_api"))
        import oases.offload as offload
    return offload


def _batched_copies(ctx: Ctx, section: Section) -> None:
    offload = _import_offload()
    dev, quick = ctx.device, ctx.quick
    counts = (4, 16) if quick else (16, 64, 256)
    sizes = (16 * KIB, 256 * KIB) if quick else (16 * KIB, 256 * KIB, MIB, 16 * MIB)
    max_total = 16 * MIB if quick else 2 * GIB
    warmup, reps = (1, 2) if quick else (2, 10)
    combos = copy_combos(counts, sizes, max_total)
    capacity = max(n * s for n, s in combos)
    engine = offload.CopyEngine(dev)
    slab = offload.HostSlab(capacity)  # the engine's pinned slab
    pinned = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)  # per-tensor copy_ targets
    section.info.update(
        {
            "engine_path": engine.path,
            "slab_pinned": slab.buffer.is_pinned(),
            "skipped_over_bytes": max_total,
            "skipped": [f"{n} x {size_label(s)}" for s in sizes for n in counts if n * s > max_total],
        }
    )
    table = section.table(
        f"batched_copies: n fp32 tensors, one batch, host-timed (sync .. sync), GB/s = n size / t; engine path "
        f"{engine.path}",
        ["dir", "n", "size", "total", "engine_GBps", "to_GBps", "copy_GBps", "x_to", "x_copy", "of_ceiling"],
        [
            "engine: CopyEngine.copy_out(ts, slab, offsets).wait() / copy_in(slab, offsets, specs) + wait()",
            "to: [t.to('cpu' | device, non_blocking=True) for t in ts]; copy: [h.copy_(t, non_blocking=True)] into "
            "preallocated pinned (D2H) or device (H2D) tensors",
            "x_to, x_copy = t_peer / t_engine (> 1: the engine is faster); of_ceiling = engine GB/s / pinned "
            "ceiling of section ceilings",
        ],
    )
    checked = False
    for size in sizes:
        fitting = [n for n, s in combos if s == size]
        if not fitting:
            continue
        if ctx.over_budget():
            table.notes.append(f"stopped by the time budget before size {size_label(size)}")
            break
        numel = size // 4
        tensors = [_rand((numel,), torch.float32, dev) for _ in range(max(fitting))]
        hosts = [pinned[i * size : (i + 1) * size].view(torch.float32) for i in range(max(fitting))]
        for n in fitting:
            ts, hs = tensors[:n], hosts[:n]
            offsets = [i * size for i in range(n)]
            specs = [((numel,), torch.float32)] * n
            if not checked:  # one round trip per path, bit for bit
                engine.copy_out(ts, slab.buffer, offsets).wait()
                back, event = engine.copy_in(slab.buffer, offsets, specs)
                event.wait()
                for h, t in zip(hs, ts):
                    h.copy_(t, non_blocking=True)
                torch.cuda.synchronize()
                to_host = ts[0].to("cpu", non_blocking=True)
                torch.cuda.synchronize()
                section.info["roundtrip_exact"] = all(torch.equal(a, b) for a, b in zip(back, ts)) and all(
                    torch.equal(h, t.cpu()) for h, t in zip(hs, ts)
                )
                section.info["to_cpu_non_blocking_is_pinned"] = to_host.is_pinned()
                if not section.info["roundtrip_exact"]:
                    raise AssertionError("batched_copies: a copy path did not give the tensors back bit for bit")
                checked = True
            d2h = host_times(
                {
                    "engine": lambda: engine.copy_out(ts, slab.buffer, offsets).wait(),
                    "to": lambda: [t.to("cpu", non_blocking=True) for t in ts],
                    "copy": lambda: [h.copy_(t, non_blocking=True) for h, t in zip(hs, ts)],
                },
                warmup=warmup,
                reps=reps,
            )

            def engine_in() -> list[torch.Tensor]:
                outs, event = engine.copy_in(slab.buffer, offsets, specs)
                event.wait()
                return outs

            h2d = host_times(
                {
                    "engine": engine_in,
                    "to": lambda: [h.to(dev, non_blocking=True) for h in hs],
                    "copy": lambda: [t.copy_(h, non_blocking=True) for t, h in zip(ts, hs)],
                },
                warmup=warmup,
                reps=reps,
            )
            for direction, times in (("d2h", d2h), ("h2d", h2d)):
                total = n * size
                ceiling = ctx.ceilings.get(direction)
                engine_gbps = total / times["engine"] / 1e9
                table.rows.append(
                    {
                        "dir": direction,
                        "n": n,
                        "size": size_label(size),
                        "total": size_label(total),
                        "engine_GBps": engine_gbps,
                        "to_GBps": total / times["to"] / 1e9,
                        "copy_GBps": total / times["copy"] / 1e9,
                        "x_to": times["to"] / times["engine"],
                        "x_copy": times["copy"] / times["engine"],
                        "of_ceiling": engine_gbps / ceiling if ceiling else None,
                        "t_ms": {k: v * 1e3 for k, v in times.items()},
                    }
                )
        del tensors, hosts
        torch.cuda.empty_cache()
        ctx.save()
    engine.synchronize()
    engine.close()
    x_copy = [r["x_copy"] for r in table.rows]
    if x_copy:
        section.headline = (
            f"batched_copies ({engine.path} path): engine vs per-tensor copy_ x{min(x_copy):.2f} .. "
            f"x{max(x_copy):.2f}; best of ceiling "
            f"{fmt(max((r['of_ceiling'] or 0.0) for r in table.rows))}"
        )


# ---- section 5: stream_priority ---------------------------------------------------------------------


def _priority_range() -> Optional[tuple[int, int]]:
    """torch.cuda.Stream.priority_range() where this torch has it (static, or on an instance)."""
    for get in (lambda: torch.cuda.Stream.priority_range(), lambda: torch.cuda.Stream().priority_range()):
        try:
            low, high = get()
            return int(low), int(high)
        except Exception:
            continue
    return None


def _stream_priority(ctx: Ctx, section: Section) -> None:
    dev, quick = ctx.device, ctx.quick
    n = 1024 if quick else 8192
    fill_s = 0.005 if quick else 0.05
    trials = 2 if quick else 20
    background = torch.cuda.Stream(dev, priority=0)
    streams = {"high": torch.cuda.Stream(dev, priority=-1), "normal": torch.cuda.Stream(dev, priority=0)}
    section.info["priority_range"] = _priority_range()
    section.info["stream_priorities"] = {k: s.priority for k, s in streams.items()}
    a, b = _rand((n, n), torch.bfloat16, dev), _rand((n, n), torch.bfloat16, dev)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=dev)
    t_gemm = cuda_times({"mm": lambda k: torch.mm(a, b, out=c)}, warmup=2, reps=3)["mm"]
    gemms = max(1, min(2000, round(fill_s / t_gemm)))
    section.info.update(
        {
            "gemm": f"bf16 {n}^3",
            "gemm_ms": t_gemm * 1e3,
            "gemms_per_fill": gemms,
            "fill_ms": gemms * t_gemm * 1e3,
            "trials": trials,
        }
    )
    x, y, z = (_rand((1024,), torch.float32, dev) for _ in range(3))
    host = torch.empty(64 * KIB, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, (64 * KIB,), dtype=torch.uint8, device=dev))
    dst = torch.empty(64 * KIB, dtype=torch.uint8, device=dev)
    ops: dict[str, Callable[[], object]] = {
        "add_1024": lambda: torch.add(x, y, out=z),
        "h2d_64KiB": lambda: dst.copy_(host, non_blocking=True),
    }
    rng = random.Random(0)

    def latency(op: Callable[[], object], stream: Any, busy: bool, delay_s: float) -> tuple[float, bool]:
        """Seconds from issuing op on `stream` to its event completing; whether the background
        GEMMs were still running when it completed."""
        torch.cuda.synchronize()
        bg_done = torch.cuda.Event()
        if busy:
            with torch.cuda.stream(background):
                for _ in range(gemms):
                    torch.mm(a, b, out=c)
                bg_done.record(background)
            time.sleep(delay_s)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            start = time.perf_counter()
            op()
            done.record(stream)
            done.synchronize()
            seconds = time.perf_counter() - start
        still_busy = busy and not bg_done.query()
        torch.cuda.synchronize()
        return seconds, still_busy

    table = section.table(
        f"stream_priority: small op latency (issue -> done, host clock) while a priority-0 stream runs "
        f"{gemms} x bf16 {n}^3 GEMMs (~{gemms * t_gemm * 1e3:.0f} ms)",
        ["op", "stream", "priority", "median_us", "p90_us", "vs_high", "trials", "bg_busy"],
        [
            "high: torch.cuda.Stream(priority=-1); normal: a second priority-0 stream; idle: no background work",
            "the op is issued at a random point (5%..70%) of the GEMM queue; bg_busy: share of trials in which "
            "the GEMMs were still running when the op completed",
            "vs_high = this median / the high-priority stream's median",
        ],
    )
    for op_name, op in ops.items():
        if ctx.over_budget():
            table.notes.append(f"stopped by the time budget before {op_name}")
            break
        for stream in streams.values():  # warm-up: the op's kernel and the streams exist
            latency(op, stream, False, 0.0)
        samples: dict[str, list[float]] = {"high": [], "normal": [], "idle": []}
        busy_counts = {"high": 0, "normal": 0}
        for _ in range(trials):
            delay = rng.uniform(0.05, 0.7) * gemms * t_gemm
            for kind in ("high", "normal"):  # the same point of the queue for both
                seconds, busy = latency(op, streams[kind], True, delay)
                samples[kind].append(seconds)
                busy_counts[kind] += busy
            samples["idle"].append(latency(op, streams["high"], False, 0.0)[0])
        high_median = statistics.median(samples["high"])
        for kind, values in samples.items():
            median = statistics.median(values)
            table.rows.append(
                {
                    "op": op_name,
                    "stream": kind,
                    "priority": streams["normal" if kind == "normal" else "high"].priority,
                    "median_us": median * 1e6,
                    "p90_us": percentile(values, 90) * 1e6,
                    "vs_high": median / high_median,
                    "trials": len(values),
                    "bg_busy": busy_counts[kind] / len(values) if kind in busy_counts else None,
                    "samples_us": [v * 1e6 for v in values],
                }
            )
    ratios = {r["op"]: r["vs_high"] for r in table.rows if r["stream"] == "normal"}
    if ratios:
        section.headline = "stream_priority: normal / high median latency " + ", ".join(
            f"{op} x{v:.1f}" for op, v in ratios.items()
        )


# ---- the run ----------------------------------------------------------------------------------------


SECTIONS: dict[str, Callable[[Ctx, Section], None]] = {
    "ceilings": _ceilings,
    "chunked_gemm": _chunked_gemm,
    "triton_vs_cublas": _triton_vs_cublas,
    "batched_copies": _batched_copies,
    "stream_priority": _stream_priority,
}
# Soft budgets in seconds (checked between cases; a case that started runs to its end).
# Expected on an H100/H200: ~2, ~5, ~35 (mostly compiling and autotuning), ~6 and ~5 s.
BUDGETS: dict[str, float] = {
    "ceilings": 10,
    "chunked_gemm": 20,
    "triton_vs_cublas": 45,
    "batched_copies": 15,
    "stream_priority": 12,
}


def _meta(device: torch.device, quick: bool) -> dict[str, Any]:
    versions = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "quick": quick,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }  # set: Triton runs on the CPU
    try:
        props = torch.cuda.get_device_properties(device)
    except Exception as err:  # reported; the sections will say what else fails
        return {"gpu": f"properties unavailable: {err}", "l2_bytes": None, **versions}
    try:
        import triton

        triton_version: Optional[str] = triton.__version__
    except Exception as err:  # reported, not fatal: only section triton_vs_cublas needs it
        triton_version = f"not importable: {err}"
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": getattr(props, "multi_processor_count", None),
        "memory_gib": round(props.total_memory / GIB, 1),
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "triton": triton_version,
        **versions,
    }


def _start_watchdog(seconds: float) -> bool:
    """After `seconds`, dump every thread's stack to the real stderr and exit (faulthandler: works
    while the main thread is blocked in CUDA). False when off (seconds <= 0) or not possible."""
    if seconds <= 0:
        return False
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__ or sys.stderr)
    except (AttributeError, OSError, ValueError) as err:  # no file descriptor to write to
        print(f"cuda_micro: no watchdog ({err})", flush=True)
        return False
    return True


def _cleanup() -> None:
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # a sticky CUDA error: the next section reports it
        traceback.print_exc()


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_micro", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"where to write {JSON_NAME} and {MD_NAME} (default: bench/results)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 1-2 iterations (a smoke test)")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)} (default: all)"
    )
    parser.add_argument(
        "--watchdog",
        type=float,
        default=300.0,
        help="dump every stack and exit after this many seconds (default 300; 0: off)",
    )
    parser.add_argument(
        "--no-plots",
        action="store_true",
        help="leave out the PNGs (python -m bench.cuda_plots makes them from the JSON later)",
    )
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.sections = names
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the sections; 0 when every one succeeded, 1 when some failed, 2 without a GPU."""
    args = _parse(argv)
    if not torch.cuda.is_available():
        print(
            "cuda_micro: no CUDA GPU (torch.cuda.is_available() is False); nothing measured",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_NO_GPU
    watchdog = _start_watchdog(args.watchdog)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    report = Report(os.path.abspath(args.out), _meta(device, args.quick))
    ctx = Ctx(device, args.quick, report.meta["l2_bytes"] or DEFAULT_L2_BYTES, report)
    print("cuda_micro: " + ", ".join(f"{k} {v}" for k, v in report.meta.items()), flush=True)
    report.write()
    for name in args.sections:
        section = Section(name)
        report.sections.append(section)
        start = time.perf_counter()
        ctx.deadline = start + BUDGETS[name]
        print(f"\n== {name}", flush=True)
        try:
            SECTIONS[name](ctx, section)
        except Exception:
            section.error = traceback.format_exc()
            print(section.error, file=sys.stderr, flush=True)
        finally:
            section.seconds = time.perf_counter() - start
            _cleanup()
            try:
                report.write()
            except Exception:
                traceback.print_exc()
        for table in section.tables:
            print(render_text(table), flush=True)
        print(f"[{name}: {'FAILED' if section.error else 'ok'}, {section.seconds:.1f} s]", flush=True)
    if watchdog:
        faulthandler.cancel_dump_traceback_later()
    print("\n== summary", flush=True)
    for s in report.sections:
        status = "FAILED: " + s.error.strip().splitlines()[-1] if s.error else "ok"
        print(f"  {s.name} ({s.seconds:.1f} s, {status}) {s.headline}", flush=True)
    print(f"wrote {os.path.join(report.out_dir, JSON_NAME)} and {MD_NAME}", flush=True)
    if not args.no_plots:
        _plot(report.out_dir)
    return 1 if any(s.error for s in report.sections) else 0


def _plot(out_dir: str) -> None:
    """The PNGs of bench.cuda_plots beside the JSON; a plotting failure is reported, not fatal."""
    try:
        from bench import cuda_plots

        cuda_plots.main([os.path.join(out_dir, JSON_NAME), "--out", out_dir])
    except Exception:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
