"""ColumnParallelLinear: nn.Linear with its output features sharded over the ranks of a group.

The first of Megatron's pair (`oases.nn.layers` describes the pair; `oases.nn.row` holds the second).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import ops
from oases._checks import process_group
from oases._sharding import ShardRule, vocab_rule
from oases.comm.topology import ring_of
from oases.nn._from_full import _from_conv1d, _from_linear
from oases.nn._fusion import _linear, _main_grad
from oases.nn._layer_args import _check_flag, _check_replicas, _check_transposed, _resolve_chunks, check_shardable
from oases.nn._shared_entry import _SharedEntry
from oases.nn.mappings import copy_to_replicas, copy_to_tp, gather_from_tp

__all__ = ["ColumnParallelLinear", "adding"]


class ColumnParallelLinear(nn.Module):
    """nn.Linear with its output features sharded over the ranks of `group` (column parallel).

    ::

        weight [out/p, in] = W[r*out/p : (r+1)*out/p],  bias [out/p]
        forward(x):
            sequence_parallel=False:  x [..., in] (replicated)  ->  y [..., out/p]
                y = F.linear(copy_to_tp(x), weight, bias)          # bwd: grad_x all-reduced
            sequence_parallel=True:   x [s/p, b, in] (shard of the sequence)  ->  y [s, b, out/p]
                y = all_gather_linear(x, weight, bias, dim=0)      # bwd: grad_x reduce-scattered
            gather_output=True:  y = gather_from_tp(y)             # y [..., out]; bwd: split

    Args:
        in_features: the full layer's input features.
        out_features: the full layer's output features, sharded over `group`.
        bias: whether the layer has a bias (sharded like the output features).
        group: the tensor-parallel process group (default None: the world).
        gather_output: all-gather the output to [..., out] (default False: this rank's [..., out/p]).
        sequence_parallel: the input is this rank's slice of the sequence, [s/p, b, in].
        chunks: pieces per shard for all_gather_linear's overlap (None: the op chooses); sequence_parallel only.
        stacked: how many equal blocks the output features are (q|k|v: 3), each sharded alone (default 1).
        parts: the blocks' sizes, where they differ (default (): no parts; only with stacked=1).
        replicas: per block, how many consecutive ranks hold its slice alike (default (): none).
        replica_group: with replicas, the group of this rank's copies.
        pad_vocab: an LM head: out_features need not divide by p (padding rows, outputs -inf).
        transposed: the weight kept in a Conv1D's layout, [in, out/p] (default False: [out/p, in]).
        gradient_accumulation_fusion: the weight's gradient goes to weight.main_grad in fp32.
        device: where the parameters are allocated, as for nn.Linear.
        dtype: the parameters' dtype, as for nn.Linear.

    Each option's contract: the layers guide (docs/guides/parallelize.md, "The parallel layers in detail").
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: Optional[dist.ProcessGroup] = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        chunks: Optional[int] = None,
        stacked: int = 1,
        parts: tuple[int, ...] = (),
        replicas: tuple[int, ...] = (),
        replica_group: Optional[dist.ProcessGroup] = None,
        pad_vocab: bool = False,
        transposed: bool = False,
        gradient_accumulation_fusion: bool = False,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        _check_flag(type(self).__name__, "gradient_accumulation_fusion", gradient_accumulation_fusion)
        _check_flag(type(self).__name__, "pad_vocab", pad_vocab)
        _check_transposed(type(self).__name__, transposed, gradient_accumulation_fusion)
        group = process_group(group)  # a 1-D DeviceMesh: its group
        replica_group = process_group(replica_group, "replica_group")
        ring = ring_of(group)
        if pad_vocab and (stacked != 1 or parts or transposed):
            raise ValueError(
                f"{type(self).__name__}: pad_vocab (an LM head) takes stacked=1, no parts and "
                f"transposed=False, got stacked={stacked}, parts={parts}, transposed={transposed}"
            )
        replicas = tuple(replicas) if isinstance(replicas, (tuple, list)) else replicas
        if not pad_vocab:
            check_shardable(type(self).__name__, "out_features", out_features, ring.size, stacked, parts, replicas)
        if any(c > 1 for c in replicas):
            _check_replicas(
                type(self).__name__,
                replicas,
                replica_group,
                ring,
                pad_vocab or transposed or gather_output or gradient_accumulation_fusion,
            )
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.in_features, self.out_features = in_features, out_features
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.chunks, self.stacked, self.parts = _resolve_chunks(chunks), stacked, tuple(parts)
        self.pad_vocab, self.transposed = pad_vocab, transposed
        self.replicas = replicas if any(c > 1 for c in replicas) else ()
        self.replica_group = replica_group if self.replicas else None
        self._rule = (
            vocab_rule(out_features, ring.size)
            if pad_vocab
            else ShardRule(1 if transposed else 0, stacked, parts=self.parts, replicas=self.replicas)
        )
        spans = self._rule.local_copies(out_features, ring.size)  # (start, rows, copies) per block
        # rows of this rank's weight that other ranks hold alike: their gradient is summed over them
        self._copied = tuple((first, n) for first, n, c in spans if c > 1)
        start, stop = (
            self._rule.held(out_features, ring.rank, ring.size) if pad_vocab else (0, sum(n for _, n, _ in spans))
        )
        self._held = stop - start  # real rows on this rank (rows past them: a padded vocabulary's)
        self._entry: Optional[_SharedEntry] = None  # use_entry (parallelize): see _SharedEntry
        self._communicate = True  # False only inside no_tp_communication
        self._added: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # adding(): a term joining y
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)  # nn.Linear's init
        w = full.weight.detach()
        self.weight = nn.Parameter(self.shard(w.t() if transposed else w).clone())  # [out/p, in] ([in, out/p])
        if bias:
            self.bias = nn.Parameter(self.shard(full.bias.detach()).clone())  # [out/p]
        else:
            self.register_parameter("bias", None)

    def use_entry(self, entry: _SharedEntry) -> None:
        """Enter the TP region through `entry`, shared by the layers fed one input (q, k, v): one all-reduce."""
        if not isinstance(entry, _SharedEntry):
            raise TypeError(f"entry: expected the _SharedEntry parallelize makes, got {type(entry).__name__}")
        self._entry = entry

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [out, ...] weight or [out] bias (a view; a zero-padded copy
        for a padded vocabulary); transposed: its columns of a full [in, out] weight."""
        rule = self._rule if full.dim() > 1 else self._bias_rule()
        return rule.shard(full, self.rank, self.world_size)

    def _bias_rule(self) -> ShardRule:
        return ShardRule(0, self.stacked, self._rule.size, self.parts, self.replicas)

    def dense_weight(self) -> torch.Tensor:
        """The weight as F.linear takes it, [out/p, in] (a view of a transposed layer's [in, out/p])."""
        return self.weight.t() if self.transposed else self.weight

    def tp_layout(self) -> dict[str, ShardRule]:
        """How this layer's parameters cut the full layer's (see oases._sharding)."""
        rule = self._rule
        if self.bias is None:
            return {"weight": rule}
        return {"weight": rule, "bias": self._bias_rule()}

    def mask_padding(self, y: torch.Tensor) -> torch.Tensor:
        """y [..., rows of this rank] with the padded vocabulary's columns at -inf (pad_vocab; else y):
        they never win a softmax, add nothing to a loss, and get no gradient."""
        if self._held == y.shape[-1]:
            return y
        return y.masked_fill(torch.arange(y.shape[-1], device=y.device) >= self._held, float("-inf"))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Optional[dist.ProcessGroup] = None, **kw) -> "ColumnParallelLinear":
        """This rank's shard of `linear` (values copied): computes `linear`'s output slice r.

        Args:
            linear: the full nn.Linear (its values and requires_grad flags are copied).
            group: the tensor-parallel process group (default None: the world).
            **kw: the constructor's other keyword arguments (gather_output, stacked, ...).

        Returns:
            A ColumnParallelLinear on `linear`'s device and dtype, holding this rank's shard.
        """
        return _from_linear(cls, linear, group, kw, shard_bias=True)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, group: Optional[dist.ProcessGroup] = None, **kw) -> "ColumnParallelLinear":
        """This rank's shard of a Hugging Face Conv1D (weight [in, out]), kept in its layout: weight
        [in, out/p], computing the output slice r of x @ conv.weight + conv.bias.

        Args:
            conv: the full Conv1D (its values and requires_grad flags are copied).
            group: the tensor-parallel process group (default None: the world).
            **kw: the constructor's other keyword arguments (transposed is True).

        Returns:
            A transposed ColumnParallelLinear on `conv`'s device and dtype, holding this rank's shard.
        """
        return _from_conv1d(cls, conv, group, kw, shard_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> y [..., out/p] = F.linear(x, dense_weight(), bias), this rank's output features
        (with sequence_parallel x is [s/p, b, in]; with gather_output y is [..., out]): see the class docstring."""
        main_grad = _main_grad(self)
        weight, bias = self.dense_weight(), self.bias
        if self._added is not None and self.sequence_parallel:
            raise ValueError(f"{type(self).__name__}: an added term (adding()) is not supported with sequence_parallel")
        if self._copied:  # rows held alike by replica_group's ranks: their gradients summed over it
            weight = copy_to_replicas(weight, self._copied, self.replica_group)
            bias = None if bias is None else copy_to_replicas(bias, self._copied, self.replica_group)
        if self.sequence_parallel:
            y = ops.all_gather_linear(x, weight, bias, self.group, dim=0, chunks=self.chunks, main_grad=main_grad)
        else:
            if not self._communicate:
                pass  # the caller all-reduces the input's gradient (no_tp_communication)
            elif self._entry is None:
                x = copy_to_tp(x, self.group)
            else:
                x = self._entry.enter(x)
            y = _linear(x, weight, bias, main_grad)  # [..., out/p]
            if self._added is not None:  # adding(): e.g. a LoRA adapter's B_r (A x), from the x F.linear saw
                y = y + self._added(x).to(y.dtype)
        y = self.mask_padding(y)
        if not self.gather_output:
            return y
        y = gather_from_tp(y, self.group)  # [..., p * out/p] in rank order: [r][block][features]
        if self.pad_vocab:
            return y.narrow(-1, 0, self.out_features)  # the padding's columns dropped
        blocks = self._rule.blocks(self.out_features)
        if len(blocks) > 1:  # back to [block][r][features], the unsharded layer's order
            local = [n // self.world_size for n in blocks]
            pieces = [r.split(local, -1) for r in y.chunk(self.world_size, -1)]  # [r][block]
            y = torch.cat([pieces[r][b] for b in range(len(blocks)) for r in range(self.world_size)], -1)
        return y

    def extra_repr(self) -> str:
        """The sizes, this rank's shard and the options that are set."""
        s = (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.world_size} (rank {self.rank}: out_features "
            f"{self.weight.shape[0]})"
        )
        if self.stacked > 1:
            s += f", stacked={self.stacked}"
        if self.parts:
            s += f", parts={self.parts}"
        if self.replicas:
            s += f", replicas={self.replicas}"
        if self.transposed:
            s += ", transposed=True (Conv1D layout)"
        s += f", gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, chunks={self.chunks}"
        return s + (", gradient_accumulation_fusion=True" if self.gradient_accumulation_fusion else "")


@contextlib.contextmanager
def adding(layer: nn.Module, term: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside, `layer` (a ColumnParallelLinear or RowParallelLinear without sequence parallelism)
    adds `term(x)` to what its GEMM makes of x, where its input x is the one that GEMM reads (a
    column layer's after entering the TP region, a row layer's shard [..., in/p]):

        ColumnParallelLinear:  y_r = F.linear(x, weight, bias) + term(x)       # before mask / gather
        RowParallelLinear:     z   = reduce(F.linear(x_r, weight) + term(x_r)) + bias
                               (under no_tp_communication: the partial sum F.linear(x_r, weight) + term(x_r))

    so a row layer's term is reduced with its partial sum, in the same reduction (outside
    no_tp_communication its output is then all-reduced whole, without the fused op's overlap).
    The term's gradients are autograd's: a parameter it uses whole on every rank gets this rank's
    share (sum it over the group: oases.nn.mappings.copy_to_tp). A LoRA adapter is the user
    (oases.nn.lora). Restores the layer's previous term on exit."""
    previous = layer._added
    layer._added = term
    try:
        yield
    finally:
        layer._added = previous
