"""oases.parallelize(model, group, tp_degrees=[...]) on Hugging Face Llama, Qwen2 and Mistral (GQA):
per-layer TP degrees give the unsharded model's loss, logits and gradients, on gloo ranks.

Each rank builds the whole model from a shared seed, keeps a copy as the reference, parallelizes
the other with a per-layer plan, runs both on the same batch -- once plain, once with a padding
mask and per-row position ids, so the batch-shaped mask and rotary tables are cut too -- and
compares every parameter's gradient with the matching slice of the reference's (slices taken
from each module's own TP size and rank: degree d layers are shards over d ranks).
"""
import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _spawn import run_ranks

import oases
from oases.nn import ColumnParallelLinear, RowParallelLinear

TOL = dict(rtol=1e-5, atol=1e-5)
LAYERS, BATCH, SEQ, VOCAB = 4, 4, 8, 128


def _model(kind="llama", seed=0):
    """A small decoder of `kind` (llama, qwen2: biased q/k/v, mistral), GQA: 2 queries per KV head."""
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[kind]
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=LAYERS,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="eager")
    torch.manual_seed(seed)
    return getattr(transformers, f"{prefix}ForCausalLM")(config)


def _inputs():
    """Two batches: plain, and padded on the right with per-row position ids (batch-shaped kwargs)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0
    mask[3, SEQ - 1:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    positions = torch.arange(SEQ).repeat(BATCH, 1) + torch.arange(BATCH)[:, None]  # a different offset per row
    return [dict(input_ids=ids, labels=ids),
            dict(input_ids=ids, labels=labels, attention_mask=mask, position_ids=positions)]


def _expected_grad(model, name, full):
    """The slice of the unsharded gradient that parameter `name` holds (its module's own TP size)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, ColumnParallelLinear):
        return torch.cat([b.chunk(owner.world_size, 0)[owner.rank] for b in full.chunk(owner.stacked, 0)])
    if isinstance(owner, RowParallelLinear) and leaf == "weight":
        return full.chunk(owner.world_size, 1)[owner.rank]
    return full  # replicated: norms, embeddings, the head, layers of degree 1


def _check_plan(kind, degrees, p):
    where = f"rank {dist.get_rank()} {kind} tp_degrees={degrees}"
    ref = _model(kind)
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match=r"left 1 nn.Linear module\(s\) unsharded .*: lm_head\."):
        assert oases.parallelize(model, tp_degrees=degrees) is model
    assert model.tp_degrees == tuple(degrees)
    for layer, d in zip(model.model.layers, degrees):  # degree d: shards over d ranks; degree 1: unsharded
        q, down = layer.self_attn.q_proj, layer.mlp.down_proj
        if d == 1:
            assert type(q) is nn.Linear and type(down) is nn.Linear
        else:
            assert isinstance(q, ColumnParallelLinear) and isinstance(down, RowParallelLinear)
            assert q.world_size == down.world_size == d and q.rank == dist.get_rank() % d
    for batch in _inputs():
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        out_ref = ref(**batch)
        out_ref.loss.backward()
        out = model(**batch)
        out.loss.backward()
        torch.testing.assert_close(out.logits, out_ref.logits, **TOL, msg=lambda m: f"{where}: logits: {m}")
        torch.testing.assert_close(out.loss, out_ref.loss, **TOL, msg=lambda m: f"{where}: loss: {m}")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            assert param.grad is not None, f"{where}: {name} got no gradient"
            want = _expected_grad(model, name, ref_params[name].grad)
            torch.testing.assert_close(param.grad, want, **TOL,
                                       msg=lambda m: f"{where} {sorted(batch)}: grad of {name}: {m}")
    return model


def _bad_inputs(rank, p, model, degrees):
    """Every rank raises the same ValueError before any communication; the model is left as it was."""
    fresh = _model()
    for bad, match in (([1] * (LAYERS - 1), "one degree per layer"), ([3] + [1] * (LAYERS - 1), "power of two"),
                       ([2 * p] * LAYERS, "power of two dividing the group size")):
        with pytest.raises(ValueError, match=match):
            oases.parallelize(fresh, tp_degrees=bad)
    with pytest.raises(ValueError, match="sequence_parallel=True: not supported with per-layer tp_degrees"):
        oases.parallelize(fresh, sequence_parallel=True, tp_degrees=[1] * LAYERS)
    with pytest.raises(ValueError, match=r"plan\['lm_head'\]: 'vocab_head' is not supported with per-layer"):
        oases.parallelize(fresh, plan={**oases.nn.DEFAULT_PLAN, "lm_head": "vocab_head"}, tp_degrees=[1] * LAYERS)
    with pytest.raises(ValueError, match=r"no decoder layers at model\.base_model\.layers"):
        oases.parallelize(nn.Sequential(nn.Linear(8, 8)), tp_degrees=[1])
    if p == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        with pytest.raises(ValueError, match="must be the whole world"):
            oases.parallelize(fresh, pairs[rank // 2], tp_degrees=[1, 2, 2, 1])
    assert not any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in fresh.modules())
    assert not hasattr(fresh, "tp_degrees")

    most = p // min(degrees)  # the batch must split into the most replicas of any layer
    ids = torch.zeros(most + 1, SEQ, dtype=torch.long)
    with pytest.raises(ValueError, match=f"got batch size {most + 1} \\(use a multiple of {most}\\)"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="tp_degrees: oases.train_step runs every layer on one TP group"):
        oases.train_step(model, ids[:most], ids[:most])


def _ranks_main(rank, p, plans):
    for kind, degrees in plans:
        model = _check_plan(kind, degrees, p)
    _bad_inputs(rank, p, model, degrees)
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size, plans", [
    (2, [("qwen2", [2, 1, 1, 2]), ("mistral", [1, 1, 2, 2]), ("llama", [1, 2, 2, 1])]),
    (4, [("llama", [2, 4, 1, 2]), ("llama", [2, 2, 2, 2])]),
])
def test_hf_per_layer_degrees_match_unsharded(world_size, plans):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    assert run_ranks(_ranks_main, world_size, plans, timeout=90) == [True] * world_size
