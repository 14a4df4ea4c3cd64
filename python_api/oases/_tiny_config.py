"""`tiny_config`: a model's config shrunk to a few layers of small width, the architecture kept.

What the sharding depends on stays: the query / key-value head ratio (multi-query, grouped),
the layer kinds (each kind of `layer_types` once, at least two layers), mixtures of experts
(4 experts, top-k at most 2, one dense layer before the MoE ones), MLA's ranks, nested configs
(DBRX); dropout becomes 0 so comparisons are exact, special token ids fit the small vocabulary.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional, Sequence

_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
_INNER = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_k", "top_k")
_SMALL = {  # (key, value) set where the config has the key (not None)
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "max_seq_len": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "sliding_window": 8,
    "router_jitter_noise": 0.0,
    "n_group": 1,  # DeepSeek's grouped routing: one group of the 4 experts
    "topk_group": 1,
}


def heads_of(config: Any) -> tuple[Optional[int], Optional[int]]:
    """(query heads, key-value heads) of a config; None where it names no head count."""
    d = config.to_dict()
    heads_key, kv_key = _first(d, _HEADS), _first(d, _KV_HEADS)
    heads = d[heads_key] if heads_key else None
    return heads, (d[kv_key] if kv_key else heads)


def _first(d: dict, keys: Sequence[str]) -> Optional[str]:
    return next((k for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def tiny_config(config: Any) -> Any:
    """A config of the same architecture, shrunk (module doc); `config` a transformers
    PretrainedConfig, a path to a config.json or a directory holding one, or a model type."""
    from transformers import PretrainedConfig

    config = _load(config)
    text = getattr(config, "text_config", None)
    config = text if isinstance(text, PretrainedConfig) and _first(vars(text), _HIDDEN) else config
    d = config.to_dict()
    new = _attention(d)
    new.update(_widths(d))
    new.update(_layers(d))
    new.update(_nested(d))
    d.update(new)
    for key in ("architectures", "_name_or_path", "transformers_version"):
        d.pop(key, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = type(config).from_dict(d, attn_implementation="eager")
    return small


def _load(config: Any) -> Any:
    """The PretrainedConfig `config` names (a model type, a config.json or its directory)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, str):
        if os.path.isdir(config) or os.path.isfile(config):
            path = config if os.path.isdir(config) else os.path.dirname(os.path.abspath(config)) or "."
            if os.path.isfile(config) and os.path.basename(config) != "config.json":
                with open(config) as f:
                    d = json.load(f)
                config = AutoConfig.for_model(d.pop("model_type"), **d)
            else:
                config = AutoConfig.from_pretrained(path, local_files_only=True)
        else:
            config = AutoConfig.for_model(config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"config: expected a model type, a config path or a PretrainedConfig, got {config!r}")
    return config


def _heads(d: dict) -> tuple[int, int]:
    """(query heads, key-value heads) of the small config: at most 4 key-value heads (a power of
    two), the query / key-value ratio kept up to 16 query heads."""
    heads_key, kv_key = _first(d, _HEADS), _first(d, _KV_HEADS)
    heads = d[heads_key] if heads_key else 4
    kv = d[kv_key] if kv_key else heads
    if d.get("multi_query") is True:
        kv = 1
    attn = d.get("attn_config") if isinstance(d.get("attn_config"), dict) else None  # DBRX's nested configs
    if attn is not None and isinstance(attn.get("kv_n_heads"), int):
        kv = attn["kv_n_heads"]
    group = heads // kv if kv and heads % kv == 0 else 1
    kv_small = 1 if kv == 1 else 1 << (min(kv, 4).bit_length() - 1)
    return kv_small * max(1, min(group, 16 // kv_small)), kv_small


def _attention(d: dict) -> dict[str, Any]:
    """Heads, key-value heads, width (16 per head) and head size."""
    heads_small, kv_small = _heads(d)
    heads_key, kv_key, hidden_key = _first(d, _HEADS), _first(d, _KV_HEADS), _first(d, _HIDDEN)
    if kv_key is None:  # a default left unset (Nemotron's None): one key-value head per query head
        kv_key = next((k for k in _KV_HEADS if k in d and d[k] is None), None)
    new: dict[str, Any] = {}
    if hidden_key:
        new[hidden_key] = heads_small * 16
    if heads_key:
        new[heads_key] = heads_small
    if kv_key:
        new[kv_key] = kv_small
    if isinstance(d.get("head_dim"), int):  # MLA's is the rotary part's (qk_rope_head_dim)
        new["head_dim"] = _SMALL["qk_rope_head_dim"] if d["head_dim"] == d.get("qk_rope_head_dim") else 16
    return new


def _widths(d: dict) -> dict[str, Any]:
    """The MLP's width (its ratio to the hidden width kept), experts, top-k and the fixed small values."""
    hidden_key = _first(d, _HIDDEN)
    hidden = d[hidden_key] if hidden_key else None
    small_hidden = _heads(d)[0] * 16
    out: dict[str, Any] = {}
    inner_key = _first(d, _INNER)
    if inner_key and hidden:
        out[inner_key] = max(32, round(d[inner_key] / hidden * small_hidden / 32) * 32)
    for key in _EXPERTS:
        if _first(d, (key,)):
            out[key] = 4
    for key in _TOP_K:
        if _first(d, (key,)):
            out[key] = min(d[key], 2)
        elif key in d and d[key] is None and any(_first(d, (e,)) for e in _EXPERTS):
            out[key] = 2  # a default left unset (DeepSeek-V2's)
    out.update((k, v) for k, v in _SMALL.items() if d.get(k) is not None)
    if isinstance(d.get("rotary_dim"), int):  # GPT-J's, CodeGen's: within the head
        out["rotary_dim"] = 8
    if hidden_key and isinstance(d.get("word_embed_proj_dim"), int):  # OPT's: equal to the width, or half of it
        out["word_embed_proj_dim"] = small_hidden if d["word_embed_proj_dim"] == hidden else small_hidden // 2
    for key, value in d.items():  # dropout 0: exact comparisons
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            out[key] = 0.0
    for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(d.get(key), int) and d[key] >= 128:
            out[key] = value
    return out


def _layers(d: dict) -> dict[str, Any]:
    """Each kind of layer_types once (two layers at least), one dense layer before the MoE ones."""
    new: dict[str, Any] = {}
    layers_key = _first(d, _LAYERS)
    kinds = list(dict.fromkeys(d["layer_types"])) if isinstance(d.get("layer_types"), list) else []
    if layers_key:
        new[layers_key] = max(2, len(kinds))
    if kinds:
        new["layer_types"] = (kinds * 2)[: max(2, len(kinds))]
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] > 0:
        new["first_k_dense_replace"] = 1  # one dense layer, one MoE layer
    if isinstance(d.get("mlp_only_layers"), list):
        new["mlp_only_layers"] = []
    return new


def _nested(d: dict) -> dict[str, Any]:
    """DBRX's nested attn_config and ffn_config, shrunk alike."""
    out: dict[str, Any] = {}
    attn = d.get("attn_config") if isinstance(d.get("attn_config"), dict) else None
    if attn is not None:
        out["attn_config"] = {  # rope_theta and clip_qkv: transformers' default DBRX config cannot run without them
            **attn,
            "kv_n_heads": _heads(d)[1],
            "rope_theta": attn.get("rope_theta", 10000.0),
            "clip_qkv": attn.get("clip_qkv") or 8.0,
        }
        out["attn_config"].update({k: 0.0 for k in ("attn_pdrop",) if k in attn})
    hidden_key = _first(d, _HIDDEN)
    hidden = d[hidden_key] if hidden_key else None
    ffn = d.get("ffn_config") if isinstance(d.get("ffn_config"), dict) else None
    if ffn is not None and hidden:
        small_hidden = _heads(d)[0] * 16
        out["ffn_config"] = {**ffn, "hidden_size": small_hidden, "moe_num_experts": 4}
        if isinstance(ffn.get("ffn_hidden_size"), int):
            out["ffn_config"]["ffn_hidden_size"] = max(
                32, round(ffn["ffn_hidden_size"] / hidden * small_hidden / 32) * 32
            )
        if isinstance(ffn.get("moe_top_k"), int):
            out["ffn_config"]["moe_top_k"] = min(ffn["moe_top_k"], 2)
    return out
