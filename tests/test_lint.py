"""The tree passes its linter and is formatted: `ruff check .` and `ruff format --check .` as configured in
pyproject.toml (the same as `make lint`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> str:
    beside = Path(sys.executable).with_name("ruff")  # the venv's, pinned in requirements.txt
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (requirements.txt pins it: pip install -r requirements.txt)")
    return found


def test_ruff_passes():
    result = subprocess.run(
        [_ruff(), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_tree_is_formatted():
    result = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout[-4000:] + result.stderr[-2000:]


def test_formatter_sees_an_unformatted_file(tmp_path):
    """The formatter's check fails on a file it would change."""
    bad = tmp_path / "bad.py"
    bad.write_text("x = [1,2 ,3]\n")
    result = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "bad.py" in result.stdout + result.stderr, result.stdout


def test_ruff_sees_an_injected_error(tmp_path):
    """The configuration is read and its rules fire: an unused import in a package module fails."""
    bad = tmp_path / "python_api" / "oases" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text('"""A module."""\nimport os\n')
    result = subprocess.run(
        [_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout
