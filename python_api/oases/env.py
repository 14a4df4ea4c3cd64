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
import json
import os
import sys
from typing import Optional, Sequence

# `name as name`: importable from oases.env as before the split into _env_guards, _env_report and
# _link_probe (tests read the private ones)
from oases._env_guards import CommandTimeout as CommandTimeout
from oases._env_guards import _command as _command
from oases._env_guards import _error_text
from oases._env_guards import _guarded as _guarded
from oases._env_report import _LABELS as _LABELS
from oases._env_report import _SECTIONS as _SECTIONS
from oases._env_report import _TITLES as _TITLES
from oases._env_report import COMMAND_TIMEOUT_S as COMMAND_TIMEOUT_S
from oases._env_report import FIELDS, collect, render, shaping_status
from oases._env_report import NVIDIA_SMI_TIMEOUT_S as NVIDIA_SMI_TIMEOUT_S
from oases._env_report import OTHER_VARIABLES as OTHER_VARIABLES
from oases._env_report import TORCHRUN_VARIABLES as TORCHRUN_VARIABLES
from oases._env_report import _link_shaping as _link_shaping
from oases._link_probe import (
    DEFAULT_SIZES,
    OutsideLaunch,
    _parse_sizes,
    format_link,
    probe_link,
    render_probe,
    summarize_probe,
)

__all__ = [
    "FIELDS",
    "collect",
    "render",
    "shaping_status",
    "probe_link",
    "summarize_probe",
    "render_probe",
    "format_link",
    "add_arguments",
    "run",
    "main",
]

DESCRIPTION = (
    "print what a bug report needs: versions, build, GPUs, the launcher's link shaping, "
    "the torchrun and OASES_* variables (--probe-link: measure the link inside a launch)"
)


# ----------------------------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `oases env` (also `python -m oases.env`)."""
    parser.add_argument("--json", action="store_true", help="print the report (or the probe's result) as JSON")
    parser.add_argument(
        "--probe-link",
        action="store_true",
        help="inside a launch: measure ranks 0 <-> 1 and an all-gather, print the rate as "
        "`oases plan --link` takes it (e.g. oases-launch --nproc 2 --bandwidth 1gbit "
        "-m oases.env --probe-link)",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"with --probe-link: message sizes, comma-separated (default {DEFAULT_SIZES})",
    )
    parser.add_argument("--repeats", type=int, default=3, help="with --probe-link: timed rounds per size (default 3)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="with --probe-link: seconds before a stuck rank gives up (default 300)",
    )


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
        print(
            f"oases env --probe-link: rank {rank} failed: {_error_text(err).removeprefix('error: ')}",
            file=sys.stderr,
            flush=True,
        )
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
