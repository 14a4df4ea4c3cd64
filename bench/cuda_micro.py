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
than running, which then shows; bench._timing.event_times). Where one call's inputs fit in L2, k
input sets are rotated (call i reads set i % k; k sets hold > 3x L2) so every call reads its
operands from HBM.

    ceilings          d2d copy, bf16 matmul, pinned H2D / D2H peaks     (bench._cuda_copies)
    chunked_gemm      Llama layer GEMMs under TP, split into row chunks (bench._cuda_gemm)
    triton_vs_cublas  oases_kernels against torch's cuBLAS calls        (bench._cuda_gemm)
    batched_copies    oases.offload.CopyEngine against per-tensor copies (bench._cuda_copies)
    stream_priority   a small op's latency on a high-priority stream    (bench._cuda_copies)

Each section's tables are bench._report tables of records (rows are dicts: the shown columns,
plus keys only the JSON has), printed by bench._report.render, written as markdown by
render_markdown and into the JSON by Table.as_json (non-finite floats as strings: jsonable).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from bench import _cuda_copies, _cuda_gemm
from bench._report import GIB, MIB, Table, cell, jsonable, render, render_markdown, write_json, write_text

EXIT_NO_GPU = 2
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "bench", "results")
JSON_NAME, MD_NAME = "cuda_micro.json", "cuda_micro.md"
DEFAULT_L2_BYTES = 50 * MIB  # when the device properties do not say
DIGITS = 4  # significant digits of the tables' floats (from µs latencies to TB/s)


# ---- what a section produces ------------------------------------------------------------------------


@dataclass
class Section:
    name: str
    tables: list[Table] = field(default_factory=list)  # rows are records (dicts)
    info: dict[str, Any] = field(default_factory=dict)  # section-level facts (paths, ranges, checks)
    headline: str = ""  # one line for the final summary
    error: Optional[str] = None  # the traceback, when the section raised
    seconds: Optional[float] = None

    def table(self, title: str, columns: Sequence[str], notes: Sequence[str] = ()) -> Table:
        t = Table(title, list(columns), [], list(notes), digits=DIGITS)
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
                    "tables": [t.as_json() for t in s.tables],
                }
                for s in self.sections
            },
        }

    def write(self) -> None:
        """Rewrite DIR/cuda_micro.json and .md (each through a temporary file and a rename)."""
        write_json(os.path.join(self.out_dir, JSON_NAME), jsonable(self.document()))
        write_text(os.path.join(self.out_dir, MD_NAME), render_markdown_report(self))


def render_markdown_report(report: Report) -> str:
    lines = ["# cuda_micro", ""]
    lines += [f"- {k}: {cell(v, DIGITS)}" for k, v in report.meta.items()]
    lines.append("")
    for s in report.sections:
        status = "FAILED" if s.error else "ok"
        lines += [f"## {s.name} ({status}, {cell(s.seconds, DIGITS)} s)", ""]
        if s.headline:
            lines += [s.headline, ""]
        if s.info:
            lines += [f"- {k}: {cell(v, DIGITS)}" for k, v in s.info.items()] + [""]
        lines += [render_markdown(t) for t in s.tables]
        if s.error:
            lines += ["```", s.error.rstrip(), "```", ""]
    return "\n".join(lines)


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


# ---- the run ----------------------------------------------------------------------------------------


SECTIONS: dict[str, Callable[[Ctx, Section], None]] = {
    "ceilings": _cuda_copies.ceilings,
    "chunked_gemm": _cuda_gemm.chunked_gemm,
    "triton_vs_cublas": _cuda_gemm.triton_vs_cublas,
    "batched_copies": _cuda_copies.batched_copies,
    "stream_priority": _cuda_copies.stream_priority,
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
            print(render(table), flush=True)
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
