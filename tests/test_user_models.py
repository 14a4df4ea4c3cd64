"""Models as users bring them (issue 20, item 7): GQA at TP degrees above the kv heads, generate()
after parallelize, PEFT-wrapped linears.

    TP 4 > kv_heads 2   Llama (4 heads, 2 kv heads) and Phi-3 (fused q|k|v) on 4 ranks: each rank
                        holds its query head and the kv head it uses (two ranks per copy); logits,
                        every gradient (each copy equal to the unsharded rows), oases.train_step on
                        the megatron and oases schedules, clip_grad_norm_, full_state_dict,
                        save_pretrained (each kv head once) and a save_checkpoint read back at TP 2
    generate            greedy tokens with the KV cache after parallelize at TP 2 equal the
                        unsharded model's (vocab-parallel head, eval, no_grad, input checks on)
    PEFT / LoRA         a linear wrapped with LoRA adapters is refused, naming it and the fix
    own modules         what parallelize cannot keep is refused on every rank, the model unchanged:
                        a projection that does more than a plain nn.Linear (its own forward, extra
                        parameters, hooks, weight_norm), a tie of planned projections (or one module
                        under two names), an attention with no head count oases can make per-rank,
                        a row-parallel projection with no column-parallel one before it (torch's
                        nn.MultiheadAttention's out_proj); {**DEFAULT_PLAN, ...} warns only of its own
"""

import copy
import importlib.util
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import oases

from _shards import check_grads
from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TOL = dict(rtol=1e-4, atol=1e-5)
SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _llama(**extra):
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{**SMALL, **extra})).to(rank_device())


def _phi3():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))
    return model.to(rank_device())


def _parallelized(model, group=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return oases.parallelize(model, group)


def _check_grads(tp, want, rank, p, where):
    check_grads(tp, want, rank, p, where, TOL)


def _reference(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}


def _check_kv_replicated(kind, rank, p, root):
    ref = _llama() if kind == "llama" else _phi3()
    tp = _parallelized(copy.deepcopy(ref))
    attention = tp.model.layers[0].self_attn
    c = p // 2  # ranks per kv head
    if kind == "llama":
        assert attention.k_proj.replicas == (c,) and attention.q_proj.replicas == ()
        assert attention.k_proj.weight.shape[0] == 8 and attention.q_proj.weight.shape[0] == 8  # one head each
        assert attention.num_key_value_groups == 1 and attention.config.num_key_value_heads == 1
    else:
        assert attention.qkv_proj.replicas == (1, c, c) and attention.qkv_proj.weight.shape[0] == 3 * 8
        assert attention.num_key_value_heads == 1 and attention.num_key_value_groups == 1
    k = "model.layers.0.self_attn." + ("k_proj.weight" if kind == "llama" else "qkv_proj.weight")
    full_k = ref.get_parameter(k).detach()
    kv_rows = full_k[-32:] if kind == "phi3" else full_k  # [k | v] of the fused layer: 2 heads each
    mine = _parameter(tp, k).detach()[-16:] if kind == "phi3" else _parameter(tp, k).detach()
    head = rank // c  # the kv head rank r's query head uses
    want = (
        kv_rows[head * 8 : (head + 1) * 8]
        if kind == "llama"
        else torch.cat([kv_rows[head * 8 : (head + 1) * 8], kv_rows[16 + head * 8 : 16 + (head + 1) * 8]])
    )
    assert torch.equal(mine, want), f"{kind}: rank {rank} holds kv head {head}"

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (4, 10), generator=g).to(rank_device())
    want_logits, want_loss, want = _reference(ref, ids, ids)
    tp.zero_grad(set_to_none=True)
    out = tp(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want_logits, **TOL, msg=lambda m: f"{kind}: logits {m}")
    torch.testing.assert_close(out.loss, want_loss, **TOL)
    out.loss.backward()
    _check_grads(tp, want, rank, p, f"{kind} forward")
    grad = _parameter(tp, k).grad[-16:] if kind == "phi3" else _parameter(tp, k).grad  # the kv rows
    copies = [torch.empty_like(grad) for _ in range(p)]
    dist.all_gather(copies, grad.contiguous())
    assert torch.equal(copies[rank], copies[rank ^ 1]), f"{kind}: the copies' gradients differ"

    total = oases.nn.clip_grad_norm_(tp, 1e9)  # kv rows held twice, counted once
    want_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch.testing.assert_close(total, want_total, **TOL)

    for schedule in ("megatron", "oases") if kind == "llama" else ("oases",):
        tp.zero_grad(set_to_none=True)
        loss = oases.train_step(tp, ids, ids, schedule=schedule)
        torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{kind} {schedule}: loss {m}")
        _check_grads(tp, want, rank, p, f"{kind} {schedule}")

    full = oases.full_state_dict(tp)
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), f"{kind}: full_state_dict {key}"
    _check_generate(ref, tp, f"{kind} at TP {p}")  # the cache holds this rank's one kv head
    if kind == "phi3":
        return
    where = os.path.join(root, "export")
    oases.save_pretrained(tp, where)  # each kv head once, the unsharded layout
    if rank == 0:
        from safetensors.torch import load_file

        files = [f for f in os.listdir(where) if f.endswith(".safetensors")]
        got = {key: t for f in files for key, t in load_file(os.path.join(where, f)).items()}
        assert set(got) == set(ref.state_dict()), "export keys"
        for key, value in ref.state_dict().items():
            assert torch.equal(got[key], value.cpu()), f"export {key}"
    oases.save_checkpoint(tp, os.path.join(root, "ckpt"))
    half = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # TP 2: whole kv heads, no copies
    back = _parallelized(_llama(), half)
    with torch.no_grad():
        for q in back.parameters():
            q.mul_(-2.0)
    oases.load_checkpoint(back, os.path.join(root, "ckpt"))
    assert back.model.layers[0].self_attn.k_proj.replicas == ()
    for key, value in oases.full_state_dict(back).items():
        assert torch.equal(value, ref.state_dict()[key]), f"TP 2 from a TP 4 checkpoint: {key}"


def _parameter(model, name):
    return model.get_parameter(name)


def _check_generate(ref, tp, where):
    """Greedy generate() with the KV cache: the same tokens and scores as the unsharded model, each
    step after the prompt feeding one new token (the cache in use), the inputs checked each forward."""
    ref.eval(), tp.eval()
    ids = torch.randint(3, 60, (3, 6), generator=torch.Generator().manual_seed(2)).to(rank_device())
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    lengths = []
    hook = tp.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        use_cache=True,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = tp.generate(ids, **kw)
    hook.remove()
    assert torch.equal(got.sequences, want.sequences), f"{where}: {got.sequences} != {want.sequences}"
    assert len(got.scores) == 8 and got.scores[0].shape == (3, ref.config.vocab_size), where
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{where}: generate scores {m}")
    assert lengths == [6] + [1] * 7, f"{where}: forward input lengths {lengths} (KV cache unused?)"
    ref.train(), tp.train()


def _check_refused_at_tp4(rank, p):
    """What cannot hold replicated kv heads raises on every rank before anything changes."""
    import transformers as tf

    torch.manual_seed(0)
    olmo = tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL)).to(rank_device())
    before = copy.deepcopy(olmo.state_dict())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_norm: a norm over the whole width of k_proj"):
        oases.parallelize(olmo)
    assert all(torch.equal(v, olmo.state_dict()[k]) for k, v in before.items())
    assert not any(isinstance(m, oases.nn.ColumnParallelLinear) for m in olmo.modules())
    with pytest.raises(ValueError, match=r"replicated over 2 ranks each, which per-layer tp_degrees do not support"):
        oases.parallelize(_llama(), tp_degrees=[4, 2])
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads=3 is not divisible by the tensor-parallel world size 4.*"
        r"or a multiple of it",
    ):
        oases.parallelize(_llama(num_attention_heads=12, num_key_value_heads=3, hidden_size=48))
    fused = _llama()
    with pytest.raises(ValueError, match=r"k_proj: 2 key-value heads at TP degree 4 .* this one \(stacked=2\)"):
        oases.parallelize(
            fused,
            plan={
                "q_proj": "column",
                "k_proj": "column:2",
                "v_proj": "column",
                "o_proj": "row",
                "gate_proj": "column",
                "up_proj": "column",
                "down_proj": "row",
            },
        )


def _check_zero_clip_dp2_tp2(rank, p):
    """One kv head at TP 2 (both ranks hold it) under ZeRO over DP 2: the norm counts it once."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ref = _llama(num_key_value_heads=1)
    model = _parallelized(copy.deepcopy(ref), tp_groups[rank // 2])  # TP group != world: groups found by all-gather
    assert model.model.layers[0].self_attn.k_proj.replicas == (2,)
    opt = oases.dp.ZeroOptimizer(model, dp_groups[rank % 2], torch.optim.SGD, lr=0.0)
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(3)).to(rank_device())
    model(input_ids=ids, labels=ids).loss.backward()  # both dp ranks the same rows: the mean is the gradient
    ref(input_ids=ids, labels=ids).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch.testing.assert_close(opt.clip_grad_norm_(1e9), want, **TOL)


def _check_tp4(rank, p, root):
    _check_refused_at_tp4(rank, p)
    _check_zero_clip_dp2_tp2(rank, p)
    _check_kv_replicated("llama", rank, p, root)
    _check_kv_replicated("phi3", rank, p, root)
    return True


def test_gqa_at_tp_above_kv_heads_tp4():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_check_tp4, 4, root, timeout=240)


def _check_generate_tp2(rank, p):
    ref = _llama()
    tp = _parallelized(copy.deepcopy(ref))
    head = tp.get_output_embeddings()
    assert isinstance(head, oases.nn.ColumnParallelLinear) and head.gather_output  # vocab-parallel, gathered
    _check_generate(ref, tp, f"llama at TP {p}")
    tp.eval()
    # each rank another prompt: refused by the input check, every rank
    other = torch.full((1, 4), 5 + rank, device=rank_device())
    with torch.no_grad(), pytest.raises(ValueError, match=r"input_ids.*differ"):
        tp.generate(other, max_new_tokens=2, do_sample=False, pad_token_id=0)
    return True


def test_generate_with_kv_cache_equals_unsharded_tp2():
    run_ranks(_check_generate_tp2, 2, timeout=120)


class _LoraLinear(nn.Module):
    """PEFT's LoRA layer as it looks from outside: base_layer, lora_A / lora_B ModuleDicts."""

    def __init__(self, base: nn.Linear, r: int = 2) -> None:
        super().__init__()
        self.base_layer = base
        device = base.weight.device
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False, device=device)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False, device=device)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def _check_lora_refused(rank, p):
    model = _llama()
    attention = model.model.layers[1].self_attn
    attention.q_proj, attention.v_proj = _LoraLinear(attention.q_proj), _LoraLinear(attention.v_proj)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(
        ValueError,
        match=r"model: model\.layers\.1\.self_attn\.q_proj \(and 1 more\) wraps its "
        r"base_layer with LoRA adapters .*merge_and_unload\(\)",
    ):
        oases.parallelize(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(isinstance(m, oases.nn.ColumnParallelLinear) for m in model.modules())
    return True


def test_lora_wrapped_linears_refused_tp2():
    run_ranks(_check_lora_refused, 2, timeout=60)


@pytest.mark.parametrize("p", [4, 8])
def test_shard_rule_replicas(p):
    """ShardRule(replicas=...): c consecutive ranks hold the same slice of a block; the boxes say
    where, unshard takes one copy, and squares_once counts each copied row once."""
    from oases._sharding import ShardRule, squares_once

    full = torch.randn(48, 3, generator=torch.Generator().manual_seed(0))
    for rule, tensor in (
        (ShardRule(0, parts=(32, 8, 8), replicas=(1, p // 2, p // 2)), full),
        (ShardRule(0, replicas=(p // 2,)), full[:8]),
    ):
        shards = [rule.shard(tensor, r, p) for r in range(p)]
        spans = rule.local_copies(tensor.shape[0], p)
        for r, local in enumerate(shards):
            for chunk in rule.chunks(tuple(tensor.shape), r, p):
                assert torch.equal(chunk.of(local), tensor[chunk.index()]), (rule, r, chunk)
            assert rule.full_shape(local.shape, p) == tensor.shape
        for start, n, c in spans:  # the c ranks of a copy hold its rows alike; other blocks differ by rank
            for r in range(p):
                same = torch.equal(shards[r].narrow(0, start, n), shards[r // 2 * 2].narrow(0, start, n))
                assert same == (c > 1 or r % 2 == 0), (rule, r, start, c)
        assert torch.equal(rule.unshard(shards), tensor), rule
        total = sum(squares_once(s, tuple(x for x in spans if x[2] > 1)) for s in shards)
        torch.testing.assert_close(total, tensor.pow(2).sum(), rtol=1e-5, atol=1e-6)
        rows = sum(
            squares_once(s[k : k + 3], tuple(x for x in spans if x[2] > 1), k)
            for s in shards
            for k in range(0, s.shape[0], 3)
        )  # ZeRO: pieces of rows
        torch.testing.assert_close(rows, tensor.pow(2).sum(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="replicas must be one positive int per block"):
        ShardRule(0, stacked=3, replicas=(2,))


class _Attention(nn.Module):
    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.num_heads if hasattr(self, "num_heads") else self.heads  # the case below renames it
        q, k, v = (f(x).view(b, t, heads, -1).transpose(1, 2) for f in (self.q_proj, self.k_proj, self.v_proj))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _Mlp(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.up_proj(x)))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = _Attention(), _Mlp()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class _Scaled(nn.Linear):
    def forward(self, x):
        return 3.0 * super().forward(x)


def _stack():
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block()).to(rank_device())


def _refused(model, match, **kw):
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        oases.parallelize(model, **kw)
    assert not any(isinstance(m, (oases.nn.ColumnParallelLinear, oases.nn.RowParallelLinear)) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def _check_own_modules_refused(rank, p):
    plain = _stack()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(rank_device())
    tp = oases.parallelize(copy.deepcopy(plain))  # the plain stack shards exactly (the cases below differ by one thing)
    torch.testing.assert_close(tp(x), plain(x), **TOL)

    model = _stack()
    model[0].mlp.up_proj = _Scaled(16, 64, device=rank_device())
    _refused(
        model,
        r"0\.mlp\.up_proj \(planned as 'column'\) is a _Scaled whose forward is not Linear's; .* plain nn\.Linear",
    )
    model = _stack()
    model[1].attn.v_proj.lora = nn.Parameter(torch.zeros(2, 16, device=rank_device()))
    _refused(model, r"1\.attn\.v_proj \(planned as 'column'\) holds lora beside its weight and bias")
    model = _stack()
    model[0].mlp.down_proj.register_forward_hook(lambda module, args, out: out * 2)
    _refused(model, r"0\.mlp\.down_proj \(planned as 'row'\) has forward hooks on it")
    model = _stack()
    nn.utils.parametrizations.weight_norm(model[1].mlp.up_proj)
    _refused(model, r"1\.mlp\.up_proj \(planned as 'column'\) has a parametrization of weight")

    model = _stack()
    model[1].mlp.up_proj.weight = model[0].mlp.up_proj.weight  # tied projections
    _refused(model, r"0\.mlp\.up_proj: its weight is tied to 1\.mlp\.up_proj\.weight .* Untie them")
    model = _stack()
    model[1].mlp = model[0].mlp  # one module under two names
    _refused(model, r"0\.mlp\.up_proj: its weight is tied to 1\.mlp\.up_proj\.weight")

    model = _stack()
    for block in model:
        block.attn.heads = block.attn.num_heads  # under a name oases does not know
        del block.attn.num_heads
    _refused(
        model, r"0\.attn: its head projections are sharded over 2 ranks, but oases finds no head count on _Attention"
    )
    for block in model:
        block.attn.head_dim = 16 // 4  # a head_dim alone is enough: heads viewed as (..., -1, head_dim)
    oases.parallelize(model)
    assert model[0].attn.q_proj.weight.shape == (16 // p, 16)

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True).to(rank_device())
    plan = {**oases.nn.DEFAULT_PLAN, "linear1": "column", "linear2": "row"}  # DEFAULT_PLAN's out_proj: 'row'
    _refused(
        layer,
        r"self_attn: out_proj is planned as 'row' .* no projection of self_attn is column-parallel .*"
        r"nn\.MultiheadAttention reads out_proj\.weight itself",
        plan=plan,
    )
    plan = {k: v for k, v in plan.items() if k != "out_proj"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oases.parallelize(layer, plan=plan)
    unused = [str(w.message) for w in caught if "matching no" in str(w.message)]
    assert not unused, unused  # the default plan's patterns this model lacks are not the caller's slip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        oases.parallelize(_stack(), plan={**oases.nn.DEFAULT_PLAN, "nowhere": "column"})
    assert any("'nowhere'" in str(w.message) and "'q_proj'" not in str(w.message) for w in caught), caught
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a plan of one's own whose entry equals a default one: still named
        oases.parallelize(_stack(), plan={"up_proj": "column", "down_proj": "row", "fc1": "column"})
    assert any("matching no nn.Linear: 'fc1'" in str(w.message) for w in caught), caught
    dist.barrier()  # every rank raised alike: nobody is left waiting
    return True


def test_own_modules_parallelize_cannot_keep_are_refused_tp2():
    assert run_ranks(_check_own_modules_refused, 2, timeout=120) == [True, True]


def _degree_1(rank, p):
    # One rank: heads under a name oases does not know, and a row layer with no column layer before
    # it (nn.MultiheadAttention's out_proj), are exact at degree 1.
    model = _stack()
    for block in model:
        block.attn.heads = block.attn.num_heads
        del block.attn.num_heads
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(rank_device())
    want = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0).to(rank_device())
        plain = copy.deepcopy(layer)
        oases.parallelize(layer, plan={**oases.nn.DEFAULT_PLAN, "linear1": "column", "linear2": "row"})
    torch.testing.assert_close(model(x), want, **TOL)
    torch.testing.assert_close(layer(x), plain(x), **TOL)
    return True


def test_at_tp_degree_1_nothing_is_split_so_nothing_is_refused():
    assert run_ranks(_degree_1, 1, timeout=60) == [True]
