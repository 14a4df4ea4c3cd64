"""The life of a checkpoint directory on disk: where steps are published, and `save`, atomic and
durable, every step a collective over `ring` but the file operations one rank's:

    rank 0: rm -r .<name>.partial; mkdir it             -> agree (rank 0's error raised everywhere)
    all:    dcp.save(state) into .<name>.partial         (DCP writes and fsyncs each file, `.metadata` last)
    all:    crc32 of each file it wrote, whole and per stored item (offset, length)  -> gathered to rank 0
    rank 0: write oases_checkpoint.json into it (format, world size, step, every file's size and
            checksums, its own checksum; fsynced), fsync the directory; rename it to <name>
            (replacing an old <name>), fsync the parent; keep=N: hide, then delete all but the N
            newest sound step-* (never <name>), stale partials, fsync the parent  -> agree

A directory holding `.metadata` and no marker was never published: its writer died.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import time
from typing import Any, Optional

import torch.distributed as dist

from oases.comm.topology import Ring
from oases.storage.dcp import write
from oases.storage.integrity import (
    CHECKSUM,
    MARKER,
    METADATA,
    Damaged,
    check_files,
    file_checksums,
    fsync_dir,
    marker_text,
    read_marker,
)

__all__ = ["is_checkpoint", "step_dir", "steps", "check_target", "save"]

_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_LEFTOVER = re.compile(r"^\.(.+)\.(partial|deleting)$")


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
    written = write(state, partial, ring)
    files, failed = _gathered_checksums(partial, written, ring)
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
