"""Which checkpoint a load reads: the one a path or step names, or the newest under a root that
verifies, agreed by every rank of the group before anything is read into the model.

    candidates = [path]                        if path holds a checkpoint (.metadata or a marker)
               | [root/step-{step:09d}]        with step=
               | root/step-* newest first      else                  (rank 0's listing, broadcast)
    for where in candidates:
        each rank, locally (oases.storage.integrity):
            marker present (else: incomplete), readable, matching its own checksum; its format ours
            every file it records there at its size, no foreign .distcp; .metadata's checksum (verify)
            .metadata unpickled (trusted=False: DCP's records only); every file it places items in long enough for them
            prepare(where, stored, marker): the caller's checks of the model and optimizer
                against it, and what this rank will read ({key: boxes | None})
            the checksum of every stored item this rank reads (verify); the small entries unpickled
            (trusted=False: torch.load(weights_only=True); anything else raises, naming the entry)
        all-gather the verdicts: an error (a model that does not fit, ...) raised on every rank;
            a damaged file on any rank -> every rank takes the next candidate (an explicit one
            raises, naming the file and why)
    rank 0: one warning naming each skipped step, its file and why; the chosen one is returned

So no rank reads a byte into the model before every rank has verified what it will read, and
all ranks load the same step or raise the same error (never one raising while others wait).
"""

from __future__ import annotations

import builtins
import os
import warnings
from typing import Any, Callable, Optional, TypeVar, Union

import torch.distributed as dist

from oases.comm.topology import Ring, ring_of
from oases.storage import dcp, integrity
from oases.storage.integrity import MARKER, Damaged
from oases.storage.keys import FORMAT_KEY, FORMAT_VERSION
from oases.storage.publish import is_checkpoint, step_dir, steps

__all__ = ["Prepare", "wants_of", "choose_checkpoint", "verify_checkpoint"]

T = TypeVar("T")

# prepare(where, stored metadata {key: meta}, marker | None) -> (result, small: {key: None} the rank
# reads alone (pickled entries), wants: {key: boxes | None} of everything it reads, small ones too)
Prepare = Callable[[str, dict, Optional[dict]], "tuple[T, dict[str, Any], dict[str, Any]]"]


def wants_of(entries: dict[str, Any]) -> dict[str, Any]:
    """{key: the boxes a `Chunked` value reads, or None (all of it)} of a DCP state dict."""
    return {key: value.chunks if isinstance(value, dcp.Chunked) else None for key, value in entries.items()}


def _candidates(path: str, step: Optional[int]) -> list[tuple[str, bool]]:
    """[(directory, explicit)] to try, newest first; FileNotFoundError / ValueError naming the path."""
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"path: {path!r} is not a directory; pass a checkpoint directory written by "
            f"oases.save_checkpoint, or the root holding its step-NNNNNNNNN checkpoints"
        )
    if step is not None:
        if is_checkpoint(path):
            raise ValueError(
                f"step: {path!r} is a checkpoint directory itself; pass the root holding its "
                f"step-NNNNNNNNN directories with step=, or the directory alone"
            )
        where = step_dir(path, step)
        if not os.path.isdir(where):
            held = ", ".join(str(n) for n, _ in steps(path)) or "none"
            raise FileNotFoundError(f"step: no checkpoint {where!r} (steps under {path!r}: {held})")
        return [(where, True)]
    if is_checkpoint(path):
        return [(path, True)]
    return [(where, False) for _, where in steps(path)]


def _shared(value: Any, ring: Ring) -> Any:
    """Rank 0's `value` on every rank of the ring."""
    box = [value]
    if ring.size > 1:
        dist.broadcast_object_list(box, src=ring.global_ranks[0], group=ring.group)
    return box[0]


def _check_format(where: str, marker: dict) -> None:
    """ValueError unless the marker's format is one this oases reads."""
    if marker.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"path: checkpoint {where!r} has format {marker.get('format')!r} in its {MARKER}, this oases "
            f"reads format {FORMAT_VERSION}: written by another oases version; load it with that one"
        )


def _verify_one(
    where: str, explicit: bool, verify: bool, trusted: bool, prepare: Prepare
) -> tuple[dict, Optional[dict], Any, dict[str, Any]]:
    """This rank's local verification of `where` (see the module doc): (stored, marker, prepared,
    small) or `Damaged`; the caller's and format errors propagate."""
    marker = integrity.read_marker(where)
    if marker is None and not explicit:
        raise Damaged(MARKER, "missing: incomplete, its writer died before publishing it")
    if marker is not None:
        _check_format(where, marker)
        integrity.check_files(where, marker, verify)
    metadata = dcp.read_metadata(where, trusted)
    integrity.check_extents(where, metadata)  # what .metadata places in each file fits in it (any checkpoint)
    stored = metadata.state_dict_metadata
    if marker is None and FORMAT_KEY in stored:
        raise ValueError(
            f"path: checkpoint {where!r} is incomplete (no {MARKER}: its writer died before "
            f"publishing it); load an earlier one, or the root directory to pick the newest complete one"
        )
    prepared, small, wants = prepare(where, stored, marker)
    if marker is not None and verify:
        integrity.check_reads(where, marker, metadata, wants)
    if small:
        try:
            dcp.read_local(small, where, trusted)
        except dcp.Untrusted:
            raise
        except Exception as e:  # noqa: BLE001 -- a damaged pickle raises anything
            files = sorted(integrity.stored_items(metadata, dict.fromkeys(small)))
            raise Damaged(", ".join(files) or integrity.METADATA, f"unreadable ({type(e).__name__}: {e})") from e
    return stored, marker, prepared, small


def _raise_agreed(verdicts: list, mine: Optional[BaseException]) -> None:
    """Raise the error of the first rank that had one: this rank's own exception if it had one,
    else the same type with that rank's message."""
    if mine is not None:
        raise mine
    r, (_, name, message) = next((r, v) for r, v in enumerate(verdicts) if v[0] == "error")
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    raise cls(f"{message} (on rank {r} of the group)")


def choose_checkpoint(
    path: str, step: Optional[int], ring: Ring, verify: bool, prepare: Prepare, trusted: bool = True
) -> tuple[str, dict, Optional[dict], Any, dict[str, Any]]:
    """(where, stored metadata, marker | None, prepare's result, the small entries read) of the
    checkpoint to load, the same on every rank of `ring` (a collective; see the module doc)."""
    try:
        listed: Any = _candidates(path, step) if ring.rank == 0 else None
    except (OSError, ValueError) as e:
        listed = e
    listed = _shared(listed, ring)
    if isinstance(listed, BaseException):
        raise listed
    skipped: list[tuple[str, str]] = []  # (step directory, why: file, reason, which rank found it)
    incomplete = True  # every skipped one merely unpublished (no marker), none damaged
    for where, explicit in listed:
        mine: Optional[BaseException] = None
        try:
            chosen = _verify_one(where, explicit, verify, trusted, prepare)
            verdict: tuple = ("ok", "", "")
        except Damaged as e:
            verdict = ("damaged", e.file, e.reason)
        except Exception as e:  # noqa: BLE001 -- agreed below, raised on every rank
            named = next(c for c in type(e).__mro__ if getattr(builtins, c.__name__, None) is c)  # ValueError, ...
            mine, verdict = e, ("error", named.__name__, str(e))
        verdicts = [verdict]
        if ring.size > 1:
            verdicts = [None] * ring.size
            dist.all_gather_object(verdicts, verdict, group=ring.group)
        if any(v[0] == "error" for v in verdicts):
            _raise_agreed(verdicts, mine)
        damaged = [(r, v) for r, v in enumerate(verdicts) if v[0] == "damaged"]
        if not damaged:
            if skipped and ring.rank == 0:
                listing = "; ".join(f"{directory} ({why})" for directory, why in skipped)
                warnings.warn(
                    f"load_checkpoint: skipped checkpoints that do not verify: {listing}; loading {where}",
                    UserWarning,
                    stacklevel=3,
                )
            return (where, *chosen)
        r, (_, file, reason) = damaged[0]
        why = f"{file}: {reason}" + (f", found by rank {r} of the group" if ring.size > 1 else "")
        if explicit:
            raise ValueError(
                f"path: checkpoint {where!r} cannot be loaded: {why}; load another step, or the root "
                f"directory to take the newest one that verifies"
            )
        skipped.append((where, why))
        incomplete = incomplete and file == MARKER and reason.startswith("missing")
    if skipped and not incomplete:
        listing = "; ".join(f"{directory} ({why})" for directory, why in skipped)
        raise ValueError(f"path: no checkpoint in {path!r} verifies: {listing}")
    unpublished = f"; incomplete ones (no {MARKER}): {', '.join(w for w, _ in skipped)}" if skipped else ""
    raise FileNotFoundError(
        f"path: no checkpoint in {path!r}: looked for a DCP checkpoint there (a .metadata "
        f"file) and for complete step-NNNNNNNNN subdirectories{unpublished}"
    )


def verify_checkpoint(path: Union[str, os.PathLike], *, group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
    """Why the checkpoint directory `path` would not load, or None when it verifies whole.

    ::

        every rank: the marker present, readable, its own checksum right, its format this one's;
                    every file it records at its size, no foreign .distcp     (stats)
        rank r of p: the whole-file crc32 of every p-th recorded file from the r-th (by name)
        all-gather the verdicts: None, or the first damaged file and why (found by rank r)

    A collective over `group` (default: the world) that reads every file once between the ranks
    and nothing into a model: for choosing a checkpoint before anything is built to load it
    into (OasesTrainer's `resume_from_checkpoint=True`). `load_checkpoint` verifies what it
    reads itself; a directory this calls sound can still be refused there for not fitting the
    model. A checkpoint of older oases (no checksums) verifies by its files' presence.
    """
    ring = ring_of(group)
    where = os.fspath(path)
    try:
        marker = integrity.read_marker(where)
        if marker is None:
            raise Damaged(MARKER, "missing: incomplete, its writer died before publishing it")
        if marker.get("format") != FORMAT_VERSION:
            raise Damaged(MARKER, f"format {marker.get('format')!r}, this oases reads {FORMAT_VERSION}")
        integrity.check_files(where, marker, verify=False)
        integrity.check_share(where, marker, ring.rank, ring.size)
        mine: Optional[str] = None
    except Damaged as e:
        mine = f"{e.file}: {e.reason}"
    verdicts = [mine]
    if ring.size > 1:
        verdicts = [None] * ring.size
        dist.all_gather_object(verdicts, mine, group=ring.group)
    for r, verdict in enumerate(verdicts):
        if verdict is not None:
            return verdict + (f", found by rank {r} of the group" if ring.size > 1 else "")
    return None
