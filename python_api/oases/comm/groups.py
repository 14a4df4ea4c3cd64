"""Process groups for tensor parallelism, with communication on high-priority streams on CUDA.

On NCCL, the ring steps of `oases.comm` and `oases.ops` are posted and waited for from a
high-priority (-1) stream of Oases' own (`oases.comm._streams`); the transfers themselves run on
the process group's internal NCCL streams. Creating the group with `is_high_priority_stream`
puts those at priority -1 too (what TransformerEngine and PyTorch's async TP use), so a piece's
transfer is scheduled ahead of the GEMMs it overlaps. Groups made elsewhere (the default group of
`init_process_group`) get the same with TORCH_NCCL_HIGH_PRIORITY=1, which `python -m bench all`
sets. On gloo (CPU) the option does not exist and a plain group is made; a backend per device
("cpu:gloo,cuda:nccl") gets the option for its NCCL part.
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


def new_group(
    ranks: Optional[Sequence[int]] = None, *, backend: Optional[str] = None, high_priority: bool = True
) -> dist.ProcessGroup:
    """`torch.distributed.new_group(ranks, backend)`, with high-priority streams on NCCL.

    ::

        group = oases.comm.new_group([0, 1, 2, 3])         # every rank calls it, like new_group

    Collective: every rank of the world must call it with the same arguments.
    """
    backend = backend or dist.get_backend()
    nccl = backend == "nccl" or "cuda:nccl" in str(backend)  # also "cpu:gloo,cuda:nccl" (gloo ignores the options)
    options = _nccl_high_priority_options() if high_priority and nccl else None
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, pg_options=options)
