"""oases.parallelize on whole models (Hugging Face Llama and GPT-NeoX, a nanoGPT-style GPT, a toy
under an explicit plan) against the unsharded model, on gloo ranks.

Each rank builds the whole model from a shared seed, keeps a copy as the reference, parallelizes
the other, runs both on the same batch, and compares the loss and every parameter's gradient
with the matching slice of the reference's (slices taken here, from the module types).
"""

import copy
import importlib.util
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oases
from oases.nn import ColumnParallelLinear, RowParallelLinear, mappings

from _nanogpt import Block
from _spawn import rank_device, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)


def _expected_grad(tp_model, name, full_grad, rank, p):
    """The slice of the unsharded gradient that parameter `name` of the sharded model must hold."""
    owner_name, _, leaf = name.rpartition(".")
    owner = tp_model.get_submodule(owner_name)
    if isinstance(owner, ColumnParallelLinear) and owner.stacked > 1:  # spelled out: the fused layout
        return torch.cat([block.chunk(p, 0)[rank] for block in full_grad.chunk(owner.stacked, 0)])
    rule = owner.tp_layout().get(leaf) if hasattr(owner, "tp_layout") else None
    if rule is not None:  # column rows, row columns, vocabulary rows
        return rule.shard(full_grad, rank, p)
    return full_grad  # replicated: row biases, norms, unsharded layers


def _check_gradients(ref, tp, rank, p, what):
    ref_params = dict(ref.named_parameters())
    tp_params = dict(tp.named_parameters())
    assert ref_params.keys() == tp_params.keys()
    for name, param in tp_params.items():
        assert param.grad is not None, f"{what}: {name} got no gradient"
        want = _expected_grad(tp, name, ref_params[name].grad, rank, p)
        torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m: f"{what} p={p} {name}: {m}")


def _assert_unchanged(model):
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules())


# --- Hugging Face models ---------------------------------------------------------------------------


def _llama(kv_heads, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(rank_device())


def _neox(seed=0):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(config).to(rank_device())


def _check_hf_equivalence(ref, group, p, tp_rank, ids, what):
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default plan places every nn.Linear (the head: vocab-parallel)
        assert oases.parallelize(tp, group) is tp
    assert isinstance(tp.get_output_embeddings(), oases.nn.ColumnParallelLinear)
    assert isinstance(tp.get_input_embeddings(), oases.nn.VocabParallelEmbedding)
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out_tp = tp(input_ids=ids, labels=ids)
    all_reduced, original = [], mappings._all_reduced
    mappings._all_reduced = lambda t, ring: all_reduced.append(t.shape) or original(t, ring)
    try:
        out_tp.loss.backward()
    finally:
        mappings._all_reduced = original
    # One all-reduce per block input (attention, MLP): q, k, v and gate, up share theirs; one for the
    # vocab-parallel head's input (the embedding's backward has none).
    assert len(all_reduced) == 2 * len(_decoder_layers(tp)) + 1, (what, all_reduced)
    torch.testing.assert_close(out_tp.logits, out_ref.logits, **TOL)
    torch.testing.assert_close(out_tp.loss, out_ref.loss, **TOL)
    _check_gradients(ref, tp, tp_rank, p, what)
    return tp


def _decoder_layers(model):
    return model.model.layers if hasattr(model, "model") else model.gpt_neox.layers


def _check_hf_models(rank, world_size):
    """Llama and GPT-NeoX at TP=4 on the world, then TP=2 on the subgroups {0, 1} and {2, 3}."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not importable"
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(rank_device())
    for group, p, tp_rank in ((None, 4, rank), (pairs[rank // 2], 2, rank % 2)):
        for kv_heads in [k for k in (2, 4) if k % p == 0]:  # p=2: GQA and MHA; p=4: MHA
            tp = _check_hf_equivalence(_llama(kv_heads), group, p, tp_rank, ids, f"llama kv_heads={kv_heads}")
            attn, mlp = tp.model.layers[0].self_attn, tp.model.layers[0].mlp
            assert all(isinstance(getattr(attn, n), ColumnParallelLinear) for n in ("q_proj", "k_proj", "v_proj"))
            assert isinstance(attn.o_proj, RowParallelLinear) and isinstance(mlp.down_proj, RowParallelLinear)
            assert isinstance(mlp.gate_proj, ColumnParallelLinear) and type(tp.lm_head) is ColumnParallelLinear
            assert attn.k_proj.weight.shape == (kv_heads * 16 // p, 64)
            assert tp.config.num_attention_heads == 4, "the shared config is never changed"
        tp = _check_hf_equivalence(_neox(), group, p, tp_rank, ids, "gpt-neox")
        attn = tp.gpt_neox.layers[1].attention
        assert isinstance(attn.query_key_value, ColumnParallelLinear) and isinstance(attn.dense, RowParallelLinear)

    model = _llama(kv_heads=2)  # 2 KV heads over 4 ranks: replicated (tests/test_user_models.py), not per layer
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn: 2 key-value heads at TP degree 4 would be "
        r"replicated over 2 ranks each, which per-layer tp_degrees do not support",
    ):
        oases.parallelize(model, tp_degrees=[4, 4])
    with pytest.raises(ValueError, match="sequence_parallel=True: LlamaForCausalLM is a Hugging Face"):
        oases.parallelize(model, pairs[rank // 2], sequence_parallel=True)
    with pytest.raises(ValueError, match=r"head projections must all be column-parallel, but v_proj"):
        oases.parallelize(model, pairs[rank // 2], plan={"q_proj": "column", "k_proj": "column", "o_proj": "row"})
    _assert_unchanged(model)
    dist.barrier()
    return True


def test_hf_llama_and_neox_match_unsharded_at_tp2_and_tp4():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    results = run_ranks(_check_hf_models, 4, timeout=180)
    if isinstance(results[0], str):
        pytest.skip(results[0])
    assert results == [True] * 4


# --- nanoGPT-style model, explicit plans -----------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, n_embd, n_head, n_layer=2, vocab=64, block_size=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _loss(model, idx):
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


class Toy(nn.Module):
    """An MLP under names no default plan knows; sequence-first [s, b, h] activations."""

    def __init__(self, h, ffn):
        super().__init__()
        self.ffn = nn.ModuleDict(dict(w1=nn.Linear(h, ffn), w2=nn.Linear(ffn, h)))
        self.head = nn.Linear(h, 4)

    def forward(self, x):
        return self.head(x + self.ffn["w2"](F.gelu(self.ffn["w1"](x))))


def _check_nanogpt(rank, p):
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2)).to(rank_device())
    torch.manual_seed(3)
    ref = GPT(n_embd=48, n_head=12).to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every nn.Linear placed: the head vocab-parallel by default
        oases.parallelize(tp, chunks=2)
    assert isinstance(tp.lm_head, ColumnParallelLinear) and isinstance(tp.wte, oases.nn.VocabParallelEmbedding)
    assert tp.h[0].attn.c_attn.stacked == 3 and tp.h[0].attn.c_attn.chunks == 2
    assert (tp.h[0].attn.n_head, tp.h[0].attn.n_embd) == (12 // p, 48 // p), "per-rank heads and width"
    assert isinstance(tp.h[1].mlp.c_proj, RowParallelLinear) and isinstance(tp.h[1].attn.c_proj, RowParallelLinear)
    loss_ref, loss_tp = _loss(ref, idx), _loss(tp, idx)
    loss_ref.backward()
    loss_tp.backward()
    torch.testing.assert_close(loss_tp, loss_ref, **TOL)
    _check_gradients(ref, tp, rank, p, "nanoGPT")

    # Heads that do not split: 2p+1 heads of 2p features, whose widths all divide by p.
    model = GPT(n_embd=(2 * p + 1) * 2 * p, n_head=2 * p + 1).to(rank_device())
    with pytest.raises(
        ValueError,
        match=rf"h\.0\.attn: n_head={2 * p + 1} is not divisible by the "
        rf"tensor-parallel world size {p}",
    ):
        oases.parallelize(model)
    _assert_unchanged(model)
    dist.barrier()
    return True


def _check_plans(rank, p):
    h, ffn, s, b = 8 * p, 16 * p, 4 * p, 2
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(4)).to(rank_device())
    plan = {"ffn.w1": "column", "*.w2": "row", "nothing.here": "row"}
    for sequence_parallel in (False, True):
        torch.manual_seed(5)
        ref = Toy(h, ffn).to(rank_device())
        tp = copy.deepcopy(ref)
        with pytest.warns(UserWarning) as caught:
            oases.parallelize(tp, plan=plan, sequence_parallel=sequence_parallel)
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "left 1 nn.Linear module(s) unsharded" in message and ": head." in message, message
        assert "Plan patterns matching no nn.Linear: 'nothing.here'" in message, message
        assert tp.ffn["w2"].sequence_parallel == sequence_parallel
        x_ref = x.clone().requires_grad_()
        ref(x_ref).square().sum().backward()
        local = (lambda t: t.chunk(p, 0)[rank]) if sequence_parallel else (lambda t: t)
        x_tp = local(x).clone().requires_grad_()
        y_tp = tp(x_tp)
        y_tp.square().sum().backward()
        torch.testing.assert_close(y_tp, local(ref(x)), **TOL)
        torch.testing.assert_close(x_tp.grad, local(x_ref.grad), **TOL)
        for name, param in tp.named_parameters():
            if name.startswith("head.") and sequence_parallel:
                # An unsharded layer after a sequence-parallel region sees only this rank's rows:
                # summing over ranks is the model's business (this one is not SP-aware past ffn).
                dist.all_reduce(param.grad)
            want = _expected_grad(tp, name, dict(ref.named_parameters())[name].grad, rank, p)
            torch.testing.assert_close(
                param.grad, want, **TOL, msg=lambda m: f"plan sp={sequence_parallel} {name}: {m}"
            )

    # Misplanned or unsplittable layers raise, naming the module, before anything changes.
    model = Toy(h, ffn).to(rank_device())
    with pytest.raises(ValueError, match=r"plan\['ffn\.w1'\]: expected 'column', 'column:N'"):
        oases.parallelize(model, plan={"ffn.w1": "colum"})
    with pytest.raises(
        ValueError,
        match=r"head \(nn.Linear \d+ -> 4, planned as 'column'\): out_features=4 "
        r"does not split into stacked=3 equal blocks",
    ):
        oases.parallelize(model, plan={"w1": "column", "w2": "row", "head": "column:3"})
    odd = Toy(h, 4 * p + 1).to(rank_device())
    with pytest.raises(
        ValueError,
        match=rf"ffn.w1 \(nn.Linear {h} -> {4 * p + 1}, planned as 'column'\): "
        rf"out_features={4 * p + 1} is not divisible by the tensor-parallel",
    ):
        oases.parallelize(odd, plan={"w1": "column", "w2": "row"})
    _assert_unchanged(odd)
    _assert_unchanged(model)
    with pytest.raises(TypeError, match="is itself an nn.Linear"):
        oases.parallelize(nn.Linear(h, h))
    with pytest.raises(  # a row-parallel layer takes a shard of its input: nothing here makes one
        ValueError,
        match=r"Toy: head is planned as 'row' \(its input a shard of the features\), but no projection of Toy is "
        r"column-parallel to produce that shard",
    ):
        oases.parallelize(model, plan={"w1": "column", "w2": "row", "head": "row"})
    _assert_unchanged(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every Linear placed: no warning
        oases.parallelize(model, plan={"w1": "column", "w2": "row", "head": "vocab_head"})
    dist.barrier()
    return True


def _check_models_and_plans(rank, p):
    return _check_nanogpt(rank, p) and _check_plans(rank, p)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_nanogpt_and_explicit_plans_match_unsharded(world_size):
    assert run_ranks(_check_models_and_plans, world_size, timeout=120) == [True] * world_size
