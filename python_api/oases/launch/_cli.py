"""`oases-launch`: parse the command line, place the ranks (shaped or not), run them."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from oases.costs.rate import parse_bandwidth
from oases.launch._netns import TOPOLOGIES, UNSHAPED, Namespaces, Placement, ShapingUnavailable, Topology, find_tools
from oases.launch._ranks import RankProcess, run_ranks
from oases.launch._share import sharing_env, visible_gpus
from oases.launch._signals import Interrupted, signals_raise

DEFAULT_TOPOLOGY: Topology = "shared"
SELFTEST_MODULE = "oases.launch._selftest"


@dataclass(frozen=True)
class _Job:
    """One launch, as the command line asked for it."""

    nproc: int
    target: tuple[str, ...]  # ("train.py", *args) or ("-m", "bench", *args), after `python`
    threads: str  # OMP_NUM_THREADS of every rank
    bandwidth: Optional[str]  # tc rate text; None: unshaped
    topology: Topology
    hosts: int  # emulated servers; ranks packed into them, nproc // hosts each
    intra_bandwidth: Optional[str]  # with hosts > 1: tc rate inside a host; None: unshaped
    share_gpu: bool = False  # every rank on GPU 0 over NCCL, each rank its own host (_share)

    @property
    def ranks_per_host(self) -> int:
        return self.nproc // self.hosts


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
    placements: Sequence[Placement] = [UNSHAPED] * job.nproc
    shaping: dict[str, str] = {}
    with contextlib.ExitStack() as cleanup:
        if job.bandwidth is not None:
            try:
                namespaces = cleanup.enter_context(Namespaces(find_tools(), f"oases-{os.getpid()}"))
                placements, shaping = _shape(namespaces, job, job.bandwidth)
            except ShapingUnavailable as why:
                cleanup.close()  # whatever was built
                print(f"oases-launch: cannot shape the network ({why}); running unshaped", file=sys.stderr, flush=True)
        return run_ranks(_rank_processes(job, placements, shaping))


def _shape(namespaces: Namespaces, job: _Job, bandwidth: str) -> tuple[list[Placement], dict[str, str]]:
    """Build the job's shaped links: each rank's placement, and what the ranks learn of the links."""
    if job.hosts == 1:
        placements = namespaces.build(job.topology, job.nproc, _bits(bandwidth))
        return placements, {"OASES_BANDWIDTH": bandwidth, "OASES_TOPOLOGY": job.topology}
    intra = None if job.intra_bandwidth is None else _bits(job.intra_bandwidth)
    hosts = namespaces.build_hosts(job.hosts, _bits(bandwidth), intra)
    placements = [hosts[rank // job.ranks_per_host] for rank in range(job.nproc)]
    shaping = {"OASES_BANDWIDTH": bandwidth, "OASES_TOPOLOGY": "hosts", "OASES_HOSTS": str(job.hosts)}
    if job.intra_bandwidth is not None:
        shaping["OASES_INTRA_BANDWIDTH"] = job.intra_bandwidth
    return placements, shaping


def _bits(bandwidth: str) -> int:
    return round(parse_bandwidth(bandwidth) * 8)


def _rank_processes(job: _Job, placements: Sequence[Placement], extra_env: dict[str, str]) -> list[RankProcess]:
    """torchrun's environment for each rank, inside its placement: one node's, or with --hosts
    that of `job.hosts` nodes of `ranks_per_host` ranks each (GROUP_RANK: the rank's host)."""
    port = _free_port()
    per_host = job.ranks_per_host
    ranks = []
    for rank, placement in enumerate(placements):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank % per_host),
            WORLD_SIZE=str(job.nproc),
            LOCAL_WORLD_SIZE=str(per_host),
            MASTER_ADDR=placements[0].address,
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=job.threads,
        )
        if job.hosts > 1:
            env.update(GROUP_RANK=str(rank // per_host), GROUP_WORLD_SIZE=str(job.hosts))
        if job.share_gpu:
            env.update(sharing_env(rank, job.nproc, os.environ))
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
    if options.hosts > 1:
        _check_hosts(parser, options)
    if options.selftest:
        if options.script is not None or options.module:
            parser.error("--selftest runs its own rank code: give no SCRIPT and no -m")
        if options.nproc < 2:
            parser.error("--selftest measures rank 0 -> rank 1: needs --nproc 2 or more")
        if options.hosts > 1 and options.nproc // options.hosts < 2:
            parser.error("--selftest with --hosts measures a pair inside a host too: needs 2 or more ranks per host")
        target: tuple[str, ...] = ("-m", SELFTEST_MODULE)
    elif options.script is None:
        parser.error("give the SCRIPT to run (or -m MODULE, or --selftest)")
    else:
        target = (*(["-m"] if options.module else []), options.script, *options.args)
    if options.topology is not None and options.bandwidth is None:
        parser.error("--topology shapes links: give --bandwidth too")
    if options.intra_bandwidth is not None and options.hosts == 1:
        parser.error(
            "--intra-bandwidth shapes the links inside each of several hosts: give --hosts 2 "
            "or more (on one host, --bandwidth shapes the links between its ranks)"
        )
    if options.share_gpu:
        _check_sharing(parser, options)
    threads = str(options.threads) if options.threads else os.environ.get("OMP_NUM_THREADS", "1")
    return _Job(
        options.nproc,
        target,
        threads,
        options.bandwidth,
        options.topology or DEFAULT_TOPOLOGY,
        options.hosts,
        options.intra_bandwidth,
        options.share_gpu,
    )


def _check_sharing(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """--share-gpu: the ranks are hosts of their own on one GPU, over loopback sockets."""
    if options.hosts > 1:
        parser.error("--share-gpu makes every rank a host of its own: give no --hosts")
    if options.topology == "switch":
        parser.error(
            "--share-gpu sends NCCL's traffic over loopback (NCCL_SOCKET_IFNAME=lo): shape it with "
            "--topology shared (the default), not switch"
        )
    if visible_gpus() < 1:
        parser.error(
            "--share-gpu runs every rank on one GPU over NCCL, but torch sees no GPU here "
            "(torch.cuda.is_available() is False); run without --share-gpu (gloo on the CPU)"
        )


def _check_hosts(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """--hosts H > 1: ranks pack evenly into H hosts, joined by links of --bandwidth."""
    if options.nproc % options.hosts != 0:
        parser.error(
            f"--nproc {options.nproc} ranks cannot be packed evenly into --hosts "
            f"{options.hosts}: --nproc must be divisible by --hosts"
        )
    if options.bandwidth is None:
        parser.error("--hosts emulates servers joined by shaped NICs: give --bandwidth too")
    if options.topology is not None:
        parser.error(
            "--topology shapes the links of one host: with --hosts, a host's ranks share "
            "its loopback (--intra-bandwidth) and hosts talk through NICs (--bandwidth)"
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oases-launch",
        description="Start NPROC ranks of SCRIPT with torchrun's environment, optionally over "
        "rate-limited links emulating a commodity server's interconnect, or (--hosts) "
        "several servers joined by NICs.",
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        type=_positive_int,
        default=1,
        help="number of ranks, on all hosts together (default: 1)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_bandwidth,
        metavar="RATE",
        help="shape the links between ranks (with --hosts: between hosts) to RATE, "
        "in tc syntax (250mbit, 1gbit, 8gbit)",
    )
    parser.add_argument(
        "--hosts",
        type=_positive_int,
        default=1,
        metavar="H",
        help="emulate H servers: ranks 0..NPROC/H-1 on host 0, the next NPROC/H on "
        "host 1, ... (NPROC divisible by H; needs --bandwidth); each host's NIC "
        "sends and receives at RATE, its ranks talk among themselves over its "
        "loopback (default: 1, the ranks on one server)",
    )
    parser.add_argument(
        "--intra-bandwidth",
        type=_bandwidth,
        metavar="RATE",
        help="with --hosts: shape the links inside each host to RATE (default: unshaped)",
    )
    parser.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        help=f"with --bandwidth: shared = one link for all ranks (one PCIe host "
        f"bridge), switch = a link per rank into a switch (a NIC per GPU); "
        f"default {DEFAULT_TOPOLOGY}",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        metavar="K",
        help="OMP_NUM_THREADS per rank (default: the environment's, else 1)",
    )
    parser.add_argument(
        "--share-gpu",
        action="store_true",
        help="run every rank on GPU 0 over NCCL, each rank its own host (NCCL_HOSTID), NCCL "
        "over loopback sockets: a test mode for a machine with one GPU, not a speedup",
    )
    parser.add_argument(
        "--selftest",
        action="store_true",
        help=f"measure the rank 0 <-> rank 1 bandwidth (with --hosts also rank 0 <-> "
        f"the first rank of host 1) instead of running a script "
        f"(= -m {SELFTEST_MODULE})",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, run as `python -m SCRIPT`"
    )
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
