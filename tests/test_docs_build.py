"""The documentation site builds with warnings as errors (as `make docs` does): the Markdown pages
of docs/ (quick start, a guide per capability, benchmarks, verified where, design) and the API
reference from the docstrings; a broken link fails it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "docs"


def _has_sphinx() -> bool:
    """Whether Sphinx itself is installed: a bare `sphinx` namespace (left by a sphinxcontrib
    package alone, as on the H200 image of 2026-11) is not Sphinx. Nothing is imported: with
    `sphinx` in sys.modules, scipy's docstring machinery imports sphinx.ext, which breaks
    transformers' imports in the same process."""
    spec = importlib.util.find_spec("sphinx")
    return spec is not None and spec.origin not in (None, "namespace")


pytestmark = pytest.mark.skipif(
    not _has_sphinx(),
    reason="sphinx is not installed in this interpreter (pip install -r requirements-docs.txt, or run `make docs`)",
)


def _build(source: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as `make docs` runs it: the kernels are only imported
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-E",
        "-q",
        "-j",
        "1",
        "-b",
        "html",
        "-d",
        str(tmp_path / "doctrees"),
        str(source),
        str(tmp_path / "html"),
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_site_builds_strict(tmp_path):
    proc = _build(SOURCE, tmp_path)
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    out = tmp_path / "html"

    home = (out / "index.html").read_text()
    assert "Oases documentation" in home
    for page in (
        "quickstart.html",
        "guides/parallelize.html",
        "guides/train-step.html",
        "guides/pipeline.html",
        "guides/offload.html",
        "guides/planner.html",
        "guides/gpu.html",
        "guides/launcher.html",
        "guides/models.html",
        "benchmarks.html",
        "verified.html",
        "design.html",
        "api/index.html",
    ):
        assert (out / page).is_file(), f"{page} was not built"
        assert page in home, f"the home page does not link {page}"
    # a link to a file of the checkout outside docs/ points at it there (from build/docs/)
    assert 'href="../../README.md"' in home
    offload = (out / "guides" / "offload.html").read_text()
    assert "Offload" in offload and 'href="../../../README.md"' in offload

    index = (out / "api" / "index.html").read_text()
    assert "Oases API reference" in index
    for page in ("oases.html", "oases.nn.html", "oases_kernels.html"):
        assert page in index, f"the API index does not link {page}"

    top = (out / "api" / "oases.html").read_text()
    assert 'id="oases.parallelize"' in top and "parallelize" in top
    assert 'id="oases.train_step"' in top
    nn = (out / "api" / "oases.nn.html").read_text()
    assert 'id="oases.nn.ColumnParallelLinear"' in nn


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is a check: with the site's configuration, a page linking a file that does
    not exist fails it."""
    import shutil

    source = tmp_path / "docs"
    source.mkdir()
    shutil.copy(SOURCE / "conf.py", source / "conf.py")
    (source / "index.md").write_text("# Home\n\nSee [the missing guide](no-such-guide.md).\n")
    proc = _build(source, tmp_path)
    assert proc.returncode != 0
    assert "no-such-guide" in proc.stdout + proc.stderr
