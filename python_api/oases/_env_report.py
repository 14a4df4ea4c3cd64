"""The report of `oases env` (oases.env): its sections, each a set of guarded probes, collected
into {section: {key: value}} and rendered as aligned "key: value" lines."""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import shutil
import sys
from typing import Any, Callable, Mapping, Sequence

from oases._env_guards import CommandTimeout, _command, _distribution, _error_text, _first_line, _guarded

COMMAND_TIMEOUT_S = 5.0  # git, ip, tc
NVIDIA_SMI_TIMEOUT_S = 10.0
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)
OTHER_VARIABLES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG")

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
_TITLES = {
    "extension": "extension (oases._C)",
    "gpus": "GPUs",
    "link_shaping": "link shaping (oases-launch --bandwidth)",
}
_LABELS = {
    "triton_interpret": "TRITON_INTERPRET",
    "nvidia_smi_topo": "nvidia-smi topo -m",
    "oases_launch_bandwidth": "oases-launch",
    "oases": "OASES_*",
    "torchrun": "torchrun",
}


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
    code, out, _ = _command([git, "-C", folder, "rev-parse", "--show-toplevel", "--short", "HEAD"], COMMAND_TIMEOUT_S)
    lines = out.split()
    if code != 0 or len(lines) != 2:
        return "n/a (not a git checkout)"
    top, revision = lines
    if not os.path.isdir(os.path.join(top, "python_api", "oases")):  # the package sits in someone else's repo
        return "n/a (not an Oases checkout)"
    with contextlib.suppress(CommandTimeout, OSError):  # best effort: a slow status only loses the mark
        code, out, _ = _command([git, "-C", top, "status", "--porcelain", "--untracked-files=no"], COMMAND_TIMEOUT_S)
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

    return {
        "os": os_name,
        "kernel": lambda: f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": cpu,
        "cpu_cores": cores,
        "memory": memory,
    }


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

    return {
        "version": version,
        "build": build,
        "cuda_available": cuda_available,
        "distributed": distributed,
        "nccl": nccl,
        "gloo": gloo,
    }


def _libraries() -> dict[str, Callable[[], Any]]:
    return {
        "triton": lambda: _distribution("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "triton_interpret": lambda: os.environ.get("TRITON_INTERPRET", "not set"),
        "transformers": lambda: _distribution("transformers"),
        "numpy": lambda: _distribution("numpy"),
        "scipy": lambda: _distribution("scipy"),
    }


def _extension() -> dict[str, Any]:
    """Not lazily per key: the keys depend on whether the extension imports."""
    from oases import _extension

    try:
        compiled = _extension.compiled()
    except ImportError as err:
        cause = err.__cause__ or err
        return {
            "built": False,
            "built_with_cuda": "n/a",
            "built_for_torch": "n/a",
            "matches_torch": "n/a",
            "import_error": _error_text(cause).removeprefix("error: "),
        }
    import torch

    info = compiled.build_info()
    built_for = str(info.get("torch"))
    running = torch.__version__.split("+")[0]
    out: dict[str, Any] = {
        "built": True,
        "built_with_cuda": bool(info.get("cuda")),
        "built_for_torch": built_for,
        "matches_torch": running == built_for or running.startswith(built_for + "."),
    }
    if not out["matches_torch"]:
        out["note"] = (
            f"built for torch {built_for}, running {torch.__version__}: rebuild with "
            "`pip install --no-build-isolation -e .`"
        )
    elif torch.cuda.is_available() and not out["built_with_cuda"]:
        out["note"] = (
            "CUDA is available but oases._C was built without it: rebuild with "
            "`OASES_BUILD_CUDA=1 pip install --no-build-isolation -e .`"
        )
    return out


def _gpus() -> dict[str, Callable[[], Any]]:
    def devices() -> list[dict[str, Any]]:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            out.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_bytes": int(props.total_memory),
                    "compute_capability": f"{props.major}.{props.minor}",
                    "multiprocessors": int(props.multi_processor_count),
                }
            )
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
    out: dict[str, Any] = {
        "ip": shutil.which("ip") or "not found",
        "tc": shutil.which("tc") or "not found",
        "root": os.geteuid() == 0,
    }
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
    from oases.launch._netns import ShapingUnavailable, find_tools  # the launcher's own probe of shaping: one home

    try:
        tools = find_tools()  # the launcher's own check: root, ip and tc
    except ShapingUnavailable as why:
        return f"refused: {why}", f"not tried: {why}"
    name = f"oases-env-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        code, out, err = _command([tools.ip, "netns", "add", name], COMMAND_TIMEOUT_S)
        if code != 0:
            return f"refused: {_first_line(err or out, f'ip exited {code}')}", "not tried: no namespace"
        code, out, err = _command(
            [
                tools.tc,
                "-n",
                name,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "128kb",
                "latency",
                "200ms",
            ],
            COMMAND_TIMEOUT_S,
        )
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

    return {
        "torchrun": lambda: variables(TORCHRUN_VARIABLES),
        "oases": lambda: variables(sorted(k for k in os.environ if k.startswith("OASES_"))),
        "other": lambda: variables(OTHER_VARIABLES),
    }


_SECTIONS: dict[str, Callable[[], Mapping[str, Any]]] = {
    "oases": _oases,
    "python": _python,
    "system": _system,
    "torch": _torch,
    "libraries": _libraries,
    "extension": _extension,
    "gpus": _gpus,
    "link_shaping": _link_shaping,
    "environment": _environment,
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
            return (
                "\n".join(
                    f"{d['index']}: {d['name']}, {d['memory_bytes'] / 2**30:.1f} GiB, compute "
                    f"{d['compute_capability']}, {d['multiprocessors']} SMs"
                    for d in value
                )
                or "none (torch.cuda.is_available() is False)"
            )
        return ", ".join(map(str, value)) or "none"
    return str(value)


def render(report: Mapping[str, Mapping[str, Any]]) -> str:
    """The report as sections of aligned "key: value" lines; multi-line values continue under the value."""
    rows = [
        (section, _LABELS.get(key, key.replace("_", " ")), _text(key, value))
        for section, values in report.items()
        for key, value in values.items()
    ]
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
