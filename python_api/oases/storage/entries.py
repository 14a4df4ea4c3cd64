"""A checkpoint's entries besides the optimizer's: the model's tensors and the run's (format, extra,
each rank's RNG states), as `save_checkpoint` writes them and a load reads them back.

    entries = model_entries(state, shards)        # {"model.<key>": Chunked boxes of a shard | tensor}
    entries.update(run_entries(extra, rank))      # {"oases.format": 1, "oases.extra": extra, "oases.rng.<rank>": ...}
    held = stored_model(what, stored, keys)       # the checkpoint's model entries, {key: metadata}
    small, rng = run_reads(stored, marker, ring)  # what of the run this rank reads (extra, its RNG states)
    ... dcp load ...; restore_rng(what, small[rng]) if rng is not None else warn_rng_not_restored(...)

Used by `oases.storage.checkpoint` (a model's checkpoints) and the Pipeline's (oases.pipeline).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from oases.comm.topology import Ring
from oases.storage.dcp import Chunked
from oases.storage.keys import EXTRA, FORMAT_KEY, FORMAT_VERSION, MODEL, RNG
from oases.storage.unsharded import Shard

__all__ = [
    "sharded",
    "model_entries",
    "stored_model",
    "run_entries",
    "run_reads",
    "warn_rng_not_restored",
    "restore_rng",
]


def sharded(value: torch.Tensor, s: Shard) -> Chunked:
    """`value` (shaped like the shard s.local) as its boxes of the unsharded tensor."""
    return Chunked(value.detach(), tuple(s.rule.chunks(s.full_shape, s.rank, s.size)), s.full_shape)


def model_entries(state: Mapping[str, torch.Tensor], shards: Mapping[str, Shard], prefix: str = MODEL) -> dict:
    """{prefix + key: the boxes of the unsharded tensor (`sharded`) for a key in `shards`, else the
    tensor itself (replicated)} of the state dict `state`; prefix "" for a checkpoint of older oases."""
    return {prefix + key: sharded(value, shards[key]) if key in shards else value for key, value in state.items()}


def stored_model(what: str, stored: dict, keys: Optional[Iterable[str]] = None) -> dict:
    """{model key: metadata} of the checkpoint's model entries (a checkpoint of older oases, without
    FORMAT_KEY, holds them at the top level); a ValueError naming those of `keys` (default: all of
    them) that are not tensors there."""
    held = {key[len(MODEL) :]: meta for key, meta in stored.items() if key.startswith(MODEL)}
    held = held if FORMAT_KEY in stored else stored
    keys = held if keys is None else keys
    non_tensors = [key for key in keys if key in held and not isinstance(held[key], TensorStorageMetadata)]
    if non_tensors:
        raise ValueError(f"{what}: {', '.join(non_tensors)} are not tensors there")
    return held


def run_entries(extra: Any, rank: int) -> dict[str, Any]:
    """The entries of a checkpoint besides model and optimizer: the format, `extra`, this rank's RNG."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {
        FORMAT_KEY: FORMAT_VERSION,
        EXTRA: extra,
        f"{RNG}{rank}": {"cpu": torch.get_rng_state(), "cuda": cuda},
    }


def run_reads(stored: dict, marker: Optional[dict], ring: Ring) -> tuple[dict[str, None], Optional[str]]:
    """({EXTRA: None[, this rank's RNG entry: None]}: the run's entries this rank reads, its RNG
    entry or None): the RNG states are read when the group that saved had as many ranks as `ring`."""
    rng = f"{RNG}{ring.rank}"
    if marker is None or marker.get("world_size") != ring.size or rng not in stored:
        return {EXTRA: None}, None
    return {EXTRA: None, rng: None}, rng


def warn_rng_not_restored(what: str, marker: dict, size: int) -> None:
    """The warning of a load whose group has another size than the one that saved (`run_reads`)."""
    warnings.warn(
        f"load_checkpoint: {what} was saved by {marker.get('world_size')} ranks, this group has {size}: "
        f"RNG states not restored"
    )


def restore_rng(what: str, saved: dict) -> None:
    """This rank's CPU and CUDA RNG states from its RNG entry (CUDA's only with as many GPUs: else a warning)."""
    torch.set_rng_state(saved["cpu"])
    if saved["cuda"] is None:
        return
    if torch.cuda.is_available() and len(saved["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(saved["cuda"])
    else:
        warnings.warn(
            f"load_checkpoint: {what} holds the RNG states of {len(saved['cuda'])} GPUs, this rank sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: CUDA RNG not restored"
        )
