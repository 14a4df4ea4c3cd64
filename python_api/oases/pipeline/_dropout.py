"""A Pipeline step's dropout: whether the model drops, the refusal of a model adapted without its
dropout, and each train_step's seed.

Dropout (a model in training mode with dropout > 0): each micro-batch's SubBatch carries the step's
seed and its rows of the global batch, and every branch draws its masks from streams seeded by
them and by its layer (oases.models.dropout_streams: the TP group's stream on replicated activations,
each rank's own on its heads and features; oases.models.GPT: one residual mask over the global
batch, sliced), so the recomputation of each checkpointed (or offloaded) layer in B(k, i) redraws
the masks of F(k, i). The seed (`StepDropout.seed`) is the same on every stage and TP rank of a
DP replica. eval_step runs in eval mode, without dropout.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.models.dropout_streams import draw_step_seed, dropout_in
from oases.models.gpt import GPTConfig
from oases.models.hf import HFStack
from oases.models.nanogpt import NanoGPTStack

__all__ = ["StepDropout"]


class StepDropout:
    """A pipeline model's dropout (see the module doc).

    Args:
        config: the Pipeline's config (a GPTConfig, or the factory that built `model`).
        model: the built model; stack: its oases.train_step adapter.
        device: where the seed is broadcast; groups: this DP replica's pp and tp groups.
    """

    def __init__(
        self,
        config: GPTConfig | Callable[[], nn.Module],
        model: nn.Module,
        stack: object,
        device: torch.device,
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup],
    ) -> None:
        self.model, self.stack, self.device, self.groups = model, stack, device, groups
        # the model drops in training (a GPTConfig's dropout, a dropout module or rate above 0): each
        # train_step in training mode then draws a seed for its masks (seed)
        self.present = config.dropout > 0 if isinstance(config, GPTConfig) else bool(dropout_in(model))

    def check(self) -> None:
        """A Hugging Face or nanoGPT model built in eval mode (from_pretrained) was adapted without its
        dropout (oases.models.HFStack: each branch's masks and biases placed for a training step);
        refuse to train it with its dropout back on."""
        stack = self.stack
        if self.present and self.model.training and isinstance(stack, (HFStack, NanoGPTStack)) and not stack.dropout:
            name, p = dropout_in(self.model)[0]
            raise ValueError(
                f"train_step: the model has dropout {p} ({name}) and is in training mode, but it was in eval "
                "mode when the pipeline was built (from_pretrained returns it so), so its layers were set up "
                "without dropout; call model.train() in the factory, or keep the model in eval mode "
                "(no dropout) or set its dropout to 0"
            )

    def seed(self) -> Optional[int]:
        """The step's dropout seed, or None (the model has no dropout, or is in eval mode).

        ::

            seed = randint(2**31 - 1)        # the default generator, on every rank (each advances alike)
            broadcast over pp, then over tp  # every rank of this DP replica: its (stage 0, TP rank 0)'s

        Every stage uses it (the masks are keyed by layer, sublayer, branch and the micro-batch's
        rows of the global batch: oases.models.dropout_streams.DropoutStreams); each TP group shares it,
        so replicated activations see one mask and each rank's heads their own stream. DP replicas
        are not broadcast to: a collective over dp could meet the previous step's DP syncs in flight
        on that group, and none is needed, since each replica's micro-batches are different rows of
        the global batch, keyed apart. Replicas whose default generators agree (torch.manual_seed(s)
        on every rank) draw the same seed anyway; the masks then depend on the micro-batches' rows
        alone, not on dp."""
        if not (self.present and self.model.training):
            return None
        return draw_step_seed(self.device, self.groups)
