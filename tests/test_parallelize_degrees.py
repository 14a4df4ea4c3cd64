"""oases.parallelize(model, group, tp_degrees=[...]) on Hugging Face Llama, Qwen2, Mistral (GQA) and
GPT-NeoX, a nanoGPT-style model and a model of this file's own (layers="body.blocks"): per-layer TP
degrees give the unsharded model's loss, logits and gradients, on gloo ranks.

Each rank builds the whole model from a shared seed, keeps a copy as the reference, parallelizes
the other with a per-layer plan, runs both on the same batch -- for Hugging Face models once plain,
once with a padding mask and per-row position ids, so the batch-shaped mask and rotary tables are
cut too, and once more so on a batch of 5 rows that the replicas do not divide (blocks of unequal
size) -- and checks that every decoder layer's input is exactly the reference's at this rank's
replica rows, then compares logits, loss and every parameter's gradient with the matching slice of
the reference's (slices taken from each module's own TP size and rank: degree d layers are shards
over d ranks). Every batch row differs (tokens, masks, position offsets), so a reshard or a cut to
the wrong rows fails the layer-input check. A model of this file's own also runs its layers under
a reentrant torch.utils.checkpoint (recomputed on detached inputs).
"""

import copy
import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oases
from oases.nn import ColumnParallelLinear, RowParallelLinear

from _nanogpt import Block
from _spawn import rank_device, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)
LAYERS, BATCH, SEQ, VOCAB = 4, 4, 8, 128


def _model(kind="llama", seed=0):
    """A small decoder of `kind`: llama, qwen2 (biased q/k/v), qwen3 (per-head q/k norms), mistral, all
    GQA with 2 queries per KV head; neox (fused head-by-head query_key_value, parallel residual,
    rotary on a quarter of each head)."""
    import transformers

    if kind == "neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=64,
            num_attention_heads=8,
            num_hidden_layers=LAYERS,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            attn_implementation="eager",
        )
        torch.manual_seed(seed)
        return transformers.GPTNeoXForCausalLM(config).to(rank_device())
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[kind]
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=LAYERS,
        head_dim=8,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).to(rank_device())


def _inputs():
    """Three batches: plain, and padded on the right with per-row position ids (batch-shaped kwargs),
    of BATCH rows and of BATCH + 1 (an odd count: blocks of unequal size)."""
    batches = []
    for b in (BATCH, BATCH + 1):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(0, VOCAB, (b, SEQ), generator=g).to(rank_device())
        mask = torch.ones(b, SEQ, dtype=torch.long, device=rank_device())
        mask[1, SEQ - 3 :] = 0
        mask[3, SEQ - 1 :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        positions = torch.arange(SEQ).repeat(b, 1) + torch.arange(b)[:, None]  # a different offset per row
        batches.append(
            dict(input_ids=ids, labels=labels, attention_mask=mask, position_ids=positions.to(rank_device()))
        )
    return [dict(input_ids=batches[0]["input_ids"], labels=batches[0]["input_ids"]), *batches]


def _expected_grad(model, name, full):
    """The slice of the unsharded gradient that parameter `name` holds (its module's own TP size)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, ColumnParallelLinear):
        return torch.cat([b.chunk(owner.world_size, 0)[owner.rank] for b in full.chunk(owner.stacked, 0)])
    if isinstance(owner, RowParallelLinear) and leaf == "weight":
        return full.chunk(owner.world_size, 1)[owner.rank]
    return full  # replicated: norms, embeddings, the head, layers of degree 1


def _layer_inputs(layers):
    """{layer index: a list that fills with its hidden-states input at each call (as the layer sees
    it, after any earlier pre-hook: the resharded rows; a recomputed layer is called again)}, and
    the hook handles."""
    seen = {i: [] for i in range(len(layers))}

    def record(i, module, args, kwargs):
        seen[i].append((args[0] if args else kwargs["hidden_states"]).detach().clone())

    return seen, [
        layer.register_forward_pre_hook(functools.partial(record, i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]


def _compare(where, ref, model, layers_of, degrees, p, batches, forward):
    """forward(m, batch) -> (loss, logits) on both models: every layer's input at this rank's replica
    rows, then logits, loss and every parameter's gradient (its shard's slice) against the reference."""
    rank = dist.get_rank()
    for batch in batches:
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        seen_ref, handles = _layer_inputs(layers_of(ref))
        seen, more = _layer_inputs(layers_of(model))
        loss_ref, logits_ref = forward(ref, batch)
        loss_ref.backward()
        loss, logits = forward(model, batch)
        loss.backward()
        for h in handles + more:
            h.remove()
        what = f"{where} {sorted(batch)} batch {logits_ref.shape[0]}"
        assert len(seen) == len(seen_ref) == len(degrees), (what, len(seen), len(seen_ref))
        for l, d in enumerate(degrees):
            assert len(seen[l]) == len(seen_ref[l]) >= 1, (what, l, len(seen[l]), len(seen_ref[l]))
            for x, x_ref in zip(seen[l], seen_ref[l]):
                b, replicas, j = x_ref.shape[0], p // d, rank // d  # rows [floor(j b / R), floor((j + 1) b / R))
                torch.testing.assert_close(
                    x,
                    x_ref[j * b // replicas : (j + 1) * b // replicas],
                    **TOL,
                    msg=lambda m: f"{what}: input of layer {l} (degree {d}): {m}",
                )
        torch.testing.assert_close(logits, logits_ref, **TOL, msg=lambda m: f"{what}: logits: {m}")
        torch.testing.assert_close(loss, loss_ref, **TOL, msg=lambda m: f"{what}: loss: {m}")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            assert param.grad is not None, f"{what}: {name} got no gradient"
            want = _expected_grad(model, name, ref_params[name].grad)
            torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m: f"{what}: grad of {name}: {m}")


def _hf_forward(m, batch):
    out = m(**batch)
    return out.loss, out.logits


def _check_sharding(layers, degrees, shards):
    """shards(layer) -> (a column-planned, a row-planned module) of the layer: shards over d ranks at
    degree d (TP rank rank % d), plain nn.Linear at degree 1."""
    for layer, d in zip(layers, degrees):
        column, row = shards(layer)
        if d == 1:
            assert type(column) is nn.Linear and type(row) is nn.Linear
        else:
            assert isinstance(column, ColumnParallelLinear) and isinstance(row, RowParallelLinear)
            assert column.world_size == row.world_size == d and column.rank == dist.get_rank() % d


def _check_plan(kind, degrees, p):
    where = f"rank {dist.get_rank()} {kind} tp_degrees={degrees}"
    ref = _model(kind)
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=r"left 1 nn.Linear module\(s\) unsharded .*: (lm_head|embed_out)\."):
        assert oases.parallelize(model, tp_degrees=degrees) is model
    assert model.tp_degrees == model.layer_degrees.degrees == tuple(degrees)
    assert not [name for name in vars(model) if name.startswith("_oases")]  # one public attribute, nothing private
    if kind == "neox":
        _check_sharding(model.gpt_neox.layers, degrees, lambda l: (l.attention.query_key_value, l.mlp.dense_4h_to_h))
    else:
        _check_sharding(model.model.layers, degrees, lambda l: (l.self_attn.q_proj, l.mlp.down_proj))
    _compare(where, ref, model, lambda m: m.base_model.layers, degrees, p, _inputs(), _hf_forward)
    return model


# --- a nanoGPT-style model (Karpathy's layout: transformer.{wte, wpe, h, ln_f}, lm_head) -----------


class NanoGPT(nn.Module):
    def __init__(self, n_embd=32, n_head=4):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, n_embd),
                wpe=nn.Embedding(SEQ, n_embd),
                h=nn.ModuleList(Block(n_embd, n_head) for _ in range(LAYERS)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx, targets):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _check_nanogpt(degrees, p):
    where = f"rank {dist.get_rank()} nanoGPT tp_degrees={degrees}"
    torch.manual_seed(3)
    ref = NanoGPT().to(rank_device())
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=r": lm_head\.$"):
        oases.parallelize(model, tp_degrees=degrees)  # found at transformer.h
    _check_sharding(model.transformer.h, degrees, lambda b: (b.attn.c_attn, b.mlp.c_proj))
    for block, d in zip(model.transformer.h, degrees):  # per-rank heads at the block's own degree
        assert (block.attn.n_head, block.attn.n_embd) == (4 // d, 32 // d), where
    batches = []
    for b in (BATCH, BATCH + 1):  # BATCH + 1: blocks of unequal size
        ids = torch.randint(0, VOCAB, (b, SEQ + 1), generator=torch.Generator().manual_seed(2)).to(rank_device())
        batches.append(dict(idx=ids[:, :-1], targets=ids[:, 1:]))
    _compare(where, ref, model, lambda m: m.transformer.h, degrees, p, batches, lambda m, b: m(**b))


# --- a model of this file's own: blocks at body.blocks, called as block(x, keep, scale=, table=) --


class MyBlock(nn.Module):
    """A pre-norm MLP, then a masked running mean over the sequence: rows independent, tokens mixed."""

    def __init__(self, h):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x, keep, *, scale, table):
        # x [B, t, h]; keep [B, t] (per row, positional); scale [B] (per row); table [t, h] (shared)
        x = x + self.down(F.gelu(self.up(self.norm(x + table)))) * scale[:, None, None]
        w = keep[..., None].to(x.dtype)  # [B, t, 1]
        mean = (x * w).cumsum(1) / w.cumsum(1).clamp(min=1)
        return x + mean, mean.square().mean()  # (hidden states, something else)


class Mine(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h)
        self.body = nn.ModuleDict(dict(blocks=nn.ModuleList(MyBlock(h) for _ in range(LAYERS))))
        self.register_buffer("table", torch.randn(SEQ, h) / 10)
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, VOCAB)

    def forward(self, ids, keep, scale, recompute=False):
        x = self.embed(ids)
        for block in self.body["blocks"]:
            call = functools.partial(block, scale=scale, table=self.table)
            if recompute:  # the reentrant form: the layer is rerun in backward on detached inputs
                x, _ = torch.utils.checkpoint.checkpoint(call, x, keep, use_reentrant=True)
            else:
                x, _ = call(x, keep)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")[keep.flatten()].mean(), logits


MY_PLAN = {"up": "column", "down": "row"}


def _my_batch(batch=BATCH):
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(batch, SEQ, generator=g) > 0.3
    keep[:, 0] = True
    ids, scale = torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.rand(batch, generator=g) + 0.5
    return dict(ids=ids.to(rank_device()), keep=keep.to(rank_device()), scale=scale.to(rank_device()))


def _check_mine(degrees, p):
    where = f"rank {dist.get_rank()} Mine tp_degrees={degrees}"
    torch.manual_seed(4)
    ref = Mine().to(rank_device())
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=r": head\.$"):
        oases.parallelize(model, plan=MY_PLAN, tp_degrees=degrees, layers="body.blocks")
    _check_sharding(model.body["blocks"], degrees, lambda b: (b.up, b.down))
    odd = [_my_batch(BATCH + 1), {**_my_batch(BATCH + 1), "recompute": True}]  # unequal blocks, recomputed too
    _compare(where, ref, model, lambda m: m.body["blocks"], degrees, p, [_my_batch(), *odd], lambda m, b: m(**b))

    # Bad input: the same error on every rank, before any communication; the model left as it was.
    fresh = Mine().to(rank_device())
    for kwargs, error, match in (
        (dict(layers="body.nope"), ValueError, r"layers: Mine has no submodule 'body\.nope'"),
        (dict(layers="body"), TypeError, r"layers: model\.body is a ModuleDict, not an nn\.ModuleList"),
        (dict(layers=["body", "blocks"]), TypeError, r"layers: expected a dotted path \(str\)"),
        (dict(), ValueError, r"tp_degrees: Mine has no decoder layers where oases looks .* pass layers="),
        (
            dict(layers="body.blocks", tp_degrees=degrees[:-1]),
            ValueError,
            rf"tp_degrees: expected one degree per layer of model\.body\.blocks \({LAYERS} layers\), got {LAYERS - 1}",
        ),
        (dict(layers="body.blocks", tp_degrees=[4 * p] * LAYERS), ValueError, "power of two dividing the group"),
        (dict(layers="body.blocks", tp_degrees=None), ValueError, r"layers='body\.blocks': .* no tp_degrees"),
    ):
        with pytest.raises(error, match=match):
            oases.parallelize(fresh, plan=MY_PLAN, **{"tp_degrees": degrees, **kwargs})
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in fresh.modules())
    assert not hasattr(fresh, "tp_degrees")
    most = p // min(degrees)  # a replica of the most would get no row
    with pytest.raises(ValueError, match=f"got batch size {most - 1} \\(use at least {most} rows\\)"):
        model(**_my_batch(most - 1))
    batch = _my_batch()
    batch["scale"].requires_grad_()
    with pytest.raises(ValueError, match=r"body\.blocks\[0\]: keyword scale requires grad"):
        model(**batch)


def _bad_inputs(rank, p, model, degrees):
    """Every rank raises the same ValueError before any communication; the model is left as it was."""
    fresh = _model()
    for bad, match in (
        ([1] * (LAYERS - 1), "one degree per layer"),
        ([3] + [1] * (LAYERS - 1), "power of two"),
        ([2 * p] * LAYERS, "power of two dividing the group size"),
    ):
        with pytest.raises(ValueError, match=match):
            oases.parallelize(fresh, tp_degrees=bad)
    with pytest.raises(ValueError, match="sequence_parallel=True: not supported with per-layer tp_degrees"):
        oases.parallelize(fresh, sequence_parallel=True, tp_degrees=[1] * LAYERS)
    with pytest.raises(ValueError, match=r"plan\['lm_head'\]: 'vocab_head' is not supported with per-layer"):
        oases.parallelize(fresh, plan={**oases.nn.DEFAULT_PLAN, "lm_head": "vocab_head"}, tp_degrees=[1] * LAYERS)
    with pytest.raises(ValueError, match=r"no decoder layers where oases looks \(model\.base_model\.layers, "):
        oases.parallelize(nn.Sequential(nn.Linear(8, 8)).to(rank_device()), tp_degrees=[1])
    if p == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        with pytest.raises(ValueError, match="must be the whole world"):
            oases.parallelize(fresh, pairs[rank // 2], tp_degrees=[1, 2, 2, 1])
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in fresh.modules())
    assert not hasattr(fresh, "tp_degrees")

    most = p // min(degrees)  # every replica of every layer needs a row of the batch
    ids = torch.zeros(most + 1, SEQ, dtype=torch.long, device=rank_device())
    with pytest.raises(ValueError, match=f"batch: .* got batch size {most - 1} \\(use at least {most} rows\\)"):
        model(input_ids=ids[: most - 1])
    with pytest.raises(ValueError, match="replicas"):  # 2 sub-batches of most / 2 rows: not one per replica
        oases.train_step(model, ids[:most], ids[:most])


def _ranks_main(rank, p, plans):
    """Every plan, then the bad inputs on the last Hugging Face plan's model (a Llama: train_step
    refuses it by its tp_degrees)."""
    checks = dict(nanogpt=_check_nanogpt, mine=_check_mine)
    for kind, degrees in plans:
        if kind in checks:
            checks[kind](degrees, p)
        else:
            model, hf = _check_plan(kind, degrees, p), (kind, degrees)
    _bad_inputs(rank, p, model, hf[1])
    dist.barrier()
    return True


@pytest.mark.parametrize(
    "world_size, plans",
    [
        (
            2,
            [
                ("nanogpt", [1, 2, 2, 1]),
                ("mine", [2, 1, 2, 1]),
                ("neox", [1, 2, 2, 1]),
                ("qwen2", [2, 1, 1, 2]),
                ("qwen3", [1, 2, 1, 2]),
                ("mistral", [1, 1, 2, 2]),
                ("llama", [1, 2, 2, 1]),
            ],
        ),
        (4, [("neox", [2, 4, 4, 2]), ("neox", [4, 1, 2, 4]), ("llama", [2, 4, 1, 2]), ("llama", [2, 2, 2, 2])]),
    ],
)
def test_per_layer_degrees_match_unsharded(world_size, plans):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    assert run_ranks(_ranks_main, world_size, plans, timeout=180) == [True] * world_size
