"""CopyEngine: batched copies of many tensors to and from offsets of a host buffer, one call each,
issued on a copy stream of their own so the caller keeps computing.

    event = engine.copy_out(tensors, buffer, offsets)   # buffer[offsets[i] : +nbytes_i] = bytes(tensors[i])
    outs, event = engine.copy_in(buffer, offsets, [(shape, dtype), ...])   # new tensors on engine.device
    event.wait()                                        # before reading `outs` (or reusing the regions)

    CUDA (written to the contract; not run on this machine):
      compute stream: | fwd k+1 ...  ready●         | ...              wait● | recompute k
      copy stream   :               wait● D2H batch ●done      H2D batch ●done
    a dedicated stream of the lowest priority; `ready` is an event recorded on the caller's
    current stream that the copy stream waits for, `done` one recorded after the copies that the
    consumer's stream waits for (CopyEvent.wait): no host synchronisation anywhere. A tensor
    copied out is `record_stream`-ed on the copy stream, so dropping it frees its memory for
    reuse only after the copy read it; a tensor copied in is allocated on the copy stream and
    `record_stream`-ed on the stream that waits for it.

    Small tensors: with the extension, tensors whose buffer regions lie end to end (as a
    HostSlab's consecutive regions do when their sizes are multiples of 256 bytes) move as one run:
    out (each at most 64 KiB), one gather kernel into a device staging buffer and one DMA copy; in
    (each at most 1 MiB), one DMA copy into one allocation that the run's tensors are views of
    (its memory is freed once all of them are dropped; they share one version counter). Others
    move one copy each. Measured on an H200 (`python -m bench.cuda_micro --sections
    batched_copies`, docs/benchmarks.md): 256 tensors of 16 KiB 3.5x (out) and 3.2x (in) the rate
    of per-tensor copies; 16 of them about 1x (the call's own overhead dominates).

    CPU: the copy stream is one worker thread; copies run there in issue order, the extension's
    memcpy releasing the GIL (and split over the intra-op threads), events are futures.
    `asynchronous=False` runs every copy in the caller instead.

The path: `oases._C.pack/unpack` when `_should_use_extension(device)` (the extension is built,
with CUDA for a GPU), else the Python fallback (one `copy_` per tensor), which is also the
reference; `use_extension=False` forces it, True requires the extension. Each batched copy runs
in a `torch.profiler.record_function("oases.offload.copy_<out|in>:<extension|python>")` range
while a profiler runs (none otherwise: opening one costs microseconds, a small copy's own time).
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence, Union

import torch

from oases import _extension
from oases._ranges import hot_range

__all__ = ["CopyEngine", "CopyEvent"]

Spec = tuple[Sequence[int], torch.dtype]  # (shape, dtype) of a tensor to copy in


def _should_use_extension(device: torch.device) -> bool:
    """The extension copies for `device`: it imports, and it was built with CUDA for a GPU."""
    if not _extension.is_available():
        return False
    return device.type == "cpu" or (device.type == "cuda" and _extension.compiled().build_info()["cuda"])


class CopyEvent:
    """One batched copy's completion. `wait()`: make the caller wait for it (CUDA: the current
    stream waits, the host does not); `done()`: whether it completed (never blocks)."""

    def __init__(
        self, *, future: Optional[Future] = None, cuda_event=None, tensors: Sequence[torch.Tensor] = ()
    ) -> None:
        self._future, self._cuda_event, self._tensors = future, cuda_event, list(tensors)

    def done(self) -> bool:
        """Whether the copy completed (never blocks)."""
        if self._future is not None:
            return self._future.done()
        return self._cuda_event is None or bool(self._cuda_event.query())

    def wait(self) -> None:
        """Make the caller wait for the copy: on the CPU the host blocks (and re-raises the copy's error);
        on CUDA the current stream waits for it, the host does not."""
        if self._future is not None:
            self._future.result()  # re-raises the copy's exception, if any
        elif self._cuda_event is not None:
            stream = torch.cuda.current_stream(self._tensors[0].device if self._tensors else None)
            stream.wait_event(self._cuda_event)
            for t in self._tensors:  # allocated on the copy stream, used from here on this one
                t.record_stream(stream)
            self._tensors = []


class CopyEngine:
    """Batched device <-> host copies on a copy stream of their own (see the module docstring).

    `calls["out"|"in"]` counts batched copy calls and `bytes["out"|"in"]` the bytes they moved.
    `close()` ends the CPU worker thread (after its queued copies); a later copy starts another.
    """

    def __init__(
        self,
        device: Union[str, torch.device, None] = None,
        *,
        use_extension: Optional[bool] = None,
        asynchronous: bool = True,
    ) -> None:
        self.device = torch.device("cpu" if device is None else device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device} is neither a CPU nor a CUDA device")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if use_extension is None:
            use_extension = _should_use_extension(self.device)
        elif use_extension:
            _extension.compiled()  # ImportError saying how to build it
            if not _should_use_extension(self.device):
                raise ValueError(
                    f"use_extension: oases._C was built without CUDA, so it cannot copy from "
                    f"{self.device}; pass None or False"
                )
        self.use_extension = bool(use_extension)
        self.asynchronous = asynchronous
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self._stream = None  # CUDA: the copy stream, made on first use
        self._worker: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        """The copy path in use: "extension" (oases._C) or "python"."""
        return "extension" if self.use_extension else "python"

    def copy_out(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor, offsets: Sequence[int]) -> CopyEvent:
        """Start buffer[offsets[i] : offsets[i] + nbytes(tensors[i])] = bytes(tensors[i]) for all i.

        tensors: contiguous, on `device`, any dtypes; buffer: a 1-D uint8 host tensor (pinned on
        CUDA). The caller may drop `tensors` at once: the copy keeps them alive until it read them."""
        tensors, offsets = list(tensors), [int(o) for o in offsets]
        self._count("out", self._check(tensors, buffer, offsets, "tensors"))
        if self.device.type == "cuda":
            return self._cuda_copy_out(tensors, buffer, offsets)
        return self._run(self._copy_out_now, tensors, buffer, offsets)

    def copy_in(
        self, buffer: torch.Tensor, offsets: Sequence[int], specs: Sequence[Spec]
    ) -> tuple[list[torch.Tensor], CopyEvent]:
        """Start outs[i] = tensor of specs[i] = (shape, dtype) from buffer[offsets[i] : ...], new
        contiguous tensors on `device`; read them only after event.wait()."""
        offsets = [int(o) for o in offsets]
        if len(specs) != len(offsets):
            raise ValueError(f"offsets: need one offset per spec, got {len(offsets)} for {len(specs)}")
        if self.device.type == "cuda":
            return self._cuda_copy_in(buffer, offsets, specs)
        outs, _ = self._empty(offsets, specs)
        self._count("in", self._check(outs, buffer, offsets, "specs"))
        return outs, self._run(self._copy_in_now, buffer, outs, offsets)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has completed."""
        if self._stream is not None:
            self._stream.synchronize()
        worker = self._worker
        if worker is not None:
            worker.submit(lambda: None).result()

    def close(self) -> None:
        """End the CPU worker thread after its queued copies (a later copy starts another)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)

    # ---- internals ----------------------------------------------------------------------------------

    def _check(self, tensors: list[torch.Tensor], buffer: torch.Tensor, offsets: list[int], what: str) -> int:
        """Every check before any copy is issued (so errors raise here, not from the copy stream);
        returns the bytes to move. The extension's checks run in C++ (one call for the batch)."""
        if len(tensors) != len(offsets):
            raise ValueError(f"offsets: need one offset per tensor, got {len(offsets)} for {len(tensors)}")
        if buffer.dim() != 1 or buffer.dtype != torch.uint8 or buffer.device.type != "cpu":
            raise ValueError("buffer: expected a 1-D uint8 host tensor (a HostSlab's buffer)")
        if tensors and tensors[0].device != self.device:
            raise ValueError(f"{what}[0]: on {tensors[0].device}, but this engine copies for {self.device}")
        if self.use_extension:
            try:
                return _extension.compiled().check_batch(tensors, buffer, offsets)
            except RuntimeError as err:  # c10::Error: the message names the argument
                raise ValueError(str(err).splitlines()[0].replace("tensors[", f"{what}[")) from None
        for i, (t, off) in enumerate(zip(tensors, offsets)):
            if t.device != self.device:
                raise ValueError(f"{what}[{i}]: on {t.device}, but this engine copies for {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"{what}[{i}]: must be contiguous (pass t.contiguous())")
            if off < 0 or t.numel() * t.element_size() > buffer.numel() - off:
                raise ValueError(
                    f"offsets[{i}]={off}: {t.numel() * t.element_size()} bytes do not fit a buffer "
                    f"of {buffer.numel()} bytes"
                )
        return sum(t.numel() * t.element_size() for t in tensors)

    def _empty(self, offsets: list[int], specs: Sequence[Spec]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outs, owners): new tensors for specs on the device; with the extension, small tensors
        whose regions lie end to end share one allocation laid out as the buffer (oases._C.empty_batch),
        so they come in with one copy; owners: the distinct allocations."""
        if self.use_extension:
            try:
                return _extension.compiled().empty_batch(
                    offsets, [tuple(shape) for shape, _ in specs], [dtype for _, dtype in specs], self.device
                )
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as err:  # c10::Error: the message names the argument
                raise ValueError(str(err).splitlines()[0]) from None
        outs = [torch.empty(tuple(shape), dtype=dtype, device=self.device) for shape, dtype in specs]
        return outs, outs

    def _count(self, direction: str, nbytes: int) -> None:
        self.calls[direction] += 1
        self.bytes[direction] += nbytes

    def _run(self, fn, *args) -> CopyEvent:
        """CPU: run fn(*args) on the worker thread (issue order), or now when not asynchronous."""
        if not self.asynchronous:
            future: Future = Future()
            try:
                fn(*args)
                future.set_result(None)
            except BaseException as err:  # delivered by wait(), as from the worker
                future.set_exception(err)
            return CopyEvent(future=future)
        with self._lock:
            if self._worker is None:
                threads = torch.get_num_threads()  # the copies' intra-op threads: the caller's
                self._worker = ThreadPoolExecutor(
                    1, thread_name_prefix="oases-offload", initializer=torch.set_num_threads, initargs=(threads,)
                )
            return CopyEvent(future=self._worker.submit(fn, *args))

    def _copy_out_now(self, tensors: list[torch.Tensor], buffer: torch.Tensor, offsets: list[int]) -> None:
        with hot_range(f"oases.offload.copy_out:{self.path}"):
            if self.use_extension:
                _extension.compiled().pack(tensors, buffer, offsets)
                return
            for t, off in zip(tensors, offsets):
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    buffer[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)

    def _copy_in_now(self, buffer: torch.Tensor, outs: list[torch.Tensor], offsets: list[int]) -> None:
        with hot_range(f"oases.offload.copy_in:{self.path}"):
            if self.use_extension:
                _extension.compiled().unpack(buffer, outs, offsets)
                return
            for t, off in zip(outs, offsets):
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    t.copy_(buffer[off : off + nbytes].view(t.dtype).view(t.shape), non_blocking=True)

    def _copy_stream(self):
        if self._stream is None:  # priority 0 is CUDA's lowest: compute and communication go first
            self._stream = torch.cuda.Stream(self.device, priority=0)
        return self._stream

    def _cuda_copy_out(self, tensors, buffer, offsets) -> CopyEvent:
        if tensors and not buffer.is_pinned():
            raise ValueError("buffer: must be pinned for asynchronous copies from a GPU (HostSlab pins on CUDA)")
        stream, ready, done = self._copy_stream(), torch.cuda.Event(), torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the tensors' producers
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            self._copy_out_now(tensors, buffer, offsets)
            if not self.use_extension:  # (the extension's pack records them itself, in C++)
                for t in tensors:  # their memory is reused only after this stream read it
                    t.record_stream(stream)
            done.record(stream)
        return CopyEvent(cuda_event=done)

    def _cuda_copy_in(self, buffer, offsets, specs) -> tuple[list[torch.Tensor], CopyEvent]:
        if specs and not buffer.is_pinned():
            raise ValueError("buffer: must be pinned for asynchronous copies to a GPU (HostSlab pins on CUDA)")
        stream, done = self._copy_stream(), torch.cuda.Event()
        with torch.cuda.stream(stream):  # allocated on the copy stream: no wait on the compute stream
            outs, owners = self._empty(offsets, specs)
            self._count("in", self._check(outs, buffer, offsets, "specs"))
            self._copy_in_now(buffer, outs, offsets)
            done.record(stream)
        return outs, CopyEvent(cuda_event=done, tensors=owners)
