"""oases.train_step: one training step of any supported model on an overlapped TP schedule.

    model = oases.parallelize(LlamaForCausalLM(config), tp_group)
    loss = oases.train_step(model, input_ids, labels, schedule="oases")   # grads in .grad
    optimizer.step(); optimizer.zero_grad()

The model is seen through `oases.schedule.Stack` (`adapt` below finds the adapter); the loss is
the causal-LM loss with Hugging Face's meaning, or the caller's `loss_fn`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases import _checks
from oases._step_context import StepContext, adapt, step_context
from oases.dp.grad_sync import AllReduceMean, GradientSync
from oases.inputs import CheckMode, agree_tp_inputs
from oases.nn.grad_check import check_gradients
from oases.nn.vocab import IGNORE_INDEX, vocab_parallel_cross_entropy
from oases.offload import Offloader
from oases.schedule import Communicator, Recompute, RecomputeMemory, StepBatch, StepOptions, run_step
from oases.schedule.protocol import LayerPlacements
from oases.schedule.sequence_parallel import sequence_parallel_parameters
from oases.schedule.step import check_placed, partial_parameters
from oases.schedule.table import layer_modes

__all__ = ["train_step", "adapt", "causal_lm_loss_sum", "IGNORE_INDEX"]


def causal_lm_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss, summed: token i predicts labels[i + 1]; IGNORE_INDEX skipped.

        shifted = cat(labels[:, 1:], IGNORE_INDEX)     # [b, t]
        sum over tokens with shifted != IGNORE_INDEX of cross_entropy(logits.float(), shifted)
    With `group`, logits [b, t, vocab/p] are this rank's vocabulary slice over that group, and
    the same sum comes from oases.nn.vocab_parallel_cross_entropy (the logits never gathered).
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    if group is not None:
        return vocab_parallel_cross_entropy(
            logits.flatten(0, 1),
            shifted.flatten(),
            group,
            ignore_index=IGNORE_INDEX,
            reduction="sum",
            vocab_size=vocab_size,
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def train_step(
    model: object,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    schedule: str = "oases",
    sub_batches: Optional[int] = None,
    sequence_parallel: bool = False,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
    num_items: Optional[Union[int, float, torch.Tensor]] = None,
    comm: Optional[Communicator] = None,
    memory: Optional[RecomputeMemory] = None,
    offload: Union[bool, Offloader] = False,
    recompute: Recompute = "auto",
    memory_budget: Optional[float] = None,
    grad_sync: Optional[GradientSync] = None,
    check_inputs: CheckMode = True,
    check_grads: Union[bool, int] = True,
) -> torch.Tensor:
    """Forward and backward of `model`'s causal-LM loss on a TP schedule; returns the loss.

    ::

        loss = sum over the batch of causal_lm_loss_sum(model(input_ids).logits, labels)
               / number of labels[:, 1:] != -100                  # Hugging Face's mean
               (/ num_items instead, where given)
        parameter .grad += d loss / d parameter                   # accumulated, as loss.backward()

    `schedule`: "megatron", "merak", "cross_pass" or "oases" (oases.schedule.SCHEDULES);
    `sub_batches`: how many interleaved parts the batch is split into (1..8; None: the
    schedule's own, 1 for megatron and 2 for the others). `sequence_parallel`: between sublayers
    each rank keeps its slice of the sequence [b, t/p, h] (t must divide by p); each sublayer
    all-gathers its normed input and reduce-scatters its output (ring steps interleaved with the
    other sub-batches), norms' and row biases' gradients summed over the group; the same numbers,
    1/p of the saved activations. `attention_mask` [b, t]: 1 for tokens,
    0 for padding, as Hugging Face takes it. `position_ids` [b, t]: each token's position, for
    packed rows (several documents in one row, positions restarting at each: Hugging Face's
    padding-free collators, TRL's packing), handed to the model's own forward, which keeps the
    documents apart in attention (a Hugging Face model; others refuse it); the loss's labels at
    each document's first token should be -100, as those collators make them.
    `loss_fn(logits, labels)` replaces the loss: it
    returns the summed loss of the rows it is given, and the step's loss is the sum over the
    batch divided by the number of labels != -100 (with a vocab-parallel head it receives
    this rank's slice of the logits: see oases.schedule.protocol). `num_items`: the divisor of the
    summed loss in place of this batch's count of labels (a positive number or a scalar tensor):
    the tokens of a whole gradient-accumulation window, over every data-parallel rank, as
    transformers' Trainer passes `num_items_in_batch`, so that micro-batches' gradients add up to
    the window's mean (with a GradientSync, which averages over dp, pass that count / dp).
    `comm`: an oases.schedule.Communicator on the
    model's TP group, to count calls, bytes and time waited across steps (default: a new one);
    `memory`: an oases.schedule.RecomputeMemory that accounts the activations kept for
    recomputation (its `peak`, in bytes, over every sub-batch). `offload`: move those inputs to
    host memory in batches during the forward and bring them back, in the backward's order of
    use, just before recomputation (oases.offload; bit-exact). True uses the model's own
    Offloader (`model.offloader`, as GPT(..., offload=True) has), else a new one for this call;
    pass an oases.offload.Offloader to keep one across steps: its first step sizes its HostSlab.
    `recompute=False`: no recomputation; each sublayer's forward graph is kept and the backward
    runs on it, still on the schedule's sub-batches and overlap (a forward's compute less per
    step, autograd's activations held as in a model trained without activation checkpointing;
    not with sequence_parallel or offload). `recompute="selective"`: the same kept graphs saving only
    the matrix products' and attention's outputs, the element-wise rest recomputed in the backward
    (Megatron's and torchtitan's selective recomputation; oases.schedule.selective). A list of
    those values, one per layer (`[False, False, "selective", True]`), sets each layer's mode: the
    kept layers as above, the others recomputed as the schedule recomputes; the same gradients.
    `recompute="auto"` (the default): each layer's mode chosen so that the step's predicted peak fits
    `memory_budget` (bytes, the whole rank: parameters, gradients, AdamW's states, activations;
    None: the device's free memory less 10%, shared by the ranks on it), fastest first (keep, then
    selective, then full recomputation), measured once per input shape on one row of the batch and
    logged once (logger "oases"; oases.schedule.budget). An explicit budget too small even for
    full recomputation raises a ValueError naming the smallest that fits; the default falls back
    to full recomputation with a warning. With sequence_parallel, offload or per-layer TP degrees
    every layer recomputes.
    `grad_sync`: an oases.dp.GradientSync (or oases.dp.ZeroOptimizer(...).sync) averaging the
    gradients over data-parallel replicas: its buckets start during the step's backwards and the
    step returns after the reduction finished (.grad averaged; with ZeRO, the masters' grads).
    `check_inputs` (oases.inputs): True checks, before any other collective, that the model's TP
    group got the same input_ids, labels, attention_mask and position_ids (ValueError on every rank otherwise);
    "broadcast" uses TP rank 0's (Megatron's broadcast_data; the others may pass None); False skips it.
    `check_grads` (oases.check_gradients): after the backwards (and the DP sync), the gradients that
    the TP group's ranks hold alike (and, with a GradientSync, every gradient over its dp group)
    are compared across the ranks; a mismatch (a partial gradient: a parameter that sees only this
    rank's shard of the features) raises a RuntimeError on every rank naming it. True: on the
    model's first train_step; an int N: on the first and every N-th; False: never.
    The model: oases.models.GPT, a Hugging Face causal LM (Llama, Mistral, Qwen2/3, Gemma, Phi-3,
    GPT-2, GPT-NeoX, OLMo-2, ...: its parts found by structure, oases.models.hf) or a nanoGPT-style model
    after oases.parallelize, or any oases.schedule.Stack. Every schedule gives the loss and
    gradients of the unsharded model; every check runs before any communication.
    Per-layer TP degrees (GPT(config, group, tp_degrees=[...]), a Hugging Face model after
    parallelize(..., tp_degrees=[...]), a stack with layer_placements()): each layer communicates
    on its own degree's Communicator (the model's), so `comm`, `offload` and `sequence_parallel`
    are refused, and each sub-batch needs at least p / min(tp_degrees) rows; nanoGPT-style
    models with tp_degrees are refused.

    Args:
        model: oases.models.GPT, a parallelized Hugging Face causal LM or nanoGPT-style model, or a Stack.
        input_ids: the token ids [b, t].
        labels: [b, t], not shifted (token i predicts labels[i + 1]); -100 is ignored.
        schedule: the TP schedule (default "oases").
        sub_batches: how many parts the batch is split into (None: the schedule's own).
        sequence_parallel: keep the sequence sharded between sublayers.
        attention_mask: [b, t] padding mask (None: no padding).
        position_ids: [b, t] token positions (None: 0..t-1 on every row); packed rows.
        loss_fn: `loss_fn(logits, labels)`, the summed loss of its rows (None: the causal-LM loss).
        num_items: what the summed loss is divided by (None: this batch's count of labels != -100).
        comm: a Communicator on the model's TP group (None: a new one).
        memory: a RecomputeMemory accounting the activations kept for recomputation (None: not accounted).
        offload: True, False or an Offloader, as above (default False: no offload).
        recompute: recompute each sublayer's forward in the backward (True), keep its graph (False),
            or keep it saving only GEMM and attention outputs ("selective"); or a list, one per layer;
            or "auto" (default): chosen per layer for memory_budget.
        memory_budget: with recompute="auto", the rank's peak in bytes (None: the device's rule).
        grad_sync: a GradientSync averaging the gradients over data-parallel replicas (None: no DP).
        check_inputs: True, "broadcast" or False, as above.
        check_grads: True (the first step), an int N (the first and every N-th) or False, as above.

    Returns:
        The step's loss (a scalar tensor), the gradients accumulated into .grad.

    Raises:
        ValueError: a bad argument or an unsupported combination, naming it (inputs that differ
            over the TP group: on every rank, with check_inputs=True).
        RuntimeError: with check_grads, gradients that differ over the ranks holding them alike.
        TypeError: `grad_sync` not a GradientSync, `offload` neither a bool nor an Offloader.
    """
    if grad_sync is not None and not isinstance(grad_sync, GradientSync):
        raise TypeError(
            f"grad_sync: expected an oases.dp.GradientSync (or a ZeroOptimizer's .sync), got {type(grad_sync).__name__}"
        )
    if not isinstance(check_grads, bool) and not (_checks.is_int(check_grads) and check_grads >= 1):
        raise ValueError(f"check_grads: expected True, False or a positive int N (every N-th), got {check_grads!r}")
    divisor = _num_items(num_items)
    ctx = step_context(model, comm, sequence_parallel, offload)
    layer_modes(recompute, len(list(ctx.stack.layers())))  # a per-layer list: one value per layer
    if position_ids is not None and not ctx.takes_position_ids:
        raise ValueError(f"position_ids: {ctx.name} takes no token positions; pass None (positions 0..t-1)")
    input_ids, labels, attention_mask, position_ids = agree_tp_inputs(
        ctx.model,
        ctx.tp_group,
        ctx.tp_size,
        check_inputs,
        input_ids=input_ids,
        labels=labels,
        attention_mask=attention_mask,
        position_ids=position_ids,
    )
    if attention_mask is not None and not ctx.takes_attention_mask:
        raise ValueError(
            f"attention_mask: {ctx.name} has no padding mask to apply it to; pass None "
            "(or pad with tokens whose labels are -100)"
        )
    options = StepOptions(schedule, sub_batches, sequence_parallel, recompute, memory_budget, ctx.offloader, memory)
    batch = options.check(
        input_ids, labels, world_size=ctx.comm.world_size, attention_mask=attention_mask, position_ids=position_ids
    )  # before step_seed's broadcast and the placements' groups
    placements = ctx.resolved_placements()
    check_placed(ctx.stack, batch, options, placements)  # before the seed's broadcast
    loss_sum, normalizer = _loss(ctx, labels, loss_fn)
    loss = _run(
        ctx,
        batch,
        options,
        grad_sync,
        loss_sum=loss_sum,
        normalizer=normalizer if divisor is None else divisor,
        placements=placements,
    )
    if ctx.offloader is not None and offload is True and ctx.offloader is not ctx.own_offloader:
        ctx.offloader.close()  # made for this call
    if ctx.owned_comm:
        ctx.comm.close()  # its thread, if it started one (not after a failure: a ring may never finish)
    if _gradients_due(ctx.model, check_grads):
        _check_gradients(ctx.model, grad_sync)
    return loss


def _run(
    ctx: StepContext,
    batch: StepBatch,
    options: StepOptions,
    grad_sync: Optional[GradientSync],
    *,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    normalizer: float,
    placements: Optional[LayerPlacements],
) -> torch.Tensor:
    """The step's schedule (oases.schedule.run_step) with its dropout seed, and, with `grad_sync`,
    the dp reduction started during its backwards and finished after them (the gradients the
    schedule sums over TP held back until that sum)."""
    seed = ctx.step_seed() if ctx.step_seed is not None else None
    held = sequence_parallel_parameters(ctx.stack) if options.sequence_parallel else []
    held += partial_parameters(ctx.stack)  # LoRA's replicated factors: summed over TP after the backwards
    if grad_sync is not None and held:  # their TP sum comes after the backwards
        grad_sync.hold(held)
    with grad_sync.deferred() if grad_sync is not None else contextlib.nullcontext():
        loss = run_step(
            ctx.stack,
            batch,
            options,
            loss_sum=loss_sum,
            normalizer=normalizer,
            comm=ctx.comm,
            dropout_seed=seed,
            placements=placements,
            choices=_recompute_choices(ctx.model),
        )
    if grad_sync is not None:
        grad_sync.finish()  # the dp reduction of this step's gradients (started during its backwards)
    return loss


def _recompute_choices(model: object) -> Optional[dict]:
    """The model's cache of recompute="auto" choices by input shape (oases.schedule.budget), kept
    on the model itself (None for an object that takes no attribute)."""
    choices = getattr(model, "_oases_recompute_choices", None)
    if choices is None:
        try:
            object.__setattr__(model, "_oases_recompute_choices", {})
        except (AttributeError, TypeError):
            return None
        choices = model._oases_recompute_choices  # type: ignore[attr-defined]
    return choices


def _gradients_due(model: object, check_grads: Union[bool, int]) -> bool:
    """Whether this step checks the gradient invariant: the model's steps are counted on it
    (`model.oases_steps`); True: its first, N: its first and every N-th."""
    if check_grads is False or not isinstance(model, nn.Module):
        return False
    step = getattr(model, "oases_steps", 0)
    model.oases_steps = step + 1
    return step == 0 if check_grads is True else step % check_grads == 0


def _check_gradients(model: nn.Module, grad_sync: Optional[GradientSync]) -> None:
    """oases.check_gradients over the model's TP group and, with a plain GradientSync (not ZeRO's:
    its gradients live in the masters), over its dp group."""
    plain = grad_sync is not None and isinstance(grad_sync.reducer, AllReduceMean)  # ZeRO's: rows of masters
    dp_group = grad_sync.group if plain else None
    check_gradients(model, dp_group=dp_group)


def _loss(
    ctx: StepContext, labels: torch.Tensor, loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int]:
    """(loss_sum, normalizer) of a step: the causal-LM loss summed (over the stack's vocabulary-parallel
    logits group, if any) and the labels[:, 1:] != -100 count, or `loss_fn` and the labels != -100 count."""
    if loss_fn is not None:
        return loss_fn, int((labels != IGNORE_INDEX).sum())
    group, vocab_size = ctx.logits_group, ctx.vocab_size
    normalizer = int((labels[:, 1:] != IGNORE_INDEX).sum())

    def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss_sum(logits, labels, group, vocab_size)

    return loss_sum, normalizer


def _num_items(num_items: Optional[Union[int, float, torch.Tensor]]) -> Optional[float]:
    """`num_items` as the step's divisor (None: the batch's own count); ValueError unless a
    positive finite number (or a one-element tensor holding one)."""
    if num_items is None:
        return None
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
            raise ValueError(
                f"num_items: expected a number or a one-element tensor, got shape {tuple(num_items.shape)}"
            )
        value = float(num_items.item())
    elif isinstance(num_items, numbers.Real) and not isinstance(num_items, bool):
        value = float(num_items)
    else:
        raise ValueError(f"num_items: expected a positive number, got {type(num_items).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"num_items: expected a positive finite number (the tokens the loss is averaged over), got {value!r}"
        )
    return value
