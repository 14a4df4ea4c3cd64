"""Point-to-point transfers between pipeline stages (FOLD3D Algorithm 2, PPComm), in send order.

    links = make_links(mesh)                      # collective: four one-way groups per pp line
    comm = StageComm(links, stage, stages, scheduler, device)
    comm.expect(schedule, segments, micro_batches)   # which messages arrive, and in what order
    comm.post_recv(key, shape)        # irecv posted early (before the computation before its use)
    x = comm.recv(key, shape)         # waits for it (posts it first if it was not posted)
    comm.send(key, tensor)            # isend; never waited before wait_sends()
    comm.post_lazy(keys, shapes)      # receives needed only later: into the host slab, not tracked
    comm.wait_sends()                 # end of the step: every send delivered, every receive taken

A key is (kind, edge, micro_batch): over edge e, "act" travels from virtual stage e to e+1 and
"grad" from e+1 to e, where (segment k, stage s) is virtual stage k*p + s (oases.pipeline.stages).
With one stage (p = 1) the peer is this rank: the tensor is handed over in memory.

Links, and why messages match by order, not by tag. NCCL matches one pair's point-to-point
messages in posting order (it has no tags) and runs them in order on one stream per pair, where a
receive posted ahead of a send to the same peer can wait for a message the peer sends only after
it received ours: a deadlock. So every message travels on a *link*, a process group used in one
direction only, and both ends post a link's messages in the same order:

    link        carries                                 from stage -> to stage
    act         activations inside a segment            s -> s+1        (s < p-1)
    act_wrap    activations from segment k to k+1       p-1 -> 0
    grad        gradients inside a segment              s+1 -> s        (s < p-1)
    grad_wrap   gradients from segment k+1 to k         0 -> p-1

On a link each pair of neighbours talks one way (the lower-numbered stage of `act` only sends to
the next, which only receives from it; a middle stage receives on one pair and sends on another
of the same link), and ProcessGroupNCCL gives every pair of a group its own communicator and
stream for single isend / irecv (torch 2.13; a version that shared one communicator per group
would put a middle stage's receive and send on one stream), so nothing posted on one pair waits
behind another pair's traffic. `make_links` connects every pair once, in an order without
cycles, before any step (NCCL's first message on a pair blocks both ends). The order is the
sender's: `expect` derives, from the schedule of the neighbouring stages, the keys each link
delivers here in the order they are sent, and
`post_recv` checks that each receive it posts is the next one of its link (a receive out of
order is a RuntimeError, never a silently swapped tensor). Every schedule of oases.pipeline uses
its inputs in that order, since each stage runs the forwards (and the backwards) in the same
order. On gloo the links are groups too and every message has tag 0, so gloo matches them the
way NCCL does (first posted receive, first sent message, per pair and tag): the CPU tests run
the same order the GPU relies on.

Every tracked transfer goes through the rank's CommScheduler (oases.pipeline.comm_scheduler):
while one is in flight, the data-parallel sync holds back its next chunk, and its latency is
recorded. The links are made with oases.comm.new_group: on NCCL their streams have high
priority, so PP transfers run ahead of the DP sync's (on the DP group's, default-priority streams).

Inter-segment lazy communication (FOLD3D §3.2): the activations that cross from segment k to
segment k+1 (stage p-1 to stage 0) are produced long before stage 0 needs them under aiao (it
first runs segment k for every micro-batch). `post_lazy` posts their receives at once, as long as
they are the next ones of the act_wrap link, so they travel as soon as they are sent; their
bytes live in a HostSlab (oases.offload: one preallocated host buffer, pinned on CUDA, sized
for one step's lazy receives and reused every step), not in device memory. On CPU (gloo) a
message lands in its slab region directly; on CUDA (NCCL receives into device memory) it lands
in a device buffer that a copy stream moves to the slab as soon as it arrived and then frees
(an event per message), and `recv` copies it back on the compute stream once that event is
reached (never waiting for lazy receives posted after it). They are not tracked by the scheduler: nothing waits
on them meanwhile, so they do not hold back the DP sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from oases.comm import new_group
from oases.offload import HostSlab
from oases.offload.slab import ALIGNMENT
from oases.pipeline.comm_scheduler import CommScheduler, Transfer
from oases.pipeline.schedules import actions

__all__ = ["Links", "StageComm", "make_links", "link_of", "sent_by"]

Key = tuple[str, int, int]  # (kind "act" | "grad", edge, micro_batch)
LINKS = ("act", "act_wrap", "grad", "grad_wrap")
_TAG = 0  # every message of a link: matched by order


@dataclass(frozen=True)
class Links:
    """This rank's pp line (global ranks by stage) and its four one-way groups (module doc)."""

    ranks: tuple[int, ...]
    groups: dict[str, dist.ProcessGroup]


def mesh_grid(mesh) -> torch.Tensor:
    """The mesh's global ranks as [dp, pp, tp] (its dims are named so, in any order)."""
    names = tuple(mesh.mesh_dim_names)
    return mesh.mesh.permute(*(names.index(n) for n in ("dp", "pp", "tp")))


def make_links(mesh, device: torch.device = torch.device("cpu")) -> Optional[Links]:
    """The links of this rank's pp line (None with pp = 1), connected. Collective over the world:
    every rank makes every line's groups, in the mesh's order (dims named dp, pp, tp, in any
    order); then each line connects its links (`_connect`)."""
    grid = mesh_grid(mesh)  # [dp, pp, tp] global ranks
    if grid.shape[1] == 1:
        return None
    me = dist.get_rank()
    mine: Optional[Links] = None
    for d in range(grid.shape[0]):
        for t in range(grid.shape[2]):
            ranks = tuple(grid[d, :, t].tolist())
            groups = {name: new_group(ranks) for name in LINKS}  # high-priority streams on NCCL
            if me in ranks:
                mine = Links(ranks, groups)
    assert mine is not None
    _connect(mine, torch.device(device))
    return mine


def _connect(links: Links, device: torch.device) -> None:
    """One message over every (link, pair), in an order without cycles. NCCL sets a pair's
    communicator up at the pair's first message and both ends block there, so left to the
    schedule, stage 0's first lazy receive (act_wrap) and stage 1's first receive (act) would wait
    for each other. Here each link's pairs connect along its direction: on act, pair (0, 1),
    then (1, 2), ... (a middle stage receives from upstream, then sends downstream); on grad the
    reverse; each wrap link is one pair. The messages are matched and gone before any step."""
    me = links.ranks.index(dist.get_rank())
    one = torch.zeros(1, device=device)
    for name, src, dst in _connect_order(len(links.ranks)):
        if me == src:
            dist.send(one, links.ranks[dst], group=links.groups[name], tag=_TAG)
        elif me == dst:
            dist.recv(one, links.ranks[src], group=links.groups[name], tag=_TAG)


def _connect_order(stages: int) -> list[tuple[str, int, int]]:
    """(link, sending stage, receiving stage) of each connecting message, in the order every
    stage takes them (a stage skips those it is not an end of)."""
    order = []
    for name in LINKS:
        if name in ("act", "grad"):
            hops = [(s, s + 1) for s in range(stages - 1)]
            if name == "grad":
                hops = [(b, a) for a, b in reversed(hops)]
        else:
            hops = [(stages - 1, 0)] if name == "act_wrap" else [(0, stages - 1)]
        order += [(name, src, dst) for src, dst in hops]
    return order


def link_of(key: Key, stages: int) -> tuple[str, int, int]:
    """(link, sending stage, receiving stage) of message `key` with `stages` stages."""
    kind, edge, _ = key
    if kind == "act":
        src = edge % stages
        return ("act_wrap" if src == stages - 1 else "act"), src, (src + 1) % stages
    src = (edge + 1) % stages
    return ("grad_wrap" if src == 0 else "grad"), src, (src - 1) % stages


def sent_by(
    schedule: str, stage: int, stages: int, segments: int, micro_batches: int, *, forward_only: bool = False
) -> list[Key]:
    """The messages stage `stage` sends in one step (forward_only: an evaluation's forwards), in
    the order it sends them:

    for F(k, i) in its actions:  ("act", k*p + s, i)       unless the last virtual stage
    for B(k, i) in its actions:  ("grad", k*p + s - 1, i)  unless virtual stage 0
    """
    last = stages * segments - 1
    sent: list[Key] = []
    for a in actions(
        schedule, stage=stage, stages=stages, segments=segments, micro_batches=micro_batches, forward_only=forward_only
    ):
        v = a.segment * stages + stage
        if a.kind == "F" and v < last:
            sent.append(("act", v, a.micro_batch))
        elif a.kind == "B" and v > 0:
            sent.append(("grad", v - 1, a.micro_batch))
    return sent


class _Lane:
    """One link's receives at this rank: the keys in send order and how many are posted."""

    def __init__(self, keys: list[Key]) -> None:
        self.keys, self.posted = keys, 0

    def next(self) -> Optional[Key]:
        return self.keys[self.posted] if self.posted < len(self.keys) else None


class StageComm:
    """Async sends and receives of one rank's pipeline stage over its links; owns its handles."""

    def __init__(
        self,
        links: Optional[Links],
        stage: int,
        stages: int,
        scheduler: CommScheduler,
        device: torch.device = torch.device("cpu"),
    ) -> None:
        if (links is None) != (stages == 1):
            raise ValueError("links: expected links exactly when there is more than one stage")
        self.links, self.stage, self.stages, self.scheduler = links, stage, stages, scheduler
        self.device = torch.device(device)
        self.lazy_receives = 0  # receives posted by post_lazy (a counter over the comm's life)
        self.slab: Optional[HostSlab] = None  # lazy receives' host memory
        self._regions: list[int] = []  # slab regions in use this step
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lanes: dict[str, _Lane] = {}
        self._lazy: dict[Key, tuple[object, torch.Tensor]] = {}  # key -> (work or CUDA event, host tensor)
        self._pending: dict[Key, tuple[Transfer, torch.Tensor]] = {}
        self._sends: list[tuple[Transfer, torch.Tensor]] = []
        self._local: dict[Key, torch.Tensor] = {}  # p = 1: messages to this rank itself

    # --- what arrives -----------------------------------------------------------------------------

    def expect(self, schedule: str, segments: int, micro_batches: int, *, forward_only: bool = False) -> None:
        """Learn the order of this step's arrivals: per link, the keys the neighbour sends here,
        in its sending order (sent_by on the previous and the next stage; forward_only: an
        evaluation's). Every stage calls it with the same arguments, before a step; nothing may
        be in flight."""
        if self._pending or self._lazy or self._local:
            raise RuntimeError("expect: called with receives in flight")
        p, s = self.stages, self.stage
        lanes: dict[str, list[Key]] = {name: [] for name in LINKS}
        for peer in {(s - 1) % p, (s + 1) % p} if p > 1 else set():
            for key in sent_by(schedule, peer, p, segments, micro_batches, forward_only=forward_only):
                link, _, dst = link_of(key, p)
                if dst == s:
                    lanes[link].append(key)
        self._lanes = {name: _Lane(keys) for name, keys in lanes.items() if keys}

    def _lane_for(self, key: Key) -> _Lane:
        lane = self._lanes.get(link_of(key, self.stages)[0])
        if lane is None or key not in lane.keys:
            raise RuntimeError(
                f"receive of {key}: no neighbour sends it to stage {self.stage} in this step "
                "(was StageComm.expect called with the step's schedule?)"
            )
        return lane

    def _take_turn(self, key: Key) -> None:
        """Check that `key` is its link's next receive (send order) and count it posted."""
        lane = self._lane_for(key)
        if lane.next() != key:
            raise RuntimeError(
                f"receive of {key} posted out of send order: its link's next message is "
                f"{lane.next()} (receives of a link are matched in order, as NCCL does)"
            )
        lane.posted += 1

    def _peer(self, key: Key, *, sending: bool) -> tuple[dist.ProcessGroup, int]:
        """(the link's group, the global rank at the other end)."""
        link, src, dst = link_of(key, self.stages)
        assert self.links is not None
        return self.links.groups[link], self.links.ranks[dst if sending else src]

    # --- receives ---------------------------------------------------------------------------------

    def post_recv(self, key: Key, shape: torch.Size, dtype: torch.dtype = torch.float32) -> None:
        """Post the receive of `key` into a new buffer (no-op if already posted). A link's receives
        must be posted in its send order (RuntimeError otherwise) and are waited in that order."""
        if key in self._pending or key in self._lazy or self.stages == 1:
            return
        self._take_turn(key)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        group, peer = self._peer(key, sending=False)
        work = dist.irecv(buf, peer, group=group, tag=_TAG)
        self._pending[key] = (self.scheduler.track(work, "recv", peer, device=self.device), buf)

    def recv(self, key: Key, shape: torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor of `key` ([shape]), once it has arrived (on this comm's device)."""
        if self.stages == 1:
            return self._local.pop(key)
        if key in self._lazy:
            return self._load_lazy(key)
        self.post_recv(key, shape, dtype)
        work, buf = self._pending.pop(key)
        work.wait()
        return buf

    def reserve_lazy(self, shapes: list[torch.Size], dtype: torch.dtype, segments: int) -> None:
        """Size the slab for a step whose lazy receives are, at most, every micro-batch's activation
        ([shapes]) once per segment boundary; a new slab only when a step needs more than it holds.
        Called at the start of a step (no region in use)."""
        if self.stages == 1:  # the segments' activations stay in memory
            return
        each = sum(-(-s.numel() * dtype.itemsize // ALIGNMENT) * ALIGNMENT for s in shapes)
        need = each * (segments - 1)
        if need and (self.slab is None or self.slab.capacity < need):
            self.slab = HostSlab(need)

    def post_lazy(self, keys: list[Key], shapes: list[torch.Size], dtype: torch.dtype = torch.float32) -> None:
        """Post the receives of `keys` now, in order, into the slab (reserve_lazy first), untracked
        by the scheduler, while each is its link's next receive (the rest are posted as usual
        later); `recv` of one of them waits for it and moves it to the device. Keys already
        posted are skipped."""
        if self.stages == 1:
            return
        for key, shape in zip(keys, shapes):
            if key in self._pending or key in self._lazy:
                continue
            if self._lane_for(key).next() != key:
                return
            self._take_turn(key)
            host = self._host_region(shape, dtype)
            group, peer = self._peer(key, sending=False)
            if self._copy_stream is None:  # gloo receives into host memory
                self._lazy[key] = (dist.irecv(host, peer, group=group, tag=_TAG), host)
            else:  # NCCL receives into device memory: moved to the slab as soon as it arrives
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                work = dist.irecv(buf, peer, group=group, tag=_TAG)
                with torch.cuda.stream(self._copy_stream):
                    work.wait()  # the copy stream waits for the transfer (the host does not)
                    host.copy_(buf, non_blocking=True)
                    buf.record_stream(self._copy_stream)
                    copied = torch.cuda.Event()
                    copied.record()  # this message is in the slab (later ones may not be)
                self._lazy[key] = (copied, host)
            self.lazy_receives += 1

    def _host_region(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A [shape] tensor in a region of the slab, held until wait_sends()."""
        if self.slab is None:
            raise RuntimeError("post_lazy: no slab; call reserve_lazy(...) at the start of the step")
        nbytes = shape.numel() * dtype.itemsize
        offset = self.slab.allocate(nbytes)
        self._regions.append(offset)
        return self.slab.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def _load_lazy(self, key: Key) -> torch.Tensor:
        arrived, host = self._lazy.pop(key)  # gloo: the receive's work; CUDA: the event after its copy out
        if self._copy_stream is None:
            arrived.wait()
            return host  # already in (host) device memory: its slab region lives until wait_sends()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(arrived)  # its own copy out only: not the lazy receives posted after it
        return host.to(self.device, non_blocking=True)  # on the compute stream

    # --- sends ------------------------------------------------------------------------------------

    def send(self, key: Key, tensor: torch.Tensor) -> None:
        """Start sending `tensor` as `key`; it is kept alive until wait_sends()."""
        tensor = tensor.detach().contiguous()
        if self.stages == 1:
            self._local[key] = tensor
            return
        group, peer = self._peer(key, sending=True)
        work = dist.isend(tensor, peer, group=group, tag=_TAG)
        self._sends.append((self.scheduler.track(work, "send", peer, device=self.device), tensor))

    def time_transfer(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> float:
        """Seconds for one [shape] tensor to reach the next stage while the previous stage's reaches
        this one (over the act links, timed after a warm-up; 0 with p = 1). Every stage calls it,
        between steps."""
        if self.stages == 1:
            return 0.0
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        into = torch.empty(shape, dtype=dtype, device=self.device)
        p, s = self.stages, self.stage
        ahead_link, behind_link = ("act_wrap" if s == p - 1 else "act"), ("act_wrap" if s == 0 else "act")
        assert self.links is not None
        ahead, behind = self.links.ranks[(s + 1) % p], self.links.ranks[(s - 1) % p]
        for _ in range(2):
            start = time.perf_counter()
            works = [
                dist.isend(out, ahead, group=self.links.groups[ahead_link], tag=_TAG),
                dist.irecv(into, behind, group=self.links.groups[behind_link], tag=_TAG),
            ]
            for work in works:
                work.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def wait_sends(self) -> None:
        """Wait for every send; after it, nothing of this step is in flight (checked), every
        link's receives were posted, and the slab's regions are free for the next step."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._pending or self._local or self._lazy:
            raise RuntimeError(
                f"pipeline step ended with unreceived messages: {sorted(self._pending or self._local or self._lazy)}"
            )
        missed = {name: lane.next() for name, lane in self._lanes.items() if lane.next() is not None}
        if missed:
            raise RuntimeError(f"pipeline step ended with messages never received, per link: {missed}")
        for lane in self._lanes.values():
            lane.posted = 0
        if self._copy_stream is not None:  # the next step's copies into these regions come after this step's loads
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for offset in self._regions:
            self.slab.free(offset)
        self._regions.clear()
