"""A Pipeline's weights and checkpoints on disk: each rank reads and writes only what its stage holds.

    pipe.load_pretrained(dir)                        # every rank checks the whole model, reads its own boxes
    pipe.save_pretrained(dir)                        # rank 0 writes; each tensor's stage gathers it over tp, sends it
    pipe.save_checkpoint(root, step=n, extra=..., keep=2)   # -> root/step-{n:09d}
    state = pipe.load_checkpoint(root)               # the newest step-* that verifies; CheckpointState

What a rank holds (`_held`): the whole model while every tensor is allocated (a real build before
release_unowned), else the modules its stage owns whole (Stage.held(); the meta build and
release_unowned make sure there are such) and every persistent buffer. Its stage's keys: the
parameters the stage places, and the buffers.

Checkpoints are oases.save_checkpoint's (oases.storage), the same entries as a TP model's:

    model.<key>                       the unsharded tensor; each rank writes the boxes of its stage's
                                      shards (DP / TP replicas and buffers written once)
    optim.state.<param name>.<state>  each segment optimizer's state, by parameter name (a parameter
                                      is trained by one segment of one stage, but for the copies of a
                                      tied embedding / head on the first and last stage: identical,
                                      so the first stage writes them and both read them)
    optim.param_groups                the segment optimizers' groups merged: group g has their
                                      hyper-parameters (which must agree) and every stage's and
                                      segment's parameter names of group g
    oases.extra, oases.rng.<rank>     as oases.save_checkpoint

so `oases.load_checkpoint` loads a pipeline's checkpoint into a TP model (one optimizer over its
parameters), and `load_checkpoint` here one that oases.save_checkpoint or a Pipeline of any pp, dp
and tp wrote. Every check of a load runs on local metadata, the same on every rank, before any
collective; pending updates are applied before saving or loading (`apply_pending`: the
Pipeline's). Each function takes the Pipeline and reads its public attributes only.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.nn.modules.module import _IncompatibleKeys

from oases.comm.topology import Ring, ring_of
from oases.nn.materialize import is_on_meta
from oases.pipeline.p2p import mesh_grid
from oases.storage import dcp
from oases.storage.checkpoint import CheckpointState, check_load_options, save_target, write_checkpoint
from oases.storage.choose import choose_checkpoint, wants_of
from oases.storage.entries import model_entries, restore_rng, run_reads, stored_model, warn_rng_not_restored
from oases.storage.hf_files import stored_tensors
from oases.storage.hf_write import TensorEntry, check_dtypes, check_save, gather_to, split_files, write_files
from oases.storage.keys import EXTRA, FORMAT_KEY, GROUPS
from oases.storage.optimizer import (
    optimizer_entries,
    optimizer_reads,
    optimizer_view,
    optimizer_wants,
    restore_optimizer,
)
from oases.storage.pretrained import match_stored, read_into
from oases.storage.publish import check_target
from oases.storage.unsharded import check_fit, shards_of

if TYPE_CHECKING:
    from oases.pipeline.pipeline import Pipeline

__all__ = ["load_pretrained", "save_pretrained", "save_checkpoint", "load_checkpoint"]

Path = Union[str, os.PathLike]


def _held(pipe: "Pipeline") -> nn.Module:
    """This rank's allocated part of the model, as a module whose state-dict keys are the model's."""
    model = pipe.model
    if pipe.freed_bytes == 0 and not is_on_meta(model):
        return model
    held = pipe.stage.held()
    if held is None:  # release_unowned frees nothing then, and the meta build refuses such a model
        raise RuntimeError("pipeline: no module tree holds this stage's parameters (a bug)")
    present = set(held.state_dict(keep_vars=True))
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in present and not isinstance(value, nn.Parameter):  # a buffer outside the owned modules
            *path, leaf = key.split(".")
            parent = held
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]
            if type(parent) is not nn.Module:  # (an owned module's buffers are in its state dict already)
                raise RuntimeError(f"pipeline: buffer {key} is in an owned module but not in its state dict (a bug)")
            parent.register_buffer(leaf, value)
    return held


def _stage_keys(pipe: "Pipeline") -> set[str]:
    """The state-dict keys this stage reads and writes: its placed parameters, and every buffer."""
    params = {n for n, _ in pipe.model.named_parameters(remove_duplicate=False)}
    return set(pipe.stage.owned_keys) | {k for k in pipe.stage.key_order if k not in params}


def _stage_state(pipe: "Pipeline", held: nn.Module, skip: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """The entries of `held`'s state dict (detached views of this rank's tensors) that this stage
    reads and writes (`_stage_keys`), but those in `skip`."""
    keys = _stage_keys(pipe)
    return {key: value for key, value in held.state_dict().items() if key in keys and key not in skip}


# --- Hugging Face safetensors ---------------------------------------------------------------------


def load_pretrained(
    pipe: "Pipeline", path: Path, *, strict: bool = True, apply_pending: Callable[[], None]
) -> tuple[list[str], list[str]]:
    """Fill what this rank holds from a Hugging Face checkpoint (oases.load_pretrained's format).

        stored = {key: shape} from the files' headers
        check the WHOLE model's keys (if strict) and unsharded shapes against it   # every rank alike
        apply pending updates (a collective over dp, only if one is pending)
        load_pretrained of _held(pipe), keyed as the whole model maps the file   # its boxes
        zero: each optimizer's fp32 masters of 16-bit parameters start from the loaded values

    Returns the whole model's (missing_keys, unexpected_keys). Raises FileNotFoundError /
    ValueError before anything is read, on every rank alike."""
    path = os.fspath(path)
    expected = pipe.stage.shapes  # {key: unsharded shape} of the whole model
    stored = stored_tensors(path, pipe.model)
    _, given = match_stored(pipe.model, expected, stored)  # a tied tensor is stored under one of its keys
    check_fit(f"safetensors checkpoint {path!r}", expected, given, {}, strict)
    apply_pending()
    read_into(_held(pipe), path, stored, strict=False)  # keyed by the whole model's mapping
    if pipe.zero:
        for optimizer in pipe.optimizers:
            optimizer.sync_masters()
    return _IncompatibleKeys([k for k in expected if k not in given], [k for k in stored if k not in expected])


def _to_writer(entry: TensorEntry, owner: int, writer: int, me: int, device: torch.device) -> Optional[torch.Tensor]:
    """The full tensor on `writer` (None elsewhere): gathered over tp to `owner` (the rank of its
    stage's first dp replica and tp rank 0), then sent to the writer if it is another rank."""
    if entry.shard is None:  # replicated, or not held here (no shard of it on this rank)
        full = entry.local if me == owner else None
    else:
        full = gather_to(entry, owner, me)  # over the owner's tp group; None on every other rank
    if owner == writer or me not in (owner, writer):
        return full
    if me == owner:
        dist.send(full.contiguous(), dst=writer)
        return None
    full = torch.empty(entry.shape, dtype=entry.local.dtype, device=device)
    dist.recv(full, src=owner)
    return full


def save_pretrained(
    pipe: "Pipeline", path: Path, *, max_shard_size: int = 5 * 2**30, apply_pending: Callable[[], None]
) -> None:
    """Write the unsharded model as a Hugging Face directory (oases.save_pretrained's files).

        writer = the mesh's rank (dp 0, pp 0, tp 0); apply pending updates
        for entry in the model's state dict (each tensor once), in order, files cut every max_shard_size:
            owner = (dp 0, its stage, tp 0): its tp group gathers the full tensor to it
            owner sends it to the writer, which appends its bytes     # one full tensor in memory at a time
        barrier

    A collective over the mesh. Raises before any communication, on every rank alike, as
    oases.save_pretrained does (path a file, max_shard_size, dtype, config)."""
    model = pipe.model
    path = check_save(path, max_shard_size, model)
    check_dtypes("save_pretrained", model.state_dict().items())
    apply_pending()
    held = _held(pipe)
    shards, local = shards_of(held), held.state_dict(keep_vars=True)
    entries, seen = [], set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # a tied tensor once, under its first key
            seen.add(id(tensor))
            entries.append(TensorEntry(key, local.get(key, tensor).detach(), shards.get(key), pipe.stage.shapes[key]))
    grid = mesh_grid(pipe.mesh)  # [dp, pp, tp] global ranks
    stage_of = pipe.stage.stage_of()  # buffers: stage 0's (every stage holds them)
    writer, me = int(grid[0, 0, 0]), dist.get_rank()

    def full_of(entry: TensorEntry) -> Optional[torch.Tensor]:
        owner = int(grid[0, stage_of.get(entry.key, 0), 0])
        return _to_writer(entry, owner, writer, me, pipe.comm.device)

    write_files(model, path, entries, split_files(entries, max_shard_size), writer, me, full_of)


# --- checkpoints ----------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _merged_groups(pipe: "Pipeline", mine: list[list[dict]]) -> list[dict]:
    """Every stage's segment optimizers' param_groups (params as names) merged by group index, the
    names in the model's order. A collective over pp; the same on every rank (or the same ValueError)."""
    parts: list[Optional[list[list[dict]]]] = [None] * pipe.pp
    if pipe.pp > 1:  # tensor hyper-parameters pickled on the CPU (a CUDA one unpickles onto its sender's GPU)
        host = [[{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in g.items()} for g in gs] for gs in mine]
        dist.all_gather_object(parts, host, group=pipe.pp_group)
    else:
        parts[0] = mine
    optimizers = [groups for part in parts for groups in part]
    first = optimizers[0]
    for groups in optimizers:
        same = len(groups) == len(first) and all(
            g.keys() == f.keys() and all(_same(g[k], f[k]) for k in g if k != "params") for g, f in zip(groups, first)
        )
        if not same:
            raise ValueError(
                "save_checkpoint: the segment optimizers' param_groups differ (in number or in "
                "hyper-parameters); a checkpoint stores one optimizer's groups, so every segment's "
                "optimizer must have the same groups"
            )
    order = {name: i for i, (name, _) in enumerate(pipe.model.named_parameters())}
    return [
        dict(group, params=sorted({n for groups in optimizers for n in groups[g]["params"]}, key=order.__getitem__))
        for g, group in enumerate(first)
    ]


def save_checkpoint(
    pipe: "Pipeline",
    path: Path,
    *,
    step: Optional[int] = None,
    extra: Any = None,
    keep: Optional[int] = None,
    apply_pending: Callable[[], None],
) -> str:
    """oases.save_checkpoint of the pipeline (see the module doc for the entries); returns the
    directory published (path, or path/step-{step:09d}). A collective over the mesh; argument
    errors are raised on every rank before any communication."""
    ring = ring_of(None)
    where = save_target(path, step, keep, extra)
    check_target(where)  # every check above and here is local
    apply_pending()
    held = _held(pipe)
    shards = shards_of(held)
    copies = pipe.stage.tied_keys if pipe.layout.stage > 0 else frozenset()  # the first stage writes a tied one
    entries = model_entries(_stage_state(pipe, held, copies), shards)
    groups = []
    for optimizer in pipe.optimizers:
        own = optimizer_entries(optimizer_view(pipe.model, optimizer), shards, skip=copies)
        groups.append(own.pop(GROUPS))
        entries.update(own)
    entries[GROUPS] = _merged_groups(pipe, groups)
    write_checkpoint(entries, where, ring, step=step, keep=keep, extra=extra, optimizer=True)
    return where


def _group_problem(views: list, saved: list[dict]) -> Optional[str]:
    """Why the segment optimizers do not fit the checkpoint's param_groups, or None."""
    for k, view in enumerate(views):
        if len(view.names) != len(saved):
            return (
                f"optimizer of segment {k}: has {len(view.names)} param_groups, the checkpoint has {len(saved)}; "
                f"build it as the saved one was"
            )
        for g, (names, group) in enumerate(zip(view.names, saved)):
            lacking = [n for n in names if n not in set(group["params"])]
            if lacking:
                return (
                    f"optimizer of segment {k}: param_groups[{g}] holds {lacking}, which the checkpoint's "
                    f"param_groups[{g}] does not; build the optimizers as the saved ones were"
                )
    return None


def _prepare(
    pipe: "Pipeline", ring: Ring, where: str, stored: dict, marker: Optional[dict]
) -> tuple[tuple, dict, dict]:
    """load_checkpoint's local checks against the checkpoint at `where`, and what this rank reads
    from it (oases.storage.choose's `Prepare`, `pipe` and `ring` bound)."""
    what = f"checkpoint {where!r}"
    views = [optimizer_view(pipe.model, optimizer) for optimizer in pipe.optimizers]
    if FORMAT_KEY not in stored:
        raise ValueError(
            f"{what}: written by an older oases.save_checkpoint (no optimizer state); load it into a "
            f"model with oases.load_checkpoint"
        )
    held_meta = stored_model(what, stored)
    check_fit(what, pipe.stage.shapes, {key: meta.size for key, meta in held_meta.items()}, {}, True)
    if GROUPS not in stored:
        raise ValueError(
            f"{what}: holds no optimizer state (saved without optimizer=); the pipeline's optimizers need it"
        )
    small, rng = run_reads(stored, marker, ring)
    small[GROUPS] = None
    held = _held(pipe)  # views of this rank's tensors, for the boxes it reads (nothing is read here)
    shards = shards_of(held)
    wants = wants_of(model_entries(_stage_state(pipe, held), shards))
    for view in views:
        own = optimizer_wants(what, view, stored, shards)
        wants.update(own)
        small.update((key, None) for key in own if not isinstance(stored[key], TensorStorageMetadata))  # pickled
    return (rng, views), small, {**wants, **dict.fromkeys(small)}


def load_checkpoint(
    pipe: "Pipeline",
    path: Path,
    *,
    step: Optional[int] = None,
    verify: bool = True,
    trusted: bool = True,
    apply_pending: Callable[[], None],
    auto_segments: bool,
) -> CheckpointState:
    """Load a checkpoint of this model into what this rank holds and its segment optimizers.

        where = path if it is a checkpoint, path/step-{step:09d} with step=, else the newest
                path/step-* that verifies on every rank (as oases.load_checkpoint: sizes, and with
                verify the checksums of what each rank reads; newer ones skipped with a warning)
        check: written by this format, the WHOLE model's keys and unsharded shapes, optimizer state
               present (local, every rank alike, agreed with the verification); the segment
               optimizers' groups (agreed over the mesh)
        apply pending updates; dcp.load: each rank reads the boxes of its stage's tensors and states
        each segment optimizer: load_state_dict(its states, the saved groups' hyper-parameters)
        restore this rank's RNG states if the mesh has as many ranks as the one that saved

    A collective over the mesh. Returns CheckpointState(step, extra, path, [], [])."""
    ring = ring_of(None)
    if auto_segments:
        raise ValueError(
            "load_checkpoint: segments='auto' is chosen at the first train_step, which rebuilds the "
            "optimizers; pass segments=N to resume"
        )
    check_load_options(step, verify, trusted)
    where, stored, marker, (rng, views), small = choose_checkpoint(
        os.path.normpath(os.fspath(path)), step, ring, verify, functools.partial(_prepare, pipe, ring), trusted
    )
    what = f"checkpoint {where!r}"
    if rng is None:
        warn_rng_not_restored(what, marker, ring.size)
    problems: list[Optional[str]] = [None] * ring.size
    dist.all_gather_object(problems, _group_problem(views, small[GROUPS]))  # every rank raises alike
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")

    apply_pending()
    held = _held(pipe)
    shards = shards_of(held)
    entries = model_entries(_stage_state(pipe, held), shards)  # views of the model's own tensors: reads land in them
    reads = [optimizer_reads(what, view, stored, shards) for view in views]
    for _, own in reads:
        entries.update((key, value) for key, value in own.items() if value is not None)
    dcp.load(entries, where, ring, trusted)  # the one collective that moves data
    for view, (slots, own) in zip(views, reads):
        values = {key: small[key] if value is None else value for key, value in own.items()}  # pickled: read already
        restore_optimizer(view, slots, values, small[GROUPS])
    if rng is not None:
        restore_rng(what, small[rng])
    return CheckpointState(step=marker["step"], extra=small[EXTRA], path=where, missing_keys=[], unexpected_keys=[])
