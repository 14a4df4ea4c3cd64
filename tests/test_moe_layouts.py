"""The fused routed-expert layouts transformers ships, and what oases does with each (issue 36, item 4).

    concatenated  Mixtral, Qwen-MoE, DeepSeek-V2/V3, ...: gate_up_proj [E, 2I, H], down_proj [E, H, I]  shards
    interleaved   GPT-OSS: gate_up_proj [E, H, 2I] (gate, up pairs), biases                          shards
    packed        DBRX: mlp.w1 / v1 / w2 [E * I, H]                                                   shards
    transposed    Llama-4, Aria: gate_up_proj [E, H, 2I] = [gate | up] columns                         refused
    ungated       Nemotron-H: up_proj [E, I, H], down_proj [E, H, I]                                  refused
    zero experts  LongCat-Flash with zero_expert_num > 0: gate_up_proj [E + Z, 2I, H]                 refused
    flags / gate  MuseSpark's post-expert norm, Beam's and DeepSeek-V4's own _apply_gate              refused

Each experts module is built from a tiny config (no model around it, no ranks) and judged by
oases.nn.experts (is_fused_experts / looks_like_experts / check_experts, whose refusal names the
layout and the fix). Then through parallelize at TP 2: Llama-4's and Nemotron-H's experts, planned
by the default plan's "experts" entry, are refused before anything changes (they were replicated
unsaid), and shard the rest of the model once that entry is removed.
"""

import copy
import importlib
import importlib.util
import re
import warnings

import pytest
import torch

import oases
from oases.nn.experts import _form, check_experts, is_fused_experts, looks_like_experts

from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

S = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
# {experts class: (model type, config class, config, verdict: a form it shards, or what its refusal names)}
LAYOUTS = {
    "MixtralExperts": ("mixtral", "MixtralConfig", dict(S, num_local_experts=4), "concatenated"),
    "DeepseekV3Experts": ("deepseek_v3", "DeepseekV3Config", dict(S, n_routed_experts=4), "concatenated"),
    "DeepseekV2Experts": ("deepseek_v2", "DeepseekV2Config", dict(S, n_routed_experts=4), "concatenated"),
    "GptOssExperts": ("gpt_oss", "GptOssConfig", dict(S, num_local_experts=4), "interleaved"),
    "DbrxExperts": ("dbrx", "DbrxConfig", None, "packed"),
    "Llama4TextExperts": (
        "llama4",
        "Llama4TextConfig",
        dict(S, num_local_experts=4),
        r"gate_up_proj \[4, 16, 64\], down_proj \[4, 32, 16\]\)",
    ),
    "AriaExperts": (
        "aria",
        "AriaTextConfig",
        dict(S, moe_num_experts=4),
        r"gate_up_proj \[4, 16, 64\], down_proj \[4, 32, 16\], is_transposed=True\)",
    ),
    "NemotronHExperts": (
        "nemotron_h",
        "NemotronHConfig",
        dict(S, n_routed_experts=4, moe_intermediate_size=32),
        r"up_proj \[4, 32, 16\], down_proj \[4, 16, 32\], has_gate=False\)",
    ),
    "LongcatFlashExperts": (
        "longcat_flash",
        "LongcatFlashConfig",
        dict(S, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32),
        r"gate_up_proj \[6, 64, 16\], down_proj \[4, 16, 32\]\)",
    ),
    "MuseSparkExperts": (
        "muse_spark",
        "MuseSparkTextConfig",
        dict(S, num_local_experts=4, moe_hidden_size=16),
        r"has_post_expert_norm=True",
    ),
    "BeamExperts": ("beam", "BeamConfig", dict(S), r"_apply_gate='BeamExperts\._apply_gate'"),
    "DeepseekV4Experts": ("deepseek_v4", "DeepseekV4Config", dict(S), r"_apply_gate='DeepseekV4Experts\._apply_gate'"),
}
FORMS = ("concatenated", "interleaved", "packed")


def _experts(name):
    kind, config_class, config, _ = LAYOUTS[name]
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    settings = importlib.import_module(f"transformers.models.{kind}.configuration_{kind}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "dbrx":
            config = settings.DbrxConfig(
                d_model=16, n_heads=2, attn_config=dict(rope_theta=10000.0), ffn_config=dict(ffn_hidden_size=32)
            ).ffn_config
        else:
            config = getattr(settings, config_class)(**config)
        return getattr(module, name)(config)


def _verdict(name):
    """What oases makes of the layout: the form it shards, or its refusal's message ("seen as no
    experts" when parallelize would not even find the module)."""
    experts = _experts(name)
    if not (is_fused_experts(experts) or looks_like_experts(experts)):
        return "seen as no experts"
    try:
        check_experts(name, experts, 2)
    except ValueError as refusal:
        return str(refusal)
    return _form(experts)


def test_fused_expert_layouts_shard_or_are_refused_by_name():
    """Every layout of LAYOUTS: the supported forms pass check_experts, the others are refused
    naming the class, the layout (parameters and shapes, flags) and the fix."""
    wrong = {}
    for name, (*_, want) in LAYOUTS.items():
        got = _verdict(name)
        if want in FORMS:
            ok = got == want
        else:
            ok = (
                re.match(rf"{name}: {name} (holds routed experts in|has) a layout oases does not shard", got)
                and re.search(want, got)
                and "remove" in got
                and "'experts'" in got
            )
        if not ok:
            wrong[name] = got
    assert not wrong, wrong


def test_packed_experts_whose_glu_computes_otherwise_are_refused():
    experts = _experts("DbrxExperts")
    experts.mlp.forward = lambda x, w1, v1, w2: (experts.mlp.activation_fn(x @ w1.T) + x @ v1.T) @ w2  # a sum
    with pytest.raises(ValueError, match=r"DbrxExpertGLU\.forward\(x, w1, v1, w2\) does not compute"):
        check_experts("ffn.experts", experts, 2)


def _llama4():
    import transformers as tf

    config = tf.Llama4TextConfig(
        **dict(S, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
        intermediate_size_mlp=128,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return tf.Llama4ForCausalLM(config), "model.layers.0.feed_forward.experts", "Llama4TextExperts"


def _nemotron_h():
    import transformers as tf

    config = tf.NemotronHConfig(
        **dict(S, hidden_size=64, num_attention_heads=4, num_key_value_heads=2),
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=96,
        n_routed_experts=4,
        num_experts_per_tok=2,
        hybrid_override_pattern="*E",
        tie_word_embeddings=False,
    )
    return tf.NemotronHForCausalLM(config), "model.layers.1.mixer.experts", "NemotronHExperts"


def _refused(rank, p):
    without = {k: v for k, v in oases.nn.DEFAULT_PLAN.items() if k != "experts"}
    for build in (_llama4, _nemotron_h):
        torch.manual_seed(0)
        model, name, kind = build()
        model.to(rank_device())
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(
            ValueError, match=rf"{name} \(planned as 'experts'\): {kind} holds routed experts in a layout"
        ):
            oases.parallelize(model)
        assert type(model.get_submodule(name)).__name__ == kind
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), kind
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(model, plan=without)  # the fix the refusal names: experts replicated on purpose
        assert type(model.get_submodule(name)).__name__ == kind
        assert any(hasattr(m, "tp_layout") for m in model.modules()), f"{kind}: nothing else sharded"
    return True


def test_unknown_expert_layouts_refused_by_parallelize_tp2():
    run_ranks(_refused, 2, timeout=120)
