"""What a suite gets: this rank's place in the run, the timer, the trace recorder and the metadata.

`setup(args)` runs inside a distributed launch (torchrun's environment): it picks this rank's
device from `args.device` (choose_device: gloo on CPU, NCCL with one GPU per local rank),
initialises the process group, sets the intra-op threads, and describes the run (device and the
choice that picked it, link, versions) for the JSON.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from bench._timing import Timer
from bench._trace import Recorder

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # as bench.__main__.DEVICES (--device)


@dataclass
class Context:
    rank: int
    world_size: int
    device: torch.device
    group: Optional[dist.ProcessGroup]
    timer: Timer
    trace: Recorder
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def choose_device(requested: str, local_rank: int) -> tuple[torch.device, str]:
    """(device, backend) of a rank for `--device requested`: "cpu" -> (cpu, gloo); "cuda" ->
    (cuda:local_rank, nccl); "auto" -> cuda's when torch sees a GPU, else cpu's. ValueError when
    "cuda" (or "auto" on a GPU) cannot give this rank a GPU of its own."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise ValueError(
            "--device cuda: torch sees no GPU here (torch.cuda.is_available() is False); "
            "run with --device cpu (or auto)"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"--device {requested}: LOCAL_RANK {local_rank} needs GPU {local_rank}, but torch sees "
            f"{count}, and NCCL cannot run two ranks on one GPU; run at most {count} rank(s) per "
            "host, or --device cpu"
        )
    return torch.device("cuda", local_rank), "nccl"


def setup(args) -> Context:
    """Initialise torch.distributed from the launch environment on the device `args.device`
    picks (choose_device; "auto" when args has none) and build the context."""
    # torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor; the old names still work.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    torch.set_num_threads(args.threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, backend = choose_device(getattr(args, "device", "auto"), local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    timer = Timer(None, device, warmup=args.warmup, iters=args.iters)
    return Context(
        rank,
        world,
        device,
        None,
        timer,
        Recorder(rank, sync, cuda=device.type == "cuda"),
        meta=describe_run(args, device, world, backend),
    )


def describe_run(args, device: torch.device, world_size: int, backend: str) -> dict[str, Any]:
    """Device, link, versions and settings: what a reader needs to compare two JSON files."""
    return {
        "device": {
            "type": device.type,
            "name": device_name(device),
            "requested": getattr(args, "device", "auto"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            # ranks sharing this one GPU (oases-launch --share-gpu): NCCL over sockets, not a speedup
            "shared_gpu": int(os.environ["OASES_SHARE_GPU"]) if os.environ.get("OASES_SHARE_GPU") else None,
        },
        "world_size": world_size,
        "backend": backend,
        "link": link(args),
        "threads_per_rank": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "oases": _version("oases"),
        },
        "host": platform.node(),
        "load_average": load_average(),
        "quick": bool(args.quick),
        "warmup": args.warmup,
        "iters": args.iters,
    }


def load_average() -> Optional[list[float]]:
    """1, 5 and 15 minute load: a busy machine (other jobs on these cores) skews every time."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def link(args) -> dict[str, Any]:
    """The link the ranks talk over, as far as this process can know it.

    oases-launch exports OASES_BANDWIDTH / OASES_TOPOLOGY only when it did shape the link; it runs
    unshaped (exporting neither) when it cannot. A --bandwidth given to the bench under another
    launcher (torchrun inside a namespace shaped by hand) is taken at its word.
    """
    requested = args.bandwidth
    if os.environ.get("OASES_BANDWIDTH"):
        text, topology, source = os.environ["OASES_BANDWIDTH"], os.environ.get("OASES_TOPOLOGY"), "oases-launch"
    elif requested and os.environ.get("OASES_BENCH_RELAUNCHED"):
        text, topology, source = None, None, f"oases-launch could not shape {requested}: unshaped"
    elif requested:
        text, topology, source = requested, args.topology, "bench --bandwidth (not verified)"
    else:
        text, topology, source = None, None, "unshaped"
    return {
        "shaped": text is not None,
        "bandwidth": text,
        "bytes_per_s": _bytes_per_s(text),
        "topology": topology,
        "requested": requested,
        "source": source,
    }


def _bytes_per_s(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        from oases.launch import parse_bandwidth
    except ImportError:
        return None
    return parse_bandwidth(text)


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
