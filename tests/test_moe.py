"""Mixture-of-experts models at TP 2 with the default plan, against the unsharded model (issue 20, item 1).

Tiny random models from their configs (no downloads):

    mixtral    routed experts fused in 3-D parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]),
               a replicated top-k router (4 experts, top 2)
    qwen2_moe  the same, plus a shared expert (a dense MLP) scaled by a sigmoid gate

For each, in one spawn: the default plan shards the experts (each expert's intermediate dim:
ParallelExperts) and >= 95% of the decoder layers' shardable parameters (oases.summary), and the
MoE block's forward all-reduces once (routed and shared experts together); forward logits and
loss.backward() gradients (the router's included) equal the unsharded model's, also with the
load-balancing loss (output_router_logits=True); oases.train_step's loss and every gradient equal
them on every schedule and with sequence parallelism, the MoE block a split sublayer; a train_step
of a model whose config asks for router logits is refused; save_pretrained writes the unsharded
Hugging Face layout (transformers reads it back) that load_pretrained reads into a fresh TP model;
save_checkpoint / load_checkpoint round-trip at TP 2 and load into the unsharded model (TP 1).
Mixtral also: a build on the meta device gets the plain build's values. Qwen2-MoE also: per-layer
TP degrees (an MoE layer sharded, one whole) stay exact; plans that would not be exact are refused
(a shared expert left whole, a router planned as sharded), and one without 'experts' warns,
naming the experts and the entry that would shard them (its layers then run whole, exact).
"""

import copy
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch

import oases
from oases.nn import DEFAULT_PLAN
from oases.schedule import SCHEDULES

from _shards import check_export, check_grads
from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TOL = dict(rtol=1e-4, atol=1e-5)
COMMON = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=96,
    max_position_embeddings=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    attn_implementation="eager",
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**COMMON, num_local_experts=4)).to(rank_device())
    if kind == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(
            tf.Qwen2MoeConfig(
                **COMMON,
                num_experts=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                decoder_sparse_step=1,
            )
        ).to(rank_device())
    raise AssertionError(kind)


def _check_grads(tp, want, rank, p, where):
    check_grads(tp, want, rank, p, where, TOL)


def _forward_backward(model, ids, mask, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    out.loss.backward()
    return out


def _all_reduces(block, x):
    """How many all-reduces one forward of `block` makes (oases' mappings all reduce through _all_reduced)."""
    from oases.nn import mappings

    real, calls = mappings._all_reduced, []
    mappings._all_reduced = lambda t, ring: calls.append(tuple(t.shape)) or real(t, ring)
    try:
        with torch.no_grad():
            block(x)
    finally:
        mappings._all_reduced = real
    return calls


def _check_model(kind, rank, p, root):
    from oases.nn.experts import ParallelExperts

    ref = _build(kind)
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        oases.parallelize(tp)
    assert not said, f"{kind}: parallelize said {[str(w.message) for w in said]}"
    summary = oases.summary(tp)
    assert summary.layer_coverage >= 0.95 and not summary.left_whole, f"{kind}: {summary}"
    assert summary.world_size == p and summary.share < 0.6, f"{kind}: {summary}"
    block = tp.model.layers[0].mlp
    intermediate = 64 if kind == "mixtral" else 32
    assert isinstance(block.experts, ParallelExperts), f"{kind}: {block}"
    assert block.experts.gate_up_proj.shape == (4, 2 * intermediate // p, 32), f"{kind}: {block.experts}"
    assert block.experts.down_proj.shape == (4, 32, intermediate // p), f"{kind}: {block.experts}"
    assert {part.style for part in summary.parts if part.name.endswith("mlp.experts")} == {"experts"}, summary
    assert oases.models.HFStack(tp).parts[0].kind == "sequential", kind  # the MoE block: a split sublayer
    reduced = _all_reduces(block, torch.randn(2, 5, 32).to(rank_device()))
    assert reduced == [(2, 5, 32)], f"{kind}: the MoE block's forward all-reduced {reduced}"

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (4, 12), generator=g).to(rank_device())
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, its labels ignored
    labels = ids.masked_fill(mask == 0, -100)
    for aux in (False, True):  # with the load-balancing loss: the router's logits leave the MoE blocks
        where = f"{kind} forward output_router_logits={aux}"
        want = _forward_backward(ref, ids, mask, labels, output_router_logits=aux)
        want_grads = {n: q.grad.clone() for n, q in ref.named_parameters()}
        got = _forward_backward(tp, ids, mask, labels, output_router_logits=aux)
        torch.testing.assert_close(got.logits, want.logits, **TOL, msg=lambda m: f"{where}: logits {m}")
        torch.testing.assert_close(got.loss, want.loss, **TOL, msg=lambda m: f"{where}: loss {m}")
        if aux:
            torch.testing.assert_close(got.aux_loss, want.aux_loss, **TOL, msg=lambda m: f"{where}: aux_loss {m}")
        _check_grads(tp, want_grads, rank, p, where)

    want = _forward_backward(ref, ids, mask, labels)
    want_grads = {n: q.grad.clone() for n, q in ref.named_parameters()}
    for schedule, sp in [(s, False) for s in SCHEDULES] + [("oases", True)]:
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp)
        where = f"{kind} {schedule} sequence_parallel={sp}"
        torch.testing.assert_close(loss, want.loss.detach(), **TOL, msg=lambda m: f"{where}: loss {m}")
        _check_grads(tp, want_grads, rank, p, where)
    tp.config.output_router_logits = True  # refused before any communication: the step's loss has no aux term
    with pytest.raises(ValueError, match="output_router_logits=True"):
        oases.train_step(tp, ids, labels, schedule="oases", attention_mask=mask)
    tp.config.output_router_logits = False

    if kind == "mixtral":  # built on meta, only this rank's shards allocated and given the plain build's values
        with torch.device("meta"):
            meta = type(ref)(ref.config)
        torch.manual_seed(0)
        oases.parallelize(meta, device=rank_device())
        built = oases.full_state_dict(meta)
        for key, value in _build(kind).state_dict().items():
            assert torch.equal(built[key], value), f"{kind}: {key} built on meta"
    where = os.path.join(root, kind)
    check_export(tp, ref, where, rank, kind)
    fresh = _build(kind)
    for q in fresh.parameters():
        torch.nn.init.normal_(q)
    oases.parallelize(fresh)
    oases.load_pretrained(fresh, where)
    for (name, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), f"{kind}: {name} after load_pretrained"
    oases.save_checkpoint(tp, os.path.join(root, kind + "-ckpt"))  # torch.distributed.checkpoint boxes
    with torch.no_grad():
        for q in fresh.parameters():
            q.mul_(-2.0)
    oases.load_checkpoint(fresh, os.path.join(root, kind + "-ckpt"))
    for (name, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), f"{kind}: {name} after load_checkpoint"
    whole = _build(kind)  # TP 1: the unsharded model reads the TP-2 checkpoint
    with torch.no_grad():
        for q in whole.parameters():
            q.mul_(-2.0)
    oases.load_checkpoint(whole, os.path.join(root, kind + "-ckpt"))
    full = oases.full_state_dict(tp)
    for key, value in whole.state_dict().items():
        assert torch.equal(full[key], value), f"{kind}: {key} loaded at TP 1"


def _check_plans(rank, p):
    """Qwen2-MoE plans that would not be exact are refused before anything changes; one that leaves
    the experts whole warns, naming them and the plan entry that would shard them."""
    model = _build("qwen2_moe")
    before = copy.deepcopy(model.state_dict())
    no_shared = {k: v for k, v in DEFAULT_PLAN.items() if k not in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match=r"mlp\.shared_expert\.gate_proj: .*plan 'gate_proj' as 'column' or 'row'"):
        oases.parallelize(model, plan=no_shared)
    with pytest.raises(ValueError, match=r"mlp\.shared_expert_gate: a router or gate .* stays replicated"):
        oases.parallelize(model, plan={**DEFAULT_PLAN, "shared_expert_gate": "row"})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # left as it was
    no_experts = {k: v for k, v in DEFAULT_PLAN.items() if k != "experts"}
    with pytest.warns(UserWarning, match=r"shards \d+% .*mlp\.experts.*'experts': 'experts'"):
        oases.parallelize(model, plan=no_experts)
    # experts left replicated: the schedules run each layer whole (exact), and parallelize said why
    assert oases.models.HFStack(model).parts[0].kind == "whole"
    ref = _build("qwen2_moe")
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(3)).to(rank_device())
    want = _forward_backward(ref, ids, None, ids)
    model.zero_grad(set_to_none=True)
    loss = oases.train_step(model, ids, ids, schedule="oases")
    torch.testing.assert_close(loss, want.loss.detach(), **TOL)
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    torch.testing.assert_close(model.get_parameter(experts).grad, ref.get_parameter(experts).grad, **TOL)
    return True


def _check_degrees(rank, p):
    """Per-layer TP degrees: the MoE block of layer 0 sharded over the p ranks, layer 1's left whole
    on each rank's rows; the model's forward and train_step stay exact."""
    ref = _build("qwen2_moe")
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LM head stays replicated with per-layer degrees
        oases.parallelize(tp, tp_degrees=[p, 1])
    assert type(tp.model.layers[0].mlp.experts).__name__ == "ParallelExperts"
    assert tp.model.layers[1].mlp.experts.gate_up_proj.shape == ref.model.layers[1].mlp.experts.gate_up_proj.shape
    ids = torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(2)).to(rank_device())
    want = _forward_backward(ref, ids, None, ids)
    want_grads = {n: q.grad.clone() for n, q in ref.named_parameters()}
    got = _forward_backward(tp, ids, None, ids)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    _check_grads(tp, want_grads, rank, p, "tp_degrees forward")
    tp.zero_grad(set_to_none=True)
    loss = oases.train_step(tp, ids, ids, schedule="oases")
    torch.testing.assert_close(loss, want.loss.detach(), **TOL)
    _check_grads(tp, want_grads, rank, p, "tp_degrees train_step")


def _check_mixtral(rank, p, root):
    _check_model("mixtral", rank, p, root)
    return True


def _check_qwen2_moe(rank, p, root):
    _check_model("qwen2_moe", rank, p, root)
    _check_degrees(rank, p)
    return _check_plans(rank, p)


def test_mixtral_matches_unsharded_tp2():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_check_mixtral, 2, root, timeout=240) == [True, True]


def test_qwen2_moe_with_a_shared_expert_matches_unsharded_tp2():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_check_qwen2_moe, 2, root, timeout=240) == [True, True]
