"""OasesTrainer's checks: the Trainer options it refuses and the (dp, tp) layout it runs, decided
locally on every rank before any communication. See oases.integrations.transformers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn
from transformers import TrainingArguments

from oases import _checks
from oases.nn.parallelism import parallelism_of

ELEMENTWISE_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")


def refusals(args: TrainingArguments, bound: dict[str, Any], prepared_model: bool) -> list[str]:
    """One line per Trainer option or argument OasesTrainer does not run (local: no communication)."""
    found = []

    def refuse(flag: str, why: str) -> None:
        found.append(f"OasesTrainer: {flag}: {why}")

    if bound.get("model") is None:
        refuse("model_init", "not supported; build the model on every rank alike and pass model=")
    model = bound.get("model")
    if isinstance(model, nn.Module) and (
        getattr(model, "is_quantized", False)
        or any(type(m).__module__.split(".")[0] == "bitsandbytes" for m in model.modules())
    ):
        refuse(
            "model: quantized (bitsandbytes, QLoRA)",
            "oases shards full-precision projections; load the model unquantized (e.g. bf16), LoRA on top",
        )
    if bound.get("compute_loss_func") is not None:
        refuse("compute_loss_func", "not supported; the loss is the causal-LM loss of oases.train_step")
    if args.torch_compile:
        refuse("torch_compile=True", "not supported; compile the model yourself before OasesTrainer, or drop it")
    if args.label_smoothing_factor:
        refuse(f"label_smoothing_factor={args.label_smoothing_factor}", "not supported; set it to 0")
    if args.neftune_noise_alpha is not None:
        refuse("neftune_noise_alpha", "NEFTune is not supported; leave it None")
    if args.deepspeed:
        refuse("deepspeed", "not with OasesTrainer (its own TP x DP); remove the DeepSpeed config")
    if args.fsdp:
        refuse("fsdp", "not with OasesTrainer (its own TP x DP); remove the FSDP options")
    config = args.parallelism_config
    if config is not None:
        for field in ("dp_shard_size", "cp_size", "sp_size"):
            if getattr(config, field, 1) > 1:
                refuse(
                    f"parallelism_config.{field}={getattr(config, field)}",
                    "OasesTrainer runs tensor x data parallelism (tp_size, dp_replicate_size); set it to 1",
                )
        tp_size = bound.get("tp_size")
        if tp_size is not None and tp_size != config.tp_size:
            refuse(
                f"tp_size={tp_size}",
                f"contradicts parallelism_config.tp_size={config.tp_size}; pass one of them",
            )
    if args.load_best_model_at_end:
        refuse("load_best_model_at_end=True", "not supported yet; set it to False")
    if args.use_liger_kernel:
        refuse("use_liger_kernel=True", "not supported; Oases shards the model's own modules")
    if args.train_sampling_strategy == "batch_rebalance":
        refuse(
            "train_sampling_strategy='batch_rebalance'",
            "not supported; use 'random', 'sequential' or 'group_by_length'",
        )
    if args.accelerator_config.dispatch_batches:
        refuse("accelerator_config.dispatch_batches=True", "not supported; every rank loads its DP shard")
    optimizers = bound.get("optimizers") or (None, None)
    custom = optimizers[0] is not None or bound.get("optimizer_cls_and_kwargs") is not None
    optim = getattr(args.optim, "value", args.optim)
    if not custom and optim not in ELEMENTWISE_OPTIMIZERS:
        refuse(
            f"optim={optim!r}",
            f"only element-wise optimizers give the unsharded model's update on TP shards "
            f"({', '.join(ELEMENTWISE_OPTIMIZERS)}); or pass optimizer_cls_and_kwargs= with one",
        )
    if optimizers[0] is not None and not prepared_model:
        refuse(
            "optimizers",
            "an optimizer made before OasesTrainer parallelizes the model holds the replaced parameters; "
            "pass optimizer_cls_and_kwargs=, or parallelize the model first",
        )
    model = bound.get("model")
    checkpointing = getattr(type(model), "is_activation_checkpointing", None) is not None  # transformers >= 5.x
    if getattr(model, "is_activation_checkpointing" if checkpointing else "is_gradient_checkpointing", False):
        refuse(
            "the model's own gradient checkpointing",
            "disable it (model.gradient_checkpointing_disable()); activation_checkpointing=True is Oases' recompute",
        )
    made = parallelism_of(model)
    if made is not None and made.tp_degrees is not None:
        refuse("a model with per-layer tp_degrees", "not supported yet; parallelize with one TP degree")
    return found


def tp_groups(model: nn.Module) -> list[Optional[dist.ProcessGroup]]:
    """The distinct process groups of the model's tensor-parallel modules (none: not parallelized)."""
    groups: list[Optional[dist.ProcessGroup]] = []
    for module in model.modules():
        if hasattr(module, "tp_layout") and not any(module.group is g for g in groups):
            groups.append(module.group)
    return groups


def is_peft(model: Any) -> bool:
    """Whether `model` is a peft.PeftModel (its get_base_model() is the model oases runs)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    if not dist.is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def option_problems(args: TrainingArguments, bound: dict[str, Any], sub_batches: Any, zero: Any) -> list[str]:
    """One line per OasesTrainer option that is malformed or does not combine with Trainer's."""
    found = []
    if sub_batches is not None and (not _checks.is_int(sub_batches) or sub_batches < 1):
        found.append(f"OasesTrainer: sub_batches={sub_batches!r}: expected a positive int or None")
    if not isinstance(zero, bool):
        found.append(f"OasesTrainer: zero={zero!r}: expected True or False")
    elif zero and args.fp16:
        found.append("OasesTrainer: zero=True with fp16=True: not supported yet; use bf16=True")
    elif zero and (bound.get("optimizers") or (None, None))[0] is not None:
        found.append("OasesTrainer: zero=True with optimizers=: pass optimizer_cls_and_kwargs= instead")
    return found


def resolve_tp_size(config: Any, tp_size: Any, groups: list[Optional[dist.ProcessGroup]], world: int, rank: int) -> int:
    """The TP size of the (dp, tp) layout, ranks r*tp .. r*tp + tp - 1 one TP group:

        parallelism_config's tp_size (its total must be the world), else tp_size=, else the
        size of the group the model is already parallelized over (`groups`: tp_groups), else the world
    ValueError when it does not divide the world, or when that group is not this rank's TP group."""
    if config is not None:
        if config.total_size != world:
            raise ValueError(
                f"OasesTrainer: parallelism_config: tp_size x dp_replicate_size = {config.total_size}, but the "
                f"world has {world} ranks; make them equal"
            )
        tp_size = config.tp_size
    if tp_size is None:
        tp_size = len(group_ranks(groups[0])) if groups else world
    if not _checks.is_int(tp_size) or tp_size < 1 or world % tp_size:
        raise ValueError(
            f"OasesTrainer: tp_size={tp_size!r} does not divide the world of {world} ranks "
            f"(world = tp_size x dp); pick a divisor of {world}"
        )
    block = rank // tp_size * tp_size
    if groups and group_ranks(groups[0]) != list(range(block, block + tp_size)):
        raise ValueError(
            f"OasesTrainer: model: parallelized over ranks {group_ranks(groups[0])}, but tp_size={tp_size} "
            f"puts rank {rank} in TP group {list(range(block, block + tp_size))} (init_device_mesh((dp, tp)): "
            f"consecutive ranks); parallelize over mesh['tp'] of that mesh, or pass the plain model"
        )
    return tp_size
