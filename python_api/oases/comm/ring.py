"""Ring all-gather, reduce-scatter and all-reduce built from point-to-point ops.

Every schedule here works on a "rows" layout: the sharded dimension moved to dim 0 and the tensor
made contiguous, so any range of rows is one contiguous message. Each rank's shard of n rows is
cut into `chunks` pieces; with `bidirectional=True` each piece is halved again and the halves
travel opposite ways round the ring ("lanes"). Each ring step of one piece is one
`batch_isend_irecv([recv, send])`, so the same code runs on gloo and NCCL, and each rank sends
(p-1)/p of the data for a gather or a reduce-scatter.

The schedules are generators: they yield after each piece, with the next pieces already in
flight, so a caller computes on a piece while later ones travel (see `oases.ops`).

Who waits for whom is the `side` of `oases.comm._streams`: on CPU the host thread waits for each
transfer; on CUDA the steps are posted, waited for and (reduce-scatter) accumulated on a
high-priority comm stream of Oases' own, so the caller's compute stream waits only where it
reads a received piece (all-gather) or the result (the end of a reduce-scatter), by events, and
the host never waits.

    all-gather, p=2, chunks=2 (rank 0):
      comm : |send own0/recv 1.0|send own1/recv 1.1|
      yield: own0 own1 |1.0 (consume)    |1.1 (consume)
    reduce-scatter, p=2, chunks=2 (rank 0):
      produce: |P1.0|P1.1|P0.0      |P0.1      |
      comm   :      |send P1.0|send P1.1|       (recv 0.0, 0.1 from rank 1 on the same batches)
"""

from __future__ import annotations

from typing import Callable, Generator, Iterator, Optional

import torch
import torch.distributed as dist

from oases import _checks
from oases._ranges import hot_range
from oases.comm._streams import _Side, side_for
from oases.comm.topology import Ring, ring_of

__all__ = [
    "ring_all_gather",
    "ring_reduce_scatter",
    "all_reduce",
    "all_gather_steps",
    "reduce_scatter_steps",
    "all_gather_rows",
    "reduce_scatter_rows",
]

# A lane is a direction round the ring: +1 sends to the next rank, -1 to the previous one.
_Lane = tuple[int, int, int]  # (direction, first row within a piece, rows)


def _lanes(piece_rows: int, bidirectional: bool) -> list[_Lane]:
    if not bidirectional or piece_rows < 2:
        return [(1, 0, piece_rows)]
    half = piece_rows // 2
    return [(1, 0, half), (-1, half, piece_rows - half)]


def _post(ring: Ring, direction: int, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> list[dist.Work]:
    """One ring step of one lane: send to the rank `direction` ahead, receive from the one behind.
    Messages carry `tag` (forward lane) or `tag + 1` (backward lane)."""
    tag = tag if direction > 0 else tag + 1
    # Receive first: on gloo, a send whose receive is not yet posted on a two-way link gets half
    # its rate (measured with oases-launch --selftest); NCCL groups the pair either way.
    ops = [
        dist.P2POp(dist.irecv, recv, ring.peer(-direction), ring.group, tag),
        dist.P2POp(dist.isend, send, ring.peer(direction), ring.group, tag),
    ]
    with hot_range("oases::ring::post"):
        return dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    with hot_range("oases::ring::wait"):
        for w in works:
            w.wait()


def all_gather_rows(
    shard: torch.Tensor,
    out: torch.Tensor,
    ring: Ring,
    chunks: int,
    bidirectional: bool,
    tag: int = 0,
    side: Optional[_Side] = None,
) -> Iterator[slice]:
    """Gather `shard` ([n, ...], contiguous) from every rank into `out` ([p*n, ...], contiguous).

    Yields slices of `out`'s rows as they become valid: this rank's pieces first, then the
    received pieces in arrival order. While the caller holds a yielded slice, the pieces after it
    are in flight. On CUDA a received piece is forwarded from the comm stream as soon as it has
    arrived, never behind the caller's GEMMs::

        compute: | own0 | own1 |(wait ev 1.0) 1.0 |(wait ev 1.1) 1.1 |
        comm   : post 0.*  |wait 1.0, post 2.0, ev|wait 1.1, post 2.1, ev|     (p > 2: forward)
    """
    side = side if side is not None else side_for(out)
    n, p, r = shard.shape[0], ring.size, ring.rank
    own = out[r * n : (r + 1) * n]
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)
    m = n // chunks
    lanes = _lanes(m, bidirectional)

    def rows(block: int, k: int, lane: _Lane) -> slice:
        start = block * n + k * m + lane[1]
        return slice(start, start + lane[2])

    def block_sent(step: int, lane: _Lane) -> int:
        return (r - lane[0] * step) % p

    def block_received(step: int, lane: _Lane) -> int:
        return (r - lane[0] * (step + 1)) % p

    def post(step: int, k: int, lane: _Lane) -> list[dist.Work]:
        return _post(
            ring,
            lane[0],
            out[rows(block_sent(step, lane), k, lane)],
            out[rows(block_received(step, lane), k, lane)],
            tag,
        )

    side.handoff(out)  # the comm side sends this rank's rows: after the copy above
    with side.comm():
        pending = {(0, k, i): post(0, k, lane) for k in range(chunks) for i, lane in enumerate(lanes) if p > 1}
    for k in range(chunks):
        yield slice(r * n + k * m, r * n + (k + 1) * m)
    for step in range(p - 1):
        for k in range(chunks):
            for i, lane in enumerate(lanes):
                with side.comm():
                    _wait(pending.pop((step, k, i)))  # on CUDA: the comm stream waits
                    if step + 1 < p - 1:  # forward what just arrived while the caller consumes it
                        pending[(step + 1, k, i)] = post(step + 1, k, lane)
                side.to_compute()  # the caller reads the piece that arrived
                yield rows(block_received(step, lane), k, lane)


def reduce_scatter_rows(
    produce: Callable[[slice], torch.Tensor],
    out: torch.Tensor,
    ring: Ring,
    chunks: int,
    bidirectional: bool,
    tag: int = 0,
    side: Optional[_Side] = None,
) -> Iterator[slice]:
    """out ([n, ...], contiguous) = sum over ranks of each rank's rows [r*n, (r+1)*n).

    `produce(rows)` returns this rank's contribution to a slice of the full [p*n, ...] rows as a
    contiguous tensor (it may be a view; it is only read). It is called exactly once for every row
    of the full range, block by block in ring order, so it can compute each contribution just
    in time. Yields each produced slice after its partial sum has been posted, so the caller can
    do more work while it travels.

    Each contribution is produced before the partial sum it extends is waited for, and only the
    accumulate (received partial += contribution) waits for the transfer. On CUDA the wait, the
    accumulate and the next send run on the comm stream, so the compute stream runs every
    contribution's GEMM back to back and waits once, at the end, for `out`::

        compute: | P1.0 | P1.1 | P0.0        | P0.1        |(wait ev) out ready
        comm   :   |post P1.0|post P1.1|wait P0.0', += P0.0|wait P0.1', += P0.1| ev
    """
    side = side if side is not None else side_for(out)
    n, p, r = out.shape[0], ring.size, ring.rank
    m = n // chunks
    lanes = _lanes(m, bidirectional)
    pending: dict[tuple[int, int], tuple[list[dist.Work], torch.Tensor, torch.Tensor]] = {}
    side.handoff(out)  # the comm side writes the sums into out
    for step in range(p):
        for k in range(chunks):
            for i, (direction, offset, count) in enumerate(lanes):
                # The block whose partial sum this rank extends at `step`; it ends at block r.
                block = (r - direction * (step + 1)) % p
                rows = slice(block * n + k * m + offset, block * n + k * m + offset + count)
                mine = out[k * m + offset : k * m + offset + count]
                part = produce(rows)  # compute side: computed while the partial sum arrives
                if p == 1:
                    mine.copy_(part)
                    yield rows
                    continue
                side.handoff(part)
                with side.comm():
                    if step == 0:
                        acc = part
                    else:
                        works, _sent, acc = pending.pop((k, i))
                        _wait(works)  # on CUDA: the comm stream waits
                        if step == p - 1:
                            torch.add(acc, part, out=mine)
                        else:
                            acc.add_(part)
                    if step < p - 1:
                        recv = torch.empty_like(acc)
                        pending[(k, i)] = (_post(ring, direction, acc, recv, tag), acc, recv)
                yield rows
    side.to_compute()  # the caller reads out


def _to_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.movedim(dim, 0).contiguous()


def _resolve(t: torch.Tensor, group, dim: int, chunks: int) -> tuple[Ring, int]:
    _checks.floating("t", t)
    _checks.chunks_arg(chunks)
    dim = _checks.normalize_dim("t", t, dim)
    return ring_of(group), dim


def all_gather_steps(
    t: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks: int = 1,
    bidirectional: bool = False,
    tag: int = 0,
) -> Generator[None, None, torch.Tensor]:
    """ring_all_gather, one ring step at a time: yields after each piece with the next pieces in
    flight, and returns the result (`out = yield from all_gather_steps(t, group)`), so a caller
    (oases.schedule's programs) runs other work while the pieces travel. Rings that may run at
    the same time on one group (from two threads) need different `tag` values (a ring uses tag and
    tag + 1), so their messages never match each other's."""
    ring, dim = _resolve(t, group, dim, chunks)
    _checks.divisible("t.shape[dim]", t.shape[dim], ring.size, chunks)
    shard = _to_rows(t, dim)
    out = shard.new_empty((shard.shape[0] * ring.size, *shard.shape[1:]))
    for _ in all_gather_rows(shard, out, ring, chunks, bidirectional, tag):
        yield
    return out.movedim(0, dim).contiguous()


def reduce_scatter_steps(
    t: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks: int = 1,
    bidirectional: bool = False,
    tag: int = 0,
) -> Generator[None, None, torch.Tensor]:
    """ring_reduce_scatter, one ring step at a time: yields after each partial sum is posted, and
    returns the result (`out = yield from reduce_scatter_steps(t, group)`); `tag` as in
    all_gather_steps."""
    ring, dim = _resolve(t, group, dim, chunks)
    _checks.full_divisible("t.shape[dim]", t.shape[dim], ring.size, chunks)
    rows = _to_rows(t, dim)
    out = rows.new_empty((rows.shape[0] // ring.size, *rows.shape[1:]))
    for _ in reduce_scatter_rows(rows.__getitem__, out, ring, chunks, bidirectional, tag=tag):
        yield
    return out.movedim(0, dim).contiguous()


def _drain(steps: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def ring_all_gather(
    t: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks: int = 1,
    bidirectional: bool = False,
    tag: int = 0,
) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`, by ring.

        out = cat([t from rank 0, ..., t from rank p-1], dim)      # t.shape[dim] * p along dim

    `chunks` pieces per shard (must divide t.shape[dim]); each rank sends (p-1)/p of the result.
    `tag`: see all_gather_steps.
    """
    with torch.profiler.record_function("oases::ring_all_gather"):
        return _drain(all_gather_steps(t, group, dim=dim, chunks=chunks, bidirectional=bidirectional, tag=tag))


def ring_reduce_scatter(
    t: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    dim: int = 0,
    chunks: int = 1,
    bidirectional: bool = False,
    tag: int = 0,
) -> torch.Tensor:
    """Sum `t` over ranks and keep this rank's block along `dim`, by ring.

        n = t.shape[dim] // p
        out = sum(t from every rank).narrow(dim, rank * n, n)

    t.shape[dim] must divide by p * chunks; each rank sends (p-1)/p of `t`. `tag`: see
    all_gather_steps.
    """
    with torch.profiler.record_function("oases::ring_reduce_scatter"):
        return _drain(reduce_scatter_steps(t, group, dim=dim, chunks=chunks, bidirectional=bidirectional, tag=tag))


def all_reduce(
    t: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    *,
    chunks: int = 1,
    bidirectional: bool = False,
) -> torch.Tensor:
    """Sum `t` over ranks in place, as ring reduce-scatter then ring all-gather; returns `t`.

        t[...] = sum(t from every rank)

    Any shape: the flattened tensor is padded to a multiple of p * chunks internally. Each rank
    sends 2 (p-1)/p of `t`, like a ring all-reduce.
    """
    _checks.floating("t", t)
    _checks.chunks_arg(chunks)
    ring = ring_of(group)
    quantum = ring.size * chunks
    padded = -(-t.numel() // quantum) * quantum
    if t.is_contiguous() and padded == t.numel():
        flat = t.view(-1)
    else:
        flat = t.new_zeros(padded)
        flat[: t.numel()].copy_(t.reshape(-1))
    n = padded // ring.size
    own = flat[ring.rank * n : (ring.rank + 1) * n]
    with torch.profiler.record_function("oases::all_reduce"):
        # Reduce-scatter reads this rank's own rows only at its last step, where it overwrites
        # them elementwise with their sum; all-gather then fills the other blocks in place.
        for _ in reduce_scatter_rows(flat.__getitem__, own, ring, chunks, bidirectional):
            pass
        for _ in all_gather_rows(own, flat, ring, chunks, bidirectional):
            pass
    if flat.data_ptr() != t.data_ptr():
        t.copy_(flat[: t.numel()].view(t.shape))
    return t
