"""Offloader: saved tensors leave the device in batches and come back, in use order, before use.

    off = Offloader(batch=8)                  # no slab: the first step profiles and sizes it
    c = off.save(x, group=k)                  # every `batch` saves of group k: one copy out
    off.flush(k)                              # the rest of group k's saves: one more copy out
    off.prefetch([c, ...])                    # copies in, in the order given, `batch` per call
    x = off.get(c)                            # waits for c's copy in (issues it if needed)
    off.release(c)                            # c is done with: its device and host memory go
    stats = off.end_step()                    # counts of the step; the first step allocates the slab

Each saved tensor's handle has an explicit state, so misuse raises instead of reading stale memory:

    save --> ON_DEVICE --offload--> IN_FLIGHT_OUT --(copy done)--> ON_HOST
                 ^                                                    |
                 +----get (waits)---- IN_FLIGHT_IN <----prefetch------+
    release (from any state) --> RELEASED;   prefetch of a tensor never offloaded, get or
    release of a RELEASED one (a double free) and a slab too small raise.

Host storage: a preallocated HostSlab (given, or allocated by `end_step()` of the first step
from that step's high-water mark; until then each batch gets a host buffer of its own, so the
profiling step offloads too). A saved tensor's host region is freed as soon as its copy in is
issued: the next copy out into it is issued later on the same copy stream, so it cannot
overtake. Device-resident bytes (`stats.resident_bytes`, `peak_resident_bytes`) count a
saved tensor from save until its copy out is issued, and again from its copy in until release:
the device memory the offloader holds references to.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Optional

import torch

from oases import _checks
from oases._deprecated import renamed as _renamed
from oases.offload.engine import CopyEngine
from oases.offload.handle import OffloadHandle, OffloadState, _Record
from oases.offload.slab import _UNBOUNDED, ALIGNMENT, HostSlab, _FirstFit, _round_up

__all__ = ["Offloader", "OffloadHandle", "OffloadState", "OffloadStats"]


@dataclass
class OffloadStats:
    """What an Offloader did since the step began (oases.offload.Offloader.begin_step).

    copies_out / copies_in: batched copy calls; bytes_out / bytes_in: bytes they moved;
    saves: tensors saved; resident_bytes: device bytes of saved tensors the offloader holds now,
    peak_resident_bytes: the most at once; host_bytes: bytes of host regions in use now (aligned),
    host_high_water: the slab size this step's placements need."""

    saves: int = 0
    copies_out: int = 0
    copies_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    host_bytes: int = 0
    host_high_water: int = 0

    @property
    def checkpoints(self) -> int:
        """Deprecated name of `saves` ("checkpoint" is a training state saved to files)."""
        warnings.warn(
            "OffloadStats.checkpoints is deprecated: use OffloadStats.saves", DeprecationWarning, stacklevel=2
        )
        return self.saves


def _dense_order(t: torch.Tensor) -> Optional[list[int]]:
    """A permutation p with t.permute(p) contiguous (t dense, its strides in any order), else None."""
    p = sorted(range(t.dim()), key=t.stride, reverse=True)  # stable: equal strides keep their order
    return p if t.permute(p).is_contiguous() else None


def _inverse(p: list[int]) -> list[int]:
    inv = [0] * len(p)
    for i, d in enumerate(p):
        inv[d] = i
    return inv


class Offloader:
    """Moves saved tensors to host memory in batches and back in use order (module docstring).

    slab: the HostSlab (None: allocated by the first `end_step()` from that step's need);
    batch: saved tensors per copy call (copies per step and group = ceil(saves / batch));
    engine: the CopyEngine (None: one per device, made on first use, closed by `close()`).
    """

    def __init__(self, slab: Optional[HostSlab] = None, *, batch: int = 8, engine: Optional[CopyEngine] = None) -> None:
        if slab is not None and not isinstance(slab, HostSlab):
            raise TypeError(f"slab: expected an oases.offload.HostSlab or None, got {type(slab).__name__}")
        if not _checks.is_int(batch) or batch < 1:
            raise ValueError(f"batch: expected an int >= 1 (saved tensors per copy call), got {batch!r}")
        if engine is not None and not isinstance(engine, CopyEngine):
            raise TypeError(f"engine: expected an oases.offload.CopyEngine or None, got {type(engine).__name__}")
        self.slab, self.batch = slab, batch
        self._engines: dict[torch.device, CopyEngine] = {} if engine is None else {engine.device: engine}
        self._owned = engine is None
        self._pending: dict[Hashable, list[OffloadHandle]] = {}
        self._profile = _FirstFit(_UNBOUNDED) if slab is None else None  # placements a slab would get
        self._batches = itertools.count()
        self._saves = itertools.count()
        self._lock = threading.RLock()
        self._dead: list[_Record] = []  # records of handles that died, to free (see OffloadHandle)
        self.stats = OffloadStats()

    # ---- the step -----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start a step: zero the counters (peaks restart from what is held now) and forget saves a
        failed step left pending (they are not offloaded)."""
        with self._lock:
            self._reap()
            self._pending.clear()
            s = self.stats
            self.stats = OffloadStats(
                resident_bytes=s.resident_bytes,
                peak_resident_bytes=s.resident_bytes,
                host_bytes=s.host_bytes,
                host_high_water=s.host_bytes,
            )

    def end_step(self) -> OffloadStats:
        """End a step: return its stats; without a slab yet, allocate one of the size this step's
        placements reached (the profiling step), which later steps then reuse."""
        with self._lock:
            self._reap()
            stats = replace(self.stats)
            if self.slab is None and self._profile is not None and self._profile.high_water > 0:
                self.slab = HostSlab(self._profile.high_water)
                self._profile = None
            return stats

    # ---- saving and offloading ----------------------------------------------------------------------

    def save(self, tensor: torch.Tensor, *, group: Hashable = 0) -> OffloadHandle:
        """Register `tensor` (kept on the device for now); once `group` has `batch` saves not yet
        offloaded, they leave in one copy. Any dtype, any strides, zero-size too."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"tensor: only dense (strided) CPU or CUDA tensors are offloaded, got layout "
                f"{tensor.layout} on {tensor.device}"
            )
        t = tensor.detach().resolve_conj().resolve_neg()
        order = _dense_order(t)
        if order is None:  # overlapping or gapped (expanded, sliced): offload a contiguous copy
            t = t.contiguous()
            order = list(range(t.dim()))
        with self._lock:
            self._reap()
            record = _Record(t.permute(order), order)
            c = OffloadHandle(self, record, group, next(self._saves), tuple(tensor.shape))
            self.stats.saves += 1
            self._add_resident(record.nbytes)
            pending = self._pending.setdefault(group, [])
            pending.append(c)
            if len(pending) >= self.batch:
                self._offload(pending[: self.batch])
                del pending[: self.batch]
            return c

    def flush(self, group: Optional[Hashable] = None) -> None:
        """Offload the saves of `group` (None: of every group) not yet offloaded, `batch` per copy."""
        with self._lock:
            groups = list(self._pending) if group is None else [group]
            for g in groups:
                pending = self._pending.pop(g, [])
                for i in range(0, len(pending), self.batch):
                    self._offload(pending[i : i + self.batch])

    def _offload(self, handles: list[OffloadHandle]) -> None:
        records = [c._record for c in handles]
        buffer, offsets = self._place(records)
        event = self._engine(records[0].device).copy_out([r.tensor for r in records], buffer, offsets)
        number, peers = next(self._batches), [weakref.ref(c) for c in handles]
        for r, off in zip(records, offsets):
            r.buffer, r.offset, r.event, r.batch, r.peers = buffer, off, event, number, peers
            r.tensor, r.state, r.offloaded = None, OffloadState.IN_FLIGHT_OUT, True
            self._drop_resident(r)
        self.stats.copies_out += 1
        self.stats.bytes_out += sum(r.nbytes for r in records)

    def _place(self, records: list[_Record]) -> tuple[torch.Tensor, list[int]]:
        """Host regions for a batch: in the slab (all or none: SlabTooSmallError frees what this
        batch took), or, while profiling, in a buffer of the batch's own (and in the profile)."""
        if self.slab is not None:
            offsets: list[int] = []
            try:
                for r in records:
                    offsets.append(self.slab.allocate(r.nbytes) if r.nbytes else 0)
            except BaseException:
                for r, off in zip(records, offsets):
                    if r.nbytes:
                        self.slab.free(off)
                raise
            for r in records:
                r.region = r.nbytes > 0
            self._note_host()
            return self.slab.buffer, offsets
        offsets, end = [], 0
        for r in records:
            offsets.append(end)
            end += _round_up(r.nbytes, ALIGNMENT)
            if r.nbytes:
                r.profile_offset = self._profile.allocate(r.nbytes)
                r.region = True
        self._note_host()
        pinned = torch.cuda.is_available()
        return torch.empty(end, dtype=torch.uint8, pin_memory=pinned), offsets

    # ---- bringing back ------------------------------------------------------------------------------

    def prefetch(
        self,
        handles: Optional[Iterable[OffloadHandle]] = None,
        *,
        checkpoints: Optional[Iterable[OffloadHandle]] = None,
    ) -> None:
        """Start copying `handles` back to the device, in the order given, `batch` per copy call
        (a batch whose members share a host buffer). Ones already in (or coming in) are skipped;
        one never offloaded, or released, raises ValueError (before any copy starts).
        `checkpoints`: the deprecated name of `handles` (warns)."""
        if checkpoints is not None:
            if handles is not None:
                raise TypeError("prefetch: got both handles and checkpoints (its deprecated name)")
            warnings.warn(
                "Offloader.prefetch(checkpoints=...) is deprecated: use handles=", DeprecationWarning, stacklevel=2
            )
            handles = checkpoints
        if handles is None:
            raise TypeError("prefetch: missing the handles to bring back")
        handles = list(handles)
        with self._lock:
            self._reap()
            wanted, seen = [], set()
            for c in handles:
                self._check_mine(c, "prefetch")
                state = c.state
                if state is OffloadState.RELEASED:
                    raise ValueError(f"prefetch: {c} was released; nothing is left to bring back")
                if not c._record.offloaded:
                    raise ValueError(
                        f"prefetch: {c} was never offloaded (still on the device); prefetch brings "
                        "back what save()/flush() moved out"
                    )
                if state in (OffloadState.IN_FLIGHT_OUT, OffloadState.ON_HOST) and id(c) not in seen:
                    wanted.append(c)
                    seen.add(id(c))
            chunk: list[OffloadHandle] = []
            for c in wanted:
                if chunk and (len(chunk) == self.batch or c._record.buffer is not chunk[0]._record.buffer):
                    self._fetch(chunk)
                    chunk = []
                chunk.append(c)
            if chunk:
                self._fetch(chunk)

    def _fetch(self, handles: list[OffloadHandle]) -> None:
        records = [c._record for c in handles]
        specs = [(r.shape, r.dtype) for r in records]
        outs, event = self._engine(records[0].device).copy_in(records[0].buffer, [r.offset for r in records], specs)
        for r, out in zip(records, outs):
            self._free_region(r)  # later copies out are issued after this copy in, on the same stream
            r.tensor, r.event, r.state, r.buffer = out, event, OffloadState.IN_FLIGHT_IN, None
            self._add_resident(r.nbytes)
            r.resident = True
        self.stats.copies_in += 1
        self.stats.bytes_in += sum(r.nbytes for r in records)

    def get(self, c: OffloadHandle) -> torch.Tensor:
        """The saved tensor on its device (same shape, dtype, strides where it was dense): waits for
        its copy in, first issuing one for its whole batch if none was prefetched."""
        with self._lock:
            self._reap()
            self._check_mine(c, "get")
            state = c.state
            if state is OffloadState.RELEASED:
                raise ValueError(f"get: {c} was released; its memory may already hold other data")
            if state in (OffloadState.IN_FLIGHT_OUT, OffloadState.ON_HOST):  # with its batch
                peers = [p() for p in c._record.peers]
                self.prefetch(
                    [c]
                    + [
                        p
                        for p in peers
                        if p is not None
                        and p is not c
                        and p.state in (OffloadState.IN_FLIGHT_OUT, OffloadState.ON_HOST)
                    ]
                )
            r = c._record
            if r.state is OffloadState.IN_FLIGHT_IN:
                r.event.wait()
                r.event, r.state = None, OffloadState.ON_DEVICE
            return r.tensor.permute(_inverse(r.order))

    def release(self, c: OffloadHandle) -> None:
        """Done with `c`: drop the offloader's device tensor and host region. Twice raises."""
        with self._lock:
            self._reap()
            self._check_mine(c, "release")
            if c.state is OffloadState.RELEASED:
                raise ValueError(f"release: {c} was already released (double free)")
            r = c._record
            pending = self._pending.get(c.group, [])
            if c in pending:
                pending.remove(c)
            self._free_region(r)
            self._drop_resident(r)
            r.tensor, r.buffer, r.event, r.state = None, None, None, OffloadState.RELEASED

    # ---- engines, accounting ------------------------------------------------------------------------

    def engine(self, device: torch.device) -> CopyEngine:
        """The CopyEngine for `device` (made on first use)."""
        return self._engine(torch.device(device))

    def _engine(self, device: torch.device) -> CopyEngine:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        engine = self._engines.get(device)
        if engine is None:
            if not self._owned:
                raise ValueError(
                    f"engine: the Offloader's engine copies for {next(iter(self._engines))}, "
                    f"not for a tensor on {device}"
                )
            engine = self._engines[device] = CopyEngine(device)
        return engine

    def _check_mine(self, c: object, what: str) -> None:
        if not isinstance(c, OffloadHandle) or c._owner is not self:
            raise TypeError(
                f"{what}: expected an OffloadHandle that this Offloader's save() returned, got {type(c).__name__}"
            )

    def _add_resident(self, nbytes: int) -> None:
        s = self.stats
        s.resident_bytes += nbytes
        s.peak_resident_bytes = max(s.peak_resident_bytes, s.resident_bytes)

    def _drop_resident(self, r: _Record) -> None:
        if r.resident:
            self.stats.resident_bytes -= r.nbytes
            r.resident = False

    def _free_region(self, r: _Record) -> None:
        if r.region:
            r.region = False
            if self.slab is not None and r.buffer is self.slab.buffer:
                self.slab.free(r.offset)
            elif self._profile is not None and r.buffer is not None:
                self._profile.free(r.profile_offset)
            self._note_host()

    def _note_host(self) -> None:
        s, regions = self.stats, (self._profile if self._profile is not None else self.slab._regions)
        s.host_bytes = regions.in_use
        s.host_high_water = max(s.host_high_water, regions.high_water)

    def _reap(self) -> None:
        """Free what dead handles held (their finalizers only queued their records)."""
        while self._dead:
            r = self._dead.pop()
            self._free_region(r)
            self._drop_resident(r)
            r.tensor, r.buffer, r.event = None, None, None

    def close(self) -> None:
        """End the engines' worker threads (the engines this Offloader made)."""
        if self._owned:
            for engine in self._engines.values():
                engine.close()


__getattr__ = _renamed(
    __name__, {"Checkpoint": "OffloadHandle", "CheckpointState": "OffloadState"}, globals(), public="oases.offload"
)  # the old names warn
