"""Fused q/k/v projections whose layout the attention class fixes, with the default plan (issue 36, item 4).

    dbrx         Wqkv = [q (heads * d) | k (kv * d) | v (kv * d)], 2 kv heads, clip_qkv (an elementwise
                 clamp, exact on shards): "column:qkv"; at TP 4 each kv head on 2 ranks. Its routed
                 experts, packed (DbrxExperts' mlp.w1 / v1 / w2 [E * I, H]), sharded by expert TP:
                 each expert's I rows cut over the ranks (ShardRule(0, stacked=E)), the FFN one TP
                 region (router replicated, its gradient summed); a forward asking for its router
                 logits, whose router routes with them, is refused, and so is router jitter
    bigcode_mqa  GPTBigCode multi_query=True: c_attn = [q (heads * d) | k (d) | v (d)]: blocks by the
                 head counts (kv_heads = 1), K / V replicated on every rank (not equal thirds)
    bigcode_mha  GPTBigCode multi_query=False: c_attn head by head, [q_h | k_h | v_h] per head: whole-width
                 shards (not equal thirds)
    falcon_mqa   Falcon multi_query=True: query_key_value = [q | k (d) | v (d)], as bigcode_mqa
    falcon_new   Falcon new_decoder_architecture, 2 kv heads: query_key_value group by group,
                 [2 q heads | k | v] per kv head: whole groups per rank at TP 2, refused at TP 4

For each: the fused projection's shard layout, logits and every gradient of model(...) +
loss.backward(), and oases.train_step's loss and every gradient on every schedule equal the
unsharded model's (the ShardRule of each parameter as the oracle); a build on the meta device gets
the plain build's values (not GPTBigCode: its init is refused there, as GPT-2's); save_pretrained
writes what transformers reads back as the unsharded model, and load_pretrained reads it into a
fresh TP model; DBRX's full_state_dict holds its experts' unsharded names and shapes.
"""

import copy
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch

import oases
from oases.schedule import SCHEDULES

from _shards import check_export, check_grads
from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TOL = dict(rtol=1e-4, atol=1e-5)
IDS = dict(attn_implementation="eager", pad_token_id=0, bos_token_id=1, eos_token_id=2)
# {kind: (the fused projection of layer 0, its column layer's (parts, replicas) at TP 2, at TP 4)}
FUSED = {
    "dbrx": ("transformer.blocks.0.norm_attn_norm.attn.Wqkv", ((64, 32, 32), ()), ((64, 32, 32), (1, 2, 2))),
    "bigcode_mqa": ("transformer.h.0.attn.c_attn", ((64, 16, 16), (1, 2, 2)), ((64, 16, 16), (1, 4, 4))),
    "bigcode_mha": ("transformer.h.0.attn.c_attn", ((), ()), None),
    "falcon_mqa": (
        "transformer.h.0.self_attention.query_key_value",
        ((64, 16, 16), (1, 2, 2)),
        ((64, 16, 16), (1, 4, 4)),
    ),
    "falcon_new": ("transformer.h.0.self_attention.query_key_value", ((), ()), None),
}


def _build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "dbrx":
        config = tf.DbrxConfig(
            d_model=64,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            vocab_size=96,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.3, attn_pdrop=0.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2),
            resid_pdrop=0.0,
            emb_pdrop=0.0,
            tie_word_embeddings=False,
            **IDS,
        )
        return tf.DbrxForCausalLM(config).to(rank_device())
    if kind.startswith("bigcode"):
        config = tf.GPTBigCodeConfig(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=128,
            vocab_size=96,
            n_positions=64,
            multi_query=kind == "bigcode_mqa",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=False,
            **IDS,
        )
        return tf.GPTBigCodeForCausalLM(config).to(rank_device())
    if kind.startswith("falcon"):
        config = tf.FalconConfig(
            hidden_size=64,
            num_hidden_layers=2,
            vocab_size=96,
            num_attention_heads=4,
            multi_query=kind == "falcon_mqa",
            new_decoder_architecture=kind == "falcon_new",
            num_kv_heads=2 if kind == "falcon_new" else None,
            alibi=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            **IDS,
        )
        return tf.FalconForCausalLM(config).to(rank_device())
    raise AssertionError(kind)


def _check(kind, rank, p, root):
    ref = _build(kind)
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    summary = oases.summary(tp)
    # DBRX's routers stay whole by design (not "left whole"); its packed experts are sharded
    assert summary.layer_coverage >= 0.95 and summary.left_whole == (), f"{kind}: {summary}"
    if kind == "dbrx":
        _check_dbrx_experts(ref, tp, rank, p)
    name, at2, at4 = FUSED[kind]
    fused = tp.get_submodule(name)
    assert (fused.parts, fused.replicas) == (at2 if p == 2 else at4), f"{kind}: {fused}"

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (4, 12), generator=g).to(rank_device())
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: masked positions' labels ignored below
    labels = ids.masked_fill(mask == 0, -100)
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=ids, labels=ids, attention_mask=mask)
    out.loss.backward()
    want_logits, want = out.logits.detach(), {n: q.grad.clone() for n, q in ref.named_parameters()}
    got = tp(input_ids=ids, labels=ids, attention_mask=mask)
    torch.testing.assert_close(got.logits, want_logits, **TOL, msg=lambda m: f"{kind}: logits {m}")
    got.loss.backward()
    check_grads(tp, want, rank, p, f"{kind} forward", TOL)

    ref.zero_grad(set_to_none=True)
    want_loss = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    want_loss.backward()
    want = {n: q.grad.clone() for n, q in ref.named_parameters()}
    for schedule in SCHEDULES:
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask)
        torch.testing.assert_close(loss, want_loss.detach(), **TOL, msg=lambda m: f"{kind} {schedule}: loss {m}")
        check_grads(tp, want, rank, p, f"{kind} {schedule}", TOL)
    oases.check_gradients(tp)

    if not kind.startswith("bigcode"):  # GPTBigCode's init writes c_proj from its parent (GPT-2's): refused on meta
        with torch.device("meta"):  # only this rank's shards allocated, the plain build's values
            meta = type(ref)(ref.config)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(meta, device=rank_device())
        built = oases.full_state_dict(meta)
        for key, value in ref.state_dict().items():
            assert torch.equal(built[key], value), f"{kind}: {key} built on meta"

    fresh = _build(kind)
    for q in fresh.parameters():
        torch.nn.init.zeros_(q) if q.dim() == 1 else torch.nn.init.normal_(q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(fresh)
    where = os.path.join(root, f"{kind}-{p}")
    check_export(tp, ref, where, rank, kind)
    oases.load_pretrained(fresh, where)
    for (key, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), f"{kind}: {key} after load_pretrained"
    if kind == "dbrx":  # transformers' own save: its packed experts read into this rank's rows of each expert
        hf = os.path.join(root, f"{kind}-{p}-hf")
        if rank == 0:
            ref.save_pretrained(hf)
        torch.distributed.barrier()
        for q in fresh.parameters():
            torch.nn.init.zeros_(q)
        oases.load_pretrained(fresh, hf)
        for (key, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
            assert torch.equal(a, b), f"{kind}: {key} after load_pretrained of transformers' save"


def _check_dbrx_experts(ref, tp, rank, p):
    """DBRX's experts: rank r's rows of each expert in w1 / v1 / w2, the unsharded names and shapes
    in full_state_dict, and the refusals (router logits asked for, router jitter)."""
    e, i, h = 4, 128, 64
    for b in range(2):
        experts = tp.transformer.blocks[b].ffn.experts
        assert isinstance(experts, oases.nn.ParallelExperts) and experts.form == "packed", experts
        for w in ("w1", "v1", "w2"):
            local = getattr(experts.mlp, w)
            full = getattr(ref.transformer.blocks[b].ffn.experts.mlp, w)
            assert local.shape == (e * i // p, h) and experts.mlp.tp_layout()[w] == oases.nn.ShardRule(0, stacked=e)
            rows = torch.cat([full[k * i + rank * i // p : k * i + (rank + 1) * i // p] for k in range(e)])
            assert torch.equal(local, rows), f"dbrx: block {b} {w} is not rank {rank}'s rows of each expert"
    full = oases.full_state_dict(tp)
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(2)).to(rank_device())
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.router \(DbrxRouter\) returns the logits its MoE block"):
        tp(input_ids=ids, labels=ids, output_router_logits=True)
    jittery = copy.deepcopy(ref)
    jittery.transformer.blocks[1].ffn.router.moe_jitter_eps = 0.01
    with pytest.raises(ValueError, match=r"blocks\.1\.ffn: router jitter noise 0\.01 \(router\.moe_jitter_eps\)"):
        oases.parallelize(jittery)
    assert type(jittery.transformer.blocks[1].ffn.experts).__name__ == "DbrxExperts"


def _check_all(rank, p, kinds, root):
    for kind in kinds:
        _check(kind, rank, p, root)
    return True


@pytest.mark.parametrize(
    "kinds", [("dbrx",), ("bigcode_mha", "bigcode_mqa"), ("falcon_mqa", "falcon_new")], ids="-".join
)
def test_fused_layouts_match_unsharded_tp2(kinds):
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_all, 2, kinds, root, timeout=240)


def _check_tp4(rank, p, root):
    _check_all(rank, p, ("dbrx", "bigcode_mqa", "falcon_mqa"), root)
    model = _build("falcon_new")  # 2 kv groups over 4 ranks: refused before anything changes
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError,
        match=r"h\.0\.self_attention\.query_key_value: FalconAttention's fused query_key_value is laid out "
        r"key-value group by group .* Use a TP degree that divides 2",
    ):
        oases.parallelize(model)
    assert type(model.transformer.h[0].self_attention.query_key_value).__name__ == "FalconLinear"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return True


def test_fused_layouts_match_unsharded_tp4():
    """TP 4: DBRX's 2 kv heads each on 2 ranks, multi-query K / V on all 4; grouped Falcon refused."""
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_tp4, 4, root, timeout=300)
