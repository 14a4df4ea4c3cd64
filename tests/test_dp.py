"""Data parallelism in the user's own loop (oases.dp) against one process training on the whole batch.

DP 2 with a plain loss.backward() and GradientSync; DP 2 x TP 2 on oases.train_step's schedule with
ZeroOptimizer (ZeRO-1): after three AdamW steps every parameter equals the single-process run's
(fp32 tolerance: the dp mean sums in another order), buckets start during the backward from the
second step on (the overlap), and each rank holds half of AdamW's state.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

from _spawn import run_ranks

import oases

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 3


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))


def _batch(step):
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))


OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-3)),  # scale-invariant: a missing 1/dp would pass it
              "sgd": (torch.optim.SGD, dict(lr=0.5, momentum=0.9))}  # not scale-invariant: the mean is checked


def _reference(kind):
    model = _llama()
    cls, kw = OPTIMIZERS[kind]
    opt = cls(model.parameters(), **kw)
    for step in range(STEPS):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _dp_plain_backward(rank, world_size):
    model = _llama()
    sync = oases.dp.GradientSync(model, bucket_bytes=64 * 1024)
    opt = torch.optim.SGD(model.parameters(), **OPTIMIZERS["sgd"][1])
    for step in range(STEPS):
        ids = _batch(step).chunk(world_size)[rank]  # this replica's rows
        model(input_ids=ids, labels=ids).loss.backward()  # the sync finishes at the backward's end
        opt.step()
        opt.zero_grad()
    assert sync.started_in_backward > 0
    expected = _reference("sgd")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], **TOL, msg=lambda m: f"{key}: {m}")


def test_gradient_sync_dp2_plain_backward():
    run_ranks(_dp_plain_backward, 2, timeout=120)


def _zero_dp2_tp2(rank, world_size, schedule, kind):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh["dp"].get_group(), mesh["tp"].get_group()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = oases.parallelize(_llama(), tp_group)
    cls, kw = OPTIMIZERS[kind]
    opt = oases.dp.ZeroOptimizer(model, dp_group, cls, bucket_bytes=64 * 1024, **kw)
    dp_rank = dist.get_rank(dp_group)
    for step in range(STEPS):
        ids = _batch(step).chunk(2)[dp_rank]
        oases.train_step(model, ids, ids, schedule=schedule, grad_sync=opt.sync)
        opt.step()
        opt.zero_grad()
    assert opt.sync.started_in_backward > 0, "no bucket started during a backward"
    moments = 2 if kind == "adamw" else 1  # exp_avg + exp_avg_sq, or the momentum buffer
    full_state = sum(moments * p.numel() * 4 for p in model.parameters())  # plain optimizer on the TP shards
    assert full_state / 2 <= opt.state_bytes() <= full_state / 2 + 8 * 64, (opt.state_bytes(), full_state)
    expected = _reference(kind)
    state = oases.full_state_dict(model)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, **TOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("schedule,kind", [("megatron", "sgd"), ("oases", "adamw")])
def test_zero1_dp2_tp2_train_step(schedule, kind):
    run_ranks(_zero_dp2_tp2, 4, schedule, kind, timeout=180)


def _bad_grad_sync(rank, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = oases.parallelize(_llama())
    with pytest.raises(TypeError, match="grad_sync"):
        oases.train_step(model, _batch(0), _batch(0), grad_sync=object())
    with pytest.raises(TypeError, match="optimizer_class"):
        oases.dp.ZeroOptimizer(model, None, dict)
    dist.barrier()


def test_bad_input():
    run_ranks(_bad_grad_sync, 2, timeout=60)


def _zero_checkpoint(rank, world_size, root):
    """ZeRO-1 checkpoints: bit-exact resume at DP2 x TP2, and loadable at DP4 x TP1 (ZeRO) and into a
    plain AdamW at DP2 x TP2 (the states are stored as boxes of the full parameters, whatever the layout)."""
    cls, kw = OPTIMIZERS["adamw"]

    def build(dp, tp, zero):  # rank = i_dp * tp + i_tp (new_group on every rank: a mesh drops size-1 dims)
        tp_group = dp_group = None
        for i in range(dp):
            group = dist.new_group(list(range(i * tp, (i + 1) * tp)))
            tp_group = group if rank // tp == i else tp_group
        for j in range(tp):
            group = dist.new_group(list(range(j, dp * tp, tp)))
            dp_group = group if rank % tp == j else dp_group
        model = _llama(seed=5)  # another seed: everything is loaded
        if tp > 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                oases.parallelize(model, tp_group)
        if zero:
            opt = oases.dp.ZeroOptimizer(model, dp_group, cls, bucket_bytes=64 * 1024, **kw)
            return model, opt, dp_group, opt.sync
        return model, cls(model.parameters(), **kw), dp_group, oases.dp.GradientSync(model, dp_group)

    def train(model, opt, dp_group, sync, steps):
        dp_rank, dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        for step in steps:
            ids = _batch(step).chunk(dp)[dp_rank]
            oases.train_step(model, ids, ids, schedule="oases" if ids.shape[0] > 1 else "megatron", grad_sync=sync)
            opt.step()
            opt.zero_grad()

    model, opt, dp_group, sync = build(2, 2, True)
    train(model, opt, dp_group, sync, range(2))
    oases.save_checkpoint(model, root, optimizer=opt, step=2)
    train(model, opt, dp_group, sync, range(2, STEPS + 1))
    expected = oases.full_state_dict(model)
    for dp, tp, zero in ((2, 2, True), (4, 1, True), (2, 2, False)):
        model, opt, dp_group, sync = build(dp, tp, zero)
        assert oases.load_checkpoint(model, root, optimizer=opt).step == 2
        train(model, opt, dp_group, sync, range(2, STEPS + 1))
        state = oases.full_state_dict(model)
        for key, value in expected.items():
            if (dp, tp, zero) == (2, 2, True):
                assert torch.equal(state[key], value), key
            else:
                torch.testing.assert_close(state[key], value, **TOL, msg=lambda m: f"{key} at dp{dp} tp{tp}: {m}")


def test_zero1_checkpoint_resumes_exactly_and_loads_at_another_dp(tmp_path):
    run_ranks(_zero_checkpoint, 4, str(tmp_path), timeout=240)
