"""The shape of a transformer, as the planner sees it: sizes, parameter counts and FLOPs per sublayer.

    shape = load_model("llama-7b")                  # a preset
    shape = load_model("configs/my_model.json")     # our keys or a Hugging Face config.json
    shape = shape_from_config(llama_config, seq_len=512)   # a transformers config object
    shape.flops("mlp", tokens=4096, tp=2)           # forward FLOPs of one rank's MLP shard

Every layer is two sublayers (attention, MLP), as in oases.models.GPT: FLOPs and parameters are
those of the column-parallel / row-parallel GEMMs plus attention's score products; norms and
element-wise work are left to the measured profile.

Mixture of experts (`experts` E > 0; Mixtral, Qwen2-MoE, Qwen3-MoE): the MLP sublayer is a router
and E expert MLPs of width `ffn_hidden` each, every token through `experts_per_token` k of them,
plus an optional shared MLP of width `shared_ffn_hidden` that every token runs (Qwen2-MoE's
shared expert). Expert TP as Megatron runs a dense MLP: every rank holds 1/tp of every expert
(gate / up split by columns, down by rows), the router [h, E] is replicated, a token stays on its
rank. With mats = 3 if gated_mlp else 2 and one MLP's parameters mlp(f) = mats h f + f + h:

    parameters("mlp") = E mlp(ffn_hidden) + mlp(shared_ffn_hidden) [if > 0] + h E + 2 h    (router, norm)
    rank parameters   = (P - h E) / tp + h E                      (router_parameters() = h E, per layer)
    flops("mlp", t, tp) = 2 t h E                                 router logits, replicated: not / tp
                        + 2 t k h ffn_hidden mats / tp            k routed experts per token
                        + 2 t h shared_ffn_hidden mats / tp       the shared MLP
No capacity factor: no token is dropped and each goes through exactly k experts (so no rank
waits on another: each runs its 1/tp of the experts on all its tokens); the dispatch's gathers
and scatters are element-wise work, left to the profile. Left out: Qwen2-MoE's scalar gate of its
shared expert (h parameters per layer). A dense MLP (experts = 0) is one mlp(ffn_hidden) + 2 h
parameters and 2 t h ffn_hidden mats / tp FLOPs: an MoE with E = k = 1 is it plus a router.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional

from oases import _checks
from oases._files import read_json

__all__ = ["ModelShape", "PRESETS", "SUBLAYERS", "load_model", "shape_from_config"]

SUBLAYERS = ("attention", "mlp")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: `layers` blocks of attention + MLP on [batch, seq_len, hidden].

    `ffn_hidden` defaults to 4 * hidden (an MoE: each expert's width); `gated_mlp` (Llama's
    SwiGLU) adds a third MLP matrix; `kv_heads` (grouped-query attention) defaults to `heads`.
    `experts` > 0 makes every MLP a mixture of that many experts, `experts_per_token` (1..experts)
    of them per token, plus a shared MLP of width `shared_ffn_hidden` when > 0 (see the module
    docstring); experts = 0 (the default): a dense MLP."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int = 0
    kv_heads: int = 0
    gated_mlp: bool = False
    experts: int = 0
    experts_per_token: int = 0
    shared_ffn_hidden: int = 0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "seq_len", "vocab_size"):
            value = getattr(self, field_name)
            if not _checks.is_int(value) or value < 1:
                raise ValueError(f"{field_name}: expected a positive int, got {value!r}")
        for field_name in ("experts", "experts_per_token", "shared_ffn_hidden"):
            value = getattr(self, field_name)
            if not _checks.is_int(value) or value < 0:
                raise ValueError(f"{field_name}: expected an int >= 0, got {value!r}")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(
                f"experts_per_token: expected 1..experts={self.experts} (top-k routing), got {self.experts_per_token}"
            )
        if not self.experts and (self.experts_per_token or self.shared_ffn_hidden):
            raise ValueError(
                "experts: experts_per_token / shared_ffn_hidden describe a mixture of experts; set "
                f"experts > 0 (got experts=0, experts_per_token={self.experts_per_token}, "
                f"shared_ffn_hidden={self.shared_ffn_hidden})"
            )
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide heads={self.heads}")

    @property
    def head_dim(self) -> int:
        """Features per attention head: hidden // heads."""
        return self.hidden // self.heads

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one (expert's) MLP: 3 gated (gate, up, down), else 2 (fc, proj)."""
        return 3 if self.gated_mlp else 2

    def parameters(self, sublayer: str) -> int:
        """Parameters of one sublayer, unsharded (weights, biases, its norm; an MoE MLP: every
        expert, the shared MLP and the router, see the module docstring)."""
        h = self.hidden
        if sublayer == "attention":
            qkv = h + 2 * self.kv_heads * self.head_dim
            return h * qkv + qkv + h * h + h + 2 * h
        if sublayer == "mlp":
            mats = self.mlp_matrices
            if not self.experts:
                return mats * h * self.ffn_hidden + self.ffn_hidden + h + 2 * h
            expert = mats * h * self.ffn_hidden + self.ffn_hidden + h
            shared = mats * h * self.shared_ffn_hidden + self.shared_ffn_hidden + h if self.shared_ffn_hidden else 0
            return self.experts * expert + shared + self.router_parameters() + 2 * h
        raise ValueError(f"sublayer: {sublayer!r} is not one of {SUBLAYERS}")

    def layer_parameters(self) -> int:
        """Parameters of one layer, unsharded: its attention and MLP sublayers'."""
        return sum(self.parameters(s) for s in SUBLAYERS)

    def router_parameters(self) -> int:
        """Parameters of one layer's router, replicated on every TP rank: h * experts (0 dense)."""
        return self.hidden * self.experts

    def rank_layer_parameters(self, tp: int) -> float:
        """Parameters of one layer one rank holds at TP degree `tp`: the router replicated, the
        rest split (norms too, as eq. 6 counts them)::

            (layer_parameters() - router_parameters()) / tp + router_parameters()"""
        router = self.router_parameters()
        return (self.layer_parameters() - router) / tp + router

    def flops(self, sublayer: str, tokens: int, tp: int) -> float:
        """Forward FLOPs of one rank's shard of `sublayer` on `tokens` = rows * seq_len tokens at TP
        degree `tp` (backward: twice as many); an MoE MLP: the router on every rank, k experts
        and the shared MLP per token split over tp (see the module docstring)."""
        h, s = self.hidden, self.seq_len
        if sublayer == "attention":
            qkv = h + 2 * self.kv_heads * self.head_dim
            gemms = 2 * tokens * h * (qkv + h)
            scores = 4 * tokens * s * h  # Q K^T and P V over the whole sequence
            return (gemms + scores) / tp
        if sublayer == "mlp":
            mats = self.mlp_matrices
            if not self.experts:
                return 2 * tokens * h * self.ffn_hidden * mats / tp
            router = 2 * tokens * h * self.experts  # [t, h] @ [h, E], replicated
            routed = 2 * tokens * self.experts_per_token * h * self.ffn_hidden * mats
            shared = 2 * tokens * h * self.shared_ffn_hidden * mats
            return router + (routed + shared) / tp
        raise ValueError(f"sublayer: {sublayer!r} is not one of {SUBLAYERS}")

    def projection_flops(self, sublayer: str, tokens: int, tp: int) -> float:
        """Forward FLOPs of the sublayer's row-parallel output projection on `tokens` at TP degree
        `tp` (attention: 2 t h h / tp; a dense MLP: 2 t h ffn / tp), which fine-grained
        recomputation does not run (oases.schedule.protocol: core_for_gradients); 0 for an MoE's
        MLP, whose experts' outputs the router weights (recomputed in full)."""
        if sublayer == "attention":
            return 2 * tokens * self.hidden * self.hidden / tp
        if sublayer == "mlp":
            return 0.0 if self.experts else 2 * tokens * self.hidden * self.ffn_hidden / tp
        raise ValueError(f"sublayer: {sublayer!r} is not one of {SUBLAYERS}")

    def head_flops(self, tokens: int) -> float:
        """Forward FLOPs of the LM head (replicated: not sharded by TP)."""
        return 2 * tokens * self.hidden * self.vocab_size

    def embedding_parameters(self) -> int:
        """Parameters outside the layers: 2 * vocab_size * hidden (the token embedding and the head),
        seq_len * hidden (the positions) and 2 * hidden (the final norm)."""
        return self.vocab_size * self.hidden * 2 + self.seq_len * self.hidden + 2 * self.hidden

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (dataclasses.asdict)."""
        return asdict(self)


PRESETS: Mapping[str, ModelShape] = MappingProxyType(
    {
        "gpt2-small": ModelShape(12, 768, 12, 1024, 50304, name="gpt2-small"),
        "gpt2-xl": ModelShape(48, 1600, 25, 1024, 50304, name="gpt2-xl"),
        "gpt3-1.3b": ModelShape(24, 2048, 16, 2048, 50304, name="gpt3-1.3b"),
        "gpt3-2.7b": ModelShape(32, 2560, 32, 2048, 50304, name="gpt3-2.7b"),
        "llama-7b": ModelShape(32, 4096, 32, 2048, 32000, ffn_hidden=11008, gated_mlp=True, name="llama-7b"),
        "llama-13b": ModelShape(40, 5120, 40, 2048, 32000, ffn_hidden=13824, gated_mlp=True, name="llama-13b"),
        "mixtral-8x7b": ModelShape(
            32,
            4096,
            32,
            4096,
            32000,
            ffn_hidden=14336,
            kv_heads=8,
            gated_mlp=True,
            experts=8,
            experts_per_token=2,
            name="mixtral-8x7b",
        ),
    }
)

_HF_KEYS = {
    "num_hidden_layers": "layers",
    "hidden_size": "hidden",
    "num_attention_heads": "heads",
    "max_position_embeddings": "seq_len",
    "intermediate_size": "ffn_hidden",
    "num_key_value_heads": "kv_heads",
    "n_layer": "layers",
    "n_embd": "hidden",
    "n_head": "heads",
    "n_positions": "seq_len",
    "n_inner": "ffn_hidden",
    "block_size": "seq_len",
    "num_local_experts": "experts",
    "num_experts": "experts",
    "num_experts_per_tok": "experts_per_token",
    "shared_expert_intermediate_size": "shared_ffn_hidden",
}
_OUR_KEYS = (
    "layers",
    "hidden",
    "heads",
    "seq_len",
    "vocab_size",
    "ffn_hidden",
    "kv_heads",
    "gated_mlp",
    "experts",
    "experts_per_token",
    "shared_ffn_hidden",
    "name",
)


def load_model(spec: str, *, seq_len: Optional[int] = None) -> ModelShape:
    """A preset name (see PRESETS) or the path of a JSON config: our keys (ModelShape's fields, or
    oases.models.GPTConfig's with `mlp_ratio`) or a Hugging Face config.json. `seq_len` overrides
    the sequence length (a config's max_position_embeddings is often longer than training's).

    A Hugging Face mixture of experts (Mixtral: num_local_experts, num_experts_per_tok,
    intermediate_size per expert; Qwen2-MoE / Qwen3-MoE: num_experts, num_experts_per_tok,
    moe_intermediate_size per expert, shared_expert_intermediate_size) becomes an MoE shape. The
    planner's layers are alike, so the layers are all MoE or all dense, by Qwen's rule of which are::

        moe(i) = experts > 0 and i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
        all MoE if any(moe(i) for i in range(layers)), else all dense (ffn_hidden = intermediate_size)

    (a model that mixes them has its dense layers costed as MoE ones)."""
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"model: expected a preset name or a config path, got {spec!r}")
    if spec in PRESETS:
        shape = PRESETS[spec]
    elif os.path.exists(spec):
        shape = _from_config(read_json(spec, "model"), os.path.splitext(os.path.basename(spec))[0])
    else:
        raise ValueError(f"model: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config file")
    return shape if seq_len is None else replace(shape, seq_len=seq_len)


def shape_from_config(config: Any, *, seq_len: Optional[int] = None) -> ModelShape:
    """The ModelShape of a transformers config object (anything with `to_dict()`) or a mapping of
    its keys, as `load_model` reads a config.json; `seq_len` overrides max_position_embeddings
    (the training sequence length is usually shorter)."""
    as_dict = getattr(config, "to_dict", None)
    fields = as_dict() if callable(as_dict) else config
    if not isinstance(fields, Mapping):
        raise TypeError(f"config: expected a transformers config or a mapping, got {type(config).__name__}")
    shape = _from_config(fields, type(config).__name__)
    return shape if seq_len is None else replace(shape, seq_len=seq_len)


def _from_config(config: Mapping[str, Any], default_name: str) -> ModelShape:
    if not isinstance(config, Mapping):
        raise ValueError("model: the config file must hold a JSON object")
    fields: dict[str, Any] = {}
    for key, value in config.items():
        if key in _OUR_KEYS:
            fields[key] = value
        elif key in _HF_KEYS and value is not None:
            fields.setdefault(_HF_KEYS[key], value)
    if "mlp_ratio" in config and "ffn_hidden" not in fields and "hidden" in fields:
        fields["ffn_hidden"] = config["mlp_ratio"] * fields["hidden"]
    if config.get("hidden_act") in ("silu", "swiglu") or "llama" in str(config.get("model_type", "")):
        fields.setdefault("gated_mlp", True)
    if "experts" not in config:  # Hugging Face's expert keys, if any (ours describe every layer)
        _hf_experts(config, fields)
    fields.setdefault("name", config.get("model_type", default_name))
    missing = [k for k in ("layers", "hidden", "heads", "seq_len", "vocab_size") if k not in fields]
    if missing:
        raise ValueError(
            f"model: the config lacks {missing} (ModelShape fields or Hugging Face's "
            "num_hidden_layers / hidden_size / num_attention_heads / max_position_embeddings / "
            "vocab_size)"
        )
    return ModelShape(**fields)


def _hf_experts(config: Mapping[str, Any], fields: dict[str, Any]) -> None:
    """Fill `fields` in place from a Hugging Face config's expert keys (see load_model): an MoE shape
    with each expert's width (moe_intermediate_size, else intermediate_size), or, when no layer is
    MoE, none of the expert fields."""
    experts = fields.get("experts", 0)
    step = 1 if config.get("decoder_sparse_step") is None else config["decoder_sparse_step"]
    dense_only = [] if config.get("mlp_only_layers") is None else config["mlp_only_layers"]
    if not _checks.is_int(step) or step < 1:
        raise ValueError(f"model: decoder_sparse_step must be a positive int, got {step!r}")
    if not isinstance(dense_only, list):
        raise ValueError(f"model: mlp_only_layers must be a list of layer indices, got {dense_only!r}")
    layers = fields.get("layers", 0) if isinstance(fields.get("layers"), int) else 0  # else ModelShape says why
    moe = experts and any(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
    if not moe:
        for key in ("experts", "experts_per_token", "shared_ffn_hidden"):
            fields.pop(key, None)
        return
    if "experts_per_token" not in fields:
        raise ValueError(f"model: the config has {experts} experts but no num_experts_per_tok (the top-k of routing)")
    if "ffn_hidden" not in config and config.get("moe_intermediate_size") is not None:
        fields["ffn_hidden"] = config["moe_intermediate_size"]
