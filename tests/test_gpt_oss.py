"""GPT-OSS with the default plan, against the unsharded model: attention sinks and interleaved experts.

A tiny random GptOssForCausalLM (no download) holds the two parts GPT-OSS adds to a Mixtral-like
model:

    self_attn.sinks [heads]      one learned logit per query head -> cut by query heads like q_proj
                                 (oases.nn._heads: the attention module's tp_layout, ShardRule(0))
    mlp.experts                  gate_up_proj [E, H, 2I] with gate / up interleaved, its bias [E, 2I],
                                 down_proj [E, I, H] and its bias [E, H], a clamped swiglu ->
                                 ParallelExperts' "interleaved" form: whole (gate, up) pairs per rank,
                                 the down bias in one rank's partial sum (oases.nn.experts)
    mlp.router                   weight [E, H], bias [E]: replicated, its gradient summed

At TP 2 (one spawn): the default plan shards >= 95% of the decoder layers' projection parameters
and the layers split for the schedules; forward logits and loss.backward() gradients of every
parameter equal the unsharded model's (right padding masked); oases.train_step's loss and every
gradient equal them on every schedule (and with sequence parallelism); save_pretrained writes the
unsharded Hugging Face layout that transformers reads back, full_state_dict gives it too,
save_checkpoint / load_checkpoint round-trip, and a build on the meta device gets the plain
build's values. At TP 4 (2 kv heads, each held by two ranks; one query head and one sink per
rank): logits, gradients, train_step on "oases", the round trips and the meta build.
Locally: the experts' form is recognised only with GPT-OSS's gate (another _apply_gate is
refused, naming it), and an intermediate size the world size does not divide is refused.
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

from _shards import check_export, check_grads, expected_shard
from _spawn import rank_device, run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)
CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=96,
    max_position_embeddings=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    attn_implementation="eager",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


def _config():
    import transformers as tf

    return tf.GptOssConfig(**CONFIG)


def _build():
    """The model, its biases and sinks drawn away from Hugging Face's zero / tiny init (a bias
    added on every rank, or a sink on the wrong rank, must show)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(_config())
    with torch.no_grad():
        for name, q in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                q.normal_(0.0, 0.5)
    return model.to(rank_device())


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (4, 12), generator=g).to(rank_device())
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding: its labels ignored
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _reference(ref, ids, mask, labels):
    ref.zero_grad(set_to_none=True)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: q.grad.clone() for n, q in ref.named_parameters()}


def _check_parts(tp, ref, rank, p):
    """The sinks and the experts are sharded as the module docs say (values: the unsharded model's)."""
    from oases.nn.experts import ParallelExperts

    attention, block = tp.model.layers[0].self_attn, tp.model.layers[0].mlp
    assert attention.sinks.shape == (4 // p,) and "sinks" in attention.tp_layout(), attention
    assert isinstance(block.experts, ParallelExperts) and block.experts.form == "interleaved", block
    i = 128 // p
    shapes = {
        "gate_up_proj": (4, 64, 2 * i),
        "gate_up_proj_bias": (4, 2 * i),
        "down_proj": (4, i, 64),
        "down_proj_bias": (4, 64),
    }
    assert {n: tuple(q.shape) for n, q in block.experts.named_parameters()} == shapes
    full = ref.state_dict()
    for name, q in tp.named_parameters():
        assert torch.equal(q, expected_shard(tp, name, full[name], rank, p)), f"{name} on rank {rank}"
    pairs = ref.model.layers[0].mlp.experts.gate_up_proj[..., 2 * i * rank : 2 * i * (rank + 1)]
    assert torch.equal(block.experts.gate_up_proj, pairs)  # rank r: the (gate, up) pairs [r I/p, (r+1) I/p)


def _check_files(tp, ref, rank, p, root):
    """save_pretrained -> transformers; full_state_dict; save_checkpoint / load_checkpoint."""
    want = ref.state_dict()
    built = oases.full_state_dict(tp)
    for key, value in want.items():
        torch.testing.assert_close(built[key], value, rtol=0, atol=0, msg=lambda m: f"full_state_dict {key}: {m}")
    where = os.path.join(root, f"tp{p}-export")
    check_export(tp, ref, where, rank, "gpt-oss")
    fresh = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(fresh)
    with torch.no_grad():
        for q in fresh.parameters():
            q.mul_(-2.0).add_(1.0)  # every value changed
    oases.save_checkpoint(tp, os.path.join(root, f"tp{p}-ckpt"))
    oases.load_checkpoint(fresh, os.path.join(root, f"tp{p}-ckpt"))
    for (name, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), f"{name} after load_checkpoint"


def _check_meta():
    """Built on the meta device and parallelized with device=rank_device(): the plain build's values."""
    import transformers as tf

    with torch.device("meta"):
        meta = tf.GptOssForCausalLM(_config())
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(meta, device=rank_device())
    torch.manual_seed(0)
    # Hugging Face's init (ref's biases were redrawn)
    plain = tf.GptOssForCausalLM(_config()).to(rank_device()).state_dict()
    built = oases.full_state_dict(meta)
    for key, value in plain.items():
        assert torch.equal(built[key], value), f"{key} built on meta"


def _check(rank, p, schedules, root):
    ref = _build()
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        oases.parallelize(tp)
    assert not said, [str(w.message) for w in said]
    summary = oases.summary(tp)
    assert summary.layer_coverage >= 0.95 and not summary.left_whole, summary
    assert {part.kind for part in oases.models.HFStack(tp).parts} == {"sequential"}
    _check_parts(tp, ref, rank, p)

    ids, mask, labels = _batch()
    want_logits, want_loss, want = _reference(ref, ids, mask, labels)
    tp.zero_grad(set_to_none=True)
    out = tp(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.logits, want_logits, **TOL, msg=lambda m: f"tp{p} logits: {m}")
    torch.testing.assert_close(out.loss, want_loss, **TOL, msg=lambda m: f"tp{p} loss: {m}")
    out.loss.backward()
    check_grads(tp, want, rank, p, f"tp{p} forward", TOL)

    for schedule, sp in schedules:
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp)
        where = f"tp{p} train_step {schedule} sequence_parallel={sp}"
        torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
        check_grads(tp, want, rank, p, where, TOL)
    _check_files(tp, ref, rank, p, root)
    _check_meta()
    return True


def test_gpt_oss_matches_unsharded_tp2():
    schedules = [(s, False) for s in SCHEDULES] + [("oases", True)]
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check, 2, schedules, root, timeout=240)


def test_gpt_oss_matches_unsharded_tp4():
    """TP 4 with 2 kv heads: each kv head held by two ranks (oases.nn._kv), one sink per rank."""
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check, 4, [("oases", False)], root, timeout=240)


def test_gpt_oss_experts_form_checked():
    """Only GPT-OSS's own gate is taken for the interleaved form; p must divide the intermediate size."""
    import transformers.models.gpt_oss.modeling_gpt_oss as gpt_oss

    from oases.nn.experts import check_experts, is_fused_experts

    experts = gpt_oss.GptOssExperts(_config())
    assert is_fused_experts(experts)
    check_experts("mlp.experts", experts, 2)
    with pytest.raises(ValueError, match=r"mlp\.experts: the experts' intermediate size 128 is not divisible .* 3"):
        check_experts("mlp.experts", experts, 3)

    class _Unclamped(gpt_oss.GptOssExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    refused = r"mlp\.experts: _Unclamped has a layout .*_apply_gate='_Unclamped\._apply_gate'"
    with pytest.raises(ValueError, match=refused):
        check_experts("mlp.experts", _Unclamped(_config()), 2)
