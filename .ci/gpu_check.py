"""`make gpu-check` (`python .ci/gpu_check.py --device cuda`): the whole GPU check in one command.

    1. find the GPUs (nvidia-smi); none: say so and exit 2, before building anything
    2. build oases._C with CUDA in .venv-cuda (.ci/cuda_build.sh --test-deps)
    3. for each GPU type present (GPUs of one name form one group, CUDA_VISIBLE_DEVICES):
         the environment report  (python -m oases.env: what `oases env` shows a user; env.log)
         the test suite on NCCL  (OASES_TEST_DEVICE=cuda python -m pytest -q tests)
         every bench suite       (python -m bench SUITE --nproc <GPUs of the type>)
       then one results file per type, <out>/gpu-<type>-<stamp>.json (GPU name, count, driver,
       CUDA, NCCL and torch versions, each step's exit code and time, the suites' JSON files and
       a summary), and its summary table (overlap efficiency and speedups per op and schedule,
       from the suites' own records) printed and written beside it as .md.

NCCL's streams are made high priority for every run (TORCH_NCCL_HIGH_PRIORITY=1), as
oases.comm.new_group does for the TP groups it makes.

Exit status: 0 every step passed; 1 a step failed (the others still ran); 2 no GPU.
This parent process imports no torch: it drives .venv-cuda's Python. `python -m bench all [options]`
runs this script too (bench/__main__.py hands it its options).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script: bench/ is a package at the repository root
    sys.path.insert(0, REPO_ROOT)

from bench import SUITES  # noqa: E402

EXIT_NO_GPU = 2
DEFAULT_OUT = os.path.join(REPO_ROOT, "bench", "results")
CUDA_VENV_PYTHON = os.path.join(REPO_ROOT, ".venv-cuda", "bin", "python")
_NVIDIA_SMI_QUERY = [
    "nvidia-smi",
    "--query-gpu=index,name,driver_version,memory.total,compute_cap",
    "--format=csv,noheader,nounits",
]
# What .venv-cuda's torch reports about the GPUs and the libraries it runs with.
_PROBE = """
import json, torch
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                  "available": torch.cuda.is_available(), "count": torch.cuda.device_count()}))
"""
_METRIC_PREFIXES = ("efficiency", "speedup")
_LABEL_KEYS = ("case", "op", "schedule", "variant", "peer")


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi lists it."""

    index: int
    name: str
    driver: str
    memory_mib: Optional[int]
    capability: Optional[str]


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap
    --format=csv,noheader,nounits` output; lines that do not parse are skipped."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3 or not fields[0].isdigit():
            continue
        memory = fields[3] if len(fields) > 3 else ""
        capability = fields[4] if len(fields) > 4 and fields[4] not in ("", "[N/A]") else None
        gpus.append(Gpu(int(fields[0]), fields[1], fields[2], int(memory) if memory.isdigit() else None, capability))
    return gpus


def query_gpus(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> tuple[list[Gpu], str]:
    """(the GPUs nvidia-smi lists, why none were found: "" when some were)."""
    try:
        done = run(_NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return [], "nvidia-smi is not installed (no NVIDIA driver on this machine)"
    except subprocess.TimeoutExpired:
        return [], "nvidia-smi did not answer within 60 s"
    if done.returncode != 0:
        message = (done.stderr or done.stdout or "").strip().splitlines()
        return [], f"nvidia-smi failed (exit {done.returncode}): {message[0] if message else 'no output'}"
    gpus = parse_nvidia_smi(done.stdout)
    return gpus, "" if gpus else "nvidia-smi lists no GPU"


def by_type(gpus: Sequence[Gpu]) -> dict[str, list[Gpu]]:
    """GPUs grouped by name, in the order of their first index."""
    groups: dict[str, list[Gpu]] = {}
    for gpu in sorted(gpus, key=lambda g: g.index):
        groups.setdefault(gpu.name, []).append(gpu)
    return groups


def slug(name: str) -> str:
    """A file-name-safe form of a GPU name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def summarize(suite: str, document: dict[str, Any]) -> list[list[Any]]:
    """Summary rows [suite, case, metric, value] from a suite's JSON: every numeric efficiency or
    speedup field of every case (nested {peer: x} speedups flattened), labelled by the case's
    identifying fields."""
    rows = []
    for case in document.get("cases", []):
        label = " / ".join(str(case[k]) for k in _LABEL_KEYS if isinstance(case.get(k), (str, int)))
        for key, value in case.items():
            if not key.startswith(_METRIC_PREFIXES):
                continue
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for peer, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    rows.append([suite, label or "-", key if peer is None else f"{key}[{peer}]", float(v)])
    return rows


# Suites that cannot run on GPUs yet, and why (left out of the default list).
CPU_ONLY = {
    "pipeline": "bench pipeline measures the emulated CPU cluster (gloo); the pipeline's CUDA path is "
    "checked by the test suite on NCCL (tests/test_pipeline.py)"
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python .ci/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("cuda",),
        default="cuda",
        help="the devices to check (only cuda: the CPU suites run one by one, see README)",
    )
    parser.add_argument(
        "--suites",
        default=",".join(s for s in SUITES if s not in CPU_ONLY),
        type=_suite_list,
        help="comma-separated bench suites (default: every suite but the CPU-only ones: "
        + "; ".join(f"{s}: {why}" for s, why in CPU_ONLY.items())
        + ")",
    )
    parser.add_argument("--quick", action="store_true", help="pass --quick to every suite (small shapes)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="where to write results")
    parser.add_argument("--no-build", action="store_true", help="use .venv-cuda as it is (skip make cuda-build)")
    parser.add_argument("--no-tests", action="store_true", help="skip the test suite on NCCL")
    parser.add_argument(
        "--python", default=CUDA_VENV_PYTHON, help="the Python with the CUDA torch (default: .venv-cuda/bin/python)"
    )
    return parser


def _suite_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SUITES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown suite(s) {unknown or text!r}; choose from {', '.join(SUITES)}")
    return names


def _no_gpu(reason: str) -> int:
    print(
        f"gpu-check: no GPU found: {reason}. Nothing was built or measured. "
        "Run this on a machine with NVIDIA GPUs and a driver (`make gpu-check`).",
        file=sys.stderr,
    )
    return EXIT_NO_GPU


def _step(name: str, command: list[str], env: dict[str, str], log: Optional[str] = None) -> dict[str, Any]:
    print(f"gpu-check: {name}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    if log:
        with open(log, "w") as f:
            code = subprocess.run(command, env=env, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    else:
        code = subprocess.run(command, env=env, cwd=REPO_ROOT).returncode
    seconds = round(time.monotonic() - start, 1)
    print(f"gpu-check: {name}: exit {code} after {seconds} s", flush=True)
    return {"step": name, "command": command, "exit_code": code, "seconds": seconds, "log": log}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The check on every GPU type present; the exit status of the module docstring."""
    args = _parser().parse_args(argv)
    gpus, reason = query_gpus()
    if not gpus:
        return _no_gpu(reason)
    if not args.no_build:
        build = _step(
            "cuda-build", ["bash", os.path.join(REPO_ROOT, ".ci", "cuda_build.sh"), "--test-deps"], dict(os.environ)
        )
        if build["exit_code"] != 0:
            return 1
    probe = subprocess.run([args.python, "-c", _PROBE], capture_output=True, text=True, cwd="/")
    if probe.returncode != 0:
        print(f"gpu-check: {args.python} cannot import torch:\n{probe.stderr}", file=sys.stderr)
        return 1
    versions = json.loads(probe.stdout.strip().splitlines()[-1])
    if not versions["available"]:
        return _no_gpu(
            f"nvidia-smi lists {len(gpus)} GPU(s), but torch {versions['torch']} sees none "
            "(torch.cuda.is_available() is False: driver too old for CUDA "
            f"{versions['cuda']}, or a CPU build of torch?)"
        )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    failed = False
    for name, group in by_type(gpus).items():
        failed |= not _check_type(args, name, group, versions, stamp)
    return 1 if failed else 0


def _check_type(args, name: str, group: list[Gpu], versions: dict[str, Any], stamp: str) -> bool:
    """Tests and benches on the GPUs of one type; writes its results file. True if all passed."""
    out_dir = os.path.join(os.path.abspath(args.out), f"gpu-{slug(name)}-{stamp}")
    os.makedirs(out_dir, exist_ok=True)
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=",".join(str(g.index) for g in group),
        OASES_TEST_DEVICE="cuda",
        TORCH_NCCL_HIGH_PRIORITY="1",
    )
    steps = [_step(f"{name}: oases env", [args.python, "-m", "oases.env"], env, log=os.path.join(out_dir, "env.log"))]
    if not args.no_tests:
        steps.append(
            _step(
                f"{name}: tests on NCCL",
                [args.python, "-m", "pytest", "-q", "tests"],
                env,
                log=os.path.join(out_dir, "tests.log"),
            )
        )
    summary: list[list[Any]] = []
    suite_files = {}
    for suite in args.suites:
        command = [args.python, "-m", "bench", suite, "--nproc", str(len(group)), "--out", out_dir]
        steps.append(
            _step(
                f"{name}: bench {suite}",
                command + (["--quick"] if args.quick else []),
                env,
                log=os.path.join(out_dir, f"{suite}.log"),
            )
        )
        written = sorted(
            path for path in glob.glob(os.path.join(out_dir, f"{suite}-*.json")) if not path.endswith(".trace.json")
        )
        suite_files[suite] = written[-1] if written else None
        if written:
            with open(written[-1]) as f:
                summary += summarize(suite, json.load(f))
    document = {
        "gpu": {
            "name": name,
            "count": len(group),
            "indices": [g.index for g in group],
            "driver": group[0].driver,
            "memory_mib": group[0].memory_mib,
            "capability": group[0].capability,
        },
        "versions": {"torch": versions["torch"], "cuda": versions["cuda"], "nccl": versions["nccl"]},
        "created": stamp,
        "steps": steps,
        "suite_files": suite_files,
        "summary": [dict(zip(("suite", "case", "metric", "value"), row)) for row in summary],
        "devices": [asdict(g) for g in group],
    }
    base = os.path.join(os.path.abspath(args.out), f"gpu-{slug(name)}-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(document, f, indent=1)
    table = _summary_markdown(document)
    with open(base + ".md", "w") as f:
        f.write(table)
    print(table, flush=True)
    print(f"gpu-check: wrote {base}.json and {base}.md", flush=True)
    return all(s["exit_code"] == 0 for s in steps)


def _summary_markdown(document: dict[str, Any]) -> str:
    gpu, v = document["gpu"], document["versions"]
    lines = [
        f"# {gpu['count']} x {gpu['name']} (driver {gpu['driver']}, CUDA {v['cuda']}, NCCL {v['nccl']}, "
        f"torch {v['torch']})",
        "",
        "| step | exit | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {s['step']} | {s['exit_code']} | {s['seconds']} |" for s in document["steps"]]
    lines += ["", "| suite | case | metric | value |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['suite']} | {r['case']} | {r['metric']} | {r['value']:.2f} |" for r in document["summary"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
