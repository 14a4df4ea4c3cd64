"""Attention modules once their head projections are column-parallel: per-rank head counts.

Each rank computes num_heads/p query heads and num_kv_heads/p key/value heads (whole heads: both
counts must divide by p), or, at p > num_kv_heads with p % num_kv_heads == 0, the one key/value
head its query heads use, held alike by p / num_kv_heads ranks (oases.nn._kv). parallelize makes
the attention module (the parent of a sharded head projection) think in per-rank counts, and
never touches the shared config:

    module.<a> //= p   for every int attribute a in PER_RANK_ATTRIBUTES the module holds itself
                       (a key-value head count below p: 1)
    module.num_key_value_groups = this rank's query heads / its kv heads (changed only at p > kv)
    module.config  ->  a view of the shared config whose head counts are this rank's
                       (Phi-3 slices its fused q|k|v with config.num_attention_heads * head_dim);
                       every other attribute, and every write, goes to the shared config
    norms over the projected width (OLMo-2's q_norm [heads * head_dim]) -> ShardedRMSNorm
                       (oases.nn.norm), their weights sharded like the projection's outputs
    per-head parameters: the module's own parameters whose leading dim is its query head count
                       (GPT-OSS's attention sinks [heads], one logit per query head) -> cut by query
                       heads, rank r keeping [r * heads/p, (r + 1) * heads/p) as q_proj's rows (also
                       at p > kv_heads); the module's tp_layout() says so (ShardRule(0)), `group` its group
    other parameters of the module (Qwen3's per-head q_norm / k_norm, shared by every head)
                       -> their gradient summed over the group (each rank saw its heads only)

`qkv_parts` gives the block sizes of a fused [q | k | v] projection from the module's head counts,
for the plan style "column:qkv" (GQA: the blocks differ, so equal thirds would be wrong).
`fused_layout` says how a known attention class's forward lays out its fused projection (FUSED_LAYOUTS:
DBRX's Wqkv and multi-query GPTBigCode / Falcon are [q | k | v] blocks, GPT-NeoX / BLOOM / Persimmon
and multi-head GPTBigCode / Falcon go head by head, Falcon's new_decoder_architecture group by group);
for those the layout, not the plan's column variant, decides the shards (oases.nn._plan_checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases._sharding import ShardRule
from oases.comm.topology import ring_of
from oases.nn import mappings
from oases.nn.norm import ShardedRMSNorm
from oases.nn.parts import HEAD_PROJECTIONS, is_norm

__all__ = [
    "PER_RANK_ATTRIBUTES",
    "count",
    "heads",
    "check_heads",
    "check_widths",
    "localize_heads",
    "qkv_parts",
    "FUSED_LAYOUTS",
    "fused_layout",
    "full_width_norms",
    "check_norm_form",
    "shard_norms",
    "head_parameters",
    "shard_head_parameters",
    "sum_head_shared_grads",
    "head_dim",
]

# Integer attributes of an attention module that count its heads or the features made of them.
PER_RANK_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_head",
    "n_kv_heads",
    "hidden_size",
    "embed_dim",
    "n_embd",
    "split_size",
    "all_head_size",
    "kv_heads",
)
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "n_kv_heads", "kv_heads")


def count(module: nn.Module, names: tuple[str, ...]) -> Optional[tuple[str, int]]:
    """(where, value) of the first head count found on the module, else on its config."""
    for owner, label in ((module, ""), (getattr(module, "config", None), "config.")):
        for n in names:
            value = getattr(owner, n, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return label + n, value
    return None


def heads(module: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """(query heads, key-value heads) of an attention module (None: not found; kv defaults to heads)."""
    q = count(module, _HEAD_COUNTS)
    kv = count(module, _KV_HEAD_COUNTS)
    return (None if q is None else q[1]), (None if kv is None else kv[1])


def head_dim(module: nn.Module) -> Optional[int]:
    value = getattr(module, "head_dim", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _replicated(value: int, p: int) -> bool:
    """A key-value head count below p that divides it: each head held alike by p / value ranks."""
    return 0 < value < p and p % value == 0


def check_heads(name: str, module: nn.Module, p: int) -> None:
    where = name or "the model"
    for names in (_HEAD_COUNTS, _KV_HEAD_COUNTS):
        found = count(module, names)
        if found is not None and found[1] % p and not (names is _KV_HEAD_COUNTS and _replicated(found[1], p)):
            attr, value = found
            more = (
                " or a multiple of it (each key-value head then held by several ranks)"
                if names is _KV_HEAD_COUNTS
                else ""
            )
            raise ValueError(
                f"{where}: {attr}={value} is not divisible by the tensor-parallel world size {p}; "
                f"each rank must hold whole heads, so use a world size that divides {value}{more}"
            )
    for attr in PER_RANK_ATTRIBUTES:
        value = vars(module).get(attr)
        if attr in _KV_HEAD_COUNTS and isinstance(value, int) and _replicated(value, p):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value % p:
            raise ValueError(
                f"{where}: {attr}={value} is not divisible by the tensor-parallel world size {p}; "
                f"this rank's share of it would not be whole"
            )
    if p > 1 and count(module, _HEAD_COUNTS) is None and head_dim(module) is None:
        raise ValueError(
            f"{where}: its head projections are sharded over {p} ranks, but oases finds no head count on "
            f"{type(module).__name__} (an int {', '.join(_HEAD_COUNTS)}, on it or on its config) to make this "
            f"rank's, nor a head_dim: its forward would split this rank's share of the features into the full "
            f"number of heads. Store the head count as num_heads (oases divides it by {p}), or a head_dim with "
            f"heads viewed as (..., -1, head_dim)"
        )
    taken = [attr for attr in ("tp_layout", "group") if hasattr(module, attr)]
    if head_parameters(module) and taken:
        raise ValueError(
            f"{where}: {type(module).__name__} has per-head parameters "
            f"({', '.join(head_parameters(module))}) that oases shards by heads, and already an "
            f"attribute {taken[0]!r}, which oases would set to say how; rename that attribute, or "
            f"leave the attention unsharded (remove its projections from the plan)"
        )


def check_widths(name: str, attention: nn.Module, widths: dict[str, int]) -> None:
    """The sharded head projections' output widths agree with the module's head counts and head_dim
    (q_proj: heads * d, k_proj / v_proj: kv_heads * d), else ValueError: a rank would hold other
    features than its heads' (checked where the module says its head_dim and head counts)."""
    q, kv = heads(attention)
    d = head_dim(attention)
    if q is None or d is None:
        return
    expected = {"q_proj": q * d, "k_proj": (kv or q) * d, "v_proj": (kv or q) * d}
    for child, want in expected.items():
        if child in widths and widths[child] != want:
            raise ValueError(
                f"{name}.{child}: out_features={widths[child]}, but its attention module has "
                f"{q if child == 'q_proj' else kv or q} heads of head_dim={d} ({want} features); "
                f"oases would shard heads that the module does not count. Check the model's config"
            )


def qkv_parts(name: str, attention: nn.Module, out_features: int) -> tuple[int, int, int]:
    """(q, k, v) widths of a fused [q | k | v] projection with `out_features` outputs, from the
    attention module's head counts: (heads * d, kv_heads * d, kv_heads * d), d = out / (heads + 2 kv_heads)."""
    q, kv = heads(attention)
    if q is None:
        raise ValueError(
            f"{name}: planned as 'column:qkv', but its attention module has no head count "
            f"(num_heads / num_attention_heads, on it or its config); give the block sizes instead, "
            f"'column:<q>,<k>,<v>'"
        )
    kv = q if kv is None else kv
    d, rest = divmod(out_features, q + 2 * kv)
    if rest or (head_dim(attention) not in (None, d)):
        raise ValueError(
            f"{name}: out_features={out_features} is not (heads + 2 * kv_heads) * head_dim with "
            f"heads={q}, kv_heads={kv}"
            + (f", head_dim={head_dim(attention)}" if head_dim(attention) else "")
            + "; give the block sizes, 'column:<q>,<k>,<v>'"
        )
    return q * d, kv * d, kv * d


def _bigcode_layout(attention: nn.Module) -> str:
    if getattr(attention, "is_cross_attention", False):
        return "cross"
    return "qkv" if getattr(attention, "multi_query", False) else "heads"


def _falcon_layout(attention: nn.Module) -> str:
    if getattr(attention, "new_decoder_architecture", False):
        return "groups"
    return "qkv" if getattr(attention, "multi_query", False) else "heads"


# Attention classes (by class name, anywhere in the MRO) whose forward fixes how the outputs of their
# fused q/k/v projection map to heads: {class: (projection child, its layout given the module)}.
#   "qkv"     [q (heads * d) | k (kv * d) | v (kv * d)]: three blocks, each cut by heads (qkv_parts),
#             K / V replicated at p > kv_heads (oases.nn._kv)
#   "heads"   head by head, [q_h | k_h | v_h] for each head (kv_heads == heads): whole-width shards
#             ("column") hold whole heads
#   "groups"  key-value head by key-value head, [q (heads / kv_heads of them) | k_g | v_g] for each:
#             whole-width shards hold whole groups (kv_heads % p == 0; refused at p > kv_heads)
#   "cross"   GPTBigCode's cross-attention c_attn [k | v] beside a q_attn: refused
FUSED_LAYOUTS: dict[str, tuple[str, Callable[[nn.Module], str]]] = {
    "DbrxAttention": ("Wqkv", lambda attention: "qkv"),
    "GPTBigCodeAttention": ("c_attn", _bigcode_layout),
    "FalconAttention": ("query_key_value", _falcon_layout),
    "GPTNeoXAttention": ("query_key_value", lambda attention: "heads"),
    "BloomAttention": ("query_key_value", lambda attention: "heads"),
    "PersimmonAttention": ("query_key_value", lambda attention: "heads"),
}


def fused_layout(attention: nn.Module, child: str) -> Optional[str]:
    """The layout ("qkv", "heads", "groups", "cross": FUSED_LAYOUTS) of the attention module's fused
    q/k/v projection `child`, where its class's forward fixes it; None elsewhere (the plan decides)."""
    for cls in type(attention).__mro__:
        found = FUSED_LAYOUTS.get(cls.__name__)
        if found is not None:
            return found[1](attention) if found[0] == child else None
    return None


class _RankConfig:
    """The shared config seen with this rank's head counts (`own`); all else, writes too, is the config's."""

    def __init__(self, config: object, own: dict[str, int]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_own", own)

    def __getattr__(self, name: str):
        if name.startswith("__") or "_own" not in self.__dict__:
            raise AttributeError(name)
        own = self.__dict__["_own"]
        return own[name] if name in own else getattr(self.__dict__["_config"], name)

    def __setattr__(self, name: str, value: object) -> None:
        if name in self._own:
            raise AttributeError(
                f"{name}: this attention module's per-rank head count; set it on the shared config "
                f"before oases.parallelize"
            )
        setattr(self._config, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._own}, of {type(self._config).__name__})"


def _per_rank(attr: str, value: int, p: int) -> int:
    return 1 if attr in _KV_HEAD_COUNTS and _replicated(value, p) else value // p


def localize_heads(module: nn.Module, p: int) -> None:
    """Make the module's head counts (and widths made of heads), and its config's, this rank's."""
    q, kv = heads(module)
    if (
        q is not None
        and kv is not None
        and _replicated(kv, p)
        and isinstance(vars(module).get("num_key_value_groups"), int)
    ):
        module.num_key_value_groups = q // p  # this rank's query heads all use its one kv head
    for attr in PER_RANK_ATTRIBUTES:
        value = vars(module).get(attr)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(module, attr, _per_rank(attr, value, p))
    config = vars(module).get("config")
    if config is None or isinstance(config, _RankConfig):
        return
    own = {}
    for names in (_HEAD_COUNTS, _KV_HEAD_COUNTS):
        for n in names:
            value = getattr(config, n, None)
            if isinstance(value, int) and not isinstance(value, bool):
                own[n] = _per_rank(n, value, p)
    full = next((getattr(config, n) for n in _HEAD_COUNTS if n in own), None)
    hidden = getattr(config, "hidden_size", None)
    if full and getattr(config, "head_dim", None) is None and isinstance(hidden, int):
        own["head_dim"] = hidden // full  # derived from the full counts (getattr(config, "head_dim", h // heads))
    if own:
        module.config = _RankConfig(config, own)


def full_width_norms(attention: nn.Module, widths: dict[str, int]) -> dict[str, str]:
    """{norm child: the head projection it normalises} for the attention module's norms whose
    weight spans a column-sharded projection's whole output width (OLMo-2's q_norm, k_norm), by
    size: `widths` maps each sharded head projection's child name to its out features."""
    found = {}
    for child, module in attention.named_children():
        weight = getattr(module, "weight", None)
        if child in HEAD_PROJECTIONS or not is_norm(module) or weight is None:
            continue
        match = [proj for proj, width in widths.items() if width == weight.shape[0]]
        if match and weight.shape[0] != head_dim(attention):
            found[child] = match[0]
    return found


def _eps(norm: nn.Module) -> Optional[float]:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return None


def check_norm_form(name: str, norm: nn.Module) -> tuple[float, bool]:
    """(eps, unit_offset) of an RMS norm that ShardedRMSNorm reproduces, checked on a random input
    when its weight is real (a private generator: no global random state is used); else ValueError."""
    eps = _eps(norm)
    if eps is None or "rms" not in type(norm).__name__.lower():
        raise ValueError(
            f"{name}: a {type(norm).__name__} over the whole projected width of a sharded head "
            f"projection; oases shards only RMS norms (weight * x / rms(x), with variance_epsilon or "
            f"eps) there. Leave the attention unsharded (remove its projections from the plan)"
        )
    weight = norm.weight
    if weight.is_meta:
        return eps, "gemma" in type(norm).__name__.lower()  # no values to check: Gemma's norms scale by 1 + w
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=g).to(weight.device, weight.dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if weight.dtype in (torch.float32, torch.float64) else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        got = norm(x).float()
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        for unit_offset in (False, True):
            scale = weight.float() + (1.0 if unit_offset else 0.0)
            if torch.allclose(got, scale * h, **tol):
                return eps, unit_offset
    raise ValueError(
        f"{name}: its output is neither weight * x / rms(x) nor (1 + weight) * x / rms(x), which "
        f"ShardedRMSNorm computes over the sharded width; leave the attention unsharded (remove "
        f"its projections from the plan)"
    )


def shard_norms(attention: nn.Module, norms: dict[str, tuple[float, bool]], group: Optional[dist.ProcessGroup]) -> None:
    """Replace each named norm child by its ShardedRMSNorm over `group` (values copied)."""
    for child, (eps, unit_offset) in norms.items():
        setattr(
            attention,
            child,
            ShardedRMSNorm.from_norm(getattr(attention, child), group, eps=eps, unit_offset=unit_offset),
        )


def head_parameters(attention: nn.Module) -> tuple[str, ...]:
    """Names of the attention module's own parameters (not its children's: norms, projections)
    whose leading dim is its query head count: one entry per query head (GPT-OSS's sinks)."""
    q, _ = heads(attention)
    if q is None:
        return ()
    return tuple(n for n, t in attention.named_parameters(recurse=False) if t.dim() >= 1 and t.shape[0] == q)


@dataclass(frozen=True)
class _HeadLayout:
    """An attention module's tp_layout(): its per-head parameters cut by query heads (dim 0)."""

    names: tuple[str, ...]

    def __call__(self) -> dict[str, ShardRule]:
        return {n: ShardRule(0) for n in self.names}


def shard_head_parameters(attention: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Keep this rank's query heads of the module's per-head parameters (`head_parameters`; run
    before localize_heads, which makes the head counts per-rank), and say so:

        param [heads, ...] -> param[r * heads/p : (r + 1) * heads/p]     (values and requires_grad kept)
        attention.tp_layout() == {name: ShardRule(0), ...},  attention.group = group
    """
    names = head_parameters(attention)
    if not names:
        return
    ring = ring_of(group)
    rule = ShardRule(0)
    for name in names:
        full = getattr(attention, name)
        shard = rule.shard(full.detach(), ring.rank, ring.size).clone()
        setattr(attention, name, nn.Parameter(shard, requires_grad=full.requires_grad))
    attention.tp_layout = _HeadLayout(names)
    attention.group = group


def sum_head_shared_grads(attention: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Parameters of an attention module outside its TP modules and its per-head parameters
    (Qwen3's per-head q_norm / k_norm weights, shared by every head) see only this rank's heads:
    their gradient is all-reduced over the group as it is computed, so .grad holds the full
    gradient (a hook per parameter)."""
    tp_modules = [m for m in attention.modules() if hasattr(m, "tp_layout") and m is not attention]
    in_tp = {id(q) for m in tp_modules for q in m.parameters()}
    layout = getattr(attention, "tp_layout", None)
    if callable(layout):  # its own per-head parameters (shard_head_parameters)
        in_tp |= {id(attention.get_parameter(name)) for name in layout()}
    names = [n for n, param in attention.named_parameters() if id(param) not in in_tp and param.requires_grad]
    mappings.sum_grads(attention, names, group)
