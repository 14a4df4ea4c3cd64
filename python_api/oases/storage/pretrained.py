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
oases.storage.unsharded finds them (modules with `tp_layout()` and `group`); a shard is a few boxes of
the full tensor (`ShardRule.chunks`), and that is all a rank reads or sends:

    load:  for chunk in rule.chunks(full_shape, rank, p):  chunk.of(local).copy_(file[key][chunk.index()])
    save:  full[chunk.index()] = chunk.of(shard of rank r)  on the writer, one tensor at a time, then appended

Keys are used as they are: checkpoints whose keys transformers renames on load (conversion
mappings of some architectures) are not translated.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from oases._checks import process_group
from oases._compiled import original_module
from oases.storage.hf_files import Stored, stored_tensors
from oases.storage.hf_write import (
    TensorEntry,
    check_dtypes,
    check_save,
    durable,
    gather_to,
    on_writer,
    partial_path,
    prepare_dir,
    split_files,
    staged,
    stream_tensors,
    tensor_entries,
    write_files,
    writer_ranks,
)
from oases.storage.integrity import fsync_file
from oases.storage.unsharded import allocated, check_fit, layout_of

__all__ = ["ties", "match_stored", "read_into", "load_pretrained", "save_pretrained", "save_adapter"]


# --- reading -----------------------------------------------------------------------------------------


def ties(model: nn.Module) -> dict[str, list[str]]:
    """{key: every state-dict key of the same tensor (itself first)} (tied weights share one tensor)."""
    by_id: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), []).append(key)
    return {key: keys for keys in by_id.values() for key in keys}


def match_stored(
    model: nn.Module, expected: Mapping[str, torch.Size], stored: Mapping[str, Stored]
) -> tuple[dict[str, str], dict[str, torch.Size]]:
    """(source, given) of the model's keys `expected` against the checkpoint's tensors `stored`:

    source = {model key: the checkpoint's key it is read from: itself, or a tied key the file has}
    given  = {model key: the stored shape} for those, then {key: shape} of the keys the model lacks
    """
    tied = ties(model)
    source = {}
    for key in expected:
        present = [k for k in tied[key] if k in stored]
        if present:
            source[key] = key if key in stored else present[0]
    given = {key: stored[k].shape for key, k in source.items()}
    given.update({k: t.shape for k, t in stored.items() if k not in expected})
    return source, given


def load_pretrained(
    model: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Load a Hugging Face safetensors checkpoint (unsharded) into `model` at its own TP degree.

    ::

        stored = {key: (file, shape)} from the headers (index.json's weight_map, or the one file),
                 keyed as the model names them (transformers' renamings and expert merges: oases.storage.hf_files)
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
    model = allocated(model)  # torch.compile(model): the original's keys
    path = os.fspath(path)
    return read_into(model, path, stored_tensors(path, model), strict)


def read_into(model: nn.Module, path: str, stored: dict[str, Stored], strict: bool) -> tuple[list[str], list[str]]:
    """load_pretrained's work, from `stored` (keyed as the model names its tensors: a pipeline stage's
    held modules are keyed by the whole model's mapping, which only the whole model knows)."""
    _, shards, expected = layout_of(model)
    source, given = match_stored(model, expected, stored)
    check_fit(f"safetensors checkpoint {path!r}", expected, given, shards, strict)
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
    model = allocated(model)  # torch.compile(model): the original's keys and class name
    path = check_save(path, max_shard_size, model)
    entries = tensor_entries(model)
    _, writer, me = writer_ranks(group)
    files = split_files(entries, max_shard_size)
    write_files(model, path, entries, files, writer, me, lambda e: gather_to(e, writer, me), group)


# --- PEFT adapters -----------------------------------------------------------------------------------

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's names (peft.utils.SAFETENSORS_WEIGHTS_NAME, CONFIG_NAME)
ADAPTER_CONFIG = "adapter_config.json"


def _adapter_entries(model: nn.Module, adapter_name: str) -> list[TensorEntry]:
    """The adapter's tensors as PEFT saves them (peft.get_peft_model_state_dict's keys and order),
    each with its shard where a tp_layout() lists it (oases' LoRA layers' split factors)."""
    from peft import get_peft_model_state_dict

    _, shards, expected = layout_of(model)
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
            entries.append(TensorEntry(key, tensor.detach(), None, tensor.shape))
            continue
        entries.append(TensorEntry(key, tensor.detach(), shards.get(source), torch.Size(expected[source])))
    check_dtypes("save_adapter", ((e.key, e.local) for e in entries))
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
    staged(path, lambda staging: config.save_pretrained(staging, auto_mapping_dict=auto_mapping))


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
    distributed, writer, me = writer_ranks(group)
    writing = me == writer
    on_writer(lambda: prepare_dir(path), writing, writer, distributed, group, f"prepare {path!r}")
    stream_tensors(partial_path(path, ADAPTER_WEIGHTS), entries, lambda e: gather_to(e, writer, me), writing)

    def publish() -> None:
        fsync_file(partial_path(path, ADAPTER_WEIGHTS))
        os.replace(partial_path(path, ADAPTER_WEIGHTS), os.path.join(path, ADAPTER_WEIGHTS))
        _write_adapter_config(model, adapter_name, path)
        durable(path, [ADAPTER_CONFIG])

    on_writer(publish, writing, writer, distributed, group, f"write the adapter to {path!r}")
