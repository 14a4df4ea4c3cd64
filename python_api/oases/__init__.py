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
    oases.storage      checkpoints loadable at any TP degree, Hugging Face safetensors in and out
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _TYPE_CHECKING:  # what `oases.<name>` gives, for type checkers and IDEs (imported lazily below)
    from oases import amp, comm, dp, models, nn, ops, pipeline, schedule, storage
    from oases.nn import check_gradients, parallelize, summary
    from oases.storage import (
        CheckpointState,
        full_state_dict,
        load_checkpoint,
        load_full_state_dict,
        load_pretrained,
        save_adapter,
        save_checkpoint,
        save_pretrained,
        verify_checkpoint,
    )
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
    "storage",
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

# `import oases` imports no torch: a public name loads its module on first use, so the launcher
# (`python -m oases.launch`, `oases-launch`) starts in a fraction of a second where the whole
# library takes seconds (torch, Triton, torch._dynamo). Any subpackage or module (`oases.planner`,
# `oases.storage`, ...) is imported on its first `oases.<name>` likewise.
_HOMES = {
    "CheckpointState": "oases.storage",
    "full_state_dict": "oases.storage",
    "load_checkpoint": "oases.storage",
    "load_full_state_dict": "oases.storage",
    "save_checkpoint": "oases.storage",
    "verify_checkpoint": "oases.storage",
    "check_gradients": "oases.nn",
    "parallelize": "oases.nn",
    "summary": "oases.nn",
    "load_pretrained": "oases.storage",
    "save_adapter": "oases.storage",
    "save_pretrained": "oases.storage",
    "train_step": "oases.training",
}


def __getattr__(name: str) -> _Any:
    """oases.<name> not bound yet: a public function's module imported and the function returned,
    or the submodule oases.<name> imported (Python binds it here from then on). A module that
    fails to import raises its own error (an AttributeError inside it as an ImportError, so that
    `from oases import x` does not hide it)."""
    home = _HOMES.get(name)
    if home is None and (name.startswith("__") or not name.isidentifier()):
        raise AttributeError(f"module 'oases' has no attribute {name!r}")
    try:
        module = _importlib.import_module(home or f"oases.{name}")
    except ModuleNotFoundError as e:
        if home is None and e.name == f"oases.{name}":  # no such submodule
            raise AttributeError(f"module 'oases' has no attribute {name!r}") from None
        raise
    except AttributeError as e:  # a bug inside the module: not "oases has no such name"
        raise ImportError(f"importing {home or f'oases.{name}'} failed: {e!r}") from e
    return getattr(module, name) if home is not None else module


def __dir__() -> list[str]:
    return sorted(k for k in set(globals()) | set(__all__) if not k.startswith("_") or k.startswith("__"))
