"""Argument checks shared across the package (the one home of the checks more than one module makes).

Every check runs on local metadata only (shapes, dtypes, devices), so under SPMD every rank
raises the same error before any communication starts and no rank is left waiting.
"""

from __future__ import annotations

from typing import Any, Collection, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def is_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool (True is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def one_of(name: str, value: Any, choices: Collection[str]) -> None:
    """ValueError naming `name` unless `value` is one of `choices` (listed sorted in the message)."""
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {sorted(choices)}")


def from_transformers(module: Any) -> bool:
    """Whether `module`'s class (or a base of it) comes from Hugging Face transformers."""
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def floating(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}; cast it with .float()")


def same_dtype_device(name: str, t: Optional[torch.Tensor], ref_name: str, ref: torch.Tensor) -> None:
    if t is None:
        return
    floating(name, t)
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} differs from {ref_name}'s {ref.dtype}; cast one with .to()")
    if t.device != ref.device:
        raise ValueError(f"{name}: on {t.device} but {ref_name} is on {ref.device}; move one with .to()")


def chunks_arg(chunks: int) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks: expected an int >= 1 (or None to let the op choose), got {chunks!r}")
    if chunks < 1:
        raise ValueError(f"chunks: must be >= 1, got {chunks}")


def normalize_dim(name: str, t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0:
        raise ValueError(f"{name}: a 0-d tensor has no dimension to shard; reshape it to at least 1-d")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim: {dim} is out of range for {name} with shape {tuple(t.shape)}")
    return dim % t.dim()


def divisible(what: str, size: int, world_size: int, chunks: int) -> None:
    """`size` (a sharded length) must split into `chunks` equal pieces."""
    if size % chunks:
        raise ValueError(
            f"{what}: size {size} is not divisible by chunks={chunks} (world size {world_size}); "
            f"pick chunks dividing {size}, or pad"
        )


def full_divisible(what: str, size: int, world_size: int, chunks: int) -> None:
    """`size` (an unsharded length) must split into world_size * chunks equal pieces."""
    if size % world_size:
        raise ValueError(
            f"{what}: size {size} is not divisible by the world size {world_size}; pad it to a multiple of {world_size}"
        )
    divisible(what + " per rank", size // world_size, world_size, chunks)


def weight_bias(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    floating("weight", weight)
    same_dtype_device("weight", weight, "x", x)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight: in_features {weight.shape[1]} does not match x's last dimension {x.shape[-1]} "
            f"(x {tuple(x.shape)}, weight {tuple(weight.shape)}); weight must be [out, {x.shape[-1]}]"
        )
    if bias is not None:
        same_dtype_device("bias", bias, "x", x)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def sharded_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dim: int) -> int:
    """Checks of an op that gathers or scatters x along `dim` around a linear; returns dim >= 0."""
    floating("x", x)
    weight_bias(x, weight, bias)
    dim = normalize_dim("x", x, dim)
    if dim == x.dim() - 1:
        raise ValueError(
            f"dim: {op} shards a non-feature dimension; x's last dimension is the features "
            "(use linear_all_reduce for feature-sharded inputs)"
        )
    return dim


def process_group(group: object, name: str = "group") -> Optional[dist.ProcessGroup]:
    """The process group an argument names: a 1-D DeviceMesh's (as torch's parallelize_module
    takes `mesh["tp"]`), else the argument itself (a ProcessGroup, or None: the world).

    Raises ValueError for a DeviceMesh of several dimensions, naming them."""
    if not isinstance(group, DeviceMesh):
        return group  # type: ignore[return-value]
    if group.ndim != 1:
        names = group.mesh_dim_names or tuple(range(group.ndim))
        raise ValueError(
            f"{name}: a {group.ndim}-D DeviceMesh (dimensions {names}); pass the one dimension this group "
            f"spans, e.g. mesh[{names[-1]!r}]"
        )
    return group.get_group()
