"""A GPT whose blocks are tensor-parallel and whose stack trains on a selectable schedule.

Each block is two *sublayers* (attention, MLP), each of the pre-LN residual form

    x = x + finish(all_reduce(core(norm(x))))        # x [b, t, h], replicated on every TP rank

where `core` is the TP-local part (column-parallel QKV / fc1 on this rank's heads / features,
then the row-parallel out-projection / fc2 without its bias), so summing `core` over the ranks
gives the unsharded sublayer's output; `finish` adds the replicated bias and the residual dropout.
The schedules in `oases.schedule` only see this form.

With no process group (or a group of one) the same module is the plain single-process model:
`GPT(config, seed=s)` on one process and `GPT(config, group, seed=s)` on each TP rank hold the
same weights (each rank keeps its shard of the full initialisation), so their losses and
gradients can be compared exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases._sharding import column_shard, row_shard
from oases.schedule import SCHEDULES, Communicator, train_step

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    hidden: int = 128
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0  # residual dropout after each sublayer (same masks in recomputation)

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")


def _residual_dropout(y: torch.Tensor, p: float, seed: int, rows: slice, batch: int) -> torch.Tensor:
    """Dropout with a mask drawn for the whole batch from `seed`, sliced to this sub-batch's rows:
    the same mask in forward and recomputation, and whatever the sub-batch split."""
    g = torch.Generator(device=y.device).manual_seed(seed)
    keep = torch.rand((batch, *y.shape[1:]), generator=g, device=y.device)[rows] >= p
    return y * keep.to(y.dtype) / (1.0 - p)


class _Sublayer(nn.Module):
    """norm -> TP-local core -> (all-reduce by the schedule) -> finish; see the module docstring."""

    def __init__(self, config: GPTConfig, index: int) -> None:
        super().__init__()
        self.config, self.index = config, index
        self.norm = nn.LayerNorm(config.hidden)

    def finish(self, z: torch.Tensor, seed: Optional[int], rows: slice, batch: int) -> torch.Tensor:
        y = z + self.out_bias
        if seed is None or self.config.dropout == 0.0:
            return y
        return _residual_dropout(y, self.config.dropout, seed * 1_000_003 + self.index, rows, batch)


class _Attention(_Sublayer):
    def __init__(self, config: GPTConfig, index: int, tp: int) -> None:
        super().__init__(config, index)
        self.local_heads = config.heads // tp
        head_dim = config.hidden // config.heads
        self.qkv = nn.Linear(config.hidden, 3 * self.local_heads * head_dim)  # column-parallel
        self.proj = nn.Linear(self.local_heads * head_dim, config.hidden)  # row-parallel

    @property
    def out_bias(self) -> nn.Parameter:
        return self.proj.bias  # replicated: added once, after the reduction

    def core(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        qkv = self.qkv(h).view(b, t, 3, self.local_heads, -1)  # (b, t, 3, nh_local, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, nh_local, t, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (b, t, nh_local * hd)
        return F.linear(y, self.proj.weight)  # partial sum of the out-projection


class _MLP(_Sublayer):
    def __init__(self, config: GPTConfig, index: int, tp: int) -> None:
        super().__init__(config, index)
        width = config.mlp_ratio * config.hidden // tp
        self.fc1 = nn.Linear(config.hidden, width)  # column-parallel
        self.fc2 = nn.Linear(width, config.hidden)  # row-parallel

    @property
    def out_bias(self) -> nn.Parameter:
        return self.fc2.bias

    def core(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(self.fc1(h)), self.fc2.weight)


# How each TP-sharded parameter of the full model is cut: (dimension, stacked blocks). QKV's rows
# are three blocks (q, k, v), each cut by heads; column layers cut dim 0, row layers dim 1.
_SHARDING = MappingProxyType({
    "qkv.weight": (0, 3), "qkv.bias": (0, 3), "proj.weight": (1, 1),
    "fc1.weight": (0, 1), "fc1.bias": (0, 1), "fc2.weight": (1, 1),
})


def _shard(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    rule = _SHARDING.get(".".join(name.split(".")[-2:]))
    if rule is None:
        return full
    dim, stacked = rule
    return column_shard(full, rank, tp, stacked) if dim == 0 else row_shard(full, rank, tp)


class GPT(nn.Module):
    """GPT with tensor-parallel blocks on `group` (None and no initialised process group: one rank).

        model = GPT(config, group, schedule="oases", seed=0)
        loss = model.train_step(tokens, targets)     # tokens, targets [b, t] int64; grads in .grad
        logits = model(tokens)                       # [b, t, vocab], blocking all-reduces

    `train_step` runs forward and backward on `schedule` (see oases.schedule.SCHEDULES); every
    schedule gives the loss and gradients of the single-process model with the same seed.
    """

    def __init__(self, config: GPTConfig, group: Optional[dist.ProcessGroup] = None, *,
                 schedule: str = "oases", seed: int = 0) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: {schedule!r} is not one of {sorted(SCHEDULES)}")
        distributed = dist.is_available() and dist.is_initialized()
        self.tp = dist.get_world_size(group) if distributed else 1
        self.tp_rank = dist.get_rank(group) if distributed else 0
        for what, size in (("heads", config.heads), ("hidden * mlp_ratio", config.hidden * config.mlp_ratio)):
            if size % self.tp:
                raise ValueError(f"config.{what}: {size} is not divisible by the TP size {self.tp}")
        self.config, self.schedule = config, schedule
        self.comm = Communicator(group if distributed else None, self.tp)
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.pos = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(
            nn.ModuleList([_Attention(config, 2 * i, self.tp), _MLP(config, 2 * i + 1, self.tp)])
            for i in range(config.layers)
        )
        self.norm_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise the full model from `seed` (GPT-2 style) and keep this rank's shards."""
        g = torch.Generator().manual_seed(seed)
        std_out = 0.02 / math.sqrt(2 * self.config.layers)
        for name, p in self.named_parameters():
            shape = list(p.shape)
            rule = _SHARDING.get(".".join(name.split(".")[-2:]))
            if rule is not None:
                shape[rule[0]] *= self.tp
            if name.endswith("norm.weight") or name == "norm_f.weight":
                full = torch.ones(shape)
            elif name.endswith("bias"):
                full = torch.zeros(shape)
            else:
                std = std_out if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                full = torch.randn(shape, generator=g) * std
            p.copy_(_shard(name, full, self.tp_rank, self.tp))

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full model's tensor `name` (a parameter or its gradient)."""
        return _shard(name, full, self.tp_rank, self.tp)

    def sublayers(self) -> list[_Sublayer]:
        return [s for block in self.blocks for s in block]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"tokens: expected [batch, t <= {self.config.seq_len}], got {tuple(tokens.shape)}")
        return self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))

    def head_loss_sum(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of the final hidden states x [b, t, h]."""
        logits = self.head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, *, dropout_seed: Optional[int] = None) -> torch.Tensor:
        """Forward and backward of the mean token loss on `self.schedule`; returns the loss.

        With dropout, masks come from `dropout_seed` (when None: drawn from the default generator
        of the group's first rank and broadcast, so every rank uses the same masks)."""
        if self.training and self.config.dropout > 0 and dropout_seed is None:
            dropout_seed = self._shared_seed()
        seed = dropout_seed if self.training and self.config.dropout > 0 else None
        return train_step(self, tokens, targets, schedule=self.schedule, dropout_seed=seed)

    def _shared_seed(self) -> int:
        """A seed from the default generator of the group's first rank, the same on every rank
        (the replicated residual stream must see the same dropout masks everywhere)."""
        seed = torch.randint(0, 2**31 - 1, (1,), device=self.embed.weight.device)
        if self.tp > 1:
            dist.broadcast(seed, dist.get_global_rank(self.comm.group or dist.group.WORLD, 0),
                           group=self.comm.group)
        return int(seed)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                dropout_seed: Optional[int] = None) -> torch.Tensor:
        """Logits [b, t, vocab] (or the mean loss with `targets`); differentiable on one rank.

        Dropout applies only with a `dropout_seed` (the masks `train_step` draws from it)."""
        if self.tp > 1 and torch.is_grad_enabled():
            raise RuntimeError("GPT.forward is not differentiable with TP > 1: use train_step(), "
                               "or run inference under torch.no_grad()")
        x = self.embed_tokens(tokens)
        rows = slice(0, tokens.shape[0])
        for s in self.sublayers():
            part = s.core(s.norm(x))
            self.comm.all_reduce(part, "forward").wait()
            x = x + s.finish(part, dropout_seed if self.training else None, rows, tokens.shape[0])
        if targets is not None:
            return self.head_loss_sum(x, targets) / targets.numel()
        return self.head(self.norm_f(x))
