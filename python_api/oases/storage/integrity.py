"""A checkpoint's integrity: the completion marker, its checksums, and the checks of a reader.

The marker (`MARKER`, written last by `oases.storage.publish.save`) records every file the
checkpoint holds, with its size and crc32, whole and per stored item (offset, length), and its own
checksum. A reader checks sizes (a stat per file: truncated, missing, or foreign files,
`check_files`, `check_extents`) and checksums, of `.metadata` and of each stored item it reads
(`check_reads`: a rank reading slices, as in a reshard, verifies only the items it reads).
zlib.crc32 runs at ~2 GiB/s on one core here; a save re-reads each rank's own files (page cache)
and checksums them whole and by item in one pass (~0.11 s per 100 MiB), a verified load reads
what the rank then reads again (`python -m bench checkpoint`). A damaged file raises `Damaged`.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from torch.distributed.checkpoint.metadata import Metadata

from oases._sharding import Chunk

__all__ = [
    "MARKER",
    "METADATA",
    "CHECKSUM",
    "Damaged",
    "file_checksums",
    "fsync_dir",
    "fsync_file",
    "marker_text",
    "read_marker",
    "check_files",
    "check_share",
    "check_extents",
    "stored_items",
    "check_reads",
]

MARKER = "oases_checkpoint.json"  # the completion marker, written last, before publishing
METADATA = ".metadata"  # DCP's metadata file
CHECKSUM = "crc32"  # zlib.crc32, the algorithm the marker names
_SELF_CHECKSUM = "marker_crc32"  # the marker's checksum of its own other entries
_BLOCK = 1 << 24  # bytes read at a time while checksumming


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


def _size(path: str, name: str) -> int:
    """The size of the checkpoint's file `name`; `Damaged` when it is missing or cannot be stat'ed."""
    try:
        return os.stat(os.path.join(path, name)).st_size
    except FileNotFoundError:
        raise Damaged(name, "missing (deleted, or never copied)") from None
    except OSError as e:
        raise Damaged(name, f"unreadable ({e.strerror or e})") from e


def _check_whole(path: str, name: str, files: dict) -> None:
    """`Damaged` unless the checkpoint's file `name` has the whole-file checksum `files` records
    (a KeyError or TypeError where that record is malformed)."""
    try:
        crc = file_checksums(os.path.join(path, name))[CHECKSUM]
    except OSError as e:
        raise Damaged(name, f"unreadable ({e.strerror or e})") from e
    if crc != files[name][CHECKSUM]:
        raise Damaged(name, f"checksum: {CHECKSUM} {crc:#010x}, {files[name][CHECKSUM]:#010x} was written (corrupted)")


def check_files(path: str, marker: dict, verify: bool = True) -> None:
    """`Damaged` unless every file the marker records is in `path` with its recorded size, no
    `.distcp` file it does not record is there (another run's or world size's), and, with
    `verify`, `.metadata` has its recorded checksum. A stat per file, and one read of `.metadata`."""
    files = _recorded(marker)
    if files is None:
        return
    try:
        for name, entry in files.items():
            size = _size(path, name)
            if size != entry["size"]:
                raise Damaged(name, f"size {size} bytes, {entry['size']} were written (truncated, or another file)")
        foreign = sorted(name for name in os.listdir(path) if name.endswith(".distcp") and name not in files)
        if foreign:
            raise Damaged(foreign[0], "foreign: not written by this checkpoint (another run's or world size's file)")
        if verify:
            _check_whole(path, METADATA, files)
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
        _check_whole(path, name, files)


def check_extents(path: str, metadata: Metadata) -> None:
    """`Damaged` unless every file `.metadata` places items in is in `path` and long enough to hold
    them: a size check for any DCP checkpoint, one without checksums (older oases) too."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = _size(path, name)
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
