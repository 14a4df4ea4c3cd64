"""torch.distributed.checkpoint (DCP) for tensor-parallel shards.

A TP shard is a few boxes of one global tensor (`ShardRule.chunks`). `Chunked` shows those boxes to
DCP as chunks of that tensor, so each rank writes only what it holds and the stored tensor has the
unsharded model's shape; reading at another TP degree is DCP's resharding (it reads the overlaps):

    state = {"w": Chunked(local, rule.chunks(full_shape, r, p), full_shape), "b": replicated_tensor}
    written = write(state, path, ring)           # rank r writes its boxes of w; b once (deduplicated)
    load(state, path, ring)                      # each box read straight into `local`'s storage

Plain tensors are replicated (DCP writes one copy); identical boxes on several ranks (replicas of a
shard: data parallel, per-layer TP degrees) are one write item, deduplicated the same way. Other
values are pickled ("bytes" entries). Untrusted reads (`trusted=False`) run no pickle: `.metadata`
is read naming only DCP's metadata records, every other entry with torch.load(weights_only=True).
A checkpoint's life on disk is `oases.storage.publish`, its checks `oases.storage.integrity`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from oases._sharding import Chunk
from oases.comm.topology import Ring
from oases.storage.integrity import METADATA, Damaged

__all__ = ["Chunked", "Untrusted", "read_metadata", "read_local", "load", "write"]


@dataclass(frozen=True, eq=False)
class Chunked:
    """This rank's boxes of one global tensor of `full_shape`: `chunk.of(local)` is full[chunk.index()]."""

    local: torch.Tensor
    chunks: tuple[Chunk, ...]
    full_shape: torch.Size

    def size(self) -> torch.Size:
        """The global tensor's shape (DCP checks it against the checkpoint's)."""
        return self.full_shape

    def box(self, offset: tuple[int, ...]) -> torch.Tensor:
        """The view of `local` holding the chunk that starts at `offset` of the global tensor."""
        for chunk in self.chunks:
            if tuple(chunk.offsets) == tuple(offset):
                return chunk.of(self.local)
        raise ValueError(
            f"no chunk of this rank starts at {tuple(offset)} (its chunks: {[c.offsets for c in self.chunks]})"
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                    properties=properties,
                    size=self.full_shape,
                ),
            )
            for c in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in self.chunks]


class SavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner on a flat state dict whose `Chunked` values write their boxes."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Chunked):
            return value.box(index.offset)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner on a flat state dict whose `Chunked` values are read box by box, in place."""

    def __init__(self, trusted: bool = True, path: str = "") -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.trusted, self.path = trusted, path
        self.refused: dict[str, str] = {}  # untrusted: {entry: the global its pickle names}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """A pickled entry; untrusted, with torch.load(weights_only=True) (plain data and tensors)."""
        if self.trusted:
            return super().load_bytes(read_item, value)
        key = read_item.dest_index.fqn
        try:
            self.state_dict[key] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            if found is None:
                raise
            self.state_dict[key] = None
            self.refused.setdefault(key, found.group(1))  # raised by the caller: DCP would wrap it

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        chunked = {key: value for key, value in state_dict.items() if isinstance(value, Chunked)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunked)  # DCP's meta-tensor pass maps values it does not know to None

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, Chunked):
            return value.box(index.offset)
        return super().lookup_tensor(index)


# --- reading ----------------------------------------------------------------------------------------


# What `.metadata` (DCP's pickle) may name when read untrusted: DCP's metadata records, torch.Size
# and dtypes, a layout by name, a path. Each is a constructor of a record or a lookup by name.
_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    )]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    ]
)  # fmt: skip


class Untrusted(ValueError):
    """A checkpoint entry that an untrusted load (`trusted=False`) does not read: its pickle names
    `what`, which is neither DCP's metadata nor plain data."""


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler resolving only `_METADATA_GLOBALS` and torch's dtypes: any other global
    (a function, a class of another package: what makes a pickle run code) raises `Untrusted`."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise Untrusted(f"{module}.{name}")


class _Reader(torch_dcp.FileSystemReader):
    """DCP's FileSystemReader; untrusted (`trusted=False`), `.metadata` is read by
    `_MetadataUnpickler` instead of pickle.load."""

    def __init__(self, path: str, trusted: bool = True) -> None:
        super().__init__(path)
        self.trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.trusted:
            return super().read_metadata(*args, **kwargs)
        with open(os.path.join(self.path, METADATA), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise Untrusted(f"a {type(metadata).__name__} instead of DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _untrusted(where: str, key: str, what: str) -> Untrusted:
    return Untrusted(
        f"trusted: checkpoint {where!r} holds {key}, which names {what} in its pickle; trusted=False "
        f"reads DCP's metadata records and plain data only (tensors, numbers, strings, None, and "
        f"lists, tuples and dicts of them). Load it with trusted=True only if you trust who wrote it"
    )


def read_metadata(path: str, trusted: bool = True) -> Metadata:
    """The checkpoint's DCP metadata ({key: shape, dtype, chunks | bytes}), read locally; `Damaged`
    when it is missing or cannot be unpickled; untrusted, a ValueError when it names anything but
    DCP's metadata records (`_MetadataUnpickler`)."""
    try:
        return _Reader(path, trusted).read_metadata()
    except FileNotFoundError:
        raise Damaged(METADATA, "missing (deleted, or never copied)") from None
    except Untrusted as e:
        raise _untrusted(path, METADATA, str(e)) from None
    except Exception as e:  # noqa: BLE001 -- a damaged pickle raises anything
        raise Damaged(METADATA, f"unreadable ({type(e).__name__}: {e})") from e


def read_local(state: dict[str, Any], path: str, trusted: bool = True) -> None:
    """dcp.load(state) by this rank alone, no communication (for the small pickled entries);
    untrusted, each with torch.load(weights_only=True): a ValueError naming an entry that needs more."""
    planner = LoadPlanner(trusted, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        torch_dcp.load(state, storage_reader=_Reader(path, trusted), planner=planner, no_dist=True)
    for key, what in planner.refused.items():
        raise _untrusted(path, key, what)


def load(state: dict[str, Any], path: str, ring: Ring, trusted: bool = True) -> None:
    """dcp.load(state) over `ring`'s group: tensors and `Chunked` boxes are filled in place."""
    torch_dcp.load(
        state, storage_reader=_Reader(path, trusted), planner=LoadPlanner(trusted, path), process_group=ring.group
    )


class _Writer(torch_dcp.FileSystemWriter):
    """DCP's FileSystemWriter (files fsynced), keeping this rank's write results: the file, offset
    and length of each item it wrote."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.written: list = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = list(future.wait())  # FileSystemWriter's future is done when it returns
        return future


def write(state: dict[str, Any], path: str, ring: Ring) -> list:
    """dcp.save(state) into the directory `path` over `ring`'s group (DCP writes and fsyncs each
    file, `.metadata` last); this rank's write results (the file, offset and length of each item)."""
    writer = _Writer(path)
    torch_dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=ring.group)
    return writer.written
