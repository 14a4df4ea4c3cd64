"""The Hugging Face Llama of `bench layers --model llama`, and PyTorch's DTensor TP of the same model.

    config = llama_config(hidden=512, heads=8, kv_heads=4, layers=2, seq_len=64, world_size=p)
    model = build(config)                         # transformers' LlamaForCausalLM, seeded, unsharded
    plan = torchtitan_plan(config)                # {module name: ParallelStyle}: data
    peer = torch_tp(model, mesh, plan)            # a copy of `model` (same weights), parallelized
    loss = peer.step(ids)                         # forward + backward; grads in the params' layout

Two PyTorch peers, each the same weights through `parallelize_module` on a 1-D mesh, and the
peer a Hugging Face user picks first, transformers' own tensor parallelism:

    torch_tp        torchtitan's `apply_tp` for Llama, on HF's module names: sequence parallelism
                    (activations between blocks are [b, s/p, h] shards), one all-gather of a
                    block's input shared by q/k/v (gate/up) through PrepareModuleInput, a
                    reduce-scatter after o_proj / down_proj, the vocabulary-parallel embedding and
                    LM head, and the loss on vocabulary-sharded logits under `loss_parallel()`
    torch_tp_nosp   the same projections without sequence parallelism (Megatron's layout, the one
                    oases.parallelize gives): one input all-reduce in backward shared by q/k/v
                    (gate/up) through PrepareModuleInput, an all-reduce after o_proj / down_proj;
                    embedding, norms and LM head replicated. On gloo, whose reduce-scatter is an
                    all-reduce (twice the bytes), this moves fewer bytes than sequence parallelism
                    (2 ranks at 750 Mbit, 1 MiB: all-reduce 19 ms, reduce-scatter 22, all-gather 11).
    hf_tp           transformers' native TP: `from_pretrained(dir, tp_plan="auto")` (spelled
                    `distributed_config=DistributedConfig(tp_plan="auto", tp_size=p)`, its
                    non-deprecated form), the model's own plan (`LlamaConfig.base_model_tp_plan`:
                    q/k/v/gate/up "colwise", o/down "rowwise"; `embed_tokens` "embedding_rowwise",
                    `lm_head` "colwise_gather_output"), DTensor parameters on transformers' mesh.
                    See `hf_tp` for the two routes (with and without `accelerate`).

What the HF model needs for sequence parallelism (all through its public forward arguments):
`position_ids` = arange(s) for the whole sequence. Without them LlamaModel derives the positions
from its embedding's output, which is this rank's s/p rows, and the rotary embeddings (s/p) no
longer match the all-gathered queries (s): the forward raises a size mismatch.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

__all__ = [
    "CHAR_VOCAB",
    "llama_config",
    "build",
    "torchtitan_plan",
    "megatron_plan",
    "PLANS",
    "TorchTP",
    "torch_tp",
    "HF_TP",
    "hf_tp_unavailable",
    "has_accelerate",
    "hf_tp",
    "check_gradients",
]

CHAR_VOCAB = 29  # examples/train_llama.py's character vocabulary, padded to a multiple of p


def llama_config(*, hidden: int, heads: int, kv_heads: int, layers: int, seq_len: int, world_size: int):
    """examples/train_llama.py's small Llama: intermediate 2.75 h, vocabulary padded to p, sdpa."""
    from transformers import LlamaConfig

    p = world_size
    for what, n in (("heads", heads), ("kv heads", kv_heads), ("seq len (sequence parallelism)", seq_len)):
        if n % p:
            raise ValueError(f"layers --model llama: {what} {n} is not divisible by the {p} ranks")
    intermediate = -(-int(2.75 * hidden) // p) * p
    return LlamaConfig(
        vocab_size=-(-CHAR_VOCAB // p) * p,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build(config) -> nn.Module:
    """transformers' LlamaForCausalLM from seed 0 (the same weights on every rank), unsharded."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def parallelized(sizes: dict[str, int], ctx) -> tuple[Any, nn.Module]:
    """(config, model): the Llama of `sizes` (hidden, heads, kv_heads, layers, seq_len) built on
    ctx.device and sharded by oases.parallelize over ctx.group (TP = the ranks), its warnings quiet."""
    import warnings

    import oases

    keys = ("hidden", "heads", "kv_heads", "layers", "seq_len")
    config = llama_config(**{k: sizes[k] for k in keys}, world_size=ctx.world_size)
    model = build(config).to(ctx.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model, ctx.group)
    return config, model


# ---- plans: module name (`*` matches one level) -> ParallelStyle --------------------------------
def torchtitan_plan(config) -> dict[str, Any]:
    """torchtitan's apply_tp for Llama with loss parallelism, on Hugging Face's module names.

    embedding     vocabulary rows sharded; ids replicated in, [b, s/p, h] out (reduce-scatter)
    every norm    sequence parallel: [b, s/p, h] in and out
    attention     its hidden_states all-gathered to [b, s, h] once, for q/k/v together
    q/k/v, gate/up  column-parallel (output features);  o/down  row-parallel, reduce-scattered to s/p
    LM head       [b, s/p, h] all-gathered in, logits [b, s, V/p] stay sharded (loss_parallel)
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    layer = "model.layers.*."
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        layer + "input_layernorm": SequenceParallel(),
        # HF's decoder layer calls self_attn(hidden_states=..., ...): a keyword argument
        layer + "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        **{layer + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
        layer + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        layer + "post_attention_layernorm": SequenceParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        layer + "mlp.gate_proj": ColwiseParallel(),
        layer + "mlp.up_proj": ColwiseParallel(),
        layer + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def megatron_plan(config) -> dict[str, Any]:
    """The projections alone, activations replicated (no sequence parallelism), as oases shards them.

    PrepareModuleInput marks each block's input Replicate once, so the backward sums q/k/v's (gate/up's)
    input gradients before one all-reduce, rather than one all-reduce per projection.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    layer = "model.layers.*."
    return {
        layer + "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        **{layer + f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
        layer + "self_attn.o_proj": RowwiseParallel(),
        layer + "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        layer + "mlp.gate_proj": ColwiseParallel(),
        layer + "mlp.up_proj": ColwiseParallel(),
        layer + "mlp.down_proj": RowwiseParallel(),
    }


@dataclass(frozen=True)
class _PlanSpec:
    make: Callable[[Any], dict[str, Any]]
    loss_parallel: bool  # logits stay vocabulary-sharded DTensors: the loss runs under loss_parallel()
    description: str


PLANS: Mapping[str, _PlanSpec] = MappingProxyType(
    {
        "torch_tp": _PlanSpec(
            torchtitan_plan,
            True,
            "torchtitan's apply_tp (sequence parallel, vocabulary-parallel embedding and LM head, loss_parallel)",
        ),
        "torch_tp_nosp": _PlanSpec(
            megatron_plan,
            False,
            "DTensor TP without sequence parallelism (Megatron's layout; embedding, norms, LM head replicated)",
        ),
    }
)


# ---- the peer ----------------------------------------------------------------------------------
@dataclass
class TorchTP:
    """A parallelized copy of the model and how to run one training step of it."""

    name: str
    model: nn.Module
    plan: dict[str, Any]
    loss_parallel: bool
    description: str
    notes: list[str] = field(default_factory=list)
    impl: str = ""  # how the peer was built (default: parallelize_module's call)

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """zero_grad; HF's causal-LM loss (labels = input_ids, shifted inside); backward; then every
        gradient in its parameter's layout (sequence parallelism leaves the norms' as pending
        partial sums, which an optimizer step would reduce: reduced here, so the step is complete)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        self.model.zero_grad(set_to_none=True)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)  # [1, s]: all of s
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            loss = self.model(input_ids=input_ids, position_ids=positions, labels=input_ids).loss
            loss.backward()
        for p in self.model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)
        return loss.detach()

    def describe(self) -> dict[str, Any]:
        impl = self.impl or (
            "parallelize_module(LlamaForCausalLM, init_device_mesh(cpu, (p,)), plan)"
            + (" + loss_parallel()" if self.loss_parallel else "")
        )
        return {
            "impl": impl,
            "description": self.description,
            "plan": {k: v if isinstance(v, str) else repr(v) for k, v in self.plan.items()},
            "notes": list(self.notes),
        }


def torch_tp(name: str, model: nn.Module, mesh) -> TorchTP:
    """A deep copy of the unsharded `model` (the same weights), parallelized by PLANS[name]."""
    from torch.distributed.tensor.parallel import parallelize_module

    spec = PLANS[name]
    plan = spec.make(model.config)
    peer = parallelize_module(copy.deepcopy(model), mesh, plan)
    notes = [
        "step = forward + backward; no activation recomputation; eager (no torch.compile)",
        "position_ids = arange(s) passed to the HF forward (see bench._llama)",
    ]
    if spec.loss_parallel:
        notes += [
            "async TP (torchtitan's maybe_enable_async_tp) not applied: it needs torch.compile and "
            "CUDA symmetric memory",
            "norm weight gradients (Partial after backward) reduced to Replicate at the end of the step",
        ]
    return TorchTP(name, peer, plan, spec.loss_parallel, spec.description, notes)


# ---- transformers' own tensor parallelism ------------------------------------------------------
HF_TP = "hf_tp"
_HF_IMPL = (
    'LlamaForCausalLM.from_pretrained(dir, attn_implementation="sdpa", '
    'distributed_config=DistributedConfig(tp_plan="auto", tp_size=p)).train()'
)


def hf_tp_unavailable(device: Optional[torch.device] = None) -> Optional[str]:
    """Why transformers' native tensor parallelism cannot run here on `device` (the bench's; None:
    any), or None when it can. transformers puts its TP mesh on the accelerator torch reports, so
    a CPU run on a machine with a visible GPU cannot hold the peer beside the other variants."""
    if device is not None and device.type == "cpu" and torch.cuda.is_available():
        return (
            "transformers places its TP mesh on the visible GPU while this run is on the CPU; from the "
            'command line, --device cpu hides the GPUs from the ranks (CUDA_VISIBLE_DEVICES="")'
        )
    try:
        from transformers import LlamaForCausalLM
        from transformers.distributed import DistributedConfig  # noqa: F401
    except ImportError as error:
        return f"transformers has no native tensor parallelism here ({error})"
    if not all(hasattr(LlamaForCausalLM, m) for m in ("prepare_distribute_model", "maybe_distribute_model")):
        return "this transformers version lacks DistributedMixin.prepare_distribute_model / maybe_distribute_model"
    return None


def has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def hf_tp(model: nn.Module, world_size: int, *, from_pretrained: Optional[bool] = None) -> TorchTP:
    """transformers' native TP of the unsharded `model` (the same weights), as a user loads it.

    Call on every rank (collectives: the mesh, the load). Two routes to one model:

        from_pretrained (accelerate installed): rank 0 saves `model` (save_pretrained) to a
            temporary directory, every rank loads it with
            `from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto", tp_size=p))`
            (transformers 5.23 refuses any device_map, which its TP sets, without accelerate)
        in process (no accelerate): the two steps that from_pretrained runs, on a copy of
            `model`: `prepare_distribute_model(DistributedConfig(...))` (the mesh) and
            `maybe_distribute_model(copy, config, mesh)` (the plan: parameters sharded as DTensors by
            the same styles, the same forward hooks); only the weight loading is skipped, the
            copy already holds the weights (each rank keeps its shard: distribute_tensor with
            src_data_rank=None, the unsharded weights being the same on every rank)

    Checked equal on this machine (2 ranks): same weights, loss, gradients and collectives.
    `from_pretrained` None: the first route when accelerate is importable. Every rank must
    take the same route (bench.layers agrees on it first).
    """
    import shutil
    import tempfile

    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging as hf_logging

    if from_pretrained is None:
        from_pretrained = has_accelerate()
    config = DistributedConfig(tp_plan="auto", tp_size=world_size)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        if from_pretrained:
            box = [tempfile.mkdtemp(prefix="bench-hf-tp-") if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)  # the ranks of one bench share a host
            try:
                if dist.get_rank() == 0:
                    model.save_pretrained(box[0])
                dist.barrier()
                peer = LlamaForCausalLM.from_pretrained(box[0], attn_implementation="sdpa", distributed_config=config)
                dist.barrier()
            finally:
                if dist.get_rank() == 0:
                    shutil.rmtree(box[0], ignore_errors=True)
            impl = _HF_IMPL
            route = (
                "from_pretrained: rank 0 saved the unsharded weights (save_pretrained) to a temporary "
                "directory; every rank loaded its shards from it"
            )
        else:
            config, _, mesh = LlamaForCausalLM.prepare_distribute_model(config)
            peer = LlamaForCausalLM.maybe_distribute_model(copy.deepcopy(model), config, mesh)
            impl = (
                "LlamaForCausalLM.maybe_distribute_model(copy of the model, "
                '*prepare_distribute_model(DistributedConfig(tp_plan="auto", tp_size=p)))'
            )
            route = (
                "in process (accelerate not installed, which from_pretrained's TP path requires in "
                f"transformers {_transformers_version()}): the plan applied by the two steps from_pretrained "
                "runs, on a copy holding the same weights (checked equal by hand to the from_pretrained route: "
                "weights, loss, gradients, collectives)"
            )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    peer.train()  # from_pretrained returns the model in eval mode; a training loop calls train()
    notes = [
        f"route: {route}",
        'transformers\' own plan for Llama (tp_plan="auto"): q/k/v/gate/up colwise, o/down rowwise '
        "(all-reduce forward), embed_tokens embedding_rowwise (vocabulary-parallel, all-reduce forward), "
        "lm_head colwise_gather_output (logits all-gathered, loss on full logits); norms replicated",
        "no sequence parallelism (DistributedConfig.enable_sequence_parallel is reserved, not wired), no "
        "shared input marking: each colwise projection all-reduces its own input gradient in backward "
        "(q, k, v, gate, up: 5 all-reduces a layer where a shared PrepareModuleInput needs 2)",
        "step = zero_grad, forward with labels, backward; no recomputation; eager (no torch.compile)",
    ]
    description = (
        'transformers\' native tensor parallelism (from_pretrained tp_plan="auto": '
        "the model's base_model_tp_plan on DTensor)"
    )
    return TorchTP(HF_TP, peer, dict(peer.tp_plan), False, description, notes, impl=impl)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_gradients(peer: TorchTP, reference: nn.Module, rtol: float = 1e-4) -> None:
    """Every gradient of `peer` (after one step) equals the unsharded `reference`'s (after one
    step on the same batch), relative to its norm; AssertionError naming the parameter otherwise.
    A collective per DTensor gradient: call on every rank."""
    from torch.distributed.tensor import DTensor

    expected = dict(reference.named_parameters())
    for name, p in peer.model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = expected[name].grad
        if g is None or want is None or g.shape != want.shape:
            raise AssertionError(f"layers: {peer.name} gradient of {name} is missing or mis-shaped")
        error = float((g - want).norm() / want.norm().clamp_min(1e-12))
        if error > rtol:
            raise AssertionError(
                f"layers: {peer.name} gradient of {name} differs from the unsharded model's "
                f"(relative error {error:.2e}): the peer is wrong"
            )
