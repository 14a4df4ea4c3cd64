"""The shape of a transformer, as the planner sees it: sizes, parameter counts and FLOPs per sublayer.

    shape = load_model("llama-7b")                  # a preset
    shape = load_model("configs/my_model.json")     # our keys or a Hugging Face config.json
    shape = shape_from_config(llama_config, seq_len=512)   # a transformers config object
    shape.flops("mlp", tokens=4096, tp=2)           # forward FLOPs of one rank's MLP shard

Every layer is two sublayers (attention, MLP), as in oases.models.GPT: FLOPs and parameters are
those of the column-parallel / row-parallel GEMMs plus attention's score products; norms and
element-wise work are left to the measured profile.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping, Optional

from oases.planner._files import read_json

__all__ = ["ModelShape", "PRESETS", "SUBLAYERS", "load_model", "shape_from_config"]

SUBLAYERS = ("attention", "mlp")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: `layers` blocks of attention + MLP on [batch, seq_len, hidden].

    `ffn_hidden` defaults to 4 * hidden; `gated_mlp` (Llama's SwiGLU) adds a third MLP matrix;
    `kv_heads` (grouped-query attention) defaults to `heads`."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int = 0
    kv_heads: int = 0
    gated_mlp: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "seq_len", "vocab_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name}: expected a positive int, got {value!r}")
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
        return self.hidden // self.heads

    def parameters(self, sublayer: str) -> int:
        """Parameters of one sublayer, unsharded (weights, biases, its norm)."""
        h = self.hidden
        if sublayer == "attention":
            qkv = h + 2 * self.kv_heads * self.head_dim
            return h * qkv + qkv + h * h + h + 2 * h
        if sublayer == "mlp":
            mats = 3 if self.gated_mlp else 2
            return mats * h * self.ffn_hidden + self.ffn_hidden + h + 2 * h
        raise ValueError(f"sublayer: {sublayer!r} is not one of {SUBLAYERS}")

    def layer_parameters(self) -> int:
        return sum(self.parameters(s) for s in SUBLAYERS)

    def flops(self, sublayer: str, tokens: int, tp: int) -> float:
        """Forward FLOPs of one rank's shard of `sublayer` on `tokens` = rows * seq_len tokens at TP
        degree `tp` (backward: twice as many)."""
        h, s = self.hidden, self.seq_len
        if sublayer == "attention":
            qkv = h + 2 * self.kv_heads * self.head_dim
            gemms = 2 * tokens * h * (qkv + h)
            scores = 4 * tokens * s * h  # Q K^T and P V over the whole sequence
            return (gemms + scores) / tp
        if sublayer == "mlp":
            mats = 3 if self.gated_mlp else 2
            return 2 * tokens * h * self.ffn_hidden * mats / tp
        raise ValueError(f"sublayer: {sublayer!r} is not one of {SUBLAYERS}")

    def head_flops(self, tokens: int) -> float:
        """Forward FLOPs of the LM head (replicated: not sharded by TP)."""
        return 2 * tokens * self.hidden * self.vocab_size

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden * 2 + self.seq_len * self.hidden + 2 * self.hidden

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: Mapping[str, ModelShape] = MappingProxyType({
    "gpt2-small": ModelShape(12, 768, 12, 1024, 50304, name="gpt2-small"),
    "gpt2-xl": ModelShape(48, 1600, 25, 1024, 50304, name="gpt2-xl"),
    "gpt3-1.3b": ModelShape(24, 2048, 16, 2048, 50304, name="gpt3-1.3b"),
    "gpt3-2.7b": ModelShape(32, 2560, 32, 2048, 50304, name="gpt3-2.7b"),
    "llama-7b": ModelShape(32, 4096, 32, 2048, 32000, ffn_hidden=11008, gated_mlp=True, name="llama-7b"),
    "llama-13b": ModelShape(40, 5120, 40, 2048, 32000, ffn_hidden=13824, gated_mlp=True, name="llama-13b"),
})

_HF_KEYS = {"num_hidden_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
            "max_position_embeddings": "seq_len", "intermediate_size": "ffn_hidden",
            "num_key_value_heads": "kv_heads", "n_layer": "layers", "n_embd": "hidden", "n_head": "heads",
            "n_positions": "seq_len", "n_inner": "ffn_hidden", "block_size": "seq_len"}
_OUR_KEYS = ("layers", "hidden", "heads", "seq_len", "vocab_size", "ffn_hidden", "kv_heads", "gated_mlp", "name")


def load_model(spec: str, *, seq_len: Optional[int] = None) -> ModelShape:
    """A preset name (see PRESETS) or the path of a JSON config: our keys (ModelShape's fields, or
    oases.models.GPTConfig's with `mlp_ratio`) or a Hugging Face config.json. `seq_len` overrides
    the sequence length (a config's max_position_embeddings is often longer than training's)."""
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
    fields.setdefault("name", config.get("model_type", default_name))
    missing = [k for k in ("layers", "hidden", "heads", "seq_len", "vocab_size") if k not in fields]
    if missing:
        raise ValueError(f"model: the config lacks {missing} (ModelShape fields or Hugging Face's "
                         "num_hidden_layers / hidden_size / num_attention_heads / max_position_embeddings / vocab_size)")
    return ModelShape(**fields)
