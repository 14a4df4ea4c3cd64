"""Routed experts stored fused, each expert tensor-parallel over its intermediate dim (Megatron's
expert tensor parallelism): `ParallelExperts`.

Hugging Face keeps a mixture-of-experts block's routed experts fused in the parameters of one module,
E experts of intermediate size I over hidden size H, in one of three forms:

    "concatenated" (Mixtral, Qwen2/3-MoE, OLMoE, ...): F.linear's layout, [gate | up] blocks
        gate_up_proj [E, 2I, H]   expert e's [gate | up] rows
        down_proj    [E, H, I]
        expert(e, x) = F.linear(act_fn(g) * u, down_proj[e]),   g, u = F.linear(x, gate_up_proj[e]).chunk(2, -1)
    "interleaved" (GPT-OSS): x @ W's layout, gate and up features in pairs, biases
        gate_up_proj      [E, H, 2I]  columns g_0, u_0, g_1, u_1, ...
        gate_up_proj_bias [E, 2I]
        down_proj         [E, I, H]
        down_proj_bias    [E, H]
        expert(e, x) = swiglu(x @ gate_up_proj[e] + gate_up_proj_bias[e]) @ down_proj[e] + down_proj_bias[e]
        swiglu = ClampedSwiGLU(alpha, limit): (clamp(u, -limit, limit) + 1) * c * sigmoid(alpha * c),
                 c = clamp(g, max=limit),  g, u = gate_up[..., ::2], gate_up[..., 1::2]

    "packed" (DBRX): the experts' matrices stacked on dim 0, each [I, H], in a child `mlp`
        mlp.w1 [E * I, H]   rows [e I, (e + 1) I): expert e's gate, F.linear's layout
        mlp.v1 [E * I, H]   expert e's up, the same
        mlp.w2 [E * I, H]   expert e's down, x @ W's layout (rows: the I features)
        expert(e, x) = (act(x @ w1_e.T) * (x @ v1_e.T)) @ w2_e,   w_e = w.view(E, I, H)[e]
        (x [..., H] is flattened to [T, H] and the output viewed back as [x.shape[0], -1, H])

    forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> y [T, H]:
        for each expert e some token routes to:
            (t, j) = the tokens routed to e, and the slot j of e among their k choices
            y[t]  += expert(e, x[t]) * top_k_weights[t, j]

Each expert is a gated MLP whose gate is elementwise in its I features, so it shards as a dense
one does (p ranks, r this rank; rank r holds features j in [rI/p, (r+1)I/p) of every expert):

    concatenated  gate_up_proj [E, 2I/p, H] = [G_e[rI/p:(r+1)I/p] | U_e[rI/p:(r+1)I/p]]   ShardRule(1, stacked=2)
                  down_proj    [E, H, I/p]  = D_e[:, rI/p:(r+1)I/p]                       ShardRule(2)
    interleaved   gate_up_proj [E, H, 2I/p] = columns [2rI/p, 2(r+1)I/p): the pairs (g_j, u_j)  ShardRule(2)
                  gate_up_proj_bias [E, 2I/p]  the same pairs                              ShardRule(1)
                  down_proj    [E, I/p, H]  = rows [rI/p, (r+1)I/p)                        ShardRule(1)
                  down_proj_bias [E, H]        replicated, added to rank 0's partial sum only
    packed        mlp.w1, mlp.v1, mlp.w2 [E * I/p, H] = rows [e I + rI/p, e I + (r+1)I/p) of each
                  expert e, in expert order                                            ShardRule(0, stacked=E)
    forward(x, top_k_index, top_k_weights) -> y_r [T, H], the same loop on the shards:
        sum over r of y_r == y

The pairs of an interleaved gate_up kept together are whole columns of it, so a plain rule cuts
them. The down bias enters the sum once through `lead_only` (fwd: the bias on rank 0, zeros
elsewhere; bwd: identity): the gradient reaching the block's output is the same on every rank
(its reduction's adjoint is the identity), so each rank's bias gradient is the whole one, as a
row-parallel layer's bias added after its reduction gets, and the router's (summed over the ranks
by oases.nn._moe) counts the bias once.

The forward communicates nothing: y_r is this rank's partial sum, and the block it sits in
enters its input and reduces its output once, with the shared expert's partial sum added
(oases.nn._moe). The parameters keep Hugging Face's names, so checkpoints and
oases.save_pretrained exports hold the unsharded tensors of each form (the packed form's shards
live in a child `mlp`, a PackedExpertShards whose tp_layout() says how they are cut).

Each form is recognised by its parameters' names and shapes and checked against what its module
computes (the flags transformers' use_experts_implementation sets, the gate's or the packed GLU's
output on small draws). A module that holds fused experts in any other layout (a class named
...Experts with a parameter of 3 or more dims: Llama-4's and Aria's transposed gate_up_proj
[E, H, 2I], Nemotron-H's ungated up_proj / down_proj, ...) is `looks_like_experts`: found by
parallelize like the others and refused by check_experts, naming its layout, when the plan
shards it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases import _checks
from oases._sharding import ShardRule
from oases.comm.topology import ring_of
from oases.nn._expert_forms import (
    _PACKED,
    ClampedSwiGLU,
    _form,
    check_experts,
    expert_weights,
    is_experts,
    is_fused_experts,
    looks_like_experts,
)
from oases.nn.mappings import lead_only

__all__ = [
    "ParallelExperts",
    "PackedExpertShards",
    "ClampedSwiGLU",
    "is_fused_experts",
    "is_experts",
    "looks_like_experts",
    "expert_weights",
    "check_experts",
]


class PackedExpertShards(nn.Module):
    """This rank's rows of DBRX's packed experts (module doc), the `mlp` child of a packed
    ParallelExperts: w1, v1, w2 [E * I/p, H], expert e's I/p features of rank r at rows
    [e I/p, (e+1) I/p) (ShardRule(0, stacked=E): its tp_layout()); `group` their group.

        expert(e, x [n, H]) -> [n, H] = (activation_fn(x @ w1_e.T) * (x @ v1_e.T)) @ w2_e,
                                        w_e = w.view(E, I/p, H)[e]   (this rank's partial sum)
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation_fn: Callable[[torch.Tensor], torch.Tensor],
        group: Optional[dist.ProcessGroup],
        *,
        std: float = 0.02,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        ring = ring_of(group)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation_fn = activation_fn
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        rule = ShardRule(0, stacked=num_experts)
        for name in _PACKED:
            full = torch.empty(num_experts * intermediate_size, hidden_size, device=device, dtype=dtype)  # [E * I, H]
            full.normal_(0.0, std)
            self.register_parameter(name, nn.Parameter(rule.shard(full, self.rank, self.world_size).clone()))

    def tp_layout(self) -> dict[str, ShardRule]:
        """w1, v1, w2: each expert's rows cut on their own (dim 0, E blocks)."""
        return {name: ShardRule(0, stacked=self.num_experts) for name in _PACKED}

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on this rank's features: [n, H] -> [n, H], its part of the expert's output."""
        shape = (self.num_experts, self.intermediate_size // self.world_size, self.hidden_size)
        w1, v1, w2 = (getattr(self, n).view(shape)[e] for n in _PACKED)  # [I/p, H] each
        return (self.activation_fn(x.matmul(w1.T)) * x.matmul(v1.T)).matmul(w2)

    def extra_repr(self) -> str:
        """The sizes and this rank's shard."""
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, tp={self.world_size} (rank {self.rank})"
        )


class ParallelExperts(nn.Module):
    """Fused routed experts with each expert's intermediate dim sharded over `group` (module doc).

    ::

        concatenated (act_fn):  gate_up_proj [E, 2I/p, H], down_proj [E, H, I/p]
        interleaved (swiglu):   gate_up_proj [E, H, 2I/p], gate_up_proj_bias [E, 2I/p],
                                down_proj [E, I/p, H], down_proj_bias [E, H] (replicated)
        packed (act_fn, packed=True):  mlp.w1, mlp.v1, mlp.w2 [E * I/p, H] (mlp: PackedExpertShards)
        forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> y_r [T, H]  (partial sum;
            packed: x [B, ..., H] flattened to [T, H], y_r viewed as [B, -1, H], as DBRX's experts do)

    Exactly one of `act_fn` (the concatenated and packed forms' elementwise activation) and `swiglu`
    (a ClampedSwiGLU: the interleaved form, GPT-OSS's) is given; `packed` (with act_fn): DBRX's
    form, whose shards and their tp_layout() are the child `mlp`'s (this module's tp_layout() is
    empty: it holds no parameter itself). Built directly, the full weights are
    drawn normal(0, std) on every rank and the biases are zeros (Hugging Face's init), and each
    rank keeps its shard: with the same seed on every rank the shards tile one full set of
    experts; `from_experts` copies a module's.
    `_communicate` (read by oases.nn._moe's hooks on the block holding it; False inside
    no_tp_communication): whether that block enters its input and reduces its output itself.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        *,
        swiglu: Optional[ClampedSwiGLU] = None,
        packed: bool = False,
        group: Optional[dist.ProcessGroup] = None,
        std: float = 0.02,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if not _checks.is_int(value) or value < 1:
                raise ValueError(f"ParallelExperts: {name} must be a positive int, got {value!r}")
        if (act_fn is None) == (swiglu is None):
            raise TypeError(
                "ParallelExperts: give exactly one of act_fn (the concatenated form's activation) and "
                f"swiglu (a ClampedSwiGLU: GPT-OSS's interleaved form); got act_fn={act_fn!r}, "
                f"swiglu={swiglu!r}"
            )
        if packed is not False and (packed is not True or act_fn is None):
            raise TypeError(
                f"ParallelExperts: packed=True (DBRX's form) takes an act_fn and no swiglu; got packed={packed!r}, "
                f"act_fn={act_fn!r}, swiglu={swiglu!r}"
            )
        if act_fn is not None and not callable(act_fn):
            raise TypeError(f"ParallelExperts: act_fn must be callable (the experts' activation), got {act_fn!r}")
        if swiglu is not None and not isinstance(swiglu, ClampedSwiGLU):
            raise TypeError(f"ParallelExperts: swiglu must be a ClampedSwiGLU(alpha, limit), got {swiglu!r}")
        group = _checks.process_group(group)  # a 1-D DeviceMesh: its group
        ring = ring_of(group)
        if intermediate_size % ring.size:
            raise ValueError(
                f"ParallelExperts: intermediate_size={intermediate_size} is not divisible by the "
                f"tensor-parallel world size {ring.size}; choose sizes that split into whole shards"
            )
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.form = "packed" if packed else "concatenated" if swiglu is None else "interleaved"
        self.act_fn = None if packed else act_fn  # packed: the mlp's activation_fn, as DBRX keeps it
        self.swiglu = swiglu
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        self._communicate = True  # the block's entry and reduction (oases.nn._moe); False in no_tp_communication
        e, h, i = num_experts, hidden_size, intermediate_size
        layout = self.tp_layout()
        if self.form == "packed":
            self.mlp = PackedExpertShards(e, h, i, act_fn, group, std=std, device=device, dtype=dtype)
            return
        if self.form == "concatenated":
            full_gate_up = torch.empty(e, 2 * i, h, device=device, dtype=dtype).normal_(0.0, std)
            full_down = torch.empty(e, h, i, device=device, dtype=dtype).normal_(0.0, std)
            self.gate_up_proj = nn.Parameter(self._cut(layout["gate_up_proj"], full_gate_up))  # [E, 2I/p, H]
            self.down_proj = nn.Parameter(self._cut(layout["down_proj"], full_down))  # [E, H, I/p]
            return
        full_gate_up = torch.empty(e, h, 2 * i, device=device, dtype=dtype).normal_(0.0, std)
        full_down = torch.empty(e, i, h, device=device, dtype=dtype).normal_(0.0, std)
        self.gate_up_proj = nn.Parameter(self._cut(layout["gate_up_proj"], full_gate_up))  # [E, H, 2I/p]
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i // self.world_size, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(self._cut(layout["down_proj"], full_down))  # [E, I/p, H]
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, device=device, dtype=dtype))  # [E, H]: replicated

    def _cut(self, rule: ShardRule, full: torch.Tensor) -> torch.Tensor:
        return rule.shard(full, self.rank, self.world_size).clone()

    def tp_layout(self) -> dict[str, ShardRule]:
        """concatenated: gate_up_proj's gate and up rows cut on their own (dim 1, 2 blocks), down_proj's
        columns (dim 2). interleaved: whole (gate, up) pairs, i.e. gate_up_proj's columns (dim 2) and
        its bias's (dim 1), down_proj's rows (dim 1); down_proj_bias replicated. packed: none here
        (the child mlp's tp_layout() cuts w1, v1, w2)."""
        if self.form == "packed":
            return {}
        if self.form == "concatenated":
            return {"gate_up_proj": ShardRule(1, stacked=2), "down_proj": ShardRule(2)}
        return {"gate_up_proj": ShardRule(2), "gate_up_proj_bias": ShardRule(1), "down_proj": ShardRule(1)}

    @classmethod
    def from_experts(cls, experts: nn.Module, group: Optional[dist.ProcessGroup] = None) -> "ParallelExperts":
        """This rank's shard of Hugging Face fused experts (values and requires_grad copied; on the
        meta device for a meta module)."""
        check_experts("experts", experts, ring_of(group).size)
        form = _form(experts)
        if form == "packed":
            like = experts.mlp.w1
            e, h, i = experts.num_experts, experts.hidden_size, experts.ffn_hidden_size
            kinds = dict(act_fn=experts.mlp.activation_fn, packed=True)
        elif form == "concatenated":
            like = experts.gate_up_proj
            e, h, i = experts.down_proj.shape
            kinds = dict(act_fn=experts.act_fn)
        else:
            like = experts.gate_up_proj
            e, i, h = experts.down_proj.shape
            kinds = dict(swiglu=ClampedSwiGLU(float(experts.alpha), float(experts.limit)))
        layer = torch.nn.utils.skip_init(cls, e, h, i, **kinds, group=group, device=like.device, dtype=like.dtype)
        owners = [(layer.mlp, experts.mlp)] if form == "packed" else [(layer, experts)]
        with torch.no_grad():
            for target_owner, source_owner in owners:
                layout = target_owner.tp_layout()
                for name, target in target_owner.named_parameters(recurse=False):
                    source = getattr(source_owner, name)
                    rule = layout.get(name)
                    target.copy_(source if rule is None else rule.shard(source, layer.rank, layer.world_size))
                    target.requires_grad_(source.requires_grad)
        return layer

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on this rank's features: [n, H] -> [n, H], its part of the expert's output."""
        if self.form == "packed":
            return self.mlp.expert(e, x)
        if self.swiglu is None:
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I/p] each
            return F.linear(self.act_fn(gate) * up, self.down_proj[e])
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [n, 2I/p]: I/p (gate, up) pairs
        bias = lead_only(self.down_proj_bias[e], self.rank == 0)  # [H]: in one rank's partial sum
        return self.swiglu(gate_up) @ self.down_proj[e] + bias

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]: each token's routed experts'
        outputs times their weights, summed; this rank's partial sum over its I/p features. The packed
        form takes x [B, ..., H] and returns [B, -1, H] (DBRX's experts' shapes)."""
        rows = hidden_states.shape[0]
        if self.form == "packed":
            hidden_states = hidden_states.reshape(-1, self.hidden_size)  # [T, H]
        out = torch.zeros_like(hidden_states)  # [T, H]: this rank's partial sum
        with torch.no_grad():
            routed = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # [E + 1, k, T]
            hit = routed[: self.num_experts].sum(dim=(-1, -2)).nonzero().flatten().tolist()  # index E: no expert
        for e in hit:
            slot, token = torch.where(routed[e])  # [n] each
            y = self._expert(e, hidden_states[token])  # [n, H], partial over the I/p features
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out.view(rows, -1, self.hidden_size) if self.form == "packed" else out

    def extra_repr(self) -> str:
        """The sizes, the swiglu if any, and this rank's TP shard (intermediate features per expert)."""
        form = ", packed" if self.form == "packed" else "" if self.swiglu is None else f", {self.swiglu}"
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}{form}, tp={self.world_size} (rank {self.rank}: "
            f"intermediate {self.intermediate_size // self.world_size} per expert)"
        )
