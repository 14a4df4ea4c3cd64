"""Hugging Face decoder stacks seen as an `oases.schedule.Stack`, run by the TP schedules.

    stack = HFStack(model)           # a Hugging Face causal LM (Llama, Mistral, Qwen2/3, Gemma, Phi-3,
                                     # GPT-2, GPT-NeoX, OLMo-2, ...), after oases.parallelize (or unsharded)

The adapter is derived from the model's structure (oases.nn.parts), not from a list of classes:
the base model (`model.base_model`), its decoder layers (its first non-empty nn.ModuleList child:
`layers`, GPT-2's `h`), its final norm (its one norm child), the head (get_output_embeddings()),
and in each layer its attention, MLP and norms, combined as the layer's forward calls them:

    "sequential"   x + attention(norm_a x)                  attention sublayer  (Llama, Mistral,
                   x + mlp(norm_b x)                        MLP sublayer         Qwen2/3, Gemma,
                                                                                 Phi-3, GPT-2)
    "parallel"     x + attention(norm_a x) + mlp(norm_b x)  one sublayer (GPT-NeoX,
                   use_parallel_residual): norm stacks [norm_a x, norm_b x], core sums both
                   branches' partials, so one all-reduce serves both (half of the all-reduces)
    "whole"        anything else (OLMo-2's post-branch norms, ...): the layer is one sublayer run
                   whole, its own TP layers communicating (oases.models._whole); exact, without overlap

`core` runs the branch under `oases.nn.no_tp_communication`: column layers skip their input's
gradient all-reduce, row layers return their partial product; the schedule reduces both and
`finish` adds the row layers' biases (with dropout, core adds them on the first rank: below).
What each layer receives besides its hidden states (rotary position embeddings, the causal and
padding mask of its attention type, position ids) is taken from the model's own forward: `embed`
runs the base model once with its decoder layers stood in for by recorders, so masks and rotary
embeddings are exactly the model's.

After `oases.parallelize(model, tp_degrees=[...])`, `layer_placements()` gives the schedules each
decoder layer's degree (oases.schedule.protocol): its all-reduces on a Communicator of its own
degree's TP group, its replica's rows (`replica_ctx` cuts every [b, ...] keyword argument of the
layers -- masks, rotary tables, position ids -- to them), rows moved between degrees, on the
groups parallelize made (its record's `layer_degrees`, an oases.degrees.LayerDegrees: oases.nn.parallelism); their
Communicators are made at the first step and kept on the model (`model.oases_layer_placements`;
beside it `model.oases_layer_returns_tuple`, what the base model's forward expects a decoder layer
to return, found at the first step).
While a schedule runs, parallelize's replica-sum hooks stand down and the schedule sums each
layer's gradients over its replicas itself (asynchronously, as the layer's backward ends for
every sub-batch).

Dropout (a model in training mode with some, on oases.train_step): `step_seed()` draws the step's
seed (broadcast over the TP group), every sublayer's core and every layer run whole draws its masks
from DropoutStreams seeded by it, and the embedding's dropout (GPT-2's embd_pdrop) from the
GROUP stream (oases.models.dropout_streams explains the streams). The layer's own dropout modules on a
branch's output (called between the branch and the next norm, or after the MLP) join that branch;
a layer that applies dropout the adapter cannot place on a branch (a dropout function in its
forward: Falcon's dropout_add; a dropout module called elsewhere) runs whole in training.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.degrees import LayerDegrees, kwargs_rows
from oases.models._branch import Branch, check_random, check_sharded
from oases.models._hf_dropout import _parts_of, _placed_dropout, _seed_groups, _SeededWholeLayer
from oases.models._hf_standins import (
    _Given,
    _ShardHead,
    _standing_in,
    _standing_in_for_top,
    _top_names,
    _vocab_embedding,
)
from oases.models._whole import WholeLayer
from oases.models.dropout_streams import draw_step_seed, dropout_in, seeded_embedding
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.parallelism import parallelism_of
from oases.nn.parts import LayerParts, find_stack
from oases.nn.vocab import runs_as_partial
from oases.schedule.placed import layer_placements
from oases.schedule.protocol import EmbedSplit, HeadSplit, LayerPlacements, SubBatch

__all__ = ["HFStack"]


@dataclass(frozen=True)
class _Context:
    """Per sub-batch: where it sits, and each decoder layer's keyword arguments from the model."""

    where: SubBatch
    layer_kwargs: tuple[dict, ...]


class _Recorder(nn.Module):
    """Stands in for decoder layer i in the base model's forward: records its arguments (positional
    ones by the names of the layer's own forward: GPT-2 passes its mask positionally), passes x on
    as the layer returns it (a tuple (x, None) where its forward says it returns a tuple: GPT-J)."""

    def __init__(self, calls: list, layer: nn.Module) -> None:
        super().__init__()
        self.calls = calls
        self.__dict__["_layer"] = layer  # not a submodule: read for attributes the base model asks of its layer
        signature = inspect.signature(layer.forward)
        self.names = [
            n for n, p in signature.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][1:]  # after hidden_states
        returns = signature.return_annotation
        returns = returns if isinstance(returns, str) else getattr(returns, "__name__", repr(returns))
        self.tuple = returns.replace("typing.", "").lower().startswith("tuple")

    def __getattr__(self, name: str) -> Any:
        """The layer's attribute where the recorder has none (transformers 5.0 reads each layer's
        attention_type to pick its mask)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > len(self.names):
            raise TypeError(
                f"oases: a decoder layer got {len(args)} positional arguments besides its hidden "
                f"states, its forward names {len(self.names)}; this model's forward is not one the "
                f"Hugging Face adapter knows"
            )
        kwargs = {**dict(zip(self.names, args)), **kwargs}
        self.calls.append((hidden_states, kwargs))
        return (hidden_states, None) if self.tuple else hidden_states


class HFStack:
    """A Hugging Face causal LM (after oases.parallelize, or unsharded) as an oases.schedule.Stack.

        x, ctx = stack.embed(input_ids[rows], where)   # the model's embeddings, masks, rotary
        stack.layers()                                  # [(attention, mlp), ...] or [(parallel,), ...]
        logits = stack.head(x, ctx)                     # final norm, then the LM head

    An LM head that parallelize made vocab-parallel ("vocab_head") gives this rank's slice of the
    logits here (never gathered; `logits_group` is its group), whatever its gather_output.

    `parts[i]` says how decoder layer i is split (oases.nn.parts.LayerParts: "sequential",
    "parallel" or "whole", and why whole).

    Raises ValueError (before any communication) for a model it cannot run exactly: no decoder
    layers, final norm or head found, or TP shards missing from a split decoder layer whose
    neighbours are sharded (each branch must end in a RowParallelLinear). `dropout`: the model
    trains with dropout (training mode, some rate above 0): the step's masks come from step_seed()
    (see the module docstring). `takes_position_ids`: the base model's forward takes
    `position_ids` (packed rows: positions restarting at each document, as Hugging Face's
    padding-free collators make them; the model's own forward builds the mask from them).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        found, missing = find_stack(model)
        if found is None:
            raise ValueError(_unknown(model, missing))
        self.base, self.decoder, self._layers_name = found.base, found.layers, found.layers_name
        self.takes_position_ids = "position_ids" in inspect.signature(self.base.forward).parameters
        self.final_norm, self.lm_head = found.final_norm, found.head
        # OPT-350m's project_out [h -> word_embed_proj_dim] after the final norm (its project_in runs
        # in embed, through the base model's own forward)
        project_out = getattr(self.base, "project_out", None)
        self._project_out = project_out if isinstance(project_out, nn.Module) else None
        vocab_parallel = isinstance(self.lm_head, ColumnParallelLinear)  # parallelize's "vocab_head"
        self.logits_group = (self.lm_head.group or dist.group.WORLD) if vocab_parallel else None
        self.vocab_size = self.lm_head.out_features if vocab_parallel else None  # V, padded shards or not
        self.dropout = model.training and bool(dropout_in(model))
        self.parts = _parts_of(self.decoder)
        self._after: list[tuple[tuple[nn.Module, ...], ...]] = [((), ())] * len(self.decoder)
        if self.dropout:
            self.parts, self._after = _placed_dropout(self.decoder, self.parts)
        self._names = _top_names(model, self.base, self.lm_head)
        self._embedding = _vocab_embedding(self.base)  # (owner, name) of a vocabulary-parallel one, else None
        decoder = self.decoder
        # parallelize(..., tp_degrees=...) records its LayerDegrees (oases.nn.parallelism): degree-1 layers unsharded
        made = parallelism_of(model)
        self.layer_degrees: Optional[LayerDegrees] = None if made is None else made.layer_degrees
        self.degrees: Optional[tuple[int, ...]] = None if self.layer_degrees is None else self.layer_degrees.degrees
        if self.degrees is not None and len(self.degrees) != len(decoder):
            raise ValueError(
                f"tp_degrees: {len(self.degrees)} degrees for {len(decoder)} decoder layers; "
                f"parallelize the model with one degree per decoder layer"
            )
        whole = [i for i, parts in enumerate(self.parts) if parts.kind == "whole"]
        if self.degrees is not None and whole:  # its own row hooks would move rows the schedule moved
            raise ValueError(
                f"tp_degrees: oases.train_step runs decoder layers {whole} of {type(model).__name__} "
                f"whole, and not yet at per-layer degrees; train it with loss = model(...) then "
                f"loss.backward(), or parallelize without tp_degrees"
            )
        tp_group = next(
            (m.group for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))), None
        )
        self._layers = [
            self._sublayers(i, layer, parts, tp_group, alone=self.degrees is not None and self.degrees[i] == 1)
            for i, (layer, parts) in enumerate(zip(self.decoder, self.parts))
        ]
        self._seed_groups = _seed_groups(model, self.layer_degrees, tp_group)
        check_sharded(
            [
                layer
                for i, layer in enumerate(self._layers)
                if (self.degrees is None or self.degrees[i] > 1) and self.parts[i].kind != "whole"
            ],
            nn.ModuleList([m for m, parts in zip(decoder, self.parts) if parts.kind != "whole"]),
        )

    def _sublayers(
        self, i: int, layer: nn.Module, parts: LayerParts, tp_group: Optional[dist.ProcessGroup], alone: bool
    ) -> tuple:
        if parts.kind == "whole":  # its own TP layers' group, else the model's (a layer left unsharded)
            group = next(
                (m.group for m in layer.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))), tp_group
            )
            if self.dropout:
                return (_SeededWholeLayer(i, layer, group, alone=alone),)
            return (WholeLayer(i, layer, group, alone=alone),)  # alone: degree 1, on this rank only
        attn, mlp = layer.get_submodule(parts.attention), layer.get_submodule(parts.mlp)
        ln1, ln2 = (layer.get_submodule(n) for n in parts.norms)
        after_attn, after_mlp = self._after[i]
        if parts.kind == "parallel":
            return (Branch(i, (ln1, ln2), (attn, mlp), attn, dropout=self.dropout, after=(after_attn, after_mlp)),)
        return (
            Branch(i, (ln1,), (attn,), attn, position=0, dropout=self.dropout, after=(after_attn,)),
            Branch(i, (ln2,), (mlp,), None, position=1, dropout=self.dropout, after=(after_mlp,)),
        )

    def partial_parameters(self) -> list[torch.Tensor]:
        """The replicated LoRA factors in the split layers (oases.nn.lora): inside the cores their
        gradients are this rank's shares, summed by the schedule after the step; a layer run whole
        communicates as model(...) does and sums them itself."""
        found: dict[int, torch.Tensor] = {}
        for layer, parts in zip(self.decoder, self.parts):
            if parts.kind == "whole":
                continue
            for module in layer.modules():
                get = getattr(module, "partial_parameters", None)
                if callable(get):
                    found.update((id(p), p) for p in get())
        return list(found.values())

    def step_seed(self) -> Optional[int]:
        """The step's dropout seed (None without dropout: eval mode, or every rate 0): drawn from the
        default generator of the TP group's first rank and broadcast, the same on every rank
        (oases.models.dropout_streams.draw_step_seed)."""
        if not self.dropout:
            return None
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return draw_step_seed(device, self._seed_groups)

    def check_trainable(self, seeded: bool = False) -> None:
        """In training mode: a router's jitter noise or sampling router is refused (recomputation
        would draw other numbers), and dropout unless the caller seeds it (`seeded`: oases.train_step
        and the pipeline do, from the step's seed); an MoE model's load-balancing loss
        (output_router_logits) is not part of the step's loss."""
        check_random(self.model, self.decoder, seeded=seeded)
        if getattr(getattr(self.model, "config", None), "output_router_logits", False) is True:
            raise ValueError(
                "oases.train_step: the model's config has output_router_logits=True, and the step's loss "
                "is the language-model loss alone (no load-balancing loss); set "
                "model.config.output_router_logits = False, or train with loss = model(...).loss and "
                "loss.backward() (exact with sharded experts)"
            )

    def embed(self, input_ids: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, _Context]:
        """input_ids [b, t] -> (x [b, t, h], the first decoder layer's input; a _Context of `where` and
        every layer's keyword arguments), recorded by running the base model's forward with stand-ins for
        its decoder layers."""
        return self._embed(input_ids, where, None)

    def embed_split(self, input_ids: torch.Tensor, where: SubBatch) -> Optional[EmbedSplit]:
        """`embed` around its vocabulary-parallel embedding's all-reduce (oases.schedule.protocol), None
        where the input embedding is not vocabulary-parallel: this rank's share of the token embeddings,
        then the base model's forward with the embedding standing in for by their sum."""
        if self._embedding is None:
            return None
        owner, name = self._embedding
        embedding = getattr(owner, name)
        if not runs_as_partial(embedding):
            return None
        return EmbedSplit(
            embedding.partial(input_ids),
            embedding.group,
            lambda summed: self._embed(input_ids, where, (owner, name, _Given(embedding, input_ids, summed))),
        )

    def _embed(
        self, input_ids: torch.Tensor, where: SubBatch, summed: Optional[tuple[nn.Module, str, nn.Module]]
    ) -> tuple[torch.Tensor, _Context]:
        """embed; `summed` = (owner, name, given): owner.<name>, the input embedding, stood in for by `given`."""
        calls: list = []
        recorders = [_Recorder(calls, layer) for layer in self.decoder]
        # what the base's forward expects of a layer, once known: kept on the model (a step makes a new HFStack)
        known: Optional[bool] = getattr(self.model, "oases_layer_returns_tuple", None)
        for recorder in recorders if known is not None else ():
            recorder.tuple = known
        given = contextlib.nullcontext() if summed is None else _standing_in(*summed)
        drawing = seeded_embedding(where if self.dropout else None, input_ids.device)  # the embedding's dropout
        inputs = {"input_ids": input_ids, "attention_mask": where.attention_mask, "use_cache": False}
        if where.position_ids is not None:
            inputs["position_ids"] = where.position_ids
        with given, drawing, _standing_in(self.base, self._layers_name, nn.ModuleList(recorders)):
            try:
                self.base(**inputs)
            except (AttributeError, IndexError, TypeError, ValueError):
                # the layer's annotation misled (Gemma-3 says tuple, returns a tensor): the other
                # form once; what follows the layers in the base's forward is discarded either way
                if known is not None:
                    raise
                calls.clear()
                for recorder in recorders:
                    recorder.tuple = not recorder.tuple
                self.base(**inputs)
            self.model.oases_layer_returns_tuple = recorders[0].tuple
        if len(calls) != len(self.decoder):
            raise RuntimeError(f"oases: the base model called {len(calls)} of its {len(self.decoder)} decoder layers")
        x = calls[0][0]
        return x, _Context(where, tuple(kwargs for _, kwargs in calls))

    def layers(self) -> list[tuple[Branch, ...]]:
        """Each decoder layer's sublayers: an attention and an MLP branch, one branch for a parallel
        block, or the whole layer."""
        return self._layers

    def layer_placements(self) -> Optional[LayerPlacements]:
        """Per-layer TP degrees (parallelize(..., tp_degrees=...)): the decoder layers' placements
        over the groups parallelize made (its record's layer_degrees), their Communicators made at the
        first call and kept on the model; None without tp_degrees. While a schedule runs,
        parallelize's replica-sum hooks stand down and the schedule sums each layer's gradients
        over its replicas itself."""
        if self.degrees is None:
            return None
        kept = getattr(self.model, "oases_layer_placements", None)
        if not isinstance(kept, LayerPlacements) or tuple(at.place.degree for at in kept.layers) != self.degrees:
            kept = layer_placements(self.layer_degrees, self.decoder)
            self.model.oases_layer_placements = kept
        return kept

    def replica_ctx(self, ctx: _Context, rows: slice) -> _Context:
        """ctx narrowed to a replica's `rows` of the sub-batch: its SubBatch, and every tensor of
        the layers' keyword arguments whose first dim is the sub-batch's row count (as
        parallelize's hooks cut them: oases.degrees.kwargs_rows)."""
        batch = ctx.where.rows.stop - ctx.where.rows.start
        kwargs = tuple(kwargs_rows(layer, batch, rows) for layer in ctx.layer_kwargs)
        return _Context(ctx.where.replica_rows(rows), kwargs)

    def head(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """The final norm (and a projection after it: OPT-350m's project_out), the LM head, then what
        the model's own forward does to the head's logits (Gemma-2's soft-capping, Cohere's
        logit_scale, Granite's logits_scaling: the model's forward runs with its base model and head
        stood in for; each is elementwise, so exact on a vocab-parallel shard too), then a padded
        vocabulary's columns set to -inf."""
        h = self._normed(x)
        if self.logits_group is None:
            return self._logits(h, self.lm_head)  # [b, t, vocab]
        # [b, t, vocab/p]; the input's gradient is all-reduced (copy_to_tp) as the layer would
        return self._logits(h, _ShardHead(self.lm_head, self.logits_group))

    def head_split(self, x: torch.Tensor, ctx: Any = None) -> Optional[HeadSplit]:
        """`head` around a vocabulary-parallel head's all-reduce of its input's gradient
        (oases.schedule.protocol), None where the head is not vocabulary-parallel: the final norm,
        then the logits from its output, whose gradient there is this rank's share."""
        if self.logits_group is None:
            return None
        return HeadSplit(self._normed(x), self.logits_group, lambda h: self._logits(h, _ShardHead(self.lm_head, None)))

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output (and OPT's project_out after it, where it has one)."""
        h = self.final_norm(x)
        return h if self._project_out is None else self._project_out(h)

    def _logits(self, h: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """`head` of the final norm's output h, then what the model's forward does to its logits."""
        if self._names is None:
            logits = head(h)
        else:
            with _standing_in_for_top(self.model, self._names, h, head):
                # .forward, not the call: the model's forward pre-hooks (the TP input check) ran at the step's entry
                logits = self.model.forward(input_ids=None, use_cache=False, return_dict=True).logits
        return logits if self.logits_group is None else self.lm_head.mask_padding(logits)


def _unknown(model: nn.Module, what: str) -> str:
    return (
        f"oases: no adapter for {type(model).__name__} ({what}). The Hugging Face adapter needs a causal LM "
        "with model.base_model holding its decoder layers (an nn.ModuleList), one final norm, and "
        "get_output_embeddings(); oases.models.GPT and nanoGPT-style models have their own. For another "
        "model, implement oases.schedule.Stack: embed(input_ids, where) -> (x, ctx), layers() -> "
        "[[sublayer with norm(x), core(h, ctx) (this rank's partial sum), finish(z, ctx)], ...], "
        "head(x, ctx) -> logits; and pass it to oases.train_step"
    )
