"""The multi-rank tier's driver (.ci/gpu_share.py), on what a CPU can check: its stages cover every
multi-rank test file in order, and its report reads pytest's phases and the harness's c10d log
right (the last run of a test decides; skips for rank count go to the wide stage)."""

import json
import os
import re
import sys
from types import SimpleNamespace

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, ".ci"))

import gpu_share  # noqa: E402


def _read(folder, name):
    with open(os.path.join(folder, name)) as f:
        return f.read()


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_stages_cover_every_multi_rank_test_file_once():
    staged = [file for _, files, _ in gpu_share.STAGES for file in files]
    assert len(staged) == len(set(staged))
    tests = os.path.join(REPO_ROOT, "tests")
    using_ranks = {
        name[:-3]
        for name in os.listdir(tests)
        if name.startswith("test_") and re.search(r"^from _spawn import .*\brun_ranks\b", _read(tests, name), re.M)
    }
    # bench suites (subprocess benches on --device cpu), the CUDA-only files and the examples run elsewhere
    elsewhere = {"test_bench", "test_cuda", "test_examples", "test_memory", "test_autocast_memory"}
    assert using_ranks - elsewhere <= set(staged), sorted(using_ranks - elsewhere - set(staged))
    assert [name for name, _, _ in gpu_share.STAGES][:2] == ["comm", "layers"]


def test_report_takes_each_tests_last_run_and_its_c10d_calls(tmp_path):
    def phase(test, when, outcome="passed", reason=None, seconds=1.0):
        return {"test": test, "when": when, "outcome": outcome, "seconds": seconds, "reason": reason}

    wide = "tests/test_a.py::test_wide"
    outcomes = _write(
        tmp_path / "outcomes.jsonl",
        [
            *(phase("tests/test_a.py::test_ok", w) for w in ("setup", "call", "teardown")),
            phase(wide, "setup"),
            phase(wide, "call", "skipped", "4 ranks: beyond OASES_TEST_MAX_RANKS=2"),
            phase(wide, "teardown"),
            phase("tests/test_a.py::test_bad", "setup"),
            phase("tests/test_a.py::test_bad", "call", "failed", "AssertionError: no"),
            phase("tests/test_a.py::test_bad", "teardown"),
            phase("tests/test_a.py::test_cpu", "setup", "skipped", "CPU harness only: gloo's threads"),
            phase("tests/test_a.py::test_cpu", "teardown"),
            *(phase(wide, w) for w in ("setup", "call", "teardown")),  # the wide stage's run passes
        ],
    )
    calls = _write(
        tmp_path / "calls.jsonl",
        [
            {"test": "tests/test_a.py::test_ok", "world_size": 2, "backend": "nccl", "c10d_calls": [{"send": 3}, {}]},
            {"test": wide, "world_size": 4, "backend": "nccl", "c10d_calls": [{"allreduce_": 1}] * 4},
            {"test": "tests/test_a.py::test_bad", "world_size": 2, "backend": "nccl", "c10d_calls": [{}, {}]},
        ],
    )
    tests = gpu_share._tests(outcomes, calls)
    assert {name: t["outcome"] for name, t in tests.items()} == {
        "tests/test_a.py::test_ok": "passed",
        wide: "passed",
        "tests/test_a.py::test_bad": "failed",
        "tests/test_a.py::test_cpu": "skipped",
    }
    assert tests["tests/test_a.py::test_ok"]["c10d_calls"] == 3 and tests[wide]["c10d_calls"] == 4
    assert tests[wide]["seconds"] == 3.0  # the last run's phases only
    summary = gpu_share._summary(list(tests.values()))
    assert (summary["passed"], summary["failed"], summary["skipped"], summary["multi_rank"]) == (2, 1, 1, 3)
    assert summary["ranks_without_c10d"] == ["tests/test_a.py::test_bad"]
    assert summary["not_run"] == ["CPU harness only: gloo's threads"]
    assert summary["failures"] == {"tests/test_a.py::test_bad": "AssertionError: no"}


def test_plugin_writes_one_line_per_phase_with_its_reason(tmp_path, monkeypatch):
    path = tmp_path / "outcomes.jsonl"
    monkeypatch.setenv(gpu_share.OUTCOMES_VARIABLE, str(path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    skipped = SimpleNamespace(
        nodeid="t::a", when="setup", outcome="skipped", duration=0.1, skipped=True, failed=False,
        longrepr=("f.py", 3, "Skipped: CPU harness only: x"),
    )  # fmt: skip
    failed = SimpleNamespace(
        nodeid="t::b", when="call", outcome="failed", duration=0.2, skipped=False, failed=True,
        longreprtext="trace\nE   AssertionError: 1 != 2\n", longrepr=None,
    )  # fmt: skip
    gpu_share.pytest_runtest_logreport(skipped)
    gpu_share.pytest_runtest_logreport(failed)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker writes nothing: the controller does
    gpu_share.pytest_runtest_logreport(failed)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["test"], x["outcome"], x["reason"]) for x in lines] == [
        ("t::a", "skipped", "CPU harness only: x"),
        ("t::b", "failed", "E   AssertionError: 1 != 2"),
    ]


def test_a_stage_that_did_not_finish_fails_the_run():
    """Tests a stage never reached leave no outcome: the run fails on the stage itself."""
    stages = [
        {"name": "comm", "rc": 0},
        {"name": "layers", "rc": 1},  # tests failed: they are in the report
        {"name": "dp", "rc": 5},  # nothing collected
        {"name": "schedules", "rc": "timeout"},
        {"name": "pipeline", "rc": 2},  # interrupted, or a collection error
        {"name": "amp", "skipped": "budget spent"},
    ]
    assert gpu_share.unfinished(stages) == ["schedules", "pipeline", "amp"]


def test_plot_counts_each_stage_and_the_wide_one(tmp_path):
    """--plot: one bar per stage, the wide stage's tests counted there, not under their file's stage."""
    wide = "tests/test_a.py::test_wide[4]"
    document = {
        "device": "cuda",
        "environment": {"gpu": "H200", "nccl": "2.28.9"},
        "stages": [{"name": "comm", "targets": ["tests/test_a.py"]}, {"name": "wide", "targets": [wide]}],
        "tests": [
            {"test": "tests/test_a.py::test_ok", "outcome": "passed"},
            {"test": "tests/test_a.py::test_bad", "outcome": "failed"},
            {"test": wide, "outcome": "passed"},
        ],
    }
    assert gpu_share.stage_counts(document) == {
        "comm": {"passed": 1, "failed": 1, "skipped": 0},
        "wide": {"passed": 1, "failed": 0, "skipped": 0},
    }
    path = tmp_path / "share.json"
    path.write_text(json.dumps(document))
    assert gpu_share.main(["--plot", str(path)]) == 0
    assert (tmp_path / "share.png").stat().st_size > 0
