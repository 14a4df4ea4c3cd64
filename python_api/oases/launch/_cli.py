"""`oases-launch`: parse the command line, place the ranks (shaped or not), run them."""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from oases.launch._netns import (TOPOLOGIES, UNSHAPED, Namespaces, Placement, ShapingUnavailable,
                                 Topology, find_tools)
from oases.launch._rate import parse_bandwidth
from oases.launch._ranks import RankProcess, run_ranks
from oases.launch._signals import Interrupted, signals_raise

DEFAULT_TOPOLOGY: Topology = "shared"
SELFTEST_MODULE = "oases.launch._selftest"


@dataclass(frozen=True)
class _Job:
    """One launch, as the command line asked for it."""

    nproc: int
    target: tuple[str, ...]    # ("train.py", *args) or ("-m", "bench", *args), after `python`
    threads: str               # OMP_NUM_THREADS of every rank
    bandwidth: Optional[str]   # tc rate text; None: unshaped
    topology: Topology


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `oases-launch` with `argv` (default: sys.argv[1:]); return the exit status.

    0 when every rank exits 0; else the status of the first rank to fail (128 + S for a rank
    killed by signal S); 128 + S when the launcher itself gets SIGINT/SIGTERM. Usage errors
    exit through argparse (SystemExit(2)).
    """
    job = _parse_args(argv)
    with signals_raise():
        try:
            return _launch(job)
        except Interrupted as stop:
            print(f"oases-launch: interrupted by {stop}; ranks stopped", file=sys.stderr, flush=True)
            return 128 + stop.signum


def _launch(job: _Job) -> int:
    placements, shaping = [UNSHAPED] * job.nproc, {}
    with contextlib.ExitStack() as cleanup:
        if job.bandwidth is not None:
            try:
                namespaces = cleanup.enter_context(Namespaces(find_tools(), f"oases-{os.getpid()}"))
                rate_bits = round(parse_bandwidth(job.bandwidth) * 8)
                placements = namespaces.build(job.topology, job.nproc, rate_bits)
                shaping = {"OASES_BANDWIDTH": job.bandwidth, "OASES_TOPOLOGY": job.topology}
            except ShapingUnavailable as why:
                cleanup.close()  # whatever was built
                print(f"oases-launch: cannot shape the network ({why}); running unshaped",
                      file=sys.stderr, flush=True)
        return run_ranks(_rank_processes(job, placements, shaping))


def _rank_processes(job: _Job, placements: Sequence[Placement],
                    extra_env: dict[str, str]) -> list[RankProcess]:
    """torchrun's single-node environment for each rank, inside its placement."""
    port = _free_port()
    ranks = []
    for rank, placement in enumerate(placements):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank),
            WORLD_SIZE=str(job.nproc), LOCAL_WORLD_SIZE=str(job.nproc),
            MASTER_ADDR=placements[0].address, MASTER_PORT=str(port),
            OMP_NUM_THREADS=job.threads,
        )
        env.update(placement.env)
        env.update(extra_env)
        ranks.append(RankProcess([*placement.prefix, sys.executable, *job.target], env))
    return ranks


def _free_port() -> int:
    """A TCP port nothing listens on now (rank 0's store will bind it, as under torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _parse_args(argv: Optional[Sequence[str]]) -> _Job:
    parser = _parser()
    options = parser.parse_args(argv)
    if options.selftest:
        if options.script is not None or options.module:
            parser.error("--selftest runs its own rank code: give no SCRIPT and no -m")
        if options.nproc < 2:
            parser.error("--selftest measures rank 0 -> rank 1: needs --nproc 2 or more")
        target: tuple[str, ...] = ("-m", SELFTEST_MODULE)
    elif options.script is None:
        parser.error("give the SCRIPT to run (or -m MODULE, or --selftest)")
    else:
        target = (*(["-m"] if options.module else []), options.script, *options.args)
    if options.topology is not None and options.bandwidth is None:
        parser.error("--topology shapes links: give --bandwidth too")
    threads = str(options.threads) if options.threads else os.environ.get("OMP_NUM_THREADS", "1")
    return _Job(options.nproc, target, threads, options.bandwidth, options.topology or DEFAULT_TOPOLOGY)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oases-launch",
        description="Start NPROC ranks of SCRIPT with torchrun's environment, optionally over "
                    "rate-limited links emulating a commodity server's interconnect.",
    )
    parser.add_argument("--nproc", "--nproc-per-node", type=_positive_int, default=1,
                        help="number of ranks (default: 1)")
    parser.add_argument("--bandwidth", type=_bandwidth, metavar="RATE",
                        help="shape the links between ranks to RATE, in tc syntax (250mbit, 1gbit, 8gbit)")
    parser.add_argument("--topology", choices=TOPOLOGIES,
                        help=f"with --bandwidth: shared = one link for all ranks (one PCIe host "
                             f"bridge), switch = a link per rank into a switch (a NIC per GPU); "
                             f"default {DEFAULT_TOPOLOGY}")
    parser.add_argument("--threads", type=_positive_int, metavar="K",
                        help="OMP_NUM_THREADS per rank (default: the environment's, else 1)")
    parser.add_argument("--selftest", action="store_true",
                        help=f"measure the rank 0 <-> rank 1 bandwidth instead of running a script "
                             f"(= -m {SELFTEST_MODULE})")
    parser.add_argument("-m", "--module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    parser.add_argument("script", nargs="?", help="the script (or, with -m, module) every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _bandwidth(text: str) -> str:
    try:
        parse_bandwidth(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text.strip()
