"""torch.compile's wrapper, seen through: the module a compiled model was made from.

    original_module(torch.compile(m)) is m;   original_module(m) is m for any other m

oases.parallelize shards the original in place (the compiled wrapper then traces the sharded
model on its next call), and oases.train_step runs its schedule on the original's modules (the
schedule calls sublayers one by one, not the compiled forward).
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["original_module"]


def original_module(model: object) -> object:
    """`model._orig_mod` for a torch.compile'd nn.Module (OptimizedModule), else `model`."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(model, nn.Module) and isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return inner
    return model
