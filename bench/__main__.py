"""`python -m bench <suite> [--device D] [--nproc N] [--bandwidth B] [--topology T | --hosts H [--intra-bandwidth B]] [--quick] [--out DIR]`.

Outside a distributed launch this re-launches itself on N ranks:

    python -m oases.launch --nproc N --threads K [--bandwidth B --topology T] -m bench <same args>

(torchrun when oases.launch is not installed, unshaped only). Inside a launch (RANK is set) it
runs the suite on this rank; rank 0 prints the tables and writes the JSON, PNG and trace.

`--device` picks where every rank runs (bench._context.setup; the ranks get the same command line):

    auto   (default) cuda:LOCAL_RANK on NCCL when torch sees a GPU, else the CPU on gloo
    cpu    the CPU on gloo, even where GPUs exist: the ranks are started with CUDA_VISIBLE_DEVICES=""
           (none of them touches a GPU), so N ranks share the CPU cores of a one-GPU machine
    cuda   cuda:LOCAL_RANK on NCCL; refused before any rank starts when torch sees no GPU, or when
           --nproc exceeds the GPUs (NCCL cannot run two ranks on one GPU)

`--share-gpu` (with cuda, or auto on a GPU) runs every rank on GPU 0 over NCCL, each rank a host of
its own (oases-launch --share-gpu): a correctness mode for a machine with one GPU. Its JSON says
`"shared_gpu": N` in `device`; its timings are not speedups (the ranks' kernels take turns).

`python -m bench all --device cuda` is the GPU check (build, tests on NCCL, every suite): it runs
.ci/gpu_check.py (`make gpu-check`) with the options after `all`.
"""  # noqa: E501 (its first line is argparse's description: kept whole)

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import subprocess
import sys
from types import ModuleType
from typing import Optional, Sequence

from bench import SUITES

MIN_WARMUP, MIN_ITERS = 2, 5  # as bench._timing (not imported here: it imports torch)
DEVICES = ("auto", "cpu", "cuda")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "bench", "results")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    """The command line, every suite's own options included (the launching parent checks them
    all before it starts the ranks, at the cost of importing torch)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto (default): cuda + NCCL when a GPU is visible, else cpu + gloo; cpu: gloo on "
        "the CPU even where GPUs exist; cuda: NCCL, one GPU per rank (refused without a GPU "
        "or with more ranks than GPUs)",
    )
    common.add_argument("--nproc", type=_positive_int, default=2, help="ranks to launch (default: 2)")
    common.add_argument(
        "--share-gpu",
        action="store_true",
        help="with cuda: every rank on GPU 0 over NCCL sockets (oases-launch --share-gpu); a "
        "correctness mode for one GPU, its timings are not speedups",
    )
    common.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="shape the links to RATE, tc syntax (250mbit, 1gbit, 8gbit); default unshaped",
    )
    common.add_argument(
        "--topology",
        choices=("shared", "switch"),
        default="shared",
        help="shaped-link topology, see oases.launch (default: shared)",
    )
    common.add_argument(
        "--hosts",
        type=_positive_int,
        default=1,
        help="emulated servers (oases-launch --hosts): --bandwidth between them (default: 1)",
    )
    common.add_argument(
        "--intra-bandwidth",
        metavar="RATE",
        help="with --hosts: shape the links inside a host to RATE (default: unshaped)",
    )
    common.add_argument("--threads", type=_positive_int, default=1, help="intra-op threads per rank (default: 1)")
    common.add_argument("--quick", action="store_true", help="small shapes, few iterations (seconds; for tests)")
    common.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help="where to write results (default: bench/results)"
    )
    common.add_argument("--warmup", type=int, help="untimed calls per variant (default: 2; --quick: 1)")
    common.add_argument("--iters", type=_positive_int, help="timed calls per variant (default: 9; --quick: 3)")
    common.add_argument("--timeout", type=float, default=900.0, help="collective timeout in seconds")
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    modules = {}
    for name, module_path in SUITES.items():
        module = importlib.import_module(module_path)
        suite_parser = sub.add_parser(name, parents=[common], help=(module.__doc__ or "").splitlines()[0])
        modules[name] = module
        if hasattr(module, "add_arguments"):
            module.add_arguments(suite_parser)
    return parser, modules


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["all"]:  # not a suite: build, test and bench on the GPUs (.ci/gpu_check.py)
        return _gpu_check().main(argv[1:])
    inside = "RANK" in os.environ
    parser, modules = _parser()  # every suite's options checked here, before any rank starts
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.iters is None:
        args.iters = 3 if args.quick else 9
    if not args.quick and (args.warmup < MIN_WARMUP or args.iters < MIN_ITERS):
        parser.error(
            f"--warmup >= {MIN_WARMUP} and --iters >= {MIN_ITERS} for figures worth reporting (--quick allows fewer)"
        )
    world = int(os.environ.get("WORLD_SIZE", args.nproc)) if inside else args.nproc
    checks = getattr(modules[args.suite], "check_args", None)
    refusal = checks(args, world) if checks is not None else None
    if refusal is None and not inside:  # inside, bench._context.setup checks this rank's own GPU
        refusal = _device_refusal(args)
    if refusal:
        parser.error(refusal)
    if not inside:
        return _relaunch(args, argv)
    return _run_rank(args, modules[args.suite], argv)


def _gpu_check() -> ModuleType:
    """The CI driver .ci/gpu_check.py as a module (.ci/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO_ROOT, ".ci", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def device_refusal(device: str, nproc: int, hosts: int, gpus: int, share_gpu: bool = False) -> Optional[str]:
    """Why `--device device` cannot start `nproc` ranks (over `hosts` emulated hosts) on a machine
    where torch sees `gpus` GPUs, or None when it can. Ranks on CUDA run on cuda:LOCAL_RANK, one
    GPU each: NCCL refuses two ranks of one host on one GPU. With `share_gpu` every rank is a
    host of its own on GPU 0 (oases-launch --share-gpu)."""
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    cuda = device == "cuda" or (device == "auto" and gpus > 0)
    if share_gpu and device == "cpu":
        return "--share-gpu runs NCCL ranks on a GPU: give --device cuda (or auto), or drop --share-gpu"
    if share_gpu and gpus < 1:
        return "--share-gpu runs NCCL ranks on a GPU, but torch sees no GPU here: drop --share-gpu (gloo on the CPU)"
    if not cuda:
        return None
    chosen = "--device cuda" if device == "cuda" else "--device auto (a GPU is visible, so cuda)"
    if gpus < 1:
        return (
            "--device cuda: torch sees no GPU here (torch.cuda.is_available() is False: no NVIDIA driver, "
            "CUDA_VISIBLE_DEVICES empty, or a CPU build of torch); run with --device cpu (or auto)"
        )
    if share_gpu:
        return "--share-gpu makes every rank a host of its own: give no --hosts" if hosts > 1 else None
    if hosts > 1:
        return (
            f"{chosen} with --hosts {hosts}: the emulated hosts share this machine's GPUs and each host's "
            "ranks count LOCAL_RANK from 0, so two ranks would use one GPU, which NCCL cannot do; "
            "pass --device cpu to emulate hosts on the CPU cores"
        )
    if nproc > gpus:
        return (
            f"{chosen} --nproc {nproc}: torch sees {gpus} GPU(s) and NCCL cannot run two ranks on one GPU; "
            f"pass --nproc {gpus} or fewer, --device cpu to run {nproc} gloo ranks on the CPU cores, or "
            "--share-gpu to test NCCL with every rank on one GPU (not a speedup)"
        )
    return None


def _device_refusal(args: argparse.Namespace) -> Optional[str]:
    """device_refusal for this machine's GPUs (what torch in this process sees)."""
    if args.device == "cpu" and not args.share_gpu:
        return None
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return device_refusal(args.device, args.nproc, args.hosts, gpus, args.share_gpu)


def _launcher_installed() -> bool:
    """Whether oases.launch exists, without importing oases (and torch) in this process."""
    spec = importlib.util.find_spec("oases")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        os.path.exists(os.path.join(location, "launch", "__main__.py")) for location in spec.submodule_search_locations
    )


def _relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    env = dict(os.environ, OASES_BENCH_RELAUNCHED="1")
    if args.device == "cpu":  # no rank touches a GPU (pinned host memory would make a CUDA context in each)
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    if _launcher_installed():
        command = [sys.executable, "-m", "oases.launch", "--nproc", str(args.nproc), "--threads", str(args.threads)]
        if args.bandwidth and args.hosts > 1:
            command += ["--bandwidth", args.bandwidth, "--hosts", str(args.hosts)]
            command += ["--intra-bandwidth", args.intra_bandwidth] if args.intra_bandwidth else []
        elif args.bandwidth:
            command += ["--bandwidth", args.bandwidth, "--topology", args.topology]
        command += ["--share-gpu"] if args.share_gpu else []
    elif args.share_gpu:
        print("bench: --share-gpu needs oases.launch (each rank's NCCL host); install oases", file=sys.stderr)
        return 2
    elif args.bandwidth:
        print(
            "bench: oases.launch is not installed, so the link cannot be shaped; run under a "
            "launcher in a shaped namespace instead (see /work/shared/README.md)",
            file=sys.stderr,
        )
        return 2
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
        env["OMP_NUM_THREADS"] = str(args.threads)
    command += ["-m", "bench", *argv]
    process = subprocess.Popen(command, env=env)  # cwd kept: a relative --out means the same dir
    try:
        return process.wait()
    except KeyboardInterrupt:  # the launcher got the same SIGINT: let it stop the ranks
        return process.wait()


def _run_rank(args: argparse.Namespace, suite: ModuleType, argv: list[str]) -> int:
    import torch.distributed as dist

    from bench._context import setup

    ctx = setup(args)
    try:
        records = suite.run(args, ctx)
        events = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(ctx.trace.events, events, dst=0)
        if ctx.rank == 0:
            _write_outputs(args, suite, ctx, records, events, argv)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _write_outputs(args, suite: ModuleType, ctx, records: list[dict], events: list, argv: list[str]) -> None:
    from bench import _report
    from bench._context import load_average
    from bench._trace import chrome_trace

    created = datetime.datetime.now()
    paths = _report.output_paths(args.out, args.suite, created)
    link = ctx.meta["link"]
    title = (
        f"{args.suite}: {ctx.world_size} ranks on {ctx.meta['device']['name']}, "
        f"{link['bandwidth'] or 'unshaped'} {link['topology'] or ''}, "
        f"{ctx.meta['threads_per_rank']} thread(s)/rank"
    )
    if ctx.meta["device"].get("shared_gpu"):
        title += f" (all {ctx.meta['device']['shared_gpu']} ranks share one GPU: not a speedup)"
    for table in suite.tables(records):
        print(_report.render(table) + "\n", flush=True)
    plotted = hasattr(suite, "plot") and suite.plot(records, paths.png, title)
    traced = any(events)
    if traced:
        _report.write_json(paths.trace, chrome_trace(events, {"suite": args.suite, "title": title}))
    document = {
        "suite": args.suite,
        "created": created.isoformat(timespec="seconds"),
        "command": ["python", "-m", "bench", *argv],
        **ctx.meta,
        "load_average_end": load_average(),
        "files": {"png": paths.png if plotted else None, "trace": paths.trace if traced else None},
        "cases": records,
    }
    _report.write_json(paths.json, document)
    print(
        f"wrote {paths.json}" + (f", {paths.png}" if plotted else "") + (f", {paths.trace}" if traced else ""),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
