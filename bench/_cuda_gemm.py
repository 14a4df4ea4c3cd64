"""cuda_micro's GEMM sections: the Llama layer shapes under TP, chunked GEMMs, Triton against cuBLAS.

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

Times: bench._timing.event_times (CUDA events, the queue kept full, input sets rotated past L2).
The shape and arithmetic helpers are pure (tested on CPU); the sections need a GPU.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from bench._report import cell
from bench._timing import event_times

if TYPE_CHECKING:
    from bench.cuda_micro import Ctx, Section


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


def rand(shape: Sequence[int], dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times scale) of a floating dtype: never zeros."""
    t = torch.randn(tuple(shape), device=device, dtype=dtype)
    return t.mul_(scale) if scale != 1.0 else t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN in out gives NaN)."""
    ref64 = ref.double()
    return float(torch.linalg.vector_norm(out.double() - ref64) / torch.linalg.vector_norm(ref64))


def spin_up(fn: Callable[[], object], seconds: float) -> float:
    """Call fn (a GEMM) until `seconds` of host time passed, synchronizing every 10 calls, so the
    GPU is at its working clocks before anything is timed; returns the seconds spent."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    return time.perf_counter() - start


# ---- chunked_gemm --------------------------------------------------------------------------------


def _matmul_into_slices(device: torch.device) -> Callable[..., torch.Tensor]:
    """torch.matmul when matmul(x[rows], w.t(), out=y[rows]) writes into y's rows in place (checked
    here on a small bf16 case), else torch.mm (checked the same way); raises when neither does."""
    x = rand((96, 64), torch.bfloat16, device)
    w = rand((80, 64), torch.bfloat16, device)
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


def chunked_gemm(ctx: Ctx, section: Section) -> None:
    dev, quick = ctx.device, ctx.quick
    models = (TINY,) if quick else (LLAMA_7B, LLAMA_13B)
    tps = (2,) if quick else (2, 4, 8)
    token_counts = (256,) if quick else (4096, 8192)
    chunk_counts = (1, 2, 4) if quick else (1, 2, 4, 8, 16)
    warmup, iters = (1, 2) if quick else (2, 8)
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
                rand((gemm.M, gemm.K), torch.bfloat16, dev),
                rand((gemm.N, gemm.K), torch.bfloat16, dev),
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
            e = rel_err(y0, ref)
            err = e if math.isnan(e) else max(err, e)  # NaN: some rows were never written
            if math.isnan(err):
                break
        del ref
        issue: dict[str, float] = {}
        times = event_times(
            {f"c{c}": v for c, v in variants.items()}, sets=n_sets, warmup=warmup, iters=iters, issue=issue
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
        f"c={r['chunks']} {cell(r['geomean_eff'], 4)}" for r in summary.rows
    )


# ---- triton_vs_cublas ----------------------------------------------------------------------------


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


def _triton_case(case: KernelCase, device: torch.device, warmup: int, iters: int, ref_rows: int) -> dict[str, Any]:
    import oases_kernels

    g, dt = case.gemm, case.dtype
    x = rand((g.M, g.K), dt, device)
    w = rand((g.N, g.K), dt, device, scale=g.K**-0.5)
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
        acc = rand((g.M, g.N), torch.float32, device)
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
    err_triton = rel_err(rows[:r], ref)
    rows.fill_(float("nan"))
    torch_fn(0)
    err_torch = rel_err(rows[:r], ref)
    times = event_times({"triton": triton_fn, **peers}, warmup=warmup, iters=iters)
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


def triton_vs_cublas(ctx: Ctx, section: Section) -> None:
    import triton

    quick = ctx.quick
    model, tps, tokens = (TINY, (2,), 256) if quick else (LLAMA_7B, (2, 8), 8192)
    warmup, iters = (1, 2) if quick else (2, 10)
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
            table.rows.append(_triton_case(case, ctx.device, warmup, iters, ref_rows=256))
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
