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

Dropout in a training step (`Branch(..., dropout=True)`, where the step has a seed: SubBatch.seed).
The schedules run a sublayer's core two or three times (forward, recomputation, a check), so its
masks cannot come from the global generator's running state. Each branch's forward runs with the
default generators forked (`DropoutStreams`: the CPU's, and the device's on CUDA; restored after)
and seeded from (step seed, layer, sublayer, branch, the sub-batch's rows), so every run of it draws
the same masks, and a rank switches between two streams as the branch runs (Megatron's RNG tracker):

    GROUP  the same on every rank of the TP group: from the branch's entry, and again after each
           row-parallel projection. Dropout there acts on replicated activations, or on the partial
           sums after the row projection (GPT-2's resid_dropout): mask m on every rank, so
           sum_r m * z_r / (1 - p) = m * (sum_r z_r) / (1 - p), the unsharded dropout of the sum.
    RANK   this rank's own (its TP rank in the seed): after each column-parallel projection, up to
           the row projection. Dropout there acts on this rank's heads or features (attention
           probabilities, MLP features): independent masks, as the unsharded model's would be.

With dropout on, the row projections' biases are added inside core on the group's first rank
(lead_only: fwd b there and 0 elsewhere, bwd the whole gradient on every rank), so a dropout after
the projection sees the unsharded layer's biased output; finish adds nothing then. The layer's own
dropout modules applied to a branch's output (`after`: GPT-NeoX's post_attention_dropout, Phi-3's
resid_attn_dropout) run at the end of that branch, on the GROUP stream. Masks depend on the
sub-batch split (the rows are in the seed), not on recomputation, on the schedule's passes or on
sequence parallelism (the ranks' token slices are not in the seed).
"""

from __future__ import annotations

import contextlib
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.dropout import _DropoutNd

from oases.nn._mappings import lead_only
from oases.nn._parts import LATENT_PROJECTIONS
from oases.nn.experts import ParallelExperts
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear, no_tp_communication
from oases.nn.row import _outputs_made
from oases.schedule.protocol import SubBatch

__all__ = [
    "Branch",
    "NOT_PASSED",
    "GROUP",
    "RANK",
    "DropoutStreams",
    "check_sharded",
    "check_random",
    "seeded_embedding",
    "seeded_layer",
    "tp_rank",
    "where_of",
    "dropout_in",
    "draw_step_seed",
    "mix_seed",
    "stream_hooks",
]

# Keyword arguments of a decoder layer that its attention must not get in a training step.
NOT_PASSED = ("hidden_states", "use_cache", "past_key_values", "layer_past", "past_key_value")


GROUP, RANK = 0, 1  # DropoutStreams' streams: the same on every TP rank / this rank's own
_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A seed in [0, 2**63) from integers (splitmix64 over them): the same in every process."""
    h = 0
    for v in values:
        h = (h + (int(v) & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


class DropoutStreams:
    """Inside `with`: the default generators (the CPU's, and `device`'s on CUDA) forked, drawing
    from the GROUP stream of `key`; `use(RANK)` / `use(GROUP)` switch streams. Each switch starts
    the stream's next segment, seeded from (key, stream, `rank` for RANK, the segment's number), so
    the same code path draws the same numbers on every run and GROUP's on every rank. The
    generators' states are restored on exit."""

    def __init__(self, key: Sequence[int], rank: int, device: torch.device) -> None:
        self.key, self.rank = tuple(key), rank
        self.cuda = device.index if device.index is not None else None
        if device.type == "cuda" and self.cuda is None:
            self.cuda = torch.cuda.current_device()
        if device.type != "cuda":
            self.cuda = None
        self.current: Optional[int] = None
        self._segments = [0, 0]
        self._saved: Optional[tuple] = None

    def __enter__(self) -> "DropoutStreams":
        cuda = None if self.cuda is None else torch.cuda.get_rng_state(self.cuda)
        self._saved = (torch.get_rng_state(), cuda)
        self.current = None
        self.use(GROUP)
        return self

    def __exit__(self, *exc: Any) -> None:
        cpu, cuda = self._saved
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.cuda)
        self.current, self._saved = None, None

    def use(self, stream: int) -> None:
        """Draw from `stream` (GROUP or RANK) from here on (nothing changes if it is the current one)."""
        if stream == self.current:
            return
        self.current = stream
        seed = mix_seed(*self.key, stream, self.rank if stream == RANK else 0, self._segments[stream])
        self._segments[stream] += 1
        torch.default_generator.manual_seed(seed)
        if self.cuda is not None:
            torch.cuda.default_generators[self.cuda].manual_seed(seed)


@contextlib.contextmanager
def stream_hooks(module: nn.Module, streams: Optional[DropoutStreams], lead_biases: bool = False) -> Iterator[None]:
    """Inside, `module`'s column-parallel layers switch `streams` to RANK after their forward and its
    row-parallel layers back to GROUP (see the module docstring), a LoRA layer on a column to GROUP
    before its forward (its lora_dropout masks the replicated input: one mask on every rank; a
    LoRA layer on a row draws on RANK, its input being this rank's features); `lead_biases`: a row layer that
    returns its partial sum (under no_tp_communication) adds its bias to it on the group's first
    rank (lead_only). Hooks removed on exit."""
    handles = []

    def after_column(m: nn.Module, args: Any, out: torch.Tensor) -> None:
        if streams is not None:
            streams.use(RANK)

    def before_column_adapter(m: nn.Module, args: Any) -> None:
        if streams is not None:
            streams.use(GROUP)

    def after_row(m: nn.Module, args: Any, out: torch.Tensor) -> Optional[torch.Tensor]:
        if streams is not None:
            streams.use(GROUP)
        if lead_biases and m.bias is not None and not m._communicate:
            return out + lead_only(m.bias.to(out.dtype), m.rank == 0)
        return None

    try:
        for m in module.modules():
            if isinstance(m, ColumnParallelLinear) and streams is not None:
                handles.append(m.register_forward_hook(after_column))
            elif isinstance(getattr(m, "base_layer", None), ColumnParallelLinear) and streams is not None:
                # a LoRA layer on a column (oases.nn.lora): its dropout acts on the replicated input
                handles.append(m.register_forward_pre_hook(before_column_adapter))
            elif isinstance(m, RowParallelLinear):
                handles.append(m.register_forward_hook(after_row))
        yield
    finally:
        for h in handles:
            h.remove()


def tp_rank(module: nn.Module) -> int:
    """The TP rank of `module`'s first column- or row-parallel layer (0 without one)."""
    return next((m.rank for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))), 0)


def where_of(ctx: Any) -> Optional[SubBatch]:
    """The SubBatch of a stack's ctx: ctx itself, or its `where` attribute (None: neither)."""
    if isinstance(ctx, SubBatch):
        return ctx
    where = getattr(ctx, "where", None)
    return where if isinstance(where, SubBatch) else None


def seed_key(where: SubBatch, *place: int) -> tuple[int, ...]:
    """A DropoutStreams key: the step seed, `place` (what runs: a layer and sublayer, the
    embedding) and the sub-batch's rows of the batch."""
    rows = where.rows
    return (where.seed, *place, rows.start or 0, -1 if rows.stop is None else rows.stop, where.batch)


_BRANCH, _WHOLE, _EMBED = 1, 2, 3  # what a DropoutStreams key's place starts with


def seeded(where: Optional[SubBatch], *place: int, rank: int = 0, device: torch.device) -> Any:
    """DropoutStreams for `place` in sub-batch `where`, or a null context (None) without a step seed."""
    if where is None or where.seed is None:
        return contextlib.nullcontext(None)
    return DropoutStreams(seed_key(where, *place), rank, device)


def seeded_embedding(where: Optional[SubBatch], device: torch.device) -> Any:
    """`seeded` for a stack's embedding (before the decoder layers): the GROUP stream throughout."""
    return seeded(where, _EMBED, device=device)


@contextlib.contextmanager
def seeded_layer(
    layer: nn.Module, where: Optional[SubBatch], index: int, rank: int, device: torch.device
) -> Iterator[Optional[DropoutStreams]]:
    """Around decoder layer `index` run whole (its TP layers communicating themselves): its
    DropoutStreams and stream_hooks; the row layers add their own biases."""
    with seeded(where, _WHOLE, index, rank=rank, device=device) as streams:
        with stream_hooks(layer, streams):
            yield streams


def draw_step_seed(device: torch.device, groups: Sequence[Optional[dist.ProcessGroup]]) -> int:
    """A step's dropout seed: drawn from the default generator (on every rank, so each advances
    alike) and broadcast from the first rank of each of `groups` in turn (None: the world), so
    every rank of their union has the first one's."""
    seed = torch.randint(0, 2**31 - 1, (1,), device=device)
    if dist.is_available() and dist.is_initialized():
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.broadcast(seed, dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    return int(seed)


def is_dropout(module: nn.Module) -> bool:
    """A dropout module (nn.Dropout and its kin)."""
    return isinstance(module, _DropoutNd)


def dropout_in(module: nn.Module) -> list[tuple[str, float]]:
    """(name, p) of what draws dropout masks in `module` in training: dropout modules with p > 0
    and float attributes named like a dropout rate (`*dropout*`, `*pdrop*`) above 0 (a Hugging
    Face attention's attention_dropout, Falcon's hidden_dropout, nanoGPT's dropout)."""
    found = []
    for name, m in module.named_modules():
        if is_dropout(m):
            if m.p > 0:
                found.append((name, float(m.p)))
            continue
        for attr, v in vars(m).items():
            if isinstance(v, float) and v > 0 and ("dropout" in attr.lower() or "pdrop" in attr.lower()):
                found.append((f"{name}.{attr}" if name else attr, v))
    return found


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
        with _outputs_made(rows, unread=False) as made:
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
            with torch.enable_grad(), _outputs_made(rows, unread=False) as made:
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
        with _outputs_made(rows, unread=True) as made:
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
        place = (_BRANCH, self.index, self.position, j)
        with seeded(where_of(ctx), *place, rank=tp_rank(module), device=device) as streams:
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
