"""transformers' `Trainer` on Oases: tensor parallelism with the overlapped schedules, data
parallelism over the rest of the world, by changing one class name.

    from oases.integrations.transformers import OasesTrainer
    trainer = OasesTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, eval_dataset=ev,
                           data_collator=collator, tp_size=2, schedule="oases")   # under torchrun / oases-launch
    trainer.train(); trainer.evaluate()

Layout. tp_size= or TrainingArguments.parallelism_config (accelerate's ParallelismConfig: tp_size x
dp_replicate_size, taken here and not handed to accelerate). The world is a (dp, tp) mesh,
`init_device_mesh(device, (world / tp_size, tp_size), mesh_dim_names=("dp", "tp"))`: ranks r*tp ..
r*tp + tp - 1 are one TP group (the model's shards), ranks holding the same TP rank one DP group. A
plain Hugging Face causal LM is sharded with `oases.parallelize(model, mesh["tp"])`; one already
parallelized over those TP groups is taken as it is. The model is not wrapped in DDP: its parameters
are broadcast from the first DP replica (as DDP does), and `oases.dp.GradientSync(model,
mesh["dp"])` averages the gradients once per optimizer step, at the last micro-batch of the
accumulation window (its buckets overlapping that backward).

ZeRO-1. zero=True: Trainer's optimizer (class, hyper-parameters, weight-decay groups) inside
oases.dp.ZeroOptimizer over the DP group; its .sync reduce-scatters the gradients.

Data. Trainer's own data loader (the same sampler, seed, collator and accelerate's shards), split
over the DP ranks only: the TP ranks of a group get the same batches; DataLoader workers are seeded
by the DP rank. Evaluation runs the whole eval set on every rank (not split over DP yet) and its
loss is the single process's.

Step. `training_step` runs `oases.train_step(model, input_ids, labels, schedule=..., attention_mask=...,
num_items=...)`: the loss is Trainer's, the sum of the token losses over num_items_in_batch (the
labels[:, 1:] != -100 of the whole accumulation window, over every DP rank), so losses, gradients,
the logged loss and `grad_norm` (oases.nn.clip_grad_norm_: the unsharded model's norm) are the
single process's. `activation_checkpointing` (`gradient_checkpointing`) is Oases' recomputation
(`recompute=True`; off: `recompute="auto"`, each layer kept or recomputed to fit the device's
memory), Hugging Face's own checkpointing is never enabled on top.

Checkpoints. Each checkpoint-N holds `oases/`, an `oases.save_checkpoint` written by every rank (the
shards, AdamW's state, the LR scheduler and the position in `extra`, each rank's RNG), beside
Trainer's trainer_state.json and rng_state_<rank>.pth; `train(resume_from_checkpoint=...)` reads
them back: bit-exactly at the same layout, and at another TP / DP layout with the same global batch
(oases.load_checkpoint re-shards the model and the optimizer's state, verifying what each rank
reads). resume_from_checkpoint=True takes the newest checkpoint-N that verifies (trainer_state.json
readable, oases/ whole: oases.verify_checkpoint), skipping newer damaged or unfinished ones with one
warning. save_total_limit rotates the complete checkpoint-N folders once every rank has finished
writing the new one, on each node (its local rank 0), by step; unfinished ones are not counted.
`save_model()` writes the Hugging Face export with `oases.save_pretrained` (every rank takes part;
rank 0 writes); a PEFT model's adapter with `oases.save_adapter` (PEFT's format).

fp16. The loss scale is oases.amp.GradScaler's (accelerator.scaler): its inf/NaN verdict is the
world's, so every rank skips the same steps; the scaled loss is the summed loss over num_items /
scale; gradients are unscaled once before clipping; its state is checkpointed by Trainer
(scaler.pt). bf16 needs no scaler.

PEFT. A peft.PeftModel (LoRA) is taken as the model: unsharded, its base model is parallelized with
PEFT's LoRA layers set aside and rewrapped on the shards (oases.nn.lora); the step runs its base
model; only the adapters train.

What it refuses (a ValueError in __init__ naming the flag, on every rank): torch_compile,
label_smoothing_factor, compute_loss_func, NEFTune, DeepSpeed, FSDP, parallelism_config beyond
tp_size x dp_replicate_size (or contradicting tp_size=), a quantized model (bitsandbytes: QLoRA),
load_best_model_at_end, Liger kernels, model_init, optimizers
other than torch's element-wise ones, a prepared optimizer over a model still to be parallelized,
batch_rebalance sampling, dispatch_batches; in a batch, keys other than input_ids, labels,
attention_mask, position_ids (and the varlen keys padding-free collators derive from position_ids).

Packed rows. position_ids restarting at each document (DataCollatorWithFlattening, TRL's
padding_free / packing) reach the model's own forward, which keeps the documents apart. A batch
with fewer rows than the schedule's sub-batches (per_device_train_batch_size=1, a padding-free
batch) that packs several documents is cut at document starts into rows of one length, padded
with documents of their own whose labels are -100 (the same losses and gradients), so the
sub-batches still overlap; one that cannot be cut runs as fewer sub-batches, said once.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import math
import os
import shutil
import warnings
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks

_MISSING = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(
        f"oases.integrations.transformers needs {' and '.join(_MISSING)} (transformers' Trainer runs on "
        "accelerate): pip install transformers accelerate (tested: transformers==5.23.0, accelerate==1.15.0)"
    )

from accelerate.data_loader import prepare_data_loader  # noqa: E402
from accelerate.utils import recursively_apply  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker  # noqa: E402
from transformers.utils import logging  # noqa: E402

import oases  # noqa: E402
from oases._dcp import MARKER  # noqa: E402
from oases.dp import GradientSync, ZeroOptimizer  # noqa: E402
from oases.schedule import MAX_SUB_BATCHES, SCHEDULES  # noqa: E402

__all__ = ["OasesTrainer"]

OASES_CHECKPOINT = "oases"  # the sharded checkpoint's folder inside checkpoint-N
ELEMENTWISE_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
# what padding-free collators (TRL's, DataCollatorWithFlattening) add beside position_ids for
# flash-attention's varlen kernels: derived from position_ids, which the model's forward reads
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
IGNORE_INDEX = -100

logger = logging.get_logger(__name__)


class _StepInputs(NamedTuple):
    """A micro-batch as oases.train_step takes it."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]


def _split_packed(
    input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, parts: int
) -> Optional[_StepInputs]:
    """A packed batch of one row [1, t] (documents one after another, position_ids restarting at
    each) cut at document starts into up to `parts` rows of one length, each padded at its end
    with a document of its own whose labels are -100; None where no cut qualifies (one document).

    ::

        starts = {s : position_ids[s] - position_ids[s - 1] != 1 and labels[s] == -100}
        cuts   = the start nearest j t / parts, j = 1 .. parts - 1
        row k  = tokens[cut_k : cut_k+1] + padding             # width = the longest piece

    The same token losses and gradients: a cut is made only where the document's first label is
    -100 (no loss term crosses it), each document keeps its tokens and positions, and padding
    after a row's tokens changes none of them (causal attention, a document of its own)."""
    if input_ids.shape[0] != 1 or parts < 2:
        return None
    t, pos = input_ids.shape[1], position_ids[0]
    starts = [int(s) + 1 for s in ((pos[1:] - pos[:-1]) != 1).nonzero().flatten()]
    starts = [s for s in starts if int(labels[0, s]) == IGNORE_INDEX]
    if not starts:
        return None
    cuts = sorted({min(starts, key=lambda s: abs(s - j * t / parts)) for j in range(1, parts)})
    bounds = list(zip([0, *cuts], [*cuts, t]))
    width = max(b - a for a, b in bounds)

    def piece(tensor: torch.Tensor, a: int, b: int, fill: Optional[int]) -> torch.Tensor:
        n = width - (b - a)
        pad = torch.arange(n, dtype=tensor.dtype, device=tensor.device) if fill is None else tensor.new_full((n,), fill)
        return torch.cat([tensor[0, a:b], pad])

    return _StepInputs(
        torch.stack([piece(input_ids, a, b, 0) for a, b in bounds]),
        torch.stack([piece(labels, a, b, IGNORE_INDEX) for a, b in bounds]),
        None,
        torch.stack([piece(position_ids, a, b, None) for a, b in bounds]),
    )


def _refusals(args: TrainingArguments, bound: dict[str, Any], prepared_model: bool) -> list[str]:
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
    if getattr(model, "tp_degrees", None) is not None:
        refuse("a model with per-layer tp_degrees", "not supported yet; parallelize with one TP degree")
    return found


def _tp_groups(model: nn.Module) -> list[Optional[dist.ProcessGroup]]:
    """The distinct process groups of the model's tensor-parallel modules (none: not parallelized)."""
    groups: list[Optional[dist.ProcessGroup]] = []
    for module in model.modules():
        if hasattr(module, "tp_layout") and not any(module.group is g for g in groups):
            groups.append(module.group)
    return groups


def _checkpoints(run_dir: str) -> list[str]:
    """The checkpoint-N folders of run_dir, oldest (lowest N) first."""
    steps = []
    for name in os.listdir(run_dir):
        prefix, _, step = name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(run_dir, name)):
            steps.append((int(step), os.path.join(run_dir, name)))
    return [folder for _, folder in sorted(steps)]


def _complete(folder: str) -> bool:
    """Whether checkpoint-N `folder` was written to the end: its oases/ published (its marker) and
    Trainer's trainer_state.json, written after it (stats only)."""
    return os.path.isfile(os.path.join(folder, OASES_CHECKPOINT, MARKER)) and os.path.isfile(
        os.path.join(folder, TRAINER_STATE_NAME)
    )


def _rotate(run_dir: str, limit: int, best: Optional[str]) -> None:
    """Delete the oldest complete checkpoint-N folders of run_dir by N until `limit` complete ones
    are left; the newest and `best` are kept whatever the limit (as Trainer's rotation).
    Incomplete ones (a save that died) are neither counted nor deleted, so they never push out
    the newest one that loads."""
    folders = [folder for folder in _checkpoints(run_dir) if _complete(folder)]
    kept = {folders[-1]} if folders else set()
    if best is not None:
        kept.add(os.path.normpath(best))
    left = len(folders)
    for folder in folders:
        if left <= max(limit, len(kept)):
            break
        if os.path.normpath(folder) not in kept:
            shutil.rmtree(folder, ignore_errors=True)
            left -= 1


def _weight_decay_groups(cls: type, decays: list[bool], weight_decay: float) -> type:
    """`cls` built on ZeroOptimizer's masters in two groups, as Trainer groups the parameters:
    weight_decay on those whose flag in `decays` (by position) is set, 0 on the others."""

    class Grouped(cls):  # type: ignore[misc, valid-type]
        def __init__(self, masters: list, **kwargs: Any) -> None:
            groups = [
                {"params": [m for m, d in zip(masters, decays) if d], "weight_decay": weight_decay},
                {"params": [m for m, d in zip(masters, decays) if not d], "weight_decay": 0.0},
            ]
            super().__init__([g for g in groups if g["params"]], **kwargs)

    Grouped.__name__ = Grouped.__qualname__ = cls.__name__
    return Grouped


def _is_peft(model: Any) -> bool:
    """Whether `model` is a peft.PeftModel (its get_base_model() is the model oases runs)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def _group_ranks(group: Optional[dist.ProcessGroup]) -> list[int]:
    if not dist.is_initialized():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


class OasesTrainer(Trainer):
    """transformers.Trainer training a tensor-parallel model on Oases' schedules (see the module docstring).

    Args:
        model: a Hugging Face causal LM, the same on every rank (parallelized here over the TP
            groups), or one already parallelized with `oases.parallelize(model, mesh["tp"])`.
        args, *trainer_args, **trainer_kwargs: transformers.Trainer's own.
        tp_size: ranks per TP group; it must divide the world (None: an already-parallelized
            model's TP size, else the whole world).
        schedule: the TP schedule of oases.train_step ("megatron", "merak", "cross_pass", "oases").
        sub_batches: how many interleaved parts each micro-batch is split into (None: the
            schedule's own; a batch with fewer rows runs with one part per row).
        recompute: oases.train_step's recompute (None: True with args.activation_checkpointing,
            else "auto": each layer kept, selective or recomputed to fit the device's memory;
            False keeps every layer, "selective" for selective recomputation).
        memory_budget: with recompute="auto", the rank's peak in bytes (None: the device's rule).
        zero: ZeRO-1 over the DP ranks: the optimizer Trainer would build (its class, hyper-parameters
            and weight-decay groups) inside oases.dp.ZeroOptimizer, each DP rank holding the state
            of 1/dp of every parameter's rows; gradients reduce-scattered during the window's last
            backward, clipped by the whole averaged gradient's norm (not with fp16 or optimizers=).

    Raises:
        ValueError: an option OasesTrainer does not run (one line naming it), a tp_size that does
            not divide the world, or a model parallelized over other groups: on every rank, before
            any communication.
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        args: Optional[TrainingArguments] = None,
        *trainer_args: Any,
        tp_size: Optional[int] = None,
        schedule: str = "oases",
        sub_batches: Optional[int] = None,
        recompute: Optional[Any] = None,
        memory_budget: Optional[float] = None,
        zero: bool = False,
        **trainer_kwargs: Any,
    ) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        # the arguments by the next class's names (Trainer's, or a subclass's such as TRL's SFTTrainer)
        bound = inspect.signature(super().__init__).bind(model, args, *trainer_args, **trainer_kwargs).arguments
        bound["tp_size"] = tp_size
        groups = _tp_groups(model) if isinstance(model, nn.Module) else []
        problems = _refusals(args, bound, prepared_model=bool(groups))
        _checks.one_of("schedule", schedule, SCHEDULES)
        if sub_batches is not None and (not _checks.is_int(sub_batches) or sub_batches < 1):
            problems.append(f"OasesTrainer: sub_batches={sub_batches!r}: expected a positive int or None")
        if not isinstance(zero, bool):
            problems.append(f"OasesTrainer: zero={zero!r}: expected True or False")
        elif zero and args.fp16:
            problems.append("OasesTrainer: zero=True with fp16=True: not supported yet; use bf16=True")
        elif zero and (bound.get("optimizers") or (None, None))[0] is not None:
            problems.append("OasesTrainer: zero=True with optimizers=: pass optimizer_cls_and_kwargs= instead")
        if len(groups) > 1:
            problems.append("OasesTrainer: model: its TP modules use several process groups; parallelize it once")
        if problems:
            raise ValueError("\n".join(problems))
        # parallelism_config's layout is OasesTrainer's to apply, not accelerate's
        config, args.parallelism_config = args.parallelism_config, None
        _ = args.device  # under torchrun: accelerate initializes the process group here
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if config is not None:
            if config.total_size != world:
                raise ValueError(
                    f"OasesTrainer: parallelism_config: tp_size x dp_replicate_size = {config.total_size}, but the "
                    f"world has {world} ranks; make them equal"
                )
            tp_size = config.tp_size
        if tp_size is None:
            tp_size = len(_group_ranks(groups[0])) if groups else world
        if not _checks.is_int(tp_size) or tp_size < 1 or world % tp_size:
            raise ValueError(
                f"OasesTrainer: tp_size={tp_size!r} does not divide the world of {world} ranks "
                f"(world = tp_size x dp); pick a divisor of {world}"
            )
        block = rank // tp_size * tp_size
        if groups and _group_ranks(groups[0]) != list(range(block, block + tp_size)):
            raise ValueError(
                f"OasesTrainer: model: parallelized over ranks {_group_ranks(groups[0])}, but tp_size={tp_size} "
                f"puts rank {rank} in TP group {list(range(block, block + tp_size))} (init_device_mesh((dp, tp)): "
                f"consecutive ranks); parallelize over mesh['tp'] of that mesh, or pass the plain model"
            )
        self.tp_size, self.dp_size = tp_size, world // tp_size
        self.dp_rank = rank // tp_size
        self.schedule, self.sub_batches = schedule, sub_batches
        self.recompute = (True if args.activation_checkpointing else "auto") if recompute is None else recompute
        self.memory_budget = memory_budget
        self.device_mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.device_mesh = init_device_mesh(
                args.device.type, (self.dp_size, self.tp_size), mesh_dim_names=("dp", "tp")
            )
        if not groups and tp_size > 1:
            if _is_peft(model):  # PEFT's LoRA layers set aside, their base linears sharded (oases.nn.lora)
                oases.parallelize(model.get_base_model(), self.device_mesh["tp"])
            else:
                model = oases.parallelize(model, self.device_mesh["tp"])
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        # The model owns its placement and gradient reduction: Trainer prepares it without DDP (as a
        # model sharded at load time) and this class averages the gradients over dp itself.
        self.is_distributed_loading_by_transformers = True
        self.grad_sync: Optional[GradientSync] = None  # with zero: the ZeroOptimizer's, made with it
        self.zero = zero
        if self.dp_size > 1:
            self._broadcast_from_first_replica()
            if not zero:
                self.grad_sync = GradientSync(self.model, self.device_mesh["dp"])
        self._window: Optional[list[int]] = None  # the sub-batches of each micro-batch of this window
        self._micro = 0
        self._learned: Optional[tuple[int, ...]] = None  # the window GradientSync learned its counts on
        self._saving_checkpoint = False
        self._said_one_part = False
        self._unscaled = False  # whether this window's gradients were unscaled (fp16)
        if args.fp16:
            # oases.amp.GradScaler: one inf/NaN verdict over the world (every TP shard and DP replica),
            # so every rank skips the same steps; accelerate's optimizer wrapper steps and updates it
            self.accelerator.scaler = oases.amp.GradScaler(self.args.device.type)

    # --- layout --------------------------------------------------------------------------------

    def _broadcast_from_first_replica(self) -> None:
        """Every parameter and buffer from the first DP replica (DP rank 0, the same TP rank), as DDP does."""
        group = self.device_mesh["dp"].get_group()
        source = dist.get_rank() % self.tp_size  # the global rank of DP rank 0 in this rank's dp group
        seen = set()
        with torch.no_grad():
            for tensor in list(self.model.parameters()) + list(self.model.buffers()):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    dist.broadcast(tensor.data, src=source, group=group)

    def get_tp_size(self) -> int:
        """The TP size (Trainer's total batch size counts dp = world / tp)."""
        return self.tp_size

    def _sync_replicated_trainable_parameters(self, model: nn.Module) -> None:
        """Nothing: Trainer's version (for FSDP2 models) would overwrite every rank's TP shards with rank 0's."""

    # --- data ----------------------------------------------------------------------------------

    def _get_dataloader(
        self,
        dataset,
        description: str,
        batch_size: int,
        sampler_fn=None,
        is_training: bool = False,
        dataloader_key: Optional[str] = None,
    ) -> DataLoader:
        """Trainer's data loader, sharded over the DP ranks only for training (the TP ranks of a
        group get the same batches); evaluation loads the whole set on every rank."""
        collator = self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        args = self.args
        params: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "in_order": args.dataloader_in_order,
        }
        if not isinstance(dataset, IterableDataset):
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            if sampler is not None:
                params["sampler"] = sampler
            params["drop_last"] = args.dataloader_drop_last
            if is_training:
                params["worker_init_fn"] = functools.partial(
                    seed_worker, num_workers=args.dataloader_num_workers, rank=self.dp_rank
                )
        accelerator = self.accelerator
        replicas, index = (self.dp_size, self.dp_rank) if is_training else (1, 0)
        loader = prepare_data_loader(
            DataLoader(dataset, **params),
            accelerator.device,
            num_processes=replicas,
            process_index=index,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement,
            rng_types=accelerator.rng_types.copy(),
            dispatch_batches=False,
            even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(loader)
        if dataloader_key is not None and args.dataloader_persistent_workers:
            if not hasattr(self, "_eval_dataloaders"):
                self._eval_dataloaders = {}
            self._eval_dataloaders[dataloader_key] = loader
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Trainer's accumulation window, remembering each micro-batch's sub-batches (the DP sync
        runs at the window's last one)."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._window = [self._parts(self._step_inputs(batch).input_ids.shape[0]) for batch in batch_samples]
        self._micro = 0
        return batch_samples, num_items

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The window's labels[:, 1:] != -100 count: summed over the DP ranks with
        average_tokens_across_devices (Trainer's default), this rank's otherwise; None where
        Trainer divides by the accumulation steps instead (a model without loss kwargs)."""
        if not batch_samples or "labels" not in batch_samples[0] or not self.model_accepts_loss_kwargs:
            return None
        count = sum(batch["labels"][..., 1:].ne(IGNORE_INDEX).sum() for batch in batch_samples)
        count = torch.as_tensor(count, dtype=torch.int64, device=device)
        if self.args.average_tokens_across_devices and self.dp_size > 1:
            dist.all_reduce(count, group=self.device_mesh["dp"].get_group())
        return count

    def _track_num_input_tokens(self, inputs) -> None:
        """Trainer's count gathers every rank; the TP ranks of a group saw the same tokens."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.tp_size

    # --- step ----------------------------------------------------------------------------------

    def _parts(self, rows: int) -> int:
        parts = SCHEDULES[self.schedule].sub_batches if self.sub_batches is None else self.sub_batches
        return max(1, min(parts, rows))

    def _step_inputs(self, inputs: dict[str, Any]) -> _StepInputs:
        """The step's tensors of a batch, a packed row cut into rows at document starts where the
        batch has fewer rows than the schedule's sub-batches (_split_packed); ValueError for what
        train_step cannot take."""
        keys = set(inputs) - set(BATCH_KEYS)
        if "position_ids" in inputs:
            keys -= set(VARLEN_KEYS)  # derived from position_ids: the model's own forward derives them again
        if keys:
            raise ValueError(
                f"OasesTrainer: the batch has {', '.join(sorted(keys))}; oases.train_step takes input_ids, labels, "
                f"attention_mask and position_ids (drop the others in the collator)"
            )
        if "labels" not in inputs or "input_ids" not in inputs:
            raise ValueError("OasesTrainer: the batch needs input_ids and labels (a causal LM's collator makes them)")
        step = _StepInputs(
            inputs["input_ids"], inputs["labels"], inputs.get("attention_mask"), inputs.get("position_ids")
        )
        parts = self._parts(step.input_ids.shape[0])
        wanted = self._parts(MAX_SUB_BATCHES)
        if parts < wanted and step.position_ids is not None and step.attention_mask is None:
            cut = _split_packed(step.input_ids, step.labels, step.position_ids, wanted)
            if cut is not None:
                return cut
        if parts < wanted and not self._said_one_part:
            self._said_one_part = True
            logger.warning(
                f"OasesTrainer: a batch of {step.input_ids.shape[0]} row(s) runs as {parts} sub-batch(es) of the "
                f"{wanted} schedule {self.schedule!r} interleaves: the overlap between sub-batches is given up for it "
                f"(per_device_train_batch_size >= {wanted}, or packed rows holding several documents, keep it)"
            )
        return step

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """oases.train_step on this micro-batch: the loss is the sum of its token losses over
        num_items_in_batch (÷ dp: GradientSync averages), its gradients added to .grad; the DP
        sync at the window's last micro-batch. Returns the loss Trainer logs (its meaning)."""
        self.model.train()
        inputs = self._prepare_inputs(inputs)
        step = self._step_inputs(inputs)
        parts = self._parts(step.input_ids.shape[0])
        if self._window is not None and self._micro < len(self._window):
            first, last, window = self._micro == 0, self._micro == len(self._window) - 1, tuple(self._window)
            self._micro += 1
        else:  # called outside Trainer's window (by a subclass, or by hand): a window of its own
            first, last, window = True, True, (parts,)
        sync = self.grad_sync
        if sync is not None and first and window != self._learned:
            sync.relearn()  # accumulation counts per window change with its micro-batches' sub-batches
            self._learned = window
        if first:
            self._unscaled = False
        # fp16: the loss scaled through its divisor (the gradients come out scale times larger)
        scale = self._scale()
        divisor = self._divisor(step.labels, num_items_in_batch) / scale
        with self.accelerator.autocast():
            if sync is not None and not last:
                with sync.deferred():  # accumulate; the window's last micro-batch reduces
                    loss = self._train_step(step, parts, divisor, None)
            else:
                loss = self._train_step(step, parts, divisor, sync)
        return loss.detach() / scale

    def _scale(self) -> float:
        """The fp16 loss scale (1 without a GradScaler)."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.scale(torch.ones((), device=self.args.device)))  # scale() starts its state

    def _unscale(self) -> None:
        """fp16: the window's gradients divided by the scale, once, with the world's inf verdict."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled() and not self._unscaled:
            scaler.unscale_(self._optimizer())
            self._unscaled = True

    def _divisor(self, labels: torch.Tensor, num_items_in_batch) -> float:
        """What this micro-batch's summed loss is divided by, as Trainer normalises it."""
        if num_items_in_batch is None:  # Trainer: the batch's mean over the accumulation steps
            count = int(labels[:, 1:].ne(IGNORE_INDEX).sum())
            divisor = count * self.current_gradient_accumulation_steps
        else:
            divisor = float(num_items_in_batch)
            if self.args.average_tokens_across_devices and self.dp_size > 1:
                divisor /= self.dp_size  # the count is the dp ranks' total and GradientSync averages
        return divisor if divisor > 0 else 1.0  # no token with a label in the window: a zero loss

    def _train_step(self, step: _StepInputs, parts: int, divisor: float, grad_sync) -> torch.Tensor:
        return oases.train_step(
            self.model.get_base_model() if _is_peft(self.model) else self.model,
            step.input_ids,
            step.labels,
            schedule=self.schedule,
            sub_batches=parts,
            attention_mask=step.attention_mask,
            position_ids=step.position_ids,
            num_items=divisor,
            recompute=self.recompute,
            memory_budget=self.memory_budget,
            grad_sync=grad_sync,
        )

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip by the unsharded model's gradient norm (oases.nn.clip_grad_norm_; with zero, the
        ZeroOptimizer's of the whole averaged gradient), fp16's gradients unscaled first; returns the norm."""
        self._unscale()
        if self.zero:
            return self._optimizer().clip_grad_norm_(self.args.max_grad_norm)
        return oases.nn.clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        """The unsharded model's gradient norm (computed where max_grad_norm is 0: nothing clipped)."""
        if grad_norm is None:
            self._unscale()
            if self.zero:
                return self._optimizer().clip_grad_norm_(math.inf)
            grad_norm = oases.nn.clip_grad_norm_(self.model, math.inf)
        return grad_norm

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *train_args: Any, **train_kwargs: Any):
        """Trainer.train, with Hugging Face's activation checkpointing left off (Oases recomputes:
        see `recompute`). resume_from_checkpoint=True resumes from the newest checkpoint-N of
        output_dir that verifies (`_newest_sound`), not merely the newest folder."""
        args = self.args
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_sound(args.output_dir)
        saved = args.activation_checkpointing, args.gradient_checkpointing
        args.activation_checkpointing = args.gradient_checkpointing = False
        try:
            return super().train(resume_from_checkpoint, *train_args, **train_kwargs)
        finally:
            args.activation_checkpointing, args.gradient_checkpointing = saved

    def _newest_sound(self, run_dir: str) -> str:
        """The newest checkpoint-N of run_dir that verifies, agreed by every rank (a collective):

        for folder in rank 0's checkpoint-N folders, newest first:
            every rank: trainer_state.json present and JSON; oases/ there   -> all-gathered
            oases.verify_checkpoint(folder/oases): sizes, every file's crc32 read once between the ranks
            the first that passes is returned; the newer ones skipped, one warning on rank 0 naming each

        A ValueError on every rank when none verifies (Trainer's own when there is none)."""
        world = dist.is_initialized() and dist.get_world_size() > 1
        box = [_checkpoints(run_dir) if os.path.isdir(run_dir) else []]
        if world:
            dist.broadcast_object_list(box, src=0)
        skipped: list[str] = []
        for folder in reversed(box[0]):
            why: Optional[str] = None
            try:
                with open(os.path.join(folder, TRAINER_STATE_NAME)) as f:
                    json.load(f)
            except FileNotFoundError:
                why = f"{TRAINER_STATE_NAME}: missing (the save did not finish)"
            except (OSError, ValueError) as e:
                why = f"{TRAINER_STATE_NAME}: unreadable ({type(e).__name__}: {e})"
            if why is None and not os.path.isdir(os.path.join(folder, OASES_CHECKPOINT)):
                why = f"{OASES_CHECKPOINT}/: missing (not written by OasesTrainer, or the save did not finish)"
            whys = [why]
            if world:
                whys = [None] * dist.get_world_size()
                dist.all_gather_object(whys, why)
            why = next((w for w in whys if w is not None), None)
            if why is None:
                found = oases.verify_checkpoint(os.path.join(folder, OASES_CHECKPOINT))
                why = None if found is None else f"{OASES_CHECKPOINT}/{found}"
            if why is None:
                if skipped and self.args.process_index == 0:
                    warnings.warn(
                        f"OasesTrainer: resume_from_checkpoint=True skipped checkpoints that do not verify: "
                        f"{'; '.join(skipped)}; resuming from {folder}",
                        UserWarning,
                        stacklevel=3,
                    )
                return folder
            skipped.append(f"{folder} ({why})")
        if skipped:
            raise ValueError(
                f"resume_from_checkpoint=True: no checkpoint in {run_dir!r} verifies: {'; '.join(skipped)}"
            )
        raise ValueError(f"No valid checkpoint found in output directory ({run_dir})")

    # --- evaluation ----------------------------------------------------------------------------

    def evaluation_loop(self, *loop_args: Any, **loop_kwargs: Any):
        """Trainer's loop over the whole eval set on every rank; nothing gathered from the others
        (their results are the same), the last batch's padding cut as one process cuts it."""
        self.gather_function = functools.partial(
            self._gather_replica, use_gather_object=self.args.eval_use_gather_object
        )
        return super().evaluation_loop(*loop_args, **loop_kwargs)

    def _gather_replica(self, data, use_gather_object: bool = False):
        """accelerate's gather_for_metrics in a process of its own: the data, its last batch cut to
        the dataset's remainder."""
        state = self.accelerator.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return data
        if use_gather_object:
            return data[: state.remainder]
        return recursively_apply(lambda tensor: tensor[: state.remainder], data)

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """Trainer's optimizer; with zero, the same class, hyper-parameters and weight-decay groups
        inside oases.dp.ZeroOptimizer over the DP group (its .sync reduces the gradients)."""
        if not self.zero or self.optimizer is not None:
            return super().create_optimizer(model)
        model = self.model if model is None else model
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        kwargs = dict(kwargs)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or {"params", "model"} & set(kwargs):
            raise ValueError(
                f"OasesTrainer: zero=True needs a torch optimizer class built from its parameters; got {cls!r}"
            )
        decay = set(self.get_decay_parameter_names(model))
        names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        # ZeroOptimizer's masters come in model.parameters() order, one per trainable parameter
        decays = [names[id(p)] in decay for p in dict.fromkeys(p for p in model.parameters() if id(p) in names)]
        group = self.device_mesh["dp"].get_group() if self.device_mesh is not None else None
        self.optimizer = ZeroOptimizer(
            model, group, _weight_decay_groups(cls, decays, self.args.weight_decay), **kwargs
        )
        self.grad_sync = self.optimizer.sync
        return self.optimizer

    # --- checkpoints and export ----------------------------------------------------------------

    def _optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer under accelerate's wrapper."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """Trainer's checkpoint (every rank writes its shards: save_model), then the rotation of
        save_total_limit once every rank has finished writing: on each node (its local rank 0),
        by step number, so a node's own shards of old steps go too and no rank deletes a step
        another is still writing."""
        args = self.args
        limit = args.save_total_limit
        self._saving_checkpoint = True
        args.save_total_limit = None  # Trainer rotates on rank 0 alone, before the others finished
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False
            args.save_total_limit = limit
        if limit is None or limit <= 0:
            return
        if dist.is_initialized():
            dist.barrier()
        if args.local_process_index == 0:
            _rotate(self._get_output_dir(trial=trial), limit, self.state.best_model_checkpoint)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """In a checkpoint: the oases sharded checkpoint (every rank writes its shards). Otherwise
        the Hugging Face export, `oases.save_pretrained` (every rank takes part; rank 0 writes)."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if not self._saving_checkpoint:
            return super().save_model(output_dir, _internal_call=_internal_call)
        with_optimizer = not self.args.save_only_model and self.optimizer is not None
        scheduler = self.lr_scheduler.state_dict() if with_optimizer and self.lr_scheduler is not None else None
        extra = {
            "scheduler": scheduler,
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "optimizer": with_optimizer,
        }
        oases.save_checkpoint(
            self.model,
            os.path.join(output_dir, OASES_CHECKPOINT),
            optimizer=self._optimizer() if with_optimizer else None,
            extra=extra,
        )

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        """The Hugging Face export of the unsharded model (a PEFT model: its adapter, PEFT's format),
        written by rank 0 with every rank's shards."""
        if state_dict is not None:
            raise ValueError("OasesTrainer: _save(state_dict=...) is not supported; the model's own shards are saved")
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if _is_peft(self.model):
            oases.save_adapter(self.model, output_dir)  # PEFT's format, unsharded
        else:
            oases.save_pretrained(self.model, output_dir)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing: the optimizer and the scheduler are in the checkpoint's oases/ (save_model)."""

    def _checkpoint_dir(self, checkpoint: str) -> str:
        where = os.path.join(checkpoint, OASES_CHECKPOINT)
        if not os.path.isdir(where):
            raise ValueError(
                f"OasesTrainer: resume_from_checkpoint={checkpoint!r} holds no {OASES_CHECKPOINT}/ (not written "
                f"by OasesTrainer); start from its weights with oases.load_pretrained instead"
            )
        return where

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[nn.Module] = None) -> None:
        """Checks the checkpoint is OasesTrainer's; the model, optimizer and scheduler are read
        together once the optimizer exists (_load_optimizer_and_scheduler)."""
        self._checkpoint_dir(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """oases.load_checkpoint: the model's shards and the optimizer's state (a collective), then
        the LR scheduler from its extra state."""
        if checkpoint is None:
            return
        where = self._checkpoint_dir(checkpoint)
        with open(os.path.join(where, MARKER)) as f:
            with_optimizer = bool(json.load(f).get("optimizer"))  # save_only_model: the weights alone
        state = oases.load_checkpoint(self.model, where, optimizer=self._optimizer() if with_optimizer else None)
        scheduler = (state.extra or {}).get("scheduler")
        if scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(scheduler)
