"""Writing a Hugging Face directory (oases.storage.pretrained's format), one tensor at a time:

    entries = tensor_entries(model)               # each tensor once, with its shard and full shape
    write_files(model, path, entries, split_files(entries, max_shard_size), writer, me, full_of)
        writer: prepare_dir(path); for each file: stream_tensors(.<file>.partial, its entries, full_of)
                (its safetensors header, then each full tensor's bytes: full_of(entry), gathered by
                `gather_to` or the caller's way); the index; each .partial fsynced and renamed over
                its name, the config staged (`staged`), the directory's entries fsynced
        every rank: the writer's error, if any (`on_writer`)

Only the writer holds a full tensor, one at a time; a save that dies while streaming leaves the
previous save whole (its new files are hidden .partial ones).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import struct
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases.comm.topology import ring_of
from oases.storage.hf_files import DTYPES, INDEX, SINGLE
from oases.storage.integrity import fsync_dir, fsync_file
from oases.storage.unsharded import Shard, layout_of

__all__ = [
    "TensorEntry",
    "check_dtypes",
    "tensor_entries",
    "split_files",
    "gather_to",
    "check_save",
    "staged",
    "partial_path",
    "prepare_dir",
    "durable",
    "on_writer",
    "writer_ranks",
    "stream_tensors",
    "write_files",
]

_PART = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the files of a multi-file checkpoint


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the written checkpoint: its key, this rank's tensor, its shard (if any)."""

    key: str
    local: torch.Tensor
    shard: Optional[Shard]
    shape: torch.Size  # full

    @property
    def nbytes(self) -> int:
        """The full tensor's size in bytes."""
        return self.shape.numel() * self.local.dtype.itemsize


def check_dtypes(what: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """TypeError naming every (key, tensor) whose dtype safetensors lacks (`what`: the caller's name)."""
    unknown = [f"{key} ({tensor.dtype})" for key, tensor in tensors if tensor.dtype not in DTYPES]
    if unknown:
        raise TypeError(f"{what}: no safetensors dtype for {', '.join(unknown)}")


def tensor_entries(model: nn.Module) -> list[TensorEntry]:
    """The unsharded state dict's tensors in order, a tied tensor once (under its first key)."""
    _, shards, expected = layout_of(model)
    entries, seen = [], set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        entries.append(TensorEntry(key, tensor.detach(), shards.get(key), torch.Size(expected[key])))
    check_dtypes("save_pretrained", ((e.key, e.local) for e in entries))
    return entries


def split_files(entries: list[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """Consecutive entries grouped into files of at most max_shard_size bytes (a bigger tensor alone)."""
    files: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _header(entries: list[TensorEntry]) -> bytes:
    """The safetensors header of a file holding `entries` back to back, length prefix included."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {
            "dtype": DTYPES[e.local.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _write(out: BinaryIO, tensor: torch.Tensor) -> None:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # native = little-endian
    out.write(memoryview(data.numpy()))


def gather_to(entry: TensorEntry, writer: int, me: int) -> Optional[torch.Tensor]:
    """The full tensor on `writer` (None elsewhere): each rank's shard in turn, sent to the writer.

        writer:  full = empty(shape); for r in group: full[chunk.index()] = chunk.of(shard_r)
        others:  send(shard, writer) if the writer is in the module's group (else a replica: nothing)

    Peak on the writer: the full tensor and one received shard.
    """
    s = entry.shard
    if s is None:
        return entry.local if me == writer else None
    ring = ring_of(s.group)
    if writer not in ring.global_ranks:
        return None
    shard = s.local.detach().contiguous()
    if ring.size == 1:
        return shard
    if me != writer:
        dist.send(shard, dst=writer, group=s.group)
        return None
    full = torch.empty(entry.shape, dtype=shard.dtype, device=shard.device)
    received = torch.empty_like(shard)
    for r, src in enumerate(ring.global_ranks):
        part = shard
        if src != writer:
            dist.recv(received, src=src, group=s.group)
            part = received
        for chunk in s.rule.chunks(entry.shape, r, s.size):
            full[chunk.index()] = chunk.of(part)
    return full


def check_save(path: Union[str, os.PathLike], max_shard_size: object, model: nn.Module) -> str:
    """save_pretrained's local checks (path not a file, max_shard_size, byte order, config); the path."""
    path = os.fspath(path)
    if os.path.isfile(path):
        raise FileExistsError(f"path: {path!r} is a file; save_pretrained writes a directory")
    if not _checks.is_int(max_shard_size) or max_shard_size < 1:
        raise ValueError(f"max_shard_size: expected a positive number of bytes, got {max_shard_size!r}")
    if sys.byteorder != "little":
        raise NotImplementedError("save_pretrained: safetensors is little-endian; this machine is not")
    _check_config(model)
    return path


def _check_config(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None or callable(getattr(config, "save_pretrained", None)):
        return
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(
            f"save_pretrained: model.config is a {type(config).__name__}, neither a transformers "
            f"config (with save_pretrained) nor a dataclass instance; cannot write config.json"
        )


def _write_config(model: nn.Module, path: str, dtype: Optional[torch.dtype]) -> None:
    """config.json (and generation_config.json) as transformers writes them; a dataclass config as
    JSON. Staged (`staged`): a save that dies meanwhile leaves the previous config whole."""
    config = getattr(model, "config", None)
    if config is None:
        return
    if not callable(getattr(config, "save_pretrained", None)):  # a dataclass: GPTConfig -> "oases-gpt"
        kind = "oases-" + type(config).__name__.lower().removesuffix("config")

        def write(staging: str) -> None:
            with open(os.path.join(staging, "config.json"), "w") as f:
                json.dump(dict(dataclasses.asdict(config), model_type=kind), f, indent=2)

        staged(path, write)
        return
    config = copy.deepcopy(config)  # as transformers records them, without changing the model's config
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    generation = getattr(model, "generation_config", None)

    def write_hf(staging: str) -> None:
        config.save_pretrained(staging)
        if callable(getattr(generation, "save_pretrained", None)):
            generation.save_pretrained(staging)

    staged(path, write_hf)


def staged(path: str, write: Callable[[str], object]) -> None:
    """`write(staging)` into the hidden directory path/.config.partial, then each file it wrote
    fsynced and renamed over its name in `path` (atomic: the old file or the new one, never a cut
    one, as a config written in place would be by a writer killed mid-write)."""
    staging = partial_path(path, "config")
    shutil.rmtree(staging, ignore_errors=True)  # an earlier save's that died
    os.makedirs(staging)
    write(staging)
    for name in sorted(os.listdir(staging)):
        fsync_file(os.path.join(staging, name))
        os.replace(os.path.join(staging, name), os.path.join(path, name))
    os.rmdir(staging)


_CONFIGS = ("config.json", "generation_config.json")  # what _write_config writes


def partial_path(path: str, name: str) -> str:
    """Where `name` is written before it is published: hidden, a name no loader reads."""
    return os.path.join(path, f".{name}.partial")


def prepare_dir(path: str) -> None:
    """On the writer: the directory, writable (a previous save's files are left as they are)."""
    os.makedirs(path, exist_ok=True)
    with open(partial_path(path, "probe"), "wb"):
        pass
    os.remove(partial_path(path, "probe"))


def durable(path: str, names: Iterable[str] = ()) -> None:
    """fsync the files `names` of directory `path` that exist, then the directory's entries."""
    for name in names:
        if os.path.exists(os.path.join(path, name)):
            fsync_file(os.path.join(path, name))
    fsync_dir(path)


def _publish(model: nn.Module, path: str, names: list[str], entries: list[TensorEntry]) -> None:
    """On the writer, once every file is written whole: each fsynced and renamed over its name (the
    index last), then a previous save's weight files that are not the new ones removed, then the
    config; the config files and the directory's entries fsynced, so that once it returns the save
    survives a machine crash.

    What a crash leaves at each point: a loader (ours, transformers') reads model.safetensors if
    there is one, else the index's parts. One file: the rename is atomic (old or new). Several: a
    previous index goes first (its removal made durable before any part is replaced), so parts
    replaced one by one never load under it mixed with the old ones (no index, no single file:
    loading fails, loudly); a previous single file stays until the new index is in place, and is
    read before it until removed."""
    if len(names) > 1 and os.path.exists(os.path.join(path, INDEX)):
        os.remove(os.path.join(path, INDEX))
        fsync_dir(path)
    for name in names + ([INDEX] if len(names) > 1 else []):
        fsync_file(partial_path(path, name))  # its bytes durable before its name points at them
        os.replace(partial_path(path, name), os.path.join(path, name))
    for name in os.listdir(path):
        stale = (name in (SINGLE, INDEX) or _PART.fullmatch(name)) and name not in names
        stale = stale and (name != INDEX or len(names) == 1)
        failed = name.startswith(".model") and name.endswith(".partial")  # an earlier save's that died
        if stale or failed:
            os.remove(os.path.join(path, name))  # a stale index or part would shadow the new files
    floating = next((e.local.dtype for e in entries if e.local.dtype.is_floating_point), None)
    _write_config(model, path, floating)
    durable(path, _CONFIGS)


def _shared(error: Optional[Exception], writer: int, distributed: bool, group, what: str) -> None:
    """Raise the writer's `error` on every rank (a collective over `group` when distributed)."""
    failure = [None if error is None else f"{type(error).__name__}: {error}"]
    if distributed:
        dist.broadcast_object_list(failure, src=writer, group=group)
    if error is not None:
        raise error
    if failure[0] is not None:
        raise RuntimeError(f"save_pretrained: rank {writer} could not {what}: {failure[0]}")


def on_writer(run: Callable[[], object], writing: bool, writer: int, distributed: bool, group, what: str) -> None:
    """`run()` on the writer; its error, shared so that no rank is left waiting, raised on every rank."""
    error: Optional[Exception] = None
    if writing:
        try:
            run()
        except Exception as e:  # noqa: BLE001 -- re-raised by _shared, on every rank
            error = e
    _shared(error, writer, distributed, group, what)


def writer_ranks(group: Optional[dist.ProcessGroup]) -> tuple[bool, int, int]:
    """(distributed, the writer: the global rank of `group`'s rank 0, this rank); (False, 0, 0)
    without a process group (one process)."""
    distributed = dist.is_available() and dist.is_initialized()
    writer = ring_of(group).global_ranks[0] if distributed else 0
    return distributed, writer, dist.get_rank() if distributed else 0


def stream_tensors(
    path: str, entries: list[TensorEntry], full_of: Callable[[TensorEntry], Optional[torch.Tensor]], writing: bool
) -> None:
    """One safetensors file of `entries` at `path`: on the writer (`writing`) its header, then each
    entry's full tensor (`full_of(entry)`, one in memory at a time) appended; every other rank
    calls `full_of` alike (its part in the gathering) and writes nothing."""
    with open(path, "wb") if writing else nullcontext() as out:
        if writing:
            out.write(_header(entries))
        for entry in entries:
            full = full_of(entry)  # [entry.shape] on the writer
            if writing:
                _write(out, full)
            del full


def write_files(
    model: nn.Module,
    path: str,
    entries: list[TensorEntry],
    files: list[list[TensorEntry]],
    writer: int,
    me: int,
    full_of: Callable[[TensorEntry], Optional[torch.Tensor]],
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """The files of `entries` cut into `files`, written by global rank `writer` (this rank: `me`;
    every rank of `group` calls it, `full_of(entry)` giving the writer the full tensor and taking
    part in its gathering elsewhere): streamed into .partial files, then published (_publish). A
    failure to prepare or publish is raised on every rank; without a process group, one process."""
    names = (
        [SINGLE]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    distributed = dist.is_available() and dist.is_initialized()
    writing = me == writer
    on_writer(lambda: prepare_dir(path), writing, writer, distributed, group, f"prepare {path!r}")
    for name, held in zip(names, files):
        stream_tensors(partial_path(path, name), held, full_of, writing)
    if writing and len(files) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.key: name for name, held in zip(names, files) for e in held},
        }
        with open(partial_path(path, INDEX), "w") as f:
            json.dump(index, f, indent=2)
    on_writer(  # and nobody returns before the files exist
        lambda: _publish(model, path, names, entries), writing, writer, distributed, group, f"publish {path!r}"
    )
