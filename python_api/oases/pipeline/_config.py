"""A Pipeline's argument checks: every check that needs no model (`check_arguments`, local, so every rank
raises the same error before any communication), whose answer is the frozen `Settings` the pipeline and
its parts read; those of the built model's device and the mesh's backend, and those of a train_step's
batch; and the default optimizer (`_sgd`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases import _checks
from oases.amp import GradScaler
from oases.comm.hierarchical import HostLinks
from oases.models.gpt import GPTConfig
from oases.nn.vocab import IGNORE_INDEX
from oases.offload import Offloader
from oases.pipeline._hierarchy import check_dp_hierarchy
from oases.pipeline._layout import check_layers
from oases.pipeline.schedules import SCHEDULES

__all__ = ["MESH_DIMS", "Settings", "check_arguments", "mesh_device", "model_device", "check_backend", "check_batch"]

MESH_DIMS = ("dp", "pp", "tp")


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Pipeline's default optimizer (its `optimizer` argument): one segment's SGD with lr=0.1."""
    return torch.optim.SGD(params, lr=0.1)


@dataclass(frozen=True)
class Settings:
    """Pipeline(...)'s arguments once checked (each one's contract: the constructor's Args), and what the
    checks found: the mesh sizes {"dp": .., "pp": .., "tp": ..}; how many of each dp group's ranks a host
    holds (None: a flat DP sync); the host links dp_hierarchy="auto" chooses on."""

    config: GPTConfig | Callable[[], nn.Module]
    mesh: object
    schedule: str
    segments: int | str
    micro_batches: int
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    seed: int
    dp_overlap_ratio: float | str
    preemption: bool
    dp_bucket_numel: int
    dp_chunk_bytes: int
    offload: bool | Offloader
    dp_hierarchy: bool | str
    init_weights: bool
    zero: bool
    loss_scaler: Optional[GradScaler]
    max_grad_norm: Optional[float]
    sizes: dict[str, int]
    dp_packing: Optional[int]
    dp_links: Optional[HostLinks]

    @property
    def auto(self) -> dict[str, bool]:
        """Which of segments / dp_overlap_ratio are chosen on the first train_step ("auto"; FOLD3D's
        segment rule models aiao's overlap, so with gpipe or 1f1b "auto" means one segment)."""
        return {
            "segments": self.segments == "auto" and self.schedule == "aiao",
            "dp_overlap_ratio": self.dp_overlap_ratio == "auto",
        }

    @property
    def first_layout(self) -> tuple[int, float]:
        """(segments, dp_overlap_ratio) the pipeline runs until "auto" has chosen (1 and 1.0 for "auto")."""
        return (
            1 if self.segments == "auto" else self.segments,
            1.0 if self.dp_overlap_ratio == "auto" else self.dp_overlap_ratio,
        )


def check_arguments(
    config: GPTConfig | Callable[[], nn.Module],
    mesh,
    *,
    schedule: str,
    segments: int | str,
    micro_batches: int,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    seed: int,
    dp_overlap_ratio: float | str,
    preemption: bool,
    dp_bucket_numel: int,
    dp_chunk_bytes: int,
    init_weights: bool,
    zero: bool,
    loss_scaler: Optional[GradScaler],
    dp_hierarchy: bool | str,
    offload: bool | Offloader,
    max_grad_norm: Optional[float] = None,
) -> Settings:
    """Every argument check of Pipeline(...) that needs no model, in the constructor's order (local
    only: every rank raises the same error); the Settings they validate."""
    sizes = _check_config(
        config, mesh, schedule, segments, micro_batches, dp_overlap_ratio, dp_bucket_numel, dp_chunk_bytes
    )
    if not isinstance(init_weights, bool):
        raise TypeError(f"init_weights: expected a bool, got {init_weights!r}")
    if not isinstance(zero, bool):
        raise TypeError(f"zero: expected a bool, got {zero!r}")
    _check_loss_scaler(loss_scaler, zero)
    if zero and dp_hierarchy is not False:
        raise ValueError(f"zero: the ZeRO sync runs flat rings over dp; pass dp_hierarchy=False (got {dp_hierarchy!r})")
    dp_packing = check_dp_hierarchy(dp_hierarchy, mesh)  # before any communication, like every check
    dp_links = HostLinks.from_env() if dp_hierarchy == "auto" and dp_packing is not None else None
    if not isinstance(offload, (bool, Offloader)):
        raise TypeError(f"offload: expected a bool or an oases.offload.Offloader, got {type(offload).__name__}")
    number = isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool)
    if max_grad_norm is not None and not (number and 0 < max_grad_norm < math.inf):
        raise ValueError(f"max_grad_norm: expected a finite number > 0 (or None: no clipping), got {max_grad_norm!r}")
    return Settings(
        config=config,
        mesh=mesh,
        schedule=schedule,
        segments=segments,
        micro_batches=micro_batches,
        optimizer=optimizer,
        seed=seed,
        dp_overlap_ratio=dp_overlap_ratio,
        preemption=preemption,
        dp_bucket_numel=dp_bucket_numel,
        dp_chunk_bytes=dp_chunk_bytes,
        offload=offload,
        dp_hierarchy=dp_hierarchy,
        init_weights=init_weights,
        zero=zero,
        loss_scaler=loss_scaler,
        max_grad_norm=max_grad_norm,
        sizes=sizes,
        dp_packing=dp_packing,
        dp_links=dp_links,
    )


def _check_loss_scaler(loss_scaler: Optional[GradScaler], zero: bool) -> None:
    if loss_scaler is not None and not isinstance(loss_scaler, GradScaler):
        raise TypeError(
            f"loss_scaler: expected an oases.amp.GradScaler (its inf/NaN verdict spans every rank, "
            f"so every stage and replica skips the same steps), got {type(loss_scaler).__name__}"
        )
    if (
        loss_scaler is not None
        and loss_scaler.group is not None
        and dist.get_world_size(loss_scaler.group) != dist.get_world_size()
    ):
        raise ValueError(
            "loss_scaler: its group must span every rank of the pipeline (stages and replicas take "
            "one verdict); make it with group=None (the world)"
        )
    if loss_scaler is not None and zero:
        raise ValueError(
            "loss_scaler: not with zero=True (the sharded optimizer's masters are not unscaled); pass zero=False"
        )


def _check_config(
    config: GPTConfig | Callable[[], nn.Module],
    mesh,
    schedule: str,
    segments: int,
    micro_batches: int,
    dp_overlap_ratio: float,
    dp_bucket_numel: int,
    dp_chunk_bytes: int,
) -> dict[str, int]:
    """The checks of the numbers, the model description, the mesh and the schedule (local only, so
    every rank raises the same error). Returns the mesh sizes {"dp": .., "pp": .., "tp": ..}."""
    if dp_overlap_ratio != "auto" and (
        isinstance(dp_overlap_ratio, bool)
        or not isinstance(dp_overlap_ratio, (int, float))
        or not 0.0 <= dp_overlap_ratio <= 1.0
    ):
        raise ValueError(f"dp_overlap_ratio: expected a number in [0, 1] or 'auto', got {dp_overlap_ratio!r}")
    if not _checks.is_int(dp_bucket_numel) or dp_bucket_numel < 1:
        raise ValueError(f"dp_bucket_numel: expected an int >= 1, got {dp_bucket_numel!r}")
    if not _checks.is_int(dp_chunk_bytes) or dp_chunk_bytes < 1:
        raise ValueError(f"dp_chunk_bytes: expected an int >= 1 (bytes per DP ring piece), got {dp_chunk_bytes!r}")
    if not isinstance(config, GPTConfig) and not callable(config):
        raise ValueError(
            f"config: expected an oases.models.GPTConfig or a model factory (a callable returning "
            f"the model), got {type(config).__name__}"
        )
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if sorted(names) != sorted(MESH_DIMS):
        raise ValueError(f"mesh: expected dimensions named {MESH_DIMS}, got {names or 'none'}")
    sizes = {name: mesh.size(names.index(name)) for name in MESH_DIMS}
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("mesh: torch.distributed is not initialized")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"mesh: dp * pp * tp = {sizes['dp']} * {sizes['pp']} * {sizes['tp']} = {mesh.size()}, "
            f"but the world size is {world}"
        )
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
        check_layers("config.layers", config.layers, sizes["pp"], 1 if segments == "auto" else segments)
        for what, size in (("heads", config.heads), ("hidden * mlp_ratio", config.hidden * config.mlp_ratio)):
            if size % sizes["tp"]:
                raise ValueError(f"config.{what}: {size} is not divisible by tp = {sizes['tp']}")
    return sizes


def mesh_device(mesh) -> torch.device:
    """The device a meta-built stage is allocated on: the mesh's device type (CUDA: the current GPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def model_device(model: nn.Module) -> torch.device:
    """The one device the built model's parameters are on (meta ones, other stages' in a meta build, aside)."""
    devices = {p.device for p in model.parameters() if not p.is_meta}  # meta: other stages' (meta build)
    if len(devices) != 1:
        raise ValueError(
            f"config: the model's parameters are on {len(devices)} devices "
            f"({sorted(map(str, devices))}); "
            "a stage runs on one device: move the model there in the factory"
        )
    return devices.pop()


def check_backend(group: dist.ProcessGroup, device: torch.device) -> None:
    """The pipeline's tensors live on `device`: the group must carry that device's tensors (gloo
    for CPU, NCCL for CUDA; "cpu:gloo,cuda:nccl" carries both)."""
    config = str(dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else dist.get_backend(group))
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    backend = per_device.get(device.type, config if not per_device else None)
    want = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
    if backend != want:
        raise ValueError(
            f"mesh: the model's parameters are on {device.type} but the mesh's groups use {config!r}; "
            f"{device.type} tensors need {want!r} (init the process group with {want!r} or "
            "'cpu:gloo,cuda:nccl', and the mesh on the model's device type)"
        )


def check_batch(tokens: torch.Tensor, targets: torch.Tensor, settings: Settings, *, vocab: int) -> None:
    """train_step's checks of its global batch (the same on every rank, so every rank raises alike) for
    the pipeline's `settings` (config.seq_len, dp, micro_batches); `vocab`: the model's vocabulary size."""
    seq_len = settings.config.seq_len if isinstance(settings.config, GPTConfig) else None
    dp, micro_batches = settings.sizes["dp"], settings.micro_batches
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(
            f"tokens: expected an int64 tensor [batch, t], got "
            f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}"
        )
    if not isinstance(targets, torch.Tensor) or targets.shape != tokens.shape:
        raise ValueError(
            f"targets: expected the tokens' shape {tuple(tokens.shape)}, got {tuple(getattr(targets, 'shape', ()))}"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"targets: expected int64 class indices, got {targets.dtype}")
    if tokens.shape[1] == 0 or (seq_len is not None and tokens.shape[1] > seq_len):
        raise ValueError(f"tokens: {tokens.shape[1]} positions; expected 1 to config.seq_len = {seq_len}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):  # they would raise mid-step
        raise ValueError(
            f"tokens: values must lie in [0, vocab_size = {vocab}), got [{int(tokens.min())}, {int(tokens.max())}]"
        )
    learned = targets[targets != IGNORE_INDEX]
    if learned.numel() and (int(learned.min()) < 0 or int(learned.max()) >= vocab):
        bad = learned[(learned < 0) | (learned >= vocab)]
        raise ValueError(
            f"targets: values must lie in [0, vocab_size = {vocab}) or be {IGNORE_INDEX} (no loss there), "
            f"got {int(bad[0])}"
        )
    if targets.numel() and not learned.numel():
        raise ValueError(f"targets: every position is {IGNORE_INDEX} (ignored): the batch has no token to learn from")
    if tokens.shape[0] % dp:
        raise ValueError(f"tokens: {tokens.shape[0]} rows are not divisible by dp = {dp}")
    if tokens.shape[0] // dp < micro_batches:
        raise ValueError(
            f"micro_batches: {micro_batches} micro-batches, but each DP rank has only {tokens.shape[0] // dp} rows"
        )
