"""Packaging as a user meets it: one version number, a non-editable install from a clean copy of
the tree, and what a build says when it cannot import torch (see pyproject.toml for why torch is
not a build requirement)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import oases

REPO = Path(__file__).resolve().parent.parent
INIT = REPO / "python_api" / "oases" / "__init__.py"
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"[ \t]*(?:#.*)?$', re.M)
VERSION_LITERAL = re.compile(r"""["']\d+\.\d+\.\d+[^"']*["']""")  # a quoted "X.Y.Z..." string


def _run(cmd, cwd, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _clean_copy(dest: Path) -> Path:
    """The tree as a fresh clone of it would be, uncommitted work included: tracked files that
    still exist and untracked files git does not ignore (no build/, no built oases._C)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to list its files")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO)
    assert listed.returncode == 0, listed.stderr
    for rel in sorted(set(filter(None, listed.stdout.split("\0")))):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    assert not list(dest.rglob("_C*.so")), "the copy must not carry a built extension"
    return dest


# (a) one version number -------------------------------------------------------------------------


def test_version_is_written_once():
    assert VERSION_LINE.findall(INIT.read_text()) == [oases.__version__]
    assert INIT.read_text().count(oases.__version__) == 1
    for name in ("setup.py", "pyproject.toml"):
        text = (REPO / name).read_text()
        assert not VERSION_LITERAL.findall(text), f"{name} writes a version of its own"
    assert not re.search(r"^\s*version\s*=", (REPO / "pyproject.toml").read_text(), re.M)


def test_setup_py_reports_the_package_version():
    out = _run([sys.executable, "setup.py", "--version"], REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == oases.__version__


def test_changelog_names_the_current_version():
    headings = re.findall(r"^## \[([^\]]+)\]", (REPO / "CHANGELOG.md").read_text(), re.M)
    released = [h for h in headings if h != "Unreleased"]
    assert released and released[0] == oases.__version__


# (b) a non-editable install from a clean copy ---------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    os.environ.get("OASES_TEST_PACKAGING") != "1",
    reason="builds the extension once more (1.5-5 min): `make test-packaging` (CI) runs it",
)
def test_non_editable_install_from_a_clean_copy(tmp_path):
    """`pip install --no-build-isolation .` (not -e) into an empty target, then import it there.
    Uses this interpreter's torch; OASES_BUILD_CUDA=0 and CFLAGS=-g0 keep the build short (about
    a minute and a half on 2 idle cores: compiling against torch's headers dominates)."""
    if _run([sys.executable, "-m", "pip", "--version"], REPO).returncode != 0:
        pytest.skip("pip is not available to this interpreter")
    src = _clean_copy(tmp_path / "src")
    target = tmp_path / "target"
    env = dict(os.environ, OASES_BUILD_CUDA="0", CFLAGS="-g0", MAX_JOBS="2")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "--no-cache-dir",
        "--target",
        str(target),
        ".",
    ]
    built = _run(cmd, src, env=env, timeout=570)
    assert built.returncode == 0, (built.stdout + built.stderr)[-6000:]

    # Outside any checkout, with only the target on the path ahead of site-packages (which holds
    # torch and, in a development venv, an editable oases the target must win over).
    probe = textwrap.dedent("""
        import json, torch, oases, oases_kernels
        from oases import _extension
        C = _extension.compiled()
        x = torch.arange(6, dtype=torch.float32)
        slab = torch.zeros(32, dtype=torch.uint8)
        y = torch.empty_like(x)
        C.pack([x], slab, [8])
        C.unpack(slab, [y], [8])
        print(json.dumps({"version": oases.__version__, "oases": oases.__file__,
                          "kernels": oases_kernels.__file__, "available": _extension.is_available(),
                          "C": C.__file__, "roundtrip": bool(torch.equal(x, y)),
                          "built_for": C.build_info()["torch"], "torch": torch.__version__}))
    """)
    run_env = dict(os.environ, PYTHONPATH=str(target))
    run_env.pop("PYTHONSTARTUP", None)
    ran = _run([sys.executable, "-c", probe], tmp_path, env=run_env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["version"] == oases.__version__
    for key in ("oases", "kernels", "C"):
        assert Path(got[key]).resolve().is_relative_to(target.resolve()), (key, got[key])
    assert got["available"] and got["roundtrip"]
    assert got["built_for"] == got["torch"].split("+")[0]  # TORCH_VERSION has no local tag (+cpu)

    dist = target / f"oases-{oases.__version__}.dist-info"
    metadata = (dist / "METADATA").read_text()
    assert f"\nVersion: {oases.__version__}\n" in metadata
    assert "\nLicense: MIT\n" in metadata or "\nLicense-Expression: MIT\n" in metadata
    assert (dist / "licenses" / "LICENSE").read_text() == (REPO / "LICENSE").read_text()
    assert {"oases", "oases-launch"} <= {p.name for p in (target / "bin").iterdir()}


# (c) a build that cannot import torch -----------------------------------------------------------


def _assert_says_what_to_do(output: str) -> None:
    assert "Oases could not be built: `import torch` failed" in output, output
    assert "pip install --no-build-isolation ." in output, output
    assert "Traceback" not in output, output


def test_setup_py_without_torch_says_what_to_do(tmp_path):
    """An interpreter whose `import torch` fails as it does when torch is not installed: a
    `torch` package ahead on PYTHONPATH that raises ModuleNotFoundError."""
    shadow = tmp_path / "no_torch" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n')
    env = dict(os.environ, PYTHONPATH=str(shadow.parent))
    check = _run([sys.executable, "-c", "import torch"], tmp_path, env=env)
    assert check.returncode != 0 and "No module named 'torch'" in check.stderr
    # Run on a clean copy so a failing build could never leave files in the checkout.
    src = _clean_copy(tmp_path / "src")
    out = _run([sys.executable, "setup.py", "bdist_wheel"], src, env=env)
    assert out.returncode == 1
    _assert_says_what_to_do(out.stdout + out.stderr)
    assert not (src / "build").exists()


def test_plain_pip_install_says_to_disable_build_isolation(tmp_path):
    """`pip install .` builds in an isolated environment without torch: it must fail fast with the
    same message, not download a torch. Skipped where pip cannot fetch setuptools for that
    environment (no index reachable)."""
    if _run([sys.executable, "-m", "pip", "--version"], REPO).returncode != 0:
        pytest.skip("pip is not available to this interpreter")
    src = _clean_copy(tmp_path / "src")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-cache-dir",
        "--target",
        str(tmp_path / "target"),
        ".",
    ]
    out = _run(cmd, src, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-4000:]
    if "Oases could not be built" not in text and "Installing build dependencies" in text:
        pytest.skip("pip could not set up the isolated build environment here:\n" + text[-2000:])
    _assert_says_what_to_do(text)
    assert "Getting requirements to build wheel" in text  # failed before any compiling
    assert not (tmp_path / "target").exists() or not any((tmp_path / "target").iterdir())
