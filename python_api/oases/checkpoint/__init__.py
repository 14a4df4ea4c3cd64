"""Checkpoints of tensor-parallel models in the unsharded model's own layout, loadable at any TP degree.

    full = full_state_dict(tp_model)        # on every rank: what model.state_dict() of the unsharded model is
    plain_model.load_state_dict(full)       # TP=1 ...
    load_full_state_dict(tp4_model, full)   # ... or any TP degree: each rank keeps its shard
    save_checkpoint(tp_model, path, optimizer=opt, step=n, extra=..., keep=3)   # -> path/step-{n:09d}
    state = load_checkpoint(tp4_model, path, optimizer=opt4)   # the newest step-* that verifies; resume at state.step
    verify_checkpoint(path / "step-000000003")   # None, or why it would not load (every file read once)

On disk (torch.distributed.checkpoint) no rank gathers the model: each writes the boxes of the
unsharded tensors its shards hold (oases._dcp), and reads those it needs at its own TP degree.

Sharded modules are found by contract, never by type: a submodule with a `tp_layout()` method
({param_name: ShardRule}, see oases._sharding) and a `group` attribute (its process group, None
for the world) holds, for each parameter its layout lists, this rank's part of the full tensor:

    local == rule.shard(full, dist.get_rank(group), dist.get_world_size(group))
    full  == rule.unshard([local of rank 0, ..., local of rank p-1])

Everything else in the state dict (replicated parameters, buffers) is the same on every rank and
is taken as it is. Every check runs before any copy (on local metadata; a load's checks of the
checkpoint's files and checksums, oases.checkpoint._select, then agreed by the ranks), so a bad
model or checkpoint raises the same error on every rank, none is left waiting, and the model is
left unchanged.
"""

from __future__ import annotations

from oases.checkpoint._disk import CheckpointState, load_checkpoint, save_checkpoint
from oases.checkpoint._select import verify_checkpoint
from oases.checkpoint._unsharded import full_state_dict, load_full_state_dict

__all__ = [
    "full_state_dict",
    "load_full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "CheckpointState",
]
