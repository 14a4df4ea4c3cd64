"""`oases-launch`: start N ranks like torchrun, over links shaped like a commodity server's.

    oases-launch --nproc 4 train.py --lr 3e-4                    # = torchrun --nproc-per-node 4
    oases-launch --nproc 2 -m bench primitives                   # run a module, like torchrun -m
    oases-launch --nproc 2 --bandwidth 1gbit train.py            # ranks talk at ~125 MB/s
    oases-launch --nproc 4 --bandwidth 8gbit --topology switch train.py
    oases-launch --nproc 2 --bandwidth 1gbit --selftest          # measure the shaped link
    oases-launch --nproc 8 --hosts 2 --bandwidth 1gbit train.py  # 2 servers of 4 ranks, 1 Gbit NICs
    oases-launch --nproc 8 --hosts 2 --bandwidth 1gbit --intra-bandwidth 8gbit --selftest
    oases-launch --nproc 2 --share-gpu train.py                  # 2 NCCL ranks on one GPU (a test mode)
    python -m oases.launch ...                                   # the same

Every rank runs `sys.executable SCRIPT ARGS` (or `-m MODULE ARGS`) with torchrun's single-node
environment: RANK = LOCAL_RANK = r, WORLD_SIZE = LOCAL_WORLD_SIZE = N, MASTER_ADDR (rank 0's
address), MASTER_PORT (a free port), so `init_process_group()` works unchanged and the same script
runs under plain torchrun on a real cluster. OMP_NUM_THREADS is 1 per rank unless set in the
environment or given by --threads. Ranks share the launcher's stdout/stderr. The first rank to
fail ends the run: the others are stopped and the launcher exits with that rank's status.

--bandwidth RATE (tc syntax) runs the ranks in network namespaces made for this run
(`oases-<pid>...`) whose links pass a tc token-bucket filter at RATE; the ranks then also get
OASES_BANDWIDTH=RATE and OASES_TOPOLOGY, so a benchmark can report the link it ran on
(`parse_bandwidth(os.environ["OASES_BANDWIDTH"])` bytes/s). The namespaces are deleted when the
run ends, also on failure, SIGINT or SIGTERM (not on SIGKILL, which leaves them to
`ip netns del`). Shaping needs root and iproute2's `ip` and `tc`; without them the launcher says
so in one line and runs unshaped (and sets neither variable).

Topologies (see `_netns` for the wiring):
  shared (default)  all ranks on one shaped loopback: every byte between any two ranks passes one
                    queue of RATE, so concurrent transfers split it.
  switch            one namespace and veth "NIC" per rank into a bridge, each shaped both ways:
                    every rank sends and receives at RATE, independently of the others.
`shared` is the default because it is the commodity server Oases targets: GPUs without NVLink,
whose peer traffic crosses one PCIe host bridge (and, across sockets, the CPU interconnect and
host memory). There the box's aggregate bandwidth, not a per-GPU link, is the bottleneck, and a
ring's simultaneous sends contend for it; `switch` would credit every rank a private full-duplex
link and overstate concurrent communication by up to the number of concurrent flows. Use
`switch` to model one NIC per GPU into a non-blocking switch (a multi-node cluster).

--hosts H emulates H servers (see `_netns`): NPROC must be divisible by H, and the ranks are
packed in order, NPROC/H per host (8 ranks, 2 hosts: 0..3 on host 0, 4..7 on host 1). Each host
is a namespace with its own address (10.88.0.h+1) and one NIC into a switch, shaped to
--bandwidth RATE both ways: a host sends at RATE and receives at RATE at once, so two hosts
talking both ways get RATE in each direction, and the hosts' traffic to one host shares its
NIC. Ranks of one host talk over the host's loopback: unshaped, or one link of --intra-bandwidth
shared by the host's ranks like `shared`. So tensor parallelism inside a host runs on the fast
link and pipeline/data parallelism across hosts on the NICs, as on a cluster. The environment is
torchrun's on H nodes: LOCAL_RANK = the index within the host, LOCAL_WORLD_SIZE = NPROC/H,
GROUP_RANK = the host, GROUP_WORLD_SIZE = H, MASTER_ADDR = host 0's address; shaped runs also
get OASES_TOPOLOGY=hosts, OASES_HOSTS=H and, if given, OASES_INTRA_BANDWIDTH. `--selftest`
measures a pair inside host 0 and a pair across hosts (needs 2 or more ranks per host). Without
root or iproute2 the layout (the environment) stays and the links are unshaped, as above.

--share-gpu runs every rank on GPU 0 over NCCL, for a workstation with one GPU (see `_share`):
each rank is a host of its own to NCCL (NCCL_HOSTID per rank, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1,
GROUP_RANK=r, GROUP_WORLD_SIZE=N, OASES_SHARE_GPU=N), so NCCL, which refuses two ranks of one
host on one GPU, carries their traffic over sockets on loopback (NCCL_SOCKET_IFNAME=lo, no
InfiniBand, no P2P or shared memory, unless the environment says otherwise). With --bandwidth
(topology shared) that loopback is shaped: NCCL over a slow TCP link. It is a correctness mode:
the ranks' kernels take turns on the one GPU, so its timings are not speedups. Refused in one
line where torch sees no GPU, and with --hosts. The script picks the backend as usual
(`init_process_group("nccl")`, or no backend: gloo for CPU tensors, NCCL for CUDA ones).
"""

from oases.costs.rate import parse_bandwidth
from oases.launch._cli import main

__all__ = ["main", "parse_bandwidth"]
