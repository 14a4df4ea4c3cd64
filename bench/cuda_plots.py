"""`python -m bench.cuda_plots RESULTS.json --out DIR`: PNG plots of a bench.cuda_micro results file.

    chunked_gemm.png      per layer (sum of its 4 GEMMs), efficiency t(1 GEMM) / t(c row chunks)
                          against c, one line per (model, TP, tokens); 1.0 = chunking costs nothing
    batched_copies.png    GB/s against the batch's bytes, D2H and H2D, for CopyEngine and the
                          per-tensor peers, one marker per tensor size; the pinned ceiling dashed
    triton_vs_cublas.png  t_torch / t_triton per case (> 1: Triton faster), the 0.9 target dashed

A section missing from the file (or failed) is skipped. Needs matplotlib; no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping, Optional, Sequence

from bench._report import pyplot, save_figure

_CHUNKS = (1, 2, 4, 8, 16)


def _rows(results: Mapping[str, Any], section: str, title_start: str) -> list[dict[str, Any]]:
    """The rows of the first table of `section` whose title starts with `title_start` ([] if none)."""
    body = results.get("sections", {}).get(section) or {}
    if body.get("error"):
        return []
    for table in body.get("tables", []):
        if table.get("title", "").startswith(title_start):
            return list(table.get("rows", []))
    return []


def _pyplot():
    plt = pyplot()

    return plt


def _gpu(results: Mapping[str, Any]) -> str:
    meta = results.get("meta", {})
    return f"{meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}"


def plot_chunked_gemm(results: Mapping[str, Any], path: str) -> bool:
    rows = _rows(results, "chunked_gemm", "chunked_gemm: per layer")
    if not rows:
        return False
    plt = _pyplot()
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in rows if r["model"] == model):
            chunks = [c for c in _CHUNKS if c == 1 or f"eff_c{c}" in r]
            effs = [1.0 if c == 1 else r[f"eff_c{c}"] for c in chunks]
            ax.plot(chunks, effs, marker="o", label=f"TP {r['tp']}, {r['T']} tokens")
        ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(_CHUNKS))
        ax.set_xticklabels([str(c) for c in _CHUNKS])
        ax.set_xlabel("row chunks c")
        ax.set_ylabel("efficiency t(1 GEMM) / t(c GEMMs)")
        ax.set_ylim(0, max(1.15, 1.05 * max((r.get(f"eff_c{c}") or 0) for r in rows for c in _CHUNKS[1:])))
        ax.set_title(f"{model}: a layer's 4 GEMMs, bf16", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Chunked GEMM efficiency ({_gpu(results)})", fontsize=10)
    return save_figure(fig, path)


def _bytes(label: str) -> float:
    """'256 KiB' -> 262144.0."""
    number, unit = label.split()
    return float(number) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def plot_batched_copies(results: Mapping[str, Any], path: str) -> bool:
    rows = _rows(results, "batched_copies", "batched_copies")
    if not rows:
        return False
    ceilings = (results["sections"].get("ceilings", {}).get("info", {}) or {}).get("ceilings", {})
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.4), squeeze=False)
    styles = {
        "engine_GBps": ("CopyEngine (one call)", "tab:red"),
        "to_GBps": ("per tensor .to()", "tab:blue"),
        "copy_GBps": ("per tensor copy_ into preallocated", "tab:green"),
    }
    markers = dict(zip(sorted({r["size"] for r in rows}, key=_bytes), "osD^v*"))  # by tensor size
    for ax, direction in zip(axes[0], ("d2h", "h2d")):
        mine = sorted((r for r in rows if r["dir"] == direction), key=lambda r: _bytes(r["total"]))
        for key, (label, color) in styles.items():
            for i, (size, marker) in enumerate(markers.items()):
                pts = [(_bytes(r["total"]), r[key]) for r in mine if r["size"] == size]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, color=color, marker=marker, linewidth=1, label=label if i == 0 else None)
        if direction in ceilings:
            ax.axhline(ceilings[direction], color="black", linestyle="--", linewidth=1, label="pinned ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes in the batch (16, 64, 256 tensors; marker = tensor size)")
        ax.set_ylabel("GB/s (host-timed: issue to done)")
        ax.set_title(direction.upper(), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    sizes = ", ".join(f"{m} {s}" for s, m in markers.items())
    fig.suptitle(f"Batched copies ({_gpu(results)}); markers: {sizes}", fontsize=9)
    return save_figure(fig, path)


def plot_triton_vs_cublas(results: Mapping[str, Any], path: str) -> bool:
    rows = _rows(results, "triton_vs_cublas", "triton_vs_cublas")
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    labels = [f"{r['kernel']}\n{short.get(r['dtype'], r['dtype'])} TP{r['tp']} {r['gemm']}" for r in rows]
    colors = ["tab:blue" if r["kernel"] == "linear_into" else "tab:orange" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color=colors)
    ax.axhline(0.9, color="black", linestyle="--", linewidth=1, label="target 0.9")
    ax.axhline(1.0, color="0.5", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=6.5)
    ax.set_ylabel("t_torch / t_triton (> 1: Triton faster)")
    shapes = sorted({f"{r['M']}x{r['N']}x{r['K']}" for r in rows})
    ax.set_title(f"Triton kernels vs torch/cuBLAS, {len(shapes)} GEMM shapes (M x N x K) ({_gpu(results)})", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


PLOTS = {
    "chunked_gemm.png": plot_chunked_gemm,
    "batched_copies.png": plot_batched_copies,
    "triton_vs_cublas.png": plot_triton_vs_cublas,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_plots", description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a cuda_micro.json written by python -m bench.cuda_micro")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the PNG files")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    written = [name for name, plot in PLOTS.items() if plot(results, os.path.join(args.out, name))]
    print("wrote " + (", ".join(os.path.join(args.out, n) for n in written) if written else "nothing (no sections)"))
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
