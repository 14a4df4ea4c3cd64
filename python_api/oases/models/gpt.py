"""A GPT whose blocks are tensor-parallel and whose stack trains on a selectable schedule.

Each block is two *sublayers* (attention, MLP), each of the pre-LN residual form

    x = x + finish(all_reduce(core(norm(x))))        # x [b, t, h], replicated on every TP rank

where `core` is the TP-local part (column-parallel QKV / fc1 on this rank's heads / features,
then the row-parallel out-projection / fc2 without its bias), so summing `core` over the ranks
gives the unsharded sublayer's output; `finish` adds the replicated bias and the residual dropout.
The schedules in `oases.schedule` only see this form.

With no process group (or a group of one) the same module is the plain single-process model:
`GPT(config, seed=s)` on one process and `GPT(config, group, seed=s)` on each TP rank hold the
same weights (each rank keeps its shard of the full initialisation), so their losses and
gradients can be compared exactly.

Per-layer TP degrees (`tp_degrees=[d_0, ..., d_{L-1}]`, each a power of two dividing p, e.g. from
`oases.plan.load`): block l runs as p/d_l replicas, replica j on the d_l consecutive ranks
j*d_l .. j*d_l + d_l - 1 and on row block j of p/d_l of the batch ("data parallel inside the
group"; oases._rows.block_rows: blocks differ by a row at most when p/d_l does not divide B);
the embedding and the head run at degree p (the whole batch on every rank):

    x = embed(tokens)                                 # [B, t, h] on every rank (degree p)
    for l: x = reshard_rows(x, d_{l-1} -> d_l); x = block_l(x)    # [~B d_l / p, t, h]
    loss = head(reshard_rows(x, d_{L-1} -> p))       # moves of rows and their adjoints: oases.degrees
and each parameter gradient of a block with d_l < p is summed over its p/d_l replicas (an
all-reduce over the ranks at the same TP position, by a hook as autograd produces the gradient;
under oases.train_step's schedules the hooks stand down and the schedule sums each block's
gradients once, per step, as the block's backward ends: see `layer_placements`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases import _checks
from oases._sharding import tp_rules
from oases.degrees import LayerDegrees, check_tp_degrees, check_world_group, refuse_with_degrees
from oases.inputs import CheckMode, agree_tp_inputs
from oases.models._gpt_config import GPTConfig
from oases.models._gpt_sublayers import _MLP, _Attention, _Sublayer
from oases.nn.layers import ColumnParallelLinear
from oases.nn.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from oases.nn.parallelism import Parallelism, parallelism_of, record
from oases.nn.vocab import IGNORE_INDEX, VocabParallelEmbedding, runs_as_partial, vocab_parallel_cross_entropy
from oases.offload import Offloader
from oases.schedule import (
    SCHEDULES,
    Communicator,
    Recompute,
    RecomputeMemory,
    StepOptions,
    SubBatch,
    check_placed,
    run_step,
)
from oases.schedule.placed import layer_placements
from oases.schedule.protocol import EmbedSplit, HeadSplit, LayerPlacements

__all__ = ["GPTConfig", "GPT"]


class GPT(nn.Module):
    """GPT with tensor-parallel blocks on `group` (None and no initialised process group: one rank).

        model = GPT(config, group, schedule="oases", seed=0)
        loss = model.train_step(tokens, targets)     # tokens, targets [b, t] int64; grads in .grad
        logits = model(tokens)                       # [b, t, vocab]; differentiable at any TP size
        loss = model(tokens, targets)                # mean token loss; loss.backward() works too

    `vocab_parallel=True` (TP > 1) shards the token embedding and the LM head by vocabulary rows
    (oases.nn.VocabParallelEmbedding, ColumnParallelLinear): the loss of `train_step` and of
    `forward(tokens, targets)` comes from oases.nn.vocab_parallel_cross_entropy and the full
    logits never exist (`forward(tokens)` alone gathers them). The vocabulary must divide by p.

    `offload=True` (or an oases.offload.Offloader): `train_step` moves the sublayer inputs it keeps
    for recomputation to host memory in batches and back before use (`self.offloader`; its first
    step sizes its HostSlab); the same losses and gradients.

    `sequence_parallel=True`: `train_step` keeps the residual stream as this rank's slice of the
    sequence between sublayers (oases.schedule.sequence_parallel); seq_len must divide by p.

    `train_step` runs forward and backward on `schedule` (see oases.schedule.SCHEDULES); every
    schedule gives the loss and gradients of the single-process model with the same seed, and so
    does `forward` + `backward` (blocking all-reduces on the autograd path). The model is an
    `oases.schedule.Stack`: `oases.train_step(model, input_ids, labels)` runs it too (with
    Hugging Face's shifted-label loss).

    `tp_degrees=[d_0, ..., d_{L-1}]` (one per layer, each a power of two dividing p; e.g.
    `oases.plan.load("plan.json")`): layer l runs at TP degree d_l as p/d_l replicas, each on its
    block of the batch rows (see the module docstring; kept as `self.layer_degrees`, an
    oases.degrees.LayerDegrees); `group` must be the whole world (the subgroups are made at
    construction, collectively on every rank). Same loss and per-shard gradients as the
    single-process model; the batch (each sub-batch under `train_step`) needs at least
    p / min(tp_degrees) rows. `forward` + `backward` run it with blocking collectives on the
    autograd path; `train_step` and `oases.train_step` on the overlapped schedules, which read
    each block's Communicator, row moves and replica group from `layer_placements()`.
    vocab_parallel, sequence_parallel and offload do not combine with it (ValueError), nor does
    `oases.pipeline`.
    """

    def __init__(
        self,
        config: GPTConfig,
        group: Optional[dist.ProcessGroup] = None,
        *,
        schedule: str = "oases",
        seed: int = 0,
        vocab_parallel: bool = False,
        sequence_parallel: bool = False,
        offload: Union[bool, Offloader] = False,
        tp_degrees: Optional[Sequence[int]] = None,
    ) -> None:
        """Build this rank's shards of the model (the class docstring describes each argument).

        Args:
            config: the model's sizes (a GPTConfig); heads and hidden * mlp_ratio must divide by the TP size.
            group: the tensor-parallel process group (default None: the world; no initialised process
                group: one rank).
            schedule: the schedule `train_step` runs on (default "oases"; see oases.schedule.SCHEDULES).
            seed: the seed the full model is initialised from (GPT-2 style); this rank keeps its shards.
            vocab_parallel: shard the token embedding and the LM head by vocabulary rows (TP > 1).
            sequence_parallel: `train_step` keeps the residual stream sequence-sharded between sublayers.
            offload: True or an oases.offload.Offloader: `train_step` offloads the sublayer inputs it keeps
                for recomputation (default False: they stay).
            tp_degrees: one TP degree per layer, each a power of two dividing p (None: every layer at p).

        Raises:
            ValueError: config sizes not divisible by the TP size, a bad schedule or tp_degrees, or
                tp_degrees with vocab_parallel, sequence_parallel, offload or a group that is not the world.
            TypeError: offload neither a bool nor an oases.offload.Offloader, or tp_degrees not a list of ints.
        """
        super().__init__()
        _checks.one_of("schedule", schedule, SCHEDULES)
        distributed = dist.is_available() and dist.is_initialized()
        group = _checks.process_group(group)  # a 1-D DeviceMesh: its group
        self.tp = dist.get_world_size(group) if distributed else 1
        self.tp_rank = dist.get_rank(group) if distributed else 0
        for what, size in (("heads", config.heads), ("hidden * mlp_ratio", config.hidden * config.mlp_ratio)):
            if size % self.tp:
                raise ValueError(f"config.{what}: {size} is not divisible by the TP size {self.tp}")
        self.config, self.schedule, self.sequence_parallel = config, schedule, sequence_parallel
        if not isinstance(offload, (bool, Offloader)):
            raise TypeError(f"offload: expected a bool or an oases.offload.Offloader, got {type(offload).__name__}")
        degrees = None  # None: every layer at degree self.tp
        if tp_degrees is not None:  # every check before the subgroups are made
            degrees = check_tp_degrees(tp_degrees, config.layers, self.tp)
            for name, value in (
                ("vocab_parallel", vocab_parallel),
                ("sequence_parallel", sequence_parallel),
                ("offload", offload),
            ):
                refuse_with_degrees(name, value, fix=f"pass {name}=False (or tp_degrees=None)")
            check_world_group(self.tp)
        self._recompute_choices: dict = {}  # recompute="auto": by input shape (oases.schedule.budget)
        self.group = (group or dist.group.WORLD) if distributed else None  # never None at TP > 1
        record(self, Parallelism(self.group, self.tp))  # oases.nn.parallelism
        self.offloader = Offloader() if offload is True else (offload or None)  # both kept in the record
        self.comm = Communicator(self.group, self.tp)
        self.logits_group = self.group if vocab_parallel and self.tp > 1 else None
        if self.logits_group is not None:
            self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden, group=self.group)
        else:
            self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.layer_degrees: Optional[LayerDegrees] = None  # per-layer degrees: their placements and row groups
        where = [(self.tp, self.group)] * config.layers  # each block's (TP degree, TP group)
        if degrees is not None:  # collective: every rank of the world makes every subgroup
            self.layer_degrees = LayerDegrees.make(self.group, self.tp, self.tp_rank, degrees, where="blocks")
            where = [(at.degree, at.tp_group) for at in map(self.layer_degrees.placement, range(config.layers))]
        self.blocks = nn.ModuleList(
            nn.ModuleList([_Attention(config, 2 * i, d, g), _MLP(config, 2 * i + 1, d, g)])
            for i, (d, g) in enumerate(where)
        )
        if self.layer_degrees is not None:
            self.layer_degrees.hook_replica_sums(self.blocks)  # suspended while a schedule sums them itself
        self._layer_placements: Optional[LayerPlacements] = None  # made on first use (Communicators)
        self.norm_f = nn.LayerNorm(config.hidden)
        if self.logits_group is not None:
            self.lm_head = ColumnParallelLinear(config.hidden, config.vocab_size, bias=False, group=self.group)
        else:
            self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.reset_parameters(seed)
        record(self, dataclasses.replace(parallelism_of(self), layer_degrees=self.layer_degrees))

    @property
    def comm(self) -> Communicator:
        """The Communicator of the model's TP group, kept across steps in its Parallelism record
        (which oases.train_step reads); assigning one replaces it there."""
        return parallelism_of(self).comm

    @comm.setter
    def comm(self, comm: Communicator) -> None:
        record(self, dataclasses.replace(parallelism_of(self), comm=comm))

    @property
    def offloader(self) -> Optional[Offloader]:
        """The Offloader train_step offloads with (None: none), kept in the model's Parallelism record."""
        return parallelism_of(self).offloader

    @offloader.setter
    def offloader(self, offloader: Optional[Offloader]) -> None:
        record(self, dataclasses.replace(parallelism_of(self), offloader=offloader))

    @property
    def tp_degrees(self) -> Optional[tuple[int, ...]]:
        """The per-layer TP degrees (`self.layer_degrees.degrees`), or None: every layer at degree p."""
        return None if self.layer_degrees is None else self.layer_degrees.degrees

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise the full model from `seed` (GPT-2 style) and keep this rank's shards."""
        g = torch.Generator().manual_seed(seed)
        std_out = 0.02 / math.sqrt(2 * self.config.layers)
        rules = tp_rules(self)
        for name, p in self.named_parameters():
            shape, rule = list(p.shape), rules.get(name, (None,))[0]
            rank, size = self._shard_position(name)
            if rule is not None:
                shape = list(rule.full_shape(shape, size))
            if name.endswith("norm.weight") or name == "norm_f.weight":
                full = torch.ones(shape)
            elif name.endswith("bias"):
                full = torch.zeros(shape)
            else:
                std = std_out if name.endswith(("proj.weight", "fc2.weight")) and "blocks" in name else 0.02
                full = torch.randn(shape, generator=g) * std
            p.copy_(full if rule is None else rule.shard(full, rank, size))

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full model's tensor `name` (a parameter or its gradient)."""
        rule = tp_rules(self).get(name, (None,))[0]
        return full if rule is None else rule.shard(full, *self._shard_position(name))

    def _shard_position(self, name: str) -> tuple[int, int]:
        """(TP rank, TP size) of the parameter `name`: its block's degree with tp_degrees."""
        if self.tp_degrees is None or not name.startswith("blocks."):
            return self.tp_rank, self.tp
        degree = self.tp_degrees[int(name.split(".")[1])]
        return self.tp_rank % degree, degree

    # --- oases.schedule.Stack ---------------------------------------------------------------------

    takes_attention_mask = False  # every sequence is whole: no padding mask

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, t <= seq_len] -> wte(tokens) + wpe(positions 0..t-1), x [b, t, h]."""
        positions = self._positions(tokens)  # checked before wte's all-reduce
        return self.wte(tokens) + self.wpe(positions)

    def _positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """0..t-1 for tokens [b, t <= seq_len] (ValueError for another shape)."""
        if tokens.dim() != 2 or tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"tokens: expected [batch, t <= {self.config.seq_len}], got {tuple(tokens.shape)}")
        return torch.arange(tokens.shape[1], device=tokens.device)

    def embed(self, input_ids: torch.Tensor, where: SubBatch) -> tuple[torch.Tensor, SubBatch]:
        """input_ids [b, t] -> (embed_tokens(input_ids), `where` as the ctx)."""
        return self.embed_tokens(input_ids), where

    def embed_split(self, input_ids: torch.Tensor, where: SubBatch) -> Optional[EmbedSplit]:
        """With vocab_parallel, `embed` around wte's all-reduce (oases.schedule.protocol): wte's share
        on this rank, then (sum + wpe(positions), `where`); else None."""
        overridden = type(self).embed is not GPT.embed or type(self).embed_tokens is not GPT.embed_tokens
        if self.logits_group is None or overridden or not runs_as_partial(self.wte):
            return None  # (a subclass's own embed runs as it is, its all-reduce inside)
        positions = self._positions(input_ids)
        return EmbedSplit(self.wte.partial(input_ids), self.group, lambda summed: (summed + self.wpe(positions), where))

    def head_split(self, x: torch.Tensor, ctx: object = None) -> Optional[HeadSplit]:
        """With vocab_parallel, `head` around its input gradient's all-reduce (oases.schedule.protocol):
        norm_f(x), then this rank's vocabulary slice of the logits; else None."""
        if self.logits_group is None or type(self).head is not GPT.head:
            return None  # (a subclass's own head runs as it is, its all-reduce inside)
        return HeadSplit(self.norm_f(x), self.group, lambda h: F.linear(h, self.lm_head.weight))

    def layers(self) -> list[tuple[_Sublayer, ...]]:
        """Each block as its sublayers (attention, MLP)."""
        return [tuple(block) for block in self.blocks]

    def layer_placements(self) -> Optional[LayerPlacements]:
        """With tp_degrees: where each block runs for the schedules (oases.schedule.protocol), its
        Communicators made once and kept (one per distinct degree, one per replica group and per
        pair of neighbouring degrees); None without (every block on `self.comm`)."""
        if self.tp_degrees is None:
            return None
        if self._layer_placements is None:
            self._layer_placements = layer_placements(self.layer_degrees, self.blocks, comm_at_p=self.comm)
        return self._layer_placements

    def head(self, x: torch.Tensor, ctx: object = None) -> torch.Tensor:
        """Logits [b, t, vocab], or this rank's [b, t, vocab/p] with vocab_parallel."""
        if self.logits_group is None:
            return self.lm_head(self.norm_f(x))
        return F.linear(copy_to_tp(self.norm_f(x), self.group), self.lm_head.weight)

    # --- training -----------------------------------------------------------------------------------

    def train_step(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        *,
        dropout_seed: Optional[int] = None,
        sub_batches: Optional[int] = None,
        memory: Optional[RecomputeMemory] = None,
        check_inputs: CheckMode = True,
        recompute: Recompute = "auto",
        memory_budget: Optional[float] = None,
    ) -> torch.Tensor:
        """Forward and backward of the mean token loss (targets not shifted) on `self.schedule`.

        ::

            loss = mean over (i, j) with targets[i, j] != -100 of cross_entropy(logits[i, j], targets[i, j])
            .grad += d loss

        With dropout, masks come from `dropout_seed` (when None: drawn from the default generator
        of the group's first rank and broadcast, so every rank uses the same masks).

        With `tp_degrees` the same schedule runs each layer at its own degree (every sub-batch
        needs at least p / min(tp_degrees) rows); `loss = self(tokens, targets); loss.backward()`
        is the blocking form (no sub-batch overlap, no recomputation). `check_inputs`: the TP group
        agrees on tokens and targets first (True: ValueError on every rank where they differ;
        "broadcast": TP rank 0's; False: not checked; see oases.inputs). `recompute=False`: each
        sublayer's forward graph kept, no recomputation; "selective": kept saving only GEMM and
        attention outputs; a list: one of those per layer; "auto": each layer's chosen for
        `memory_budget` (oases.schedule.train_step, oases.schedule.budget).

        Args:
            tokens: the token ids [b, t] (int64).
            targets: each position's class index [b, t] (int64), not shifted.
            dropout_seed: the dropout masks' seed (None: drawn and broadcast, as above).
            sub_batches: how many parts the batch is split into (None: the schedule's own).
            memory: an oases.schedule.RecomputeMemory accounting the activations kept for recomputation
                (None: not accounted).
            check_inputs: True (the default), "broadcast" or False, as above.
            recompute: recompute each sublayer's forward in the backward (True), keep its graph (False),
                or keep it saving only GEMM and attention outputs ("selective"); a list, one per
                layer; or "auto".
            memory_budget: with recompute="auto", the rank's peak in bytes (None: the device's rule).

        Returns:
            The mean token loss (a scalar tensor); the gradients are accumulated into .grad.

        Raises:
            ValueError: targets' shape differs from tokens', a bad step argument, or, with
                check_inputs=True, tokens or targets that differ over the TP group.
        """
        tokens, targets = agree_tp_inputs(self, self.group, self.tp, check_inputs, tokens=tokens, targets=targets)
        if tokens.shape != targets.shape:
            raise ValueError(f"targets: shape {tuple(targets.shape)} differs from tokens' {tuple(tokens.shape)}")
        self._positions(tokens)  # the shape check of embed_tokens, before any communication
        options = StepOptions(
            self.schedule, sub_batches, self.sequence_parallel, recompute, memory_budget, self.offloader, memory
        )
        batch = options.check(tokens, targets, world_size=self.tp)
        placements = self.layer_placements()
        check_placed(self, batch, options, placements)
        seed = self.step_seed() if dropout_seed is None else dropout_seed
        return run_step(
            self,
            batch,
            options,
            loss_sum=self._loss_sum,
            normalizer=int((targets != IGNORE_INDEX).sum()),
            comm=self.comm,
            dropout_seed=seed if self.training and self.config.dropout > 0 else None,
            placements=placements,
            choices=self._recompute_choices,
        )

    def step_seed(self) -> Optional[int]:
        """The dropout seed of a training step (None without dropout): drawn from the default
        generator of the group's first rank and broadcast, the same on every rank (the replicated
        residual stream must see the same masks everywhere)."""
        if not (self.training and self.config.dropout > 0):
            return None
        seed = torch.randint(0, 2**31 - 1, (1,), device=self.wte.weight.device)
        if self.tp > 1:
            dist.broadcast(seed, dist.get_global_rank(self.group, 0), group=self.group)
        return int(seed)

    def forward(
        self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None, *, dropout_seed: Optional[int] = None
    ) -> torch.Tensor:
        """Logits [b, t, vocab] (or the mean loss with `targets`); differentiable at any TP size.

        ::

            x = embed(tokens)
            for each sublayer: x = x + finish(reduce_from_tp(core(copy_to_tp(norm(x)))))

        (copy_to_tp: identity, gradient all-reduced; reduce_from_tp: all-reduce, gradient
        identity). Dropout applies only with a `dropout_seed` (the masks `train_step` draws)."""
        x = self.embed_tokens(tokens)
        where = SubBatch(slice(0, tokens.shape[0]), tokens.shape[0], dropout_seed if self.training else None)
        if self.tp_degrees is not None:
            x = self._per_layer_blocks(x, where)
        else:
            for layer in self.layers():
                for s in layer:
                    h = s.norm(x)
                    if self.tp > 1:
                        x = x + s.finish(reduce_from_tp(s.core(copy_to_tp(h, self.group)), self.group), where)
                    else:
                        x = x + s.finish(s.core(h), where)
        if targets is not None:
            return self._loss_sum(self.head(x), targets) / (targets != IGNORE_INDEX).sum()
        if self.logits_group is not None:
            return gather_from_tp(self.head(x), self.group)
        return self.head(x)

    def _per_layer_blocks(self, x: torch.Tensor, where: SubBatch) -> torch.Tensor:
        """The blocks at their own degrees: x [B, t, h] (degree p) -> [B, t, h] (degree p).

        for block l at degree d:  x = reshard_rows(x, -> d)     # [~B d / p, t, h], this replica's rows
                                  x = x + finish(reduce_from_tp(core(copy_to_tp(norm(x)))))  # on its TP group
        x = reshard_rows(x, -> p)"""
        plan = self.layer_degrees
        plan.check_rows("tokens", x.shape[0])  # before any communication
        batch, degree = x.shape[0], self.tp
        for block, d in zip(self.blocks, plan.degrees):
            x, degree = plan.reshard_rows(x, degree, d, batch), d
            at = plan.placements[d]
            rows = SubBatch(at.rows(batch), batch, where.seed)  # dropout masks: this replica's rows
            for s in block:
                h = s.norm(x)
                if d > 1:
                    x = x + s.finish(reduce_from_tp(s.core(copy_to_tp(h, at.tp_group)), at.tp_group), rows)
                else:
                    x = x + s.finish(s.core(h), rows)
        return plan.reshard_rows(x, degree, self.tp, batch)

    def _loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy: logits [b, t, vocab] (or the vocab slice), targets [b, t] (not shifted)."""
        if self.logits_group is not None:
            return vocab_parallel_cross_entropy(
                logits.flatten(0, 1), targets.flatten(), self.group, ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
