"""`--share-gpu`: N ranks on one GPU over NCCL, each rank its own host.

NCCL refuses two ranks on one GPU when they share a host hash; the hash comes from NCCL_HOSTID
when it is set. Giving each rank its own NCCL_HOSTID makes every rank a node of its own, so NCCL
carries the traffic over its socket transport on loopback: NCCL over TCP, the commodity-cluster
transport, without the second machine. A test mode for a workstation with one GPU, not a speedup:
the ranks' kernels time-slice on the one GPU.

    rank r:  RANK=r  WORLD_SIZE=N  LOCAL_RANK=0  LOCAL_WORLD_SIZE=1  GROUP_RANK=r  GROUP_WORLD_SIZE=N
             NCCL_HOSTID=oases-share-r  OASES_SHARE_GPU=N (the ranks on the GPU: memory budgets divide by it)
             NCCL_NET=Socket  NCCL_IB_DISABLE=1  NCCL_SOCKET_IFNAME=lo  NCCL_P2P_DISABLE=1  NCCL_SHM_DISABLE=1
             (these five only where the environment does not set them already)
"""

from __future__ import annotations

from typing import Mapping

SHARE_VARIABLE = "OASES_SHARE_GPU"

# NCCL's settings for ranks that are hosts of one machine: sockets on loopback, no InfiniBand, no
# intra-node transports (distinct host hashes already rule those out; set so no NCCL version tries).
_NCCL_DEFAULTS = {
    "NCCL_NET": "Socket",  # also past a network plugin the image installs (cloud GPU images do)
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
}


def sharing_env(rank: int, nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables rank `rank` of `nproc` ranks sharing one GPU gets (the module's table);
    NCCL's transport settings already in `environ` win over the defaults."""
    if not 0 <= rank < nproc:
        raise ValueError(f"rank: expected 0 <= rank < nproc ({nproc}), got {rank}")
    env = {name: environ.get(name, value) for name, value in _NCCL_DEFAULTS.items()}
    env.update(
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        GROUP_WORLD_SIZE=str(nproc),
        NCCL_HOSTID=f"oases-share-{rank}",
        **{SHARE_VARIABLE: str(nproc)},
    )
    return env


def visible_gpus() -> int:
    """How many GPUs torch sees here (0 without CUDA). Imports torch: call only when sharing."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
