"""Routed experts stored fused, each expert tensor-parallel over its intermediate dim (Megatron's
expert tensor parallelism): `ParallelExperts`.

Hugging Face keeps a mixture-of-experts block's routed experts (Mixtral, Qwen2/3-MoE, OLMoE, ...)
as two 3-D parameters of one module, E experts of intermediate size I over hidden size H:

    gate_up_proj [E, 2I, H]   expert e's [gate | up] rows, as a fused 2-D gate_up_proj
    down_proj    [E, H, I]
    forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> y [T, H]:
        for each expert e some token routes to:
            (t, j) = the tokens routed to e, and the slot j of e among their k choices
            g, u   = (x[t] @ gate_up_proj[e].T).chunk(2, -1)            # [n, I] each
            y[t]  += (act(g) * u) @ down_proj[e].T * top_k_weights[t, j]

Each expert is a gated MLP, so it shards as a dense one does (p ranks, r this rank): its gate and
up rows column-parallel, each part on its own ("column:2"), its down columns row-parallel:

    ParallelExperts   gate_up_proj [E, 2I/p, H] = [G_e[rI/p:(r+1)I/p] | U_e[rI/p:(r+1)I/p]]  ShardRule(1, stacked=2)
                      down_proj    [E, H, I/p]  = D_e[:, rI/p:(r+1)I/p]                     ShardRule(2)
        forward(x, top_k_index, top_k_weights) -> y_r [T, H], the same loop on the shards:
            sum over r of y_r == y                                       (act is elementwise)

The forward communicates nothing: y_r is this rank's partial sum, and the block it sits in
enters its input and reduces its output once, with the shared expert's partial sum added
(oases.nn._moe). The parameters keep Hugging Face's names, so checkpoints and
oases.save_pretrained exports hold the unsharded [E, 2I, H] and [E, H, I] tensors.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases._sharding import ShardRule
from oases.comm._topology import ring_of

__all__ = ["ParallelExperts", "is_fused_experts", "is_experts", "check_experts"]

# The flags transformers' use_experts_implementation sets, with the only layout ParallelExperts computes.
_STANDARD_LAYOUT = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                    "has_post_expert_norm": False}


def is_fused_experts(module: nn.Module) -> bool:
    """Hugging Face's fused routed experts, unsharded: own parameters exactly gate_up_proj [E, 2I, H]
    and down_proj [E, H, I] (3-D, I > 0), and an act_fn (a ParallelExperts is not)."""
    if isinstance(module, ParallelExperts):
        return False
    own = dict(module.named_parameters(recurse=False))
    if set(own) != {"gate_up_proj", "down_proj"} or not callable(getattr(module, "act_fn", None)):
        return False
    gate_up, down = own["gate_up_proj"], own["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    e, two_i, h = gate_up.shape
    return two_i % 2 == 0 and two_i > 0 and tuple(down.shape) == (e, h, two_i // 2)


def is_experts(module: nn.Module) -> bool:
    """Fused routed experts, sharded (ParallelExperts) or not."""
    return isinstance(module, ParallelExperts) or is_fused_experts(module)


def check_experts(owner: str, experts: nn.Module, world_size: int) -> None:
    """ValueError (naming `owner` and the fix) unless `experts` is in the layout ParallelExperts
    computes and its intermediate size splits into `world_size` whole shards."""
    if not is_fused_experts(experts):
        raise ValueError(f"{owner}: {type(experts).__name__} is not fused routed experts (own parameters exactly "
                         f"gate_up_proj [E, 2I, H] and down_proj [E, H, I], and an act_fn); remove it from the plan")
    odd = {k: getattr(experts, k) for k, v in _STANDARD_LAYOUT.items() if getattr(experts, k, v) != v}
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        odd["_apply_gate"] = f"{type(experts).__name__}._apply_gate"
    if odd:
        raise ValueError(f"{owner}: {type(experts).__name__} has a layout oases does not shard "
                         f"({', '.join(f'{k}={v!r}' for k, v in odd.items())}; it shards {_STANDARD_LAYOUT} with "
                         f"act(gate) * up); leave it replicated: remove its 'experts' plan entry")
    intermediate = experts.down_proj.shape[2]
    if intermediate % world_size:
        raise ValueError(f"{owner}: the experts' intermediate size {intermediate} is not divisible by the "
                         f"tensor-parallel world size {world_size}; choose a world size dividing it (or leave the "
                         f"experts replicated: remove the 'experts' plan entry)")


class ParallelExperts(nn.Module):
    """Fused routed experts with each expert's intermediate dim sharded over `group` (module doc).

        gate_up_proj [E, 2I/p, H], down_proj [E, H, I/p]
        forward(x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> y_r [T, H]  (partial sum)

    `act_fn`: the experts' activation (elementwise). Built directly, the full tensors are drawn
    normal(0, std) on every rank (Hugging Face's init) and each rank keeps its shard: with the same
    seed on every rank the shards tile one full set of experts; `from_experts` copies a module's.
    `_communicate` (read by oases.nn._moe's hooks on the block holding it; False inside
    no_tp_communication): whether that block enters its input and reduces its output itself.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act_fn: Callable[[torch.Tensor], torch.Tensor], *, group: Optional[dist.ProcessGroup] = None,
                 std: float = 0.02, device: Optional[torch.device | str] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelExperts: {name} must be a positive int, got {value!r}")
        if not callable(act_fn):
            raise TypeError(f"ParallelExperts: act_fn must be callable (the experts' activation), got {act_fn!r}")
        ring = ring_of(group)
        if intermediate_size % ring.size:
            raise ValueError(f"ParallelExperts: intermediate_size={intermediate_size} is not divisible by the "
                             f"tensor-parallel world size {ring.size}; choose sizes that split into whole shards")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.act_fn = act_fn
        self.group, self.world_size, self.rank = group, ring.size, ring.rank
        self._communicate = True  # the block's entry and reduction (oases.nn._moe); False in no_tp_communication
        e, h, i = num_experts, hidden_size, intermediate_size
        full_gate_up = torch.empty(e, 2 * i, h, device=device, dtype=dtype).normal_(0.0, std)
        full_down = torch.empty(e, h, i, device=device, dtype=dtype).normal_(0.0, std)
        layout = self.tp_layout()
        self.gate_up_proj = nn.Parameter(self._cut(layout["gate_up_proj"], full_gate_up))  # [E, 2I/p, H]
        self.down_proj = nn.Parameter(self._cut(layout["down_proj"], full_down))  # [E, H, I/p]

    def _cut(self, rule: ShardRule, full: torch.Tensor) -> torch.Tensor:
        return rule.shard(full, self.rank, self.world_size).clone()

    def tp_layout(self) -> dict[str, ShardRule]:
        """gate_up_proj: each expert's gate and up rows cut on their own (dim 1, 2 blocks);
        down_proj: its columns (dim 2)."""
        return {"gate_up_proj": ShardRule(1, stacked=2), "down_proj": ShardRule(2)}

    @classmethod
    def from_experts(cls, experts: nn.Module, group: Optional[dist.ProcessGroup] = None) -> "ParallelExperts":
        """This rank's shard of Hugging Face fused experts (values and requires_grad copied; on the
        meta device for a meta module)."""
        check_experts("experts", experts, ring_of(group).size)
        e, h, i = experts.down_proj.shape
        like = experts.gate_up_proj
        layer = torch.nn.utils.skip_init(cls, e, h, i, experts.act_fn, group=group, device=like.device,
                                         dtype=like.dtype)
        layout = layer.tp_layout()
        with torch.no_grad():
            for name, rule in layout.items():
                source = getattr(experts, name)
                target = getattr(layer, name)
                target.copy_(rule.shard(source, layer.rank, layer.world_size))
                target.requires_grad_(source.requires_grad)
        return layer

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # [T, H]: this rank's partial sum
        with torch.no_grad():
            routed = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)  # [E + 1, k, T]
            hit = routed[: self.num_experts].sum(dim=(-1, -2)).nonzero().flatten().tolist()  # index E: no expert
        for e in hit:
            slot, token = torch.where(routed[e])  # [n] each
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I/p] each
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # [n, H], partial over the I/p features
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, tp={self.world_size} (rank {self.rank}: "
                f"intermediate {self.intermediate_size // self.world_size} per expert)")
