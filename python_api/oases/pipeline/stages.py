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
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from oases._leaves import grad_leaf
from oases._sharding import tp_rules
from oases.checkpoint import _layout, full_state_dict
from oases.nn._mappings import copy_to_tp, reduce_from_tp
from oases.nn.vocab import vocab_parallel_cross_entropy
from oases.offload import Offloader
from oases.schedule import Stack, SubBatch

__all__ = ["StageLayout", "Stage", "Roles", "probe_roles"]


@dataclass(frozen=True)
class Roles:
    """What a stage knows of a model's embedding and head, by parameter name (every name of a tied one).

        head:   the parameters stack.head uses (final norm, LM head)
        embed:  the parameters stack.embed uses (the others outside the layers go with it too)
        hidden, dtype: of the activations; vocab_size: of the logits (all of it when vocab-parallel)
    """

    head: frozenset[str]
    embed: frozenset[str]
    hidden: int
    dtype: torch.dtype
    vocab_size: int


def probe_roles(model: nn.Module, stack: Stack, rest: list[nn.Parameter],
                device: Optional[torch.device] = None) -> Roles:
    """Roles found by running one token through stack.embed and stack.head and differentiating each
    once (on every rank of the stage alike: a vocab-parallel embedding or head communicates over
    TP there); `rest`: the parameters outside the layers (only their trainable ones are found)."""
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device or (rest[0].device if rest else None))
    x, ctx = stack.embed(tokens, SubBatch(slice(0, 1), 1))
    logits = stack.head(x.detach(), ctx)
    group = getattr(stack, "logits_group", None)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    head = frozenset(n for p in _used_by(logits, rest) for n in names[id(p)])
    embed = frozenset(n for p in _used_by(x, rest) for n in names[id(p)])
    vocab = logits.shape[-1] * (dist.get_world_size(group) if group is not None else 1)
    return Roles(head, embed, x.shape[-1], x.dtype, vocab)


@dataclass(frozen=True)
class StageLayout:
    """Where stage `stage` of `stages` sits when `layers` layers are folded into `segments` segments."""

    layers: int
    stages: int
    segments: int
    stage: int

    def __post_init__(self) -> None:
        if self.layers % (self.stages * self.segments):
            raise ValueError(f"config.layers: {self.layers} is not divisible by pp * segments = "
                             f"{self.stages} * {self.segments}")

    @property
    def chunk(self) -> int:
        """Layers per (segment, stage)."""
        return self.layers // (self.stages * self.segments)

    def layers_of(self, segment: int) -> range:
        """This stage's `chunk` consecutive layers of segment `segment` (after the earlier stages')."""
        start = segment * (self.layers // self.segments) + self.stage * self.chunk
        return range(start, start + self.chunk)

    def virtual(self, segment: int) -> int:
        """The position of (segment, this stage) in the chain of ns * p virtual stages."""
        return segment * self.stages + self.stage

    def is_first(self, segment: int) -> bool:
        """Runs the embedding (virtual stage 0)."""
        return self.virtual(segment) == 0

    def is_last(self, segment: int) -> bool:
        """Runs the final norm, LM head and loss (virtual stage ns*p - 1)."""
        return self.virtual(segment) == self.stages * self.segments - 1


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

    def __init__(self, model: nn.Module, stack: Stack, layout: StageLayout,
                 tp_group: Optional[dist.ProcessGroup], roles: Optional[Roles] = None) -> None:
        self.model, self.stack, self.layout = model, stack, layout
        self._anchor = torch.empty(0, requires_grad=True)  # see _OffloadedLayer
        distributed = dist.is_available() and dist.is_initialized()
        self.tp = dist.get_world_size(tp_group) if distributed and tp_group is not None else 1
        self.group = tp_group if self.tp > 1 else None
        self.logits_group = getattr(stack, "logits_group", None)
        self._layers = list(stack.layers())
        if len(self._layers) != layout.layers:
            raise ValueError(f"model: {len(self._layers)} layers, but the layout was made for {layout.layers}")
        layer_params = [_unique(p for sub in layer for p in _parameters_of(sub, i))
                        for i, layer in enumerate(self._layers)]
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
            raise ValueError(f"model: parameter {shared} is used in more than one place of the pipeline (a "
                             f"(segment, stage) pair: pp = {layout.stages}, segments = {layout.segments}) other "
                             "than by the embedding and the head (tied input/output embeddings, supported); "
                             "its gradient would need a sum across them. Untie it, or use pp = segments = 1")
        owned = {id(p) for k in range(layout.segments) for p in self._placed(k)}
        self._owned_keys = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in owned}
        self.key_order = list(model.state_dict())  # the model's state-dict order, for Pipeline.state_dict()
        self.shapes = _layout(model)[2]  # {key: unsharded shape} of the whole model (before release_unowned)
        # Modules outside the layers whose parameters this rank does not hold (a meta build's other stages'):
        # stood in for while embed computes the ctx.
        self._absent = _outermost(name for name, m in model.named_modules() if any(
            p.is_meta and id(p) not in in_layers for p in m.parameters(recurse=False)))

    def shared_at(self, segments: int) -> Optional[str]:
        """A parameter that `segments` segments would place at two (segment, stage) pairs, or None
        (a tied embedding and head excepted: see the class doc)."""
        return shared_across_placements(self.model, self._layer_params, self._embed_uses, self._head_params,
                                        self.layout.stages, segments)

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
        return next((k for k in range(self.layout.segments)
                     if any(id(p) in ids for p in self.segment_parameters(k))), None)

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
        with _standing_in(self.model, self._absent):
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

    def time_layer(self, shape: torch.Size, dtype: torch.dtype, ctx: object, *,
                   repeats: int = 2) -> tuple[float, float]:
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

    def forward_segment(self, segment: int, x: torch.Tensor, ctx: object, *,
                        offload: Optional[tuple[Offloader, Hashable, list]] = None) -> torch.Tensor:
        """Segment `segment`'s layers of this stage on x [b, t, h] (the embedding's output on virtual stage 0).

        offload = (offloader, group, handles): each layer's input is saved in the offloader under
        `group` (its Checkpoint appended to `handles`, in layer order) instead of being kept by
        torch.utils.checkpoint; backward gets it back (waiting for its copy in), releases it and
        recomputes the layer, as the checkpoint would."""
        for i in self.layout.layers_of(segment):
            if offload is None:
                x = checkpoint(self._layer, i, x, ctx, use_reentrant=False)
            else:  # the anchor makes the output need grad even when x does not (a frozen embedding)
                x = _OffloadedLayer.apply(x, self._anchor, functools.partial(self._layer, i, ctx=ctx), *offload)
        return x

    def loss_sum(self, x: torch.Tensor, targets: torch.Tensor, ctx: object) -> torch.Tensor:
        """Summed token cross-entropy of the head on x [b, t, h] against targets [b, t] (not shifted);
        from the vocabulary slices when the head is vocab-parallel (logits never gathered)."""
        logits = self.stack.head(x, ctx)  # [b, t, vocab] or [b, t, vocab/p]
        if self.logits_group is not None:
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.logits_group,
                                                reduction="sum")
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")

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


class _OffloadedLayer(torch.autograd.Function):
    """y = layer(x) with x kept in an Offloader, recomputed in backward (reentrant-style checkpoint:
    the recomputation's backward accumulates the parameters' .grad and returns x's gradient; the
    CPU random state of the forward is restored for it, as torch.utils.checkpoint does).
    `anchor`: a tensor that requires grad, so the output does even when x does not."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, layer, offloader: Offloader, group: Hashable,
                handles: list) -> torch.Tensor:
        ctx.layer, ctx.offloader, ctx.needs_x = layer, offloader, x.requires_grad
        ctx.rng = torch.get_rng_state()
        ctx.saved = offloader.save(x.detach(), group=group)
        handles.append(ctx.saved)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x = ctx.offloader.get(ctx.saved)
        x = grad_leaf(x) if ctx.needs_x else x.detach()  # (not cached by autocast: oases._leaves)
        ctx.offloader.release(ctx.saved)
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            y = ctx.layer(x)
        torch.autograd.backward(y, grad)
        return (x.grad if ctx.needs_x else None), None, None, None, None, None


class StageInput(torch.autograd.Function):
    """x = StageInput.apply(anchor, received, sink, key): `received` entering the stage's autograd
    graph without becoming a leaf the pipeline must keep (its memory can go with its offloaded
    copy); backward puts its gradient in sink[key]. `anchor`: any tensor requiring grad."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, received: torch.Tensor, sink: dict, key: Hashable) -> torch.Tensor:
        ctx.sink, ctx.key = sink, key
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sink[ctx.key] = grad
        return None, None, None, None


def _owned_modules(model: nn.Module, owned_keys: set[str]) -> Optional[nn.Module]:
    """A module tree holding, at their own qualified names, the largest submodules of `model` whose
    parameters are all in `owned_keys` (their state-dict keys are the model's); None when some owned
    parameter sits in no such submodule (e.g. directly on a module that also holds others')."""
    params = dict(model.named_parameters(remove_duplicate=False))
    whole: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(w + ".") for w in whole):
            continue
        inside = [f"{name}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)]
        if inside and all(k in owned_keys for k in inside):
            whole.append(name)
    covered = {k for k in params if any(k.startswith(w + ".") for w in whole)}
    if not owned_keys <= covered:
        return None
    sharded = {k for k in tp_rules(model) if k in owned_keys}
    if not sharded <= set(tp_rules(_tree(model, whole))):  # a tp_layout() above the owned modules
        return None
    return _tree(model, whole)


def _tree(model: nn.Module, whole: list[str]) -> nn.Module:
    """A module holding model's submodules `whole` at their own qualified names."""
    root = nn.Module()
    for name in whole:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, model.get_submodule(name))
    return root


def check_layers(what: str, layers: int, pp: int, segments: int) -> None:
    """ValueError unless `layers` layers fold into pp stages of `segments` segments."""
    if layers % (pp * segments):
        raise ValueError(f"{what}: {layers} layers are not divisible by pp * segments = {pp} * {segments}")


def placement_of_layer(index: int, layers: int, stages: int, segments: int) -> tuple[int, int]:
    """(segment, stage) holding layer `index` (StageLayout's folding, seen from any stage)."""
    per_segment = layers // segments
    return index // per_segment, (index % per_segment) // (per_segment // stages)


def shared_across_placements(model: nn.Module, layer_params: list[list[nn.Parameter]],
                             embed_params: list[nn.Parameter], head_params: list[nn.Parameter],
                             stages: int, segments: int) -> Optional[str]:
    """The name of a parameter used at two (segment, stage) placements, or None; one that only the
    embedding and the head use (tied input/output embeddings) is allowed.

        place(layer i) = placement_of_layer(i);  place(embedding) = (0, 0);  place(head) = (ns-1, p-1)"""
    places: dict[int, set[tuple[int, int]]] = {}
    for i, params in enumerate(layer_params):
        for p in params:
            places.setdefault(id(p), set()).add(placement_of_layer(i, len(layer_params), stages, segments))
    tied = {id(p) for p in embed_params} & {id(p) for p in head_params}
    for params, place in ((embed_params, (0, 0)), (head_params, (segments - 1, stages - 1))):
        for p in params:
            if id(p) not in tied or id(p) in places:  # (a tied one in a layer too: refused)
                places.setdefault(id(p), set()).add(place)
    names = {id(p): n for n, p in model.named_parameters()}
    return next((names.get(i, "?") for i, where in places.items() if len(where) > 1), None)


def _unique(params) -> list[nn.Parameter]:
    """`params` without repeats (tied parameters once), in first-seen order."""
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _parameters_of(sublayer: object, index: int) -> list[nn.Parameter]:
    if isinstance(sublayer, nn.Module) or callable(getattr(sublayer, "parameters", None)):
        return list(sublayer.parameters())
    raise ValueError(f"model: a sublayer of layer {index} ({type(sublayer).__name__}) is not an nn.Module and has "
                     "no parameters() method; the pipeline needs each sublayer's parameters to place them")


def _used_by(out: torch.Tensor, params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The trainable parameters among `params` that `out` depends on (differentiated once)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable or not out.requires_grad:
        return []
    grads = torch.autograd.grad(out.float().sum(), trainable, allow_unused=True)
    return [p for p, g in zip(trainable, grads) if g is not None]


class _StandIn(nn.Module):
    """Stands in for a module whose parameters this rank does not hold while a stage computes its
    ctx: an embedding (a module with an int `embedding_dim`) gives zeros [*ids.shape, dim], any
    other module returns its first input."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        dim = getattr(module, "embedding_dim", None)
        self.dim = dim if isinstance(dim, int) else None
        self.out_dtype = next(module.parameters()).dtype

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.dim is None:
            return x
        return torch.zeros((*x.shape, self.dim), dtype=self.out_dtype, device=x.device)


@contextlib.contextmanager
def _standing_in(model: nn.Module, names: list[str]) -> Iterator[None]:
    """model's submodules `names` replaced by _StandIns for the block (restored after)."""
    saved = []
    try:
        for name in names:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent)
            saved.append((owner, leaf, getattr(owner, leaf)))
            setattr(owner, leaf, _StandIn(saved[-1][2]))
        yield
    finally:
        for owner, leaf, module in reversed(saved):
            setattr(owner, leaf, module)


def _outermost(names: Iterable[str]) -> list[str]:
    """`names` (qualified module names, in named_modules order) without those inside another one."""
    kept: list[str] = []
    for name in names:
        if not any(name == k or name.startswith(k + ".") for k in kept):
            kept.append(name)
    return kept
