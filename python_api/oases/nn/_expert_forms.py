"""The expert modules ParallelExperts takes: which forms they come in (fused [E, ...] tensors,
transformers' interleaved gate_up, DBRX's packed w1/v1/w2, a list of expert MLPs), the flags that
select them, and the checks that refuse what cannot be sharded (oases.nn.experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from oases import _checks

# The flags transformers' use_experts_implementation sets, for the two forms ParallelExperts computes.
_LAYOUTS = {
    "concatenated": {
        "is_concatenated": True,
        "is_transposed": False,
        "has_bias": False,
        "has_gate": True,
        "has_post_expert_norm": False,
    },
    "interleaved": {
        "is_concatenated": False,
        "is_transposed": True,
        "has_bias": True,
        "has_gate": True,
        "has_post_expert_norm": False,
    },
}
_INTERLEAVED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_PACKED = ("w1", "v1", "w2")  # DBRX's mlp: gate, up, down, each [E * I, H]
# use_experts_implementation's flags and their defaults (a fused module's layout, as transformers names it)
_FLAGS = {
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert gate over interleaved gate / up pairs (elementwise in the pairs):

    __call__(gate_up [..., 2m]) -> [..., m]
        g, u = gate_up[..., ::2], gate_up[..., 1::2]
        c    = clamp(g, max=limit)
        out  = (clamp(u, -limit, limit) + 1) * c * sigmoid(alpha * c)
    """

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2m] -> [..., m], as the class docstring writes it."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # [..., m] each
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _sharded(module: nn.Module) -> bool:
    """Whether `module` is experts sharded already (a ParallelExperts)."""
    from oases.nn.experts import ParallelExperts  # which imports this module

    return isinstance(module, ParallelExperts)


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    return _checks.is_int(value) and value > 0


def _packed(module: nn.Module) -> bool:
    """DBRX's packed experts (oases.nn.experts' module doc): no parameters of its own, a child `mlp` holding exactly
    w1, v1, w2, each [E * I, H] for the module's ints num_experts E, ffn_hidden_size I and
    hidden_size H, and a callable activation_fn."""
    e, i, h = (getattr(module, a, None) for a in ("num_experts", "ffn_hidden_size", "hidden_size"))
    mlp = getattr(module, "mlp", None)
    if not (_positive(e) and _positive(i) and _positive(h)) or not isinstance(mlp, nn.Module):
        return False
    if {n for n, _ in module.named_parameters()} != {f"mlp.{n}" for n in _PACKED}:
        return False
    return callable(getattr(mlp, "activation_fn", None)) and all(
        tuple(getattr(mlp, n).shape) == (e * i, h) for n in _PACKED
    )


def _form(module: nn.Module) -> Optional[str]:
    """ "concatenated", "interleaved" or "packed" (oases.nn.experts' module doc) for Hugging Face's fused experts,
    unsharded, by their parameters' names and shapes (I > 0); None for anything else:

        concatenated  exactly gate_up_proj [E, 2I, H], down_proj [E, H, I], and an act_fn
        interleaved   exactly gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H],
                      down_proj_bias [E, H]; flags is_concatenated False (or absent: 5.0) and
                      is_transposed True (as transformers' use_experts_implementation sets them),
                      numbers alpha and limit
        packed        DBRX's: no own parameters, mlp.w1 / v1 / w2 [E * I, H] (_packed)
    """
    if _sharded(module):
        return None
    if _packed(module):
        return "packed"
    own = dict(module.named_parameters(recurse=False))
    if set(own) == {"gate_up_proj", "down_proj"} and callable(getattr(module, "act_fn", None)):
        gate_up, down = own["gate_up_proj"], own["down_proj"]
        if gate_up.dim() != 3 or down.dim() != 3:
            return None
        e, two_i, h = gate_up.shape
        ok = two_i % 2 == 0 and two_i > 0 and tuple(down.shape) == (e, h, two_i // 2)
        return "concatenated" if ok else None
    if set(own) == set(_INTERLEAVED):
        # transformers 5.0 sets no is_concatenated (its gate checks the interleaving: check_experts)
        if (
            getattr(module, "is_concatenated", False) is not False
            or getattr(module, "is_transposed", None) is not True
            or not (_real(getattr(module, "alpha", None)) and _real(getattr(module, "limit", None)))
        ):
            return None
        gate_up = own["gate_up_proj"]
        if gate_up.dim() != 3 or gate_up.shape[2] % 2 or gate_up.shape[2] == 0:
            return None
        e, h, two_i = gate_up.shape
        want = {"gate_up_proj_bias": (e, two_i), "down_proj": (e, two_i // 2, h), "down_proj_bias": (e, h)}
        return "interleaved" if all(tuple(own[n].shape) == s for n, s in want.items()) else None
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """Hugging Face's fused routed experts, unsharded, in one of the three forms of the module doc
    (by their parameters: a ParallelExperts is not)."""
    return _form(module) is not None


def looks_like_experts(module: nn.Module) -> bool:
    """Fused experts in a layout of none of the forms (oases.nn.experts' module doc): a module whose class is named
    ...Experts, with a parameter of its own of 3 or more dims, that is_fused_experts does not know."""
    return (
        type(module).__name__.endswith("Experts")
        and not _sharded(module)
        and any(q.dim() >= 3 for q in module.parameters(recurse=False))
        and _form(module) is None
    )


def expert_weights(module: nn.Module) -> tuple[str, ...]:
    """The names (relative to the module, dotted into a child) of the weights of fused experts,
    sharded (ParallelExperts) or not, that expert TP cuts (biases aside); () for any other module."""
    form = module.form if _sharded(module) else _form(module)
    if form is None:
        return ()
    return tuple(f"mlp.{n}" for n in _PACKED) if form == "packed" else ("gate_up_proj", "down_proj")


def is_experts(module: nn.Module) -> bool:
    """Fused routed experts, sharded (ParallelExperts) or not."""
    return _sharded(module) or is_fused_experts(module)


def _gate_matches(experts: nn.Module, swiglu: ClampedSwiGLU) -> bool:
    """Whether the experts' own _apply_gate computes `swiglu`, on values either side of its limit
    (a private generator: no global random state is used)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64) * (2.0 * abs(swiglu.limit) + 1.0)
    with torch.no_grad():
        got = experts._apply_gate(x)
    return isinstance(got, torch.Tensor) and got.shape == (5, 4) and torch.allclose(got, swiglu(x))


def _glu_matches(mlp: nn.Module) -> bool:
    """Whether the packed experts' mlp.forward(x, w1_e, v1_e, w2_e) computes
    (act(x @ w1_e.T) * (x @ v1_e.T)) @ w2_e with its activation_fn, on small draws of its arguments
    (a private generator: no global random state is used; the module's own tensors are not read)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x, w1, v1, w2 = (torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (5, 3, 3, 3))  # x [5, 4], w [3, 4]
    try:
        with torch.no_grad():
            got = mlp.forward(x, w1, v1, w2)
            want = (mlp.activation_fn(x @ w1.T) * (x @ v1.T)) @ w2
    except (TypeError, RuntimeError, ValueError):
        return False
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want)


def _layout_of(module: nn.Module) -> str:
    """A module's parameters with their shapes (a child's dotted) and its layout flags that differ
    from transformers' defaults: how a refusal names the layout."""
    shapes = [f"{n} {list(q.shape)}" for n, q in module.named_parameters()]
    flags = [f"{k}={getattr(module, k)!r}" for k, v in _FLAGS.items() if getattr(module, k, v) != v]
    return ", ".join(shapes + flags)


_FIX = (
    "leave them replicated: remove the 'experts' entry from the plan (plan={k: v for k, v in "
    "oases.nn.DEFAULT_PLAN.items() if k != 'experts'})"
)


def check_experts(owner: str, experts: nn.Module, world_size: int) -> None:
    """ValueError (naming `owner`, the layout and the fix) unless `experts` is in a form
    ParallelExperts computes (oases.nn.experts' module doc) and its intermediate size splits into `world_size`
    whole shards."""
    form = _form(experts)
    if form is None:
        raise ValueError(
            f"{owner}: {type(experts).__name__} holds routed experts in a layout oases does not shard "
            f"({_layout_of(experts)}); oases shards fused experts stored as Mixtral's gate_up_proj [E, 2I, H] "
            f"and down_proj [E, H, I] with an act_fn, GPT-OSS's gate_up_proj [E, H, 2I] (gate and up "
            f"interleaved), gate_up_proj_bias, down_proj [E, I, H], down_proj_bias, or DBRX's mlp.w1 / v1 / w2 "
            f"[E * I, H]; {_FIX}"
        )
    if form == "packed":
        if not _glu_matches(experts.mlp):
            raise ValueError(
                f"{owner}: {type(experts).__name__} packs its experts as DBRX does ({_layout_of(experts)}), but "
                f"{type(experts.mlp).__name__}.forward(x, w1, v1, w2) does not compute "
                f"(act(x @ w1.T) * (x @ v1.T)) @ w2 with its activation_fn, which oases shards; {_FIX}"
            )
        intermediate = experts.ffn_hidden_size
    else:
        layout = _LAYOUTS[form]
        odd = {k: getattr(experts, k) for k, v in layout.items() if getattr(experts, k, v) != v}
        gate = getattr(type(experts), "_apply_gate", None)
        if form == "concatenated":
            if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
                odd["_apply_gate"] = f"{type(experts).__name__}._apply_gate"
            computes = "act_fn(gate) * up"
        else:
            swiglu = ClampedSwiGLU(float(experts.alpha), float(experts.limit))
            if gate is None or not _gate_matches(experts, swiglu):
                odd["_apply_gate"] = f"{type(experts).__name__}._apply_gate"
            computes = f"{swiglu} of the interleaved pairs"
        if odd:
            raise ValueError(
                f"{owner}: {type(experts).__name__} has a layout oases does not shard "
                f"({', '.join(f'{k}={v!r}' for k, v in odd.items())}; for its parameters it shards "
                f"{layout} with {computes}); leave it replicated: remove its 'experts' plan entry"
            )
        intermediate = experts.down_proj.shape[2 if form == "concatenated" else 1]
    if intermediate % world_size:
        raise ValueError(
            f"{owner}: the experts' intermediate size {intermediate} is not divisible by the "
            f"tensor-parallel world size {world_size}; choose a world size dividing it (or leave the "
            f"experts replicated: remove the 'experts' plan entry)"
        )
