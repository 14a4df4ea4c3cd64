"""Data-parallel gradient averaging, in buckets started during the backward (DDP's overlap).

    sync = GradientSync(model, dp_group)          # hooks on every parameter that requires grad
    loss.backward()                                # buckets start as their gradients are final
    # at the end of the backward (or sync.finish()): for every parameter p
    #     p.grad = mean over the dp ranks of p.grad                   (zeros where a rank had None)
    #     p.grad stays None where every rank had None                 (the optimizer skips it, as torch's)

Which gradients are final. A step may accumulate a parameter's gradient several times (the
schedules of oases.train_step run one backward per sub-batch and layer). The first step learns
how many times each parameter's gradient is accumulated (the most any dp rank saw: one small
all-reduce, once) and reduces everything at its end; parameters no rank had a gradient for then
go to the last buckets, which start at the end of the backward. From then on a bucket
(parameters in reverse registration order, about `bucket_bytes` each, one dtype) starts its
collective as soon as the last of its parameters reached its count and every earlier bucket
started (the ranks' collectives pair up by order, so buckets start in order everywhere), while
the rest of the backward runs. At most `max_in_flight` buckets are in flight at once (each holds
a flat copy of its gradients until it completes): starting one more first completes the oldest,
so the copies cost at most max_in_flight buckets, not the whole model's gradients when the link
is slower than the backward. The step's structure must stay the same across steps and dp ranks (the same
schedule and sub-batches everywhere); a gradient that arrives after its bucket started raises a
RuntimeError (call `relearn()` after changing the step's structure).

When it ends. After a plain `loss.backward()` the sync finishes by itself at the end of the
backward (an autograd engine callback). Inside `deferred()` (oases.train_step(..., grad_sync=)
uses it, as its schedules run several backwards per step) the caller calls `finish()` once.

Reduction. `GradientSync` all-reduces (SUM, then divides by the dp size); oases.dp.ZeroOptimizer
passes a reducer that reduce-scatters instead (each rank keeps its rows: ZeRO-1).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterable, Iterator, Optional, Protocol, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases.comm.topology import ring_of

__all__ = ["GradientSync", "Reducer", "AllReduceMean"]


class Reducer(Protocol):
    """How a bucket's gradients are reduced over the dp group."""

    def start(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> object:
        """Start the collective (async) for one bucket; return what `complete` needs."""

    def complete(self, params: list[nn.Parameter], pending: object) -> None:
        """Wait for it and put the result where it belongs."""


class AllReduceMean:
    """p.grad = mean over `group` of p.grad: one flat all-reduce per bucket."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = _checks.process_group(group)  # a 1-D DeviceMesh: its group
        self.size = ring_of(self.group).size

    def start(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> object:
        """Concatenate `grads` into one flat tensor, then one flag per parameter (whether this rank
        had a gradient: p.grad not None), and start its all-reduce (SUM, async) over `group`;
        returns (flat, work)."""
        flags = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [flags])  # [sum of numel + len(params)]
        return flat, dist.all_reduce(flat, group=self.group, async_op=True)

    def complete(self, params: list[nn.Parameter], pending: object) -> None:
        """Wait for the all-reduce, divide by the group's size and copy each parameter's slice of it
        into p.grad (a new tensor where p.grad is None); p.grad stays None where no rank had one."""
        flat, work = pending
        work.wait()
        present = (flat[-len(params) :] > 0).tolist()
        flat.div_(self.size)
        offset = 0
        for p, had in zip(params, present):
            piece = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if not had:
                continue  # no rank had a gradient: None, as in the single process
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready = 0
        self.pending: Optional[object] = None
        self.started = False
        self.done = False  # completed (its results written) before finish()


def _parameters(model: Union[nn.Module, Iterable[nn.Parameter]]) -> list[nn.Parameter]:
    params = model.parameters() if isinstance(model, nn.Module) else model
    unique, seen = [], set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"model: expected an nn.Module or parameters, got an element of type {type(p).__name__}")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


def _buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    """Reverse registration order (the backward's usual order), split at `bucket_bytes` and at dtype changes."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and (
            size + p.numel() * p.element_size() > bucket_bytes
            or p.dtype != current[0].dtype
            or p.device != current[0].device
        ):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _on_grad(sync: "weakref.ref[GradientSync]", p: nn.Parameter) -> None:
    alive = sync()
    if alive is None:  # its hooks outlived it: the gradients would silently stay this rank's own
        raise RuntimeError(
            "oases.dp.GradientSync: the sync was garbage-collected while its hooks were registered, so no gradient "
            "is averaged over dp; keep a reference to it for as long as it trains (sync = GradientSync(model, "
            "group)), and call sync.close() to stop it"
        )
    alive._on_grad(p)


class GradientSync:
    """Average the gradients of `model`'s parameters (or the given parameters) over `group`'s ranks
    (the model's data-parallel replicas), overlapped with the backward: see the module docstring.

    Args:
        model: an nn.Module (its parameters that require grad) or an iterable of parameters, the
            same on every rank of `group` (same shapes, same order).
        group: the data-parallel group or a 1-D DeviceMesh such as `mesh["dp"]` (None: the world).
            Each rank's TP shards are averaged with the same shards of the other dp ranks: make it
            from ranks holding the same TP rank (e.g. init_device_mesh("cpu", (dp, tp))["dp"]).
        bucket_bytes: about this many bytes of gradients per collective.
        reducer: how a bucket is reduced (default AllReduceMean(group)).
        max_in_flight: buckets whose collectives run at once during the backward (each holds a
            flat copy of its gradients); the oldest completes before one more starts.
    """

    def __init__(
        self,
        model: Union[nn.Module, Iterable[nn.Parameter]],
        group: Optional[dist.ProcessGroup] = None,
        *,
        bucket_bytes: int = 25 * 2**20,
        reducer: Optional[Reducer] = None,
        max_in_flight: int = 2,
    ) -> None:
        for name, value in (("bucket_bytes", bucket_bytes), ("max_in_flight", max_in_flight)):
            if not _checks.is_int(value) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.max_in_flight = max_in_flight
        self._in_flight: list[_Bucket] = []  # started in the backward, oldest first
        self._next = 0  # the bucket to start next: buckets start in order, on every rank alike
        self.group = group = _checks.process_group(group)  # a 1-D DeviceMesh: its group
        self.size = ring_of(group).size
        self.params = _parameters(model)
        if not self.params:
            raise ValueError("model: has no parameter that requires grad; nothing to synchronise")
        self.reducer = reducer if reducer is not None else AllReduceMean(group)
        self.bucket_bytes = bucket_bytes
        self._held: set[int] = set()  # parameters reduced only at finish (hold)
        self._counts: dict[int, int] = {}
        self._expected: Optional[dict[int, int]] = None  # learned by the first step
        self._rebucket()
        self._deferred = False
        self._queued = False
        self.started_in_backward = 0  # buckets started by a gradient hook, over the sync's life (overlap)
        # The hooks hold the sync weakly: a parameter's hook keeping it alive would keep the model
        # alive too (a cycle through post-accumulate-grad hooks that the garbage collector never frees).
        # A sync dropped without close() makes its hooks raise (its gradients would go unaveraged).
        hook = functools.partial(_on_grad, weakref.ref(self))
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def _on_grad(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[id(p)]
        if bucket.started:
            raise RuntimeError(
                f"oases.dp: a gradient of a parameter ({tuple(p.shape)}) arrived after its bucket's reduction "
                f"started: this step accumulates it more often than the step GradientSync learned from; call "
                f"relearn() after changing the step's structure (schedule, sub_batches)"
            )
        count = self._counts.get(id(p), 0) + 1
        self._counts[id(p)] = count
        if self._expected is not None and count == self._expected.get(id(p), 0) and id(p) not in self._held:
            bucket.ready += 1
            while self._next < len(self._buckets) and self._is_ready(self._buckets[self._next]):
                # in bucket order on every rank, as the collectives pair up by order: a bucket ready
                # before an earlier one (another rank's step left a gradient out) waits for it
                if len(self._in_flight) >= self.max_in_flight:
                    self._complete(self._in_flight.pop(0))
                self._start(self._buckets[self._next])
                self._in_flight.append(self._buckets[self._next])
                self._next += 1
                self.started_in_backward += 1
        if not self._deferred and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    @staticmethod
    def _is_ready(bucket: _Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def _start(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.pending = self.reducer.start(bucket.params, grads)
        bucket.started = True

    def _complete(self, bucket: _Bucket) -> None:
        self.reducer.complete(bucket.params, bucket.pending)
        bucket.pending, bucket.done = None, True

    @contextlib.contextmanager
    def deferred(self) -> Iterator["GradientSync"]:
        """Inside, backwards do not finish the sync; the caller calls finish() once (several
        backwards make one step's gradients)."""
        previous, self._deferred = self._deferred, True
        try:
            yield self
        finally:
            self._deferred = previous

    def finish(self) -> None:
        """Start the buckets not started yet (in order), wait for all, write the results; learn
        the step's accumulation counts (the first time, or after relearn())."""
        self._queued = False
        if not self._counts:
            return  # no gradient this step
        for bucket in self._buckets:  # in order on every rank; one late bucket's copy in flight at a time
            if not bucket.started:
                self._start(bucket)
            if not bucket.done:
                self._complete(bucket)
            bucket.started, bucket.done, bucket.ready = False, False, 0
        self._in_flight.clear()
        self._next = 0
        if self._expected is None:
            self._learn()
        self._counts = {}

    def _learn(self) -> None:
        """The step's accumulation counts, agreed over the group (the most any rank had: a count no
        rank reaches just leaves its bucket to finish), and the buckets rebuilt with the parameters no
        rank had a gradient for at their end: every rank builds the same buckets."""
        counts = torch.tensor(
            [self._counts.get(id(p), 0) for p in self.params], dtype=torch.int64, device=self.params[0].device
        )
        if self.size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
        self._expected = {id(p): int(c) for p, c in zip(self.params, counts)}
        self._rebucket()

    def _rebucket(self) -> None:
        """Buckets (reverse registration order) of the parameters the backward makes final, then of
        the late ones, held or that no rank had a gradient for: started at finish, they never hold
        back an earlier bucket."""
        late = {id(p) for p in self.params if self._expected is not None and self._expected[id(p)] == 0}
        late |= self._held
        on_time = [p for p in self.params if id(p) not in late]
        self._buckets = _buckets(on_time, self.bucket_bytes) + _buckets(
            [p for p in self.params if id(p) in late], self.bucket_bytes
        )
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}

    def hold(self, params: Iterable[torch.Tensor]) -> None:
        """Reduce `params` only at finish(), never during the backward: their gradients change after
        it (oases.train_step sums sequence-parallel norms' gradients over the TP group then). Call it
        alike on every rank, between steps; it lasts for the sync's life."""
        held = self._held | {id(p) for p in params if id(p) in self._bucket_of}  # this sync's parameters
        if held != self._held:
            self._held = held
            self._rebucket()

    def relearn(self) -> None:
        """Forget the learned accumulation counts: the next step reduces everything at its end."""
        self._expected = None

    def close(self) -> None:
        """Remove the hooks (a sync dropped without close() leaves hooks that raise at the next backward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
