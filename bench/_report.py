"""What rank 0 writes: tables on stdout, the run's JSON, a PNG of the sweeps, a Chrome trace.

print(render(Table("fused ops", ["case", "t_serial ms"], [["all_gather_linear", 97.1]])))
paths = output_paths(out_dir, "primitives")     # .json, .png, .trace.json with one timestamp
write_json(paths.json, {"meta": ..., "cases": [...]})
plot_panels(panels, paths.png)                   # time vs chunk count, one panel per case
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)


def render(table: Table) -> str:
    cells = [[_cell(v) for v in row] for row in table.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(table.columns)]
    line = "  ".join("-" * w for w in widths)
    out = [table.title, line, "  ".join(c.rjust(w) for c, w in zip(table.columns, widths)), line]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    out += [line] + table.notes
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


@dataclass(frozen=True)
class OutputPaths:
    json: str
    png: str
    trace: str


def output_paths(out_dir: str, suite: str, when: Optional[datetime.datetime] = None) -> OutputPaths:
    stamp = (when or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out_dir, f"{suite}-{stamp}")
    return OutputPaths(base + ".json", base + ".png", base + ".trace.json")


def write_json(path: str, document: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(document, f, indent=1, allow_nan=False)
        f.write("\n")


@dataclass
class Panel:
    """One case: a curve of times against chunk count, and reference times as horizontal lines."""

    title: str
    chunks: list[int]
    curves: dict[str, list[float]]  # name -> seconds per chunk count
    levels: dict[str, Optional[float]]  # name -> seconds (None: not measured)
    best: Optional[int] = None  # chunk count to mark


_LEVEL_STYLES = {
    "t_serial": ("tab:red", "-"),
    "t_compute": ("tab:green", "--"),
    "t_comm": ("tab:blue", "--"),
    "bound": ("black", ":"),
}


def plot_panels(panels: Sequence[Panel], path: str, title: str) -> bool:
    """Time (ms) vs chunk count, one panel per case; False when there is nothing to plot."""
    if not panels:
        return False
    plt = pyplot()

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name, ys in panel.curves.items():
            ax.plot(panel.chunks, [y * 1e3 for y in ys], marker="o", label=name)
        others = iter(["tab:purple", "tab:brown", "tab:pink", "tab:gray"])
        for name, y in panel.levels.items():
            if y is None:
                continue
            color, style = _LEVEL_STYLES[name] if name in _LEVEL_STYLES else (next(others, "tab:gray"), "-.")
            ax.axhline(y * 1e3, color=color, linestyle=style, linewidth=1.2, label=name)
        if panel.best is not None:
            ax.axvline(panel.best, color="0.8", linewidth=6, zorder=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(panel.chunks)
        ax.set_xticklabels([str(c) for c in panel.chunks])
        ax.set_xlabel("chunks per shard")
        ax.set_ylabel("time per call (ms, MAX over ranks)")
        ax.set_ylim(bottom=0)
        ax.set_title(panel.title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display): every suite's plots start here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 110) -> bool:
    """Lay out `fig`, write it to `path` as PNG (making its folder), close it; True (written)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True
