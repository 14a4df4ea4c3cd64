"""Run one process per rank; the first rank to fail ends the run.

Each rank starts in its own session (process group), so stopping a rank also stops what it
started, and a terminal's Ctrl-C reaches the launcher only: the launcher decides how ranks end.

    rank 0    ──────────────────────────────x  SIGTERM (SIGKILL if alive `grace` s later)
    rank 1    ───────────────── exit 3 ┐
    launcher  wait for the first exit ─┴─> "rank 1 exited with code 3", stop the others, return 3
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

from oases.launch._signals import signals_deferred

_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class RankProcess:
    """What to run for one rank: the full command line and its complete environment."""

    command: Sequence[str]
    env: Mapping[str, str]


def exit_status(returncode: int) -> int:
    """A process's exit code as a shell reports it: killed by signal S -> 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(ranks: Sequence[RankProcess], *, grace: float = _GRACE_SECONDS) -> int:
    """Start every rank, wait for all; return 0, or the exit status of the first rank to fail.

    When a rank fails, the others get SIGTERM, and SIGKILL if still alive `grace` seconds later.
    Whatever ends this call (return, exception, Interrupted), no rank outlives it.
    Ranks inherit stdin/stdout/stderr: their output and tracebacks stream to the terminal.
    """
    procs: list[subprocess.Popen] = []
    try:
        for rank in ranks:
            procs.append(subprocess.Popen(list(rank.command), env=dict(rank.env), start_new_session=True))
        return _wait_for_first_failure(procs)
    finally:
        with signals_deferred():
            _stop(procs, grace)


def _wait_for_first_failure(procs: Sequence[subprocess.Popen]) -> int:
    with contextlib.closing(_exit_order(procs)) as exits:
        for rank in exits:
            returncode = procs[rank].wait()
            if returncode != 0:
                print(
                    f"oases-launch: rank {rank} {_describe(returncode)}; stopping the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
                return exit_status(returncode)
    return 0


def _exit_order(procs: Sequence[subprocess.Popen]) -> Iterator[int]:
    """Ranks in the order their processes exit; the caller's `procs[rank].wait()` then returns
    at once with the exit code. Linux: a pidfd per rank; elsewhere: polling."""
    if not hasattr(os, "pidfd_open"):
        pending = list(range(len(procs)))
        while pending:
            done = [rank for rank in pending if procs[rank].poll() is not None]
            pending = [rank for rank in pending if rank not in done]
            yield from done
            if pending:
                time.sleep(_POLL_SECONDS)
        return
    with contextlib.ExitStack() as fds:
        exits = select.poll()
        rank_of = {}
        for rank, proc in enumerate(procs):
            fd = os.pidfd_open(proc.pid)  # readable once the process has exited
            fds.callback(os.close, fd)
            exits.register(fd, select.POLLIN)
            rank_of[fd] = rank
        while rank_of:
            for fd, _ in exits.poll():
                exits.unregister(fd)
                yield rank_of.pop(fd)


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    alive = [proc for proc in procs if proc.poll() is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    # The rank is its group's leader and not yet reaped, so its pid (= group id) is still its own.
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
