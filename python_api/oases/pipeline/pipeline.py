"""`Pipeline`: a model trained with pipeline x data x tensor parallelism on a (dp, pp, tp) device mesh.

    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(config, mesh, schedule="aiao", segments=2, micro_batches=4,   # a GPTConfig, or
                                                      # a factory: lambda: LlamaForCausalLM(cfg)
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3), seed=0,
                    dp_overlap_ratio=1.0, preemption=True)
    loss = pipe.train_step(tokens, targets)   # global batch [B, t], the same on every rank
    state = pipe.state_dict()                 # applies pending updates; the full model's state dict, on every rank
    pipe.load_pretrained(dir) / pipe.save_pretrained(dir)       # Hugging Face safetensors, each stage its part
    pipe.save_checkpoint(root, step=n, keep=2) / pipe.load_checkpoint(root)   # DCP, optimizers included

One step, on the rank at (d, s, t) of the mesh:

    rows = B / dp; block = tokens[d*rows : (d+1)*rows]          # this DP rank's rows
    micro-batches = block split into m near-equal row ranges (sizes differ by at most one)
    sync.launch_deferred()                                      # last step's deferred DP buckets
    for action in schedules.actions(schedule, stage=s, ...):    # F(k, i) / B(k, i)
        first F of segment k: sync.wait(k); optimizer[k].step(); zero grads   # last step's update
        post the receive the next action needs                  # PPComm: one action ahead
        F(k, i): x = recv act (or embed(tokens)); y = layers of (k, s) on x
                 last virtual stage: loss_i = loss_sum(head(y), targets_i) / (B * t) else send y
        B(k, i): g = recv grad (or 1 for loss_i); backward(y, g); send x.grad (unless first)
        last B of segment k: sync.launch(k)                     # DPComm: sum over dp, async
    first and last stage, tied embedding / head W: W.grad += other copy's; sync.launch(W)
    return sum over dp and micro-batches of loss_i              # broadcast from the last stage

Dividing each micro-batch's summed token loss by the *global* token count makes the sum of the
DP ranks' gradients the single-process gradient of the mean loss: the DP sync is a plain sum.

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
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases._leaves import grad_leaf
from oases._rows import split_rows
from oases.amp import GradScaler
from oases.checkpoint import CheckpointState
from oases.comm.hierarchical import HostGroups, HostLinks, packed_ranks_per_host, ranks_per_host_from_env
from oases.costs.collectives import partition
from oases.dp.zero import ShardedOptimizer
from oases.inputs import CheckMode, agree_mesh_inputs
from oases.models.gpt import GPTConfig
from oases.offload import Offloader, OffloadStats
from oases.pipeline import _storage
from oases.pipeline._build import build
from oases.pipeline.comm_scheduler import CommScheduler
from oases.pipeline.dp_sync import CHUNK_BYTES, SegmentSync, buckets_of
from oases.pipeline.p2p import StageComm, make_links, mesh_grid
from oases.pipeline.schedules import SCHEDULES, Action, actions
from oases.pipeline.stages import Stage, StageInput, StageLayout
from oases.pipeline.stages import check_layers as _check_layers
from oases.pipeline.tied import pair_group, sum_copies
from oases.pipeline.zero_sync import ZeroSegmentSync
from oases.planner.fold3d import choose_segments, dp_overlap_ratio
from oases.schedule import SubBatch

__all__ = ["Pipeline"]

_MESH_DIMS = ("dp", "pp", "tp")
_BUCKET_NUMEL = 1 << 22  # elements per flat gradient bucket of the DP sync (16 MiB in fp32)


@dataclass
class _Step:
    """What one train_step's actions share: micro-batches, their activation shapes, kept tensors."""

    micro: list[tuple[torch.Tensor, torch.Tensor]]  # (tokens, targets) [b_i, t] per micro-batch
    ctx: dict[int, object]  # micro-batch -> what stack.embed gives every layer (rotary, masks)
    shapes: list[torch.Size]  # activation [b_i, t, h] per micro-batch
    dtype: torch.dtype  # of activations and their gradients
    normalizer: int  # tokens in the global batch: each micro-batch's loss is divided by it
    inputs: dict[tuple[int, int], Optional[torch.Tensor]] = field(default_factory=dict)  # (k, i) -> stage input
    saved: dict[tuple[int, int], list] = field(default_factory=dict)  # offload: (k, i) -> its layers' Checkpoints
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # offload: (k, i) -> input's gradient
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (k, i) -> output / loss
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _check_config(config: GPTConfig | Callable[[], nn.Module], mesh, schedule: str, segments: int,
                  micro_batches: int, dp_overlap_ratio: float, dp_bucket_numel: int,
                  dp_chunk_bytes: int) -> dict[str, int]:
    """Every argument check of Pipeline(...) that needs no model: local only, so every rank raises
    the same error. Returns the mesh sizes {"dp": .., "pp": .., "tp": ..}."""
    if dp_overlap_ratio != "auto" and (isinstance(dp_overlap_ratio, bool)
                                       or not isinstance(dp_overlap_ratio, (int, float))
                                       or not 0.0 <= dp_overlap_ratio <= 1.0):
        raise ValueError(f"dp_overlap_ratio: expected a number in [0, 1] or 'auto', got {dp_overlap_ratio!r}")
    if not _checks.is_int(dp_bucket_numel) or dp_bucket_numel < 1:
        raise ValueError(f"dp_bucket_numel: expected an int >= 1, got {dp_bucket_numel!r}")
    if not _checks.is_int(dp_chunk_bytes) or dp_chunk_bytes < 1:
        raise ValueError(f"dp_chunk_bytes: expected an int >= 1 (bytes per DP ring piece), got {dp_chunk_bytes!r}")
    if not isinstance(config, GPTConfig) and not callable(config):
        raise ValueError(f"config: expected an oases.models.GPTConfig or a model factory (a callable returning "
                         f"the model), got {type(config).__name__}")
    if isinstance(config, GPTConfig) and config.dropout != 0.0:
        raise ValueError(f"config.dropout: the pipeline does not apply dropout yet, got {config.dropout}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if sorted(names) != sorted(_MESH_DIMS):
        raise ValueError(f"mesh: expected dimensions named {_MESH_DIMS}, got {names or 'none'}")
    sizes = {name: mesh.size(names.index(name)) for name in _MESH_DIMS}
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("mesh: torch.distributed is not initialized")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(f"mesh: dp * pp * tp = {sizes['dp']} * {sizes['pp']} * {sizes['tp']} = {mesh.size()}, "
                         f"but the world size is {world}")
    _checks.one_of("schedule", schedule, SCHEDULES)
    if segments != "auto" and (not _checks.is_int(segments) or segments < 1):
        raise ValueError(f"segments: expected an int >= 1 or 'auto', got {segments!r}")
    if not _checks.is_int(micro_batches) or micro_batches < 1:
        raise ValueError(f"micro_batches: expected an int >= 1, got {micro_batches!r}")
    if schedule == "1f1b" and segments not in (1, "auto"):
        raise ValueError(f"segments: the 1f1b schedule runs one segment, got {segments} (use 'aiao')")
    if schedule == "1f1b" and micro_batches < sizes["pp"]:
        raise ValueError(f"micro_batches: 1f1b needs at least pp = {sizes['pp']} micro-batches, got {micro_batches}")
    if isinstance(config, GPTConfig):
        _check_layers("config.layers", config.layers, sizes["pp"], 1 if segments == "auto" else segments)
        for what, size in (("heads", config.heads), ("hidden * mlp_ratio", config.hidden * config.mlp_ratio)):
            if size % sizes["tp"]:
                raise ValueError(f"config.{what}: {size} is not divisible by tp = {sizes['tp']}")
    return sizes


def _mesh_device(mesh) -> torch.device:
    """The device a meta-built stage is allocated on: the mesh's device type (CUDA: the current GPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _dp_lines(mesh) -> list[list[int]]:
    """Every dp group's global ranks, in the order make_links walks the mesh: (pp, tp) index-major."""
    grid = mesh_grid(mesh)  # [dp, pp, tp] global ranks
    return [grid[:, s, t].tolist() for s in range(grid.shape[1]) for t in range(grid.shape[2])]


def _check_dp_hierarchy(dp_hierarchy: bool | str, mesh) -> Optional[int]:
    """dp_hierarchy's checks (local: every rank raises the same error). Returns how many of each
    dp group's ranks a host holds (hosts of LOCAL_WORLD_SIZE consecutive ranks, as oases-launch
    --hosts packs them), or None when the DP sync stays flat (False, or dp = 1)."""
    if not (dp_hierarchy is False or dp_hierarchy is True
            or (isinstance(dp_hierarchy, str) and dp_hierarchy == "auto")):
        raise ValueError(f"dp_hierarchy: expected False, True or 'auto', got {dp_hierarchy!r}")
    lines = _dp_lines(mesh)
    if dp_hierarchy is False or len(lines[0]) == 1:
        return None
    try:
        per_host = ranks_per_host_from_env()
    except ValueError as err:
        raise ValueError(f"dp_hierarchy: {err}") from None
    counts = set()
    for ranks in lines:
        try:
            counts.add(packed_ranks_per_host(ranks, per_host))
        except ValueError as err:
            raise ValueError(f"dp_hierarchy: the dp group's {err}") from None
    if len(counts) != 1:  # (every dp group has as many ranks, on hosts of one size: cannot happen)
        raise ValueError(f"dp_hierarchy: dp groups hold {sorted(counts)} ranks per host; expected one number")
    return counts.pop()


def _dp_host_groups(mesh, ranks_per_host: int) -> HostGroups:
    """This rank's HostGroups of its dp group. Collective over the world: every rank makes every
    dp group's host groups, in the mesh's order (as make_links does)."""
    mine = None
    for ranks in _dp_lines(mesh):
        groups = HostGroups.create(ranks_per_host, ranks, high_priority=False)  # DP yields to the PP links
        if groups is not None:
            mine = groups
    assert mine is not None
    return mine


def _hierarchy_is_faster(segment_params: list[list[nn.Parameter]], bucket_numel: int, hosts: HostGroups,
                         links: HostLinks) -> bool:
    """dp_hierarchy="auto": oases.planner.partition's choice for the all-reduce of this stage's
    largest DP bucket (its gradients and presence flags, as SegmentSync sends it). The same on
    every rank of a dp group (same stage, same buckets, same links)."""
    sizes = [sum(p.numel() for p in bucket) + len(bucket)
             for params in segment_params for bucket in buckets_of(params, bucket_numel)]
    if not sizes:
        return False
    element = next(p for params in segment_params for p in params).element_size()
    choice = partition("all_reduce", max(sizes) * element, hosts.ranks_per_host, hosts.hosts, links.intra, links.inter)
    return choice.choice == "hierarchical"


def _check_backend(group: dist.ProcessGroup, device: torch.device) -> None:
    """The pipeline's tensors live on `device`: the group must carry that device's tensors (gloo
    for CPU, NCCL for CUDA; "cpu:gloo,cuda:nccl" carries both)."""
    config = str(dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else dist.get_backend(group))
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    backend = per_device.get(device.type, config if not per_device else None)
    want = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
    if backend != want:
        raise ValueError(f"mesh: the model's parameters are on {device.type} but the mesh's groups use {config!r}; "
                         f"{device.type} tensors need {want!r} (init the process group with {want!r} or "
                         "'cpu:gloo,cuda:nccl', and the mesh on the model's device type)")


class Pipeline:
    """A model cut into pp stages (ns segments each), replicated dp times, each stage TP-sharded tp ways.

    `config`: an `oases.models.GPTConfig` (parameters start as `GPT(config, seed=seed)`'s), or a
    factory: a callable returning the unsharded model, e.g. `lambda: LlamaForCausalLM(cfg)`; every
    rank calls it under `torch.manual_seed(seed)` (so parameters start as the single-process model
    made the same way), shards it with `oases.parallelize` over tp (unless already sharded) and
    sees it through `oases.train_step`'s adapters (Hugging Face Llama / Mistral / Qwen2 / Qwen3 /
    GPT-NeoX, nanoGPT, any `oases.schedule.Stack` module). Every rank builds the whole model,
    then frees the parameters of other stages' layers once the layout is final (`freed_bytes`;
    embedding and head stay on every rank: every stage runs the embedding for its ctx). Tied
    input/output embeddings are trained on the first and the last stage, as copies whose
    gradients are summed (module doc). A factory
    that builds on meta (`with torch.device("meta"): return Cls(cfg)`) gets only what its stage
    places allocated, on the mesh's device (oases.pipeline._build): its layers, the embedding on
    the first stage, the head on the last; `init_weights=True` gives them the single-process
    build's values, False leaves them for `load_pretrained` / `load_checkpoint` (segments: an int).
    The loss is the GPT's: mean over every token of cross_entropy(logits, targets), targets not shifted.

    `schedule`: "gpipe", "1f1b" (segments=1, micro_batches >= pp) or "aiao" (see
    oases.pipeline.schedules); `optimizer(params)` builds the optimizer of one segment's
    parameters on this rank (called once per segment; it must treat parameters independently, as
    SGD and AdamW do, so per-segment optimizers equal one over the whole model).
    `dp_overlap_ratio` r in [0, 1]: the fraction of a segment's gradient buckets whose DP sync
    starts as soon as its backward ends (the rest start at the next train_step, under its
    forwards); `dp_bucket_numel`: elements per flat gradient bucket;
    `dp_chunk_bytes`: the most a DP ring piece moves (what a PP transfer may wait behind);
    `offload` (True or an oases.offload.Offloader): the per-layer checkpoints go to host memory
    in batches after each forward action and come back before their backward (`offload_stats`
    after each step; bit-exact; the slab is sized by the first step, so a later step with larger
    micro-batches raises SlabTooSmallError: pass an Offloader with a larger HostSlab then);
    `preemption`: PP transfers hold back DP sync chunks (module doc);
    `dp_hierarchy`: the DP sync's rings in two levels (oases.comm.hierarchical: intra-host, then
    inter-host) over hosts of LOCAL_WORLD_SIZE consecutive ranks (oases-launch --hosts H): True
    always, "auto" when oases.planner.partition predicts it faster for this stage's largest
    bucket on HostLinks.from_env() (`dp_hierarchical` says which ran; False: the flat ring). Each
    host must hold as many of every dp group's ranks (ValueError otherwise); LOCAL_WORLD_SIZE
    and the OASES_*BANDWIDTH variables must be the same on every rank (as oases-launch sets them).
    `zero=True`: ZeRO-1 (oases.pipeline.zero_sync): each segment's DP sync reduce-scatters gradient
    rows instead of summing whole gradients, `optimizers[k]` is an oases.dp.ShardedOptimizer
    stepping `optimizer(masters)` on this dp rank's ceil(n/dp) rows of each parameter (fp32
    masters for 16-bit ones: optimizer state ~1/dp per rank), and the parameters are all-gathered
    in preemptible chunks on the DP thread, segment k+1's under segment k's forwards; checkpoints
    store the rows (loadable at any dp, with or without zero); not with dp_hierarchy.
    Every argument is checked (ValueError naming it) on every rank before any communication.
    `close()` ends the threads.
    Pipelines on one mesh share its dp group and the DP rings' message tags: close() one (its DP sync may still
    be in flight after train_step returns) before another trains.

    `loss_scaler` (an oases.amp.GradScaler, for fp16): the last stage back-propagates the scaled
    loss; the first pending update of the next step waits for every segment's DP sync, unscales
    each segment's gradients and takes one inf/NaN verdict for all segments over the scaler's
    group (default: the world: every stage and replica), so every segment of every rank steps or
    skips alike, as one optimizer would; the scale is updated after the last segment's update.
    Not with zero=True. The scaler's state is not in the pipeline's checkpoints: save
    `loss_scaler.state_dict()` beside them.

    `segments="auto"` and `dp_overlap_ratio="auto"` are chosen by FOLD3D's rules
    (oases.planner.fold3d: choose_segments, dp_overlap_ratio) from times measured on the first
    train_step's batch, before it runs (`self.measured` keeps them; the same on every rank)::

        forward_s, backward_s = one layer's forward / backward (with recomputation) on micro-batch 0,
                                times this stage's layers (MAX over ranks)
        dp_comm_s  = this stage's gradient sync over dp (a ring all-reduce of one bucket, scaled)
        pp_comm_s  = one activation between neighbouring stages (a ring exchange over pp)

    Until then the pipeline runs as segments=1 (state_dict() works; no update is pending). That
    first step rebuilds `optimizers`, `stage` and `sync` (calling `optimizer` again): make LR
    schedulers on `pipe.optimizers` after it. FOLD3D's rule models aiao; with gpipe or 1f1b,
    "auto" means one segment.
    """

    def __init__(self, config: GPTConfig | Callable[[], nn.Module], mesh, *, schedule: str = "1f1b",
                 segments: int | str = 1, micro_batches: int = 4,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _sgd,
                 seed: int = 0, dp_overlap_ratio: float | str = 1.0, preemption: bool = True,
                 dp_bucket_numel: int = _BUCKET_NUMEL, dp_chunk_bytes: int = CHUNK_BYTES,
                 offload: bool | Offloader = False, dp_hierarchy: bool | str = False,
                 init_weights: bool = True, zero: bool = False,
                 loss_scaler: Optional[GradScaler] = None) -> None:
        sizes = _check_config(config, mesh, schedule, segments, micro_batches, dp_overlap_ratio, dp_bucket_numel,
                              dp_chunk_bytes)
        if not isinstance(init_weights, bool):
            raise TypeError(f"init_weights: expected a bool, got {init_weights!r}")
        if not isinstance(zero, bool):
            raise TypeError(f"zero: expected a bool, got {zero!r}")
        if loss_scaler is not None and not isinstance(loss_scaler, GradScaler):
            raise TypeError(f"loss_scaler: expected an oases.amp.GradScaler (its inf/NaN verdict spans every rank, "
                            f"so every stage and replica skips the same steps), got {type(loss_scaler).__name__}")
        if loss_scaler is not None and loss_scaler.group is not None and \
                dist.get_world_size(loss_scaler.group) != dist.get_world_size():
            raise ValueError("loss_scaler: its group must span every rank of the pipeline (stages and replicas take "
                             "one verdict); make it with group=None (the world)")
        if loss_scaler is not None and zero:
            raise ValueError("loss_scaler: not with zero=True (the sharded optimizer's masters are not unscaled); "
                             "pass zero=False")
        self.loss_scaler = loss_scaler
        self._unscaled = False  # this step's pending gradients unscaled (and the verdict taken)
        if zero and dp_hierarchy is not False:
            raise ValueError(f"zero: the ZeRO sync runs flat rings over dp; pass dp_hierarchy=False "
                             f"(got {dp_hierarchy!r})")
        self.zero = zero
        dp_packing = _check_dp_hierarchy(dp_hierarchy, mesh)  # before any communication, like every check
        self._dp_links = HostLinks.from_env() if dp_hierarchy == "auto" and dp_packing is not None else None
        if not isinstance(offload, (bool, Offloader)):
            raise TypeError(f"offload: expected a bool or an oases.offload.Offloader, got {type(offload).__name__}")
        self.config, self.schedule, self.micro_batches = config, schedule, micro_batches
        self.dp_group, self.pp_group, self.tp_group = (mesh.get_group(name) for name in _MESH_DIMS)
        self.dp, self.pp = dist.get_world_size(self.dp_group), dist.get_world_size(self.pp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.mesh = mesh
        self.model, self._stack, self._roles = build(
            config, self.tp_group, sizes["tp"], seed, device=_mesh_device(mesh), init_weights=init_weights,
            pp=self.pp, segments=segments, stage=dist.get_rank(self.pp_group))
        devices = {p.device for p in self.model.parameters() if not p.is_meta}  # meta: other stages' (meta build)
        if len(devices) != 1:
            raise ValueError(f"config: the model's parameters are on {len(devices)} devices "
                             f"({sorted(map(str, devices))}); "
                             "a stage runs on one device: move the model there in the factory")
        device = devices.pop()
        _check_backend(self.pp_group, device)
        if loss_scaler is not None:  # its scale lives on this device on every stage, not only where the loss is
            loss_scaler.scale(torch.zeros((), device=device))
        self._layers = len(self._stack.layers())
        self._make_optimizer, self._bucket_numel, self._chunk_bytes = optimizer, dp_bucket_numel, dp_chunk_bytes
        self._auto = {"segments": segments == "auto" and schedule == "aiao",  # the rule models aiao's overlap
                      "dp_overlap_ratio": dp_overlap_ratio == "auto"}
        self.measured: Optional[dict[str, float]] = None  # the times "auto" was chosen from
        self.offloader: Optional[Offloader] = Offloader() if offload is True else (offload or None)
        self.offload_stats: Optional[OffloadStats] = None  # the last train_step's (with offload)
        self._anchor = torch.empty(0, requires_grad=True)  # offload: what received inputs hang from
        self._failed: Optional[BaseException] = None  # a step that raised mid-way (its links are out of order)
        self.scheduler = CommScheduler(preemption=preemption)
        self.comm = StageComm(make_links(mesh, device), dist.get_rank(self.pp_group), self.pp, self.scheduler, device)
        self.dp_hierarchy = dp_hierarchy
        self._dp_hosts = None if dp_packing is None else _dp_host_groups(mesh, dp_packing)  # collective
        self._configure(1 if segments == "auto" else segments,
                        1.0 if dp_overlap_ratio == "auto" else dp_overlap_ratio)
        # Tied embedding / head over pp > 1: this rank's group with the other copy (None on middle
        # stages); collective over the world, once (stage.tied is the same on every rank).
        self._tied_group = pair_group(mesh) if self.pp > 1 and self.stage.tied else None
        self.freed_bytes = 0  # parameters of other stages released (once the layout is final)
        if not any(self._auto.values()):
            self.freed_bytes = self.stage.release_unowned()

    def _configure(self, segments: int, dp_overlap_ratio: float) -> None:
        """Everything that depends on the segment count and r: layout, stage, optimizers, actions, sync."""
        _check_layers("config" if isinstance(self.config, GPTConfig) else "model", self._layers, self.pp, segments)
        self.segments, self.dp_overlap_ratio = segments, dp_overlap_ratio
        stage = dist.get_rank(self.pp_group)
        self.layout = StageLayout(self._layers, self.pp, segments, stage)
        self.stage = Stage(self.model, self._stack, self.layout, self.tp_group, roles=self._roles)
        segment_params = [self.stage.segment_parameters(k) for k in range(segments)]
        if self.zero:  # ZeRO-1: each segment's optimizer steps this dp rank's rows (oases.dp.ShardedOptimizer)
            self.optimizers = [ShardedOptimizer(params, self.dp_group, self._make_optimizer)
                               for params in segment_params]
        else:
            self.optimizers = [self._make_optimizer(params) for params in segment_params]  # one per segment
        # A copy of a tied embedding / head (pp > 1, first or last stage): trained by segment
        # _tied_home, its gradient summed with the other copy's and then over dp as sync segment ns.
        self._tied_home = self.stage.tied_segment() if self.pp > 1 else None
        self._tied = self.stage.tied if self._tied_home is not None else []
        tied = {id(p) for p in self._tied}
        sync_params = [[p for p in params if id(p) not in tied] for params in segment_params]
        sync_params += [self._tied] if self._tied else []
        self.actions: list[Action] = actions(self.schedule, stage=stage, stages=self.pp, segments=segments,
                                             micro_batches=self.micro_batches)
        self.comm.expect(self.schedule, segments, self.micro_batches)  # each link's arrivals, in send order
        backward = [(a.segment, a.micro_batch) for a in self.actions if a.kind == "B"]
        self._next_backward = dict(zip(backward, backward[1:]))  # offload: what to prefetch during B(k, i)
        # Where each segment's first forward and last backward sit in the actions.
        self._first_forward = {k: min(j for j, a in enumerate(self.actions) if a.kind == "F" and a.segment == k)
                               for k in range(segments)}
        self._last_backward = {max(j for j, a in enumerate(self.actions) if a.kind == "B" and a.segment == k): k
                               for k in range(segments)}
        # Two-level DP rings: always with dp_hierarchy=True; with "auto" where the planner says so.
        self.dp_hierarchical = self._dp_hosts is not None and (
            self._dp_links is None or _hierarchy_is_faster(sync_params, self._bucket_numel, self._dp_hosts,
                                                          self._dp_links))
        if self.zero:  # reduce-scatter into the optimizers' rows, all-gather after their steps
            self.sync = ZeroSegmentSync(sync_params, self.dp_group, self.scheduler, self.optimizers,
                                        overlap_ratio=dp_overlap_ratio, bucket_numel=self._bucket_numel,
                                        chunk_bytes=self._chunk_bytes)
        else:
            self.sync = SegmentSync(sync_params, self.dp_group, self.scheduler,
                                    overlap_ratio=dp_overlap_ratio, bucket_numel=self._bucket_numel,
                                    chunk_bytes=self._chunk_bytes,
                                    hosts=self._dp_hosts if self.dp_hierarchical else None)
        self._update_pending: set[int] = set()  # segments whose optimizer step is not applied yet

    # --- one step -------------------------------------------------------------------------------

    @property
    def plan(self) -> list[Action]:
        """Deprecated name of `actions` (this stage's actions in order); "plan" is the planner's word."""
        warnings.warn("Pipeline.plan is deprecated: use Pipeline.actions", DeprecationWarning, stacklevel=2)
        return self.actions

    def _check_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens: expected an int64 tensor [batch, t], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        if not isinstance(targets, torch.Tensor) or targets.shape != tokens.shape:
            raise ValueError(f"targets: expected the tokens' shape {tuple(tokens.shape)}, "
                             f"got {tuple(getattr(targets, 'shape', ()))}")
        if targets.dtype != torch.int64:
            raise ValueError(f"targets: expected int64 class indices, got {targets.dtype}")
        seq_len = self.config.seq_len if isinstance(self.config, GPTConfig) else None
        if tokens.shape[1] == 0 or (seq_len is not None and tokens.shape[1] > seq_len):
            raise ValueError(f"tokens: {tokens.shape[1]} positions; expected 1 to config.seq_len = {seq_len}")
        vocab = self.stage.vocab_size
        for name, t in (("tokens", tokens), ("targets", targets)):  # they would raise mid-step on one stage
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
                raise ValueError(f"{name}: values must lie in [0, vocab_size = {vocab}), got "
                                 f"[{int(t.min())}, {int(t.max())}]")
        if tokens.shape[0] % self.dp:
            raise ValueError(f"tokens: {tokens.shape[0]} rows are not divisible by dp = {self.dp}")
        if tokens.shape[0] // self.dp < self.micro_batches:
            raise ValueError(f"micro_batches: {self.micro_batches} micro-batches, but each DP rank has only "
                             f"{tokens.shape[0] // self.dp} rows")

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, *,
                   check_inputs: CheckMode = True) -> torch.Tensor:
        """One optimizer step on the global batch (tokens, targets [B, t], the same on every rank);
        returns the mean token loss of the whole batch, the same on every rank (see the module doc).
        `check_inputs` (oases.inputs): True checks first that every rank of the mesh got the same
        batch (one all_gather of a summary; ValueError on every rank otherwise), "broadcast" uses
        rank 0's, False skips it."""
        if self._failed is not None:
            raise RuntimeError("train_step: an earlier step failed mid-way (see the cause), leaving messages posted "
                               "on the pipeline's links, which match in order; build a new Pipeline") from self._failed
        tokens, targets = agree_mesh_inputs(check_inputs, self.comm.device, tokens=tokens, targets=targets)
        self._check_batch(tokens, targets)
        step = self._split(tokens, targets)
        if any(self._auto.values()):
            self._choose(step)
        self.sync.launch_deferred()  # the last step's deferred buckets overlap the forwards up to them
        if self.layout.stage == 0 and self.segments > 1:  # lazy inter-segment receives land in the slab
            self.comm.reserve_lazy(step.shapes, step.dtype, self.segments)
        if self.offloader is not None:
            self.offloader.begin_step()
        try:
            self._post_recv(0, step)  # receives are posted in the order they are waited for
            for j, action in enumerate(self.actions):
                if self._first_forward[action.segment] == j:
                    self._apply_update(action.segment)
                    self._post_lazy(action.segment, step)
                self._post_recv(j + 1, step)  # PPComm: the next action's input is on its way meanwhile
                with torch.profiler.record_function(f"oases::pipeline::{action.kind}"):
                    self._run(action, step)
                if j in self._last_backward:  # DPComm: this segment's gradients are final
                    self.sync.launch(self._last_backward[j])
                    self._update_pending.add(self._last_backward[j])
            self.comm.wait_sends()
            self._sum_tied()
        except BaseException as error:  # receives may still be posted: the links' order is lost
            self._failed = error
            raise
        if self.offloader is not None:
            self.offload_stats = self.offloader.end_step()  # the first step also sizes its HostSlab
        return self._global_loss(step.loss)

    def _choose(self, step: _Step) -> None:
        """segments / dp_overlap_ratio "auto": measure (see the class doc), choose, reconfigure."""
        per_stage = self._layers // self.pp
        tokens = step.micro[0][0]
        _, ctx = self.stage.embed(tokens, SubBatch(slice(0, tokens.shape[0]), tokens.shape[0]))
        forward, backward = self.stage.time_layer(step.shapes[0], step.dtype, ctx)
        numel = sum(p.numel() for p in self.stage.parameters())
        times = torch.tensor([forward * per_stage, backward * per_stage,
                              self.sync.time_sync(numel), self.comm.time_transfer(step.shapes[0], step.dtype)],
                             dtype=torch.float64, device=self.comm.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every rank decides the same
        f, b, dp_s, pp_s = times.tolist()
        self.measured = dict(forward_s=f, backward_s=b, dp_comm_s=dp_s, pp_comm_s=pp_s)
        m = self.micro_batches
        segments = self.segments
        if self._auto["segments"]:
            segments = choose_segments(self._layers, self.pp, f, b, pp_s, dp_s, micro_batches=m)
        if self.stage.shared_at(segments):  # a weight tied between layers must stay in one segment
            segments = self.segments
        ratio = self.dp_overlap_ratio
        if self._auto["dp_overlap_ratio"]:
            ratio = dp_overlap_ratio(f, b, dp_s, segments=segments, micro_batches=m)
        self._auto = {key: False for key in self._auto}
        if (segments, ratio) != (self.segments, self.dp_overlap_ratio):
            self._configure(segments, ratio)
        self.freed_bytes = self.stage.release_unowned()

    def _post_lazy(self, segment: int, step: _Step) -> None:
        """Stage 0, at segment k's first forward: post the receives of every micro-batch's
        activation from segment k's last stage (needed by segment k+1) into host memory
        (oases.pipeline.p2p: inter-segment lazy communication)."""
        if self.layout.stage != 0 or segment + 1 >= self.segments:
            return
        edge = self.layout.virtual(segment + 1) - 1  # stage p-1 of segment k -> stage 0 of segment k+1
        keys = [("act", edge, i) for i in range(self.micro_batches)]
        self.comm.post_lazy(keys, step.shapes, step.dtype)

    def _post_recv(self, j: int, step: _Step) -> None:
        """Post the receive actions[j] waits for, if any."""
        key = self._recv_key(self.actions[j]) if j < len(self.actions) else None
        if key is not None:
            self.comm.post_recv(key, step.shapes[key[2]], step.dtype)

    def _sum_tied(self) -> None:
        """End of a step, on a copy of a tied embedding / head (first and last stage): add the
        other copy's gradient (a collective with that stage), then start the weight's DP sync."""
        if self._tied and self._tied_group is not None:
            sum_copies(self._tied, self._tied_group)
            self.sync.launch(self.segments)

    def _apply_update(self, segment: int) -> None:
        """Segment `segment`'s pending optimizer step, before its forward. ZeRO: then segment
        k+1's step, whose all-gather runs under segment k's forwards (oases.pipeline.zero_sync);
        and segment k's all-gather is waited for."""
        if self._failed is not None:  # ranks may hold different pending steps: their collectives would not match
            raise RuntimeError("pipeline: an earlier step failed mid-way (see the cause); its pending updates are "
                               "not applied; build a new Pipeline") from self._failed
        if segment in self._update_pending:
            self._step(segment)
        if self.zero:
            if segment + 1 in self._update_pending:
                self._step(segment + 1)
            self.sync.wait_gather(segment)

    def _wait_sync(self, segment: int) -> None:
        self.sync.wait(segment)
        if segment == self._tied_home:
            self.sync.wait(self.segments)

    def _step(self, segment: int) -> None:
        """Wait for the segment's DP sync (and a tied copy's), step, clear its grads (ZeRO: start
        the all-gather of its parameters). With a loss scaler, the first pending step of a train
        step waits for every pending segment's sync and unscales them all (one verdict for all of
        them over the scaler's group); each segment then steps or skips by it, and the scale is
        updated after the last."""
        if self.loss_scaler is not None and not self._unscaled:
            pending = sorted(self._update_pending)
            for k in pending:
                self._wait_sync(k)
            self.loss_scaler.unscale_together_([self.optimizers[k] for k in pending])
            self._unscaled = True
        self._wait_sync(segment)
        if self.loss_scaler is None:
            self.optimizers[segment].step()
        else:
            self.loss_scaler.step(self.optimizers[segment])
        self.optimizers[segment].zero_grad(set_to_none=True)
        self._update_pending.discard(segment)
        if self.loss_scaler is not None and not self._update_pending:
            self.loss_scaler.update()
            self._unscaled = False
        if self.zero:
            self.sync.gather(segment)

    def _split(self, tokens: torch.Tensor, targets: torch.Tensor) -> _Step:
        """This DP rank's contiguous block of rows, cut into micro-batches of near-equal rows."""
        rows = tokens.shape[0] // self.dp
        block = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        parts = split_rows(rows, self.micro_batches)  # sizes differ by at most one
        mine = [t[block].to(self.comm.device) for t in (tokens, targets)]  # on the model's device
        micro = [tuple(t[p] for t in mine) for p in parts]
        shapes = [torch.Size((p.stop - p.start, tokens.shape[1], self.stage.hidden)) for p in parts]  # [b_i, t, h]
        return _Step(micro, {}, shapes, self.stage.dtype, targets.numel(),  # normalizer: the global batch's tokens
                     loss=torch.zeros((), dtype=torch.float32, device=self.comm.device))

    def _embed(self, step: _Step, i: int) -> Optional[torch.Tensor]:
        """Micro-batch i's embedding on virtual stage 0 (None elsewhere); its ctx is kept for every layer."""
        tokens = step.micro[i][0]
        x, step.ctx[i] = self.stage.embed(tokens, SubBatch(slice(0, tokens.shape[0]), tokens.shape[0]))
        return x if self.layout.is_first(0) else None

    def _run(self, action: Action, step: _Step) -> None:
        """F(k, i): receive (or embed), run the segment, send (or add the loss), keep (input, output).
        B(k, i): receive the output's gradient (or start from the loss), back-propagate, send the
        input's gradient (unless virtual stage 0)."""
        k, i = action.segment, action.micro_batch
        v, off = self.layout.virtual(k), self.offloader
        if action.kind == "F":
            if self.layout.is_first(k):
                x = self._embed(step, i)
            else:
                if i not in step.ctx:
                    self._embed(step, i)
                x = self.comm.recv(("act", v - 1, i), step.shapes[i], step.dtype)
                # Offloading, the received input is not kept here: layer 0's checkpoint holds it.
                x = grad_leaf(x) if off is None else StageInput.apply(self._anchor, x, step.grads, (k, i))
            keep = None if off is None else (off, (k, i), step.saved.setdefault((k, i), []))
            y = self.stage.forward_segment(k, x, step.ctx[i], offload=keep)
            if off is not None:
                off.flush((k, i))  # this micro-batch's checkpoints leave while the next one computes
            if self.layout.is_last(k):
                y = self.stage.loss_sum(y, step.micro[i][1], step.ctx[i]) / step.normalizer
                step.loss += y.detach()
            else:
                self.comm.send(("act", v, i), y)
            step.inputs[k, i], step.outputs[k, i] = (x if off is None else None), y
        else:
            x, y = step.inputs.pop((k, i)), step.outputs.pop((k, i))
            if off is not None:  # FOLD3D §4: this backward's checkpoints (if not yet), then the next one's
                off.prefetch(reversed(step.saved[k, i]))
                following = self._next_backward.get((k, i))
                if following is not None:
                    off.prefetch(reversed(step.saved.get(following, [])))
            if self.layout.is_last(k):
                (y if self.loss_scaler is None else self.loss_scaler.scale(y)).backward()
            else:
                torch.autograd.backward(y, self.comm.recv(("grad", v, i), step.shapes[i], step.dtype))
            step.saved.pop((k, i), None)
            if not self.layout.is_first(k):
                self.comm.send(("grad", v - 1, i), x.grad if off is None else step.grads.pop((k, i)))

    def _recv_key(self, action: Action) -> Optional[tuple[str, int, int]]:
        """The message `action` waits for (None: it needs none)."""
        v = self.layout.virtual(action.segment)
        if action.kind == "F":
            return None if self.layout.is_first(action.segment) else ("act", v - 1, action.micro_batch)
        return None if self.layout.is_last(action.segment) else ("grad", v, action.micro_batch)

    def sync_segment(self, segment: int) -> None:
        """Sum segment `segment`'s gradients of this stage over dp now, blocking (in place).

        ::

            for bucket in flat buckets of [p.grad for p in stage.segment_parameters(segment)]:
                ring reduce-scatter + all-gather over dp_group      # sum: the loss is already / (B * t)

        train_step does the same asynchronously (launch after the segment's backward, wait before
        its next forward); this is the plain blocking form of it, for gradients made outside
        train_step. The segment that trains a copy of a tied embedding / head (first stage:
        segment 0, last stage: ns - 1) also sums it with the other copy's gradient, then over dp
        (a collective with that stage: call sync_segment for every segment, in one order, on
        every rank).
        After a train_step, its own sync of the segment is pending: RuntimeError. With zero=True
        the gradients are reduce-scattered into the optimizers' rows, not summed in place: RuntimeError."""
        if self.zero:
            raise RuntimeError("sync_segment: with zero=True gradients are reduce-scattered into each dp rank's "
                               "optimizer rows (train_step does it); there is no in-place sum")
        if segment in self._update_pending:
            raise RuntimeError(f"sync_segment({segment}): the last train_step already syncs this segment's "
                               "gradients; call state_dict() or close() to finish it first")
        self.sync.launch(segment)
        self.sync.wait(segment)
        if segment == self._tied_home:
            self._sum_tied()
            self.sync.wait(self.segments)

    def _global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum of the last stage's micro-batch losses over dp, broadcast over pp to every stage."""
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
        if self.pp > 1:
            dist.broadcast(loss, dist.get_global_rank(self.pp_group, self.pp - 1), group=self.pp_group)
        return loss

    # --- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys, order and shapes of the unsharded model's), on every rank.

        ::

            mine = this stage's entries of oases.full_state_dict(model)   # gathered over tp
            every stage's = all_gather_object(mine, pp_group)             # merged, in the model's key order

        Applies every pending update first (waits for its DP sync, steps its optimizer). A
        collective over the whole mesh (every rank calls it)."""
        for k in range(self.segments):
            self._apply_update(k)
        mine = self.stage.state_dict()
        parts: list[Optional[dict[str, torch.Tensor]]] = [None] * self.pp
        if self.pp > 1:
            dist.all_gather_object(parts, mine, group=self.pp_group)
        else:
            parts[0] = mine
        merged = {key: value for part in parts for key, value in part.items()}
        return {key: merged[key] for key in self.stage.key_order}

    # --- storage (oases.pipeline._storage) -------------------------------------------------------

    def load_pretrained(self, path: str | os.PathLike, *, strict: bool = True) -> tuple[list[str], list[str]]:
        """Fill the tensors this rank holds from a Hugging Face safetensors directory (each rank reads
        only its boxes), checked against the whole model on every rank first; returns the whole
        model's (missing_keys, unexpected_keys). No communication unless an update is pending."""
        result = _storage.load_pretrained(self, path, strict=strict)
        if self.zero:  # fp32 masters of 16-bit parameters start from the loaded values
            for optimizer in self.optimizers:
                optimizer.sync_masters()
        return result

    def save_pretrained(self, path: str | os.PathLike, *, max_shard_size: int = 5 * 2**30) -> None:
        """Write the unsharded model as a Hugging Face directory: rank 0 writes, each stage sends its
        tensors to it one at a time. A collective over the mesh; applies pending updates first."""
        _storage.save_pretrained(self, path, max_shard_size=max_shard_size)

    def save_checkpoint(self, path: str | os.PathLike, *, step: Optional[int] = None, extra: object = None,
                        keep: Optional[int] = None) -> str:
        """oases.save_checkpoint of the whole pipeline (every segment's optimizer too), each rank
        writing only what it holds, into path (path/step-{step:09d} with step; keep=N: the N newest
        stay); extra: anything picklable. Returns the directory published. A collective over the mesh."""
        return _storage.save_checkpoint(self, path, step=step, extra=extra, keep=keep)

    def load_checkpoint(self, path: str | os.PathLike) -> CheckpointState:
        """Load a checkpoint of this model (from any Pipeline layout, or oases.save_checkpoint of a
        TP model) into this stage's tensors and optimizers. A collective over the mesh."""
        return _storage.load_checkpoint(self, path)

    def close(self) -> None:
        """Apply every pending update (every rank calls it, as its DP sync is collective over dp),
        then end the scheduler's threads; a later train_step starts new ones."""
        if self._failed is None:
            for k in range(self.segments):
                self._apply_update(k)
        self.scheduler.close()
        if self.offloader is not None:
            self.offloader.close()
