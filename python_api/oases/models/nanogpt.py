"""nanoGPT-style models seen as an `oases.schedule.Stack`, run by the TP schedules.

The layout of Karpathy's nanoGPT (`model.py`), with or without its `transformer` ModuleDict:

    container = model.transformer (or model itself): wte, wpe (optional), drop (optional), h, ln_f
    model.lm_head
    each block of h:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))       # attn(x) is causal

After `oases.parallelize(model)` (c_attn "column:3", c_fc "column", c_proj "row"), each block is
two sublayers whose cores are the block's own attn and mlp under no_tp_communication; `attn`
must view its heads with -1 (see oases.parallelize). The embedding is wte(ids) + wpe(arange(t)).

Dropout (nanoGPT's attn_dropout / resid_dropout / MLP dropout / drop, in training on
oases.train_step): masks from the step's seed (`step_seed()`), as for Hugging Face models
(oases.models.dropout_streams: the GROUP stream on replicated activations and partial sums after c_proj,
this rank's RANK stream on its attention probabilities).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.models._branch import Branch, check_random, check_sharded
from oases.models.dropout_streams import draw_step_seed, dropout_in, seeded_embedding
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.vocab import VocabParallelEmbedding, runs_as_partial
from oases.schedule.protocol import EmbedSplit, SubBatch

__all__ = ["NanoGPTStack", "is_nanogpt"]

_BLOCK_PARTS = ("ln_1", "attn", "ln_2", "mlp")


def _container(model: nn.Module) -> Optional[nn.Module]:
    container = getattr(model, "transformer", model)
    if not isinstance(container, nn.Module):
        return None
    parts = [getattr(container, n, None) for n in ("wte", "h", "ln_f")]
    if not (
        isinstance(parts[0], nn.Module)
        and isinstance(parts[1], nn.ModuleList)
        and len(parts[1])
        and isinstance(parts[2], nn.Module)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    ):
        return None
    if not all(all(isinstance(getattr(b, n, None), nn.Module) for n in _BLOCK_PARTS) for b in parts[1]):
        return None
    return container


def is_nanogpt(model: object) -> bool:
    """Whether `model` has nanoGPT's layout (see the module docstring)."""
    return isinstance(model, nn.Module) and _container(model) is not None


class NanoGPTStack:
    """A nanoGPT-style model (after oases.parallelize, or unsharded) as an oases.schedule.Stack."""

    takes_attention_mask = False  # nanoGPT's attention is causal only

    def __init__(self, model: nn.Module) -> None:
        container = _container(model)
        if container is None:
            raise ValueError(
                f"{type(model).__name__}: not a nanoGPT-style model (wte, h of blocks with "
                f"{', '.join(_BLOCK_PARTS)}, ln_f, lm_head)"
            )
        self.model, self.container = model, container
        self.lm_head = model.lm_head
        self.logits_group = None
        self.dropout = model.training and bool(dropout_in(model))  # the step draws seeded masks
        self._layers = [
            (
                Branch(i, (b.ln_1,), (b.attn,), None, position=0, dropout=self.dropout),
                Branch(i, (b.ln_2,), (b.mlp,), None, position=1, dropout=self.dropout),
            )
            for i, b in enumerate(container.h)
        ]
        check_sharded(self._layers, container.h)

    def check_trainable(self, seeded: bool = False) -> None:
        """Refuse, in training mode, what the blocks' recomputation would draw anew (check_random):
        dropout unless the caller seeds it (`seeded`: oases.train_step)."""
        check_random(self.model, self.container.h, seeded=seeded)

    def step_seed(self) -> Optional[int]:
        """The step's dropout seed (None without dropout), the same on every TP rank (draw_step_seed)."""
        if not self.dropout:
            return None
        tp = [m for m in self.container.h.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        groups = (tp[0].group,) if tp and dist.is_initialized() else ()
        return draw_step_seed(self.lm_head.weight.device, groups)

    def embed(self, input_ids: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, SubBatch]:
        """input_ids [b, t] -> (wte(input_ids) [+ wpe(positions)], through `drop` where there is one,
        x [b, t, h]; `where` as the ctx)."""
        return self._from_tokens(self.container.wte(input_ids), input_ids, where)

    def embed_split(self, input_ids: torch.Tensor, where: SubBatch) -> Optional[EmbedSplit]:
        """`embed` around a vocabulary-parallel wte's all-reduce (oases.schedule.protocol), else None."""
        wte = self.container.wte
        if not isinstance(wte, VocabParallelEmbedding) or not runs_as_partial(wte):
            return None
        return EmbedSplit(wte.partial(input_ids), wte.group, lambda summed: self._from_tokens(summed, input_ids, where))

    def _from_tokens(self, x: torch.Tensor, input_ids: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, SubBatch]:
        """The token embeddings x [b, t, h] -> embed's (x [+ wpe(positions)], through `drop`; `where`)."""
        wpe = getattr(self.container, "wpe", None)
        if wpe is not None:
            x = x + wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        drop = getattr(self.container, "drop", None)
        if drop is None:
            return x, where
        with seeded_embedding(where if self.dropout else None, x.device):  # the same mask on every rank
            return drop(x), where

    def layers(self) -> list[tuple[Branch, ...]]:
        """Each block as two branches: (ln_1, attn) and (ln_2, mlp)."""
        return self._layers

    def head(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """x [b, t, h] -> logits: lm_head(ln_f(x))."""
        return self.lm_head(self.container.ln_f(x))
