"""One residual branch of a model's own decoder layer, as an oases.schedule.Sublayer.

    Branch(index, norms, branches, attention)
        norm(x)      = norms[0](x), or stack([n(x) for n in norms]) for a parallel residual
        core(h, ctx) = sum over branches of branch(its input) under no_tp_communication: this
                       rank's partial sum (the row-parallel output projections unreduced, no bias);
                       `attention` (if one of them) also gets ctx.layer_kwargs[index] (masks, rotary)
        finish(z)    = z + the row-parallel layers' biases
        core_for_gradients(h, ctx) = core's graph, each branch's output projection not run (its
                       value unread), where each branch ends in its one RowParallelLinear; else core

Shared by the adapters of Hugging Face and nanoGPT-style models.

Dropout in a training step (`Branch(..., dropout=True)`, where the step has a seed: SubBatch.seed):
the streams and seeds of oases.models.dropout_streams.
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from oases.models.dropout_streams import (
    GROUP,
    DropoutStreams,
    dropout_in,
    seeded_branch,
    stream_hooks,
    tp_rank,
    where_of,
)
from oases.nn.experts import ParallelExperts
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear, no_tp_communication
from oases.nn.parts import LATENT_PROJECTIONS
from oases.nn.row import outputs_made

__all__ = ["Branch", "NOT_PASSED", "check_sharded", "check_random"]

# Keyword arguments of a decoder layer that its attention must not get in a training step.
NOT_PASSED = ("hidden_states", "use_cache", "past_key_values", "layer_past", "past_key_value")


def _row_biases(module: nn.Module) -> list[torch.Tensor]:
    return [m.bias for m in module.modules() if isinstance(m, RowParallelLinear) and m.bias is not None]


def _sum(ys: list[torch.Tensor]) -> torch.Tensor:
    out = ys[0]
    for y in ys[1:]:
        out = out + y
    return out


def _as_made(ys: list[torch.Tensor], made: list[list[tuple]]) -> bool:
    """Whether each branch returned its row layer's one output as the layer made it (the same
    tensor, neither another op's output nor changed in place since)."""
    return all(
        len(m) == 1 and y is m[0][0] and y.grad_fn is m[0][1] and y._version == m[0][2] for y, m in zip(ys, made)
    )


def _check_after_projection(
    index: int, module: nn.Module, y: torch.Tensor, projected: list, h: torch.Tensor, biases: Sequence = ()
) -> None:
    """Refuse a branch whose output joins its row-parallel projection's output (autograd nodes
    `projected`) with a parameter or other tensor that needs a gradient: a learned scale or gate
    applied to the projection (the schedules apply it to this rank's partial sum, so its gradient
    would be partial). Parameter-free steps (a constant scale, a view, dropout at p = 0, a gate
    computed from the branch's input `h` alone, whose gradient the schedule sums over the ranks)
    pass: they commute with the reduction. `biases`: the row layers' biases, which a training
    step with dropout adds there itself (Branch's dropout)."""
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in projected or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", h)  # AccumulateGrad: a tensor that needs a gradient
        if variable is not h and not any(variable is b for b in biases):
            raise ValueError(
                f"oases.train_step: decoder layer {index}'s {type(module).__name__} does more with its "
                f"row-parallel output projection's output than return it (its output is {y.grad_fn.name()} "
                "of it and of a tensor that needs a gradient, such as a learned scale or gate). The schedules "
                "reduce that projection's output themselves, after the branch, so that gradient would be this "
                "rank's partial sum. Return the projection's output as is (apply the scale in the decoder "
                "layer), or train with loss = model(...).loss; loss.backward(), which reduces before it"
            )
        todo.extend(f for f, _ in node.next_functions)


def _sole_row(module: nn.Module) -> Optional[RowParallelLinear]:
    """The branch's one RowParallelLinear, or None (several, none, or sharded experts)."""
    rows = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
    if len(rows) != 1 or any(isinstance(m, ParallelExperts) for m in module.modules()):
        return None
    return rows[0]


class Branch:
    """One sublayer: x + finish(reduce(core(norm(x)))), over a decoder layer's own modules.

    `position`: the sublayer's place in its layer (in the dropout seeds); `dropout`: the step
    applies dropout (the model trains with some): core draws its masks from DropoutStreams seeded
    by ctx's SubBatch and adds the row biases itself, and `after[j]` are the layer's dropout
    modules applied to branch j's output (see the module docstring)."""

    def __init__(
        self,
        index: int,
        norms: tuple[nn.Module, ...],
        branches: tuple[nn.Module, ...],
        attention: Optional[nn.Module],
        *,
        position: int = 0,
        dropout: bool = False,
        after: Sequence[Sequence[nn.Module]] = (),
    ) -> None:
        self.index, self.position = index, position  # the decoder layer's; the sublayer's in it
        self.norms, self.branches, self.attention = norms, branches, attention
        self.dropout = dropout
        self.after = tuple(tuple(a) for a in after) + ((),) * (len(branches) - len(after))
        self.biases = [b for m in branches for b in _row_biases(m)]
        rows = [_sole_row(m) for m in branches]
        # each branch's one RowParallelLinear, or None where a branch has several, none, or sharded
        # experts (whose outputs the MoE block weights: oases.nn._moe reduces them)
        self._rows: Optional[list[RowParallelLinear]] = None if any(r is None for r in rows) else rows

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.norms) == 1:
            return self.norms[0](x)
        return torch.stack([n(x) for n in self.norms])  # [branches, b, t, h]

    def core(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        rows = self._rows
        # (checked already: see below; in inference mode nothing is differentiated, nor versioned)
        if rows is None or all(r._output_read for r in rows) or torch.is_inference_mode_enabled():
            return _sum(self._outputs(h, ctx))
        with outputs_made(rows, unread=False) as made:
            ys = self._outputs(h, ctx)
        if not _as_made(ys, made):  # something after the output projection: refused if it learns
            if any(r.world_size > 1 for r in rows):  # (one rank: the whole sum, nothing to refuse)
                self._check_after_projections(h, ctx, rows, ys, made)
            for row in rows:  # core_for_gradients runs core from now on, and core checks no more
                row._output_read = True
        return _sum(ys)

    def _check_after_projections(self, h: torch.Tensor, ctx: Any, rows: list, ys: list, made: list) -> None:
        """Refuse the branch if a tensor that needs a gradient joins a projection's output after
        it (_check_after_projection). Without autograd the branch is run once more with it, so
        the first forward refuses, before any backward."""
        if not torch.is_grad_enabled() or not h.requires_grad:
            h = h.detach().requires_grad_()
            with torch.enable_grad(), outputs_made(rows, unread=False) as made:
                ys = self._outputs(h, ctx)
        biases = self.biases if self.dropout else ()
        for module, y, outputs in zip(self.branches, ys, made):
            _check_after_projection(self.index, module, y, [node for _, node, _ in outputs], h, biases)

    def core_for_gradients(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        """core(h, ctx)'s graph for a backward only (oases.schedule.protocol): where every branch's
        output is its one RowParallelLinear's, those layers run no GEMM (their value is unread).
        A branch that does anything to that output after the layer (scales it) is seen here, by
        its output's grad_fn, and core runs instead, then and from then on (the layer is marked)."""
        rows = self._rows
        if rows is None or any(r._output_read for r in rows):
            return self.core(h, ctx)
        with outputs_made(rows, unread=True) as made:
            ys = self._outputs(h, ctx)
        if _as_made(ys, made):
            return _sum(ys)
        return self.core(h, ctx)  # marks the layers, or refuses the branch

    def _outputs(self, h: torch.Tensor, ctx: Any) -> list[torch.Tensor]:
        """Each branch's partial sum, under no_tp_communication."""
        inputs = [h] if len(self.norms) == 1 else h.unbind(0)
        ys = []
        for j, (module, x) in enumerate(zip(self.branches, inputs)):
            with no_tp_communication(module), self._drawing(j, module, ctx, h.device) as streams:
                if module is self.attention:
                    kwargs = {k: v for k, v in ctx.layer_kwargs[self.index].items() if k not in NOT_PASSED}
                    y = module(hidden_states=x, **kwargs)[0]
                else:
                    y = module(x)
                y = y[0] if isinstance(y, tuple) else y  # GPT-OSS's MoE block: (hidden_states, router_scores)
                if self.dropout and self.after[j]:  # the layer's dropout of this branch's output (after its bias)
                    if streams is not None:
                        streams.use(GROUP)
                    for drop in self.after[j]:
                        y = drop(y)
            ys.append(y)
        return ys

    @contextlib.contextmanager
    def _drawing(self, j: int, module: nn.Module, ctx: Any, device: torch.device) -> Iterator[Optional[DropoutStreams]]:
        """Around branch j's forward with dropout: its DropoutStreams (None without a step seed) and
        stream_hooks (row biases added on the lead rank); nothing without dropout."""
        if not self.dropout:
            yield None
            return
        where = where_of(ctx)
        with seeded_branch(where, self.index, self.position, j, tp_rank(module), device) as streams:
            with stream_hooks(module, streams, lead_biases=True):
                yield streams

    def finish(self, z: torch.Tensor, ctx: Any) -> torch.Tensor:
        if self.dropout:  # core added them (before the branch's dropout)
            return z
        for b in self.biases:
            z = z + b
        return z

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter the sublayer uses: its norms' and its branches' (each once)."""
        seen: dict[int, nn.Parameter] = {}
        for module in (*self.norms, *self.branches):
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def sequence_parallel_parameters(self) -> list[nn.Parameter]:
        """What norm and finish use (summed over the group under sequence parallelism); with
        dropout, core adds the biases (their gradients whole on every rank): the norms' alone."""
        return [*(p for n in self.norms for p in n.parameters()), *(() if self.dropout else self.biases)]


def check_sharded(layers: list[tuple[Branch, ...]], decoder: nn.Module) -> None:
    """Either nothing in `decoder` is TP-sharded (TP = 1), or every branch is: no plain nn.Linear
    left in it (but an MoE block's routers and gates, replicated by design), and a row-parallel
    output projection or sharded experts (ParallelExperts) that make its output a partial sum."""
    if not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in decoder.modules()):
        return
    for layer in layers:
        for sub in layer:
            for module in sub.branches:
                blocks = {
                    n
                    for n, m in module.named_modules()  # MoE blocks: their nn.Linear children replicated
                    if any(isinstance(c, ParallelExperts) for c in m.children())
                }
                plain = [
                    n
                    for n, m in module.named_modules()
                    if type(m) is nn.Linear
                    and n.rpartition(".")[0] not in blocks
                    and n.rpartition(".")[2] not in LATENT_PROJECTIONS  # MLA's, replicated by design
                ]
                if plain or not any(isinstance(m, (RowParallelLinear, ParallelExperts)) for m in module.modules()):
                    raise ValueError(
                        f"oases.train_step: decoder layer {sub.index}'s {type(module).__name__} is not fully "
                        f"tensor-parallel (plain nn.Linear: {', '.join(plain) or 'none'}; it needs a row-parallel "
                        "output projection); shard every decoder layer with oases.parallelize(model, group)"
                    )


# Modules that draw random numbers in training whatever their settings: PhiMoE's router samples its
# experts (Gumbel noise); a recomputed sublayer would route its tokens to other experts.
_SAMPLES_IN_TRAINING: Mapping[str, str] = MappingProxyType(
    {"PhimoeTopKRouter": "samples its experts with Gumbel noise in training"}
)


def check_random(model: nn.Module, decoder: nn.Module, *, seeded: bool) -> None:
    """Refuse, in training mode, what recomputed sublayers would draw anew: a router's jitter noise
    or sampled experts always; dropout unless the caller seeds it (`seeded`: oases.train_step and
    the pipeline, whose masks come from the step's seed)."""
    if not model.training:
        return
    for i, layer in enumerate(decoder):
        for name, m in layer.named_modules():
            jitter = {a: v for a, v in vars(m).items() if "jitter" in a and isinstance(v, float) and v > 0}
            why = _SAMPLES_IN_TRAINING.get(type(m).__name__) or (
                f"draws random noise in training ({', '.join(f'{a}={v}' for a, v in jitter.items())})" if jitter else ""
            )
            if why:
                raise ValueError(
                    f"oases.train_step: decoder layer {i}'s {name or 'layer'} ({type(m).__name__}) {why}; the "
                    "schedules recompute sublayers and would draw other numbers. Set the config's jitter noise to "
                    "0 or call model.eval() (the router then picks its top experts)"
                )
        if not seeded:
            for name, p in dropout_in(layer)[:1]:
                raise ValueError(
                    f"decoder layer {i} has dropout {p} ({name}); this caller does not seed dropout masks "
                    "(its recomputation would draw other ones). Set the config's dropout to 0, call "
                    "model.eval(), or train with oases.train_step or the pipeline (masks from the step's seed)"
                )
