"""Selective recomputation: a kept sublayer graph that saves only its GEMMs' and attention's outputs.

::

    part = core(h, ctx)                   # recompute=False: autograd keeps every tensor the
                                          # backward needs
    part = selective(core, h, ctx)        # recompute="selective": the same values; kept are the
                                          # inputs and the outputs of the matrix products and of
                                          # scaled_dot_product_attention; every other tensor the
                                          # backward needs (norm statistics, rotary products, the
                                          # activation's input and output, casts) is recomputed
                                          # from those when the backward reaches it

Megatron's and torchtitan's "selective" activation checkpointing: the FLOPs stay (no GEMM runs
twice); the memory of the element-wise intermediates goes. It is torch.utils.checkpoint with a
selective policy (non-reentrant; the RNG state is restored for the rerun); the recomputed ops are
deterministic, so gradients equal those of the kept graph bit for bit.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "selective"]

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the aten ops `names` this torch build has."""
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


# ops whose outputs a selective graph saves: the matrix products and attention (every backend)
SAVED_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args), recorded so that its backward keeps only the outputs of SAVED_OPS (see above)."""
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))
