"""LoRA adapters (PEFT's) on oases' tensor-parallel layers, sharded like their base layers.

Two ways in, one result (p ranks, r this rank; W [out, in] the base layer's weight, A [rank, in]
and B [out, rank] an adapter's factors, s its scaling):

    (A) model = oases.parallelize(model); peft_model = get_peft_model(model, oases.nn.register_lora(LoraConfig(...)))
    (B) peft_model = get_peft_model(model, LoraConfig(...)); oases.parallelize(peft_model.get_base_model())

Either way each targeted ColumnParallelLinear / RowParallelLinear is wrapped by a PEFT LoRA layer
of oases' (oases.nn._lora_layers: LoraColumnParallelLinear, LoraRowParallelLinear), cut as
Megatron's LoRA is (PEFT's megatron path):

    column  A replicated [rank, in],  B_r = B[rows of rank r] [out/p, rank]
            y_r = F.linear(x, W_r, b_r) + s * B_r (A x)                  # before the output's mask / gather
    row     A_r = A[:, columns of rank r] [rank, in/p],  B replicated [out, rank]
            z   = reduce(F.linear(x_r, W_r) + s * B (A_r x_r)) + b         # one reduction of both

The row's term joins its partial sum before the reduction (oases.nn.column.adding), so inside
no_tp_communication (oases.train_step's cores) it is part of the partial sum the schedule
reduces. The replicated factor of each layer (the column's A, the row's B) gets only this rank's
share of its gradient, so it enters the term through copy_to_tp (identity forward, all-reduce of
the gradient), and every adapter gradient is the unsharded PEFT model's; the column's B_r rows that
several ranks hold alike (key-value heads at p > kv_heads) are summed over their replicas as the
base weight's are. Only the adapters train (PEFT freezes the base layers). Each split factor
says how it is cut with tp_layout() (ShardedLoraFactor: the column's B by the base weight's rows
rule, the row's A by ShardRule(1)), so full_state_dict, load_full_state_dict, checkpoints,
clip_grad_norm_ and oases.save_adapter read them unsharded; oases.summary shows the replicated
factors as "summed".

In (A) the factors are drawn as PEFT draws them for an nn.Linear (the same random numbers, in the
same order, then the rank's shard kept), so with the same seed every TP degree holds the adapter
the unsharded PEFT model would. In (B) parallelize sets PEFT's LoRA layers aside, shards their
base linears by the plan and wraps each sharded one in oases' LoRA layer holding its shards of
the PEFT layer's factors (a LoRA layer on a projection the plan leaves whole stays PEFT's).

lora_dropout > 0 trains in oases.train_step, its masks drawn from the step's dropout streams
(oases.models.dropout_streams): a column adapter's on its replicated input from the GROUP stream (one mask
on every rank, as the unsharded layer's one mask over the whole input), a row adapter's on this
rank's input features from the RANK stream (independent, as the unsharded layer's per element);
recomputation redraws them. Outside train_step (model(...)) they come from each rank's global
generator, as any dropout's there.

Refused by name, before anything is changed: the LoRA variants (DoRA's use_dora, aLoRA,
VeLoRA, ...), lora_bias, modules_to_save and trainable tokens, layer_replication,
target_parameters, PEFT adapters other than LoRA on nn.Linear (IA3, LoHa, AdaLoRA, LoRA on
embeddings), and, in (A), initialisations that read the base weight (PiSSA, OLoRA, LoftQ, EVA,
CorDA, LoRA-GA, orthogonal). In (B) also: merged adapters, per-layer tp_degrees, a model built on
meta, sequence_parallel, LoRA on a vocabulary-parallel head.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch.nn as nn

__all__ = ["register_lora", "check_config"]

# Initialisations that draw the factors alone (as nn.Linear and PEFT's reset_lora_parameters do).
_PLAIN_INITS = (True, False, "gaussian")


def register_lora(config: Any) -> Any:
    """`config` (a peft.LoraConfig) with oases' LoRA layers registered for ColumnParallelLinear and
    RowParallelLinear (PEFT's LoraConfig._register_custom_module); returns it, for
    `get_peft_model(oases_model, oases.nn.register_lora(LoraConfig(...)))`.

    ::

        ColumnParallelLinear -> LoraColumnParallelLinear   A replicated, B split on its output rows
        RowParallelLinear    -> LoraRowParallelLinear      A split on its input columns, B replicated

    Targets PEFT already knows (an nn.Linear left whole) keep PEFT's own LoRA layer.

    Args:
        config: a peft.LoraConfig.

    Returns:
        `config`, registered.

    Raises:
        ValueError: a setting oases' LoRA layers do not support, named (use_dora,
            another LoRA variant, lora_bias, modules_to_save, an initialisation that reads the base
            weight, ...), before anything is registered.
        TypeError: `config` is not a peft.LoraConfig (or peft is not installed: ImportError).
    """
    check_config(config, creating=True)
    from oases.nn._lora_layers import LORA_LAYERS  # imports peft

    config._register_custom_module(dict(LORA_LAYERS))
    return config


def _variants(config: Any) -> list[str]:
    """The LoRA variants `config` asks for, by field (PEFT tags them: is_lora_variant, and the
    init_lora_weights values that are variants)."""
    import dataclasses

    found = []
    for field in dataclasses.fields(config):
        if field.name == "init_lora_weights":
            found += [
                f"init_lora_weights={v!r}"
                for v in field.metadata.get("lora_variants", ())
                if config.init_lora_weights == v
            ]
        elif field.metadata.get("is_lora_variant") and getattr(config, field.name):
            found.append(
                "use_dora=True (DoRA)" if field.name == "use_dora" else f"{field.name}={getattr(config, field.name)!r}"
            )
    return found


def check_config(config: Any, *, creating: bool) -> None:
    """Raise a ValueError naming what of `config` (a peft.LoraConfig) oases' LoRA layers do not
    support; `creating`: the factors are drawn here (get_peft_model on an oases model), so
    initialisations that read the base weight are refused too."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig) or str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        raise TypeError(
            f"config: expected a peft.LoraConfig, got {type(config).__name__}; oases' parallel layers take LoRA "
            f"adapters only (not IA3, LoHa, AdaLoRA, ...)"
        )
    problems = []
    problems += [f"{v} (a LoRA variant)" for v in _variants(config)]
    if config.lora_bias:
        problems.append("lora_bias=True (use lora_bias=False)")
    if config.modules_to_save:
        problems.append(f"modules_to_save={list(config.modules_to_save)} (train those modules without PEFT's copies)")
    for name in ("trainable_token_indices", "layer_replication", "target_parameters"):
        if getattr(config, name, None):
            problems.append(f"{name}={getattr(config, name)!r}")
    if creating and not any(config.init_lora_weights is v or config.init_lora_weights == v for v in _PLAIN_INITS):
        problems.append(
            f"init_lora_weights={config.init_lora_weights!r} (it reads the whole base weight, which no rank holds; "
            f"use True, False or 'gaussian', or initialise the unsharded PEFT model and parallelize it)"
        )
    if problems:
        raise ValueError(
            f"LoraConfig: oases' tensor-parallel LoRA layers do not support {'; '.join(problems)}. Nothing was changed"
        )


# --- parallelize(model) of a model holding PEFT's LoRA layers (flow B) ------------------------------------


def peft_lora_layers(model: nn.Module) -> list[str]:
    """The names of PEFT's LoRA layers on nn.Linear / Conv1D in `model` that parallelize can shard
    (none when peft was never imported); a ValueError naming any PEFT module it cannot (another
    adapter type, modules_to_save, dropout, a variant, lora_bias, merged adapters)."""
    layer_module = sys.modules.get("peft.tuners.lora.layer")
    if layer_module is None:  # peft never imported: no PEFT layer can be in the model
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    found = []
    for name, m in model.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            raise ValueError(
                f"model: {name} is a PEFT {type(m).__name__} (modules_to_save / trainable tokens), which "
                f"oases.parallelize does not shard; make the PEFT model without modules_to_save"
            )
        if not isinstance(m, BaseTunerLayer):
            continue
        if type(m) is not layer_module.Linear:
            raise ValueError(
                f"model: {name} is a PEFT {type(m).__name__}; oases.parallelize shards PEFT's LoRA on nn.Linear "
                f"(peft.tuners.lora.Linear) only, not other adapter types (IA3, LoHa, AdaLoRA, LoRA on embeddings) "
                f"nor a model parallelized already"
            )
        problems = []
        for adapter, variant in m.lora_variant.items():
            kind = "DoRA (use_dora=True)" if "Dora" in type(variant).__name__ else type(variant).__name__
            problems.append(f"{kind} (adapter {adapter!r}, a LoRA variant)")
        problems += [f"lora_bias (adapter {a!r})" for a, on in m.lora_bias.items() if on]
        if m.merged:
            problems.append(f"merged adapters {m.merged_adapters} (unmerge them first)")
        if problems:
            raise ValueError(
                f"model: {name}: oases' tensor-parallel LoRA layers do not support {'; '.join(problems)}. "
                f"Nothing was changed"
            )
        found.append(name)
    return found


class SetAside:
    """PEFT's LoRA layers of a model replaced by their base layers while parallelize plans and
    shards those, then put back: around each sharded base layer oases' LoRA layer holding its
    shards of the adapters, around one left whole PEFT's own layer (restore(): all as they were)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.held: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, child name, PEFT's layer)
        for name in names:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            self.held.append((parent, leaf, getattr(parent, leaf)))
        self.names = names
        for parent, leaf, layer in self.held:
            setattr(parent, leaf, layer.base_layer)

    def check_planned(self, placed: dict[str, Any]) -> None:
        """A LoRA layer's base planned as a vocabulary-parallel head is refused (ValueError)."""
        for name in self.names:
            style = placed.get(name)
            if style is not None and style.kind == "vocab_head":
                raise ValueError(
                    f"model: {name} carries PEFT LoRA adapters and is planned as a vocabulary-parallel head "
                    f"('vocab_head'), which oases' LoRA layers do not support; leave it out of target_modules, or "
                    f"parallelize with vocab_parallel=False"
                )

    def restore(self) -> None:
        """Every PEFT layer back where it was, around its own base layer."""
        for parent, leaf, layer in self.held:
            setattr(parent, leaf, layer)

    def put_back(self) -> None:
        """Around each sharded base layer, oases' LoRA layer with its shards of the PEFT layer's
        adapters; around one left whole, the PEFT layer itself."""
        if not self.held:
            return
        from oases.nn._lora_layers import LORA_LAYERS

        for parent, leaf, layer in self.held:
            base = getattr(parent, leaf)
            cls = next((c for kind, c in LORA_LAYERS.items() if isinstance(base, kind)), None)
            if cls is None:
                layer.base_layer = base
                setattr(parent, leaf, layer)
            else:
                setattr(parent, leaf, cls.from_peft(layer, base))


def set_aside(model: nn.Module, *, tp_degrees: Optional[object], on_meta: bool, sequence_parallel: bool) -> SetAside:
    """parallelize's first step on a model holding PEFT's LoRA layers: each checked (ValueError
    naming what is not supported, before anything is changed), then replaced by its base layer."""
    names = peft_lora_layers(model)
    if names:
        given = [
            what
            for what, on in (
                ("tp_degrees", tp_degrees is not None),
                ("device= (a model built on meta)", on_meta),
                ("sequence_parallel=True", sequence_parallel),
            )
            if on
        ]
        if given:
            raise ValueError(
                f"model: {names[0]} carries PEFT LoRA adapters, which oases.parallelize does not shard with "
                f"{', '.join(given)} yet; parallelize without it"
            )
    return SetAside(model, names)
