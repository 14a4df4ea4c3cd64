"""What rank 0 writes: tables on stdout, the run's JSON, a PNG of the sweeps, a Chrome trace.

print(render(Table("fused ops", ["case", "t_serial ms"], [["all_gather_linear", 97.1]])))
paths = output_paths(out_dir, "primitives")     # .json, .png, .trace.json with one timestamp
write_json(paths.json, {"meta": ..., "cases": [...]})
plot_panels(panels, paths.png)                   # time vs chunk count, one panel per case

A table's rows are lists (one cell per column) or dicts (records: the values under `columns` are
shown, every key goes to the JSON, `Table.as_json`). `render` gives aligned text, `render_markdown`
GitHub markdown; both format cells by `cell` (n/a, yes/no, two decimals or `digits` significant).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[Any] = field(default_factory=list)  # list of cells per column, or dict (a record)
    notes: list[str] = field(default_factory=list)
    digits: Optional[int] = None  # floats: None two decimals, n n significant digits (`cell`)

    def cells(self) -> list[list[str]]:
        """Each row's shown cells, formatted (a record's values under `columns`; a missing one n/a)."""
        return [[cell(v, self.digits) for v in self._shown(row)] for row in self.rows]

    def _shown(self, row: Any) -> Sequence[Any]:
        return [row.get(c) for c in self.columns] if isinstance(row, dict) else row

    def as_json(self) -> dict[str, Any]:
        """{"title", "columns", "rows", "notes"}: records with every key, unformatted."""
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "notes": self.notes}


def render(table: Table) -> str:
    """The table as aligned plain text: title, rule, header, rule, rows, rule, notes."""
    cells = table.cells()
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(table.columns)]
    line = "  ".join("-" * w for w in widths)
    out = [table.title, line, "  ".join(c.rjust(w) for c, w in zip(table.columns, widths)), line]
    out += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    out += [line] + table.notes
    return "\n".join(out)


def render_markdown(table: Table) -> str:
    """The table in GitHub markdown: '### title', header, |---| row, rows ('|' escaped), notes."""

    def escape(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [
        f"### {table.title}",
        "",
        "| " + " | ".join(escape(c) for c in table.columns) + " |",
        "|" + "|".join("---" for _ in table.columns) + "|",
    ]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in table.cells()]
    if table.notes:
        lines.append("")
        lines += [f"- {n}" for n in table.notes]
    return "\n".join(lines) + "\n"


def cell(value: Any, digits: Optional[int] = None) -> str:
    """None n/a, bools yes/no, non-finite floats nan/inf, floats from 1000 up whole, below that
    two decimals (digits None) or `digits` significant digits; the rest str()."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.2f}" if digits is None else f"{value:.{digits}g}"
    return str(value)


def size_label(nbytes: int) -> str:
    """16384 -> '16 KiB', 1 << 20 -> '1 MiB', 3 -> '3 B'."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


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
    """The document as indented JSON (NaN refused: pass `jsonable(document)` to keep it as a string)."""
    write_text(path, json.dumps(document, indent=1, allow_nan=False) + "\n")


def write_text(path: str, text: str) -> None:
    """Write through a temporary file and a rename (making the folder): a reader never sees half a file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def jsonable(value: Any) -> Any:
    """The value with tuples as lists, non-finite floats as strings, other objects as str()."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


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
