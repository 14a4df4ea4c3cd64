"""oases.storage's checkpoints on gloo ranks: full state dicts and on-disk checkpoints across TP degrees.

Models: Hugging Face Llama (GQA and MHA) under the default plan, and a toy MLP with a fused
[gate | up] projection ("column:2"), a replicated head and a buffer under an explicit plan. Each
TP model is trained one step first, so that what a checkpoint carries differs from the seed's
initialisation; a model loaded from it (another seed, another TP degree) must give its outputs.
"""

import copy
import importlib.util
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oases
from oases._sharding import ShardRule
from oases.comm.topology import ring_of

from _spawn import rank_device, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)  # TP sums in another order than the plain model's
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _llama(kv_heads, seed):
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
    return LlamaForCausalLM(config)


class Toy(nn.Module):
    """A SwiGLU MLP with a fused [gate | up] projection, an unsharded head and a buffer."""

    def __init__(self, h=16, ffn=32):
        super().__init__()
        self.ffn = nn.ModuleDict(dict(w1=nn.Linear(h, 2 * ffn), w2=nn.Linear(ffn, h)))  # w1: [gate | up]
        self.head = nn.Linear(h, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, h))

    def forward(self, x):
        gate, up = self.ffn["w1"](x).chunk(2, dim=-1)  # [..., ffn] each (ffn/p on a TP rank)
        return self.head(self.scale * (x + self.ffn["w2"](F.silu(gate) * up)))


TOY_PLAN = {"ffn.w1": "column:2", "ffn.w2": "row"}


def _toy(seed, **kw):
    torch.manual_seed(seed)
    return Toy(**kw)


class Case:
    """A model family: build(seed), its plan, its output and loss on a fixed batch."""

    def __init__(self, name, build, plan, max_tp):
        self.name, self.plan, self.max_tp = name, plan, max_tp
        self.build = lambda seed: build(seed).to(rank_device())  # a case is made inside a rank
        self.ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())
        self.x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(2)).to(rank_device())
        self.hf = name.startswith("llama")

    def output(self, model):
        return model(input_ids=self.ids).logits if self.hf else model(self.x)

    def loss(self, model):
        return model(input_ids=self.ids, labels=self.ids).loss if self.hf else model(self.x).square().mean()


def _cases():
    toy = Case("toy", _toy, TOY_PLAN, max_tp=4)
    if not HAVE_TRANSFORMERS:
        return [toy]
    return [
        Case("llama-gqa", lambda seed: _llama(2, seed), None, max_tp=2),  # 2 KV heads: TP <= 2
        Case("llama-mha", lambda seed: _llama(4, seed), None, max_tp=4),
        toy,
    ]


def _parallelize(model, group, plan):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"oases.parallelize: left \d+ nn.Linear", UserWarning)
        return oases.parallelize(model, group, plan)


def _train_step(case, model):
    case.loss(model).backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.1 * param.grad
            param.grad = None


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_state(model, snapshot):
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for key, value in state.items():
        assert torch.equal(value, snapshot[key]), f"{key} changed"


def _assert_equal_dicts(got, want):
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


class Table(nn.Module):
    """No Oases layer: rows of a table sharded over `group`, known only through tp_layout()."""

    def __init__(self, rows, cols, group=None, seed=0):
        super().__init__()
        ring = ring_of(group)
        self.group = group
        full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        self.weight = nn.Parameter(ShardRule(0).shard(full, ring.rank, ring.size).clone())
        self.bias = nn.Parameter(torch.zeros(cols))  # not listed: replicated

    def tp_layout(self):
        return {"weight": ShardRule(0)}


# --- full_state_dict at TP = world size ------------------------------------------------------------


def _check_full_state_dict(rank, p):
    for case in _cases():
        if p > case.max_tp:
            continue
        ref = case.build(0)
        tp = _parallelize(copy.deepcopy(ref), None, case.plan)
        _assert_equal_dicts(oases.full_state_dict(tp), ref.state_dict())  # gathers are exact

        _train_step(case, tp)
        full = oases.full_state_dict(tp)
        plain = case.build(1)
        plain.load_state_dict(full)
        torch.testing.assert_close(case.output(plain), case.output(tp), **TOL)
        kept = {k: v.clone() for k, v in full.items()}
        _train_step(case, tp)
        _assert_equal_dicts(full, kept)  # a snapshot: training on does not change it

    ref = _toy(0).to(rank_device(), torch.bfloat16)
    tp = _parallelize(copy.deepcopy(ref), None, TOY_PLAN)
    _assert_equal_dicts(oases.full_state_dict(tp), ref.state_dict())

    # The contract, not the types: any module with tp_layout() and group, under any name, tied too.
    table = Table(4 * p, 3, seed=5).to(rank_device())
    model = nn.ModuleDict(dict(a=table, b=nn.Sequential(table)))
    full = oases.full_state_dict(model)
    want = torch.randn(4 * p, 3, generator=torch.Generator().manual_seed(5)).to(rank_device())
    assert list(full) == ["a.weight", "a.bias", "b.0.weight", "b.0.bias"]
    assert torch.equal(full["a.weight"], want) and torch.equal(full["b.0.weight"], want)
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_full_state_dict_is_the_unsharded_models(world_size):
    assert run_ranks(_check_full_state_dict, world_size, timeout=180) == [True] * world_size


# --- save at TP 2, load at TP 4, 2 and 1 -----------------------------------------------------------


def _check_reshard(rank, world_size, path):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    for case in _cases():
        tp2 = _parallelize(case.build(0), pair, case.plan)  # ranks {0, 1} and {2, 3}: two replicas
        _train_step(case, tp2)
        want = case.output(tp2)
        full = oases.full_state_dict(tp2)
        where = os.path.join(path, case.name)
        oases.save_checkpoint(tp2, where)  # the world: each entry written once
        for degree in (4, 1):
            if degree > case.max_tp:
                continue
            for load in ("full", "disk"):
                model = case.build(10 + degree)
                if degree > 1:
                    _parallelize(model, None, case.plan)
                if load == "full":
                    result = oases.load_full_state_dict(model, full)
                else:
                    result = oases.load_checkpoint(model, where)
                assert (result.missing_keys, result.unexpected_keys) == ([], [])
                torch.testing.assert_close(
                    case.output(model), want, **TOL, msg=lambda m: f"{case.name} TP 2 -> {degree} ({load}): {m}"
                )
                _assert_equal_dicts(oases.full_state_dict(model), full)

    # A checkpoint written and read by one TP group alone, the other pair doing nothing meanwhile.
    case = _cases()[-1]
    where = os.path.join(path, "pair")
    if rank < 2:
        tp2 = _parallelize(case.build(0), pair, case.plan)
        _train_step(case, tp2)
        torch.save(case.output(tp2), os.path.join(path, f"want{rank}.pt"))
        oases.save_checkpoint(tp2, where, group=pair)
    dist.barrier()
    if rank >= 2:
        model = _parallelize(case.build(3), pair, case.plan)
        oases.load_checkpoint(model, where, group=pair)
        want = torch.load(os.path.join(path, f"want{rank - 2}.pt"), map_location=rank_device())
        torch.testing.assert_close(case.output(model), want, **TOL)
    dist.barrier()
    return True


def test_save_at_tp2_load_at_tp4_and_tp1(tmp_path):
    assert run_ranks(_check_reshard, 4, str(tmp_path), timeout=240) == [True] * 4


# --- bad input: a ValueError on every rank, the model untouched ------------------------------------


def _check_bad_input(rank, p, path):
    tp = _parallelize(_toy(0).to(rank_device()), None, TOY_PLAN)
    before = _snapshot(tp)
    full = oases.full_state_dict(tp)
    changed = {k: v + 1 for k, v in full.items()}  # would show any partial load

    bad = dict(changed, **{"ffn.w1.weight": torch.zeros(64, 17)})
    with pytest.raises(
        ValueError,
        match=rf"ffn\.w1\.weight: state_dict has shape \(64, 17\), the model expects "
        rf"\(64, 16\) \(unsharded; this rank holds \({64 // p}, 16\) "
        rf"of it at TP={p}\)",
    ):
        oases.load_full_state_dict(tp, bad)
    bad = dict(changed, scale=torch.zeros(15))  # a replicated buffer, last in the state dict
    with pytest.raises(ValueError, match=r"scale: state_dict has shape \(15,\), the model expects \(16,\)$"):
        oases.load_full_state_dict(tp, bad, strict=False)
    bad = {k: v for k, v in changed.items() if k != "ffn.w2.bias"}
    with pytest.raises(ValueError, match=r"nothing was loaded:\n  missing keys: ffn\.w2\.bias$"):
        oases.load_full_state_dict(tp, bad)
    with pytest.raises(ValueError, match=r"unexpected keys: extra$"):
        oases.load_full_state_dict(tp, dict(changed, extra=torch.zeros(1)))
    with pytest.raises(TypeError, match=r"values must be tensors; not so for head\.bias"):
        oases.load_full_state_dict(tp, dict(changed, **{"head.bias": [0.0] * 8}))
    _assert_state(tp, before)

    other = _parallelize(_toy(0, ffn=48).to(rank_device()), None, TOY_PLAN)  # ffn 48 instead of 32
    where = os.path.join(path, "ffn48")
    oases.save_checkpoint(other, where)
    with pytest.raises(
        ValueError,
        match=rf"checkpoint '.*ffn48' does not fit the model; nothing was loaded:\n"
        rf"  ffn\.w1\.weight: checkpoint has shape \(96, 16\), the model expects "
        rf"\(64, 16\) \(unsharded; this rank holds \({64 // p}, 16\) "
        rf"of it at TP={p}\)\n"
        rf"  ffn\.w1\.bias: .*\n  ffn\.w2\.weight: checkpoint has shape \(16, 48\)",
    ):
        oases.load_checkpoint(tp, where)  # raised before any collective: nobody waits
    _assert_state(tp, before)

    # strict=False: missing keys stay, unexpected ones are reported, the rest loads.
    partial = {k: v for k, v in changed.items() if k != "head.bias"}
    result = oases.load_full_state_dict(tp, dict(partial, extra=torch.zeros(1)), strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["head.bias"], ["extra"])
    assert torch.equal(tp.head.bias, before["head.bias"])
    _assert_equal_dicts({k: v for k, v in oases.full_state_dict(tp).items() if k != "head.bias"}, partial)

    # On disk in fp32, read back into a bf16 model: cast on copy, as load_state_dict does.
    where = os.path.join(path, "fp32")
    oases.save_checkpoint(tp, where)
    half = _parallelize(_toy(4).to(rank_device()), None, TOY_PLAN).to(torch.bfloat16)
    oases.load_checkpoint(half, where)
    _assert_equal_dicts(oases.full_state_dict(half), {k: v.bfloat16() for k, v in oases.full_state_dict(tp).items()})

    class NoGroup(nn.Module):
        def tp_layout(self):
            return {}

    with pytest.raises(TypeError, match=r"n: NoGroup has tp_layout\(\) but no `group` attribute"):
        oases.full_state_dict(nn.ModuleDict(dict(n=NoGroup())))
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size", [2])
def test_bad_input_raises_on_every_rank_and_changes_nothing(world_size, tmp_path):
    assert run_ranks(_check_bad_input, world_size, str(tmp_path), timeout=120) == [True] * world_size
