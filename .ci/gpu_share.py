"""The multi-rank tier on one GPU: the suite's distributed tests on NCCL, ranks sharing the GPU.

    python .ci/gpu_share.py --out DIR [--device cuda|cpu] [--budget S] [--workers N] [--stages a,b]
    python .ci/gpu_share.py --plot DIR/share.json          # the PNG, where matplotlib is

Each stage runs its test files under pytest with the harness on `--device` (tests/_spawn.py: on
cuda every rank is an NCCL host of its own on the one GPU, as `oases-launch --share-gpu`), worlds of
2 ranks first (OASES_TEST_MAX_RANKS=2). The tests that skipped for having more ranks run last, in
the stage `wide`, and only when every 2-rank test passed (`--wide always` runs them anyway).
`--device cpu` rehearses the same on gloo (the stages' CPU times, the driver itself).

Stages, in order (what matters first comes first; each stage's CPU seconds are in STAGES):

    comm        rings, fused ops (fp32/bf16/fp16, odd shapes, both directions), hierarchical
    layers      Column/Row layers, parallelize on the Hugging Face matrix, vocabulary heads
    schedules   every schedule's exactness: sequence parallel, offload, recomputation, autocast
    dp          GradientSync, ZeroOptimizer, device meshes
    checkpoint  sharded checkpoints, faults, load_pretrained / save_pretrained
    pipeline    gpipe / 1f1b / aiao, preemption gate, tied embeddings, ZeRO inside
    amp         oases.amp.GradScaler
    loops       HF Trainer, TRL, PEFT LoRA, the user's own loop

Writes DIR/share.json: the GPU, torch / CUDA / NCCL versions, the NCCL settings, each stage's
time and exit code, and per test its outcome, time, the skip or failure reason, the worlds it ran
and the c10d operations each rank's main thread issued (OASES_TEST_COMM_LOG; a lower bound: a
background thread's, such as the pipeline's DP sync, are not seen), so a multi-rank test that
passed with 0 is listed. Exit status: 0 when every test that ran passed and every stage finished
(no timeout, no budget spent, no collection error), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTCOMES_VARIABLE = "OASES_SHARE_OUTCOMES"
WIDE_REASON = "beyond OASES_TEST_MAX_RANKS"

# (stage, test files, seconds of the CPU suite's run on this project's 2-core machine, gloo, 2026-11-29:
# 642 s of the suite's 1054; the GPU run's budget is sized from them)
STAGES: list[tuple[str, list[str], int]] = [
    ("comm", ["test_comm", "test_ops", "test_hierarchical", "test_gpu_path"], 21),
    (
        "layers",
        [
            "test_nn",
            "test_parallelize",
            "test_models_matrix",
            "test_user_models",
            "test_parallelize_degrees",
            "test_moe",
            "test_moe_layouts",
            "test_gpt_oss",
            "test_fused_attention_layouts",
            "test_packed_rows",
            "test_unread_projection",
            "test_gradient_invariant",
            "test_meta_build",
            "test_vocab",
            "test_vocab_split",
        ],
        170,
    ),
    (
        "schedules",
        [
            "test_schedule",
            "test_train_step",
            "test_step_context",
            "test_tp_degrees",
            "test_tp_degrees_schedule",
            "test_dropout_training",
            "test_recompute_auto",
            "test_autocast",
            "test_input_checks",
            "test_offload",
            "test_compile",
            "test_exposure",
        ],
        193,
    ),
    ("dp", ["test_dp", "test_device_mesh_groups"], 14),
    (
        "checkpoint",
        [
            "test_checkpoint",
            "test_checkpoint_resume",
            "test_checkpoint_integrity",
            "test_pretrained",  # test_checkpoint_faults: its own forked gloo ranks (SIGKILLed mid-save)
        ],
        21,
    ),
    (
        "pipeline",
        [
            "test_pipeline",
            "test_pipeline_tied",
            "test_pipeline_zero",
            "test_pipeline_dropout",
            "test_pipeline_memory",
            "test_pipeline_eval",
            "test_pipeline_ignore_index",
            "test_pipeline_clip",
        ],
        109,
    ),
    ("amp", ["test_amp"], 10),
    ("loops", ["test_trainer", "test_trl", "test_peft_lora", "test_user_loop", "test_user_story"], 113),
]


# --- the pytest plugin (loaded in the pytest this driver starts: -p gpu_share) ------------------


def pytest_runtest_logreport(report) -> None:
    """One JSON line per test phase (setup, call, teardown)."""
    path = os.environ.get(OUTCOMES_VARIABLE)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        return
    reason = None
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed:
        reason = _last_line(getattr(report, "longreprtext", "") or str(report.longrepr))
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome, "seconds": report.duration}
    line["reason"] = reason
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_collectreport(report) -> None:
    """A module that fails to collect: one failed line under its path (else its tests leave no trace)."""
    path = os.environ.get(OUTCOMES_VARIABLE)
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not report.failed:
        return
    line = {"test": report.nodeid or "collection", "when": "setup", "outcome": "failed", "seconds": 0.0}
    line["reason"] = "collection failed: " + _last_line(str(report.longrepr))
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


# --- the driver ---------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    """Run the chosen stages (or draw a PNG); 0 when every test that ran passed."""
    args = _parser().parse_args(argv)
    if args.plot:
        return plot(args.plot)
    os.makedirs(args.out, exist_ok=True)
    chosen = args.stages.split(",") if args.stages else [name for name, _, _ in STAGES]
    unknown = sorted(set(chosen) - {name for name, _, _ in STAGES})
    if unknown:
        raise SystemExit(f"--stages: unknown {', '.join(unknown)}; expected names of {[n for n, _, _ in STAGES]}")
    start = time.monotonic()
    document: dict[str, Any] = {"device": args.device, "environment": _environment(args.device), "stages": []}
    outcomes = os.path.join(args.out, "outcomes.jsonl")
    calls = os.path.join(args.out, "calls.jsonl")
    for path in (outcomes, calls):
        if os.path.exists(path):
            os.remove(path)
    for name, files, cpu_s in STAGES:
        if name not in chosen:
            continue
        targets = [os.path.join("tests", f"{file}.py") for file in files]
        record = _stage(args, name, targets, {"OASES_TEST_MAX_RANKS": "2"}, start, outcomes, calls)
        document["stages"].append({**record, "cpu_s": cpu_s})
    tests = _tests(outcomes, calls)
    wide = sorted(t["test"] for t in tests.values() if t["outcome"] == "skipped" and WIDE_REASON in (t["reason"] or ""))
    narrow_failed = [t for t in tests.values() if t["outcome"] == "failed"]
    if wide and (args.wide == "always" or not narrow_failed):
        document["stages"].append(_stage(args, "wide", wide, {}, start, outcomes, calls))
    elif wide:
        document["stages"].append(
            {"name": "wide", "rc": 0, "skipped": f"{len(narrow_failed)} test(s) of 2 ranks failed: not run"}
        )
    document["tests"] = sorted(_tests(outcomes, calls).values(), key=lambda t: t["test"])
    document["summary"] = _summary(document["tests"])
    # a stage that did not finish (timeout, budget spent, pytest's own errors: rc other than 0, 1 for
    # failed tests, 5 for none collected) leaves tests unrecorded: the run fails on it too
    document["summary"]["stages_not_finished"] = unfinished(document["stages"])
    document["seconds"] = round(time.monotonic() - start, 1)
    with open(os.path.join(args.out, "share.json"), "w") as out:
        json.dump(document, out, indent=1)
    summary = document["summary"]
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (list, dict)) or v}, indent=1))
    return 0 if summary["failed"] == 0 and not summary["stages_not_finished"] else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu-share"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all stages together")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers per stage (0: none)")
    parser.add_argument("--stages", help="comma-separated stage names (default: all, in order)")
    parser.add_argument("--wide", choices=("after-pass", "always"), default="after-pass")
    parser.add_argument("--plot", metavar="SHARE_JSON", help="draw share.json's PNG beside it and exit")
    return parser


def _stage(args, name: str, targets: list[str], extra: dict[str, str], start: float, outcomes: str, calls: str):
    left = args.budget - (time.monotonic() - start)
    if left < 20:
        print(f"{name}: skipped (budget spent)", flush=True)
        return {"name": name, "skipped": "budget spent"}
    env = dict(os.environ, OASES_TEST_DEVICE=args.device, PYTHONUNBUFFERED="1", **extra)
    env.update({OUTCOMES_VARIABLE: outcomes, "OASES_TEST_COMM_LOG": calls})
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, ".ci"), os.path.join(ROOT, "python_api"), ROOT, env.get("PYTHONPATH", "")]
    )
    command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider", "-p", "gpu_share"]
    command += ["-n", str(args.workers)] if args.workers else []
    began = time.monotonic()
    print(f"===== {name}: {len(targets)} target(s), limit {left:.0f} s", flush=True)
    # a session of its own: on a timeout the whole tree goes (xdist workers, their ranks), not only pytest
    process = subprocess.Popen([*command, *targets], cwd=ROOT, env=env, start_new_session=True)
    try:
        rc: Any = process.wait(timeout=left)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        rc = "timeout"
    seconds = round(time.monotonic() - began, 1)
    print(f"{name}: rc={rc} {seconds}s", flush=True)
    return {"name": name, "targets": targets, "rc": rc, "seconds": seconds, "limits": extra}


def unfinished(stages: list[dict[str, Any]]) -> list[str]:
    """The stages that did not run to their end: no exit code (budget spent), a timeout, or pytest's
    own error (rc other than 0, 1 = tests failed, 5 = none collected)."""
    return [stage["name"] for stage in stages if stage.get("rc", "skipped") not in (0, 1, 5)]


def _tests(outcomes: str, calls: str) -> dict[str, dict[str, Any]]:
    """Per test: the outcome of its last run (a setup starts a run; the first phase that does not
    pass decides it), its time and reason, and the c10d calls of every run it made."""
    tests: dict[str, dict[str, Any]] = {}
    for line in _lines(outcomes):
        if line["when"] == "setup" or line["test"] not in tests:
            tests[line["test"]] = {"test": line["test"], "outcome": "passed", "reason": None, "seconds": 0.0}
        test = tests[line["test"]]
        if test["outcome"] == "passed" and line["outcome"] != "passed":
            test.update(outcome=line["outcome"], reason=line["reason"])
        test["seconds"] = round(test["seconds"] + line["seconds"], 2)
    for line in _lines(calls):
        test = tests.get(line["test"])
        if test is None:
            continue
        runs = test.setdefault("runs", [])
        ranks = line["c10d_calls"]
        runs.append(
            {
                "world_size": line["world_size"],
                "backend": line["backend"],
                "c10d_calls": [sum(rank.values()) if rank else 0 for rank in ranks],
                "ops": sorted({op for rank in ranks if rank for op in rank}),
            }
        )
    for test in tests.values():
        test["c10d_calls"] = sum(sum(run["c10d_calls"]) for run in test.get("runs", []))
    return tests


def _lines(path: str):
    if not os.path.exists(path):
        return
    with open(path) as f:
        for text in f:
            if text.strip():
                yield json.loads(text)


def _summary(tests: list[dict[str, Any]]) -> dict[str, Any]:
    count = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failed", "skipped")}
    ranked = [t for t in tests if t.get("runs")]  # ran ranks through the harness (else single-process)
    count["multi_rank"] = len(ranked)
    count["multi_rank_passed"] = sum(t["outcome"] == "passed" for t in ranked)
    count["ranks_without_c10d"] = sorted(t["test"] for t in ranked if t["c10d_calls"] == 0)
    count["not_run"] = sorted({t["reason"] for t in tests if t["outcome"] == "skipped" and t["reason"]})
    count["failures"] = {t["test"]: t["reason"] for t in tests if t["outcome"] == "failed"}
    return count


def _environment(device: str) -> dict[str, Any]:
    probe = (
        "import json, sys, torch, torch.distributed as dist\n"
        "cuda = torch.cuda.is_available()\n"
        "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,"
        " 'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if cuda else None,"
        " 'gpu': torch.cuda.get_device_name(0) if cuda else None, 'gpus': torch.cuda.device_count() if cuda else 0}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    found = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-400:]}
    found["nccl_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    found["host"] = os.uname().nodename
    return found


def stage_counts(document: dict[str, Any]) -> dict[str, dict[str, int]]:
    """{stage: {"passed": n, "failed": n, "skipped": n}}: a test under the stage of its file, or
    under "wide" when it ran there."""
    stage_of = {}
    for stage in document["stages"]:
        for target in stage.get("targets", []):
            stage_of[target] = stage["name"]
    names = [s["name"] for s in document["stages"]]
    counts = {name: {"passed": 0, "failed": 0, "skipped": 0} for name in names}
    for test in document["tests"]:
        stage = stage_of.get(test["test"]) or stage_of.get(test["test"].split("::")[0], names[0])
        counts.setdefault(stage, {"passed": 0, "failed": 0, "skipped": 0})[test["outcome"]] += 1
    return counts


def plot(path: str) -> int:
    """Stacked bars per stage (passed / failed / skipped) into share.png beside `path`."""
    sys.path.insert(0, ROOT)
    from bench._report import pyplot

    with open(path) as f:
        document = json.load(f)
    counts = stage_counts(document)
    names = list(counts)
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 3.5))
    bottom = [0] * len(names)
    for kind, colour in (("passed", "tab:green"), ("failed", "tab:red"), ("skipped", "tab:gray")):
        values = [counts[name][kind] for name in names]
        axis.bar(names, values, bottom=bottom, color=colour, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    env = document["environment"]
    transport = f"NCCL {env['nccl']}" if env.get("nccl") else "gloo"
    axis.set_title(f"multi-rank tier, {document['device']}: {env.get('gpu') or 'CPU'}, {transport}")
    axis.set_ylabel("tests")
    axis.legend()
    figure.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    figure.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
