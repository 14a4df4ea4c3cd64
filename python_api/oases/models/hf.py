"""Hugging Face decoder stacks seen as an `oases.schedule.Stack`, run by the TP schedules.

    stack = HFStack(model)           # LlamaForCausalLM, MistralForCausalLM, Qwen2/Qwen3ForCausalLM,
                                     # GPTNeoXForCausalLM, after oases.parallelize (or unsharded)
Sublayers, per decoder layer (its own modules, called as its forward calls them):

    Llama / Mistral / Qwen2 / Qwen3   x + self_attn(input_layernorm(x))         attention
                                      x + mlp(post_attention_layernorm(x))      MLP
    GPT-NeoX, use_parallel_residual   x + attention(ln1 x) + mlp(ln2 x)         one sublayer: norm
                                      stacks [ln1 x, ln2 x], core sums both branches' partials, so
                                      one all-reduce serves both (half of the all-reduces)
    GPT-NeoX, sequential              as Llama, with GPT-NeoX's names

`core` runs the branch under `oases.nn.no_tp_communication`: column layers skip their input's
gradient all-reduce, row layers return their partial product; the schedule reduces both and
`finish` adds the row layers' biases. What each layer receives besides its hidden states
(rotary position embeddings, the causal and padding mask of its attention type, position ids)
is taken from the model's own forward: `embed` runs the base model once with its decoder layers
stood in for by recorders, so masks and rotary embeddings are exactly the model's.

After `oases.parallelize(model, tp_degrees=[...])`, `layer_placements()` gives the schedules each
decoder layer's degree (oases.schedule.protocol): its all-reduces on a Communicator of its own
degree's TP group, its replica's rows (`replica_ctx` cuts every [b, ...] keyword argument of the
layers -- masks, rotary tables, position ids -- to them), rows moved between degrees, on the
groups parallelize made; their Communicators are made at the first step and kept on the model
(`model.oases_layer_placements`). While a schedule runs, parallelize's replica-sum hooks stand
down and the schedule sums each layer's gradients over its replicas itself (asynchronously, as
the layer's backward ends for every sub-batch).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases.models._branch import Branch, check_no_dropout, check_sharded
from oases.models._placed import layer_placements
from oases.nn._degrees import kwargs_rows
from oases.nn._mappings import copy_to_tp
from oases.nn.layers import ColumnParallelLinear
from oases.schedule.protocol import LayerPlacements, SubBatch

__all__ = ["HFStack", "SEQUENTIAL_LAYERS", "PARALLEL_RESIDUAL_LAYERS"]

# Decoder layer classes whose forward is x + attn(norm1 x), then x + mlp(norm2 x), with these names.
SEQUENTIAL_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})
# GPT-NeoX: parallel residual x + attention(ln1 x) + mlp(ln2 x) (or sequential when the config says so).
PARALLEL_RESIDUAL_LAYERS = frozenset({"GPTNeoXLayer"})
_FINAL_NORMS = ("norm", "final_layer_norm")


@dataclass(frozen=True)
class _Context:
    """Per sub-batch: where it sits, and each decoder layer's keyword arguments from the model."""

    where: SubBatch
    layer_kwargs: tuple[dict, ...]


class _Recorder(nn.Module):
    """Stands in for decoder layer i in the base model's forward: records its arguments, passes x."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args:
            raise TypeError("oases: a decoder layer got positional arguments besides its hidden states; "
                            "this model's forward is not one the Hugging Face adapter knows")
        self.calls.append((hidden_states, kwargs))
        return hidden_states


class HFStack:
    """A Hugging Face causal LM (after oases.parallelize, or unsharded) as an oases.schedule.Stack.

        x, ctx = stack.embed(input_ids[rows], where)   # the model's embeddings, masks, rotary
        stack.layers()                                  # [(attention, mlp), ...] or [(parallel,), ...]
        logits = stack.head(x, ctx)                     # final norm, then the LM head

    An LM head that parallelize made vocab-parallel ("vocab_head") gives this rank's slice of the
    logits here (never gathered; `logits_group` is its group), whatever its gather_output.

    Raises ValueError (before any communication) for a model it cannot run exactly: an unknown
    decoder layer class, dropout active in training, or TP shards missing from a decoder layer
    whose neighbours are sharded (each branch must end in a RowParallelLinear).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.base = getattr(model, "base_model", None)
        decoder = getattr(self.base, "layers", None)
        if self.base is None or not isinstance(decoder, nn.ModuleList) or len(decoder) == 0:
            raise ValueError(_unknown(model, "no decoder layers at model.base_model.layers"))
        self.decoder = decoder
        kinds = {type(layer).__name__ for layer in decoder}
        if not kinds <= SEQUENTIAL_LAYERS | PARALLEL_RESIDUAL_LAYERS:
            raise ValueError(_unknown(model, f"decoder layers of class {', '.join(sorted(kinds))}"))
        self.final_norm = next((getattr(self.base, n) for n in _FINAL_NORMS if hasattr(self.base, n)), None)
        self.lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if self.final_norm is None or self.lm_head is None:
            raise ValueError(_unknown(model, "no final norm (base_model.norm / final_layer_norm) or no output embeddings"))
        vocab_parallel = isinstance(self.lm_head, ColumnParallelLinear)  # parallelize's "vocab_head"
        self.logits_group = (self.lm_head.group or dist.group.WORLD) if vocab_parallel else None
        self.vocab_size = self.lm_head.out_features if vocab_parallel else None  # V, padded shards or not
        self._layers = [self._sublayers(i, layer) for i, layer in enumerate(decoder)]
        degrees = getattr(model, "tp_degrees", None)  # parallelize(..., tp_degrees=...): degree-1 layers unsharded
        self.degrees: Optional[tuple[int, ...]] = None if degrees is None else tuple(degrees)
        if self.degrees is not None and len(self.degrees) != len(decoder):
            raise ValueError(f"tp_degrees: {len(self.degrees)} degrees for {len(decoder)} decoder layers; "
                             f"parallelize the model with one degree per decoder layer")
        check_sharded([layer for i, layer in enumerate(self._layers) if self.degrees is None or self.degrees[i] > 1],
                      decoder)

    @staticmethod
    def _sublayers(i: int, layer: nn.Module) -> tuple[Branch, ...]:
        if type(layer).__name__ in PARALLEL_RESIDUAL_LAYERS:
            attn, mlp = layer.attention, layer.mlp
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            if layer.use_parallel_residual:
                return (Branch(i, (ln1, ln2), (attn, mlp), attn),)
            return (Branch(i, (ln1,), (attn,), attn), Branch(i, (ln2,), (mlp,), None))
        attn, mlp = layer.self_attn, layer.mlp
        return (Branch(i, (layer.input_layernorm,), (attn,), attn),
                Branch(i, (layer.post_attention_layernorm,), (mlp,), None))

    def check_trainable(self) -> None:
        """Dropout inside the recomputed sublayers would draw different masks when recomputed."""
        check_no_dropout(self.model, self.decoder)

    def embed(self, input_ids: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, _Context]:
        calls: list = []
        with _standing_in(self.base, _Recorder(calls), len(self.decoder)):
            self.base(input_ids=input_ids, attention_mask=where.attention_mask, use_cache=False)
        if len(calls) != len(self.decoder):
            raise RuntimeError(f"oases: the base model called {len(calls)} of its {len(self.decoder)} decoder layers")
        x = calls[0][0]
        return x, _Context(where, tuple(kwargs for _, kwargs in calls))

    def layers(self) -> list[tuple[Branch, ...]]:
        return self._layers

    def layer_placements(self) -> Optional[LayerPlacements]:
        """Per-layer TP degrees (parallelize(..., tp_degrees=...)): the decoder layers' placements
        over the groups parallelize made, their Communicators made at the first call and kept on
        the model; None without tp_degrees. While a schedule runs, parallelize's replica-sum hooks
        stand down and the schedule sums each layer's gradients over its replicas itself."""
        if self.degrees is None:
            return None
        kept = getattr(self.model, "oases_layer_placements", None)
        if not isinstance(kept, LayerPlacements) or tuple(at.degree for at in kept.layers) != self.degrees:
            groups = getattr(self.model, "_oases_degree_groups", None)
            if groups is None:
                raise ValueError("tp_degrees: the model has per-layer degrees but not the groups oases.parallelize "
                                 "keeps with them; parallelize it with oases.parallelize(model, tp_degrees=...)")
            kept = layer_placements(groups, self.degrees, self.decoder,
                                    dist.get_world_size() if dist.is_initialized() else 1)
            self.model.oases_layer_placements = kept
        return kept

    def replica_ctx(self, ctx: _Context, rows: slice) -> _Context:
        """ctx narrowed to a replica's `rows` of the sub-batch: its SubBatch, and every tensor of
        the layers' keyword arguments whose first dim is the sub-batch's row count (as
        parallelize's hooks cut them: oases.nn._degrees.kwargs_rows)."""
        batch = ctx.where.rows.stop - ctx.where.rows.start
        kwargs = tuple(kwargs_rows(layer, batch, rows) for layer in ctx.layer_kwargs)
        return _Context(ctx.where.replica_rows(rows), kwargs)

    def head(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        h = self.final_norm(x)
        if self.logits_group is None:
            return self.lm_head(h)  # [b, t, vocab]
        # [b, t, vocab/p]; the input's gradient is all-reduced (copy_to_tp) as the layer would
        logits = F.linear(copy_to_tp(h, self.logits_group), self.lm_head.weight, self.lm_head.bias)
        return self.lm_head.mask_padding(logits)  # a padded vocabulary's columns: -inf


@contextlib.contextmanager
def _standing_in(base: nn.Module, recorder: nn.Module, n: int) -> Iterator[None]:
    """base.layers replaced by `n` references to `recorder` for the block (restored after)."""
    layers = base.layers
    base.layers = nn.ModuleList([recorder] * n)
    try:
        yield
    finally:
        base.layers = layers


def _unknown(model: nn.Module, what: str) -> str:
    return (f"oases: no adapter for {type(model).__name__} ({what}). Known: Hugging Face decoder layers "
            f"{', '.join(sorted(SEQUENTIAL_LAYERS | PARALLEL_RESIDUAL_LAYERS))}, and oases.models.GPT. For another "
            "model, implement oases.schedule.Stack: embed(input_ids, where) -> (x, ctx), layers() -> "
            "[[sublayer with norm(x), core(h, ctx) (this rank's partial sum), finish(z, ctx)], ...], "
            "head(x, ctx) -> logits; and pass it to oases.train_step")
