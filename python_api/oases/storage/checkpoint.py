"""On-disk checkpoints: `save_checkpoint` and `load_checkpoint` (oases.storage's module doc), each
rank writing and reading its own shards through oases.storage.dcp; and the steps every saver and
loader shares (the Pipeline's too): `save_target`, `check_load_options`, `write_checkpoint`."""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases.comm.topology import Ring, ring_of
from oases.storage import dcp, publish
from oases.storage.choose import choose_checkpoint, wants_of
from oases.storage.entries import (
    model_entries,
    restore_rng,
    run_entries,
    run_reads,
    stored_model,
    warn_rng_not_restored,
)
from oases.storage.keys import EXTRA, FORMAT_KEY, FORMAT_VERSION, GROUPS, MODEL
from oases.storage.optimizer import (
    OptimizerView,
    check_groups,
    optimizer_entries,
    optimizer_reads,
    optimizer_view,
    restore_optimizer,
)
from oases.storage.unsharded import Shard, allocated, check_fit, layout_of

__all__ = [
    "CheckpointState",
    "check_count",
    "save_target",
    "check_load_options",
    "write_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
]


@dataclass(frozen=True)
class CheckpointState:
    """What `load_checkpoint` restored besides tensors, and which model keys did not match.

    ::

        step, extra:      what save_checkpoint was given (None for a checkpoint of older Oases)
        path:             the checkpoint directory loaded (a root resolves to its newest step-*)
        missing_keys:     model keys the checkpoint lacks, left as they were (strict=False only)
        unexpected_keys:  checkpoint keys the model lacks, not read (strict=False only)
    """

    step: Optional[int]
    extra: Any
    path: str
    missing_keys: list[str]
    unexpected_keys: list[str]


def check_count(name: str, value: object, least: int) -> None:
    """TypeError unless `value` is an int, ValueError unless it is >= `least` (the argument `name`)."""
    if not _checks.is_int(value):
        raise TypeError(f"{name}: expected an int >= {least} or None, got {value!r}")
    if value < least:
        raise ValueError(f"{name}: must be >= {least}, got {value}")


def save_target(path: Union[str, os.PathLike], step: object, keep: object, extra: object) -> str:
    """Where a checkpoint of `step` under `path` is published, after the local checks of the
    arguments every saver shares (step, keep, extra picklable)."""
    if step is not None:
        check_count("step", step, 0)
    if keep is not None:
        check_count("keep", keep, 1)
        if step is None:
            raise ValueError("keep: rotation needs step= (it keeps the newest path/step-* checkpoints)")
    try:
        torch.save(extra, io.BytesIO())
    except Exception as e:
        raise TypeError(f"extra: cannot be pickled ({type(e).__name__}: {e}); pass plain data") from e
    root = os.path.normpath(os.fspath(path))
    return root if step is None else publish.step_dir(root, step)


def check_load_options(step: object, verify: object, trusted: object) -> None:
    """The local checks of the arguments every loader shares: step (an int >= 0 or None), verify and trusted (bools)."""
    if step is not None:
        check_count("step", step, 0)
    if not isinstance(verify, bool):
        raise TypeError(f"verify: expected a bool, got {verify!r}")
    if not isinstance(trusted, bool):
        raise TypeError(f"trusted: expected a bool, got {trusted!r}")


def write_checkpoint(
    entries: dict[str, Any],
    where: str,
    ring: Ring,
    *,
    step: Optional[int],
    keep: Optional[int],
    extra: Any,
    optimizer: bool,
) -> None:
    """Publish `entries` (model and optimizer) with the run's (format, extra, this rank's RNG) at
    `where` (oases.storage.publish.save: atomic, durable, keep=N rotates); a collective over `ring`.
    `optimizer`: whether the entries hold an optimizer's state (recorded in the marker)."""
    entries = {**entries, **run_entries(extra, ring.rank)}
    marker = {"format": FORMAT_VERSION, "world_size": ring.size, "step": step, "optimizer": optimizer}
    publish.save(entries, where, ring, marker, keep)


def save_checkpoint(
    model: nn.Module,
    path: Union[str, os.PathLike],
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    step: Optional[int] = None,
    extra: Any = None,
    keep: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> str:
    """Write model (and optimizer) state, step, `extra` and RNG states; return the directory published.

    ::

        where = path if step is None else path/step-{step:09d}
        dcp.save({"model.<key>": each rank's shards as boxes of the unsharded tensor | replicated tensor,
                  "optim.state.<param name>.<state>": likewise (shard-shaped state is sharded),
                  "optim.master.<param name>": a ZeroOptimizer's fp32 masters of 16-bit parameters (rows),
                  "optim.param_groups": param_groups with parameter names,
                  "oases.extra": extra, "oases.rng.<rank>": this rank's RNG states}, .<where>.partial)
        every rank: crc32 of the files it wrote, whole and per stored item (offset, length)
        rank 0: write oases_checkpoint.json (format, world size, step, every file's size and
                checksums), fsync the directory, rename it to `where`, fsync the parent
        keep=N: delete all but the N newest (highest step) sound path/step-* (published, every
                file at its size: damaged ones are neither counted nor deleted), never `where`, and
                stale partials; fsync the parent

    A collective over `group` (default: the world; ranks holding replicas of the model, at any TP
    degrees inside it): no rank gathers the model; each writes its own shards, a replicated entry
    or a shard held by several replicas is written once. The stored tensors have the unsharded
    model's shapes, so `load_checkpoint` reads them at any TP degree. `path` must be a directory
    every rank sees; saving replaces a checkpoint already at `where`, never other files. Once it
    returns, the step survives a machine crash (files, marker and directory entries fsynced).
    The checksums cost a read-back of each rank's own files (from the page cache) and crc32 of
    them, whole and by item: ~0.11 s per 100 MiB a rank wrote, 14% of a save whose file fsyncs
    take 39% (`python -m bench checkpoint`; the models guide).

    Args:
        model: the model, plain or tensor-parallel (its shards are written as boxes of the unsharded tensors).
        path: the checkpoint directory, or with step the root of its step-* directories.
        optimizer: a torch.optim optimizer over the model's parameters whose state of a sharded
            parameter is shaped like it or scalar (not Adafactor's factored state: a ValueError).
        step: the training step (an int >= 0) or None.
        extra: anything picklable (e.g. {"data": position}), returned by load_checkpoint; one value
            is stored (the same on every rank: a per-rank position belongs in a list indexed by rank).
        keep: with step, the number of newest step-* checkpoints to keep (>= 1).
        group: the ranks that call it (default None: the world).
    Returns:
        The published checkpoint directory.
    """
    ring = ring_of(group)
    model = allocated(model)  # torch.compile(model): the original's keys
    where = save_target(path, step, keep, extra)
    _, shards, _ = layout_of(model)
    entries = model_entries(model.state_dict(), shards)
    if optimizer is not None:
        entries.update(optimizer_entries(optimizer_view(model, optimizer), shards))
    publish.check_target(where)  # every check above and here is local: no rank is left waiting
    write_checkpoint(entries, where, ring, step=step, keep=keep, extra=extra, optimizer=optimizer is not None)
    return where


def _prepare(
    model: nn.Module,
    shards: dict[str, Shard],
    expected: dict[str, torch.Size],
    view: Optional[OptimizerView],
    ring: Ring,
    strict: bool,
    where: str,
    stored: dict,
    marker: Optional[dict],
) -> tuple[Any, dict, dict]:
    """load_checkpoint's local checks against the checkpoint at `where`, and what this rank reads
    from it (oases.storage.choose's `Prepare`, the first six arguments bound)."""
    what = f"checkpoint {where!r}"
    ours = FORMAT_KEY in stored  # else one of older Oases: the model's keys at the top level, nothing else
    held = stored_model(what, stored, expected)
    check_fit(what, expected, {key: getattr(meta, "size", ()) for key, meta in held.items()}, shards, strict)
    small, rng = run_reads(stored, marker, ring) if ours else ({}, None)  # pickled: read by this rank alone first
    slots, reads = {}, {}
    if view is not None:
        if not ours:
            raise ValueError(
                f"optimizer: {what} was written by an older oases.save_checkpoint and holds no "
                f"optimizer state; load it with optimizer=None"
            )
        slots, reads = optimizer_reads(what, view, stored, shards)
        small.update({key: None for key, value in reads.items() if value is None})
        small[GROUPS] = None
    local = model.state_dict()  # detached views of the model's own tensors: reads land in them
    entries = model_entries({key: local[key] for key in expected if key in held}, shards, prefix=MODEL if ours else "")
    entries.update({key: value for key, value in reads.items() if value is not None})
    return (held, rng, slots, reads, entries), small, {**wants_of(entries), **dict.fromkeys(small)}


def load_checkpoint(
    model: nn.Module,
    path: Union[str, os.PathLike],
    *,
    optimizer: Optional[torch.optim.Optimizer] = None,
    strict: bool = True,
    group: Optional[dist.ProcessGroup] = None,
    step: Optional[int] = None,
    verify: bool = True,
    trusted: bool = True,
) -> CheckpointState:
    """Load a `save_checkpoint` directory (or the newest step-* under a root that verifies) at any TP degree.

    ::

        where = path if path holds a checkpoint, path/step-{step:09d} with step=, else the newest
                path/step-* that verifies on every rank (newer ones skipped: one warning on rank 0)
        verify where (every rank, what it reads): its files' sizes; with verify, the checksums of
            .metadata and of every stored item this rank reads; all ranks agree (oases.storage.choose)
        trusted=False: no pickle is run (.metadata: DCP's records only; entries: weights_only)
        check the checkpoint against the model (keys if strict, shapes) and the optimizer   # local only
        dcp.load: each rank reads the boxes of its own shards, straight into the model's tensors
        optimizer.load_state_dict(the saved state, re-sharded to this layout, keyed by its indices)
        ZeroOptimizer: fp32 masters read as its rows (those not saved: refilled from the parameters)
        restore this rank's RNG states if the group has as many ranks as the one that saved
        return CheckpointState(step, extra, where, missing_keys, unexpected_keys)

    A collective over `group` (default: the world), like `save_checkpoint`. Every check runs
    before any byte is read into the model, and its verdict is shared, so a bad model, optimizer
    or checkpoint raises the same error on every rank and changes nothing. A damaged checkpoint
    (a file missing, cut short, corrupted, or another's mixed in) named by `path` or `step` raises
    a ValueError naming the file and what is wrong; under a root it is skipped for the next older
    one. Tensors are cast to the model's dtype on copy; the optimizer's state follows torch's
    load_state_dict rules (cast, moved to its parameter's device), its hyper-parameters (lr, ...)
    are the checkpoint's. Checkpoints of older Oases (the unsharded model's state dict at the top
    level) load too, without optimizer and unverified (they record no checksums).

    Args:
        model: the model to fill, plain or tensor-parallel at any TP degree.
        path: a `save_checkpoint` directory, or a root whose newest step-* that verifies is loaded.
        optimizer: an optimizer over the model's parameters, grouped as the saved one was.
        strict: if False, keys on one side only are skipped and listed in the result.
        group: the ranks that call it (default None: the world).
        step: with a root `path`, load exactly path/step-{step:09d}, or raise naming what is wrong.
        verify: False skips the checksums (sizes are still checked), saving a read and a crc32
            of what each rank reads: a third of a load from the page cache (`bench checkpoint`).
        trusted: True reads the checkpoint's pickles (DCP's `.metadata`, `extra`, RNG states, the
            optimizer's hyper-parameters) with pickle, which can run code: load only checkpoints you
            trust. False runs none: `.metadata` is read naming only DCP's metadata records, every
            other entry with torch.load(weights_only=True) (tensors, numbers, strings, None, and
            lists, tuples and dicts of them); an entry needing more raises a ValueError naming it.
    Returns:
        CheckpointState(step, extra, path, missing_keys, unexpected_keys).
    """
    ring = ring_of(group)
    model = allocated(model)  # torch.compile(model): the original's keys
    check_load_options(step, verify, trusted)
    _, shards, expected = layout_of(model)
    view = optimizer_view(model, optimizer) if optimizer is not None else None
    prepare = functools.partial(_prepare, model, shards, expected, view, ring, strict)
    where, stored, marker, prepared, small = choose_checkpoint(
        os.path.normpath(os.fspath(path)), step, ring, verify, prepare, trusted
    )
    held, rng, slots, reads, entries = prepared
    what = f"checkpoint {where!r}"
    ours = FORMAT_KEY in stored
    if ours and rng is None:
        warn_rng_not_restored(what, marker, ring.size)
    if view is not None:
        check_groups(what, view.names, small[GROUPS])
    dcp.load(entries, where, ring, trusted)  # the one collective that moves data
    if view is not None:
        values = {key: small[key] if value is None else value for key, value in reads.items()}
        restore_optimizer(view, slots, values, small[GROUPS])  # ZeroOptimizer: and its fp32 masters
    if rng is not None:
        restore_rng(what, small[rng])
    return CheckpointState(
        step=marker["step"] if ours else None,
        extra=small.get(EXTRA),
        path=where,
        missing_keys=[key for key in expected if key not in held],
        unexpected_keys=[key for key in held if key not in expected],
    )
