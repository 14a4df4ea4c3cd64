"""CPU time of this process's threads other than the caller's: what communication costs the cores.

    with OtherThreadsCPU() as other:
        step()
    other.seconds   # user + system CPU seconds the other threads (gloo's, a communicator's) used

The process's CPU time (all its threads, ended ones included) minus the calling thread's own, over
the block. On a machine where compute keeps every core busy, this is CPU time the compute could
not have: the transfers' own cost to the cores, which no schedule hides.
"""

from __future__ import annotations

import time
from typing import Optional


class OtherThreadsCPU:
    """CPU seconds used during the block by the process's threads other than the one entering it."""

    def __init__(self) -> None:
        self.seconds: Optional[float] = None

    def __enter__(self) -> "OtherThreadsCPU":
        self._process, self._own = time.process_time(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        process, own = time.process_time() - self._process, time.thread_time() - self._own
        self.seconds = max(process - own, 0.0)
