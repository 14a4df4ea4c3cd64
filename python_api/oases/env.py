"""`oases env`: one screen of facts to paste into a bug report; `--probe-link` measures a link.

    oases env                       # aligned "key: value" lines, in sections
    oases env --json                # the same, as JSON ({section: {key: value}})
    python -m oases.env [--json]    # the same
    oases-launch --nproc 2 --bandwidth 1gbit -m oases.env --probe-link   # measure ranks 0 <-> 1

Sections: oases (version, git revision of a checkout), python, system (OS, kernel, CPU, cores,
memory), torch (build, CUDA, NCCL, gloo), libraries (Triton, TRITON_INTERPRET, transformers,
numpy, scipy), extension (oases._C: built, for which torch, with CUDA), gpus (torch.cuda's
devices, `nvidia-smi topo -m`), link_shaping (what `oases-launch --bandwidth` needs: root, `ip`,
`tc`, a network namespace it may create, a tbf qdisc in it) and environment (the torchrun
variables and OASES_* that are set). Every probe is guarded: a failing one reports
"error: ..." in its value, a command that runs too long is killed ("timed out after N s"), and
the report is still printed whole.

`--probe-link` runs on the ranks of a launch (oases-launch or torchrun: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set). Over gloo it times a ping-pong between ranks 0 and 1 (half the
round trip is one message) and an all-gather on all ranks, over --sizes (default 64 KiB ..
16 MiB), median of --repeats rounds after an untimed one (more rounds below 1 MiB, up to 16x, where
they cost little and scheduling noise weighs most), and fits each to
t = latency_s + nbytes / bytes_per_s (oases.costs.link.LinkFit.from_samples, the planner's
own fit; an all-gather's nbytes is the gathered tensor). Rank 0 prints the point-to-point rate
in the syntax of `oases plan --link` (e.g. 198mbit) with the latency beside it, and the
all-gather as the ring link the planner would assume for it. Outside a launch it says how to
run it and exits 2.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

__all__ = ["FIELDS", "collect", "render", "shaping_status", "probe_link", "summarize_probe", "render_probe",
           "format_link", "add_arguments", "run", "main"]

DESCRIPTION = ("print what a bug report needs: versions, build, GPUs, the launcher's link shaping, "
               "the torchrun and OASES_* variables (--probe-link: measure the link inside a launch)")
COMMAND_TIMEOUT_S = 5.0        # git, ip, tc
NVIDIA_SMI_TIMEOUT_S = 10.0
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK")
OTHER_VARIABLES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                   "NCCL_DEBUG")
DEFAULT_SIZES = "64KiB,256KiB,1MiB,4MiB,16MiB"
_ERROR_CHARS = 300

# Every section and the keys it always has (a section may add a key, e.g. extension's import_error).
FIELDS: dict[str, tuple[str, ...]] = {
    "oases": ("version", "git_revision", "location"),
    "python": ("version", "executable"),
    "system": ("os", "kernel", "cpu", "cpu_cores", "memory"),
    "torch": ("version", "build", "cuda_available", "distributed", "nccl", "gloo"),
    "libraries": ("triton", "triton_interpret", "transformers", "numpy", "scipy"),
    "extension": ("built", "built_with_cuda", "built_for_torch", "matches_torch"),
    "gpus": ("devices", "driver", "nvidia_smi_topo"),
    "link_shaping": ("ip", "tc", "root", "network_namespace", "tc_shaping", "oases_launch_bandwidth"),
    "environment": ("torchrun", "oases", "other"),
}
_TITLES = {"extension": "extension (oases._C)", "gpus": "GPUs",
           "link_shaping": "link shaping (oases-launch --bandwidth)"}
_LABELS = {"triton_interpret": "TRITON_INTERPRET", "nvidia_smi_topo": "nvidia-smi topo -m",
           "oases_launch_bandwidth": "oases-launch", "oases": "OASES_*", "torchrun": "torchrun"}


# ----------------------------------------------------------------------------------------------
# Guards


def _guarded(probe: Callable[[], Any]) -> Any:
    """probe(), or "error: Type: message" (one line) if it raises."""
    try:
        return probe()
    except Exception as err:  # noqa: BLE001  (a probe must never end the report)
        return _error_text(err)


def _error_text(err: BaseException) -> str:
    message = " ".join(str(err).split()) or "(no message)"
    if len(message) > _ERROR_CHARS:
        message = message[:_ERROR_CHARS] + "..."
    return f"error: {type(err).__name__}: {message}"


class CommandTimeout(RuntimeError):
    """A command ran past its time limit and was killed."""


def _command(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv`, run in its own session with the C locale.
    Past `timeout` seconds its process group is killed and CommandTimeout raised; FileNotFoundError
    when the program does not exist."""
    env = {**os.environ, "LC_ALL": "C"}
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=2)
        shown = " ".join([os.path.basename(argv[0]), *argv[1:]])
        raise CommandTimeout(f"`{shown}` timed out after {timeout:g} s") from None
    return proc.returncode, out, err


def _first_line(text: str, fallback: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else fallback


def _distribution(*names: str) -> str:
    """The installed version of the first of `names` (distribution names), else "not installed"."""
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return "not installed"


# ----------------------------------------------------------------------------------------------
# Sections: {key: probe}; collect() runs each probe under a guard


def _oases() -> dict[str, Callable[[], Any]]:
    def location() -> str:
        import oases

        return os.path.dirname(os.path.abspath(oases.__file__))

    def version() -> str:
        import oases

        return oases.__version__

    return {"version": version, "git_revision": lambda: _git_revision(location()), "location": location}


def _git_revision(folder: str) -> str:
    """`git rev-parse --short HEAD` of the Oases checkout holding `folder` (+ " (modified)"), or n/a."""
    if any(part in ("site-packages", "dist-packages") for part in folder.split(os.sep)):
        return "n/a (installed package, not a checkout)"
    git = shutil.which("git")
    if git is None:
        return "n/a (git not found)"
    code, out, _ = _command([git, "-C", folder, "rev-parse", "--show-toplevel", "--short", "HEAD"],
                            COMMAND_TIMEOUT_S)
    lines = out.split()
    if code != 0 or len(lines) != 2:
        return "n/a (not a git checkout)"
    top, revision = lines
    if not os.path.isdir(os.path.join(top, "python_api", "oases")):  # the package sits in someone else's repo
        return "n/a (not an Oases checkout)"
    with contextlib.suppress(CommandTimeout, OSError):  # best effort: a slow status only loses the mark
        code, out, _ = _command([git, "-C", top, "status", "--porcelain", "--untracked-files=no"],
                                COMMAND_TIMEOUT_S)
        if code == 0 and out.strip():
            revision += " (modified)"
    return revision


def _python() -> dict[str, Callable[[], Any]]:
    return {"version": lambda: " ".join(sys.version.split()), "executable": lambda: sys.executable}


def _system() -> dict[str, Callable[[], Any]]:
    def os_name() -> str:
        with contextlib.suppress(OSError), open("/etc/os-release") as release:
            for line in release:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
        return platform.platform()

    def cpu() -> str:
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
            for line in info:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return " ".join(line.split(":", 1)[1].split())
        return platform.processor() or "unknown"

    def cores() -> str:
        total = os.cpu_count()
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
        return f"{total}" if usable == total else f"{total} ({usable} usable by this process)"

    def memory() -> str:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info if ":" in line)
        total, available = (int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "MemAvailable"))
        return f"{total / 2**30:.1f} GiB ({available / 2**30:.1f} GiB available)"

    return {"os": os_name, "kernel": lambda: f"{platform.system()} {platform.release()} {platform.machine()}",
            "cpu": cpu, "cpu_cores": cores, "memory": memory}


def _torch() -> dict[str, Callable[[], Any]]:
    def version() -> str:
        import torch

        return torch.__version__

    def build() -> str:
        import torch

        if torch.version.cuda:
            return f"CUDA {torch.version.cuda}"
        if getattr(torch.version, "hip", None):
            return f"ROCm {torch.version.hip}"
        return "CPU"

    def cuda_available() -> bool:
        import torch

        return torch.cuda.is_available()

    def distributed() -> bool:
        import torch.distributed as dist

        return dist.is_available()

    def nccl() -> str:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_nccl_available():
            return "not built into this torch"
        found = torch.cuda.nccl.version()
        return ".".join(map(str, found)) if isinstance(found, tuple) else str(found)

    def gloo() -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_gloo_available()

    return {"version": version, "build": build, "cuda_available": cuda_available, "distributed": distributed,
            "nccl": nccl, "gloo": gloo}


def _libraries() -> dict[str, Callable[[], Any]]:
    return {"triton": lambda: _distribution("triton", "pytorch-triton", "pytorch-triton-rocm"),
            "triton_interpret": lambda: os.environ.get("TRITON_INTERPRET", "not set"),
            "transformers": lambda: _distribution("transformers"),
            "numpy": lambda: _distribution("numpy"), "scipy": lambda: _distribution("scipy")}


def _extension() -> dict[str, Any]:
    """Not lazily per key: the keys depend on whether the extension imports."""
    from oases import _extension

    try:
        compiled = _extension.compiled()
    except ImportError as err:
        cause = err.__cause__ or err
        return {"built": False, "built_with_cuda": "n/a", "built_for_torch": "n/a", "matches_torch": "n/a",
                "import_error": _error_text(cause).removeprefix("error: ")}
    import torch

    info = compiled.build_info()
    built_for = str(info.get("torch"))
    running = torch.__version__.split("+")[0]
    out: dict[str, Any] = {"built": True, "built_with_cuda": bool(info.get("cuda")), "built_for_torch": built_for,
                           "matches_torch": running == built_for or running.startswith(built_for + ".")}
    if not out["matches_torch"]:
        out["note"] = (f"built for torch {built_for}, running {torch.__version__}: rebuild with "
                       "`pip install --no-build-isolation -e .`")
    elif torch.cuda.is_available() and not out["built_with_cuda"]:
        out["note"] = ("CUDA is available but oases._C was built without it: rebuild with "
                       "`OASES_BUILD_CUDA=1 pip install --no-build-isolation -e .`")
    return out


def _gpus() -> dict[str, Callable[[], Any]]:
    def devices() -> list[dict[str, Any]]:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            out.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                        "compute_capability": f"{props.major}.{props.minor}",
                        "multiprocessors": int(props.multi_processor_count)})
        return out

    def nvidia_smi(*args: str) -> tuple[bool, str]:
        """(ran, its output or why not) of `nvidia-smi args`."""
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return False, "nvidia-smi not found"
        code, out, err = _command([smi, *args], NVIDIA_SMI_TIMEOUT_S)
        if code != 0:
            return False, f"error: nvidia-smi {' '.join(args)} exited {code}: {_first_line(err or out, 'no output')}"
        return True, out

    def driver() -> str:
        ran, out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
        return _first_line(out, "unknown") if ran else out

    def topology() -> str:
        ran, out = nvidia_smi("topo", "-m")
        return out.rstrip().expandtabs() if ran else out  # tab-aligned columns: keep them aligned when indented

    return {"devices": devices, "driver": driver, "nvidia_smi_topo": topology}


def _link_shaping() -> dict[str, Any]:
    """What `oases-launch --bandwidth` needs, tried as it would use it (not lazily per key)."""
    out: dict[str, Any] = {"ip": shutil.which("ip") or "not found", "tc": shutil.which("tc") or "not found",
                           "root": os.geteuid() == 0}
    tried = _guarded(_try_namespace)
    namespace, shaping = (tried, "not tried") if isinstance(tried, str) else tried
    out["network_namespace"], out["tc_shaping"] = namespace, shaping
    works = namespace == "works" and shaping == "works"
    reason = shaping if namespace == "works" else namespace
    out["oases_launch_bandwidth"] = "shapes links" if works else f"runs unshaped ({reason})"
    return out


def _try_namespace() -> tuple[str, str]:
    """("works" | "refused: why" | "not tried: why") for creating a network namespace and for a tbf
    qdisc in it, as the launcher makes them; the namespace is deleted again."""
    from oases.launch._netns import ShapingUnavailable, find_tools

    try:
        tools = find_tools()  # the launcher's own check: root, ip and tc
    except ShapingUnavailable as why:
        return f"refused: {why}", f"not tried: {why}"
    name = f"oases-env-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        code, out, err = _command([tools.ip, "netns", "add", name], COMMAND_TIMEOUT_S)
        if code != 0:
            return f"refused: {_first_line(err or out, f'ip exited {code}')}", "not tried: no namespace"
        code, out, err = _command([tools.tc, "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                                   "1mbit", "burst", "128kb", "latency", "200ms"], COMMAND_TIMEOUT_S)
        shaping = "works" if code == 0 else f"refused: {_first_line(err or out, f'tc exited {code}')}"
        return "works", shaping
    except CommandTimeout as err:
        return f"refused: {err}", "not tried"
    finally:
        with contextlib.suppress(Exception):
            _command([tools.ip, "netns", "del", name], COMMAND_TIMEOUT_S)


def shaping_status() -> tuple[bool, str]:
    """(True, "shapes links") where oases-launch --bandwidth can shape links here, else (False, why)."""
    summary = _guarded(_link_shaping)
    if isinstance(summary, str):
        return False, summary
    return summary["oases_launch_bandwidth"] == "shapes links", summary["oases_launch_bandwidth"]


def _environment() -> dict[str, Callable[[], Any]]:
    def variables(names: Sequence[str]) -> dict[str, str]:
        return {name: os.environ[name] for name in names if name in os.environ}

    return {"torchrun": lambda: variables(TORCHRUN_VARIABLES),
            "oases": lambda: variables(sorted(k for k in os.environ if k.startswith("OASES_"))),
            "other": lambda: variables(OTHER_VARIABLES)}


_SECTIONS: dict[str, Callable[[], Mapping[str, Any]]] = {
    "oases": _oases, "python": _python, "system": _system, "torch": _torch, "libraries": _libraries,
    "extension": _extension, "gpus": _gpus, "link_shaping": _link_shaping, "environment": _environment,
}


def collect() -> dict[str, dict[str, Any]]:
    """{section: {key: value}} for every section of FIELDS; values are JSON types. A probe that
    raises gives "error: Type: message" as its value; a section that fails whole gives it to each key."""
    report: dict[str, dict[str, Any]] = {}
    for section, probes in _SECTIONS.items():
        found = _guarded(probes)
        if isinstance(found, str):  # the section itself failed
            report[section] = {key: found for key in FIELDS[section]}
            continue
        values = {key: (_guarded(value) if callable(value) else value) for key, value in found.items()}
        report[section] = {**{key: values.pop(key, "error: not reported") for key in FIELDS[section]}, **values}
    return report


# ----------------------------------------------------------------------------------------------
# Text


def _text(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "none set"
    if isinstance(value, list):
        if key == "devices":
            return "\n".join(f"{d['index']}: {d['name']}, {d['memory_bytes'] / 2**30:.1f} GiB, compute "
                             f"{d['compute_capability']}, {d['multiprocessors']} SMs" for d in value) \
                or "none (torch.cuda.is_available() is False)"
        return ", ".join(map(str, value)) or "none"
    return str(value)


def render(report: Mapping[str, Mapping[str, Any]]) -> str:
    """The report as sections of aligned "key: value" lines; multi-line values continue under the value."""
    rows = [(section, _LABELS.get(key, key.replace("_", " ")), _text(key, value))
            for section, values in report.items() for key, value in values.items()]
    width = max(len(label) for _, label, _ in rows) + 1
    lines = ["oases env: paste this into a bug report"]
    current = None
    for section, label, text in rows:
        if section != current:
            lines += ["", _TITLES.get(section, section)]
            current = section
        first, *rest = text.splitlines() or [""]
        lines.append(f"  {(label + ':').ljust(width)} {first}".rstrip())
        lines += [f"  {' ' * width} {line}".rstrip() for line in rest]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --probe-link


class OutsideLaunch(RuntimeError):
    """--probe-link was run without a launch's environment."""


def _usage_outside() -> str:
    return ("oases env --probe-link: not inside a launch (RANK and WORLD_SIZE are not set).\n"
            "It measures the link between ranks 0 and 1 of a launch; run it on 2 or more ranks:\n"
            "    oases-launch --nproc 2 -m oases.env --probe-link                    # this machine's loopback\n"
            "    oases-launch --nproc 2 --bandwidth 1gbit -m oases.env --probe-link  # the emulator's shaped link\n"
            "    torchrun --nnodes 2 --nproc-per-node 1 ... -m oases.env --probe-link  # two servers")


def format_link(bytes_per_s: float) -> str:
    """A rate in the syntax of `oases plan --link` and tc, to 3 significant digits: 24.8e6 -> "198mbit"."""
    bits = float(bytes_per_s) * 8
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            number = f"{bits / scale:.3g}"
            if "e" in number:  # >= 1000 tbit: no larger unit
                number = f"{bits / scale:.0f}"
            return f"{number}{unit}"
    return f"{max(round(bits), 8)}bit"


def _parse_sizes(text: str) -> list[int]:
    from oases.planner.profile import parse_bytes

    sizes = sorted({parse_bytes(part, what="--sizes") for part in text.split(",") if part.strip()})
    if len(sizes) < 2:
        raise ValueError(f"--sizes: give 2 or more sizes (the rate is the slope between the largest two), got {text!r}")
    return sizes


def _fit(samples: Sequence[tuple[int, float]]) -> dict[str, Any]:
    from oases.costs.link import LinkFit

    fit = LinkFit.from_samples(samples)
    return {"samples": [[int(n), float(t)] for n, t in samples], "latency_s": fit.latency_s,
            "bytes_per_s": fit.bytes_per_s}


def summarize_probe(p2p: Sequence[tuple[int, float]], all_gather: Sequence[tuple[int, float]], world_size: int,
                    repeats: int) -> dict[str, Any]:
    """The probe's result from its samples ((bytes, seconds): p2p one message; all-gather the gathered tensor)."""
    result: dict[str, Any] = {"world_size": world_size, "repeats": repeats,
                              "requested": os.environ.get("OASES_BANDWIDTH"),
                              "topology": os.environ.get("OASES_TOPOLOGY"), "p2p": _fit(p2p),
                              "all_gather": _fit(all_gather)}
    ag, p = result["all_gather"], world_size
    # The planner's ring all-gather: (p-1) a + (p-1)/p n / B; the link that gives the measured fit.
    ag["ring_link_bytes_per_s"] = ag["bytes_per_s"] * (p - 1) / p
    ag["ring_latency_s"] = ag["latency_s"] / (p - 1)
    result["link"] = format_link(result["p2p"]["bytes_per_s"])
    result["latency_s"] = result["p2p"]["latency_s"]
    return result


def _size_text(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def render_probe(result: Mapping[str, Any]) -> str:
    """Rank 0's text: both sweeps with their fits, then the --link line."""
    from oases.planner.profile import parse_link

    requested = result.get("requested")
    shaped = (f"the launcher's link: {requested} ({parse_link(requested) / 1e6:.1f} MB/s), topology "
              f"{result.get('topology') or '?'}") if requested else "no OASES_BANDWIDTH (unshaped or not oases-launch)"
    lines = [f"oases env --probe-link: {result['world_size']} ranks over gloo; {shaped}"]
    sweeps = (("p2p", "p2p, rank 0 <-> rank 1: half a ping-pong"),
              ("all_gather", f"all-gather, {result['world_size']} ranks: size = the gathered tensor, slowest rank"))
    for key, title in sweeps:
        sweep = result[key]
        lines += ["", f"{title} (median of {result['repeats']}+ rounds)", f"  {'size':>9}  {'ms':>9}  {'MB/s':>9}"]
        lines += [f"  {_size_text(n):>9}  {1e3 * t:9.3f}  {n / t / 1e6 if t > 0 else float('inf'):9.1f}"
                  for n, t in sweep["samples"]]
        lines.append(f"  fit: {1e3 * sweep['latency_s']:.3f} ms + bytes / {sweep['bytes_per_s'] / 1e6:.1f} MB/s")
    ag = result["all_gather"]
    lines.append(f"  as the planner's ring all-gather: a {format_link(ag['ring_link_bytes_per_s'])} link "
                 f"({ag['ring_link_bytes_per_s'] / 1e6:.1f} MB/s), {1e3 * ag['ring_latency_s']:.3f} ms per step"
                 + (" (concurrent transfers share the link)"
                    if ag["ring_link_bytes_per_s"] < 0.75 * result["p2p"]["bytes_per_s"] else ""))
    lines += ["", f"link: {result['link']}   latency: {1e3 * result['latency_s']:.3f} ms per message "
                  f"({result['p2p']['bytes_per_s'] / 1e6:.1f} MB/s)",
              f"  oases plan --model MODEL --world N --device-memory MEM --link {result['link']}"]
    return "\n".join(lines)


def probe_link(sizes: Sequence[int], repeats: int, timeout_s: float) -> Optional[dict[str, Any]]:
    """Measure on the ranks of the current launch (see the module docstring); the result on rank 0,
    None on the others. OutsideLaunch without RANK / WORLD_SIZE; ValueError for other usage errors."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise OutsideLaunch(_usage_outside())
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not set: start the ranks with oases-launch or torchrun")
    if int(os.environ["WORLD_SIZE"]) < 2:
        raise ValueError("needs 2 or more ranks (e.g. oases-launch --nproc 2 -m oases.env --probe-link)")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        buffer = torch.zeros(max(sizes), dtype=torch.uint8)
        p2p = [(n, _median_time(lambda: _ping_pong(rank, buffer[:n]), _rounds(n, repeats)) / 2) for n in sizes] \
            if rank in (0, 1) else [(n, 0.0) for n in sizes]
        # all_gather_single: newer torch's name for all_gather_into_tensor (which then warns it is deprecated)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gathered = []
        for n in sizes:
            chunk = max(n // world, 1)
            out, mine = torch.empty(chunk * world, dtype=torch.uint8), torch.zeros(chunk, dtype=torch.uint8)
            gathered.append((chunk * world, _median_time(lambda: all_gather(out, mine), _rounds(n, repeats),
                                                         sync=dist.barrier)))
        slowest = torch.tensor([t for _, t in gathered], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        ag_samples = [(n, float(t)) for (n, _), t in zip(gathered, slowest.tolist())]
        result = summarize_probe(p2p, ag_samples, world, repeats) if rank == 0 else None
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _ping_pong(rank: int, message: Any) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(message, dst=1)
        dist.recv(message, src=1)
    else:
        dist.recv(message, src=0)
        dist.send(message, dst=0)


def _rounds(nbytes: int, repeats: int) -> int:
    """Timed rounds for one size: `repeats`, more below 1 MiB (up to 16x). A function of the size
    alone, so every rank runs the same number of rounds."""
    return max(repeats, min(16 * repeats, -(-repeats * 2**20 // nbytes)))


def _median_time(operation: Callable[[], None], repeats: int, sync: Optional[Callable[[], Any]] = None) -> float:
    """Median seconds of `repeats` runs after one untimed run (connections, a token bucket's burst)."""
    operation()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        operation()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `oases env` (also `python -m oases.env`)."""
    parser.add_argument("--json", action="store_true", help="print the report (or the probe's result) as JSON")
    parser.add_argument("--probe-link", action="store_true",
                        help="inside a launch: measure ranks 0 <-> 1 and an all-gather, print the rate as "
                             "`oases plan --link` takes it (e.g. oases-launch --nproc 2 --bandwidth 1gbit "
                             "-m oases.env --probe-link)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"with --probe-link: message sizes, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=3, help="with --probe-link: timed rounds per size (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="with --probe-link: seconds before a stuck rank gives up (default 300)")


def run(args: argparse.Namespace) -> int:
    """Run `oases env` with parsed options; return the exit status (2: usage error)."""
    if args.probe_link:
        return _run_probe(args)
    report = collect()
    text = json.dumps(report, indent=1) if args.json else render(report)
    _print(text)
    return 0


def _run_probe(args: argparse.Namespace) -> int:
    try:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
        sizes = _parse_sizes(args.sizes)
        result = probe_link(sizes, args.repeats, args.timeout)
    except OutsideLaunch as err:
        print(err, file=sys.stderr, flush=True)
        return 2
    except (ValueError, TypeError) as err:
        print(f"oases env --probe-link: {err}", file=sys.stderr, flush=True)
        return 2
    except Exception as err:  # noqa: BLE001  (a peer gone, a timeout: one line, not a traceback)
        rank = os.environ.get("RANK", "?")
        print(f"oases env --probe-link: rank {rank} failed: {_error_text(err).removeprefix('error: ')}",
              file=sys.stderr, flush=True)
        return 1
    if result is not None:
        _print(json.dumps(result, indent=1) if args.json else render_probe(result))
    return 0


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `oases env | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m oases.env [--json] [--probe-link ...]`; the same as `oases env`."""
    parser = argparse.ArgumentParser(prog="python -m oases.env", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
