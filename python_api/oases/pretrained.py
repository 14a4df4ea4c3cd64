"""Hugging Face safetensors checkpoints in and out of tensor-parallel models, one tensor at a time.

    oases.load_pretrained(tp_model, "llama-dir")   # each rank reads only its shards' boxes; no communication
    oases.save_pretrained(tp_model, "out-dir")     # a collective: each sharded tensor gathered to rank 0
    oases.save_adapter(peft_model, "adapter-dir")  # the same for a PEFT model's adapter, in PEFT's format
    LlamaForCausalLM.from_pretrained("out-dir")    # ... is the unsharded model

The directory is the one transformers' `save_pretrained` writes and `from_pretrained` reads:

    config.json [generation_config.json]
    model.safetensors                                      one file, or
    model-00001-of-0000n.safetensors ... model-0000n-of-0000n.safetensors
    model.safetensors.index.json   {"metadata": {"total_size": bytes}, "weight_map": {key: file}}

with the unsharded model's state_dict keys and shapes (a tied tensor once, under its first key).
A safetensors file is an 8-byte little-endian header length, a JSON header {key: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to a multiple of
8 bytes, then the tensors' raw bytes back to back. Sharded parameters are found as
oases.checkpoint finds them (modules with `tp_layout()` and `group`); a shard is a few boxes of
the full tensor (`ShardRule.chunks`), and that is all a rank reads or sends:

    load:  for chunk in rule.chunks(full_shape, rank, p):  chunk.of(local).copy_(file[key][chunk.index()])
    save:  full[chunk.index()] = chunk.of(shard of rank r)  on the writer, one tensor at a time, then appended

Keys are used as they are: checkpoints whose keys transformers renames on load (conversion
mappings of some architectures) are not translated.
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
from torch.nn.modules.module import _IncompatibleKeys

from oases import _checks
from oases._checks import process_group
from oases._compiled import original_module
from oases._dcp import fsync_dir, fsync_file
from oases._hf_files import DTYPES, INDEX, SINGLE, Stored, stored_tensors
from oases.checkpoint._unsharded import _allocated, _check, _layout, _Shard
from oases.comm.topology import ring_of

__all__ = ["load_pretrained", "save_pretrained", "save_adapter"]

_PART = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the files of a multi-file checkpoint


# --- reading -----------------------------------------------------------------------------------------


def _ties(model: nn.Module) -> dict[str, list[str]]:
    """{key: every state-dict key of the same tensor (itself first)} (tied weights share one tensor)."""
    by_id: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), []).append(key)
    return {key: keys for keys in by_id.values() for key in keys}


def load_pretrained(
    model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load a Hugging Face safetensors checkpoint (unsharded) into `model` at its own TP degree.

    ::

        stored = {key: (file, shape)} from the headers (index.json's weight_map, or the one file),
                 keyed as the model names them (transformers' renamings and expert merges: oases._hf_files)
        check keys (if strict) and shapes against the UNSHARDED model       # ValueError, nothing copied
        for key, tensor in model.state_dict().items(), each tensor once:
            sharded:     for chunk in rule.chunks(full_shape, rank, p):        # a file handle per read
                             chunk.of(local).copy_(stored[key].read(chunk.index()))
            replicated:  tensor.copy_(stored[key].read())

    No communication: each rank reads its own boxes, so it touches about its share of the file.
    Values are cast to the model's dtype on copy (a bf16 file into an fp32 model). A tied tensor
    (the same tensor under several keys) is read once, from whichever of its keys the file has.

    Args:
        model: a model (plain or sharded by `oases.parallelize`) whose parameters are allocated.
        path: a directory written by `save_pretrained` (transformers' or `oases.save_pretrained`),
            or one .safetensors file.
        strict: if False, keys the files lack are left as they are and keys the model lacks are
            ignored (shapes are checked regardless).
    Returns:
        (missing_keys, unexpected_keys), as nn.Module.load_state_dict's named tuple.
    Raises:
        FileNotFoundError (no such path, no safetensors there, an index naming a missing file) and
        ValueError (keys, shapes), the same on every rank and before anything is copied.
    """
    model = _allocated(model)  # torch.compile(model): the original's keys
    path = os.fspath(path)
    return _read_into(model, path, stored_tensors(path, model), strict)


def _read_into(model: nn.Module, path: str, stored: dict[str, Stored], strict: bool) -> tuple[list[str], list[str]]:
    """load_pretrained's work, from `stored` (keyed as the model names its tensors: a pipeline stage's
    held modules are keyed by the whole model's mapping, which only the whole model knows)."""
    _, shards, expected = _layout(model)
    ties = _ties(model)
    source = {}  # model key -> the checkpoint's key it is read from: itself, or a tied key the file has
    for key in expected:
        present = [k for k in ties[key] if k in stored]
        if present:
            source[key] = key if key in stored else present[0]
    given = {key: stored[k].shape for key, k in source.items()}
    given.update({k: t.shape for k, t in stored.items() if k not in expected})
    _check(f"safetensors checkpoint {path!r}", expected, given, shards, strict)
    missing = [key for key in expected if key not in source]
    unexpected = [key for key in stored if key not in expected]

    params = model.state_dict(keep_vars=True)
    done: set[int] = set()
    with torch.no_grad():
        for key, tensor in params.items():
            if key not in source or id(tensor) in done:
                continue
            done.add(id(tensor))
            held = stored[source[key]]
            s = shards.get(key)
            if s is None:
                tensor.copy_(held.read())
                continue
            for chunk in s.rule.chunks(s.full_shape, s.rank, s.size):
                chunk.of(s.local).copy_(held.read(chunk.index()))
    return _IncompatibleKeys(missing, unexpected)


# --- writing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """One tensor of the written checkpoint: its key, this rank's tensor, its shard (if any)."""

    key: str
    local: torch.Tensor
    shard: Optional[_Shard]
    shape: torch.Size  # full

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.local.dtype.itemsize


def _entries(model: nn.Module) -> list[_Entry]:
    """The unsharded state dict's tensors in order, a tied tensor once (under its first key)."""
    _, shards, expected = _layout(model)
    entries, seen = [], set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        entries.append(_Entry(key, tensor.detach(), shards.get(key), torch.Size(expected[key])))
    unknown = [f"{e.key} ({e.local.dtype})" for e in entries if e.local.dtype not in DTYPES]
    if unknown:
        raise TypeError(f"save_pretrained: no safetensors dtype for {', '.join(unknown)}")
    return entries


def _split(entries: list[_Entry], max_shard_size: int) -> list[list[_Entry]]:
    """Consecutive entries grouped into files of at most max_shard_size bytes (a bigger tensor alone)."""
    files: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_shard_size:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _header(entries: list[_Entry]) -> bytes:
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


def _gathered(entry: _Entry, writer: int, me: int) -> Optional[torch.Tensor]:
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


def _check_save(path: Union[str, os.PathLike], max_shard_size: object, model: nn.Module) -> str:
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
    JSON. Staged (`_staged`): a save that dies meanwhile leaves the previous config whole."""
    config = getattr(model, "config", None)
    if config is None:
        return
    if not callable(getattr(config, "save_pretrained", None)):  # a dataclass: GPTConfig -> "oases-gpt"
        kind = "oases-" + type(config).__name__.lower().removesuffix("config")

        def write(staging: str) -> None:
            with open(os.path.join(staging, "config.json"), "w") as f:
                json.dump(dict(dataclasses.asdict(config), model_type=kind), f, indent=2)

        _staged(path, write)
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

    _staged(path, write_hf)


def _staged(path: str, write: Callable[[str], object]) -> None:
    """`write(staging)` into the hidden directory path/.config.partial, then each file it wrote
    fsynced and renamed over its name in `path` (atomic: the old file or the new one, never a cut
    one, as a config written in place would be by a writer killed mid-write)."""
    staging = _partial(path, "config")
    shutil.rmtree(staging, ignore_errors=True)  # an earlier save's that died
    os.makedirs(staging)
    write(staging)
    for name in sorted(os.listdir(staging)):
        fsync_file(os.path.join(staging, name))
        os.replace(os.path.join(staging, name), os.path.join(path, name))
    os.rmdir(staging)


_CONFIGS = ("config.json", "generation_config.json")  # what _write_config writes


def _partial(path: str, name: str) -> str:
    """Where `name` is written before it is published: hidden, a name no loader reads."""
    return os.path.join(path, f".{name}.partial")


def _prepare(path: str) -> None:
    """On the writer: the directory, writable (a previous save's files are left as they are)."""
    os.makedirs(path, exist_ok=True)
    with open(_partial(path, "probe"), "wb"):
        pass
    os.remove(_partial(path, "probe"))


def _durable(path: str, names: Iterable[str] = ()) -> None:
    """fsync the files `names` of directory `path` that exist, then the directory's entries."""
    for name in names:
        if os.path.exists(os.path.join(path, name)):
            fsync_file(os.path.join(path, name))
    fsync_dir(path)


def _publish(model: nn.Module, path: str, names: list[str], entries: list[_Entry]) -> None:
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
        fsync_file(_partial(path, name))  # its bytes durable before its name points at them
        os.replace(_partial(path, name), os.path.join(path, name))
    for name in os.listdir(path):
        stale = (name in (SINGLE, INDEX) or _PART.fullmatch(name)) and name not in names
        stale = stale and (name != INDEX or len(names) == 1)
        failed = name.startswith(".model") and name.endswith(".partial")  # an earlier save's that died
        if stale or failed:
            os.remove(os.path.join(path, name))  # a stale index or part would shadow the new files
    floating = next((e.local.dtype for e in entries if e.local.dtype.is_floating_point), None)
    _write_config(model, path, floating)
    _durable(path, _CONFIGS)


def _shared(error: Optional[Exception], writer: int, distributed: bool, group, what: str) -> None:
    """Raise the writer's `error` on every rank (a collective over `group` when distributed)."""
    failure = [None if error is None else f"{type(error).__name__}: {error}"]
    if distributed:
        dist.broadcast_object_list(failure, src=writer, group=group)
    if error is not None:
        raise error
    if failure[0] is not None:
        raise RuntimeError(f"save_pretrained: rank {writer} could not {what}: {failure[0]}")


def _on_writer(run: Callable[[], object], writing: bool, writer: int, distributed: bool, group, what: str) -> None:
    """`run()` on the writer; its error, shared so that no rank is left waiting, raised on every rank."""
    error: Optional[Exception] = None
    if writing:
        try:
            run()
        except Exception as e:  # noqa: BLE001 -- re-raised by _shared, on every rank
            error = e
    _shared(error, writer, distributed, group, what)


def _write_files(
    model: nn.Module,
    path: str,
    entries: list[_Entry],
    files: list[list[_Entry]],
    writer: int,
    me: int,
    full_of: Callable[[_Entry], Optional[torch.Tensor]],
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
    _on_writer(lambda: _prepare(path), writing, writer, distributed, group, f"prepare {path!r}")
    for name, held in zip(names, files):
        with open(_partial(path, name), "wb") if writing else nullcontext() as out:
            if writing:
                out.write(_header(held))
            for entry in held:
                full = full_of(entry)  # [entry.shape] on the writer
                if writing:
                    _write(out, full)
                del full
    if writing and len(files) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.key: name for name, held in zip(names, files) for e in held},
        }
        with open(_partial(path, INDEX), "w") as f:
            json.dump(index, f, indent=2)
    _on_writer(  # and nobody returns before the files exist
        lambda: _publish(model, path, names, entries), writing, writer, distributed, group, f"publish {path!r}"
    )


def save_pretrained(
    model: nn.Module,
    path: Union[str, os.PathLike],
    *,
    max_shard_size: int = 5 * 2**30,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Write `model`'s unsharded weights (and config) as a Hugging Face directory, streaming.

    ::

        writer = rank 0 of `group`
        files = state-dict entries (each tensor once) in order, cut every max_shard_size bytes
        for each file: writer writes its header to path/.<file>.partial, then
        for entry in file:                                   # one full tensor in memory at a time
            full = gather entry's shards to the writer (p2p over its module's group), or the replica
            writer appends full's bytes
        writer: .model.safetensors.index.json.partial when there are several files
        writer: each .partial fsynced and renamed over its file (the index last); a previous save's
                weight files that are not the new ones removed; config.json (+ generation_config.json)
                fsynced, then the directory's entries (the save survives a machine crash)
        every rank: the writer's error, if any (so nobody returns before the files exist)

    A collective: every rank of `group` (default: the world; without a process group, a plain
    model in one process) calls it with its replica of the same model (any TP degree; TP groups
    inside `group`; a module whose group lacks the writer is another replica's and sends nothing).
    Only the writer writes; everyone returns after the files
    exist. A save that dies while streaming leaves a previous save in `path` as it was (its new
    files are hidden .partial ones); the other weight files and index of a previous save are
    removed once the new files are in place. One that dies while renaming them leaves the old save
    or the new one, never a mix: several files over several leave none loadable (the old index goes
    first; a loud error, not the wrong weights). Config:
    transformers models write theirs (with `dtype` and `architectures` set, as transformers does)
    and their generation_config; a dataclass config (oases.models.GPT's GPTConfig) is written as
    config.json, asdict(config) plus {"model_type": "oases-gpt"} (from the class name), which
    `load_pretrained` ignores and transformers cannot build; a model without `config` gets none.

    Args:
        model: a model, plain or sharded by `oases.parallelize`.
        path: the directory to write (created if needed; must not be a file).
        max_shard_size: the largest weight file in bytes (a bigger tensor gets a file alone).
        group: the ranks that call it (default: the world); its rank 0 writes.
    Raises:
        before any communication, on every rank alike: FileExistsError (path is a file), ValueError
        (max_shard_size), TypeError (a dtype safetensors lacks, an unusable config). A failure
        while the writer prepares the directory is raised on every rank; one while it streams
        tensors (a full disk) leaves the others waiting in their sends until the group times out.
    """
    group = process_group(group)  # a 1-D DeviceMesh: its group
    model = _allocated(model)  # torch.compile(model): the original's keys and class name
    path = _check_save(path, max_shard_size, model)
    entries = _entries(model)
    distributed = dist.is_available() and dist.is_initialized()
    writer = ring_of(group).global_ranks[0] if distributed else 0
    me = dist.get_rank() if distributed else 0
    _write_files(
        model, path, entries, _split(entries, max_shard_size), writer, me, lambda e: _gathered(e, writer, me), group
    )


# --- PEFT adapters -----------------------------------------------------------------------------------

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names (peft.utils.SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME)
ADAPTER_CONFIG = "adapter_config.json"


def _adapter_entries(model: nn.Module, adapter_name: str) -> list[_Entry]:
    """The adapter's tensors as PEFT saves them (peft.get_peft_model_state_dict's keys and order),
    each with its shard where a tp_layout() lists it (oases' LoRA layers' split factors)."""
    from peft import get_peft_model_state_dict

    _, shards, expected = _layout(model)
    params = model.state_dict(keep_vars=True)
    key_of: dict[int, str] = {}
    for key, tensor in params.items():
        key_of.setdefault(id(tensor), key)
    selected = get_peft_model_state_dict(
        model, state_dict=params, adapter_name=adapter_name, save_embedding_layers=False
    )
    entries = []
    for key, tensor in selected.items():
        source = key_of.get(id(tensor))
        if source is None:  # not one of the model's tensors (PEFT made it): held whole
            entries.append(_Entry(key, tensor.detach(), None, tensor.shape))
            continue
        entries.append(_Entry(key, tensor.detach(), shards.get(source), torch.Size(expected[source])))
    unknown = [f"{e.key} ({e.local.dtype})" for e in entries if e.local.dtype not in DTYPES]
    if unknown:
        raise TypeError(f"save_adapter: no safetensors dtype for {', '.join(unknown)}")
    return entries


def _write_adapter_config(model: nn.Module, adapter_name: str, path: str) -> None:
    """adapter_config.json as PeftModel.save_pretrained writes it (inference_mode True, the base
    model's name_or_path, the auto mapping of a config without task_type)."""
    config = copy.deepcopy(model.peft_config[adapter_name])
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    auto_mapping = None
    if config.task_type is None and callable(getattr(model, "_get_base_model_class", None)):
        base_class = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    _staged(path, lambda staging: config.save_pretrained(staging, auto_mapping_dict=auto_mapping))


def save_adapter(
    model: nn.Module,
    path: Union[str, os.PathLike],
    *,
    adapter_name: str = "default",
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Write a PEFT model's adapter in PEFT's own format, unsharded: `path`/adapter_model.safetensors
    and `path`/adapter_config.json, what PeftModel.save_pretrained writes for the unsharded model
    (PeftModel.from_pretrained(base, path) loads it on one process), streaming as save_pretrained.

    ::

        entries = peft.get_peft_model_state_dict(model)'s keys and tensors (adapter name removed)
        writer = rank 0 of `group`; it writes the safetensors header to path/.adapter_model.safetensors.partial
        for entry in entries:                           # one full tensor in memory at a time
            full = gather the entry's shards to the writer (a split LoRA factor: oases.nn.lora), or the replica
            writer appends full's bytes
        writer: the file renamed over adapter_model.safetensors, then adapter_config.json written
        every rank: the writer's error, if any (so nobody returns before the files exist)

    A collective: every rank of `group` (default: the world) calls it with its replica of the same
    model. No rank gathers the model: the writer holds one adapter tensor at a time.

    Args:
        model: a peft.PeftModel (LoRA adapters on oases' parallel layers, or PEFT's own on layers left whole).
        path: the directory to write (created if needed; must not be a file).
        adapter_name: which adapter to write (default "default").
        group: the ranks that call it (default: the world); its rank 0 writes.
    Raises:
        before any communication, on every rank alike: TypeError (not a PEFT model; a dtype safetensors
        lacks), ValueError (no such adapter), FileExistsError (path is a file).
    """
    group = process_group(group)  # a 1-D DeviceMesh: its group
    model = original_module(model)
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not callable(getattr(model, "get_base_model", None)):
        raise TypeError(
            f"model: expected a peft.PeftModel (get_peft_model(...)), got {type(model).__name__}; pass the PEFT "
            f"model, whose state dict has the keys PEFT's adapter files use"
        )
    if adapter_name not in configs:
        raise ValueError(f"adapter_name: {adapter_name!r} is not one of the model's adapters {list(configs)}")
    path = os.fspath(path)
    if os.path.isfile(path):
        raise FileExistsError(f"path: {path!r} is a file; save_adapter writes a directory")
    if sys.byteorder != "little":
        raise NotImplementedError("save_adapter: safetensors is little-endian; this machine is not")
    entries = _adapter_entries(model, adapter_name)
    distributed = dist.is_available() and dist.is_initialized()
    writer = ring_of(group).global_ranks[0] if distributed else 0
    me = dist.get_rank() if distributed else 0
    writing = me == writer
    _on_writer(lambda: _prepare(path), writing, writer, distributed, group, f"prepare {path!r}")
    with open(_partial(path, ADAPTER_WEIGHTS), "wb") if writing else nullcontext() as out:
        if writing:
            out.write(_header(entries))
        for entry in entries:
            full = _gathered(entry, writer, me)  # [entry.shape] on the writer
            if writing:
                _write(out, full)
            del full

    def publish() -> None:
        fsync_file(_partial(path, ADAPTER_WEIGHTS))
        os.replace(_partial(path, ADAPTER_WEIGHTS), os.path.join(path, ADAPTER_WEIGHTS))
        _write_adapter_config(model, adapter_name, path)
        _durable(path, [ADAPTER_CONFIG])

    _on_writer(publish, writing, writer, distributed, group, f"write the adapter to {path!r}")
