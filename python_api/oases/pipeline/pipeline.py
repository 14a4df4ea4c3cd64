"""`Pipeline`: a model trained with pipeline x data x tensor parallelism on a (dp, pp, tp) device mesh.

    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(config, mesh, schedule="aiao", segments=2, micro_batches=4,   # a GPTConfig, or
                                                      # a factory: lambda: LlamaForCausalLM(cfg)
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), seed=0,
                    dp_overlap_ratio=1.0, preemption=True)
    loss = pipe.train_step(tokens, targets)   # global batch [B, t], the same on every rank
    loss = pipe.eval_step(tokens, targets)    # the same batch's loss, forwards only, in eval mode
    state = pipe.state_dict()                 # applies pending updates; the full model's state dict, on every rank
    pipe.load_pretrained(dir) / pipe.save_pretrained(dir)       # Hugging Face safetensors, each stage its part
    pipe.save_checkpoint(root, step=n, keep=2) / pipe.load_checkpoint(root)   # DCP, optimizers included

One step, on the rank at (d, s, t) of the mesh:

    rows = B / dp; block = tokens[d*rows : (d+1)*rows]          # this DP rank's rows
    micro-batches = block split into m near-equal row ranges (sizes differ by at most one)
    seed = the step's dropout seed (None without dropout)       # the same on this replica's ranks
    sync.launch_deferred()                                      # last step's deferred DP buckets
    for action in schedules.actions(schedule, stage=s, ...):    # F(k, i) / B(k, i)
        first F of segment k: sync.wait(k); optimizer[k].step(); zero grads   # last step's update
                 (max_grad_norm c: before the first, every sync waited for and every gradient
                  scaled by min(1, c / (norm of the whole model's gradient + 1e-6)))
        post the receive the next action needs                  # PPComm: one action ahead
        F(k, i): x = recv act (or embed(tokens)); y = layers of (k, s) on x   # ctx: SubBatch(rows of B, seed)
                 last virtual stage: loss_i = loss_sum(head(y), targets_i) / N else send y
                 (N: the global batch's targets that are not -100, IGNORE_INDEX: no loss there)
        B(k, i): g = recv grad (or 1 for loss_i); backward(y, g); send x.grad (unless first)
        last B of segment k: sync.launch(k)                     # DPComm: sum over dp, async
    first and last stage, tied embedding / head W: W.grad += other copy's; sync.launch(W)
    return sum over dp and micro-batches of loss_i              # broadcast from the last stage

Dividing each micro-batch's summed token loss by the *global* count N of tokens with a target
makes the sum of the DP ranks' gradients the single-process gradient of the mean loss: the DP
sync is a plain sum.

Dropout (a model in training mode with dropout > 0): each micro-batch's SubBatch carries the step's
seed and its rows of the global batch, and every branch draws its masks from streams seeded by
them and by its layer (oases.models._dropout_streams: the TP group's stream on replicated activations,
each rank's own on its heads and features; oases.models.GPT: one residual mask over the global
batch, sliced), so the recomputation of each checkpointed (or offloaded) layer in B(k, i) redraws
the masks of F(k, i). The seed (Pipeline._step_seed) is the same on every stage and TP rank of a
DP replica. eval_step runs in eval mode, without dropout.

Per-segment DP sync (FOLD3D Algorithm 2, DPComm; oases.pipeline.dp_sync): a segment's gradients
start reducing over dp on this rank's DP thread as soon as its backward is over for every
micro-batch, while the segments below it run their backward (aiao: segments finish one after
another from the last; gpipe / 1f1b with ns = 1: one segment, at the end). `dp_overlap_ratio` of
its buckets start then, the rest at the next train_step, under its forwards. Each segment has
its own optimizer (`optimizer(segment's parameters)`), stepped right before the segment's next
forward, after its sync: bulk synchronous, so parameters and losses are those of sequential
training; only *when* the step of iteration n is applied moves (into iteration n + 1, or
`state_dict()`, which applies every pending update first).

    aiao, ns = 2, pp = 2, stage 0, r = 1     time ->
    compute : .. F⁰ F¹ | B¹ (all i) | B⁰ (all i) |  wait⁰ step⁰ F⁰ (all i) | wait¹ step¹ F¹ ...
    DP      :                       | sync seg 1 | sync seg 0 ......|
    PP      : PP transfers preempt DP chunks (oases.pipeline.comm_scheduler)

Tied input/output embeddings (oases.pipeline.tied): the first stage (embedding) and the last
(head) each hold a copy of the weight, trained by the segment that places it (0 there, ns - 1
here). At the end of each step the pair of ranks holding it at the same (dp, tp) position sums
the copies' gradients (a group of two), then the weight's own DP bucket starts; that segment's
optimizer step waits for both. Both copies take the single-process step, bit-identical to each
other. With pp = 1, one copy, trained by segment 0.

ZeRO-1 (`zero=True`, oases.pipeline.zero_sync): the sync of segment k reduce-scatters its gradient
rows (each dp rank receives the sum of its 1/dp of every parameter's rows), optimizer[k] steps
those rows only, and the rows are all-gathered back into the parameters in chunks under the
same gate, before segment k's next forward (segment k+1's step and all-gather run when segment
k's forwards start, overlapping them).

Preemptive communication (FOLD3D §5.1): `pipe.scheduler` (a CommScheduler) tracks every PP
send / receive; with `preemption=True` a DP chunk is held back while one is in flight. Its
counters: `deferred_chunks`, `pp_latency`, ... (see oases.pipeline.comm_scheduler).

The parts of a Pipeline: its argument checks in oases.pipeline._config (dp_hierarchy's in _hierarchy),
the segments / dp_overlap_ratio "auto" choice in _autotune, one step's actions in _execute, the
per-segment optimizers, syncs and updates in _updates, the model's build in _build, storage in _storage.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import OrderedDict
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from oases.amp import GradScaler
from oases.checkpoint import CheckpointState
from oases.inputs import CheckMode, agree_mesh_inputs
from oases.models._dropout_streams import draw_step_seed, dropout_in
from oases.models.gpt import GPTConfig
from oases.models.hf import HFStack
from oases.models.nanogpt import NanoGPTStack
from oases.offload import Offloader, OffloadStats
from oases.pipeline import _execute, _storage
from oases.pipeline._autotune import retune
from oases.pipeline._build import build
from oases.pipeline._config import MESH_DIMS, _sgd, check_arguments, check_batch, mesh_device, model_device
from oases.pipeline._config import check_backend as _check_backend
from oases.pipeline._execute import Step, action_marks
from oases.pipeline._hierarchy import dp_host_groups, hierarchy_is_faster
from oases.pipeline._layout import check_layers
from oases.pipeline._updates import apply_update, make_optimizers, make_sync, sum_tied, sync_parameters, sync_segment
from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import CHUNK_BYTES
from oases.pipeline.p2p import StageComm, make_links
from oases.pipeline.schedules import Action, actions
from oases.pipeline.stages import Stage, StageLayout
from oases.pipeline.tied import pair_group

# register_action_wrapper's callable: wrapper(action, run), run() computing the action
ActionWrapper = Callable[[Action, Callable[[], None]], None]

__all__ = ["Pipeline"]

_BUCKET_NUMEL = 1 << 22  # elements per flat gradient bucket of the DP sync (16 MiB in fp32)


class Pipeline:
    """A model cut into pp stages (ns segments each), replicated dp times, each stage TP-sharded tp ways.

    One train_step is the pseudo-code of this module's docstring (oases.pipeline.pipeline); the
    constructor's Args list the arguments.
    `segments="auto"` and `dp_overlap_ratio="auto"` are chosen by FOLD3D's rules
    (oases.planner.fold3d: choose_segments, dp_overlap_ratio) from times measured on the first
    train_step's batch, before it runs (`self.measured` keeps them; the same on every rank)::

        forward_s, backward_s = one layer's forward / backward (with recomputation) on micro-batch 0,
                                times this stage's layers (MAX over ranks)
        dp_comm_s  = this stage's gradient sync over dp (a ring all-reduce of one bucket, scaled)
        pp_comm_s  = one activation between neighbouring stages (a ring exchange over pp)

    Every argument's contract (factories and meta builds, the per-segment optimizer, offload,
    preemption, dp_hierarchy, zero, loss_scaler, "auto", close()): the pipeline guide
    (docs/guides/pipeline.md, section "The Pipeline class: arguments and contracts").
    """

    def __init__(
        self,
        config: GPTConfig | Callable[[], nn.Module],
        mesh,
        *,
        schedule: str = "1f1b",
        segments: int | str = 1,
        micro_batches: int = 4,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _sgd,
        seed: int = 0,
        dp_overlap_ratio: float | str = 1.0,
        preemption: bool = True,
        dp_bucket_numel: int = _BUCKET_NUMEL,
        dp_chunk_bytes: int = CHUNK_BYTES,
        offload: bool | Offloader = False,
        dp_hierarchy: bool | str = False,
        init_weights: bool = True,
        zero: bool = False,
        loss_scaler: Optional[GradScaler] = None,
        max_grad_norm: Optional[float] = None,
    ) -> None:
        """Build this rank's part of the pipeline (each argument's contract: the pipeline guide).

        Args:
            config: an oases.models.GPTConfig, or a factory: a callable returning the unsharded model.
            mesh: a device mesh with dimensions named ("dp", "pp", "tp") over every rank.
            schedule: "gpipe", "1f1b" (the default: segments=1, micro_batches >= pp) or "aiao".
            segments: segments per stage (default 1), or "auto" (FOLD3D's rule; one segment unless aiao).
            micro_batches: how many micro-batches each DP rank's rows are split into (default 4).
            optimizer: `optimizer(params)` builds one segment's optimizer (default: SGD with lr=0.1).
            seed: the seed the parameters start from (default 0).
            dp_overlap_ratio: r in [0, 1], the share of a segment's buckets synced as its backward ends
                (default 1.0), or "auto".
            preemption: PP transfers hold back DP sync chunks (default True).
            dp_bucket_numel: elements per flat gradient bucket (default `2**22`).
            dp_chunk_bytes: the most one DP ring piece moves (default `2**18`).
            offload: True or an oases.offload.Offloader: per-layer recompute inputs go to host memory
                (default False: they stay).
            dp_hierarchy: two-level DP rings: True, "auto", or False (the default: the flat ring).
            init_weights: a factory building on meta: give its tensors the single-process build's values
                (False: leave them for `load_pretrained` / `load_checkpoint`).
            zero: ZeRO-1 over dp (default False).
            loss_scaler: an oases.amp.GradScaler, for fp16 (default None: no loss scaling).
            max_grad_norm: clip each update's gradient by the whole model's 2-norm, as
                `torch.nn.utils.clip_grad_norm_` on the single-process model (default None: no clipping);
                the norm is kept in `grad_norm` when the update is applied.

        Raises:
            ValueError: a bad argument (naming it), on every rank before any communication.
            TypeError: init_weights or zero not a bool, offload neither a bool nor an Offloader, or
                loss_scaler not a GradScaler.
        """
        checked = check_arguments(
            config,
            mesh,
            schedule=schedule,
            segments=segments,
            micro_batches=micro_batches,
            dp_overlap_ratio=dp_overlap_ratio,
            dp_bucket_numel=dp_bucket_numel,
            dp_chunk_bytes=dp_chunk_bytes,
            init_weights=init_weights,
            zero=zero,
            loss_scaler=loss_scaler,
            dp_hierarchy=dp_hierarchy,
            offload=offload,
            max_grad_norm=max_grad_norm,
        )
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        self.grad_norm: Optional[torch.Tensor] = None  # the last applied update's gradient norm (max_grad_norm)
        self._prepared = False  # this step's pending gradients unscaled and clipped
        self.zero = zero
        self._dp_links = checked.dp_links
        self.config, self.schedule, self.micro_batches = config, schedule, micro_batches
        self.dp_group, self.pp_group, self.tp_group = (mesh.get_group(name) for name in MESH_DIMS)
        self.dp, self.pp = dist.get_world_size(self.dp_group), dist.get_world_size(self.pp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.mesh = mesh
        self.model, self._stack, self._roles = build(
            config,
            self.tp_group,
            checked.sizes["tp"],
            seed,
            device=mesh_device(mesh),
            init_weights=init_weights,
            pp=self.pp,
            segments=segments,
            stage=dist.get_rank(self.pp_group),
        )
        device = model_device(self.model)
        _check_backend(self.pp_group, device)
        # the model drops in training (a GPTConfig's dropout, a dropout module or rate above 0): each
        # train_step in training mode then draws a seed for its masks (_step_seed)
        self._dropout = config.dropout > 0 if isinstance(config, GPTConfig) else bool(dropout_in(self.model))
        if loss_scaler is not None:  # its scale lives on this device on every stage, not only where the loss is
            loss_scaler.scale(torch.zeros((), device=device))
        self._layers = len(self._stack.layers())
        self._make_optimizer, self._bucket_numel, self._chunk_bytes = optimizer, dp_bucket_numel, dp_chunk_bytes
        self._auto = {
            "segments": segments == "auto" and schedule == "aiao",  # the rule models aiao's overlap
            "dp_overlap_ratio": dp_overlap_ratio == "auto",
        }
        self.measured: Optional[dict[str, float]] = None  # the times "auto" was chosen from
        self.offloader: Optional[Offloader] = Offloader() if offload is True else (offload or None)
        self.offload_stats: Optional[OffloadStats] = None  # the last train_step's (with offload)
        self._anchor = torch.empty(0, requires_grad=True)  # offload: what received inputs hang from
        self._failed: Optional[BaseException] = None  # a step that raised mid-way (its links are out of order)
        # register_action_wrapper's, by handle id (an OrderedDict: RemovableHandle keeps a weak reference)
        self._action_wrappers: OrderedDict[int, ActionWrapper] = OrderedDict()
        self.scheduler = CommScheduler(preemption=preemption)
        self.comm = StageComm(make_links(mesh, device), dist.get_rank(self.pp_group), self.pp, self.scheduler, device)
        self.dp_hierarchy = dp_hierarchy
        self._dp_hosts = None if checked.dp_packing is None else dp_host_groups(mesh, checked.dp_packing)  # collective
        self._configure(1 if segments == "auto" else segments, 1.0 if dp_overlap_ratio == "auto" else dp_overlap_ratio)
        # Tied embedding / head over pp > 1: this rank's group with the other copy (None on middle
        # stages); collective over the world, once (stage.tied is the same on every rank).
        self._tied_group = pair_group(mesh) if self.pp > 1 and self.stage.tied else None
        self.freed_bytes = 0  # parameters of other stages released (once the layout is final)
        if not any(self._auto.values()):
            self.freed_bytes = self.stage.release_unowned()

    def _configure(self, segments: int, dp_overlap_ratio: float) -> None:
        """Everything that depends on the segment count and r: layout, stage, optimizers, actions, sync."""
        check_layers("config" if isinstance(self.config, GPTConfig) else "model", self._layers, self.pp, segments)
        self.segments, self.dp_overlap_ratio = segments, dp_overlap_ratio
        stage = dist.get_rank(self.pp_group)
        self.layout = StageLayout(self._layers, self.pp, segments, stage)
        self.stage = Stage(self.model, self._stack, self.layout, self.tp_group, roles=self._roles)
        segment_params = [self.stage.segment_parameters(k) for k in range(segments)]
        # A segment with nothing to train (frozen layers) gets no optimizer from torch: agreed over the
        # stages first, so that every rank raises alike rather than one, leaving the others waiting.
        empty = torch.tensor([sum(1 for params in segment_params if not params)], device=self.comm.device)
        if self.pp > 1:
            dist.all_reduce(empty, op=dist.ReduceOp.MAX, group=self.pp_group)
        if int(empty):
            error = ValueError(
                f"model: a segment of a pipeline stage has no parameter that requires grad (frozen layers: "
                f"pp = {self.pp}, segments = {segments}); every (stage, segment) needs one for its optimizer. Freeze "
                f"fewer layers, or use fewer stages or segments (not segments='auto'), so that each holds a "
                f"trainable parameter"
            )
            if hasattr(self, "optimizers"):  # segments='auto' reconfiguring in train_step: half changed, unusable
                self._failed = error
            raise error
        self.optimizers = make_optimizers(segment_params, self._make_optimizer, zero=self.zero, dp_group=self.dp_group)
        # A copy of a tied embedding / head (pp > 1, first or last stage): trained by segment
        # _tied_home, its gradient summed with the other copy's and then over dp as sync segment ns.
        self._tied_home = self.stage.tied_segment() if self.pp > 1 else None
        self._tied = self.stage.tied if self._tied_home is not None else []
        sync_params = sync_parameters(segment_params, self._tied)
        self.actions: list[Action] = actions(
            self.schedule, stage=stage, stages=self.pp, segments=segments, micro_batches=self.micro_batches
        )
        self.comm.expect(self.schedule, segments, self.micro_batches)  # each link's arrivals, in send order
        # Offload: what to prefetch during B(k, i); where each segment's first forward and last backward sit.
        self._next_backward, self._first_forward, self._last_backward = action_marks(self.actions, segments)
        # Two-level DP rings: always with dp_hierarchy=True; with "auto" where the planner says so.
        self.dp_hierarchical = self._dp_hosts is not None and (
            self._dp_links is None
            or hierarchy_is_faster(sync_params, self._bucket_numel, self._dp_hosts, self._dp_links)
        )
        self.sync = make_sync(
            sync_params,
            self.dp_group,
            self.scheduler,
            self.optimizers,
            zero=self.zero,
            overlap_ratio=dp_overlap_ratio,
            bucket_numel=self._bucket_numel,
            chunk_bytes=self._chunk_bytes,
            hosts=self._dp_hosts if self.dp_hierarchical else None,
        )
        self._update_pending: set[int] = set()  # segments whose optimizer step is not applied yet
        self._update_hyper: dict[int, list[dict]] = {}  # their optimizers' hyper-parameters when they became pending

    # --- one step -------------------------------------------------------------------------------

    @property
    def plan(self) -> list[Action]:
        """Deprecated name of `actions` (this stage's actions in order); "plan" is the planner's word."""
        warnings.warn("Pipeline.plan is deprecated: use Pipeline.actions", DeprecationWarning, stacklevel=2)
        return self.actions

    def train_step(
        self, tokens: torch.Tensor, targets: torch.Tensor, *, check_inputs: CheckMode = True
    ) -> torch.Tensor:
        """One optimizer step on the global batch (tokens, targets [B, t], the same on every rank);
        returns the mean token loss of the whole batch, the same on every rank (see the module doc).
        `check_inputs` (oases.inputs): True checks first that every rank of the mesh got the same
        batch (one all_gather of a summary; ValueError on every rank otherwise), "broadcast" uses
        rank 0's, False skips it. A model in training mode with dropout draws its masks from the
        step's seed (one default-generator draw per step; see the module doc).

        Args:
            tokens: the global batch's token ids [B, t] (int64), the same on every rank.
            targets: each position's class index [B, t] (int64), not shifted; -100 (IGNORE_INDEX):
                no loss there (padding, prompt tokens), the loss the mean over the other positions.
            check_inputs: True (the default), "broadcast" or False, as above.

        Returns:
            The mean token loss of the whole batch (a scalar tensor), the same on every rank.

        Raises:
            ValueError: a bad batch (shapes, dtypes, values, B not divisible by dp, fewer rows per DP
                rank than micro-batches), or, with check_inputs=True, batches that differ over the mesh;
                a model with dropout in training mode that was built in eval mode.
            RuntimeError: an earlier step failed mid-way (build a new Pipeline), or gradients are disabled.
        """
        if self._failed is None and not torch.is_grad_enabled():  # local: every rank alike, before any message
            raise RuntimeError(
                "train_step: called with gradients disabled (under torch.no_grad() or inference_mode()); it runs "
                "backwards: call it outside no_grad (or use eval_step for a loss without training)"
            )
        if self._failed is None:
            self._check_dropout()  # local: every rank alike, before any message
        step = self._checked_step("train_step", tokens, targets, check_inputs)
        step.seed = self._step_seed()  # dropout: every micro-batch's masks (and their recomputation's)
        if any(self._auto.values()):
            self._choose(step)
        self.sync.launch_deferred()  # the last step's deferred buckets overlap the forwards up to them
        if self.layout.stage == 0 and self.segments > 1:  # lazy inter-segment receives land in the slab
            self.comm.reserve_lazy(step.shapes, step.dtype, self.segments)
        if self.offloader is not None:
            self.offloader.begin_step()
        try:
            _execute.run_actions(self, step)  # each receive posted one ahead; each segment's DP sync launched
            sum_tied(self)
        except BaseException as error:  # receives may still be posted: the links' order is lost
            self._failed = error
            raise
        if self.offloader is not None:
            self.offload_stats = self.offloader.end_step()  # the first step also sizes its HostSlab
        return self._global_loss(step.loss, step.loss_sum)

    def eval_step(self, tokens: torch.Tensor, targets: torch.Tensor, *, check_inputs: CheckMode = True) -> torch.Tensor:
        """The mean token loss of the global batch under the current parameters, without training:
        the single-process `model.eval()` loss under `torch.no_grad()`, the same on every rank.

        ::

            apply every pending update (as state_dict() does)
            every module in eval mode (dropout off); under no_grad:
                for segment k, micro-batch i: F(k, i) as train_step's, nothing kept for a backward
            loss = sum over dp and micro-batches of loss_i           # broadcast from the last stage
            every module's training mode restored

        Args and Raises: as train_step's (tokens, targets [B, t], the same on every rank); it may
        be called with gradients disabled. A collective over the mesh.
        """
        step = self._checked_step("eval_step", tokens, targets, check_inputs)
        self._apply_pending()  # the parameters of now
        modes = {module: module.training for module in self.model.modules()}
        self.comm.expect(self.schedule, self.segments, self.micro_batches, forward_only=True)
        try:
            if self.layout.stage == 0 and self.segments > 1:
                self.comm.reserve_lazy(step.shapes, step.dtype, self.segments)
            self.model.eval()
            with torch.no_grad():
                _execute.run_forwards(self, step)
        except BaseException as error:  # receives may still be posted: the links' order is lost
            self._failed = error
            raise
        finally:
            for module, training in modes.items():
                module.training = training
        self.comm.expect(self.schedule, self.segments, self.micro_batches)  # train_step's arrivals again
        return self._global_loss(step.loss, step.loss_sum)

    def _checked_step(self, name: str, tokens: torch.Tensor, targets: torch.Tensor, check_inputs: CheckMode) -> Step:
        """`name`'s checks (a failed earlier step, the batch: the same on every rank), then this DP
        rank's micro-batches."""
        if self._failed is not None:
            raise RuntimeError(
                f"{name}: an earlier step failed mid-way (see the cause), leaving messages posted "
                "on the pipeline's links, which match in order; build a new Pipeline"
            ) from self._failed
        tokens, targets = self._agree_inputs(check_inputs, tokens, targets)
        check_batch(
            tokens,
            targets,
            seq_len=self.config.seq_len if isinstance(self.config, GPTConfig) else None,
            vocab=self.stage.vocab_size,
            dp=self.dp,
            micro_batches=self.micro_batches,
        )
        return self._split(tokens, targets)

    def _check_dropout(self) -> None:
        """A Hugging Face or nanoGPT model built in eval mode (from_pretrained) was adapted without its
        dropout (oases.models.HFStack: each branch's masks and biases placed for a training step);
        refuse to train it with its dropout back on."""
        stack = self._stack
        if self._dropout and self.model.training and isinstance(stack, (HFStack, NanoGPTStack)) and not stack.dropout:
            name, p = dropout_in(self.model)[0]
            raise ValueError(
                f"train_step: the model has dropout {p} ({name}) and is in training mode, but it was in eval "
                "mode when the pipeline was built (from_pretrained returns it so), so its layers were set up "
                "without dropout; call model.train() in the factory, or keep the model in eval mode "
                "(no dropout) or set its dropout to 0"
            )

    def _step_seed(self) -> Optional[int]:
        """The step's dropout seed, or None (the model has no dropout, or is in eval mode).

        ::

            seed = randint(2**31 - 1)        # the default generator, on every rank (each advances alike)
            broadcast over pp, then over tp  # every rank of this DP replica: its (stage 0, TP rank 0)'s

        Every stage uses it (the masks are keyed by layer, sublayer, branch and the micro-batch's
        rows of the global batch: oases.models._dropout_streams.DropoutStreams); each TP group shares it,
        so replicated activations see one mask and each rank's heads their own stream. DP replicas
        are not broadcast to: a collective over dp could meet the previous step's DP syncs in flight
        on that group, and none is needed, since each replica's micro-batches are different rows of
        the global batch, keyed apart. Replicas whose default generators agree (torch.manual_seed(s)
        on every rank) draw the same seed anyway; the masks then depend on the micro-batches' rows
        alone, not on dp."""
        if not (self._dropout and self.model.training):
            return None
        return draw_step_seed(self.comm.device, (self.pp_group, self.tp_group))

    def _agree_inputs(
        self, check_inputs: CheckMode, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """oases.inputs' check of the batch over the mesh (a collective): an attribute, so that a
        benchmark may time it."""
        return agree_mesh_inputs(check_inputs, self.comm.device, tokens=tokens, targets=targets)

    def _choose(self, step: Step) -> None:
        """segments / dp_overlap_ratio "auto": measure (see the class doc), choose, reconfigure
        (oases.pipeline._autotune)."""
        self.measured, (segments, ratio) = retune(self, step)
        self._auto = {key: False for key in self._auto}
        if (segments, ratio) != (self.segments, self.dp_overlap_ratio):
            self._configure(segments, ratio)
        self.freed_bytes = self.stage.release_unowned()

    def _apply_pending(self) -> None:
        """Every segment's pending update (a collective over dp where one is pending), outside
        inference mode whatever the caller's: optimizer state made there would be inference
        tensors, which the next step could not update in place."""
        with torch.inference_mode(False):
            for k in range(self.segments):
                self._apply_update(k)

    def _apply_update(self, segment: int) -> None:
        """Segment `segment`'s pending optimizer step, before its forward (oases.pipeline._updates)."""
        apply_update(self, segment)

    def _split(self, tokens: torch.Tensor, targets: torch.Tensor) -> Step:
        """This DP rank's contiguous block of rows, cut into micro-batches of near-equal rows."""
        return _execute.split(self, tokens, targets)

    def register_action_wrapper(self, wrapper: "ActionWrapper") -> RemovableHandle:
        """Run every action of this stage's steps through `wrapper` (tracing, timing, fault injection).

        ::

            each action of train_step:  wrapper(action, run)   # run(): the action itself (eval_step's: not wrapped)
            several wrappers: the first registered outermost; handle.remove() unregisters

        `action` is the schedule's F(k, i) / B(k, i) (oases.pipeline.Action: kind, segment,
        micro-batch); `run()` computes it (its receive already posted, its send issued inside) and
        must be called exactly once: a RuntimeError otherwise. An exception a wrapper raises (that
        one included) fails the step as the action's own would (the next step refuses to run, see
        train_step).
        """
        if not callable(wrapper):
            raise TypeError(f"wrapper: expected a callable wrapper(action, run), got {type(wrapper).__name__}")
        handle = RemovableHandle(self._action_wrappers)
        self._action_wrappers[handle.id] = wrapper
        return handle

    def _run(self, action: Action, step: Step) -> None:
        """One action of the step (oases.pipeline._execute.run), through the registered wrappers;
        RuntimeError when they did not run it exactly once (the step then fails, see train_step)."""
        if not self._action_wrappers:
            _execute.run(self, action, step)
            return
        runs = 0

        def run() -> None:
            nonlocal runs
            runs += 1
            if runs > 1:
                raise RuntimeError(f"register_action_wrapper: a wrapper called run() of {action!r} twice")
            _execute.run(self, action, step)

        call: Callable[[], None] = run
        for wrapper in reversed(list(self._action_wrappers.values())):
            call = functools.partial(wrapper, action, call)
        call()
        if runs == 0:
            raise RuntimeError(
                f"register_action_wrapper: no wrapper called run() of {action!r}: each must call it once"
            )

    def sync_segment(self, segment: int) -> None:
        """Sum segment `segment`'s gradients of this stage over dp now, blocking (in place).

        ::

            for bucket in flat buckets of [p.grad for p in stage.segment_parameters(segment)]:
                ring reduce-scatter + all-gather over dp_group      # sum: the loss is already / N

        train_step does the same asynchronously (launch after the segment's backward, wait before
        its next forward); this is the plain blocking form of it, for gradients made outside
        train_step. The segment that trains a copy of a tied embedding / head (first stage:
        segment 0, last stage: ns - 1) also sums it with the other copy's gradient, then over dp
        (a collective with that stage: call sync_segment for every segment, in one order, on
        every rank).
        After a train_step, its own sync of the segment is pending: RuntimeError. With zero=True
        the gradients are reduce-scattered into the optimizers' rows, not summed in place: RuntimeError."""
        sync_segment(self, segment)

    def _global_loss(self, loss: torch.Tensor, summed: Optional[dist.Work]) -> torch.Tensor:
        """Sum of the last stage's micro-batch losses over dp (`summed`: that all-reduce, started by
        run_actions on the last stage; None elsewhere), broadcast over pp to every stage."""
        if summed is not None:
            summed.wait()
        if self.pp > 1:
            dist.broadcast(loss, dist.get_global_rank(self.pp_group, self.pp - 1), group=self.pp_group)
        return loss

    # --- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys, order and shapes of the unsharded model's), on every rank.

        ::

            mine = this stage's entries of oases.full_state_dict(model)   # gathered over tp
            every stage's = all_gather_object(mine on the CPU, pp_group)  # merged, in the model's key order
            each tensor then on this rank's device

        Applies every pending update first (waits for its DP sync, steps its optimizer). A
        collective over the whole mesh (every rank calls it)."""
        self._apply_pending()
        mine = self.stage.state_dict()
        parts: list[Optional[dict[str, torch.Tensor]]] = [None] * self.pp
        if self.pp > 1:  # pickled on the CPU: a CUDA tensor would unpickle onto its sender's GPU
            dist.all_gather_object(parts, {key: value.cpu() for key, value in mine.items()}, group=self.pp_group)
        else:
            parts[0] = mine
        merged = {key: value for part in parts for key, value in part.items()}
        return {key: merged[key].to(self.comm.device) for key in self.stage.key_order}

    # --- storage (oases.pipeline._storage) -------------------------------------------------------

    def load_pretrained(self, path: str | os.PathLike, *, strict: bool = True) -> tuple[list[str], list[str]]:
        """Fill the tensors this rank holds from a Hugging Face safetensors directory (each rank reads
        only its boxes), checked against the whole model on every rank first; returns the whole
        model's (missing_keys, unexpected_keys). No communication unless an update is pending."""
        return _storage.load_pretrained(self, path, strict=strict)

    def save_pretrained(self, path: str | os.PathLike, *, max_shard_size: int = 5 * 2**30) -> None:
        """Write the unsharded model as a Hugging Face directory: rank 0 writes, each stage sends its
        tensors to it one at a time. A collective over the mesh; applies pending updates first."""
        _storage.save_pretrained(self, path, max_shard_size=max_shard_size)

    def save_checkpoint(
        self, path: str | os.PathLike, *, step: Optional[int] = None, extra: object = None, keep: Optional[int] = None
    ) -> str:
        """oases.save_checkpoint of the whole pipeline (every segment's optimizer too), each rank
        writing only what it holds, into path (path/step-{step:09d} with step; keep=N: the N newest
        stay); extra: anything picklable. Returns the directory published. A collective over the mesh."""
        return _storage.save_checkpoint(self, path, step=step, extra=extra, keep=keep)

    def load_checkpoint(
        self, path: str | os.PathLike, *, step: Optional[int] = None, verify: bool = True, trusted: bool = True
    ) -> CheckpointState:
        """Load a checkpoint of this model (from any Pipeline layout, or oases.save_checkpoint of a
        TP model) into this stage's tensors and optimizers. A collective over the mesh. As
        oases.load_checkpoint: a root loads its newest step that verifies on every rank (newer
        damaged ones skipped, one warning); `step=N` exactly path/step-N or a ValueError naming
        the file; `verify=False` skips the checksums (sizes are still checked); `trusted=False`
        runs no pickle (DCP's metadata records and plain data only)."""
        return _storage.load_checkpoint(self, path, step=step, verify=verify, trusted=trusted)

    def close(self) -> None:
        """Apply every pending update (every rank calls it, as its DP sync is collective over dp),
        then end the scheduler's threads; a later train_step starts new ones."""
        if self._failed is None:
            self._apply_pending()
        self.scheduler.close()
        if self.offloader is not None:
            self.offloader.close()
