"""torch.distributed.checkpoint (DCP) for tensor-parallel shards, and the on-disk life of a checkpoint.

A TP shard is a few boxes of one global tensor (`ShardRule.chunks`). `Chunked` shows those boxes to
DCP as chunks of that tensor, so each rank writes only what it holds and the stored tensor has the
unsharded model's shape; reading at another TP degree is DCP's resharding (it reads the overlaps):

    state = {"w": Chunked(local, rule.chunks(full_shape, r, p), full_shape), "b": replicated_tensor}
    save(state, final, ring, marker, keep)       # rank r writes its boxes of w; b once (deduplicated)
    load(state, path, ring)                      # each box read straight into `local`'s storage

Plain tensors are replicated (DCP writes one copy); identical boxes on several ranks (replicas of a
shard: data parallel, per-layer TP degrees) are one write item, deduplicated the same way. Other
values are pickled ("bytes" entries).

Life on disk (`save`), every step a collective over `ring` but the file operations one rank's:

    rank 0: rm -r .<name>.partial; mkdir it             -> agree (rank 0's error raised everywhere)
    all:    dcp.save(state) into .<name>.partial         (DCP writes and fsyncs each file, `.metadata` last)
    all:    crc32 of each file it wrote, whole and per stored item (offset, length)  -> gathered to rank 0
    rank 0: write oases_checkpoint.json into it (format, world size, step, every file's size and
            checksums, its own checksum; fsynced), fsync the directory; rename it to <name>
            (replacing an old <name>), fsync the parent; keep=N: hide, then delete all but the N
            newest sound step-* (never <name>), stale partials, fsync the parent  -> agree
A directory holding `.metadata` and no marker was never published: its writer died.

Integrity (`check_files`, `check_extents`, `check_reads`): the marker is written last and records every file the
checkpoint holds, so a reader checks sizes (a stat per file: truncated, missing, or foreign files)
and checksums, of `.metadata` and of each stored item it reads (a rank reading slices, as in a
reshard, verifies only the items it reads). zlib.crc32 runs at ~2 GiB/s on one core here; a save
re-reads each rank's own files (page cache) and checksums them whole and by item in one pass
(~0.11 s per 100 MiB), a verified load reads what the rank then reads again (`python -m bench
checkpoint`). A damaged file raises `Damaged`.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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

MARKER = "oases_checkpoint.json"  # the completion marker, written last, before publishing
FORMAT_KEY = "oases.format"  # a DCP entry every checkpoint of this format holds (absent in older ones)
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_LEFTOVER = re.compile(r"^\.(.+)\.(partial|deleting)$")
METADATA = ".metadata"  # DCP's metadata file
CHECKSUM = "crc32"  # zlib.crc32, the algorithm the marker names
_SELF_CHECKSUM = "marker_crc32"  # the marker's checksum of its own other entries
_BLOCK = 1 << 24  # bytes read at a time while checksumming


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


# --- integrity: checksums, sizes, fsync ------------------------------------------------------------


class Damaged(Exception):
    """A file of a checkpoint that fails verification: `file` (its name in the checkpoint
    directory) and `reason` (one line, starting with what is wrong: missing, size, checksum,
    unreadable, foreign)."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason


def file_checksums(path: str, items: Iterable[tuple[int, int]] = ()) -> dict:
    """The file at `path` and its `items` (offset, length), in one sequential read, 16 MiB at a time:

    {"size": bytes, "crc32": crc32(file), "items": [[offset, length, crc32(file[offset : offset + length])]]}
    """
    spans = sorted(set(items))
    crcs = dict.fromkeys(spans, 0)
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    size = whole = first = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            block, start, end = view[:n], size, size + n
            whole = zlib.crc32(block, whole)
            while first < len(spans) and sum(spans[first]) <= start:
                first += 1
            for offset, length in spans[first:]:
                if offset >= end:
                    break
                lo, hi = max(offset, start), min(offset + length, end)
                if lo < hi:
                    crcs[offset, length] = zlib.crc32(block[lo - start : hi - start], crcs[offset, length])
            size = end
    short = [span for span in spans if sum(span) > size]
    if short:
        raise OSError(f"{path}: {size} bytes, but an item was written at bytes [{short[0][0]}, {sum(short[0])})")
    return {
        "size": size,
        CHECKSUM: whole,
        "items": [[offset, length, crcs[offset, length]] for offset, length in spans],
    }


def _range_crc(f: Any, offset: int, length: int, view: memoryview) -> int:
    """crc32 of the bytes [offset, offset + length) of the open file `f`; EOFError past its end."""
    f.seek(offset)
    crc, left = 0, length
    while left:
        n = f.readinto(view[: min(left, len(view))])
        if not n:
            raise EOFError
        crc, left = zlib.crc32(view[:n], crc), left - n
    return crc


def fsync_dir(path: str) -> None:
    """Make the entries of the directory `path` durable (names created, renamed or removed in it)."""
    fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # a file system that cannot sync a directory (some network ones): nothing to do
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Make the content of the file at `path` durable (one written by another library)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _self_checksum(marker: dict) -> int:
    body = {key: value for key, value in marker.items() if key != _SELF_CHECKSUM}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def marker_text(marker: dict) -> str:
    """The marker as JSON with its own checksum added, one line per entry (the checksums on one)."""
    marker = {key: value for key, value in marker.items() if key != _SELF_CHECKSUM}
    marker[_SELF_CHECKSUM] = _self_checksum(marker)
    lines = [f" {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}" for key, value in marker.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def read_marker(path: str) -> Optional[dict]:
    """The completion marker's content; None when there is none (never published); `Damaged`
    when it cannot be read, is not a JSON object or does not match its own checksum."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Damaged(MARKER, f"unreadable ({e.strerror or e})") from e
    try:
        marker = json.loads(raw)
    except ValueError as e:  # not JSON, or not UTF-8
        raise Damaged(MARKER, f"unreadable: not JSON ({len(raw)} bytes: {e})") from e
    if not isinstance(marker, dict):
        raise Damaged(MARKER, "unreadable: not a JSON object")
    if "checksums" in marker and _SELF_CHECKSUM not in marker:  # written with both, or (older) neither
        raise Damaged(MARKER, f"checksum: its {_SELF_CHECKSUM} is missing (corrupted)")
    if _SELF_CHECKSUM in marker and marker[_SELF_CHECKSUM] != _self_checksum(marker):
        raise Damaged(MARKER, f"checksum: its content does not match its {_SELF_CHECKSUM} (corrupted)")
    return marker


def _recorded(marker: dict) -> Optional[dict]:
    """{file name: {"size", "crc32"[, "items"]}} as the marker records them; None for a checkpoint
    of oases before checksums (nothing recorded to check)."""
    table = marker.get("checksums")
    if table is None:
        return None
    files = table.get("files") if isinstance(table, dict) else None
    if not isinstance(files, dict) or table.get("algorithm") != CHECKSUM or METADATA not in files:
        raise Damaged(MARKER, f"unreadable: its checksums are not a {CHECKSUM} table of the checkpoint's files")
    return files


def check_files(path: str, marker: dict, verify: bool = True) -> None:
    """`Damaged` unless every file the marker records is in `path` with its recorded size, no
    `.distcp` file it does not record is there (another run's or world size's), and, with
    `verify`, `.metadata` has its recorded checksum. A stat per file, and one read of `.metadata`."""
    files = _recorded(marker)
    if files is None:
        return
    try:
        for name, entry in files.items():
            try:
                size = os.stat(os.path.join(path, name)).st_size
            except FileNotFoundError:
                raise Damaged(name, "missing (deleted, or never copied)") from None
            except OSError as e:
                raise Damaged(name, f"unreadable ({e.strerror or e})") from e
            if size != entry["size"]:
                raise Damaged(name, f"size {size} bytes, {entry['size']} were written (truncated, or another file)")
        foreign = sorted(name for name in os.listdir(path) if name.endswith(".distcp") and name not in files)
        if foreign:
            raise Damaged(foreign[0], "foreign: not written by this checkpoint (another run's or world size's file)")
        if verify:
            try:
                crc = file_checksums(os.path.join(path, METADATA))[CHECKSUM]
            except OSError as e:
                raise Damaged(METADATA, f"unreadable ({e.strerror or e})") from e
            if crc != files[METADATA][CHECKSUM]:
                raise Damaged(
                    METADATA,
                    f"checksum: {CHECKSUM} {crc:#010x}, {files[METADATA][CHECKSUM]:#010x} was written (corrupted)",
                )
    except (KeyError, TypeError) as e:
        raise Damaged(MARKER, f"unreadable: malformed checksums ({type(e).__name__}: {e})") from e
    except OSError as e:  # listing the directory
        raise Damaged(".", f"unreadable ({e.strerror or e})") from e


def check_share(path: str, marker: dict, share: int, shares: int) -> None:
    """`Damaged` unless the `share`-th of `shares` parts of the files the marker records (every
    `shares`-th by name) have their recorded whole-file checksums: `shares` ranks, one part each,
    read every file of the checkpoint once between them."""
    files = _recorded(marker)
    if files is None:
        return
    for name in sorted(files)[share::shares]:
        try:
            crc = file_checksums(os.path.join(path, name))[CHECKSUM]
        except OSError as e:
            raise Damaged(name, f"unreadable ({e.strerror or e})") from e
        if crc != files[name][CHECKSUM]:
            raise Damaged(
                name, f"checksum: {CHECKSUM} {crc:#010x}, {files[name][CHECKSUM]:#010x} was written (corrupted)"
            )


def check_extents(path: str, metadata: Metadata) -> None:
    """`Damaged` unless every file `.metadata` places items in is in `path` and long enough to hold
    them: a size check for any DCP checkpoint, one without checksums (older oases) too."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = os.stat(os.path.join(path, name)).st_size
        except FileNotFoundError:
            raise Damaged(name, "missing (deleted, or never copied)") from None
        except OSError as e:
            raise Damaged(name, f"unreadable ({e.strerror or e})") from e
        if size < end:
            raise Damaged(name, f"size {size} bytes, its items end at byte {end} (truncated)")


def _overlap(
    offsets: Sequence[int], sizes: Sequence[int], other_offsets: Sequence[int], other_sizes: Sequence[int]
) -> bool:
    """Whether two boxes of one tensor overlap."""
    return all(a < b + m and b < a + n for a, n, b, m in zip(offsets, sizes, other_offsets, other_sizes))


def stored_items(metadata: Metadata, wants: dict[str, Optional[Sequence[Chunk]]]) -> dict[str, set[tuple[int, int]]]:
    """{file: {(offset, length)}}: the stored items that a read of `wants` ({key: this rank's
    boxes of it, or None for all of it}) touches, as DCP reads them (every stored chunk that
    overlaps a box)."""
    chunks: dict[str, dict[tuple[int, ...], Sequence[int]]] = {}
    touched: dict[str, set[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn not in wants:
            continue
        boxes = wants[index.fqn]
        if boxes is not None and index.offset is not None:
            if index.fqn not in chunks:
                stored = metadata.state_dict_metadata[index.fqn].chunks
                chunks[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in stored}
            sizes = chunks[index.fqn].get(tuple(index.offset))
            if sizes is not None and not any(_overlap(b.offsets, b.sizes, index.offset, sizes) for b in boxes):
                continue
        touched.setdefault(info.relative_path, set()).add((info.offset, info.length))
    return touched


def check_reads(path: str, marker: dict, metadata: Metadata, wants: dict[str, Optional[Sequence[Chunk]]]) -> int:
    """`Damaged` unless every stored item a read of `wants` touches (`stored_items`) has its
    recorded checksum; the number of bytes checked (0 for a checkpoint without checksums)."""
    files = _recorded(marker)
    if files is None:
        return 0
    view = memoryview(bytearray(_BLOCK))
    checked = 0
    for name, spans in sorted(stored_items(metadata, wants).items()):
        if name not in files:
            raise Damaged(name, "foreign: .metadata names it, this checkpoint's marker does not")
        try:
            written = {offset: (length, crc) for offset, length, crc in files[name]["items"]}
        except (KeyError, TypeError, ValueError) as e:
            raise Damaged(MARKER, f"unreadable: malformed checksums of {name} ({type(e).__name__})") from e
        try:
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                for offset, length in sorted(spans):
                    if written.get(offset, (None, None))[0] != length:
                        raise Damaged(
                            name,
                            f"unreadable: .metadata has an item at [{offset}, {offset + length}), not written there",
                        )
                    try:
                        crc = _range_crc(f, offset, length, view)
                    except EOFError:
                        raise Damaged(name, f"size: it ends before byte {offset + length} (truncated)") from None
                    if crc != written[offset][1]:
                        raise Damaged(
                            name,
                            f"checksum: bytes [{offset}, {offset + length}) have {CHECKSUM} {crc:#010x}, "
                            f"{written[offset][1]:#010x} was written (corrupted)",
                        )
                    checked += length
        except FileNotFoundError:
            raise Damaged(name, "missing (deleted, or never copied)") from None
        except OSError as e:
            raise Damaged(name, f"unreadable ({e.strerror or e})") from e
    return checked


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


class _Reader(dcp.FileSystemReader):
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


def is_checkpoint(path: str) -> bool:
    """Whether `path` holds a checkpoint, published or not (DCP's `.metadata`, or a marker)."""
    return os.path.isfile(os.path.join(path, METADATA)) or os.path.isfile(os.path.join(path, MARKER))


def step_dir(root: str, step: int) -> str:
    """Where step `step` of the checkpoints under `root` is published."""
    return os.path.join(root, f"step-{step:09d}")


def steps(root: str) -> list[tuple[int, str]]:
    """[(step, directory)] of the step-* directories under `root`, newest (highest step) first."""
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def read_local(state: dict[str, Any], path: str, trusted: bool = True) -> None:
    """dcp.load(state) by this rank alone, no communication (for the small pickled entries);
    untrusted, each with torch.load(weights_only=True): a ValueError naming an entry that needs more."""
    planner = LoadPlanner(trusted, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=_Reader(path, trusted), planner=planner, no_dist=True)
    for key, what in planner.refused.items():
        raise _untrusted(path, key, what)


def load(state: dict[str, Any], path: str, ring: Ring, trusted: bool = True) -> None:
    """dcp.load(state) over `ring`'s group: tensors and `Chunked` boxes are filled in place."""
    dcp.load(state, storage_reader=_Reader(path, trusted), planner=LoadPlanner(trusted, path), process_group=ring.group)


# --- writing ----------------------------------------------------------------------------------------


class _Writer(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (files fsynced), keeping this rank's write results: the file, offset
    and length of each item it wrote."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.written: list = []

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = list(future.wait())  # FileSystemWriter's future is done when it returns
        return future


def _own_checksums(partial: str, written: list) -> dict:
    """{file: file_checksums} of the files this rank wrote, with each of its items."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for result in written:
        info = result.storage_data
        spans.setdefault(info.relative_path, []).append((info.offset, info.length))
    return {name: file_checksums(os.path.join(partial, name), items) for name, items in spans.items()}


def _gathered_checksums(partial: str, written: list, ring: Ring) -> tuple[dict, Optional[str]]:
    """On rank 0 of the ring: ({file: checksums} of every rank's files, the first rank's error or
    None); elsewhere ({}, None). A collective (each rank reads back its own files)."""
    try:
        mine: tuple[Optional[dict], Optional[str]] = (_own_checksums(partial, written), None)
    except OSError as e:
        mine = (None, f"rank {ring.rank} could not checksum its files: {type(e).__name__}: {e}")
    parts: Optional[list] = [mine]
    if ring.size > 1:
        parts = [None] * ring.size if ring.rank == 0 else None
        dist.gather_object(mine, parts, dst=ring.global_ranks[0], group=ring.group)
    if ring.rank != 0:
        return {}, None
    files: dict = {}
    for part, error in parts:
        if error is not None:
            return {}, error
        files.update(part)
    return files, None


def _sibling(final: str, kind: str) -> str:
    parent, name = os.path.split(final)
    return os.path.join(parent, f".{name}.{kind}")


def check_target(final: str) -> None:
    """ValueError unless `final` is new, an empty directory or a checkpoint (which saving replaces)."""
    parent = os.path.dirname(final)
    if parent and os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"path: {parent!r} exists and is not a directory; pass a directory path")
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final) or os.path.islink(final):
        raise ValueError(f"path: {final!r} exists and is not a directory; pass a new directory")
    if os.listdir(final) and not is_checkpoint(final):
        raise ValueError(
            f"path: {final!r} is a non-empty directory that holds no checkpoint (no .metadata), "
            f"which saving there would replace; pass a new or empty directory (or step= to write "
            f"{final}/step-NNNNNNNNN)"
        )


def _agree(error: Optional[BaseException], ring: Ring, what: str) -> None:
    """Rank 0's outcome to every rank of the ring (a barrier too): its error is raised on all."""
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    if ring.size > 1:
        dist.broadcast_object_list(box, src=ring.global_ranks[0], group=ring.group)
    if box[0] is not None:
        raise RuntimeError(f"save_checkpoint: rank 0 of the group failed to {what}: {box[0]}") from error


def _missing(path: str) -> list[str]:
    """`path` and the directories above it that do not exist yet, deepest first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove(path: str) -> None:
    """Hide `path` under a dot-name first (a rename is atomic), then delete it."""
    hidden = _sibling(path, "deleting")
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def _exchange(a: str, b: str) -> bool:
    """Swap the names `a` and `b` atomically (Linux renameat2 RENAME_EXCHANGE): True; False where
    the C library, kernel or file system cannot (nothing changed then)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library before glibc 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _publish(partial: str, final: str, marker: dict) -> None:
    """The marker written (fsynced) into `partial`, whose entries are then fsynced; `partial`
    renamed to `final`, and the parent's entries fsynced. An older checkpoint at `final` is
    exchanged with `partial` in one atomic step where the system can (then deleted), so that
    `final` always holds the old checkpoint or the new one; elsewhere it is renamed aside first."""
    with open(os.path.join(partial, MARKER + ".tmp"), "w") as f:
        f.write(marker_text(marker))
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(partial, MARKER + ".tmp"), os.path.join(partial, MARKER))
    fsync_dir(partial)  # the marker's name and every file DCP wrote: durable before the publishing rename
    root = os.path.dirname(final)
    if os.path.lexists(final) and _exchange(partial, final):  # partial now holds the old checkpoint
        fsync_dir(root)
        shutil.rmtree(partial)
    elif os.path.lexists(final):  # an older checkpoint of that name (check_target made sure)
        old = _sibling(final, "deleting")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        fsync_dir(root)
        shutil.rmtree(old)
    else:
        os.rename(partial, final)
        fsync_dir(root)


def _sound(path: str) -> bool:
    """Whether `path` is a published checkpoint with every file there at its recorded size (stats
    only: rotation reads no checksums)."""
    try:
        marker = read_marker(path)
        if marker is None or not os.path.isfile(os.path.join(path, METADATA)):
            return False
        check_files(path, marker, verify=False)
    except Damaged:
        return False
    return True


def _rotate(root: str, keep: int, published: str) -> None:
    """Delete all but the `keep` newest sound step-* under `root` (never `published`), and
    leftovers; fsync `root`. Damaged and incomplete steps are neither counted nor deleted, so the
    newest sound one always stays."""
    sound = [where for _, where in steps(root) if _sound(where)]
    for where in sound[keep:]:
        if where != published:
            _remove(where)
    for name in os.listdir(root):
        match = _LEFTOVER.match(name)
        if match and _STEP_DIR.match(match.group(1)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    fsync_dir(root)


def save(state: dict[str, Any], final: str, ring: Ring, marker: dict, keep: Optional[int] = None) -> None:
    """Write `state` to the directory `final` atomically and durably (see the module docstring); a collective."""
    partial = _sibling(final, "partial")
    root = os.path.dirname(final)
    leader = ring.rank == 0
    error: Optional[BaseException] = None
    created: list[str] = []
    if leader:
        try:
            created = _missing(root)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as e:
            error = e
    _agree(error, ring, f"prepare {partial}")
    writer = _Writer(partial)
    dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=ring.group)
    files, failed = _gathered_checksums(partial, writer.written, ring)
    if leader:
        try:
            if failed is not None:
                raise OSError(failed)
            files[METADATA] = file_checksums(os.path.join(partial, METADATA))
            checksums = {"algorithm": CHECKSUM, "files": dict(sorted(files.items()))}
            _publish(partial, final, dict(marker, time=time.time(), checksums=checksums))
            if keep is not None:
                _rotate(root, keep, final)
            for made in created:  # a root made by this save: its name in its parent, durable too
                fsync_dir(os.path.dirname(made))
        except OSError as e:
            error = e
    _agree(error, ring, f"publish {final}")
