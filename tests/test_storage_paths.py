"""oases.storage is the one home of what is stored. The old import paths oases.checkpoint and
oases.pretrained answer with its objects for one release, each name warning; `oases.<name>` does
not warn; and nothing in the repository imports through an old path (so the suite does not warn)."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import oases

REPO = Path(__file__).resolve().parent.parent
OLD = {  # the old module: the names it exported
    "oases.checkpoint": "full_state_dict load_full_state_dict save_checkpoint load_checkpoint verify_checkpoint".split()
    + ["CheckpointState"],
    "oases.pretrained": "load_pretrained save_pretrained save_adapter".split(),
}
GONE = ("oases._dcp", "oases._hf_files")  # private modules, moved into oases.storage


@pytest.mark.parametrize("module, name", [(module, name) for module, names in OLD.items() for name in names])
def test_an_old_path_warns_and_gives_the_storage_object(module, name):
    old = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"^{module}\.{name} is deprecated: use oases\.storage\.{name}$"):
        got = getattr(old, name)
    assert got is getattr(oases.storage, name)


def test_the_public_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for names in OLD.values():
            for name in names:
                assert getattr(oases, name) is getattr(oases.storage, name)
        from oases.storage import CheckpointState, load_pretrained  # noqa: F401


def test_an_unknown_name_of_an_old_path_raises():
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        importlib.import_module("oases.checkpoint").nothing


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def test_nothing_imports_through_an_old_path():
    thin = {REPO / "python_api" / "oases" / "checkpoint.py", REPO / "python_api" / "oases" / "pretrained.py"}
    found = []
    for folder in ("python_api", "tests", "bench", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path in thin or "__pycache__" in path.parts:
                continue
            for line, name in _imports(path):
                if any(name == old or name.startswith(old + ".") for old in (*OLD, *GONE)):
                    found.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not found, "\n".join(found)
