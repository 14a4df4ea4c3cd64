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
    all:    dcp.save(state) into .<name>.partial         (DCP writes `.metadata` last)
    rank 0: write oases_checkpoint.json into it; rename it to <name> (replacing an old <name>);
            keep=N: hide, then delete all but the N newest complete step-* (never <name>), stale partials
                                                         -> agree
A directory holding `.metadata` and no marker was never published: its writer died.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from oases._sharding import Chunk
from oases.comm._topology import Ring

MARKER = "oases_checkpoint.json"  # the completion marker, written last, before publishing
FORMAT_KEY = "oases.format"  # a DCP entry every checkpoint of this format holds (absent in older ones)
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_LEFTOVER = re.compile(r"^\.(.+)\.(partial|deleting)$")


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

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

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


def read_metadata(path: str) -> Metadata:
    """The checkpoint's DCP metadata ({key: shape, dtype, chunks | bytes}), read locally."""
    return dcp.FileSystemReader(path).read_metadata()


def read_marker(path: str) -> Optional[dict]:
    """The completion marker's content, or None when there is none (never published)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def _complete(path: str) -> bool:
    return _is_checkpoint(path) and os.path.isfile(os.path.join(path, MARKER))


def step_dir(root: str, step: int) -> str:
    """Where step `step` of the checkpoints under `root` is published."""
    return os.path.join(root, f"step-{step:09d}")


def _steps(root: str) -> list[tuple[int, str]]:
    """[(step, directory)] of the step-* directories under `root`, newest (highest step) first."""
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def find(path: str) -> str:
    """The checkpoint directory `path` names: itself if it is one, else its newest complete step-*.

    path/.metadata exists                  -> path
    else the highest N with path/step-N complete (.metadata and marker); newer incomplete ones
    are skipped with a warning
    nothing                                -> FileNotFoundError naming what was looked for
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"path: {path!r} is not a directory; pass a checkpoint directory written by "
            f"oases.save_checkpoint, or the root holding its step-NNNNNNNNN checkpoints"
        )
    if _is_checkpoint(path):
        return path
    skipped = []
    for _, where in _steps(path):
        if _complete(where):
            if skipped:
                warnings.warn(
                    f"load_checkpoint: skipped incomplete checkpoints (no {MARKER}: their writer "
                    f"died before publishing them): {', '.join(skipped)}; loading {where}",
                    UserWarning,
                    stacklevel=3,
                )
            return where
        skipped.append(where)
    incomplete = f"; incomplete ones (no {MARKER}): {', '.join(skipped)}" if skipped else ""
    raise FileNotFoundError(
        f"path: no checkpoint in {path!r}: looked for a DCP checkpoint there (a .metadata "
        f"file) and for complete step-NNNNNNNNN subdirectories{incomplete}"
    )


def read_local(state: dict[str, Any], path: str) -> None:
    """dcp.load(state) by this rank alone, no communication (for the small pickled entries)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=LoadPlanner(), no_dist=True)


def load(state: dict[str, Any], path: str, ring: Ring) -> None:
    """dcp.load(state) over `ring`'s group: tensors and `Chunked` boxes are filled in place."""
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=LoadPlanner(), process_group=ring.group)


# --- writing ----------------------------------------------------------------------------------------


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
    if os.listdir(final) and not _is_checkpoint(final):
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


def _remove(path: str) -> None:
    """Hide `path` under a dot-name first (a rename is atomic), then delete it."""
    hidden = _sibling(path, "deleting")
    os.rename(path, hidden)
    shutil.rmtree(hidden)


def _publish(partial: str, final: str, marker: dict) -> None:
    with open(os.path.join(partial, MARKER + ".tmp"), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(partial, MARKER + ".tmp"), os.path.join(partial, MARKER))
    if os.path.lexists(final):  # an older checkpoint of that name (check_target made sure)
        old = _sibling(final, "deleting")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old)
    else:
        os.rename(partial, final)


def _rotate(root: str, keep: int, published: str) -> None:
    """Delete all but the `keep` newest complete step-* under `root` (never `published`), and leftovers."""
    complete = [where for _, where in _steps(root) if _complete(where)]
    for where in complete[keep:]:
        if where != published:
            _remove(where)
    for name in os.listdir(root):
        match = _LEFTOVER.match(name)
        if match and _STEP_DIR.match(match.group(1)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save(state: dict[str, Any], final: str, ring: Ring, marker: dict, keep: Optional[int] = None) -> None:
    """Write `state` to the directory `final` atomically (see the module docstring); a collective."""
    partial = _sibling(final, "partial")
    leader = ring.rank == 0
    error = None
    if leader:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as e:
            error = e
    _agree(error, ring, f"prepare {partial}")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), planner=SavePlanner(), process_group=ring.group)
    if leader:
        try:
            _publish(partial, final, dict(marker, time=time.time()))
            if keep is not None:
                _rotate(os.path.dirname(final), keep, final)
        except OSError as e:
            error = e
    _agree(error, ring, f"publish {final}")
