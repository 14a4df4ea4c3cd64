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

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "SAVED_OP_NAMES", "selective", "explained"]

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the aten ops `names` this torch build has."""
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))


# ops whose outputs a selective graph saves: the matrix products (grouped ones included) and
# attention, every backend; and _unsafe_view, which F.linear and matmul apply to a product's output:
# a view autograd does not know as one (its own version counter), so the model's in-place change
# of it (`scores /= c`) would change the saved product unseen. Saved too (no memory: it is the
# product's storage), its change is seen and refused (see selective()).
SAVED_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_grouped_mm",
    "_scaled_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_unsafe_view",
)
# the same for operators libraries register (by qualified name: they exist once the library loaded)
SAVED_OP_NAMES = frozenset({"transformers::grouped_mm_fallback"})


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    saved = op in SAVED_OPS or op.name() in SAVED_OP_NAMES
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def selective(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """fn(*args), recorded so that its backward keeps only the outputs of SAVED_OPS (see above)."""
    return checkpoint(
        fn, *args, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, _policy)
    )


@contextlib.contextmanager
def explained() -> Iterator[None]:
    """Around a backward through selective graphs: torch's error for a saved output the model's
    forward changed in place (`y = linear(x); y.mul_(2)`) becomes a ValueError saying what to do."""
    try:
        yield
    except RuntimeError as e:
        if "selective activation checkpoint has been mutated" not in str(e):
            raise
        raise ValueError(
            "recompute='selective': the model's forward changes the output of a matrix product or "
            "of attention in place (such as `scores /= scale` after a matmul); a selective graph saves "
            "those outputs, so it cannot rerun the rest from them. Use recompute=True or False"
        ) from e
