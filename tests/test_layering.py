"""The package's floors: a module imports only from its own floor's package or from floors below.

The order is written once, here (bottom first). Imports are read from the source with ast, anywhere
in a file (inside functions too: a lazy import that dodges a cycle is still an upward import), so
the test needs nothing imported. A floor of several packages keeps them apart: none of them
imports another of the same floor (except on the bottom floor of single-module leaves and the top
floor of the public front).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent / "python_api"
PACKAGE = ROOT / "oases"

FLOORS: tuple[tuple[str, ...], ...] = (
    # leaves: the extension, argument checks, row and shard arithmetic, the cost rules
    (
        "oases._C",
        "oases._checks",
        "oases._deprecated",
        "oases._rows",
        "oases._leaves",
        "oases._sharding",
        "oases._compiled",
        "oases._tiny_config",
        "oases._files",
        "oases._ranges",
        "oases._extension",
        "oases.amp",
        "oases.inputs",
        "oases.costs",
    ),
    ("oases.planner",),  # the planner: the cost rules and argument checks only, no runtime package
    ("oases.launch",),
    ("oases.comm",),
    ("oases.offload", "oases.ops", "oases.dp"),
    ("oases.degrees",),  # per-layer TP degrees: placements, row moves, hooks (oases.nn and the models read them)
    ("oases.nn",),
    ("oases.schedule",),
    ("oases.models",),
    ("oases._step_context",),  # what one oases.train_step runs on: the model, its Stack and Parallelism, once
    ("oases.storage", "oases.training"),  # what is stored (checkpoints, safetensors); the step
    ("oases.pipeline",),
    # the front: oases/__init__.py, the CLI (oases env: its report and link probe in _env_*, _link_probe),
    # oases.integrations (other libraries' training loops: transformers' Trainer), and the old import
    # paths oases.checkpoint and oases.pretrained (their names warn: oases.storage's)
    (
        "oases",
        "oases.__main__",
        "oases.cli",
        "oases.integrations",
        "oases.check_model",
        "oases.plan",
        "oases.env",
        "oases._env_guards",
        "oases._env_report",
        "oases._link_probe",
        "oases.checkpoint",
        "oases.pretrained",
    ),
)
OPEN_FLOORS = (0, len(FLOORS) - 1)  # the leaves and the front: their modules may import one another


def floor_of(module: str) -> tuple[int, str]:
    """(floor, the floor's entry the module belongs to): the longest entry that prefixes it."""
    best: Optional[tuple[int, str]] = None
    for level, entries in enumerate(FLOORS):
        for entry in entries:
            within = module == entry or (entry != "oases" and module.startswith(entry + "."))  # the front: itself
            if within and (best is None or len(entry) > len(best[1])):
                best = (level, entry)
    if best is None:
        raise AssertionError(f"{module}: on no floor; add it to tests/test_layering.FLOORS")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, module) for every oases module the source imports; `from oases import x` is the
    module oases.x where x is one, else the package oases itself."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "oases":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level` - 1 packages up
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "oases":
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                yield node.lineno, candidate if _is_module(candidate) else target


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").exists() or name == "oases._C"


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    level, entry = floor_of(module)
    found = []
    for line, target in imported(source, module, is_package):
        to_level, to_entry = floor_of(target)
        if to_level > level or (to_level == level and to_entry != entry and level not in OPEN_FLOORS):
            found.append(
                f"{module}:{line} imports {target} (floor {to_level} {to_entry}; {module} is on floor {level} {entry})"
            )
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_imports_only_downward():
    found = []
    for path in _modules():
        found += violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not found, "upward or sideways imports:\n" + "\n".join(found)


def test_every_module_is_on_a_floor():
    for path in _modules():
        floor_of(module_name(path))
    with pytest.raises(AssertionError, match="on no floor"):  # a new module must be placed, not default to the front
        floor_of("oases.brand_new")


@pytest.mark.parametrize(
    "module, line",
    [
        ("oases.comm.ring", "from oases.storage import save_checkpoint"),
        ("oases.comm.ring", "def f():\n    from oases.schedule import train_step"),  # lazy: still upward
        ("oases.ops.linear_all_reduce", "from ..nn import layers"),  # relative
        ("oases.nn.layers", "from oases import schedule"),
        ("oases.offload.engine", "import oases.dp.zero"),  # sideways: the same floor, another package
        ("oases.costs.chunks", "import oases"),  # the front is the top floor
    ],
)
def test_an_injected_upward_import_is_found(module, line):
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    source = path.read_text() + "\n" + line + "\n"
    assert violations(path.read_text(), module) == []
    assert len(violations(source, module)) == 1


def test_relative_imports_resolve():
    assert list(imported("from . import ring", "oases.comm", True)) == [(1, "oases.comm.ring")]
    assert list(imported("from .ring import x", "oases.comm.hierarchical", False)) == [(1, "oases.comm.ring")]
    assert list(imported("from ..costs import rate", "oases.comm.ring", False)) == [(1, "oases.costs.rate")]


def test_the_cost_rules_import_neither_torch_nor_oases():
    """oases.costs is the pure floor the planner and the runtime share: no torch, no other oases module."""
    for path in sorted((PACKAGE / "costs").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top != "torch" and (top != "oases" or name.startswith("oases.costs")), (
                    f"{path.name}:{node.lineno} imports {name}"
                )
