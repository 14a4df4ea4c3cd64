"""RowParallelLinear: nn.Linear with its input features sharded over the ranks of a group.

The second of Megatron's pair (`oases.nn.layers` describes the pair; `oases.nn.column` holds the first).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import ops
from oases._checks import process_group
from oases._sharding import ShardRule, row_shard
from oases.comm.topology import ring_of
from oases.nn._from_full import _from_conv1d, _from_linear
from oases.nn._fusion import _linear, _main_grad
from oases.nn._layer_args import _check_flag, _check_transposed, _resolve_chunks, check_shardable
from oases.nn.mappings import copy_to_tp, reduce_from_tp, split_to_tp
from oases.ops import linear_unread

__all__ = ["RowParallelLinear", "outputs_made"]


class RowParallelLinear(nn.Module):
    """nn.Linear with its input features sharded over the ranks of `group` (row parallel).

    ::

        weight [out, in/p] = W[:, r*in/p : (r+1)*in/p],  bias [out] (replicated, added once)
        forward(x):
            input_is_parallel=False:  x = split_to_tp(x)           # [..., in] -> [..., in/p]; bwd: all-gather
            sequence_parallel=False:  x [..., in/p]  ->  z [..., out] (replicated)
                z = linear_all_reduce(x, weight, bias)             # bwd: no communication
            sequence_parallel=True:   x [s, b, in/p]  ->  z [s/p, b, out] (shard of the sequence)
                z = linear_reduce_scatter(x, weight, copy_to_tp(bias), dim=0)
                                                                   # bwd: grad_x all-gathered,
                                                                   # grad_bias all-reduced (full)

    Args:
        in_features: the full layer's input features, sharded over `group`.
        out_features: the full layer's output features.
        bias: whether the layer has a bias (replicated, added once).
        group: the tensor-parallel process group (default None: the world).
        input_is_parallel: the input is already this rank's [..., in/p] (default True; False: split here).
        sequence_parallel: reduce-scatter the output to this rank's slice of the sequence, [s/p, b, out].
        chunks: pieces for the fused op's overlap (None: the op chooses).
        transposed: the weight kept in a Conv1D's layout, [in/p, out] (default False: [out, in/p]).
        gradient_accumulation_fusion: the weight's gradient goes to weight.main_grad in fp32.
        device: where the parameters are allocated, as for nn.Linear.
        dtype: the parameters' dtype, as for nn.Linear.

    See the layers guide (docs/guides/parallelize.md, section "The parallel layers in detail").
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Optional[dist.ProcessGroup] = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        chunks: Optional[int] = None,
        transposed: bool = False,
        gradient_accumulation_fusion: bool = False,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        _check_flag(type(self).__name__, "gradient_accumulation_fusion", gradient_accumulation_fusion)
        _check_transposed(type(self).__name__, transposed, gradient_accumulation_fusion)
        self.transposed = transposed
        group = process_group(group)  # a 1-D DeviceMesh: its group
        ring = ring_of(group)
        check_shardable(type(self).__name__, "in_features", in_features, ring.size)
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.in_features, self.out_features = in_features, out_features
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.chunks = _resolve_chunks(chunks)
        self._communicate = True  # False only inside no_tp_communication
        self._added: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # oases.nn.column.adding
        self._made: Optional[list] = None  # inside outputs_made: (output, grad_fn, version) of each forward
        self._unread = False  # inside outputs_made(unread=True): no GEMM
        self._output_read = False  # a model's forward reads this layer's output (oases.models._branch)
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)  # nn.Linear's init
        w = full.weight.detach()
        self.weight = nn.Parameter(self.shard(w.t() if transposed else w).clone())  # [out, in/p] ([in/p, out])
        if bias:
            self.bias = nn.Parameter(full.bias.detach().clone())  # [out], the same on every rank
        else:
            self.register_parameter("bias", None)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full [out, in] weight (a view); transposed: its rows of [in, out]."""
        if self.transposed:
            return full.chunk(self.world_size, dim=0)[self.rank]
        return row_shard(full, self.rank, self.world_size)

    def dense_weight(self) -> torch.Tensor:
        """The weight as F.linear takes it, [out, in/p] (a view of a transposed layer's [in/p, out])."""
        return self.weight.t() if self.transposed else self.weight

    def tp_layout(self) -> dict[str, ShardRule]:
        """How this layer's parameters cut the full layer's: the weight's columns (a transposed
        layer's rows); the bias is replicated."""
        return {"weight": ShardRule(0 if self.transposed else 1)}

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup] = None, **kw) -> "RowParallelLinear":
        """This rank's shard of `linear` (values copied): its partial product, reduced, is `linear`'s.

        Args:
            linear: the full nn.Linear (its values and requires_grad flags are copied).
            group: the tensor-parallel process group (default None: the world).
            **kw: the constructor's other keyword arguments (input_is_parallel, sequence_parallel, ...).

        Returns:
            A RowParallelLinear on `linear`'s device and dtype, holding this rank's shard.
        """
        return _from_linear(cls, linear, group, kw, shard_bias=False)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, group: Optional[dist.ProcessGroup] = None, **kw) -> "RowParallelLinear":
        """This rank's shard of a Hugging Face Conv1D (weight [in, out]), kept in its layout: weight
        [in/p, out]; its partial product, reduced, is x @ conv.weight + conv.bias.

        Args:
            conv: the full Conv1D (its values and requires_grad flags are copied).
            group: the tensor-parallel process group (default None: the world).
            **kw: the constructor's other keyword arguments (transposed is True).

        Returns:
            A transposed RowParallelLinear on `conv`'s device and dtype, holding this rank's shard.
        """
        return _from_conv1d(cls, conv, group, kw, shard_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in/p] ([..., in] without input_is_parallel) -> z [..., out], replicated (with
        sequence_parallel [s/p, b, out]); under no_tp_communication, this rank's partial sum without bias."""
        main_grad = _main_grad(self)
        weight = self.dense_weight()
        if not self._communicate:
            if self._made is None:
                return self._with_added(x, _linear(x, weight, None, main_grad))  # partial sum; the caller reduces
            # inside outputs_made; unread: a graph to differentiate only, no GEMM
            y = linear_unread(x, weight, main_grad=main_grad) if self._unread else _linear(x, weight, None, main_grad)
            y = self._with_added(x, y)
            self._made.append((y, y.grad_fn, y._version))
            return y
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group)  # [..., in/p]
        if self._added is not None:  # adding(): the term joins this rank's partial sum, one reduction of both
            if self.sequence_parallel:
                raise ValueError(
                    f"{type(self).__name__}: an added term (adding()) is not supported with sequence_parallel"
                )
            z = reduce_from_tp(self._with_added(x, _linear(x, weight, None, main_grad)), self.group)
            return z if self.bias is None else z + self.bias
        if self.sequence_parallel:
            # Each rank's grad_bias covers its s/p rows only: copy_to_tp sums it over the ranks.
            bias = None if self.bias is None else copy_to_tp(self.bias, self.group)
            return ops.linear_reduce_scatter(
                x, weight, bias, self.group, dim=0, chunks=self.chunks, main_grad=main_grad
            )
        return ops.linear_all_reduce(x, weight, self.bias, self.group, chunks=self.chunks, main_grad=main_grad)

    def _with_added(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (this rank's partial sum) plus the term adding() gave, from this rank's input x_r."""
        return y if self._added is None else y + self._added(x).to(y.dtype)

    def extra_repr(self) -> str:
        """The sizes, this rank's shard and the options."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.world_size} (rank {self.rank}: in_features "
            f"{self.weight.shape[1]}), input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}, chunks={self.chunks}"
            + (", transposed=True (Conv1D layout)" if self.transposed else "")
            + (", gradient_accumulation_fusion=True" if self.gradient_accumulation_fusion else "")
        )


@contextlib.contextmanager
def outputs_made(layers: Sequence[RowParallelLinear], unread: bool) -> Iterator[list[list[tuple]]]:
    """Inside (and inside no_tp_communication), each of `layers` records (output, output.grad_fn,
    output._version) of its forwards in its list of the yielded lists, so the caller can see what the model did
    with the output after the layer. `unread`: the layers return their partial sum's graph
    without its value (oases.ops.linear_unread: zeros, no GEMM, F.linear's gradients), for a
    caller that checks nothing read it. Restores each layer on exit."""
    made: list[list[tuple]] = [[] for _ in layers]
    for layer, outputs in zip(layers, made):
        layer._made, layer._unread = outputs, unread
    try:
        yield made
    finally:
        for layer in layers:
            layer._made, layer._unread = None, False
