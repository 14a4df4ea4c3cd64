"""Oases: overlapped tensor-parallel training for commodity GPU servers.

::

    oases.comm         ring all-gather / reduce-scatter / all-reduce from point-to-point ops
    oases.ops          fused, differentiable all_gather_linear / linear_reduce_scatter / linear_all_reduce
    oases.nn           ColumnParallelLinear / RowParallelLinear over those ops
    oases.parallelize  swap a model's nn.Linear layers for them, by plan or by naming scheme
    oases.summary      what parallelize made: each part's style, this rank's share of the parameters
    oases.check_gradients  raise if a gradient the ranks should hold alike differs between them
    oases.schedule     megatron / merak / cross_pass / oases training schedules for TP stacks
    oases.models       a GPT, and adapters that show Hugging Face stacks to the schedules
    oases.train_step   one step of a parallelized model (GPT, HF causal LMs, any Stack) on a schedule
    oases.amp          GradScaler whose inf/NaN check is every rank's (TP shards skip the same steps)
    oases.dp           data parallelism in your own loop: GradientSync (DDP-style buckets), ZeroOptimizer (ZeRO-1)
    oases.pipeline     Pipeline: the GPT on a (dp, pp, tp) mesh with gpipe / 1f1b / FOLD3D's aiao schedules
"""

from oases import amp, comm, dp, models, ops, pipeline, schedule
from oases.checkpoint import (
    CheckpointState,
    full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
    verify_checkpoint,
)
from oases.nn import check_gradients, parallelize, summary  # also binds the subpackage oases.nn
from oases.pretrained import load_pretrained, save_adapter, save_pretrained
from oases.training import train_step

__version__ = "0.1.0"  # the only place the version is written: setup.py parses this line
__all__ = [
    "amp",
    "comm",
    "dp",
    "ops",
    "nn",
    "parallelize",
    "summary",
    "check_gradients",
    "schedule",
    "models",
    "pipeline",
    "train_step",
    "__version__",
    "full_state_dict",
    "load_full_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
    "CheckpointState",
    "load_pretrained",
    "save_pretrained",
    "save_adapter",
]
