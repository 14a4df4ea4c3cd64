"""PEFT LoRA layers for oases' ColumnParallelLinear and RowParallelLinear (imports peft).

    LoraColumnParallelLinear   A [rank, in] replicated, B_r [out/p, rank]: the base weight's rows
    LoraRowParallelLinear      A_r [rank, in/p]: the base weight's columns, B [out, rank] replicated

Each is a PEFT LoRA layer (peft.tuners.lora.LoraLayer: base_layer, lora_A / lora_B ModuleDicts,
merge / unmerge, set_adapter, ...) whose forward runs its base layer with the adapters' term added
inside it (oases.nn.column.adding); its split factor (a ShardedLoraFactor) says how it is cut with
tp_layout(). The design, and what is refused: oases.nn.lora.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge

from oases._sharding import ShardRule
from oases.nn.column import ColumnParallelLinear, adding
from oases.nn.lora import check_config
from oases.nn.mappings import copy_to_replicas, copy_to_tp
from oases.nn.row import RowParallelLinear

__all__ = ["LoraFactor", "ShardedLoraFactor", "LoraColumnParallelLinear", "LoraRowParallelLinear", "LORA_LAYERS"]


class LoraFactor(nn.Module):
    """One factor of a LoRA adapter (its lora_A or lora_B): weight [out, in], forward F.linear(x, weight).

    Not an nn.Linear, so nothing takes it for a projection left whole. This one is held whole by
    every rank (replicated; `tp_summed`: its gradient is summed over the group)."""

    def __init__(self, weight: torch.Tensor, requires_grad: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class ShardedLoraFactor(LoraFactor):
    """A LoRA factor of which this rank holds its shard, `rule` cutting the unsharded one over
    `group` (its tp_layout(): checkpoints, full_state_dict and save_adapter read it unsharded)."""

    def __init__(self, weight: torch.Tensor, rule: ShardRule, group: Any, requires_grad: bool = True) -> None:
        super().__init__(weight, requires_grad)
        self.rule, self.group = rule, group

    def tp_layout(self) -> dict[str, ShardRule]:
        return {"weight": self.rule}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", a shard ({self.rule})"


# Base-layer settings oases' LoRA layers do not take, and why.
_UNSUPPORTED_BASES = {
    "sequence_parallel": "sequence_parallel=True (its GEMM reads a gathered input the term never sees)",
    "pad_vocab": "pad_vocab=True (a vocabulary-parallel head: B's padding rows)",
}


class _ParallelLora(nn.Module, LoraLayer):
    """A PEFT LoRA layer around a column- or row-parallel layer (see the module doc). The
    constructor is PEFT's custom-module contract (LoraConfig._register_custom_module); from_peft
    converts PEFT's own LoRA layer of an nn.Linear that parallelize has sharded."""

    _sharded = ""  # the factor cut like the base layer: "lora_B" (column) or "lora_A" (row)

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: Any,
        r: int = 0,
        lora_alpha: int = 1,
        **kwargs: Any,
    ) -> None:
        self._check_base(base_layer)
        if kwargs.get("tied_adapter"):
            raise ValueError(
                f"{kwargs.get('target_name', type(base_layer).__name__)}: LoRA tied to the embedding "
                "(ensure_weight_tying) is not supported on oases' parallel layers"
            )
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = False  # the factors are [rank, in] and [out, rank] whatever the base layout
        self.is_target_conv_1d_layer = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    @classmethod
    def _check_base(cls, base: nn.Module) -> None:
        kind = LORA_LAYERS_BY_NAME[cls.__name__]
        if not isinstance(base, kind):
            raise TypeError(f"{cls.__name__}: expected a {kind.__name__} base layer, got {type(base).__name__}")
        why = [reason for flag, reason in _UNSUPPORTED_BASES.items() if getattr(base, flag, False)]
        if why:
            raise ValueError(
                f"{cls.__name__}: LoRA on a {kind.__name__} with {'; '.join(why)} is not supported; leave it out of "
                f"target_modules"
            )

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        """The unsharded layer's (in_features, out_features): the factors' full sizes."""
        return module.in_features, module.out_features

    def _rule(self) -> ShardRule:
        """How the sharded factor cuts the unsharded one (see oases._sharding)."""
        raise NotImplementedError

    # --- adapters ----------------------------------------------------------------------------

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any, **kwargs: Any) -> None:
        """Add adapter `adapter_name`: its factors drawn unsharded as PEFT draws them for an nn.Linear
        (nn.Linear's init of A [r, in] and B [out, r], then init_lora_weights), then this rank's shard
        kept, so every TP degree holds the same adapter."""
        check_config(config, creating=True)
        if r <= 0:
            raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        dropout = config.lora_dropout
        self.lora_dropout.update(nn.ModuleDict({adapter_name: nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()}))
        self.lora_A[adapter_name] = LoraFactor(nn.Linear(self.in_features, r, bias=False).weight.detach())
        self.lora_B[adapter_name] = LoraFactor(nn.Linear(r, self.out_features, bias=False).weight.detach())
        self.lora_bias[adapter_name] = False
        self.use_rslora[adapter_name] = config.use_rslora
        self.use_dora[adapter_name] = False
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        if config.init_lora_weights:
            self.reset_lora_parameters(adapter_name, config.init_lora_weights)  # PEFT's: on the full factors
        self._keep_shards(adapter_name)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _keep_shards(self, adapter: str) -> None:
        """Replace the adapter's unsharded factors by this rank's: the sharded one cut by _rule()."""
        base = self.base_layer
        held = getattr(self, self._sharded)
        full = held[adapter].weight
        rule = self._rule()
        held[adapter] = ShardedLoraFactor(
            rule.shard(full.detach(), base.rank, base.world_size).clone(), rule, base.group, full.requires_grad
        )
        replicated = (self.lora_B if self._sharded == "lora_A" else self.lora_A)[adapter]
        replicated.tp_summed = ("weight",)  # oases.summary: "summed"

    @classmethod
    def from_peft(cls, layer: nn.Module, base: nn.Module) -> "_ParallelLora":
        """oases' LoRA layer around `base` (the parallel layer parallelize made of `layer`'s base
        linear) holding this rank's shards of `layer`'s adapters (a peft.tuners.lora.Linear; its
        settings, active adapters, trainable flags and train/eval mode kept)."""
        cls._check_base(base)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        LoraLayer.__init__(new, base, ephemeral_gpu_offload=layer.ephemeral_gpu_offload, **layer.kwargs)
        new.fan_in_fan_out, new.is_target_conv_1d_layer = False, False
        for name in ("r", "lora_alpha", "scaling", "use_rslora", "lora_bias", "use_dora"):
            setattr(new, name, dict(getattr(layer, name)))
        new.lora_dropout = layer.lora_dropout  # PEFT's: nn.Dropout(p) or nn.Identity each
        new.cast_input_dtype_enabled = layer.cast_input_dtype_enabled
        new._disable_adapters = layer._disable_adapters
        new._active_adapter = layer._active_adapter
        for adapter in layer.lora_A:
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            new.lora_A[adapter] = LoraFactor(a.detach().clone(), a.requires_grad)
            new.lora_B[adapter] = LoraFactor(b.detach().clone(), b.requires_grad)
            new._keep_shards(adapter)
        new.train(layer.training)
        return new

    # --- forward -----------------------------------------------------------------------------

    def _factors(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as the term uses them: the replicated one through copy_to_tp (its gradient summed),
        except inside a schedule's core (no_tp_communication), where its gradient stays this rank's
        share and the schedule sums it once after the step (partial_parameters)."""
        raise NotImplementedError

    def _replicated(self, weight: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        return weight if not base._communicate else copy_to_tp(weight, base.group)

    def partial_parameters(self) -> list[torch.Tensor]:
        """The replicated factors (the column's A, the row's B) that train: inside a schedule's core
        their gradients are this rank's shares, which the schedule sums over the TP group after
        the step's backwards (oases.schedule.protocol: stack.partial_parameters)."""
        held = self.lora_B if self._sharded == "lora_A" else self.lora_A
        return [factor.weight for factor in held.values() if factor.weight.requires_grad]

    def _term(self, adapters: list[str], x: torch.Tensor) -> torch.Tensor:
        """sum over `adapters` of s * B (A x), from the input the base layer's GEMM reads."""
        total: Optional[torch.Tensor] = None
        for adapter in adapters:
            a, b = self._factors(adapter)
            h = self.lora_dropout[adapter](self._cast_input_dtype(x, a.dtype))
            t = F.linear(F.linear(h, a), b) * self.scaling[adapter]
            total = t if total is None else total + t
        return total

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The base layer's output with the active adapters' term added inside it (the column's
        before its mask / gather, the row's to its partial sum before the reduction)."""
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError(f"{type(self).__name__}: adapter_names (mixed-batch adapters) is not supported")
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        active = [] if self.merged else [a for a in self.active_adapters if a in self.lora_A]
        if not active:
            return self.base_layer(x, *args, **kwargs)
        with adding(self.base_layer, functools.partial(self._term, active)):
            return self.base_layer(x, *args, **kwargs)

    # --- merging -----------------------------------------------------------------------------

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """This rank's shard of the adapter's s * B A, in the base layer's F.linear layout ([out/p, in]
        for a column layer, [out, in/p] for a row one): B_r A, B A_r."""
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        half_on_cpu = a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16)
        delta = (b.float() @ a.float() if half_on_cpu else b @ a) * self.scaling[adapter]
        return delta.to(a.dtype)

    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        """Add the adapters' deltas to this rank's shard of the base weight (shards of the unsharded
        merge); safe_merge: refuse non-finite results (ValueError, this rank's shard checked)."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        for adapter in adapter_names:
            if adapter not in self.lora_A:
                continue
            with torch.no_grad():
                weight = self.base_layer.dense_weight()
                delta = self.get_delta_weight(adapter).to(weight.dtype)
                if safe_merge and not torch.isfinite(weight + delta).all():
                    raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter} seems to be broken")
                weight.add_(delta)
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        """Subtract the merged adapters' deltas from the base weight's shard."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            if adapter in self.lora_A:
                with torch.no_grad():
                    weight = self.base_layer.dense_weight()
                    weight.sub_(self.get_delta_weight(adapter).to(weight.dtype))

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


class LoraColumnParallelLinear(_ParallelLora):
    """LoRA on a ColumnParallelLinear: A [rank, in] replicated (its gradient summed over the group),
    B_r [out/p, rank] the rows of B the base weight's rows are (its blocks, parts and replicas)."""

    _sharded = "lora_B"

    def _rule(self) -> ShardRule:
        base = self.base_layer
        return ShardRule(0, base.stacked, parts=base.parts, replicas=base.replicas)

    def _factors(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        base = self.base_layer
        a = self._replicated(self.lora_A[adapter].weight)
        b = self.lora_B[adapter].weight
        if base._copied:  # rows several ranks hold alike: summed over their replicas, as the weight's
            b = copy_to_replicas(b, base._copied, base.replica_group)
        return a, b


class LoraRowParallelLinear(_ParallelLora):
    """LoRA on a RowParallelLinear: A_r [rank, in/p] the columns of A the base weight's columns are,
    B [out, rank] replicated (its gradient summed over the group); B (A_r x_r) joins the partial sum."""

    _sharded = "lora_A"

    def _rule(self) -> ShardRule:
        return ShardRule(1)

    def _factors(self, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lora_A[adapter].weight, self._replicated(self.lora_B[adapter].weight)


LORA_LAYERS: Mapping[type, type] = {
    ColumnParallelLinear: LoraColumnParallelLinear,
    RowParallelLinear: LoraRowParallelLinear,
}
LORA_LAYERS_BY_NAME = {layer.__name__: base for base, layer in LORA_LAYERS.items()}
