"""How every rank of a Pipeline makes its model: a GPT, a factory's model, or a factory's meta build.

    GPTConfig          GPT(config, tp_group, seed=seed)                       # every tensor allocated
    factory, real      torch.manual_seed(seed); model = factory(); parallelize(model, tp_group)
    factory, on meta   torch.manual_seed(seed); model = factory()             # no memory, no draws
                       roles = meta_roles(model)                              # embedding / head, by name
                       placed = names Stage(model, layout, roles) places      # this stage's only
                       parallelize(model, tp_group, device=device, init_weights=init_weights,
                                   allocate=lambda name: name in placed or name is a buffer)

A meta build allocates this stage's layers, the embedding only on the stage that runs it and the
head (final norm, LM head) only on the last; every buffer everywhere (rotary tables, for the ctx).
The other tensors stay on meta; `Stage.embed` stands in for their modules while it computes the
ctx. init_weights=True replays the single-process build's values (oases.nn.materialize: the
factory's model built on the CPU under the same seed); False leaves them uninitialised for
`Pipeline.load_pretrained` / `load_checkpoint` to fill.

Which parameters are the embedding's and the head's cannot be found by running them on meta (a
Hugging Face model's mask code reads values), so for a Hugging Face model it is read from its
structure (`HFStack`: head = final norm + output embeddings, embedding = input embeddings), and
for any other model found by the Stage's one-token probe run on a meta copy (every parameter
made trainable there, so frozen ones are placed where they are used).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.models.gpt import GPT, GPTConfig
from oases.models.hf import HFStack
from oases.models.nanogpt import NanoGPTStack
from oases.nn.materialize import is_on_meta, materialize
from oases.nn.parallelism import parallelism_of
from oases.nn.parallelize import parallelize
from oases.pipeline._config import Settings
from oases.pipeline.stages import Roles, Stage, StageLayout, _owned_modules, check_layers, probe_roles
from oases.training import adapt

__all__ = ["build", "meta_roles"]


def build(
    settings: Settings, tp_group: dist.ProcessGroup, *, device: torch.device, stage: int
) -> tuple[nn.Module, object, Optional[Roles]]:
    """(model, its Stack view, its Roles when built on meta else None) of the pipeline's `settings` (the
    config or factory, seed, init_weights, segments, the mesh's tp and pp), for pipeline stage `stage` (see
    the module doc). Local: no communication, so every error is raised on every rank alike."""
    config, seed, init_weights, segments = settings.config, settings.seed, settings.init_weights, settings.segments
    tp, pp = settings.sizes["tp"], settings.sizes["pp"]
    if isinstance(config, GPTConfig):
        if not init_weights:
            raise ValueError("init_weights=False: only for a factory that builds the model on the meta device")
        model = GPT(config, tp_group, seed=seed)
        return model, model, None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = config()
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"config: the factory returned {type(model).__name__}, expected an nn.Module "
                "(a Hugging Face causal LM, a nanoGPT-style model or an oases.schedule.Stack module)"
            )
        made = parallelism_of(model)
        if made is not None and made.tp_degrees is not None:
            raise ValueError(
                "config: the factory's model has per-layer tp_degrees; the pipeline runs every layer "
                "of a stage on the mesh's tp group (build the model without tp_degrees)"
            )
        sharded = any(hasattr(m, "tp_layout") for m in model.modules())
        roles = None
        if is_on_meta(model):  # the replay draws from this seed's random state, as factory() on the CPU would
            roles = _allocate_stage(
                model, adapt(model), tp_group, tp, device, init_weights, sharded, pp, segments, stage
            )
        elif not init_weights:
            raise ValueError(
                "init_weights=False: only for a factory that builds the model on the meta device "
                "(`with torch.device('meta'): return Cls(config)`); this one has real tensors"
            )
        elif tp > 1 and not sharded:
            parallelize(model, tp_group)
    stack = adapt(model)
    if isinstance(stack, (HFStack, NanoGPTStack)):  # dropout: masks from the step seed (Pipeline.train_step)
        stack.check_trainable(seeded=True)  # a router's jitter noise or sampled experts still refused
    elif callable(getattr(stack, "check_trainable", None)):
        stack.check_trainable()
    return model, stack, roles


def meta_roles(model: nn.Module, stack: object) -> Roles:
    """The Roles of a model built on meta, before anything is allocated (see the module doc)."""
    if isinstance(stack, HFStack):
        embedding = stack.base.get_input_embeddings()
        head = {id(p) for m in (stack.final_norm, stack.lm_head) for p in m.parameters()}
        embed = {id(p) for p in embedding.parameters()}
        named = [(n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)]
        return Roles(
            frozenset(n for n, i in named if i in head),
            frozenset(n for n, i in named if i in embed),
            embedding.embedding_dim,
            embedding.weight.dtype,
            stack.lm_head.weight.shape[0],
        )
    probe = copy.deepcopy(model)  # meta: costs nothing; every parameter trainable, so all are found
    for p in probe.parameters():
        p.requires_grad_(True)
    probe_stack = adapt(probe)
    in_layers = {id(p) for layer in probe_stack.layers() for sub in layer for p in sub.parameters()}
    rest = [p for p in probe.parameters() if id(p) not in in_layers]
    try:
        return probe_roles(probe, probe_stack, rest, torch.device("meta"))
    except Exception as err:  # noqa: BLE001 -- re-raised with what to do
        raise ValueError(
            f"model: built on the meta device, and the pipeline cannot tell its embedding's parameters "
            f"from its head's without running them ({type(err).__name__}: {err}); build it on a real "
            f"device, or make it an oases.schedule.Stack whose embed and head run on meta"
        ) from err


def _allocate_stage(
    model: nn.Module,
    stack: object,
    tp_group: dist.ProcessGroup,
    tp: int,
    device: torch.device,
    init_weights: bool,
    sharded: bool,
    pp: int,
    segments: int | str,
    stage: int,
) -> Roles:
    """Allocate (and with init_weights, initialise) only what stage `stage` places; return the Roles."""
    if segments == "auto":
        raise ValueError(
            "segments='auto': a model built on meta allocates only its stage's layers, which depend "
            "on the segment count; pass segments=N"
        )
    if sharded:
        raise ValueError(
            "config: the factory's model is built on meta and already sharded; return the unsharded "
            "model, the pipeline shards it over the mesh's tp group"
        )
    layers = len(stack.layers())
    check_layers("model", layers, pp, segments)
    roles = meta_roles(model, stack)
    placed = Stage(model, stack, StageLayout(layers, pp, segments, stage), tp_group, roles=roles)  # refuses ties
    if _owned_modules(model, placed.owned_keys) is None:
        raise ValueError(
            "model: built on meta, and some parameter of this stage sits on a module that also holds "
            "another stage's; the pipeline allocates whole modules (build it on a real device)"
        )
    keep = placed.owned_keys | {n for n, _ in model.named_buffers(remove_duplicate=False)}
    if tp > 1:
        parallelize(model, tp_group, device=device, init_weights=init_weights, allocate=keep.__contains__)
    else:
        materialize(model, copy.deepcopy(model), device, init_weights, keep.__contains__)
    return roles
