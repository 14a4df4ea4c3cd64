"""Vocabulary parallelism (oases.nn.vocab) against the unsharded modules, on real gloo ranks.

VocabParallelEmbedding against nn.Embedding, vocab_parallel_cross_entropy against F.cross_entropy
of the full logits (values and gradients), and a Hugging Face Llama parallelized with a
vocabulary-parallel embedding and LM head against the unsharded model: loss, logits and every
gradient, with the logits gathered (the model's own loss) and never gathered (the loss from the
shards). Expected slices come from each module's `tp_layout()`. Every case runs at p = 2 and 4;
a 4-rank run also checks p = 2 on the subgroups {0, 1} and {2, 3}, where group rank != rank.
"""

import collections
import contextlib
import copy
import importlib.util
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oases
from oases._sharding import ShardRule
from oases.nn import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mappings,
    vocab_parallel_cross_entropy,
)

from _spawn import rank_device, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(rank_device(), dtype)


def _randint(high, shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed)).to(rank_device())


@contextlib.contextmanager
def _collectives():
    """Count the torch.distributed calls made inside the block (the ring collectives use batch_isend_irecv)."""
    counts = collections.Counter()
    names = ("all_reduce", "batch_isend_irecv", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    originals = {n: getattr(dist, n) for n in names}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for n, fn in originals.items():
        setattr(dist, n, counted(n, fn))
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _groups(rank, world_size):
    """(group, p, rank in group): the world, and at 4 ranks the pairs {0, 1}, {2, 3} as well."""
    cases = [(None, world_size, rank)]
    if world_size == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cases.append((pairs[rank // 2], 2, rank % 2))
    return cases


# --- VocabParallelEmbedding ------------------------------------------------------------------------


def _check_embedding(group, p, rank):
    V, h = 6 * p, 8
    per_rank = V // p
    ids = _randint(V, (3, 7), 10)
    for padding_idx in (None, per_rank + 1, -1):  # owned by rank 1; the last id, owned by rank p-1
        torch.manual_seed(11)
        ref = nn.Embedding(V, h, padding_idx=padding_idx).to(rank_device())
        tp = VocabParallelEmbedding.from_embedding(ref, group)
        assert tp.tp_layout() == {"weight": ShardRule(0)} and tp.group is group
        assert (tp.vocab_start_index, tp.vocab_end_index) == (rank * per_rank, (rank + 1) * per_rank)
        assert tp.padding_idx == ref.padding_idx and tp.weight.shape == (per_rank, h)
        torch.manual_seed(11)  # the constructor's init is nn.Embedding's, sharded
        built = VocabParallelEmbedding(V, h, padding_idx, group=group).to(rank_device())
        assert torch.equal(built.weight, ShardRule(0).shard(ref.weight.detach(), rank, p))

        pad_ids = ids.clone()
        if padding_idx is not None:
            pad_ids[:, ::3] = ref.padding_idx
        with _collectives() as fwd:
            y = tp(pad_ids)
        y_ref = ref(pad_ids)
        assert torch.equal(y, y_ref), f"p={p} padding_idx={padding_idx}: lookups are exact"
        assert fwd["all_reduce"] == 0 and fwd["batch_isend_irecv"] > 0  # one ring all-reduce
        g = _randn(y.shape, 12)
        with _collectives() as bwd:
            (y * g).sum().backward()
        assert sum(bwd.values()) == 0, f"backward of the embedding communicates: {bwd}"
        (y_ref * g).sum().backward()
        want = tp.tp_layout()["weight"].shard(ref.weight.grad, rank, p)
        torch.testing.assert_close(tp.weight.grad, want, **TOL)
        if padding_idx is not None:
            assert not ref.weight.grad[ref.padding_idx].any()

    # A vocabulary p does not divide: ceil(V/p) rows per rank, the last rows padding (zeros, never looked up).
    odd = nn.Embedding(V + 1, h).to(rank_device())
    padded = VocabParallelEmbedding.from_embedding(odd, group)
    part = -(-(V + 1) // p)
    assert padded.weight.shape == (part, h)
    rule = padded.tp_layout()["weight"]
    parts = [rule.shard(odd.weight.detach(), r, p) for r in range(p)]
    assert torch.equal(rule.unshard(parts), odd.weight) and torch.equal(padded.weight, parts[rank])
    odd_ids = _randint(V + 1, (3, 7), 11)
    odd_ids[0, 0] = V  # the last id, owned by the last rank
    assert torch.equal(padded(odd_ids), odd(odd_ids))

    # Bad input raises on every rank, before any communication (no rank is left waiting).
    with pytest.raises(ValueError, match=r"max_norm=1\.0 is not supported"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(V, h, max_norm=1.0), group)
    with pytest.raises(IndexError, match=rf"num_embeddings={V}\), got ids in \[0, {V}\]"):
        tp(torch.tensor([0, V], device=rank_device()))
    with pytest.raises(TypeError, match="ids: expected an int64 or int32 tensor"):
        tp(torch.zeros(3, device=rank_device()))


# --- vocab_parallel_cross_entropy ------------------------------------------------------------------


def _check_cross_entropy(group, p, rank):
    V = 10 * p
    labels = _randint(V, (3, 5), 20)
    labels[0, 1] = labels[2, 4] = -100
    for dtype, scale in ((torch.float32, 3.0), (torch.float32, 300.0), (torch.bfloat16, 3.0)):
        full = (_randn((3, 5, V), 21) * scale).to(dtype)
        for ignore_index in (-100, int(labels[1, 2])):  # a class id ignored too
            case = labels.masked_fill(labels == -100, ignore_index)
            for reduction in ("mean", "sum", "none"):
                what = f"p={p} {dtype} scale={scale} ignore_index={ignore_index} reduction={reduction}"
                shard = full.chunk(p, -1)[rank].clone().requires_grad_()
                with _collectives() as fwd:
                    loss = vocab_parallel_cross_entropy(
                        shard, case, group, ignore_index=ignore_index, reduction=reduction
                    )
                assert fwd["all_reduce"] == 1 and fwd["batch_isend_irecv"] > 0, (what, fwd)  # MAX; [2, N] SUM
                full_ref = full.clone().requires_grad_()
                ref = F.cross_entropy(
                    full_ref.float().flatten(0, -2), case.flatten(), ignore_index=ignore_index, reduction=reduction
                )
                assert loss.dtype == torch.float32 and loss.shape == ref.shape, what
                torch.testing.assert_close(loss, ref, **TOL, msg=lambda m: f"{what} loss: {m}")
                g = _randn(ref.shape, 22)
                with _collectives() as bwd:
                    (loss * g).sum().backward()
                assert sum(bwd.values()) == 0, f"{what}: backward communicates: {bwd}"
                (ref * g).sum().backward()
                want = full_ref.grad.chunk(p, -1)[rank]
                tol = TOL if dtype == torch.float32 else {}  # bf16: assert_close's bf16 defaults
                torch.testing.assert_close(shard.grad, want, **tol, msg=lambda m: f"{what} grad: {m}")
                assert shard.grad.dtype == dtype

    # One token in 2-d logits, and every label ignored (mean: nan, gradient zero, as in torch).
    full = _randn((1, V), 23)
    shard = full.chunk(p, -1)[rank].clone().requires_grad_()
    ignored = torch.full((1,), -100, device=rank_device())
    loss = vocab_parallel_cross_entropy(shard, ignored, group)
    loss.backward()
    assert loss.isnan() and F.cross_entropy(full, ignored).isnan() and not shard.grad.any()
    loss = vocab_parallel_cross_entropy(shard, torch.tensor([V - 1], device=rank_device()), group, reduction="sum")
    want = F.cross_entropy(full, torch.tensor([V - 1], device=rank_device()), reduction="sum")
    torch.testing.assert_close(loss, want, **TOL)

    with pytest.raises(ValueError, match=rf"labels: {V} is neither in \[0, V={V}\) nor ignore_index=-100"):
        vocab_parallel_cross_entropy(shard, torch.tensor([V], device=rank_device()), group)
    with pytest.raises(ValueError, match=r"logits_shard \(1, 10\) and labels \(2,\): expected"):
        vocab_parallel_cross_entropy(shard, torch.tensor([0, 1], device=rank_device()), group)
    with pytest.raises(ValueError, match="reduction: expected one of 'mean', 'sum', 'none', got 'avg'"):
        vocab_parallel_cross_entropy(shard, torch.tensor([0], device=rank_device()), group, reduction="avg")
    with pytest.raises(TypeError, match="labels: expected an integer tensor"):
        vocab_parallel_cross_entropy(shard, torch.tensor([0.0], device=rank_device()), group)


def _check_layers(rank, world_size):
    for group, p, tp_rank in _groups(rank, world_size):
        _check_embedding(group, p, tp_rank)
        _check_cross_entropy(group, p, tp_rank)
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_embedding_and_cross_entropy_match_unsharded(world_size):
    assert run_ranks(_check_layers, world_size, timeout=120) == [True] * world_size


# --- Hugging Face Llama with a vocabulary-parallel embedding and LM head ---------------------------

PLAN = {**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab", "lm_head": "vocab_head"}
PAD = 40  # the padding id: rank 1's at p=4, rank 0's at p=2


def _llama(vocab_size=128, tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        pad_token_id=PAD,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(rank_device())


def _expected_grad(tp_model, name, full_grad, rank, p):
    """The part of the unsharded gradient that parameter `name` of the sharded model holds."""
    owner_name, _, leaf = name.rpartition(".")
    owner = tp_model.get_submodule(owner_name)
    rule = owner.tp_layout().get(leaf) if hasattr(owner, "tp_layout") else None
    return full_grad if rule is None else rule.shard(full_grad, rank, p)


def _check_gradients(ref, tp, rank, p, what):
    ref_params, tp_params = dict(ref.named_parameters()), dict(tp.named_parameters())
    assert ref_params.keys() == tp_params.keys()
    for name, param in tp_params.items():
        assert param.grad is not None, f"{what}: {name} got no gradient"
        want = _expected_grad(tp, name, ref_params[name].grad, rank, p)
        torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m: f"{what} p={p} {name}: {m}")


def _backward_counting_all_reduces(loss):
    shapes, original = [], mappings._all_reduced
    mappings._all_reduced = lambda t, ring: shapes.append(t.shape) or original(t, ring)
    try:
        with _collectives() as counts:
            loss.backward()
    finally:
        mappings._all_reduced = original
    assert counts["all_reduce"] == 0, counts  # the loss's MAX is a forward-only collective
    return shapes


def _assert_unchanged(model):
    sharded = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    assert not any(isinstance(m, sharded) for m in model.modules())


def _check_llama(group, p, rank, ids):
    ref = _llama()
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert oases.parallelize(tp, group, PLAN) is tp
    messages = " ".join(str(w.message) for w in caught)
    assert "unsharded" not in messages and "nn.Embedding" not in messages, messages  # head and embedding placed
    assert isinstance(tp.model.embed_tokens, VocabParallelEmbedding) and tp.model.embed_tokens.padding_idx == PAD
    assert isinstance(tp.lm_head, ColumnParallelLinear) and tp.lm_head.gather_output
    assert tp.lm_head.weight.shape == (128 // p, 64) and tp.model.embed_tokens.weight.shape == (128 // p, 64)

    # The model's own forward and loss, on gathered logits.
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out_tp = tp(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_tp.logits, out_ref.logits, **TOL)
    torch.testing.assert_close(out_tp.loss, out_ref.loss, **TOL)
    reduced = _backward_counting_all_reduces(out_tp.loss)
    # One all-reduce per block input (attention, MLP) and one for the LM head's input.
    assert len(reduced) == 2 * len(tp.model.layers) + 1, reduced
    _check_gradients(ref, tp, rank, p, "llama, gathered logits")
    embed = tp.model.embed_tokens
    if embed.vocab_start_index <= PAD < embed.vocab_end_index:  # the padding row's gradient stays zero
        assert not embed.weight.grad[PAD - embed.vocab_start_index].any()

    # A training loop that never gathers the logits.
    tp.zero_grad(set_to_none=True)
    tp.lm_head.gather_output = False
    logits_r = tp(input_ids=ids).logits  # [b, s, V/p]
    torch.testing.assert_close(logits_r, out_ref.logits.chunk(p, -1)[rank], **TOL)
    loss = vocab_parallel_cross_entropy(logits_r[:, :-1], ids[:, 1:], group)
    torch.testing.assert_close(loss, out_ref.loss, **TOL)
    reduced = _backward_counting_all_reduces(loss)
    assert len(reduced) == 2 * len(tp.model.layers) + 1, reduced
    _check_gradients(ref, tp, rank, p, "llama, sharded logits")


def _check_padded_and_tied(p):
    """A vocabulary p does not divide (130 over 4 ranks: 33 rows each, 2 of padding) and a tied
    embedding/head (one shard serving both) give the unsharded model's logits, loss and state."""
    ids = _randint(130, (2, 16), 31)
    ids[0, 0] = 129  # the last token, on the last rank
    for model, plan in ((_llama(vocab_size=130), PLAN), (_llama(vocab_size=130), None), (_llama(tie=True), None)):
        ref = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(model, plan=plan)
        assert isinstance(model.lm_head, oases.nn.ColumnParallelLinear), "the head is vocab-parallel by default"
        if ref.config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight, "one shard serves both ends of the tie"
        out, out_ref = (
            model(input_ids=ids % ref.config.vocab_size, labels=ids % ref.config.vocab_size),
            ref(input_ids=ids % ref.config.vocab_size, labels=ids % ref.config.vocab_size),
        )
        torch.testing.assert_close(out.logits, out_ref.logits, **TOL)
        torch.testing.assert_close(out.loss, out_ref.loss, **TOL)
        full = oases.full_state_dict(model)
        for key, value in ref.state_dict().items():
            assert torch.equal(full[key], value), key
    # training on the schedule with a padded vocabulary (130 at TP 4, 2 at TP 2 is even: 129): every gradient
    vocab = 130 if p == 4 else 129
    ref, rank = _llama(vocab_size=vocab), dist.get_rank()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model)
    ids = ids % vocab
    ref(input_ids=ids, labels=ids).loss.backward()
    loss = oases.train_step(model, ids, ids, schedule="oases")
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids).loss.detach(), **TOL)
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        rule = getattr(model.get_submodule(owner), "tp_layout", lambda: {})().get(leaf)
        want = ref.get_parameter(name).grad
        want = want if rule is None else rule.shard(want, rank, p)
        torch.testing.assert_close(param.grad, want, **TOL, msg=lambda m: f"padded vocab {name}: {m}")
    bad = ids.clone()
    bad[0, 5] = vocab  # a padding column's id: no such token
    with pytest.raises((ValueError, IndexError)):
        oases.train_step(model, ids, bad, schedule="oases")


def _check_bad_plans(p):
    """Every bad request raises the same error on every rank and leaves the model as it was."""
    tied = _llama(tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with pytest.raises(
        ValueError,
        match=r"^lm_head: its weight is tied to model.embed_tokens.weight .* Plan both "
        r"ends of the tie .* or leave the tied modules replicated",
    ):
        oases.parallelize(tied, plan={**oases.nn.DEFAULT_PLAN, "lm_head": "vocab_head"})
    with pytest.raises(ValueError, match=r"^model.embed_tokens: its weight is tied to lm_head.weight"):
        oases.parallelize(tied, plan={**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab"})
    _assert_unchanged(tied)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight, "the tie is kept"

    model = _llama()
    with pytest.raises(
        ValueError,
        match=r"plan\['lm_head'\]: 'vocab' matches lm_head, an nn.Linear; "
        r"use 'vocab_head' for it",
    ):
        oases.parallelize(model, plan={"lm_head": "vocab"})
    with pytest.raises(
        ValueError,
        match=r"plan\['embed_tokens'\]: 'vocab_head' matches model.embed_tokens, an "
        r"nn.Embedding; use 'vocab' for it",
    ):
        oases.parallelize(model, plan={"embed_tokens": "vocab_head"})
    with pytest.raises(ValueError, match=r"plan\['lm_head'\]: expected 'column', 'column:N' .* 'vocab_head'"):
        oases.parallelize(model, plan={"lm_head": "vocab-head"})
    _assert_unchanged(model)


def _check_hf(rank, world_size):
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not importable"
    ids = _randint(128, (2, 16), 30)
    ids[:, -3:] = PAD  # right padding, a label too (the model's loss does not ignore it)
    for group, p, tp_rank in _groups(rank, world_size):
        _check_llama(group, p, tp_rank, ids)
    _check_padded_and_tied(world_size)
    _check_bad_plans(world_size)
    dist.barrier()
    return True


class _Scaled(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


class _Toy(nn.Module):
    def __init__(self, V, h):
        super().__init__()
        self.wte, self.wpe, self.scaled = nn.Embedding(V, h), nn.Embedding(4, h), _Scaled(V, h)
        self.head = nn.Linear(h, V, bias=True)

    def forward(self, ids):
        return self.head(self.wte(ids) + self.wpe(torch.arange(ids.shape[-1], device=ids.device)) + self.scaled(ids))


def _check_toy(rank, p):
    """A biased head, an embedding left replicated, warnings, an nn.Embedding subclass."""
    V, h = 8 * p, 16
    torch.manual_seed(31)
    ref = _Toy(V, h).to(rank_device())
    tp = copy.deepcopy(ref)
    with pytest.warns(UserWarning) as caught:
        oases.parallelize(tp, plan={"wte": "vocab", "head": "vocab_head", "nothing": "vocab"})
    assert (
        len(caught) == 1
        and str(caught[0].message) == "oases.parallelize: Plan patterns matching no nn.Embedding: 'nothing'."
    ), str(caught[0].message)
    assert type(tp.wpe) is nn.Embedding and type(tp.scaled) is _Scaled, "embeddings stay replicated unless planned"
    ids = _randint(V, (3, 4), 32)
    ref(ids).square().sum().backward()
    y = tp(ids)
    y.square().sum().backward()
    torch.testing.assert_close(y, ref(ids), **TOL)
    _check_gradients(ref, tp, rank, p, "toy")

    model = _Toy(V, h).to(rank_device())
    with pytest.raises(ValueError, match=r"scaled \(nn.Embedding .*\): _Scaled overrides nn.Embedding.forward"):
        oases.parallelize(model, plan={"wte": "vocab", "scaled": "vocab"})
    with pytest.raises(TypeError, match="is itself an nn.Embedding"):
        oases.parallelize(nn.Embedding(V, h))
    _assert_unchanged(model)
    dist.barrier()
    return True


def test_hf_llama_vocab_parallel_matches_unsharded():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    results = run_ranks(_check_hf, 4, timeout=180)
    if isinstance(results[0], str):
        pytest.skip(results[0])
    assert results == [True] * 4


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_plan_entries_on_a_toy_model(world_size):
    assert run_ranks(_check_toy, world_size, timeout=120) == [True] * world_size
