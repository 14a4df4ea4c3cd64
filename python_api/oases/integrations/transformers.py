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
import math
from typing import Any, Optional, Union

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

from accelerate.utils import recursively_apply  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

import oases  # noqa: E402
from oases.dp import GradientSync, ZeroOptimizer  # noqa: E402
from oases.integrations._trainer_checkpoints import TrainerCheckpoints  # noqa: E402
from oases.integrations._trainer_checks import (  # noqa: E402
    is_peft,
    option_problems,
    refusals,
    resolve_tp_size,
    tp_groups,
)
from oases.integrations._trainer_data import IGNORE_INDEX, StepInputs, TrainerData  # noqa: E402
from oases.schedule import SCHEDULES  # noqa: E402

__all__ = ["OasesTrainer"]


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


class OasesTrainer(TrainerData, TrainerCheckpoints):
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
        groups = tp_groups(model) if isinstance(model, nn.Module) else []
        _checks.one_of("schedule", schedule, SCHEDULES)
        problems = refusals(args, bound, prepared_model=bool(groups)) + option_problems(args, bound, sub_batches, zero)
        if len(groups) > 1:
            problems.append("OasesTrainer: model: its TP modules use several process groups; parallelize it once")
        if problems:
            raise ValueError("\n".join(problems))
        # parallelism_config's layout is OasesTrainer's to apply, not accelerate's
        config, args.parallelism_config = args.parallelism_config, None
        _ = args.device  # under torchrun: accelerate initializes the process group here
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        tp_size = resolve_tp_size(config, tp_size, groups, world, rank)
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
            if is_peft(model):  # PEFT's LoRA layers set aside, their base linears sharded (oases.nn.lora)
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

    def _train_step(self, step: StepInputs, parts: int, divisor: float, grad_sync) -> torch.Tensor:
        return oases.train_step(
            self.model.get_base_model() if is_peft(self.model) else self.model,
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
