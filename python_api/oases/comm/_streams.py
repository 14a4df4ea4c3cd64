"""Who waits for whom in a ring: the compute side (GEMMs) and the communication side.

The rings in `oases.comm.ring` are written once against this small interface; two sides
implement it:

  _HostSide    CPU tensors (gloo): the host thread is the only "stream"; a work's wait() blocks
               it until the transfer is done, and every method here is a no-op. This is the
               order the CPU path has always run in.
  _DeviceSide  CUDA tensors: a high-priority (-1) comm stream of Oases' own beside the caller's
               compute stream. Ring steps are posted and waited for from the comm stream, and the
               reduce-scatter's accumulates run there too, so the compute stream never waits for
               a transfer it does not read, and the host never waits at all:

        compute: | GEMM 0 | GEMM 1 | GEMM 2 | GEMM 3 |              ...  | (join)
                     \\ event  \\ event
        comm   :      |post P0|wait P0'|P0+=P0', post|wait P1'|...       /  event
        NCCL   :      |----- send P0, recv P0' -----|----- ...

               Event order: `handoff` (comm waits for what compute has enqueued), `to_compute`
               (compute waits for what comm has enqueued); a work's wait() inside `comm()` makes
               the comm stream wait for the transfer (ProcessGroupNCCL waits on the current
               stream, by event, without blocking the host). Tensors the comm stream reads or
               writes that were allocated on the compute stream are `record_stream`ed to it, so
               the caching allocator does not hand their memory to the compute stream while the
               comm stream may still use it; buffers the comm stream allocates itself
               (`empty_like` inside `comm()`) belong to it.

`side_for(t)` picks the side from a tensor's device. A test can drive the rings with any object
that has these methods (e.g. one that records the order of calls on CPU tensors).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Union

import torch

_COMM_PRIORITY = -1  # as TransformerEngine's and PyTorch's async-TP communication streams


class _HostSide:
    """CPU: one thread computes and waits; the transfers run in the backend's threads."""

    def comm(self) -> ContextManager[None]:
        """Work enqueued inside runs on the communication side (here: the calling thread)."""
        return contextlib.nullcontext()

    def handoff(self, *tensors: torch.Tensor) -> None:
        """The comm side may now read `tensors` (and everything computed before them)."""

    def to_compute(self) -> None:
        """The compute side may now read everything the comm side has enqueued so far."""


class _DeviceSide:
    """CUDA: the caller's current stream computes; a high-priority stream of Oases' communicates."""

    def __init__(self, device: torch.device) -> None:
        self.compute = torch.cuda.current_stream(device)
        # From torch's per-device pool of streams: constructing one is cheap and allocates nothing.
        self.stream = torch.cuda.Stream(device=device, priority=_COMM_PRIORITY)

    def comm(self) -> ContextManager[None]:
        return torch.cuda.stream(self.stream)

    def handoff(self, *tensors: torch.Tensor) -> None:
        self.stream.wait_stream(self.compute)  # an event: the host does not wait
        for t in tensors:
            t.record_stream(self.stream)

    def to_compute(self) -> None:
        self.compute.wait_stream(self.stream)


_Side = Union[_HostSide, _DeviceSide]


def side_for(t: torch.Tensor) -> _Side:
    """The side that orders a ring over `t`'s device: streams on CUDA, the host thread otherwise."""
    return _DeviceSide(t.device) if t.is_cuda else _HostSide()
