"""Causal LMs a user brings, with the default plan, against the unsharded model (issue 20).

Tiny random models from their configs (no downloads); every part the sharding knows is in at
least one of them:

    llama       separate q/k/v with GQA, gate/up/down, RMSNorm           (untied, and tied: llama_tied)
    qwen3       per-head q/k norms
    mixtral     routed experts fused in 3-D parameters, replicated router
    qwen2moe    routed experts and a shared expert with its gate, q/k/v biases
    gemma       Llama-like layers under another class name, scaled embedding tied to the head
    gemma2      logit soft-capping (attention and final), sliding-window layers, norms after
                the branches (its layers run whole)
    olmo2       q_norm / k_norm over the whole projected width (sharded norms), post-branch norms
    cohere      logit scaling, LayerNorm, attention and MLP in parallel on one norm (run whole)
    phi3        fused qkv_proj with GQA (blocks of unequal sizes) and fused gate_up_proj
    phi         partial rotary, self_attn.dense and fc1 / fc2, parallel branches on one norm
    gpt2        Conv1D projections (weights stored [in, out]), fused c_attn, biases, LayerNorm,
                tied embedding and head, a vocabulary (97) that 2 does not divide
    neox        partial rotary (rotary_pct), fused query_key_value, parallel residual (the
                schedules' "parallel" split: one all-reduce for both branches)
    gptj        out_proj, fc_in / fc_out, parallel branches on one norm (run whole)
    starcoder2  c_fc / c_proj under Llama-like attention with biases, sliding window
    bloom       ALiBi slopes built in the base model for every head (cut to each rank's heads),
                an embedding norm before the layers, branches that add the residual themselves
    falcon      ALiBi folded into a per-head mask [b, H, q, k], parallel attention, one norm
    opt         decoder layers one level down (OPTModel -> decoder), out_proj, fc1 / fc2 in the layer
    deepseek_v3 multi-head latent attention (low-rank q and kv, a rotary key shared by the heads:
                one TP region), a dense then an MoE layer with a shared expert; deepseek_v2 the
                same with full-rank queries (q_proj); at TP 2 and 4

For each, in one spawn per group: the default plan shards >= 95% of the decoder layers'
projection parameters (oases.summary) and the layers split as expected; forward logits and
loss.backward() gradients equal the unsharded model's; oases.train_step's loss and every
gradient equal them on every schedule (and with sequence parallelism where the layers split;
refused where they run whole), and oases.check_gradients raises for none of them; under
torch.autocast(cpu, bf16) model(...) and train_step's loss and gradients are within bf16
tolerance of the unsharded model under the same autocast; a build on the meta device gets the
plain build's values (not GPT-2: its init is refused there); save_pretrained writes the
unsharded model's Hugging Face layout (transformers reads it back), which load_pretrained reads
into a fresh TP model; save_checkpoint / load_checkpoint round-trip. More decoders built from the
same parts (Qwen2, Mistral, OLMo, Nemotron, GLM, Helium, Persimmon, StableLM, Granite and
GraniteMoE, Exaone-4, Cohere-2, SmolLM3, Qwen3-MoE, OLMoE, Ernie-4.5, Gemma-3, Apertus with its
learned xIELU activation, OPT-350m's projected embeddings) get lighter checks: coverage,
logits, the oases schedule's loss and every gradient. CodeGen (its forward fixes the qkv groups)
is refused before anything changes, and PhiMoE's router (it samples experts in training) by
train_step, which matches it in eval mode; per-layer degrees with layers run whole (OLMo-2) or
ALiBi attention (BLOOM) are refused; a config with return_dict=False trains exactly.
At TP 4 (4 ranks, key/value heads replicated: 2 kv heads): llama, qwen3, phi3, gpt2 and mixtral,
the same checks. Item 3 (never a silent half-sharded model): a Llama whose MLP names its
projections w1 / w2 / w3 is refused with the default plan, naming the modules and the entries
that would shard them; with those entries added it shards and matches.
"""

import copy
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn

import oases
from oases.schedule import SCHEDULES

from _shards import check_export, check_grads
from _shards import expected_shard as _expected
from _spawn import harness_device, rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TOL = dict(rtol=1e-4, atol=1e-5)
BF16 = torch.bfloat16
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=96,
    max_position_embeddings=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
IDS = dict(attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
# decoders outside the matrix, lighter checks: {kind: (model class, config class, config beyond SMALL)}
MORE = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {}),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", {}),
    "nemotron": ("NemotronForCausalLM", "NemotronConfig", {}),
    "glm": ("GlmForCausalLM", "GlmConfig", dict(head_dim=16)),
    "helium": ("HeliumForCausalLM", "HeliumConfig", dict(head_dim=16)),
    "persimmon": ("PersimmonForCausalLM", "PersimmonConfig", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(partial_rotary_factor=0.25)),
    "granite": (
        "GraniteForCausalLM",
        "GraniteConfig",
        dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.1),
    ),
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "exaone4": ("Exaone4ForCausalLM", "Exaone4Config", {}),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", dict(sliding_window=8)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config", {}),
    "qwen3moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    "ernie45": ("Ernie4_5ForCausalLM", "Ernie4_5Config", dict(head_dim=16)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(head_dim=16, sliding_window=8)),
    "apertus": ("ApertusForCausalLM", "ApertusConfig", {}),  # xIELU: a learned activation (summed)
    # OPT-350m's layout: embeddings of another width, projected in and out (project_in / project_out)
    "opt_proj": (
        "OPTForCausalLM",
        "OPTConfig",
        dict(word_embed_proj_dim=32, ffn_dim=128, num_key_value_heads=4, dropout=0.0, attention_dropout=0.0),
    ),
}
# multi-head latent attention (oases.nn._latent), the matrix's whole checks: {kind: (model, config, beyond SMALL)}
_MLA = dict(
    num_key_value_heads=4,  # MLA's keys are per head (num_key_value_groups 1)
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    tie_word_embeddings=False,
)
LATENT = {
    # low-rank queries (q_a_proj -> q_a_layernorm -> q_b_proj), one dense layer then an MoE layer
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(_MLA, q_lora_rank=32, first_k_dense_replace=1)),
    # full-rank queries (q_proj), every layer MoE with two shared experts
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(_MLA, q_lora_rank=None, n_shared_experts=2)),
}
# how oases.train_step splits each model's decoder layers (oases.nn.parts.LayerParts.kind)
SPLIT = {
    "deepseek_v3": "sequential",
    "deepseek_v2": "sequential",
    "llama": "sequential",
    "llama_tied": "sequential",
    "qwen3": "sequential",
    "mixtral": "sequential",
    "qwen2moe": "sequential",
    "gemma": "sequential",
    "gemma2": "whole",
    "olmo2": "whole",
    "cohere": "whole",
    "phi3": "sequential",
    "phi": "whole",
    "gpt2": "sequential",
    "neox": "parallel",
    "gptj": "whole",
    "starcoder2": "sequential",
    "llama_w": "sequential",
    "bloom": "whole",
    "falcon": "whole",
    "opt": "whole",
}
W_PLAN = {**oases.nn.DEFAULT_PLAN, "w1": "column", "w3": "column", "w2": "row"}


class _W123(nn.Module):
    """A Llama MLP whose projections carry Meta's names (w1 gate, w3 up, w2 down)."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        h = nn.functional.silu(self.w1(x)) * self.w3(x)
        return self.w2(h)


def _build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind in ("llama", "llama_tied", "llama_w"):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=kind == "llama_tied"))
        if kind == "llama_w":
            for layer in model.model.layers:
                layer.mlp = _W123(64, 128)
        return model
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False))
    if kind == "mixtral":
        return tf.MixtralForCausalLM(
            tf.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
        )
    if kind == "qwen2moe":
        return tf.Qwen2MoeForCausalLM(
            tf.Qwen2MoeConfig(
                **SMALL,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                tie_word_embeddings=False,
            )
        )
    if kind == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, head_dim=16))
    if kind == "gemma2":
        return tf.Gemma2ForCausalLM(
            tf.Gemma2Config(
                **SMALL,
                head_dim=16,
                sliding_window=8,
                query_pre_attn_scalar=16,
                attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0,
            )
        )
    if kind == "olmo2":
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL, tie_word_embeddings=False))
    if kind == "cohere":
        return tf.CohereForCausalLM(tf.CohereConfig(**SMALL, logit_scale=0.5))
    if kind == "phi3":
        return tf.Phi3ForCausalLM(
            tf.Phi3Config(**SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False)
        )
    if kind == "phi":
        return tf.PhiForCausalLM(
            tf.PhiConfig(**SMALL, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        )
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                vocab_size=97,
                n_positions=64,
                **NO_DROPOUT,
                bos_token_id=1,
                eos_token_id=2,
                attn_implementation="eager",
            )
        )
    if kind == "neox":
        return tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(
                hidden_size=64,
                num_hidden_layers=2,
                intermediate_size=128,
                vocab_size=96,
                num_attention_heads=4,
                rotary_pct=0.25,
                max_position_embeddings=64,
                attn_implementation="eager",
                tie_word_embeddings=False,
            )
        )
    if kind == "gptj":
        return tf.GPTJForCausalLM(
            tf.GPTJConfig(
                n_embd=64,
                n_layer=2,
                n_head=4,
                rotary_dim=8,
                vocab_size=96,
                n_positions=64,
                **NO_DROPOUT,
                bos_token_id=1,
                eos_token_id=2,
                attn_implementation="eager",
            )
        )
    if kind == "starcoder2":
        return tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**SMALL, sliding_window=8, tie_word_embeddings=False))
    if kind == "bloom":
        return tf.BloomForCausalLM(
            tf.BloomConfig(
                hidden_size=64, n_layer=2, vocab_size=96, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, **IDS
            )
        )
    if kind == "falcon":
        return tf.FalconForCausalLM(
            tf.FalconConfig(
                hidden_size=64,
                num_hidden_layers=2,
                vocab_size=96,
                num_attention_heads=4,
                multi_query=False,
                alibi=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                **IDS,
            )
        )
    if kind == "opt":
        return tf.OPTForCausalLM(
            tf.OPTConfig(
                hidden_size=64,
                num_hidden_layers=2,
                ffn_dim=128,
                vocab_size=96,
                max_position_embeddings=64,
                num_attention_heads=4,
                word_embed_proj_dim=64,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                layerdrop=0.0,
                **IDS,
            )
        )
    if kind in MORE or kind in LATENT:
        model, config, extra = MORE.get(kind) or LATENT[kind]
        return getattr(tf, model)(getattr(tf, config)(**{**SMALL, **extra}))
    raise AssertionError(kind)


def _check_grads(tp, want, rank, p, where):
    check_grads(tp, want, rank, p, where, TOL)
    oases.check_gradients(tp)  # the invariant: no false alarm on any model of the matrix


def _reference(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, attention_mask=mask)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}


def _bf16_close(a, b, what, rel=3e-2):
    """||a - b|| <= rel ||b||: bf16 rounding (8 bits of mantissa) on both sides, summed differently."""
    a, b = a.double(), b.double()
    err = (a - b).norm() / b.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"


def _check_autocast(kind, ref, tp, ids, rank, p, fp32):
    """model(...) and oases.train_step under torch.autocast(cpu, bf16) against the unsharded model
    under the same autocast: logits, loss and every gradient within bf16 tolerance, fp32 gradients.
    A gradient that is zero in exact arithmetic (its fp32 value, `fp32`, below 1e-6 of the largest:
    a key bias without rotary, softmax being shift-invariant) is bf16 noise on both sides: it is
    only checked to stay below 1e-2 of the largest gradient."""
    ref.zero_grad(set_to_none=True)
    with torch.autocast(harness_device(), BF16):
        out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    want_logits, want_loss = out.logits.detach().float(), out.loss.detach().float()
    want = {n: q.grad.clone() for n, q in ref.named_parameters()}
    largest = max(float(g.norm()) for g in fp32.values())
    noise = {n for n, g in fp32.items() if float(g.norm()) <= 1e-6 * largest}

    def check(where):
        oases.check_gradients(tp)  # bf16 autocast, fp32 gradients: no false alarm
        for name, q in tp.named_parameters():
            assert q.grad is not None and q.grad.dtype == torch.float32, f"{where}: grad of {name}"
            if name in noise:
                assert float(q.grad.norm()) <= 1e-2 * largest, f"{where}: grad of {name} (zero in exact arithmetic)"
                continue
            _bf16_close(q.grad, _expected(tp, name, want[name], rank, p), f"{where}: grad of {name}", rel=5e-2)

    tp.zero_grad(set_to_none=True)
    with torch.autocast(harness_device(), BF16):
        out = tp(input_ids=ids, labels=ids)
    out.loss.backward()
    _bf16_close(out.logits.float(), want_logits, f"{kind} autocast logits", rel=1e-2)
    _bf16_close(out.loss.float(), want_loss, f"{kind} autocast loss", rel=1e-2)
    check(f"{kind} autocast model(...)")
    tp.zero_grad(set_to_none=True)
    with torch.autocast(harness_device(), BF16):
        loss = oases.train_step(tp, ids, ids, schedule="oases")
    _bf16_close(loss.float(), want_loss, f"{kind} autocast train_step loss", rel=1e-2)
    check(f"{kind} autocast train_step")


def _check_model(kind, rank, p, root, plan=None):
    ref = _build(kind).to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        oases.parallelize(tp, plan=plan)
    said = " ".join(str(w.message) for w in said)
    summary = oases.summary(tp)
    assert summary.layer_coverage >= 0.95 and not summary.left_whole, f"{kind}: {summary}"
    assert summary.world_size == p and summary.share < 0.6 if p == 2 else summary.share < 0.45, f"{kind}: {summary}"
    split = {part.kind for part in oases.models.HFStack(tp).parts}
    assert split == {SPLIT[kind]}, f"{kind}: {split}"
    assert ("runs each" in said) == (split == {"whole"}), f"{kind}: parallelize said {said!r}"

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (4, 12), generator=g).to(rank_device())
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: masked positions' labels ignored below
    labels = ids.masked_fill(mask == 0, -100)
    want_logits, want_loss, want = _reference(ref, ids, mask)
    tp.zero_grad(set_to_none=True)
    out = tp(input_ids=ids, labels=ids, attention_mask=mask)
    torch.testing.assert_close(out.logits, want_logits, **TOL, msg=lambda m: f"{kind}: logits {m}")
    out.loss.backward()
    _check_grads(tp, want, rank, p, f"{kind} forward")

    ref.zero_grad(set_to_none=True)
    ref_out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    ref_out.loss.backward()
    want = {n: q.grad.clone() for n, q in ref.named_parameters()}
    for schedule, sp in [(s, False) for s in SCHEDULES] + [("oases", True)]:
        tp.zero_grad(set_to_none=True)
        if sp and split == {"whole"}:  # a layer run whole needs the whole sequence: refused, before communicating
            with pytest.raises(
                ValueError,
                match=r"sequence_parallel=True: decoder layer 0 \(\w+\) runs whole .* "
                r"train this model with sequence_parallel=False",
            ):
                oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp)
            continue
        loss = oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp)
        where = f"{kind} {schedule} sequence_parallel={sp}"
        torch.testing.assert_close(loss, ref_out.loss.detach(), **TOL, msg=lambda m: f"{where}: loss {m}")
        _check_grads(tp, want, rank, p, where)
    if not (kind in LATENT and p == 4):
        # (at TP 4, one head per rank, bf16 rounds the MoE router's input unlike the unsharded model:
        # near-tied top-k choices flip and the experts' and router's gradients move by O(1), 0.12-0.44
        # relative on transformers 5.0.0; its fp32 checks above are exact, and TP 2 is checked here)
        _check_autocast(kind, ref, tp, ids, rank, p, want)

    if kind not in ("gpt2", "llama_w"):  # built on meta, only this rank's shards allocated, the plain build's values
        with torch.device("meta"):
            meta = type(ref)(ref.config)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(meta, device=rank_device(), plan=plan)
        built = oases.full_state_dict(meta)
        for key, value in ref.state_dict().items():
            assert torch.equal(built[key], value), f"{kind}: {key} built on meta"
    fresh = _build(kind).to(rank_device())
    for q in fresh.parameters():
        torch.nn.init.zeros_(q) if q.dim() == 1 else torch.nn.init.normal_(q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(fresh, plan=plan)
    if kind != "llama_w":  # transformers' own layout: a Llama with w1 / w2 / w3 is not a model it can read
        where = os.path.join(root, kind)
        check_export(tp, ref, where, rank, kind)
        oases.load_pretrained(fresh, where)
        for (name, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
            assert torch.equal(a, b), f"{kind}: {name} after load_pretrained"
    oases.save_checkpoint(tp, os.path.join(root, kind + "-ckpt"))  # torch.distributed.checkpoint boxes
    with torch.no_grad():
        for q in fresh.parameters():
            q.mul_(-2.0)  # every value changed, a padded vocabulary's zero rows kept (not in checkpoints)
    oases.load_checkpoint(fresh, os.path.join(root, kind + "-ckpt"))
    for (name, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), f"{kind}: {name} after load_checkpoint"


def _check_models(rank, p, kinds, root):
    for kind in kinds:
        _check_model(kind, rank, p, root)
    return True


@pytest.mark.parametrize(
    "kinds",
    [
        ("llama", "llama_tied", "qwen3", "mixtral"),
        ("qwen2moe", "gemma", "gemma2", "olmo2"),
        ("cohere", "phi3", "phi", "gpt2"),
        ("neox", "gptj", "starcoder2"),
    ],
    ids=lambda kinds: "-".join(kinds),
)
def test_models_match_unsharded_tp2(kinds):
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_models, 2, kinds, root, timeout=300)


def test_alibi_and_nested_decoders_tp2():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_models, 2, ("bloom", "falcon", "opt"), root, timeout=240)


def _check_more(rank, p):
    for kind in MORE:
        ref = _build(kind).to(rank_device())
        if kind == "granitemoe" and hasattr(ref.model.layers[0].block_sparse_moe, "input_linear"):
            continue  # transformers 5.0 keeps its experts in two modules of its own (left whole, with a warning)
        tp = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(tp)
        summary = oases.summary(tp)
        assert summary.layer_coverage >= 0.95 and summary.share < 0.6, f"{kind}: {summary}"
        ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
        want_logits, want_loss, want = _reference(ref, ids, torch.ones_like(ids))
        torch.testing.assert_close(tp(input_ids=ids).logits, want_logits, **TOL, msg=lambda m: f"{kind}: logits {m}")
        loss = oases.train_step(tp, ids, ids, schedule="oases")
        torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{kind}: oases loss {m}")
        _check_grads(tp, want, rank, p, f"{kind} oases")
    import transformers as tf

    torch.manual_seed(0)
    codegen = tf.CodeGenForCausalLM(
        tf.CodeGenConfig(
            n_embd=64, n_layer=2, vocab_size=96, n_head=4, rotary_dim=8, n_positions=64, **NO_DROPOUT, **IDS
        )
    ).to(rank_device())
    before = copy.deepcopy(codegen.state_dict())
    with pytest.raises(ValueError, match="CodeGenAttention splits its fused qkv_proj into mp_num = 4 groups"):
        oases.parallelize(codegen)
    assert all(torch.equal(v, codegen.state_dict()[k]) for k, v in before.items())
    # per-layer degrees: layers run whole and ALiBi attention are refused before anything communicates
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
    olmo2 = _build("olmo2").to(rank_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(olmo2, tp_degrees=[2, 1])
    with pytest.raises(ValueError, match=r"tp_degrees: oases.train_step runs decoder layers \[0, 1\] of Olmo2"):
        oases.train_step(olmo2, ids, ids)
    with pytest.raises(ValueError, match="tp_degrees with an attention that takes per-head biases"):
        oases.parallelize(_build("bloom").to(rank_device()), tp_degrees=[2, 1])
    with pytest.raises(ValueError, match=r"tp_degrees with multi-head latent attention \(DeepseekV3Attention\)"):
        oases.parallelize(_build("deepseek_v3").to(rank_device()), tp_degrees=[2, 1])
    # a config asking for tuples (return_dict=False): the head still finds the logits
    ref, tp = _build("llama").to(rank_device()), _build("llama").to(rank_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    tp.config.return_dict = False
    torch.testing.assert_close(oases.train_step(tp, ids, ids), ref(input_ids=ids, labels=ids).loss, **TOL)
    # a router that samples its experts in training would route a recomputed sublayer elsewhere
    torch.manual_seed(0)
    ref = tf.PhimoeForCausalLM(tf.PhimoeConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)).to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
    with pytest.raises(ValueError, match=r"mlp.router \(PhimoeTopKRouter\) samples its experts with Gumbel noise"):
        oases.train_step(tp, ids, ids, schedule="oases")
    ref.eval(), tp.eval()  # the router then picks its top experts
    if not tf.__version__.startswith("5.0."):  # 5.0's router hands its experts [T, E] weights they index by slot
        torch.testing.assert_close(
            oases.train_step(tp, ids, ids, schedule="oases"), ref(input_ids=ids, labels=ids).loss, **TOL
        )
    return True


def test_more_decoders_from_the_same_parts_tp2():
    run_ranks(_check_more, 2, timeout=240)


@pytest.mark.parametrize("p", [2, 4])
def test_latent_attention_matches_unsharded(p):
    """DeepSeek-V2/V3's multi-head latent attention (oases.nn._latent) with their MoE layers: every
    check of the matrix (schedules, sequence parallelism, meta build, export, checkpoint) at TP 2 and
    at TP 4 (one head per rank); bf16 autocast at TP 2 (see _check_model)."""
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_models, p, tuple(LATENT), root, timeout=480)


def test_models_match_unsharded_tp4():
    """TP 4 with 2 kv heads: each kv head held by two ranks (oases.nn._kv)."""
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_models, 4, ("llama", "qwen3", "phi3", "gpt2", "mixtral"), root, timeout=480)


def _check_unknown_names(rank, p, root):
    model = _build("llama_w").to(rank_device())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"shards 33% .*mlp\.w1.*'w1': 'column', 'w2': 'row', 'w3': 'column'"):
        oases.parallelize(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # left as it was
    assert oases.summary(model).layer_coverage == 0.0
    with pytest.warns(UserWarning, match=r"shards 33% .*'w1': 'column', 'w2': 'row', 'w3': 'column'"):
        oases.parallelize(_build("llama_w").to(rank_device()), plan=dict(oases.nn.DEFAULT_PLAN))
    _check_model("llama_w", rank, p, root, plan=W_PLAN)
    return True


def test_unknown_projection_names_refused_then_planned():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_unknown_names, 2, root, timeout=240)


@pytest.mark.parametrize("p", [2, 4])
def test_shard_rules_of_unequal_blocks_and_conv1d_layout(p):
    """ShardRule(dim, parts=...) and blockwise rules on dim 1: rank r holds the r-th slice of each
    block, shards tile the tensor back, and the chunks say where each piece sits."""
    from oases.nn import ShardRule

    full = torch.arange(8 * 32, dtype=torch.float32).reshape(8, 32)
    for rule in (ShardRule(1, parts=(16, 8, 8)), ShardRule(1, stacked=2), ShardRule(0, parts=(4, 4))):
        blocks = rule.blocks(full.shape[rule.dim])
        shards = [rule.shard(full, r, p) for r in range(p)]
        for r, local in enumerate(shards):
            want = torch.cat([b.chunk(p, rule.dim)[r] for b in full.split(blocks, rule.dim)], rule.dim)
            assert torch.equal(local, want), (rule, r)
            for chunk in rule.chunks(tuple(full.shape), r, p):
                assert torch.equal(chunk.of(local), full[chunk.index()]), (rule, r, chunk)
        assert torch.equal(rule.unshard(shards), full), rule
        assert rule.full_shape(shards[0].shape, p) == full.shape
