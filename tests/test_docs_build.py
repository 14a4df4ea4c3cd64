"""The API reference builds from the docstrings with warnings as errors (as `make docs` does),
and documents the public API: the index, and the page of `oases` with `oases.parallelize` on it."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "docs" / "api"



def _has_sphinx() -> bool:
    """Whether Sphinx itself is installed: a bare `sphinx` namespace (left by a sphinxcontrib
    package alone, as on the H200 image of 2026-11) is not Sphinx. Nothing is imported: with
    `sphinx` in sys.modules, scipy's docstring machinery imports sphinx.ext, which breaks
    transformers' imports in the same process."""
    spec = importlib.util.find_spec("sphinx")
    return spec is not None and spec.origin not in (None, "namespace")


pytestmark = pytest.mark.skipif(not _has_sphinx(),
                                reason="sphinx is not installed in this interpreter "
                                       "(pip install -r requirements-docs.txt, or run `make docs`)")


def test_api_reference_builds_strict(tmp_path):
    out = tmp_path / "html"
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as `make docs` runs it: the kernels are only imported
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-j", "1", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(SOURCE), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"

    index = (out / "index.html").read_text()
    assert "Oases API reference" in index
    for page in ("oases.html", "oases.nn.html", "oases_kernels.html"):
        assert page in index, f"the index does not link {page}"

    top = (out / "oases.html").read_text()
    assert 'id="oases.parallelize"' in top and "parallelize" in top
    assert 'id="oases.train_step"' in top
    nn = (out / "oases.nn.html").read_text()
    assert 'id="oases.nn.ColumnParallelLinear"' in nn
