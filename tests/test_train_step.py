"""oases.train_step on parallelized Hugging Face models (Llama with GQA, Qwen2, Qwen3, GPT-NeoX
with parallel and sequential residual), on every schedule and several sub-batch counts, against
the unsharded model's own forward and loss.backward(); all-reduce counts per layer; bad input.

Each rank builds the whole model from a shared seed, keeps a copy as the reference, parallelizes
the other, and compares the loss and every gradient (sliced by each module's tp_layout()).
"""

import contextlib
import copy
import importlib.util
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import oases
from oases.schedule import SCHEDULES, Communicator

from _shards import expected_shard as _expected
from _spawn import harness_device, rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TOL = dict(rtol=1e-4, atol=1e-5)
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=96,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def _model(kind, heads=4, kv_heads=2, seed=0):
    """A small causal LM on the rank's device; heads / kv_heads: query and key-value heads (GQA when they differ)."""
    import transformers as tf

    torch.manual_seed(seed)
    attn = dict(num_attention_heads=heads, num_key_value_heads=kv_heads)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, **attn)).to(rank_device())
    if kind == "mistral":  # sliding-window attention (window shorter than the sequence)
        return tf.MistralForCausalLM(tf.MistralConfig(**SMALL, **attn, sliding_window=8)).to(rank_device())
    if kind == "qwen2":  # q/k/v with biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL, **attn)).to(rank_device())
    if kind == "qwen3":  # per-head q/k norms
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, **attn, head_dim=64 // heads)).to(rank_device())
    if kind in ("neox", "neox-sequential"):
        return tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(
                **SMALL,
                num_attention_heads=heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                use_parallel_residual=kind == "neox",
            )
        ).to(rank_device())
    raise AssertionError(kind)


def _batch(b, t, seed, padded):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (b, t), generator=g)
    labels = ids.clone()
    mask = None
    if padded:  # right padding of different lengths; padded labels ignored
        mask = torch.ones(b, t, dtype=torch.long)
        for i in range(b):
            mask[i, t - i :] = 0
        labels[mask == 0] = -100
        labels[0, 3] = -100  # and one ignored token inside a sequence
    dev = rank_device()  # made on the CPU, used on the rank's device
    return ids.to(dev), labels.to(dev), None if mask is None else mask.to(dev)


def _reference(model, ids, labels, mask):
    out = model(input_ids=ids, labels=labels, attention_mask=mask)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_models(rank, world_size, models, cases, plan=None):
    for kind, heads, kv_heads in models:
        ref = _model(kind, heads, kv_heads)
        tp = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(tp, plan=plan)
        if plan is not None and "lm_head" in plan:  # the schedules must not need the gathered logits
            tp.lm_head.gather_output = False
        for schedule, sub_batches, b, padded, *rest in cases:
            sp = bool(rest and rest[0])
            recompute = (
                True
                if len(rest) < 2
                else rest[1]
                if isinstance(rest[1], list)
                else {"keep": False}.get(rest[1], rest[1])
            )
            ids, labels, mask = _batch(b, 12, seed=b + 7, padded=padded)
            ref.zero_grad(set_to_none=True)
            tp.zero_grad(set_to_none=True)
            want_loss, want_grads = _reference(ref, ids, labels, mask)
            loss = oases.train_step(
                tp,
                ids,
                labels,
                schedule=schedule,
                sub_batches=sub_batches,
                attention_mask=mask,
                sequence_parallel=sp,
                recompute=recompute,
            )
            where = (
                f"{kind} heads={heads}/{kv_heads} p={world_size} {schedule} sub_batches={sub_batches} "
                f"batch={b} padded={padded} sequence_parallel={sp} recompute={recompute}"
            )
            torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
            for name, param in tp.named_parameters():
                assert param.grad is not None, f"{where}: {name} got no gradient"
                torch.testing.assert_close(
                    param.grad,
                    _expected(tp, name, want_grads[name], rank, world_size),
                    **TOL,
                    msg=lambda m: f"{where}: grad of {name}: {m}",
                )
    return True


_EVERY_SCHEDULE = [(s, None, 4, False) for s in SCHEDULES]
_EVERY_SCHEDULE_SP = [(s, None, 4, True, True) for s in SCHEDULES]
_SPLITS = [("oases", 1, 3, False), ("oases", 3, 3, True), ("cross_pass", 4, 5, True), ("oases", 3, 3, True, True)]


def test_llama_and_qwen2_with_gqa_every_schedule_match_unsharded_tp2():
    cases = _EVERY_SCHEDULE + _EVERY_SCHEDULE_SP + _SPLITS
    run_ranks(_check_models, 2, [("llama", 4, 2), ("qwen2", 4, 2)], cases, timeout=240)


def test_gqa_models_match_unsharded_tp4():
    models = [("llama", 8, 4), ("qwen3", 8, 4), ("neox", 4, 4)]
    run_ranks(_check_models, 4, models, _EVERY_SCHEDULE[:1] + _SPLITS[1:2] + _SPLITS[3:], timeout=300)


def test_vocab_parallel_llama_matches_unsharded():
    plan = {**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab", "lm_head": "vocab_head"}
    cases = [("oases", None, 4, True), ("megatron", None, 3, False), ("oases", None, 4, True, True)]
    run_ranks(_check_models, 2, [("llama", 4, 2)], cases, plan, timeout=240)


def _check_without_recomputation(rank, world_size):
    """recompute=False: each sublayer's forward graph kept, the schedules' sub-batches and
    overlap unchanged; every schedule, padded, 3 sub-batches; "selective" likewise; refused with
    sequence parallelism and offload, on every rank before any communication."""
    cases = [(s, None, 4, True, False, "keep") for s in SCHEDULES] + [("oases", 3, 3, False, False, "keep")]
    cases += [
        ("oases", None, 4, True, False, "selective"),
        ("megatron", None, 3, False, False, "selective"),
        ("oases", 3, 3, False, False, "selective"),
    ]
    # one mode per layer: the kept layers from their graphs, the others as each schedule recomputes
    cases += [(s, None, 4, True, False, [False, True]) for s in SCHEDULES]
    cases += [
        ("oases", 3, 3, False, False, [True, "selective"]),
        ("merak", None, 4, False, False, ["selective", False]),
    ]
    _check_models(rank, world_size, [("llama", 4, 2), ("neox", 4, 4), ("qwen3", 4, 2)], cases)
    tp = _model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids, labels, _ = _batch(4, 12, seed=1, padded=False)
    with pytest.raises(ValueError, match="recompute=False: not with sequence_parallel"):
        oases.train_step(tp, ids, labels, sequence_parallel=True, recompute=False)
    with pytest.raises(ValueError, match="recompute=False: not with offload"):
        oases.train_step(tp, ids, labels, offload=True, recompute=False)
    with pytest.raises(ValueError, match="recompute='selective': not with sequence_parallel"):
        oases.train_step(tp, ids, labels, sequence_parallel=True, recompute="selective")
    with pytest.raises(TypeError, match="recompute: expected 'auto', True, False, 'selective' or a list of them"):
        oases.train_step(tp, ids, labels, recompute="no")
    with pytest.raises(ValueError, match="recompute: 3 values for a model of 2 layers; give one per layer"):
        oases.train_step(tp, ids, labels, recompute=[True, False, True])
    with pytest.raises(TypeError, match="recompute: each layer's value must be True, False or 'selective', got 0"):
        oases.train_step(tp, ids, labels, recompute=[True, 0])
    with pytest.raises(ValueError, match=r"recompute=\[True, False\]: not with offload"):
        oases.train_step(tp, ids, labels, offload=True, recompute=[True, False])
    dist.barrier()
    return True


def test_without_recomputation_every_schedule_matches_unsharded():
    run_ranks(_check_without_recomputation, 2, timeout=240)


def _count_ops(rank, world_size):
    """Per step, aten ops run: "selective" reruns element-wise ops (the MLP's SiLU, the norms'
    rsqrt) but no matrix product; True reruns both; False neither; [False, True] one layer's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    import transformers as tf

    torch.manual_seed(0)  # attention through scaled_dot_product_attention, to see it saved
    tp = tf.LlamaForCausalLM(
        tf.LlamaConfig(**{**SMALL, "attn_implementation": "sdpa"}, num_attention_heads=4, num_key_value_heads=2)
    ).to(rank_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids, labels, _ = _batch(4, 12, seed=1, padded=False)
    counts = {}
    for recompute in (False, "selective", True, (False, True)):
        oases.train_step(tp, ids, labels, recompute=list(recompute) if isinstance(recompute, tuple) else recompute)
        with Count() as count:
            oases.train_step(tp, ids, labels, recompute=list(recompute) if isinstance(recompute, tuple) else recompute)
        counts[recompute] = count.ops
    mm = {k: c.get("mm", 0) + c.get("addmm", 0) + c.get("bmm", 0) for k, c in counts.items()}
    sdpa = {k: sum(n for op, n in c.items() if op.startswith("_scaled_dot_product")) for k, c in counts.items()}
    assert 0 < sdpa[False] == sdpa["selective"] < sdpa[True], sdpa  # attention is saved, not rerun
    silu = {k: c.get("silu", 0) for k, c in counts.items()}
    rsqrt = {k: c.get("rsqrt", 0) for k, c in counts.items()}
    assert mm[False] == mm["selective"] < mm[True], mm
    assert mm[False, True] == (mm[False] + mm[True]) // 2, mm  # one layer of two kept, one recomputed
    assert silu[False] < silu["selective"] == silu[True], silu
    assert rsqrt[False] < rsqrt["selective"], rsqrt
    return True


def test_selective_recomputation_reruns_elementwise_ops_not_gemms():
    run_ranks(_count_ops, 2, timeout=120)


def _selective_equals_kept(rank, world_size):
    """recompute="selective" gives the kept graph's loss and gradients bit for bit (the recomputed
    ops are deterministic), in fp32 and under bf16 autocast."""
    tp = _model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids, labels, mask = _batch(4, 12, seed=3, padded=True)
    for dtype in (None, torch.bfloat16):
        got = {}
        for recompute in (False, "selective"):
            tp.zero_grad(set_to_none=True)
            with torch.autocast(harness_device(), dtype=dtype) if dtype else contextlib.nullcontext():
                loss = oases.train_step(tp, ids, labels, attention_mask=mask, recompute=recompute)
            got[recompute] = loss, {n: p.grad.clone() for n, p in tp.named_parameters()}
        assert torch.equal(got[False][0], got["selective"][0]), dtype
        for name, grad in got[False][1].items():
            assert torch.equal(grad, got["selective"][1][name]), (dtype, name)
    return True


def test_selective_recomputation_equals_the_kept_graph_bit_for_bit():
    run_ranks(_selective_equals_kept, 2, timeout=120)


def test_selective_refuses_a_saved_output_changed_in_place():
    """A forward that changes a matrix product's output in place (through F.linear's or matmul's
    reshaping of it) would make the rerun read changed values: refused with a ValueError saying
    what to do, never silently wrong gradients."""
    import torch.nn.functional as F

    from oases.schedule.selective import explained, selective

    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)

    def scaled_linear(x):
        y = F.linear(x, w)
        y.mul_(2)
        return y.sin()

    def scaled_scores(x):
        q = x.view(2, 3, 2, 2).transpose(1, 2)
        s = q @ q.transpose(-1, -2)
        s /= 2
        return s.softmax(-1)

    for fn in (scaled_linear, scaled_scores):
        out = selective(fn, x).sum()
        with pytest.raises(ValueError, match="recompute='selective'.*in place.*recompute=True or False"):
            with explained():
                out.backward()

    def plain(x):  # no in-place change: the same gradients as autograd's own graph
        return (F.linear(x, w).sin() @ w).softmax(-1)

    plain(x).sum().backward()
    want, x.grad, w.grad = (x.grad.clone(), w.grad.clone()), None, None
    selective(plain, x).sum().backward()
    assert torch.equal(x.grad, want[0]) and torch.equal(w.grad, want[1])


def test_qwen3_mistral_and_neox_every_schedule_match_unsharded():
    models = [("qwen3", 4, 2), ("mistral", 4, 2), ("neox", 4, 4), ("neox-sequential", 4, 4)]
    cases = _EVERY_SCHEDULE + _SPLITS[1:2] + [("oases", None, 4, True, True), ("megatron", None, 4, False, True)]
    run_ranks(_check_models, 2, models, cases, timeout=240)


def _count(rank, world_size):
    counts = {}
    for kind in ("llama", "neox"):
        model = _model(kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(model)
        ids, labels, _ = _batch(4, 12, 0, False)
        calls = []  # the model's forward pre-hooks (parallelize's input check, a collective) inside a step
        model.register_forward_pre_hook(lambda module, args: calls.append(1))
        for schedule in SCHEDULES:
            comm = Communicator(dist.group.WORLD, world_size)
            oases.train_step(model, ids, labels, schedule=schedule, comm=comm, recompute=True)  # counts it
            counts[kind, schedule] = (dict(comm.calls), dict(comm.bytes))
        assert not calls, f"{kind}: the model's own forward was called {len(calls)} times inside train_step"
    return counts


def test_all_reduces_per_layer():
    counts = run_ranks(_count, 2)[0]
    layers, activation = SMALL["num_hidden_layers"], 4 * 12 * SMALL["hidden_size"] * 4  # fp32 bytes of [4, 12, h]
    # parallelize's default shards the embedding and the LM head over the vocabulary: the schedule
    # runs their all-reduces too (embed_split / head_split), one of an activation each per
    # sub-batch: the embedding's output forward, the head's input gradient backward.
    # Llama: two sublayers per layer. megatron 2 fwd + 2 recompute + 2 bwd; oases none in recompute.
    calls, sent = counts["llama", "megatron"]
    assert calls == {"forward": 2 * layers + 1, "recompute": 2 * layers, "backward": 2 * layers + 1}
    assert sent == {phase: (2 * layers + (phase != "recompute")) * activation for phase in calls}
    calls, sent = counts["llama", "oases"]
    assert calls == {"forward": 4 * layers + 2, "backward": 4 * layers + 2}  # 2 sub-batches: half-size calls
    assert sent == {"forward": (2 * layers + 1) * activation, "backward": (2 * layers + 1) * activation}
    # GPT-NeoX, parallel residual: one all-reduce serves both branches forward; backward reduces
    # the stacked [ln1 x, ln2 x] gradient in one call (twice an activation).
    calls, sent = counts["neox", "megatron"]
    assert calls == {"forward": layers + 1, "recompute": layers, "backward": layers + 1}
    assert sent == {
        "forward": (layers + 1) * activation,
        "recompute": layers * activation,
        "backward": (2 * layers + 1) * activation,
    }
    calls, _ = counts["neox", "oases"]
    assert calls == {"forward": 2 * layers + 2, "backward": 2 * layers + 2}


def _check_bad_input(rank, world_size):
    model = _model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model)
    ids, labels, _ = _batch(4, 12, 0, False)
    with pytest.raises(ValueError, match="sub_batches: expected an int in 1..8"):
        oases.train_step(model, ids, labels, sub_batches=9)
    with pytest.raises(ValueError, match="splits the batch into 3 sub-batches; got batch size 2"):
        oases.train_step(model, ids[:2], labels[:2], sub_batches=3)
    with pytest.raises(ValueError, match="labels: shape"):
        oases.train_step(model, ids, labels[:, :5])
    with pytest.raises(TypeError, match=r"labels: expected an integer tensor of token ids, got torch.float32"):
        oases.train_step(model, ids, labels.float())
    with pytest.raises(TypeError, match=r"input_ids: expected an integer tensor of token ids, got torch.bool"):
        oases.train_step(model, ids > 0, labels)
    with pytest.raises(ValueError, match="schedule: 'fast'"):
        oases.train_step(model, ids, labels, schedule="fast")
    with pytest.raises(ValueError, match="comm: its group .size 1. is not the model's TP group"):
        oases.train_step(model, ids, labels, comm=Communicator(None, 1))
    with pytest.raises(ValueError, match="sequence_parallel splits the sequence over 2 ranks; got length 11"):
        oases.train_step(model, ids[:, :11], labels[:, :11], sequence_parallel=True)
    gpt = oases.models.GPT(oases.models.GPTConfig(vocab_size=96, seq_len=12, hidden=32, heads=4)).to(rank_device())
    with pytest.raises(ValueError, match="attention_mask: GPT has no padding mask"):
        oases.train_step(gpt, ids, labels, attention_mask=torch.ones_like(ids))
    dropout = _model("neox")
    dropout.config.hidden_dropout = 0.1
    for layer in dropout.gpt_neox.layers:
        layer.post_mlp_dropout.p = 0.1
    # train_step and the pipeline seed dropout (tests/test_dropout_training.py, test_pipeline_dropout.py);
    # a caller that does not (check_trainable() unseeded) still refuses it, before any communication
    with pytest.raises(ValueError, match="decoder layer 0 has dropout 0.1"):
        oases.models.HFStack(dropout.train()).check_trainable()
    half = _model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(
            half,
            plan={
                "model.layers.0.*.o_proj": "row",
                "model.layers.0.*.down_proj": "row",
                "model.layers.0.*_proj": "column",
            },
        )
    with pytest.raises(ValueError, match="decoder layer 1's LlamaAttention is not fully tensor-parallel"):
        oases.train_step(half, ids, labels)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers, self.head = nn.Embedding(8, 4), nn.ModuleList(), nn.Linear(4, 8)

    with pytest.raises(ValueError, match="Plain is neither a Hugging Face causal LM nor an oases.schedule.Stack"):
        oases.train_step(Plain().to(rank_device()), ids, labels)
    assert all(p.grad is None for p in model.parameters()), "nothing ran"
    dist.barrier()  # every rank got here: no rank was left in a collective
    return True


def test_bad_input_raises_on_every_rank_before_communication():
    run_ranks(_check_bad_input, 2)


def test_unknown_architecture_names_what_the_adapter_needs():
    import transformers as tf

    # its layers: base_model.encoder.layer
    model = tf.BertForMaskedLM(
        tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64)
    )
    with pytest.raises(
        ValueError,
        match=r"no adapter for BertForMaskedLM \(no decoder layers.*implement "
        r"oases.schedule.Stack",
    ):
        oases.train_step(model, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


def _check_nanogpt(rank, world_size):
    from test_parallelize import GPT as NanoGPT

    torch.manual_seed(3)
    ref = NanoGPT(n_embd=48, n_head=12).to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2)).to(rank_device())
    logits = ref(idx)
    want_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
    want_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for schedule, sp in (("oases", False), ("megatron", False), ("oases", True)):
        tp.zero_grad(set_to_none=True)
        comm = Communicator(dist.group.WORLD, world_size)
        loss = oases.train_step(tp, idx, idx, schedule=schedule, sequence_parallel=sp, comm=comm)
        if not sp:  # the schedule sums the vocabulary-parallel wte's output, per sub-batch (embed_split);
            # the head, gathering its logits, all-reduces its input gradient itself
            assert comm.calls["forward"] == comm.calls["backward"] + (2 if schedule == "oases" else 1)
        torch.testing.assert_close(loss, want_loss.detach(), **TOL)
        for name, param in tp.named_parameters():
            torch.testing.assert_close(
                param.grad,
                _expected(tp, name, want[name], rank, world_size),
                **TOL,
                msg=lambda m: f"nanoGPT {schedule} sp={sp} {name}: {m}",
            )
    return True


def test_nanogpt_style_model_matches_unsharded():
    run_ranks(_check_nanogpt, 2, timeout=120)


def _check_loss_fn_and_own_stack(rank, world_size):
    """loss_fn replaces the loss; a user's own Stack (the README's shape) runs on the schedules."""
    import torch.nn.functional as F

    ref = _model("llama")
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp, vocab_parallel=False)  # loss_fn sees whole logits (a vocab-parallel head: slices)
    ids, labels, _ = _batch(4, 12, 5, False)
    labels[1, 2:5] = -100
    logits = ref(input_ids=ids).logits  # unshifted token loss, z-loss term included
    mask = labels != -100
    token = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    want = ((token * mask.flatten()).sum() + 1e-3 * (logits.logsumexp(-1) ** 2)[mask].sum()) / mask.sum()
    want.backward()

    def loss_fn(logits, labels):  # summed over the rows given
        keep = labels != -100
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
        return (ce * keep.flatten()).sum() + 1e-3 * (logits.logsumexp(-1) ** 2)[keep].sum()

    loss = oases.train_step(tp, ids, labels, schedule="oases", sub_batches=3, loss_fn=loss_fn)
    torch.testing.assert_close(loss, want.detach(), **TOL)
    for name, param in tp.named_parameters():
        torch.testing.assert_close(
            param.grad,
            _expected(tp, name, dict(ref.named_parameters())[name].grad, rank, world_size),
            **TOL,
            msg=lambda m: f"loss_fn {name}: {m}",
        )

    class OwnStack:  # a user's own stack over the same sharded modules, as the README shows
        def __init__(self, model):
            self.model = model
            self.subs = oases.models.HFStack(model).layers()

        def embed(self, input_ids, where):
            x = self.model.model.embed_tokens(input_ids)
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            rotary = self.model.model.rotary_emb(x, position_ids)
            t = input_ids.shape[1]
            # eager attention's additive mask
            causal = torch.full((t, t), float("-inf"), device=input_ids.device).triu(1)[None, None]
            kwargs = dict(position_embeddings=rotary, attention_mask=causal, position_ids=position_ids)
            return x, _OwnContext(where, tuple(kwargs for _ in self.subs))

        def layers(self):
            return self.subs

        def head(self, x, ctx):
            return self.model.lm_head(self.model.model.norm(x))

    tp.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    for sp in (False, True):
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(
            OwnStack(tp),
            ids,
            ids,
            schedule="oases",
            sequence_parallel=sp,
            comm=Communicator(dist.group.WORLD, world_size),
        )
        torch.testing.assert_close(loss, want.detach(), **TOL)
        for name, param in tp.named_parameters():
            torch.testing.assert_close(
                param.grad,
                _expected(tp, name, dict(ref.named_parameters())[name].grad, rank, world_size),
                **TOL,
                msg=lambda m: f"own stack sp={sp} {name}: {m}",
            )
    return True


class _OwnContext:
    def __init__(self, where, layer_kwargs):
        self.where, self.layer_kwargs = where, layer_kwargs


def test_loss_fn_and_a_users_own_stack():
    run_ranks(_check_loss_fn_and_own_stack, 2, timeout=120)


def _check_frozen_embedding(rank, world_size):
    ref = _model("llama")
    ref.model.embed_tokens.weight.requires_grad_(False)
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids, labels, _ = _batch(4, 12, 3, False)
    want_loss, want = _reference(ref, ids, labels, None)
    for schedule, sp in (("megatron", False), ("oases", False), ("oases", True), ("cross_pass", True)):
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(tp, ids, labels, schedule=schedule, sequence_parallel=sp)
        torch.testing.assert_close(loss, want_loss, **TOL)
        assert tp.model.embed_tokens.weight.grad is None
        for name, param in tp.named_parameters():
            if param.requires_grad:
                torch.testing.assert_close(
                    param.grad,
                    _expected(tp, name, want[name], rank, world_size),
                    **TOL,
                    msg=lambda m: f"frozen embedding {schedule} sp={sp} {name}: {m}",
                )
    return True


def test_frozen_embedding():
    run_ranks(_check_frozen_embedding, 2, timeout=120)
