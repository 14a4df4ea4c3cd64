"""Resident memory of this process (VmRSS), and its peak inside a block: the bench's one home for both.

    with PeakRSS() as peak:
        work()
    peak.rise  # bytes: the highest VmRSS seen during the block minus VmRSS at its start
    hwm_rise_mib(step)  # MiB: the kernel's own peak (VmHWM, reset first) over one step(): exact

`ru_maxrss` only grows over a process's life, so a peak inside one call needs sampling (every
`interval` s; a spike shorter than that can be missed, so keep the interval small).

Freed memory that glibc keeps is still resident. To make RSS follow the tensors a process holds:

    exact_malloc()   # once: mallopt(M_MMAP_THRESHOLD, 128 KiB): every larger block is its own
                     # mapping, unmapped at free (the threshold stops rising with freed blocks)
    settle()         # before reading VmRSS: gc.collect(), then malloc_trim(0) (free heap pages back)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
import time
from typing import Callable, Optional

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)


def rss_bytes() -> int:
    """VmRSS of this process, from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRSS:
    """Samples VmRSS every `interval` seconds inside a `with` block: `start`, `peak`, `rise`."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def rise(self) -> int:
        return self.peak - self.start


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def exact_malloc(threshold: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (not glibc: nothing); True when set."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, threshold))


def settle(trim: bool = True) -> None:
    """gc.collect(), then (trim, glibc) malloc_trim(0): what is freed leaves RSS before it is read."""
    gc.collect()
    libc = _libc() if trim else None
    if libc is not None:
        libc.malloc_trim(0)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def hwm_rise_mib(step: Callable[[], object]) -> Optional[float]:
    """Rise of this process's peak resident memory (VmHWM) over one call of `step` (Linux, glibc).

    glibc keeps freed blocks for reuse, so resident memory would not follow the tensors alive;
    with every block over 64 KiB mmap-ed and returned at once (mallopt), it does. That slows
    allocation, so call this only after every timing. None where /proc or glibc is missing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        before = _status_kib("VmHWM:")  # that reset value: VmRSS read now may already have moved (other threads)
    except (OSError, StopIteration):
        return None
    step()
    # Linux batches each thread's RSS counters (up to 64 pages), so a step that allocates almost
    # nothing can read a fraction of a MiB below the reset value: no rise.
    return max(0, _status_kib("VmHWM:") - before) / 1024
