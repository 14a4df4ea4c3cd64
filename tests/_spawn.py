"""Run a function on N real gloo ranks (127.0.0.1) with a hard timeout.

    results = run_ranks(fn, world_size, *args, timeout=60)

`fn(rank, world_size, *args)` runs in each rank's process after `init_process_group("gloo")`,
with one intra-op thread; its return values come back as a list ordered by rank. A rank that
raises fails the call with that rank's traceback; a rank that hangs (or a peer left waiting)
fails it when `timeout` expires. Either way every child is killed before this returns, so a hang
costs seconds, never the suite. The store lives in this process on a port the OS picked, so no
free-port race. Ranks are forked from a forkserver that has torch preloaded (fast, and free of
the OpenMP-after-fork deadlock), and on CPU oases and transformers' model code too, so a rank
starts in well under a second. Put many checks in one `fn` to pay the start-up once.

Device: `harness_device()` is OASES_TEST_DEVICE (cpu | cuda), else cuda where GPUs exist, else
cpu. On cpu the ranks run gloo, as always. On cuda each rank gets GPU `rank % device_count` and
an NCCL-only process group, so a collective on a CPU tensor fails instead of falling back to gloo.
Every multi-rank test takes its device from the harness: `rank_device()` inside a rank (inputs
made on the CPU from a seeded generator, then `.to(rank_device())`), `harness_device()` for a
device type (meshes, autocast, `parallelize(device=...)`). Tensors a rank returns come back on the
CPU. Where a world has more ranks than GPUs, the ranks share them as `oases-launch --share-gpu`
does (oases.launch._share): each rank an NCCL host of its own, NCCL over loopback sockets.

OASES_TEST_MAX_RANKS=N: a run with more ranks than N skips its test (the reason names the
variable), so a tier can run every world of 2 ranks first and the larger ones after.

OASES_TEST_COMM_LOG=PATH: each run appends one JSON line to PATH, the test (PYTEST_CURRENT_TEST),
the device, the backend and per rank the c10d operations its main thread issued, by name
(a TorchDispatchMode; a background thread's are not seen).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

_DEVICES = ("cpu", "cuda")


def harness_device() -> str:
    """The device of the suite's distributed tests: "cpu" (gloo) or "cuda" (NCCL)."""
    chosen = os.environ.get("OASES_TEST_DEVICE", "").strip().lower()
    if chosen and chosen not in _DEVICES:
        raise ValueError(f"OASES_TEST_DEVICE: expected one of {', '.join(_DEVICES)} (or unset), got {chosen!r}")
    import torch

    if chosen == "cuda" and not torch.cuda.is_available():
        raise ValueError("OASES_TEST_DEVICE=cuda, but torch sees no GPU (torch.cuda.is_available() is False)")
    if chosen:
        return chosen
    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def cpu_only(reason: str):
    """Mark a test that runs on the CPU harness only (gloo behaviour, the Triton interpreter, a
    host-memory figure, ...): skipped on the cuda harness with `reason`, which the GPU tier lists."""
    import pytest

    return pytest.mark.skipif(harness_device() != "cpu", reason=f"CPU harness only: {reason}")


def rank_device():
    """Inside a rank: the torch.device its tensors go on (its GPU on the cuda harness, else cpu)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if harness_device() == "cuda" else torch.device("cpu")


def _host(value):
    """`value` with every tensor in it (through lists, tuples, dicts, named tuples) moved to the CPU."""
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu() if t.device.type != "cpu" else t, value)


def _counted(fn, *args):
    """(fn(*args), {c10d op: calls}) of the calling thread."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _C10dCalls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True  # else dynamo runs eagerly under the mode: torch.compile tests would test nothing

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func.__name__.split(".")[0]
                self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with _C10dCalls() as calls:
        value = fn(*args)
    return value, calls.calls


# What the forkserver imports once, so that no rank pays for it (importing oases takes about as
# long as torch, transformers' model code twice that; each rank used to pay both). On CUDA only
# torch: an import there that touched the GPU before the fork would break CUDA in every rank.
_PRELOAD_CPU = [
    "pytest",
    # `import oases` loads nothing until a name is used (oases/__init__.py): the library's modules by name
    "oases.training",
    "oases.pipeline",
    "oases.storage",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.gpt_neox.modeling_gpt_neox",
]


def _preload() -> list[str]:
    """Modules for the forkserver to import (it skips one that raises ImportError)."""
    return ["torch", "torch.distributed"] + (_PRELOAD_CPU if harness_device() == "cpu" else [])


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_preload())
_GRACE_AFTER_ERROR = 3.0


def _rank_main(fn, rank, world_size, port, timeout, args, results, sys_path):
    sys.path[:] = sys_path
    import torch

    torch.set_num_threads(1)
    try:
        device = harness_device()
        if device == "cuda":
            count = torch.cuda.device_count()
            if world_size > count:  # as oases-launch --share-gpu, over `count` GPUs
                from oases.launch._share import sharing_env

                os.environ.update(sharing_env(rank, world_size, os.environ))
                os.environ.update(LOCAL_RANK=str(rank % count), OASES_SHARE_GPU=str(-(-world_size // count)))
            torch.cuda.set_device(rank % count)
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout)
        )
        dist.init_process_group(
            _backend(device), store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        if os.environ.get("OASES_TEST_COMM_LOG"):
            value, calls = _counted(fn, rank, world_size, *args)
        else:
            value, calls = fn(rank, world_size, *args), None
        results.put((rank, "ok", (_host(value), calls)))
    except BaseException:  # report everything, including SystemExit from a rank
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks (gloo, or see harness_device);
    return the results by rank."""
    most = os.environ.get("OASES_TEST_MAX_RANKS", "").strip()
    if most and not most.isdigit():
        raise ValueError(f"OASES_TEST_MAX_RANKS: expected a whole number of ranks (or unset), got {most!r}")
    if most and world_size > int(most):
        import pytest

        pytest.skip(f"{world_size} ranks: beyond OASES_TEST_MAX_RANKS={most}")
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )
    results = _CONTEXT.Queue()
    procs = [
        _CONTEXT.Process(
            target=_rank_main, daemon=True, args=(fn, r, world_size, store.port, timeout, args, results, list(sys.path))
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            errors = [r for r, (kind, _) in outcome.items() if kind == "error"]
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, kind, value = results.get(timeout=min(left, 0.2))
                outcome[rank] = (kind, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcome]
                for r in dead:
                    outcome[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        del store
    errors = {r: v for r, (k, v) in sorted(outcome.items()) if k == "error"}
    missing = [r for r in range(world_size) if r not in outcome]
    if errors or missing:
        lines = [f"--- rank {r} ---\n{tb}" for r, tb in errors.items()]
        if missing:
            lines.append(f"ranks {missing} did not finish within {timeout:.0f} s (hang or deadlock); killed")
        raise AssertionError("distributed run failed:\n" + "\n".join(lines))
    _log_calls(world_size, [outcome[r][1][1] for r in range(world_size)])
    return [outcome[r][1][0] for r in range(world_size)]


def _log_calls(world_size: int, calls: list) -> None:
    path = os.environ.get("OASES_TEST_COMM_LOG")
    if not path:
        return
    device = harness_device()
    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "world_size": world_size,
        "device": device,
        "backend": _backend(device),
        "c10d_calls": calls,
    }
    with open(path, "a") as out:
        out.write(json.dumps(line) + "\n")


def stop_process(proc) -> None:
    """Terminate a subprocess.Popen (a launcher then cleans up), kill it after 15 s."""
    import subprocess

    proc.terminate()
    try:
        proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def finish_process(proc, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a subprocess.Popen within `timeout` s; past it (or at the
    test's own limit) it is stopped and the error re-raised."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # TimeoutExpired, or the test's time limit
        stop_process(proc)
        raise
    return proc.returncode, out, err
