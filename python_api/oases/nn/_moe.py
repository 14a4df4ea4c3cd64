"""Mixture-of-experts blocks under tensor parallelism, for parallelize (plan style "experts").

A block (Mixtral's, Qwen2/3-MoE's, GPT-OSS's `mlp`, DBRX's `ffn`) holds a router, routed experts
stored fused (Hugging Face's 3-D gate_up_proj / down_proj, GPT-OSS's with biases, DBRX's packed
mlp.w1 / v1 / w2: oases.nn.experts) and, in some models, a shared expert (a dense MLP) with a
sigmoid gate (Qwen2-MoE):

    block(x) = experts(x, top_k(router(x)))  [+ sigmoid(shared_gate(x)) * shared_expert(x)]

Once its experts are planned "experts", the block is one tensor-parallel region, as a dense MLP's
column -> row pair is (p ranks, r this rank):

    experts        -> ParallelExperts: each expert's gate | up rows and down columns of rank r
                      (GPT-OSS: its (gate, up) pairs and down rows; the down bias in rank 0's sum;
                      DBRX: each expert's rows of w1, v1 and w2)
    shared_expert  -> its projections column / row by the plan, computing rank r's partial sum
                      (no communication of their own)
    router, shared gate (the block's direct parameters and nn.Linear children, and the projections
                   inside a child named as a router: DBRX's router.layer) -> replicated
    block(x) = reduce_from_tp(block_r(copy_to_tp(x)))    # hooks on the block: one all-reduce for
                                                         # the routed and the shared experts
    block_r  = the block's own forward on the shards: every term of its output is rank r's partial
               sum (the gates scale partial sums; the routing is computed alike on every rank);
               a block returning (hidden_states, router_scores) (GPT-OSS) has hidden_states reduced

Gradients. copy_to_tp sums the gradient of x over the ranks. A replicated parameter inside the
region (the router, through the combine weights; the shared gate) gets only rank r's share on
rank r: a hook sums its gradient over the group as it is computed. The router logits that leave
the block (a router returning (logits, weights, indices), Hugging Face's TopKRouter, whose block
uses only the weights and indices; output_router_logits: the load-balancing loss reads the logits)
carry the loss's whole gradient on every rank, so the router's output passes it on rank 0 of the
group only (zeros elsewhere) and the sums stay exact. A router returning its logits alone (DBRX's)
routes with the very tensor that leaves: its share of the block's gradient and the load-balancing
loss's whole one cannot be told apart, so a forward of the model asking for router logits
(output_router_logits, in the call or the config) raises a ValueError at that router. Inside
no_tp_communication (the schedules' core) the block neither enters nor reduces: the schedule does
(ParallelExperts carries the switch); the core takes a tuple's first element (its partial sum).

Before anything changes, `check_blocks` refuses (ValueError naming the module and the fix) what
would not be exact: experts in neither form ParallelExperts computes or whose intermediate size p
does not divide, a router or gate planned as sharded, a projection inside the block left out of the plan,
a row-parallel bias inside the block (the shared gate would scale it), router jitter noise
(Mixtral's router_jitter_noise, DBRX's moe_jitter_eps). Fused experts in a layout oases does not
shard (oases.nn.experts.looks_like_experts: Llama-4's, Nemotron-H's, ...) are found too, so that a
plan placing them is refused naming their layout rather than leaving them replicated unsaid.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn

from oases.comm.topology import ring_of
from oases.nn import mappings
from oases.nn._coverage import ROUTERS
from oases.nn._layer_args import is_conv1d
from oases.nn.experts import ParallelExperts, check_experts, is_fused_experts, looks_like_experts
from oases.nn.layers import ColumnParallelLinear, RowParallelLinear
from oases.nn.mappings import copy_to_tp, grad_on_lead, reduce_from_tp

__all__ = ["find_experts", "check_blocks", "make_region"]


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: module} of the model's fused routed experts: in a form ParallelExperts
    computes, or in another layout (looks_like_experts), which check_blocks refuses if planned."""
    return {name: m for name, m in model.named_modules() if name and (is_fused_experts(m) or looks_like_experts(m))}


def _jitter(block: nn.Module) -> tuple[str, object, str]:
    """(attribute, amount, the config change that removes it) of router jitter noise set on the
    block (Mixtral's jitter_noise) or on a child of it (DBRX's router.moe_jitter_eps); ("", 0, "")
    when there is none."""
    found = [("jitter_noise", block, "jitter_noise", "set the config's router_jitter_noise to 0")]
    found += [
        (f"{n}.moe_jitter_eps", child, "moe_jitter_eps", "set the config's moe_jitter_eps (ffn_config) to None")
        for n, child in block.named_children()
    ]
    for where, owner, attribute, fix in found:
        value = getattr(owner, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return where, value, fix
    return "", 0, ""


def check_blocks(
    model: nn.Module,
    experts: dict[str, nn.Module],
    kinds: dict[str, str],
    degree: Callable[[str], int],
    p: int,
    routers: frozenset[str] = ROUTERS,
) -> frozenset[str]:
    """Local checks (module doc) for the blocks of the planned `experts` ({name: module}) at their
    TP degrees (of p); `kinds`: {projection name: "column" | "row" | ...} as planned. Returns the
    names of the blocks' projections that stay replicated by design: their direct nn.Linear
    children (routers, shared gates) and the projections inside a child named in `routers`."""
    replicated = set()
    for name, module in experts.items():
        d = degree(name)
        block_name = name.rpartition(".")[0]
        where = f"{name} (planned as 'experts')"
        if not block_name:
            raise ValueError(f"{where}: the experts are the model itself; shard the model holding the MoE block")
        block = model.get_submodule(block_name)
        if d == 1 < p:  # a decoder layer of degree 1 stays unsharded
            replicated.update(
                f"{block_name}.{n}" for n, m in block.named_children() if isinstance(m, nn.Linear) or is_conv1d(m)
            )
            continue
        check_experts(where, module, d)
        attribute, jitter, fix = _jitter(block)
        if jitter:
            raise ValueError(
                f"{block_name}: router jitter noise {jitter} ({attribute}) multiplies the block's input in "
                f"place by fresh random draws; {fix} to shard its experts"
            )
        for sub_name, sub in block.named_modules():
            if not sub_name or not (isinstance(sub, nn.Linear) or is_conv1d(sub)):
                continue
            qualified = f"{block_name}.{sub_name}"
            kind = kinds.get(qualified)
            if "." not in sub_name or sub_name.split(".")[0] in routers:  # picks or weighs experts
                if kind is not None:
                    raise ValueError(
                        f"{qualified}: a router or gate of the MoE block {block_name} stays replicated "
                        f"(its output picks or weighs the experts, on every rank alike); remove it "
                        f"from the plan (it is planned as {kind!r})"
                    )
                replicated.add(qualified)
            elif kind not in ("column", "row"):
                leaf = sub_name.rpartition(".")[2]
                raise ValueError(
                    f"{qualified}: the experts of the MoE block {block_name} are sharded, so its "
                    f"other projections (a shared expert) must be too: plan {leaf!r} as 'column' or "
                    f"'row' (planned: {kind!r}), or leave the experts replicated"
                )
            elif kind == "row" and getattr(sub, "bias", None) is not None:
                raise ValueError(
                    f"{qualified}: a row-parallel projection with a bias inside the MoE block "
                    f"{block_name} (a gate may scale its output, and the bias must be added once); "
                    f"oases shards MoE blocks whose row-parallel projections have no bias"
                )
    return frozenset(replicated)


def _enter(experts: ParallelExperts, block: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the block's hidden states enter the region (copy_to_tp: bwd all-reduce)."""
    if not experts._communicate:
        return None
    if args:
        return (copy_to_tp(args[0], experts.group), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], experts.group)}
    raise TypeError(
        f"{type(block).__name__}: an MoE block with sharded experts takes its hidden states as its "
        f"first argument or as hidden_states="
    )


def _leave(experts: ParallelExperts, block: nn.Module, args: tuple, output: object):
    """Forward hook: the block's partial sums reduced once (routed and shared experts together).

    A block returning a tuple (GPT-OSS's: (hidden_states, router_scores)) has its first element
    reduced and the rest (the routing, replicated) passed as they are. Inside no_tp_communication
    (a schedule's core: oases.models._branch.Branch.core takes the tuple's first element) nothing
    is reduced."""
    is_tuple = isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor)
    if not is_tuple and not isinstance(output, torch.Tensor):
        raise TypeError(
            f"{type(block).__name__}: an MoE block with sharded experts must return its hidden states "
            f"(a tensor, or a tuple starting with it), got {type(output).__name__}"
        )
    if not experts._communicate:
        return None
    if is_tuple:
        return (reduce_from_tp(output[0], experts.group), *output[1:])
    return reduce_from_tp(output, experts.group)


class _Asked:
    """Whether a forward of `model` asks for router logits: its output_router_logits argument while
    one is running (a pre-hook sets it, a hook clears it), else its config's; and which modules'
    outputs transformers records as the router logits (`records`: by the `_can_record_outputs`
    ["router_logits"] of the model and its sub-models: a class, a class-name suffix or an OutputRecorder)."""

    def __init__(self, model: nn.Module) -> None:
        self.config = getattr(model, "config", None)
        self.call: Optional[bool] = None
        self.recorded: list[tuple[Optional[type], Optional[str]]] = []
        for m in model.modules():
            table = getattr(type(m), "_can_record_outputs", None)
            specs = table.get("router_logits") if isinstance(table, dict) else None
            for spec in specs if isinstance(specs, (list, tuple)) else [specs] if specs is not None else []:
                target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
                suffix = spec if isinstance(spec, str) else getattr(spec, "class_name", None)
                self.recorded.append((target if isinstance(target, type) else None, suffix))
        model.register_forward_pre_hook(self._enter, with_kwargs=True)
        model.register_forward_hook(self._leave, always_call=True)

    def records(self, router: nn.Module) -> bool:
        """Whether transformers records `router`'s output as the model's router logits."""
        return any(
            (target is not None and isinstance(router, target))
            or (isinstance(suffix, str) and type(router).__name__.endswith(suffix))
            for target, suffix in self.recorded
        )

    def _enter(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        value = kwargs.get("output_router_logits")
        self.call = None if value is None else bool(value)

    def _leave(self, model: nn.Module, args: tuple, output: object) -> None:
        self.call = None

    def __call__(self) -> bool:
        return self.call if self.call is not None else getattr(self.config, "output_router_logits", False) is True


_ASKED: "weakref.WeakKeyDictionary[nn.Module, _Asked]" = weakref.WeakKeyDictionary()


def _logits_on_lead(lead: bool, asked: Optional[_Asked], where: str, router: nn.Module, args: tuple, output: object):
    """Forward hook on a router: the logits that leave the block (a router returning (logits, weights,
    indices)) pass their gradient on rank 0 only; a router returning the logits it routes with alone,
    recorded as the model's router logits (`asked` given), is refused when the model's forward asks
    for them (module doc)."""
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (grad_on_lead(output[0], lead), *output[1:])
    if isinstance(output, torch.Tensor) and asked is not None and asked():
        raise ValueError(
            f"{where} ({type(router).__name__}) returns the logits its MoE block routes with, and this "
            f"forward asks for them (output_router_logits): with the block's experts sharded, the "
            f"load-balancing loss's gradient through them would be counted once per rank; pass "
            f"output_router_logits=False (and set model.config.output_router_logits = False), or leave the "
            f"experts replicated: remove the 'experts' entry from the plan"
        )
    return None


def make_region(model: nn.Module, name: str, routers: frozenset[str]) -> None:
    """The block holding the ParallelExperts at `name` as one TP region (module doc): its TP
    linears compute partial sums, hooks enter and reduce it, sum its replicated parameters'
    gradients, and pass its routers' (children named in `routers`) logits' gradient on rank 0."""
    experts = model.get_submodule(name)
    block_name = name.rpartition(".")[0]
    block = model.get_submodule(block_name)
    ring = ring_of(experts.group)
    for m in block.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m._communicate = False  # partial sums: the region enters and reduces for them
    block.register_forward_pre_hook(functools.partial(_enter, experts), with_kwargs=True)
    block.register_forward_hook(functools.partial(_leave, experts))
    sharded = {id(q) for m in block.modules() if hasattr(m, "tp_layout") for q in m.parameters()}
    names = [n for n, param in block.named_parameters() if id(param) not in sharded and param.requires_grad]
    mappings.sum_grads(block, names, experts.group)
    asked = _ASKED.get(model)
    if asked is None:
        asked = _ASKED[model] = _Asked(model)
    for child_name, child in block.named_children():
        if child_name in routers and child is not experts:
            where = f"{block_name}.{child_name}" if block_name else child_name
            recorded = asked if asked.records(child) else None  # a shared gate's output is no router logits
            hook = functools.partial(_logits_on_lead, ring.rank == 0, recorded, where)
            child.register_forward_hook(hook, prepend=True)
