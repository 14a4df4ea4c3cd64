"""Process groups for tensor parallelism, with communication on high-priority streams on CUDA.

On NCCL, the ring steps of `oases.comm` and `oases.ops` run on the process group's own CUDA
streams, and `work.wait()` makes the computing stream wait for them by event: no host
synchronisation. Creating the group with `is_high_priority_stream` puts those streams at priority
-1 (what TransformerEngine and PyTorch's async TP use), so a chunk's transfer is scheduled ahead of
the GEMMs it overlaps. On gloo (CPU) the option does not exist and a plain group is made.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

__all__ = ["new_group"]


def _nccl_high_priority_options():
    """ProcessGroupNCCL options with high-priority streams, or None where NCCL is not built."""
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:  # a CPU build of torch
        return None
    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def new_group(ranks: Optional[Sequence[int]] = None, *, backend: Optional[str] = None,
              high_priority: bool = True) -> dist.ProcessGroup:
    """`torch.distributed.new_group(ranks, backend)`, with high-priority streams on NCCL.

        group = oases.comm.new_group([0, 1, 2, 3])         # every rank calls it, like new_group
    Collective: every rank of the world must call it with the same arguments.
    """
    backend = backend or dist.get_backend()
    options = _nccl_high_priority_options() if high_priority and backend == "nccl" else None
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, pg_options=options)
