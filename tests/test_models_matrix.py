"""Causal LMs a user brings, at TP 2 with the default plan, against the unsharded model (issue 20).

Tiny random models from their configs (no downloads), each with what makes it hard:

    phi3    fused qkv_proj with GQA (blocks of unequal sizes) and fused gate_up_proj
    gpt2    Conv1D projections (weights stored [in, out]), fused c_attn, tied embedding and head,
            a vocabulary (97) that 2 does not divide
    olmo2   q_norm / k_norm over the whole projected width (sharded norms) and norms after the
            branches (the schedules run its layers whole)
    gemma   Llama-like layers under another class name, scaled embedding tied to the head

For each, in one spawn: the default plan shards >= 95% of the decoder layers' projection
parameters (oases.summary); forward logits and loss.backward() gradients equal the unsharded
model's; oases.train_step's loss and every gradient equal them on every schedule (and with
sequence parallelism where the layers split; refused where they run whole); a build on the
meta device gets the plain build's values (not GPT-2: its init is refused there); save_pretrained
writes the unsharded model's Hugging Face layout (transformers reads it back), which
load_pretrained reads into a fresh TP model; save_checkpoint / load_checkpoint round-trip.
Item 3 (never a silent half-sharded model): GPT-J's projections have names the default plan does
not know, so parallelize refuses it, naming the modules and the entries that would shard them;
with a complete plan its layers (one norm, parallel branches) run whole on every schedule.
"""
import copy
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from _shards import check_grads, expected_shard as _expected
from _spawn import run_ranks

import oases
from oases.schedule import SCHEDULES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

TOL = dict(rtol=1e-4, atol=1e-5)
SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=96, max_position_embeddings=64,
             num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPTJ_PLAN = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "out_proj": "row",
             "fc_in": "column", "fc_out": "row"}


def _build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                                tie_word_embeddings=False))
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=64,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               bos_token_id=1, eos_token_id=2, attn_implementation="eager"))
    if kind == "olmo2":
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL, tie_word_embeddings=False))
    if kind == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, head_dim=16))
    if kind == "gptj":  # one norm, parallel branches: run whole
        return tf.GPTJForCausalLM(tf.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=96,
                                               n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               bos_token_id=1, eos_token_id=2, attn_implementation="eager"))
    raise AssertionError(kind)


def _check_grads(tp, want, rank, p, where):
    check_grads(tp, want, rank, p, where, TOL)


def _reference(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, attention_mask=mask)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}


def _check_model(kind, rank, p, root, plan=None):
    import transformers as tf

    ref = _build(kind)
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        oases.parallelize(tp, plan=plan)
    said = " ".join(str(w.message) for w in said)
    summary = oases.summary(tp)
    assert summary.layer_coverage >= 0.95 and not summary.left_whole, f"{kind}: {summary}"
    assert summary.world_size == p and summary.share < 0.6, f"{kind}: {summary}"
    whole = {oases.models.HFStack(tp).parts[0].kind}
    assert whole == ({"whole"} if kind in ("olmo2", "gptj") else {"sequential"}), f"{kind}: {whole}"
    assert ("runs each" in said) == (whole == {"whole"}), f"{kind}: parallelize said {said!r}"

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (4, 12), generator=g)
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
        if sp and whole == {"whole"}:  # a layer run whole needs the whole sequence: refused, before communicating
            with pytest.raises(ValueError, match="sequence_parallel: WholeLayer has no sequence_parallel_parameters"):
                oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp)
            continue
        loss = oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp)
        where = f"{kind} {schedule} sequence_parallel={sp}"
        torch.testing.assert_close(loss, ref_out.loss.detach(), **TOL, msg=lambda m: f"{where}: loss {m}")
        _check_grads(tp, want, rank, p, where)

    if kind == "gptj":
        return
    if kind != "gpt2":  # built on meta, only this rank's shards allocated and given the plain build's values
        with torch.device("meta"):
            meta = type(ref)(ref.config)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(meta, device="cpu")
        built = oases.full_state_dict(meta)
        for key, value in ref.state_dict().items():
            assert torch.equal(built[key], value), f"{kind}: {key} built on meta"
    where = os.path.join(root, kind)
    oases.save_pretrained(tp, where)  # the unsharded model's names and shapes (Conv1D: [in, out])
    if rank == 0:
        back = type(ref).from_pretrained(where)
        got = back.state_dict()
        for key, value in ref.state_dict().items():
            assert key in got and got[key].shape == value.shape, f"{kind}: {key} in the export"
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m: f"{kind} export {key}: {m}")
    dist.barrier()
    fresh = _build(kind)
    for q in fresh.parameters():
        torch.nn.init.zeros_(q) if q.dim() == 1 else torch.nn.init.normal_(q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(fresh, plan=plan)
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
    del tf


def _check_models(rank, p, kinds, root):
    for kind in kinds:
        _check_model(kind, rank, p, root)
    return True


def _check_phi3_gpt2(rank, p, root):
    return _check_models(rank, p, ["phi3", "gpt2"], root)


def test_phi3_and_gpt2_match_unsharded_tp2():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_phi3_gpt2, 2, root, timeout=240)


def _check_half_sharded(rank, p, root):
    model = _build("gptj")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"shards 25% .*fc_in.*fc_out.*'fc_in': 'column', 'fc_out': 'row', "
                                         r"'out_proj': 'row'"):
        oases.parallelize(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # left as it was
    assert oases.summary(model).layer_coverage == 0.0
    partial = {k: v for k, v in GPTJ_PLAN.items() if not k.startswith("fc")}
    with pytest.warns(UserWarning, match=r"shards 33% .*'fc_in': 'column', 'fc_out': 'row'"):
        oases.parallelize(_build("gptj"), plan=partial)
    _check_model("gptj", rank, p, root, plan=GPTJ_PLAN)
    return True


def _check_olmo2_gemma_gptj(rank, p, root):
    return _check_models(rank, p, ["olmo2", "gemma"], root) and _check_half_sharded(rank, p, root)


def test_olmo2_gemma_and_a_half_sharded_gptj_tp2():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_olmo2_gemma_gptj, 2, root, timeout=240)


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
