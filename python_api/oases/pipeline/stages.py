"""Which layers a pipeline stage holds, and the stage module that runs them (FOLD3D §3.2 step 1).

With p stages and ns segments, the L layers are cut into ns segments of L/ns layers and each
segment into p chunks of c = L/(ns*p) layers; stage s holds chunk s of every segment:

    layers_of(stage=s, segment=k) = range(k*L/ns + s*c, k*L/ns + (s+1)*c)
    L=12, ns=2, p=3 (c=2):  stage 0: (0,1) (6,7)   stage 1: (2,3) (8,9)   stage 2: (4,5) (10,11)

Seen as one chain, (segment k, stage s) is the *virtual stage* v = k*p + s: activations flow
v -> v+1 (from stage p-1 of segment k to stage 0 of segment k+1 between segments), gradients
v+1 -> v. The embedding sits before v = 0, the head (final norm, LM head) and loss after
v = ns*p - 1.

A stage runs any `oases.schedule.Stack` (oases.models.GPT, a Hugging Face model through
oases.models.HFStack, nanoGPT, a user's own stack): layer i is `stack.layers()[i]`, each
sublayer x + finish(reduce_from_tp(core(copy_to_tp(norm(x)), ctx)), ctx) as in GPT.forward.

Its parts: the folding (StageLayout) in oases.pipeline._layout, which parameters are the embedding's
and the head's (Roles) in _roles, the module subtrees a stage owns or stands in for in _subtrees,
the autograd functions of offload in _offloaded.
"""

from __future__ import annotations

import functools
import time
from typing import Hashable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from oases.nn.mappings import copy_to_tp, reduce_from_tp
from oases.nn.vocab import IGNORE_INDEX, vocab_parallel_cross_entropy
from oases.offload import Offloader
from oases.pipeline._layout import StageLayout, placement_of_layer, shared_across_placements
from oases.pipeline._layout import check_layers as check_layers  # (re-exported: oases.pipeline._build)
from oases.pipeline._offloaded import OffloadedLayer
from oases.pipeline._offloaded import StageInput as StageInput  # (re-exported)
from oases.pipeline._roles import Roles, probe_roles
from oases.pipeline._subtrees import outermost, standing_in
from oases.pipeline._subtrees import owned_modules as _owned_modules
from oases.schedule import Stack, SubBatch
from oases.storage import full_state_dict
from oases.storage.unsharded import unsharded_shapes

__all__ = ["StageLayout", "Stage", "Roles", "probe_roles"]


class Stage:
    """This rank's part of a model seen as a Stack: its layers of every segment, the embedding
    on the first virtual stage, the head and loss on the last.

        stage = Stage(model, stack, layout, tp_group)    # model: the nn.Module behind `stack`
        x, ctx = stage.embed(tokens, where)              # every stage: ctx (x used on virtual stage 0)
        y = stage.forward_segment(k, x, ctx)             # x [b, t, h]: segment k's layers of this stage
        loss_sum = stage.loss_sum(y, targets, ctx)       # last virtual stage: summed token cross-entropy
        stage.segment_parameters(k), stage.state_dict()  # what it trains; the full model's state

    Each layer runs under torch.utils.checkpoint (non-reentrant), or with offload under an
    equivalent that keeps its input in an Offloader: only the input is kept, the inside is
    recomputed in backward, TP all-reduces included.

    Which parameters are the embedding's and which the head's is found by differentiating
    `stack.embed` and `stack.head` once on a one-token input (on every rank of the stage alike: a
    vocab-parallel embedding or head communicates over TP there), unless `roles` says it (a meta
    build: oases.pipeline._build finds them before anything is allocated); the parameters of
    layers are their sublayers' `parameters()` (nn.Module sublayers, oases.models' branches).
    Every rank builds the whole model (built on meta: allocates only what its stage places); it
    trains, syncs and reports only its own parameters, and `release_unowned()` frees the ones it
    never uses (on meta, there is nothing to free).

    Tied input and output embeddings (one parameter both `stack.embed` and `stack.head` use) are
    placed with both: on the first and the last stage, each holding a copy (`tied`; the pipeline
    sums the copies' gradients, oases.pipeline.tied), and in both the first and the last segment
    of one stage when pp = 1. A parameter placed in several segments of a stage is trained by
    the lowest of them (the embedding's: its backward ends last, its forward comes first). Any
    other parameter used at two (segment, stage) placements (a weight tied between layers, or
    between a layer and the embedding or head) is refused (ValueError).
    """

    def __init__(
        self,
        model: nn.Module,
        stack: Stack,
        layout: StageLayout,
        tp_group: Optional[dist.ProcessGroup],
        roles: Optional[Roles] = None,
    ) -> None:
        self.model, self.stack, self.layout = model, stack, layout
        self._anchor = torch.empty(0, requires_grad=True)  # see OffloadedLayer
        distributed = dist.is_available() and dist.is_initialized()
        self.tp = dist.get_world_size(tp_group) if distributed and tp_group is not None else 1
        self.group = tp_group if self.tp > 1 else None
        self.logits_group = getattr(stack, "logits_group", None)
        self._layers = list(stack.layers())
        if len(self._layers) != layout.layers:
            raise ValueError(f"model: {len(self._layers)} layers, but the layout was made for {layout.layers}")
        layer_params = [
            _unique(p for sub in layer for p in _parameters_of(sub, i)) for i, layer in enumerate(self._layers)
        ]
        in_layers = {id(p) for params in layer_params for p in params}
        rest = _unique(p for p in model.parameters() if id(p) not in in_layers)
        if roles is None:  # one token through embed and head: activation size and dtype, vocabulary, who uses what
            roles = probe_roles(model, stack, rest)
        self.roles = roles
        self.hidden, self.dtype, self.vocab_size = roles.hidden, roles.dtype, roles.vocab_size
        named = dict(model.named_parameters(remove_duplicate=False))
        head_ids, embed_ids = ({id(named[n]) for n in names} for names in (roles.head, roles.embed))
        self._embed_params = [p for p in rest if id(p) not in head_ids]  # unused ones go with the embedding
        self._embed_uses = [p for p in rest if id(p) in embed_ids or id(p) not in head_ids]  # tied ones too
        self._head_params = [p for p in rest if id(p) in head_ids]
        self._tied = [p for p in self._head_params if id(p) in embed_ids]  # tied input/output embeddings
        self._layer_params = layer_params
        shared = self.shared_at(layout.segments)
        if shared:
            raise ValueError(
                f"model: parameter {shared} is used in more than one place of the pipeline (a "
                f"(segment, stage) pair: pp = {layout.stages}, segments = {layout.segments}) other "
                "than by the embedding and the head (tied input/output embeddings, supported); "
                "its gradient would need a sum across them. Untie it, or use pp = segments = 1"
            )
        owned = {id(p) for k in range(layout.segments) for p in self._placed(k)}
        self._owned_keys = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in owned}
        self.key_order = list(model.state_dict())  # the model's state-dict order, for Pipeline.state_dict()
        self.shapes = unsharded_shapes(model)  # {key: unsharded shape} of the whole model (before release_unowned)
        # Modules outside the layers whose parameters this rank does not hold (a meta build's other stages'):
        # stood in for while embed computes the ctx.
        self._absent = outermost(
            name
            for name, m in model.named_modules()
            if any(p.is_meta and id(p) not in in_layers for p in m.parameters(recurse=False))
        )

    def shared_at(self, segments: int) -> Optional[str]:
        """A parameter that `segments` segments would place at two (segment, stage) pairs, or None
        (a tied embedding and head excepted: see the class doc)."""
        return shared_across_placements(
            self.model, self._layer_params, self._embed_uses, self._head_params, self.layout.stages, segments
        )

    @property
    def tied(self) -> list[nn.Parameter]:
        """The trainable parameters both the embedding and the head use (tied input/output
        embeddings), whatever this stage places: the same on every rank."""
        return [p for p in self._tied if p.requires_grad]

    @property
    def tied_keys(self) -> frozenset[str]:
        """Every state-dict key of a parameter the embedding and the head share (frozen ones too)."""
        ids = {id(p) for p in self._tied}
        return frozenset(n for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) in ids)

    def tied_segment(self) -> Optional[int]:
        """The segment of this stage that trains `tied` (None: this stage does not place it, or
        there is none): 0 on the first stage, ns - 1 on the last (pp > 1), 0 with pp = 1."""
        ids = {id(p) for p in self.tied}
        return next(
            (k for k in range(self.layout.segments) if any(id(p) in ids for p in self.segment_parameters(k))), None
        )

    @property
    def owned_keys(self) -> frozenset[str]:
        """The state-dict keys of every parameter this stage places (all names of a tied one)."""
        return frozenset(self._owned_keys)

    def stage_of(self) -> dict[str, int]:
        """{state-dict key of a parameter: the stage that places it (a tied embedding and head: the
        first)}, for every stage (local: the layout is known everywhere). Buffers are not listed:
        every stage holds them."""
        layout, where = self.layout, {}
        for i, params in enumerate(self._layer_params):
            stage = placement_of_layer(i, layout.layers, layout.stages, layout.segments)[1]
            where.update((id(p), stage) for p in params)
        where.update((id(p), layout.stages - 1) for p in self._head_params)
        where.update((id(p), 0) for p in self._embed_uses)  # a tied embedding and head: the first stage's copy
        return {n: where[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) in where}

    def held(self) -> Optional[nn.Module]:
        """The modules this stage owns whole, at their qualified names (their state-dict keys are the
        model's); None when some parameter it places is not in such a module."""
        return _owned_modules(self.model, self._owned_keys)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank trains (its segments' layers, embedding and head as placed)."""
        return _unique(p for k in range(self.layout.segments) for p in self.segment_parameters(k))

    def _placed(self, segment: int) -> list[nn.Parameter]:
        """Every parameter segment `segment` of this stage uses (embedding / head included), frozen ones too."""
        params = [p for i in self.layout.layers_of(segment) for p in self._layer_params[i]]
        if self.layout.is_first(segment):
            params = [*self._embed_params, *self._tied, *params]
        if self.layout.is_last(segment):
            params += self._head_params
        return _unique(params)

    def segment_parameters(self, segment: int) -> list[nn.Parameter]:
        """What segment `segment` of this stage trains: its parameters that require grad, each in
        the lowest segment of this stage that places it (frozen ones are placed, reported by
        state_dict(), never stepped nor synced)."""
        earlier = {id(p) for k in range(segment) for p in self._placed(k)}
        return [p for p in self._placed(segment) if p.requires_grad and id(p) not in earlier]

    def embed(self, tokens: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, object]:
        """stack.embed(tokens, where): on virtual stage 0 differentiable, elsewhere only for its ctx
        (rotary embeddings, masks: what every layer gets), without a graph. Modules whose parameters
        this rank does not hold (a meta build: another stage's embedding or final norm) are stood in
        for meanwhile: an embedding gives zeros `[*tokens.shape, h]`, any other module its input."""
        with standing_in(self.model, self._absent):
            if self.layout.is_first(0):
                return self.stack.embed(tokens, where)
            with torch.no_grad():
                return self.stack.embed(tokens, where)

    def _layer(self, index: int, x: torch.Tensor, ctx: object) -> torch.Tensor:
        """Layer `index` as GPT.forward runs it: x = x + finish(reduce_from_tp(core(copy_to_tp(norm(x)))))
        per sublayer."""
        for s in self._layers[index]:
            h = s.norm(x)
            if self.tp > 1:
                x = x + s.finish(reduce_from_tp(s.core(copy_to_tp(h, self.group), ctx), self.group), ctx)
            else:
                x = x + s.finish(s.core(h, ctx), ctx)
        return x

    def time_layer(
        self, shape: torch.Size, dtype: torch.dtype, ctx: object, *, repeats: int = 2
    ) -> tuple[float, float]:
        """Seconds of one layer's forward and backward (with its recomputation) on x [shape], as
        forward_segment runs it (the last of `repeats` runs; gradients returned, not accumulated).
        A collective over the TP group when tp > 1."""
        index = self.layout.layers_of(0)[0]
        device = next((p.device for p in self._layer_params[index]), None)
        x = torch.randn(shape, dtype=dtype, device=device, generator=torch.Generator(device or "cpu").manual_seed(0))
        x.requires_grad_(True)
        inputs = [x, *(p for p in self._layer_params[index] if p.requires_grad)]
        sync = torch.cuda.synchronize if x.is_cuda else (lambda device: None)  # CUDA: kernels only enqueued
        for _ in range(repeats):
            sync(x.device)
            start = time.perf_counter()
            y = checkpoint(self._layer, index, x, ctx, use_reentrant=False)
            sync(x.device)
            middle = time.perf_counter()
            torch.autograd.grad(y, inputs, torch.ones_like(y))
            sync(x.device)
            end = time.perf_counter()
        return middle - start, end - middle

    def forward_segment(
        self, segment: int, x: torch.Tensor, ctx: object, *, offload: Optional[tuple[Offloader, Hashable, list]] = None
    ) -> torch.Tensor:
        """Segment `segment`'s layers of this stage on x [b, t, h] (the embedding's output on virtual stage 0).

        offload = (offloader, group, handles): each layer's input is saved in the offloader under
        `group` (its OffloadHandle appended to `handles`, in layer order) instead of being kept by
        torch.utils.checkpoint; backward gets it back (waiting for its copy in), releases it and
        recomputes the layer, as torch.utils.checkpoint would. Under no_grad: the layers, nothing kept."""
        for i in self.layout.layers_of(segment):
            if not torch.is_grad_enabled():  # an evaluation: nothing to keep for a backward
                x = self._layer(i, x, ctx)
            elif offload is None:
                x = checkpoint(self._layer, i, x, ctx, use_reentrant=False)
            else:  # the anchor makes the output need grad even when x does not (a frozen embedding)
                x = OffloadedLayer.apply(x, self._anchor, functools.partial(self._layer, i, ctx=ctx), *offload)
        return x

    def loss_sum(self, x: torch.Tensor, targets: torch.Tensor, ctx: object) -> torch.Tensor:
        """Summed token cross-entropy of the head on x [b, t, h] against targets [b, t] (not shifted;
        IGNORE_INDEX positions skipped); from the vocabulary slices when the head is vocab-parallel
        (logits never gathered)."""
        logits = self.stack.head(x, ctx)  # [b, t, vocab] or [b, t, vocab/p]
        if self.logits_group is not None:
            return vocab_parallel_cross_entropy(
                logits.flatten(0, 1), targets.flatten(), self.logits_group, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the full (TP-gathered) model's state dict: its parameters, and
        the buffers on stage 0. A collective over the TP group (oases.full_state_dict of the
        modules this stage owns whole; of the whole model if its parameters are not all in such
        modules, which release_unowned() then refuses to free)."""
        owned = _owned_modules(self.model, self._owned_keys)
        full = full_state_dict(self.model if owned is None else owned)
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        mine = {k: v for k, v in full.items() if k in self._owned_keys}
        if self.layout.stage == 0:  # buffers are never freed nor sharded: stage 0 reports them all
            mine.update((k, v.detach().clone()) for k, v in self.model.state_dict().items() if k not in params)
        return mine

    def release_unowned(self) -> int:
        """Free the parameters of other stages' layers, which this rank never runs (embedding and
        head stay everywhere: every stage runs the embedding for its ctx, and a model's own
        forward may run its final norm too). Their tensors become empty; the model's structure
        stays. Returns the bytes freed (0 when this stage's parameters are not all in modules it
        owns whole: then nothing is freed)."""
        if _owned_modules(self.model, self._owned_keys) is None:
            return 0
        keep = {id(p) for p in (*self._embed_params, *self._head_params)}
        keep |= {id(p) for k in range(self.layout.segments) for p in self._placed(k)}
        freed = 0
        with torch.no_grad():
            for p in _unique(self.model.parameters()):
                if id(p) not in keep and p.numel() and not p.is_meta:  # meta: never allocated
                    freed += p.numel() * p.element_size()
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    p.grad = None
        return freed


def _unique(params) -> list[nn.Parameter]:
    """`params` without repeats (tied parameters once), in first-seen order."""
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _parameters_of(sublayer: object, index: int) -> list[nn.Parameter]:
    if isinstance(sublayer, nn.Module) or callable(getattr(sublayer, "parameters", None)):
        return list(sublayer.parameters())
    raise ValueError(
        f"model: a sublayer of layer {index} ({type(sublayer).__name__}) is not an nn.Module and has "
        "no parameters() method; the pipeline needs each sublayer's parameters to place them"
    )
