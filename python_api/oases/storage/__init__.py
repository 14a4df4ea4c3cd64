"""What is stored: checkpoints of tensor-parallel models in the unsharded model's own layout, loadable
at any TP degree, and Hugging Face safetensors directories in and out.

    full = full_state_dict(tp_model)        # on every rank: what model.state_dict() of the unsharded model is
    plain_model.load_state_dict(full)       # TP=1 ...
    load_full_state_dict(tp4_model, full)   # ... or any TP degree: each rank keeps its shard
    save_checkpoint(tp_model, path, optimizer=opt, step=n, extra=..., keep=3)   # -> path/step-{n:09d}
    state = load_checkpoint(tp4_model, path, optimizer=opt4)   # the newest step-* that verifies; resume at state.step
    verify_checkpoint(path / "step-000000003")   # None, or why it would not load (every file read once)
    load_pretrained(tp_model, "llama-dir")       # each rank reads only its shards' boxes; no communication
    save_pretrained(tp_model, "out-dir")         # a collective: each sharded tensor gathered to rank 0
    save_adapter(peft_model, "adapter-dir")      # the same for a PEFT model's adapter, in PEFT's format

On disk (torch.distributed.checkpoint) no rank gathers the model: each writes the boxes of the
unsharded tensors its shards hold (oases.storage.dcp), and reads those it needs at its own TP degree.

Sharded modules are found by contract, never by type: a submodule with a `tp_layout()` method
({param_name: ShardRule}, see oases._sharding) and a `group` attribute (its process group, None
for the world) holds, for each parameter its layout lists, this rank's part of the full tensor:

    local == rule.shard(full, dist.get_rank(group), dist.get_world_size(group))
    full  == rule.unshard([local of rank 0, ..., local of rank p-1])

Everything else in the state dict (replicated parameters, buffers) is the same on every rank and
is taken as it is. Every check runs before any copy (on local metadata; a load's checks of the
checkpoint's files and checksums, oases.storage.choose, then agreed by the ranks), so a bad
model or checkpoint raises the same error on every rank, none is left waiting, and the model is
left unchanged.

The modules, by concern (the Pipeline's storage, oases.pipeline, uses their named functions):

    unsharded    the sharded entries of a model (`tp_layout()`), full_state_dict / load_full_state_dict
    keys         the entry names of a checkpoint on disk
    entries      the model's and the run's entries (format, extra, RNG states)
    optimizer    an optimizer's state as entries keyed by parameter name, and back
    checkpoint   save_checkpoint / load_checkpoint, and the steps every saver and loader shares
    choose       which checkpoint a load reads, agreed by the ranks; verify_checkpoint
    dcp          torch.distributed.checkpoint for TP shards (boxes of the unsharded tensors)
    integrity    the completion marker, checksums and the checks of a reader
    publish      a checkpoint directory's life on disk: atomic, durable publishing and rotation
    hf_files     a safetensors checkpoint's tensors under the names a model gives them
    hf_write     writing a Hugging Face directory, one tensor at a time
    pretrained   load_pretrained / save_pretrained / save_adapter
"""

from __future__ import annotations

from oases.storage.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from oases.storage.choose import verify_checkpoint
from oases.storage.pretrained import load_pretrained, save_adapter, save_pretrained
from oases.storage.unsharded import full_state_dict, load_full_state_dict

__all__ = [  # checkpoints, the unsharded state dict, Hugging Face directories
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "CheckpointState",
    "full_state_dict",
    "load_full_state_dict",
    "load_pretrained",
    "save_pretrained",
    "save_adapter",
]
