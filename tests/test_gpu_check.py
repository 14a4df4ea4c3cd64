"""`.ci/gpu_check.py --device cuda` (make gpu-check; `python -m bench all` runs it): the parts a machine
without GPUs can check."""

import argparse
import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # bench/ is a package at the repository root, not installed
sys.path.insert(0, os.path.join(REPO_ROOT, ".ci"))

import gpu_check  # noqa: E402

from bench import SUITES  # noqa: E402

# The two ways in: the CI script itself (make gpu-check) and `python -m bench all`, which runs it.
ENTRIES = {"script": [os.path.join(".ci", "gpu_check.py")], "bench all": ["-m", "bench", "all"]}


def _bench_all(*args, path, entry="bench all"):
    env = dict(os.environ, PATH=path)
    return subprocess.run(
        [sys.executable, *ENTRIES[entry], *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_gpu_exits_2_with_a_clear_message(tmp_path, entry):
    out = tmp_path / "results"
    done = _bench_all("--device", "cuda", "--out", str(out), path=str(tmp_path), entry=entry)  # no nvidia-smi
    assert done.returncode == gpu_check.EXIT_NO_GPU == 2
    assert "no GPU found: nvidia-smi is not installed" in done.stderr
    assert "Nothing was built or measured" in done.stderr
    assert not out.exists()


def test_arguments_are_checked_before_anything_runs(tmp_path):
    done = _bench_all("--suites", "primitives,nope", path=str(tmp_path), entry="script")
    assert done.returncode == 2 and "unknown suite(s) ['nope']" in done.stderr
    done = _bench_all("--device", "cpu", path=str(tmp_path))
    assert done.returncode == 2 and "invalid choice: 'cpu'" in done.stderr
    args = gpu_check._parser().parse_args([])
    assert args.device == "cuda" and not args.no_build
    assert args.suites == [s for s in SUITES if s not in gpu_check.CPU_ONLY] and "pipeline" not in args.suites


SMI = """0, NVIDIA H100 80GB HBM3, 550.54.15, 81559, 9.0
1, NVIDIA H100 80GB HBM3, 550.54.15, 81559, 9.0
2, NVIDIA A100-SXM4-40GB, 550.54.15, 40960, 8.0
garbage line
"""


def test_gpus_are_grouped_by_type():
    gpus = gpu_check.parse_nvidia_smi(SMI)
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[0] == gpu_check.Gpu(0, "NVIDIA H100 80GB HBM3", "550.54.15", 81559, "9.0")
    groups = gpu_check.by_type(gpus)
    assert list(groups) == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"]
    assert [g.index for g in groups["NVIDIA H100 80GB HBM3"]] == [0, 1]
    assert gpu_check.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.slug("NVIDIA A100-SXM4-40GB") == "nvidia-a100-sxm4-40gb"


@pytest.mark.parametrize(
    "outcome, reason",
    [
        (FileNotFoundError(), "nvidia-smi is not installed"),
        (
            subprocess.CompletedProcess([], 9, "", "NVIDIA-SMI has failed because it couldn't communicate"),
            "nvidia-smi failed (exit 9): NVIDIA-SMI has failed",
        ),
        (subprocess.CompletedProcess([], 0, "", ""), "nvidia-smi lists no GPU"),
        (subprocess.CompletedProcess([], 0, SMI, ""), ""),
    ],
)
def test_gpu_query_says_why_none_were_found(outcome, reason):
    def run(*args, **kwargs):
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    gpus, why = gpu_check.query_gpus(run)
    assert why.startswith(reason) and (len(gpus) == 3) == (reason == "")


def test_summary_takes_every_efficiency_and_speedup():
    document = {
        "cases": [
            {"case": "all_gather_linear", "chunks": 2, "efficiency": 0.8, "speedup": {"torch": 1.3, "megatron": None}},
            {"schedule": "oases", "efficiency": None, "speedup_vs_megatron": 1.5, "busy": 0.9},
            {"variant": "aiao", "schedule": "1f1b", "speedup_vs_1f1b": 2, "flag": True},
        ]
    }
    assert gpu_check.summarize("s", document) == [
        ["s", "all_gather_linear", "efficiency", 0.8],
        ["s", "all_gather_linear", "speedup[torch]", 1.3],
        ["s", "oases", "speedup_vs_megatron", 1.5],
        ["s", "1f1b / aiao", "speedup_vs_1f1b", 2.0],
    ]


def test_each_gpu_type_gets_the_environment_report_first(tmp_path):
    # The report a user pastes into a bug report (`oases env`), run by the check's Python before the
    # tests: here with this interpreter, no tests and no suites, so only that step runs.
    args = argparse.Namespace(out=str(tmp_path), no_tests=True, suites=[], quick=False, python=sys.executable)
    gpu = gpu_check.Gpu(0, "NVIDIA H100 80GB HBM3", "550.54.15", 81559, "9.0")
    versions = {"torch": "2.13.0", "cuda": "13.0", "nccl": "2.27.7"}
    assert gpu_check._check_type(args, gpu.name, [gpu], versions, "20261126-000000")
    (written,) = tmp_path.glob("gpu-nvidia-h100-80gb-hbm3-*.json")
    steps = json.loads(written.read_text())["steps"]
    assert [s["step"] for s in steps] == [f"{gpu.name}: oases env"] and steps[0]["exit_code"] == 0
    report = open(steps[0]["log"]).read()
    assert report.startswith("oases env: paste this into a bug report") and "extension (oases._C)" in report
