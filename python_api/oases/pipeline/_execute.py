"""How a Pipeline's stage runs one train_step's actions: the step's micro-batches, each action's receive
posted one ahead, F(k, i) and B(k, i) themselves, and where each segment's first forward and last backward
sit in the actions (see the oases.pipeline.pipeline module doc)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from oases._leaves import grad_leaf
from oases._rows import split_rows
from oases.nn.vocab import IGNORE_INDEX
from oases.pipeline._layout import StageLayout
from oases.pipeline._offloaded import StageInput
from oases.pipeline._updates import hyper_parameters
from oases.pipeline.schedules import Action
from oases.schedule import SubBatch

if TYPE_CHECKING:
    from oases.pipeline.pipeline import Pipeline

__all__ = ["Step", "split", "run_actions", "run_forwards", "run", "post_recv", "post_lazy", "action_marks"]


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
        dropout streams key their masks by these rows (oases.models._dropout_streams), so every micro-batch
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


def split(pipe: Pipeline, tokens: torch.Tensor, targets: torch.Tensor) -> Step:
    """This DP rank's contiguous block of rows, cut into micro-batches of near-equal rows."""
    rows = tokens.shape[0] // pipe.dp
    block = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
    parts = split_rows(rows, pipe.micro_batches)  # sizes differ by at most one
    mine = [t[block].to(pipe.comm.device) for t in (tokens, targets)]  # on the model's device
    micro = [tuple(t[p] for t in mine) for p in parts]
    shapes = [torch.Size((p.stop - p.start, tokens.shape[1], pipe.stage.hidden)) for p in parts]  # [b_i, t, h]
    return Step(
        micro,
        {},
        shapes,
        pipe.stage.dtype,
        int((targets != IGNORE_INDEX).sum()),  # normalizer: the global batch's tokens with a target
        loss=torch.zeros((), dtype=torch.float32, device=pipe.comm.device),
        rows=[slice(block.start + p.start, block.start + p.stop) for p in parts],  # of the global batch
        batch=tokens.shape[0],
    )


def post_lazy(pipe: Pipeline, segment: int, step: Step) -> None:
    """Stage 0, at segment k's first forward: post the receives of every micro-batch's
    activation from segment k's last stage (needed by segment k+1) into host memory
    (oases.pipeline.p2p: inter-segment lazy communication)."""
    if pipe.layout.stage != 0 or segment + 1 >= pipe.segments:
        return
    edge = pipe.layout.virtual(segment + 1) - 1  # stage p-1 of segment k -> stage 0 of segment k+1
    keys = [("act", edge, i) for i in range(pipe.micro_batches)]
    pipe.comm.post_lazy(keys, step.shapes, step.dtype)


def post_recv(pipe: Pipeline, j: int, step: Step) -> None:
    """Post the receive actions[j] waits for, if any."""
    key = _recv_key(pipe.layout, pipe.actions[j]) if j < len(pipe.actions) else None
    if key is not None:
        pipe.comm.post_recv(key, step.shapes[key[2]], step.dtype)


def _recv_key(layout: StageLayout, action: Action) -> Optional[tuple[str, int, int]]:
    """The message `action` waits for (None: it needs none)."""
    v = layout.virtual(action.segment)
    if action.kind == "F":
        return None if layout.is_first(action.segment) else ("act", v - 1, action.micro_batch)
    return None if layout.is_last(action.segment) else ("grad", v, action.micro_batch)


def _embed(pipe: Pipeline, step: Step, i: int) -> Optional[torch.Tensor]:
    """Micro-batch i's embedding on virtual stage 0 (None elsewhere); its ctx (with step.where(i):
    the dropout seed and rows every layer's masks are keyed by) is kept for every layer."""
    x, step.ctx[i] = pipe.stage.embed(step.micro[i][0], step.where(i))
    return x if pipe.layout.is_first(0) else None


def run_actions(pipe: Pipeline, step: Step) -> None:
    """Every action of the step in order (pipe._run each, profiled by kind): the receive each one
    waits for posted one action ahead, segment k's pending update applied (and stage 0's lazy
    receives posted) before its first forward, its DP sync launched after its last backward; then
    every send waited for. On the last stage, the loss's sum over dp starts right after its last
    forward, before any DP sync is launched: on the same links, it would wait behind their chunks."""
    last_loss = max(
        (j for j, a in enumerate(pipe.actions) if a.kind == "F" and pipe.layout.is_last(a.segment)), default=None
    )
    post_recv(pipe, 0, step)  # receives are posted in the order they are waited for
    for j, action in enumerate(pipe.actions):
        if pipe._first_forward[action.segment] == j:
            pipe._apply_update(action.segment)
            post_lazy(pipe, action.segment, step)
        post_recv(pipe, j + 1, step)  # PPComm: the next action's input is on its way meanwhile
        with torch.profiler.record_function(f"oases::pipeline::{action.kind}"):
            pipe._run(action, step)
        # The loss is final: its sum over dp goes ahead of the DP syncs. The DP thread is idle here in
        # every schedule of oases.pipeline.schedules (each segment's update, which waits for its sync,
        # precedes its first forward, and those precede the last stage's last forward), so every dp
        # rank issues it at the same point of the same sequence of dp collectives.
        if j == last_loss and pipe.dp > 1:
            step.loss_sum = dist.all_reduce(step.loss, group=pipe.dp_group, async_op=True)
        if j in pipe._last_backward:  # DPComm: this segment's gradients are final
            segment = pipe._last_backward[j]
            pipe.sync.launch(segment)
            pipe._update_pending.add(segment)
            # the step is applied before the segment's next forward, in the next train_step: after a
            # scheduler's step() in between; it runs with the hyper-parameters of now, as one process's would
            pipe._update_hyper[segment] = hyper_parameters(pipe.optimizers[segment])
    pipe.comm.wait_sends()


def run_forwards(pipe: Pipeline, step: Step) -> None:
    """An evaluation (under no_grad, after StageComm.expect(..., forward_only=True)): F(k, i) for
    every segment k and micro-batch i, in that order, each receive posted one ahead (stage 0's
    lazy receives at each segment's first forward); nothing kept, no DP sync; the loss's sum over
    dp started on the last stage after its last forward; then every send waited for."""
    forwards = [(k, i) for k in range(pipe.segments) for i in range(pipe.micro_batches)]
    key = _forward_key(pipe.layout, *forwards[0])
    if key is not None:
        pipe.comm.post_recv(key, step.shapes[key[2]], step.dtype)
    for j, (k, i) in enumerate(forwards):
        if i == 0:
            post_lazy(pipe, k, step)
        if j + 1 < len(forwards):
            key = _forward_key(pipe.layout, *forwards[j + 1])
            if key is not None:
                pipe.comm.post_recv(key, step.shapes[key[2]], step.dtype)
        with torch.profiler.record_function("oases::pipeline::F"):
            _forward(pipe, k, i, step, keep=False)
    if pipe.layout.is_last(pipe.segments - 1) and pipe.dp > 1:
        step.loss_sum = dist.all_reduce(step.loss, group=pipe.dp_group, async_op=True)
    pipe.comm.wait_sends()


def _forward_key(layout: StageLayout, k: int, i: int) -> Optional[tuple[str, int, int]]:
    return _recv_key(layout, Action("F", k, i))


def run(pipe: Pipeline, action: Action, step: Step) -> None:
    """F(k, i): receive (or embed), run the segment, send (or add the loss), keep (input, output).
    B(k, i): receive the output's gradient (or start from the loss), back-propagate, send the
    input's gradient (unless virtual stage 0)."""
    if action.kind == "F":
        _forward(pipe, action.segment, action.micro_batch, step)
    else:
        _backward(pipe, action.segment, action.micro_batch, step)


def _forward(pipe: Pipeline, k: int, i: int, step: Step, *, keep: bool = True) -> None:
    """F(k, i); keep False (an evaluation): no offload, and its input and output are not kept."""
    v, off = pipe.layout.virtual(k), (pipe.offloader if keep else None)
    if pipe.layout.is_first(k):
        x = _embed(pipe, step, i)
    else:
        if i not in step.ctx:
            _embed(pipe, step, i)
        x = pipe.comm.recv(("act", v - 1, i), step.shapes[i], step.dtype)
        # Offloading, the received input is not kept here: layer 0's saved input holds it.
        x = grad_leaf(x) if off is None else StageInput.apply(pipe._anchor, x, step.grads, (k, i))
    saving = None if off is None else (off, (k, i), step.saved.setdefault((k, i), []))
    y = pipe.stage.forward_segment(k, x, step.ctx[i], offload=saving)
    if off is not None:
        off.flush((k, i))  # this micro-batch's recompute inputs leave while the next one computes
    if pipe.layout.is_last(k):
        y = pipe.stage.loss_sum(y, step.micro[i][1], step.ctx[i]) / step.normalizer
        step.loss += y.detach()
    else:
        pipe.comm.send(("act", v, i), y)
    if keep:
        step.inputs[k, i], step.outputs[k, i] = (x if off is None else None), y


def _backward(pipe: Pipeline, k: int, i: int, step: Step) -> None:
    v, off = pipe.layout.virtual(k), pipe.offloader
    x, y = step.inputs.pop((k, i)), step.outputs.pop((k, i))
    if off is not None:  # FOLD3D §4: this backward's recompute inputs (if not yet), then the next one's
        off.prefetch(reversed(step.saved[k, i]))
        following = pipe._next_backward.get((k, i))
        if following is not None:
            off.prefetch(reversed(step.saved.get(following, [])))
    if pipe.layout.is_last(k):
        (y if pipe.loss_scaler is None else pipe.loss_scaler.scale(y)).backward()
    else:
        torch.autograd.backward(y, pipe.comm.recv(("grad", v, i), step.shapes[i], step.dtype))
    step.saved.pop((k, i), None)
    if not pipe.layout.is_first(k):
        pipe.comm.send(("grad", v - 1, i), x.grad if off is None else step.grads.pop((k, i)))
