"""How a Pipeline's stage runs one step's actions: the `Executor` (one per pipeline) cuts the batch into the
step's micro-batches, posts each action's receive one ahead, runs F(k, i) and B(k, i) themselves through the
wrappers registered by `Pipeline.register_action_wrapper`, and knows where each segment's first forward and
last backward sit in the actions (where the `Updates` apply and launch; see the oases.pipeline.pipeline
module doc).

    executor = Executor(comm, settings, dp_group=.., offloader=..)
    executor.arrange(stage, updates)     # after each (re)configuration: actions, arrivals, marks
    step = executor.split(tokens, targets)
    executor.run_actions(step)           # train_step's actions
    executor.evaluate(step, model)       # eval_step's forwards
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from oases._leaves import grad_leaf
from oases._rows import split_rows
from oases.nn.vocab import IGNORE_INDEX
from oases.offload import Offloader
from oases.pipeline._config import Settings
from oases.pipeline._layout import StageLayout
from oases.pipeline._offloaded import StageInput
from oases.pipeline._updates import Updates
from oases.pipeline.p2p import StageComm
from oases.pipeline.schedules import Action, actions
from oases.pipeline.stages import Stage
from oases.schedule import SubBatch

__all__ = ["ActionWrapper", "Step", "Executor", "action_marks"]

# register_action_wrapper's callable: wrapper(action, run), run() computing the action
ActionWrapper = Callable[[Action, Callable[[], None]], None]


@dataclass
class Step:
    """What one train_step's actions share: micro-batches, their activation shapes, kept tensors."""

    micro: list[tuple[torch.Tensor, torch.Tensor]]  # (tokens, targets) [b_i, t] per micro-batch
    ctx: dict[int, object]  # micro-batch -> what stack.embed gives every layer (rotary, masks)
    shapes: list[torch.Size]  # activation [b_i, t, h] per micro-batch
    dtype: torch.dtype  # of activations and their gradients
    normalizer: int  # tokens with a target in the global batch: each micro-batch's loss is divided by it
    inputs: dict[tuple[int, int], Optional[torch.Tensor]] = field(default_factory=dict)  # (k, i) -> stage input
    saved: dict[tuple[int, int], list] = field(default_factory=dict)  # offload: (k, i) -> its layers' OffloadHandles
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # offload: (k, i) -> input's gradient
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (k, i) -> output / loss
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    loss_sum: Optional[dist.Work] = None  # the loss's sum over dp, started once it is final (see run_actions)
    rows: list[slice] = field(default_factory=list)  # each micro-batch's rows of the global batch
    batch: int = 0  # the global batch's rows
    seed: Optional[int] = None  # the step's dropout seed (None: no dropout; see Pipeline.train_step)

    def where(self, i: int) -> SubBatch:
        """Micro-batch i's SubBatch: its rows of the global batch, the step's dropout seed. The
        dropout streams key their masks by these rows (oases.models.dropout_streams), so every micro-batch
        of every DP rank draws its own; recomputation redraws the first forward's."""
        return SubBatch(self.rows[i], self.batch, self.seed)


def action_marks(actions: list[Action], segments: int) -> tuple[dict, dict[int, int], dict[int, int]]:
    """({B(k, i): the next backward}, {segment: index of its first forward}, {index of its last backward:
    segment}) of a stage's actions."""
    backward = [(a.segment, a.micro_batch) for a in actions if a.kind == "B"]
    next_backward = dict(zip(backward, backward[1:]))  # offload: what to prefetch during B(k, i)
    first_forward = {
        k: min(j for j, a in enumerate(actions) if a.kind == "F" and a.segment == k) for k in range(segments)
    }
    last_backward = {
        max(j for j, a in enumerate(actions) if a.kind == "B" and a.segment == k): k for k in range(segments)
    }
    return next_backward, first_forward, last_backward


class Executor:
    """Runs one stage's steps (see the module doc): what a step's actions need, the wrappers around them.

    Args:
        comm: the stage's StageComm (its links to the neighbouring stages).
        settings: the pipeline's checked arguments (schedule, micro_batches, loss_scaler).
        dp_group: the mesh's dp group (this DP rank's rows; the loss's sum over dp).
        offloader: per-layer recompute inputs to host memory (None: they stay).
    """

    def __init__(
        self, comm: StageComm, settings: Settings, *, dp_group: dist.ProcessGroup, offloader: Optional[Offloader]
    ) -> None:
        self.comm, self.offloader, self.loss_scaler = comm, offloader, settings.loss_scaler
        self.schedule, self.micro_batches = settings.schedule, settings.micro_batches
        self.dp_group, self.dp, self.dp_rank = dp_group, dist.get_world_size(dp_group), dist.get_rank(dp_group)
        # register_action_wrapper's, by handle id (an OrderedDict: RemovableHandle keeps a weak reference)
        self.wrappers: OrderedDict[int, ActionWrapper] = OrderedDict()
        self.phase_wrappers: OrderedDict[int, Callable[[str, Callable[[], None]], None]] = OrderedDict()
        self.anchor = torch.empty(0, requires_grad=True)  # offload: what received inputs hang from
        self.failed: Optional[BaseException] = None  # a step that raised mid-way (its links are out of order)

    def arrange(self, stage: Stage, updates: Updates) -> None:
        """Run `stage` (its layout: after each (re)configuration), applying and launching `updates`: this
        stage's actions, each link's arrivals in send order, where each segment's first forward and last
        backward sit, and what to prefetch during each B(k, i) (offload)."""
        self.stage, self.layout, self.updates = stage, stage.layout, updates
        segments = self.layout.segments
        self.actions: list[Action] = actions(
            self.schedule,
            stage=self.layout.stage,
            stages=self.layout.stages,
            segments=segments,
            micro_batches=self.micro_batches,
        )
        self.comm.expect(self.schedule, segments, self.micro_batches)  # each link's arrivals, in send order
        self.next_backward, self.first_forward, self.last_backward = action_marks(self.actions, segments)

    def register(self, wrapper: ActionWrapper, *, phases: bool = False) -> RemovableHandle:
        """Run every action of train_step through `wrapper` (Pipeline.register_action_wrapper), or with
        `phases` every host phase of a step (Pipeline.register_phase_wrapper)."""
        if not callable(wrapper):
            subject = "phase" if phases else "action"
            raise TypeError(f"wrapper: expected a callable wrapper({subject}, run), got {type(wrapper).__name__}")
        wrappers = self.phase_wrappers if phases else self.wrappers
        handle = RemovableHandle(wrappers)
        wrappers[handle.id] = wrapper
        return handle

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, a step's host phase ("input_check", "loss_sum": collectives), through the phase wrappers.
        A wrapper's own failure (not fn's, which every rank raises alike) may have skipped the collective
        on this rank only: it fails the pipeline as a failed action does (`failed`)."""
        result: list[Any] = []
        raised = False

        def call() -> None:
            nonlocal raised
            try:
                result.append(fn())
            except BaseException:
                raised = True
                raise

        try:
            _through(self.phase_wrappers, name, call, "register_phase_wrapper")
        except BaseException as error:
            if not raised:
                self.failed = error
            raise
        return result[0]

    def split(self, tokens: torch.Tensor, targets: torch.Tensor) -> Step:
        """This DP rank's contiguous block of rows, cut into micro-batches of near-equal rows."""
        rows = tokens.shape[0] // self.dp
        block = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        parts = split_rows(rows, self.micro_batches)  # sizes differ by at most one
        mine = [t[block].to(self.comm.device) for t in (tokens, targets)]  # on the model's device
        micro = [tuple(t[p] for t in mine) for p in parts]
        shapes = [torch.Size((p.stop - p.start, tokens.shape[1], self.stage.hidden)) for p in parts]  # [b_i, t, h]
        return Step(
            micro,
            {},
            shapes,
            self.stage.dtype,
            int((targets != IGNORE_INDEX).sum()),  # normalizer: the global batch's tokens with a target
            loss=torch.zeros((), dtype=torch.float32, device=self.comm.device),
            rows=[slice(block.start + p.start, block.start + p.stop) for p in parts],  # of the global batch
            batch=tokens.shape[0],
        )

    def refuse_if_failed(self, message: str) -> None:
        """RuntimeError(message), caused by `failed`, once a step failed mid-way: messages are left posted
        on the links, which match in order, and ranks may hold different pending updates."""
        if self.failed is not None:
            raise RuntimeError(f"{message}; build a new Pipeline") from self.failed

    def reserve(self, step: Step) -> None:
        """Stage 0 of several segments: size the slab the lazy inter-segment receives land in."""
        if self.layout.stage == 0 and self.layout.segments > 1:
            self.comm.reserve_lazy(step.shapes, step.dtype, self.layout.segments)

    def run_actions(self, step: Step) -> None:
        """train_step's actions (`_actions`), then a tied copy's gradient summed with the other copy's and
        its sync launched (Updates.sum_tied). One that raises is kept in `failed`: receives may still be
        posted, so the links' order is lost and no later step may run."""
        try:
            self._actions(step)
            self.updates.sum_tied()
        except BaseException as error:
            self.failed = error
            raise

    def _actions(self, step: Step) -> None:
        """Every action of the step in order (`run` each, profiled by kind): the receive each one
        waits for posted one action ahead, segment k's pending update applied (and stage 0's lazy
        receives posted) before its first forward, its DP sync launched after its last backward; then
        every send waited for. On the last stage, the loss's sum over dp starts right after its last
        forward, before any DP sync is launched: on the same links, it would wait behind their chunks."""
        last_loss = max(
            (j for j, a in enumerate(self.actions) if a.kind == "F" and self.layout.is_last(a.segment)), default=None
        )
        self._post_recv(0, step)  # receives are posted in the order they are waited for
        for j, action in enumerate(self.actions):
            if self.first_forward[action.segment] == j:
                self.updates.apply(action.segment)
                self._post_lazy(action.segment, step)
            self._post_recv(j + 1, step)  # PPComm: the next action's input is on its way meanwhile
            with torch.profiler.record_function(f"oases::pipeline::{action.kind}"):
                self.run(action, step)
            # The loss is final: its sum over dp goes ahead of the DP syncs. The DP thread is idle here in
            # every schedule of oases.pipeline.schedules (each segment's update, which waits for its sync,
            # precedes its first forward, and those precede the last stage's last forward), so every dp
            # rank issues it at the same point of the same sequence of dp collectives.
            if j == last_loss and self.dp > 1:
                step.loss_sum = dist.all_reduce(step.loss, group=self.dp_group, async_op=True)
            if j in self.last_backward:  # DPComm: this segment's gradients are final
                self.updates.launch(self.last_backward[j])
        self.comm.wait_sends()

    def evaluate(self, step: Step, model: nn.Module) -> None:
        """eval_step's forwards (run_forwards) with every module of `model` in eval mode, under no_grad,
        each link expecting an evaluation's arrivals; the modules' training modes restored after, and
        (once it succeeded) train_step's arrivals. One that raises is kept in `failed`, as run_actions'."""
        modes = {module: module.training for module in model.modules()}
        self.comm.expect(self.schedule, self.layout.segments, self.micro_batches, forward_only=True)
        try:
            self.reserve(step)
            model.eval()
            with torch.no_grad():
                self.run_forwards(step)
        except BaseException as error:  # receives may still be posted: the links' order is lost
            self.failed = error
            raise
        finally:
            for module, training in modes.items():
                module.training = training
        self.comm.expect(self.schedule, self.layout.segments, self.micro_batches)  # train_step's arrivals again

    def run_forwards(self, step: Step) -> None:
        """An evaluation (under no_grad, after StageComm.expect(..., forward_only=True)): F(k, i) for
        every segment k and micro-batch i, in that order, each receive posted one ahead (stage 0's
        lazy receives at each segment's first forward); nothing kept, no DP sync; the loss's sum over
        dp started on the last stage after its last forward; then every send waited for."""
        segments = self.layout.segments
        forwards = [(k, i) for k in range(segments) for i in range(self.micro_batches)]
        key = _forward_key(self.layout, *forwards[0])
        if key is not None:
            self.comm.post_recv(key, step.shapes[key[2]], step.dtype)
        for j, (k, i) in enumerate(forwards):
            if i == 0:
                self._post_lazy(k, step)
            if j + 1 < len(forwards):
                key = _forward_key(self.layout, *forwards[j + 1])
                if key is not None:
                    self.comm.post_recv(key, step.shapes[key[2]], step.dtype)
            with torch.profiler.record_function("oases::pipeline::F"):
                self._forward(k, i, step, keep=False)
        if self.layout.is_last(segments - 1) and self.dp > 1:
            step.loss_sum = dist.all_reduce(step.loss, group=self.dp_group, async_op=True)
        self.comm.wait_sends()

    def run(self, action: Action, step: Step) -> None:
        """One action of the step (`_run`), through the registered wrappers, the first registered
        outermost; RuntimeError when they did not run it exactly once (the step then fails)."""
        _through(self.wrappers, action, lambda: self._run(action, step), "register_action_wrapper")

    def _run(self, action: Action, step: Step) -> None:
        """F(k, i): receive (or embed), run the segment, send (or add the loss), keep (input, output).
        B(k, i): receive the output's gradient (or start from the loss), back-propagate, send the
        input's gradient (unless virtual stage 0)."""
        if action.kind == "F":
            self._forward(action.segment, action.micro_batch, step)
        else:
            self._backward(action.segment, action.micro_batch, step)

    def _post_lazy(self, segment: int, step: Step) -> None:
        """Stage 0, at segment k's first forward: post the receives of every micro-batch's
        activation from segment k's last stage (needed by segment k+1) into host memory
        (oases.pipeline.p2p: inter-segment lazy communication)."""
        if self.layout.stage != 0 or segment + 1 >= self.layout.segments:
            return
        edge = self.layout.virtual(segment + 1) - 1  # stage p-1 of segment k -> stage 0 of segment k+1
        keys = [("act", edge, i) for i in range(self.micro_batches)]
        self.comm.post_lazy(keys, step.shapes, step.dtype)

    def _post_recv(self, j: int, step: Step) -> None:
        """Post the receive actions[j] waits for, if any."""
        key = _recv_key(self.layout, self.actions[j]) if j < len(self.actions) else None
        if key is not None:
            self.comm.post_recv(key, step.shapes[key[2]], step.dtype)

    def _embed(self, step: Step, i: int) -> Optional[torch.Tensor]:
        """Micro-batch i's embedding on virtual stage 0 (None elsewhere); its ctx (with step.where(i):
        the dropout seed and rows every layer's masks are keyed by) is kept for every layer."""
        x, step.ctx[i] = self.stage.embed(step.micro[i][0], step.where(i))
        return x if self.layout.is_first(0) else None

    def _forward(self, k: int, i: int, step: Step, *, keep: bool = True) -> None:
        """F(k, i); keep False (an evaluation): no offload, and its input and output are not kept."""
        v, off = self.layout.virtual(k), (self.offloader if keep else None)
        if self.layout.is_first(k):
            x = self._embed(step, i)
        else:
            if i not in step.ctx:
                self._embed(step, i)
            x = self.comm.recv(("act", v - 1, i), step.shapes[i], step.dtype)
            # Offloading, the received input is not kept here: layer 0's saved input holds it.
            x = grad_leaf(x) if off is None else StageInput.apply(self.anchor, x, step.grads, (k, i))
        saving = None if off is None else (off, (k, i), step.saved.setdefault((k, i), []))
        y = self.stage.forward_segment(k, x, step.ctx[i], offload=saving)
        if off is not None:
            off.flush((k, i))  # this micro-batch's recompute inputs leave while the next one computes
        if self.layout.is_last(k):
            y = self.stage.loss_sum(y, step.micro[i][1], step.ctx[i]) / step.normalizer
            step.loss += y.detach()
        else:
            self.comm.send(("act", v, i), y)
        if keep:
            step.inputs[k, i], step.outputs[k, i] = (x if off is None else None), y

    def _backward(self, k: int, i: int, step: Step) -> None:
        v, off = self.layout.virtual(k), self.offloader
        x, y = step.inputs.pop((k, i)), step.outputs.pop((k, i))
        if off is not None:  # FOLD3D §4: this backward's recompute inputs (if not yet), then the next one's
            off.prefetch(reversed(step.saved[k, i]))
            following = self.next_backward.get((k, i))
            if following is not None:
                off.prefetch(reversed(step.saved.get(following, [])))
        if self.layout.is_last(k):
            (y if self.loss_scaler is None else self.loss_scaler.scale(y)).backward()
        else:
            torch.autograd.backward(y, self.comm.recv(("grad", v, i), step.shapes[i], step.dtype))
        step.saved.pop((k, i), None)
        if not self.layout.is_first(k):
            self.comm.send(("grad", v - 1, i), x.grad if off is None else step.grads.pop((k, i)))


def _through(wrappers: OrderedDict, subject: Any, fn: Callable[[], None], hook: str) -> None:
    """`fn()` through `wrappers` (each `wrapper(subject, run)`), the first registered outermost;
    RuntimeError naming `hook` when they did not call run() exactly once."""
    if not wrappers:
        fn()
        return
    runs = 0

    def run() -> None:
        nonlocal runs
        runs += 1
        if runs > 1:
            raise RuntimeError(f"{hook}: a wrapper called run() of {subject!r} twice")
        fn()

    call: Callable[[], None] = run
    for wrapper in reversed(list(wrappers.values())):
        call = functools.partial(wrapper, subject, call)
    call()
    if runs == 0:
        raise RuntimeError(f"{hook}: no wrapper called run() of {subject!r}: each must call it once")


def _recv_key(layout: StageLayout, action: Action) -> Optional[tuple[str, int, int]]:
    """The message `action` waits for (None: it needs none)."""
    v = layout.virtual(action.segment)
    if action.kind == "F":
        return None if layout.is_first(action.segment) else ("act", v - 1, action.micro_batch)
    return None if layout.is_last(action.segment) else ("grad", v, action.micro_batch)


def _forward_key(layout: StageLayout, k: int, i: int) -> Optional[tuple[str, int, int]]:
    return _recv_key(layout, Action("F", k, i))
