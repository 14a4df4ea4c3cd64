"""SIGINT/SIGTERM as an exception in the launcher, and clean-up that they cannot cut short.

with signals_raise():          # Ctrl-C or `kill` -> Interrupted(signum) in the main thread
    try:
        ...                    # start ranks, wait
    finally:
        with signals_deferred():
            ...                # stop ranks, delete namespaces: runs to the end; a signal
                               # that arrives meanwhile is raised when the block exits
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The launcher received `signum` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise Interrupted; the previous handlers come back after.

    A signal that was ignored (SIG_IGN) when the block starts stays ignored.
    Signal handlers belong to the main thread: called from another thread this changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # A signal ignored from the start (a `nohup` or `cmd &` launcher) stays ignored.
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _raise_interrupted)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: set outside Python, cannot be restored
                signal.signal(signum, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread for the block; pending ones are delivered at its end."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
