"""`Pipeline`: a model trained with pipeline x data x tensor parallelism on a (dp, pp, tp) device mesh.

    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(config, mesh, schedule="aiao", segments=2, micro_batches=4,   # config: a GPTConfig or a factory
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

Dropout (a model in training mode with dropout > 0): every micro-batch's masks are drawn from the
step's seed and its rows of the global batch, so recomputation redraws them (oases.pipeline._dropout).

Per-segment DP sync (FOLD3D Algorithm 2, DPComm) and optimizers, tied embedding / head copies and
ZeRO-1: oases.pipeline._updates (its timeline too). Bulk synchronous: parameters and losses are those
of sequential training; only *when* step n's update is applied moves (into step n + 1, or `state_dict()`).

Preemptive communication (FOLD3D §5.1): `pipe.scheduler` (a CommScheduler) tracks every PP transfer;
with `preemption=True` a DP chunk waits while one is in flight (oases.pipeline.comm_scheduler).

The parts of a Pipeline (oases.pipeline.*), each owning its state; the Pipeline composes them::

    Settings  _config    the checked arguments, frozen (dp_hierarchy's checks in _hierarchy)
    Stage     stages     this rank's layers of the model and its StageLayout (rebuilt when "auto" chooses)
    Updates   _updates   per-segment optimizers, DP sync, pending updates, loss scaling, clipping
    Executor  _execute   one step's actions, the action and phase wrappers, where each segment's updates go
    and       _autotune ("auto"), _build (the model), _dropout (each step's seed), _storage
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from oases.amp import GradScaler
from oases.inputs import CheckMode, agree_mesh_inputs
from oases.models.gpt import GPTConfig
from oases.offload import Offloader, OffloadStats
from oases.pipeline import _storage
from oases.pipeline._autotune import retune
from oases.pipeline._build import build
from oases.pipeline._config import MESH_DIMS, _sgd, check_arguments, check_batch, mesh_device, model_device
from oases.pipeline._config import check_backend as _check_backend
from oases.pipeline._dropout import StepDropout
from oases.pipeline._execute import ActionWrapper, Executor, Step
from oases.pipeline._hierarchy import dp_host_groups
from oases.pipeline._layout import check_layers
from oases.pipeline._updates import Updates, frozen_segment
from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import CHUNK_BYTES, SegmentSync
from oases.pipeline.p2p import StageComm, make_links
from oases.pipeline.schedules import Action
from oases.pipeline.stages import Stage, StageLayout
from oases.pipeline.tied import pair_group
from oases.storage import CheckpointState

__all__ = ["Pipeline"]

_BUCKET_NUMEL = 1 << 22  # elements per flat gradient bucket of the DP sync (16 MiB in fp32)


class Pipeline:
    """A model cut into pp stages (ns segments each), replicated dp times, each stage TP-sharded tp ways.

    One train_step is the pseudo-code of this module's docstring (oases.pipeline.pipeline); the
    constructor's Args list the arguments. `segments="auto"` and `dp_overlap_ratio="auto"` are chosen
    by FOLD3D's rules (oases.planner.fold3d) from times measured on the first train_step's batch, before
    it runs (oases.pipeline._autotune; `self.measured` keeps them; the same on every rank).

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
            dp_overlap_ratio: r in [0, 1]: the share of a segment's buckets synced when its backward ends, or "auto".
            preemption: PP transfers hold back DP sync chunks (default True).
            dp_bucket_numel: elements per flat gradient bucket (default `2**22`).
            dp_chunk_bytes: the most one DP ring piece moves (default `2**18`).
            offload: True or an oases.offload.Offloader: per-layer recompute inputs go to host memory (default False).
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
            TypeError: init_weights or zero not a bool, offload not a bool or Offloader, loss_scaler not a GradScaler.
        """
        settings = check_arguments(**{name: value for name, value in locals().items() if name != "self"})
        self._settings = settings  # every argument, checked
        self.config, self.schedule, self.micro_batches, self.mesh = config, schedule, micro_batches, mesh
        self.zero = zero
        self.dp_group, self.pp_group, self.tp_group = (mesh.get_group(name) for name in MESH_DIMS)
        self.dp, self.pp = dist.get_world_size(self.dp_group), dist.get_world_size(self.pp_group)
        self.dp_rank, self.dp_hierarchy = dist.get_rank(self.dp_group), dp_hierarchy
        self.model, self._stack, self._roles = build(
            settings, self.tp_group, device=mesh_device(mesh), stage=dist.get_rank(self.pp_group)
        )
        device = model_device(self.model)
        _check_backend(self.pp_group, device)
        self._dropout = StepDropout(config, self.model, self._stack, device, (self.pp_group, self.tp_group))
        if loss_scaler is not None:  # its scale lives on this device on every stage, not only where the loss is
            loss_scaler.scale(torch.zeros((), device=device))
        self._layers = len(self._stack.layers())
        self._auto = settings.auto  # what the first train_step chooses ("auto"; then none)
        self.measured: Optional[dict[str, float]] = None  # the times "auto" was chosen from
        self.offloader: Optional[Offloader] = Offloader() if offload is True else (offload or None)
        self.offload_stats: Optional[OffloadStats] = None  # the last train_step's (with offload)
        self.scheduler = CommScheduler(preemption=preemption)
        self.comm = StageComm(make_links(mesh, device), dist.get_rank(self.pp_group), self.pp, self.scheduler, device)
        self._executor = Executor(self.comm, settings, dp_group=self.dp_group, offloader=self.offloader)
        packing = settings.dp_packing  # two-level DP rings: each host's share of every dp group (collective)
        hosts = None if packing is None else dp_host_groups(mesh, packing)
        self._updates = Updates(
            settings, self.scheduler, device, dp_group=self.dp_group, pp_group=self.pp_group, dp_hosts=hosts
        )
        self._configure(*settings.first_layout)
        # Tied embedding / head over pp > 1: this rank's group with the other copy (None on middle
        # stages); collective over the world, once (stage.tied is the same on every rank).
        if self.pp > 1 and self.stage.tied:
            self._updates.tied_group = pair_group(mesh)
        self.freed_bytes = 0  # parameters of other stages released (once the layout is final)
        if not any(self._auto.values()):
            self.freed_bytes = self.stage.release_unowned()

    def _configure(self, segments: int, dp_overlap_ratio: float) -> None:
        """What depends on the segment count and r: the layout, stage, optimizers and DP sync, actions."""
        check_layers("config" if isinstance(self.config, GPTConfig) else "model", self._layers, self.pp, segments)
        reconfiguring, self.segments, self.dp_overlap_ratio = hasattr(self, "stage"), segments, dp_overlap_ratio
        self.layout = StageLayout(self._layers, self.pp, segments, dist.get_rank(self.pp_group))
        self.stage = Stage(self.model, self._stack, self.layout, self.tp_group, roles=self._roles)
        segment_params = [self.stage.segment_parameters(k) for k in range(segments)]
        error = frozen_segment(segment_params, self.pp_group, self.comm.device)  # agreed over pp
        if error is not None:
            if reconfiguring:  # segments='auto' reconfiguring in train_step: half changed, unusable
                self._executor.failed = error
            raise error
        self._updates.arrange(self.stage, segment_params, dp_overlap_ratio)
        self._executor.arrange(self.stage, self._updates)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Each segment's optimizer on this stage (zero=True: an oases.dp.ShardedOptimizer of this dp rank's rows)."""
        return self._updates.optimizers

    @property
    def sync(self) -> SegmentSync:
        """The per-segment DP sync (oases.pipeline.dp_sync; zero=True: a ZeroSegmentSync)."""
        return self._updates.sync

    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The last applied update's gradient norm (with max_grad_norm; else None)."""
        return self._updates.grad_norm

    @property
    def dp_hierarchical(self) -> bool:
        """Whether the DP sync runs two-level rings (dp_hierarchy=True, or "auto" where faster)."""
        return self._updates.hierarchical

    @property
    def actions(self) -> list[Action]:
        """This stage's actions in the order it runs them (oases.pipeline.schedules.actions)."""
        return self._executor.actions

    @property
    def _update_pending(self) -> set[int]:  # segments whose optimizer step is not applied yet
        return self._updates.pending

    @property
    def loss_scaler(self) -> Optional[GradScaler]:
        """The GradScaler of fp16 training given at construction (None: none); read-only."""
        return self._settings.loss_scaler

    @property
    def max_grad_norm(self) -> Optional[float]:
        """The clipping norm given at construction (None: no clipping); read-only."""
        return self._settings.max_grad_norm

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
        A model in training mode with dropout draws its masks from the step's seed (one
        default-generator draw per step; oases.pipeline._dropout).

        Args:
            tokens: the global batch's token ids [B, t] (int64), the same on every rank.
            targets: each position's class index [B, t] (int64), not shifted; -100 (IGNORE_INDEX):
                no loss there (padding, prompt tokens), the loss the mean over the other positions.
            check_inputs: (oases.inputs) True (the default) checks first that every rank of the mesh got
                the same batch (one all_gather of a summary), "broadcast" uses rank 0's, False skips it.

        Returns:
            The mean token loss of the whole batch (a scalar tensor), the same on every rank.

        Raises:
            ValueError: a bad batch (shapes, dtypes, values, B not divisible by dp, fewer rows per DP
                rank than micro-batches), or, with check_inputs=True, batches that differ over the mesh;
                a model with dropout in training mode that was built in eval mode.
            RuntimeError: an earlier step failed mid-way (build a new Pipeline), or gradients are disabled.
        """
        failed = self._executor.failed  # (then _checked_step refuses to run)
        if failed is None and not torch.is_grad_enabled():  # local: every rank alike, before any message
            raise RuntimeError(
                "train_step: called with gradients disabled (under torch.no_grad() or inference_mode()); it runs "
                "backwards: call it outside no_grad (or use eval_step for a loss without training)"
            )
        if failed is None:
            self._dropout.check()  # local: every rank alike, before any message
        step = self._checked_step("train_step", tokens, targets, check_inputs)
        step.seed = self._dropout.seed()  # dropout: every micro-batch's masks (and their recomputation's)
        if any(self._auto.values()):
            self._choose(step)
        self.sync.launch_deferred()  # the last step's deferred buckets overlap the forwards up to them
        self._executor.reserve(step)  # lazy inter-segment receives land in the slab
        if self.offloader is not None:
            self.offloader.begin_step()
        self._executor.run_actions(step)  # each receive posted one ahead; each segment's DP sync launched
        if self.offloader is not None:
            self.offload_stats = self.offloader.end_step()  # the first step also sizes its HostSlab
        return self._executor.phase("loss_sum", lambda: self._global_loss(step.loss, step.loss_sum))

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
        self._executor.evaluate(step, self.model)  # eval mode, no_grad, forwards only
        return self._executor.phase("loss_sum", lambda: self._global_loss(step.loss, step.loss_sum))

    def _checked_step(self, name: str, tokens: torch.Tensor, targets: torch.Tensor, check_inputs: CheckMode) -> Step:
        """`name`'s checks (a failed earlier step, the batch: the same on every rank), then its micro-batches."""
        self._executor.refuse_if_failed(
            f"{name}: an earlier step failed mid-way (see the cause), leaving messages posted "
            "on the pipeline's links, which match in order"
        )
        tokens, targets = self._executor.phase(
            "input_check", lambda: agree_mesh_inputs(check_inputs, self.comm.device, tokens=tokens, targets=targets)
        )
        check_batch(tokens, targets, self._settings, vocab=self.stage.vocab_size)
        return self._executor.split(tokens, targets)

    def _choose(self, step: Step) -> None:
        """segments / dp_overlap_ratio "auto": measure (see the class doc), choose, reconfigure
        (oases.pipeline._autotune)."""
        self.measured, (segments, ratio) = retune(
            step, self.stage, self.sync, self.comm, self._settings, ratio=self.dp_overlap_ratio, auto=self._auto
        )
        self._auto = {key: False for key in self._auto}
        if (segments, ratio) != (self.segments, self.dp_overlap_ratio):
            self._configure(segments, ratio)
        self.freed_bytes = self.stage.release_unowned()

    def _apply_pending(self) -> None:
        """Every segment's pending update (Updates.apply_pending: a collective over dp where one is pending)."""
        self._executor.refuse_if_failed(
            "pipeline: an earlier step failed mid-way (see the cause); its pending updates are not applied"
        )
        self._updates.apply_pending()

    def register_action_wrapper(self, wrapper: "ActionWrapper") -> RemovableHandle:
        """Run every action of this stage's steps through `wrapper` (tracing, timing, fault injection).

        ::

            each action of train_step:  wrapper(action, run)   # run(): the action itself (eval_step's: not wrapped)
            several wrappers: the first registered outermost; handle.remove() unregisters

        `action`: the schedule's F(k, i) / B(k, i) (oases.pipeline.Action); `run()` must be called
        exactly once (a RuntimeError otherwise); a wrapper's exception fails the step as the action's
        own would. The contract: the pipeline guide, "Watching each action".
        """
        return self._executor.register(wrapper)

    def register_phase_wrapper(self, wrapper: Callable[[str, Callable[[], None]], None]) -> RemovableHandle:
        """As register_action_wrapper, for each step's host phases: `wrapper(phase, run)` with phase
        "input_check" (the batch agreed over the mesh, a collective) or "loss_sum" (the loss summed over
        dp and broadcast over pp): where a benchmark times the ranks waiting for each other."""
        return self._executor.register(wrapper, phases=True)

    def sync_segment(self, segment: int) -> None:
        """Sum segment `segment`'s gradients of this stage over dp now, blocking (in place).

        ::

            for bucket in flat buckets of [p.grad for p in stage.segment_parameters(segment)]:
                ring reduce-scatter + all-gather over dp_group      # sum: the loss is already / N

        train_step's sync in its plain blocking form, for gradients made outside train_step; a tied
        embedding / head copy's segment sums it with the other copy's first (call it for every segment,
        in one order, on every rank). RuntimeError while train_step's own sync of the segment is pending,
        or with zero=True (the pipeline guide: "The Pipeline class: arguments and contracts")."""
        self._updates.sync_segment(segment)

    def _global_loss(self, loss: torch.Tensor, summed: Optional[dist.Work]) -> torch.Tensor:
        """Sum of the last stage's micro-batch losses over dp (`summed`: that all-reduce, started by
        run_actions on the last stage; None elsewhere), broadcast over pp to every stage."""
        if summed is not None:
            summed.wait()
        if self.pp > 1:
            dist.broadcast(loss, dist.get_global_rank(self.pp_group, self.pp - 1), group=self.pp_group)
        return loss

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys, order and shapes of the unsharded model's), on every rank.

        ::

            mine = this stage's entries of oases.full_state_dict(model)   # gathered over tp
            every stage's = all_gather_object(mine on the CPU, pp_group)  # merged, in the model's key order
            each tensor then on this rank's device

        Applies every pending update first. A collective over the whole mesh (every rank calls it)."""
        self._apply_pending()
        mine = self.stage.state_dict()
        parts: list[Optional[dict[str, torch.Tensor]]] = [None] * self.pp
        if self.pp > 1:  # pickled on the CPU: a CUDA tensor would unpickle onto its sender's GPU
            dist.all_gather_object(parts, {key: value.cpu() for key, value in mine.items()}, group=self.pp_group)
        else:
            parts[0] = mine
        merged = {key: value for part in parts for key, value in part.items()}
        return {key: merged[key].to(self.comm.device) for key in self.stage.key_order}

    def load_pretrained(self, path: str | os.PathLike, *, strict: bool = True) -> tuple[list[str], list[str]]:
        """Fill the tensors this rank holds from a Hugging Face safetensors directory (each rank reads
        only its boxes), checked against the whole model on every rank first; returns the whole
        model's (missing_keys, unexpected_keys). No communication unless an update is pending."""
        return _storage.load_pretrained(self, path, strict=strict, apply_pending=self._apply_pending)

    def save_pretrained(self, path: str | os.PathLike, *, max_shard_size: int = 5 * 2**30) -> None:
        """Write the unsharded model as a Hugging Face directory: rank 0 writes, each stage sends its
        tensors to it one at a time. A collective over the mesh; applies pending updates first."""
        _storage.save_pretrained(self, path, max_shard_size=max_shard_size, apply_pending=self._apply_pending)

    def save_checkpoint(
        self, path: str | os.PathLike, *, step: Optional[int] = None, extra: object = None, keep: Optional[int] = None
    ) -> str:
        """oases.save_checkpoint of the whole pipeline (every segment's optimizer too), each rank
        writing only what it holds, into path (path/step-{step:09d} with step; keep=N: the N newest
        stay); extra: anything picklable. Returns the directory published. A collective over the mesh."""
        pending = self._apply_pending
        return _storage.save_checkpoint(self, path, step=step, extra=extra, keep=keep, apply_pending=pending)

    def load_checkpoint(
        self, path: str | os.PathLike, *, step: Optional[int] = None, verify: bool = True, trusted: bool = True
    ) -> CheckpointState:
        """Load a checkpoint of this model (any Pipeline layout's, or a TP model's) into this stage's tensors
        and optimizers; a collective over the mesh. As oases.load_checkpoint: a root loads its newest step
        that verifies on every rank (newer damaged ones skipped, one warning); `step=N` exactly path/step-N
        or a ValueError naming the file; `verify=False`: no checksums (sizes still checked); `trusted=False`:
        no pickle (DCP's metadata records and plain data only)."""
        pending, auto = self._apply_pending, self._auto["segments"]
        return _storage.load_checkpoint(
            self, path, step=step, verify=verify, trusted=trusted, apply_pending=pending, auto_segments=auto
        )

    def close(self) -> None:
        """Apply every pending update (every rank calls it, as its DP sync is collective over dp),
        then end the scheduler's threads; a later train_step starts new ones."""
        if self._executor.failed is None:
            self._apply_pending()
        self.scheduler.close()
        if self.offloader is not None:
            self.offloader.close()
