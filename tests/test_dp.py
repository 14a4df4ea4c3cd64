"""Data parallelism in the user's own loop (oases.dp) against one process training on the whole batch.

DP 2 with a plain loss.backward() and GradientSync; DP 2 x TP 2 on oases.train_step's schedule with
ZeroOptimizer (ZeRO-1): after three AdamW steps every parameter equals the single-process run's
(fp32 tolerance: the dp mean sums in another order), buckets start during the backward from the
second step on (the overlap), and each rank holds half of AdamW's state. ZeroOptimizer.clip_grad_norm_
at DP 2 x TP 2 returns and applies torch.nn.utils.clip_grad_norm_'s norm of the single-process model.
Checkpoints: fp32 ZeRO resumes bit-exactly and loads at DP 4 and into a plain AdamW; bf16 ZeRO keeps
its fp32 masters (bit-exact resume at DP 2, the masters restored at DP 1). ZeroOptimizer is a
torch.optim.Optimizer: torch's LambdaLR and a step hook drive it as the single process's AdamW, and
its own state_dict resumes a bf16 run bit-exactly on the same rank.
"""

import copy
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import oases

from _spawn import harness_device, rank_device, run_ranks

pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)
STEPS = 3


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    ).to(rank_device())


def _batch(step):
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step)).to(rank_device())


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-3)),  # scale-invariant: a missing 1/dp would pass it
    "sgd": (torch.optim.SGD, dict(lr=0.5, momentum=0.9)),
}  # not scale-invariant: the mean is checked


def _reference(kind, clip=None):
    """The single-process model's state after STEPS steps; with clip, also torch's clip_grad_norm_
    norms (2-norm, clipping at `clip`, every step; then the inf-norm of one more step's gradient)."""
    model = _llama()
    cls, kw = OPTIMIZERS[kind]
    opt = cls(model.parameters(), **kw)
    norms = []
    for step in range(STEPS):
        ids = _batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    if clip is None:
        return model.state_dict()
    ids = _batch(STEPS)
    model(input_ids=ids, labels=ids).loss.backward()
    norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, norm_type=float("inf")))
    return model.state_dict(), norms


class _CountingReducer(oases.dp.AllReduceMean):
    """AllReduceMean that records the most buckets in flight at once."""

    def __init__(self, group):
        super().__init__(group)
        self.now = self.most = 0

    def start(self, params, grads):
        self.now += 1
        self.most = max(self.most, self.now)
        return super().start(params, grads)

    def complete(self, params, pending):
        super().complete(params, pending)
        self.now -= 1


def _dp_plain_backward(rank, world_size):
    model = _llama()
    reducer = _CountingReducer(None)
    sync = oases.dp.GradientSync(model, bucket_bytes=64 * 1024, reducer=reducer, max_in_flight=2)
    opt = torch.optim.SGD(model.parameters(), **OPTIMIZERS["sgd"][1])
    for step in range(STEPS):
        ids = _batch(step).chunk(world_size)[rank]  # this replica's rows
        model(input_ids=ids, labels=ids).loss.backward()  # the sync finishes at the backward's end
        opt.step()
        opt.zero_grad()
    assert sync.started_in_backward > 2  # more buckets started in the backward than may fly at once
    assert reducer.most == 2, reducer.most  # the oldest completed before a third started
    expected = _reference("sgd")
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[key], **TOL, msg=lambda m: f"{key}: {m}")


def test_gradient_sync_dp2_plain_backward():
    run_ranks(_dp_plain_backward, 2, timeout=120)


def _zero_dp2_tp2(rank, world_size, schedule, kind, clip=None, sequence_parallel=False):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(harness_device(), (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group, tp_group = mesh["dp"].get_group(), mesh["tp"].get_group()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = oases.parallelize(_llama(), tp_group)
    cls, kw = OPTIMIZERS[kind]
    opt = oases.dp.ZeroOptimizer(model, dp_group, cls, bucket_bytes=64 * 1024, **kw)
    dp_rank = dist.get_rank(dp_group)
    norms = []
    for step in range(STEPS):
        ids = _batch(step).chunk(2)[dp_rank]
        # sequence parallel: the norms' gradients are summed over TP after the backwards, so their
        # buckets wait for finish (from the second step on they would start with partial sums)
        oases.train_step(model, ids, ids, schedule=schedule, grad_sync=opt.sync, sequence_parallel=sequence_parallel)
        if clip is not None:
            norms.append(opt.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
    assert opt.sync.started_in_backward > 0, "no bucket started during a backward"
    moments = 2 if kind == "adamw" else 1  # exp_avg + exp_avg_sq, or the momentum buffer
    full_state = sum(moments * p.numel() * 4 for p in model.parameters())  # plain optimizer on the TP shards
    assert full_state / 2 <= opt.state_bytes() <= full_state / 2 + 8 * 64, (opt.state_bytes(), full_state)
    expected = _reference(kind, clip)
    if clip is not None:
        expected, want_norms = expected
        ids = _batch(STEPS).chunk(2)[dp_rank]
        oases.train_step(model, ids, ids, schedule=schedule, grad_sync=opt.sync)
        norms.append(opt.clip_grad_norm_(1e9, norm_type=float("inf")))
        assert min(want_norms[:STEPS]) > clip, want_norms  # every step is clipped
        for got, want in zip(norms, want_norms):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    state = oases.full_state_dict(model)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, **TOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize(
    "schedule,kind,clip,sp",
    [
        ("megatron", "sgd", None, False),
        ("oases", "adamw", None, False),
        ("oases", "sgd", 0.5, False),
        ("oases", "sgd", None, True),
    ],
)
def test_zero1_dp2_tp2_train_step(schedule, kind, clip, sp):
    run_ranks(_zero_dp2_tp2, 4, schedule, kind, clip, sp, timeout=180)


def _bad_grad_sync(rank, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = oases.parallelize(_llama())
    with pytest.raises(TypeError, match="grad_sync"):
        oases.train_step(model, _batch(0), _batch(0), grad_sync=object())
    with pytest.raises(TypeError, match="optimizer_class"):
        oases.dp.ZeroOptimizer(model, None, dict)
    opt = oases.dp.ZeroOptimizer(model, None, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(0.0)
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


def _zero_bf16_checkpoint(rank, world_size, root):
    """bf16 parameters: the fp32 masters are in the checkpoint, as each dp rank's rows. Resumed at
    DP 2 the run is bit-identical to the uninterrupted one (parameters and masters); at DP 1 the
    masters come back exactly, and training goes on within what bf16 gradients of other row
    blocks can change (a step's size where a gradient is near zero)."""
    cls, kw = OPTIMIZERS["adamw"]
    alone, _ = dist.new_subgroups(group_size=1)

    def build(group):
        model = _llama(seed=5).to(torch.bfloat16)  # another seed: everything is loaded
        return model, oases.dp.ZeroOptimizer(model, group, cls, bucket_bytes=64 * 1024, **kw)

    def train(model, opt, group, steps):
        for step in steps:
            ids = _batch(step).chunk(dist.get_world_size(group))[dist.get_rank(group)]
            model(input_ids=ids, labels=ids).loss.backward()  # the reduce-scatter finishes at its end
            opt.step()
            opt.zero_grad()

    def masters(model, opt, group):
        """{name: the whole parameter's fp32 master} (every dp rank's rows, in rank order)."""
        mine = {name: opt.master_of(p)[0].detach().clone() for name, p in model.named_parameters()}
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        return {name: torch.cat([part[name].to(rank_device()) for part in parts]) for name in mine}

    world = dist.group.WORLD
    model, opt = build(world)
    train(model, opt, world, range(2))
    oases.save_checkpoint(model, root, optimizer=opt, step=2)
    saved = masters(model, opt, world)
    assert any(not torch.equal(m, p.float()) for m, p in zip(saved.values(), model.parameters()))  # finer than bf16
    train(model, opt, world, range(2, STEPS + 1))
    want, want_masters = {k: v.clone() for k, v in model.state_dict().items()}, masters(model, opt, world)

    model, opt = build(world)
    oases.load_checkpoint(model, root, optimizer=opt)
    train(model, opt, world, range(2, STEPS + 1))
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    for key, value in masters(model, opt, world).items():
        assert torch.equal(value, want_masters[key]), key

    model, opt = build(alone)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saved by 2 ranks: RNG states not restored
        oases.load_checkpoint(model, root, optimizer=opt, group=alone)
    for key, value in masters(model, opt, alone).items():
        assert torch.equal(value, saved[key]), key
    train(model, opt, alone, range(2, STEPS + 1))
    # bf16 gradients of 4 rows differ from the mean of two of 2 rows: an AdamW step (at most about lr
    # per element) may go another way where a gradient is near zero; nothing else may differ.
    step_bound = 2 * (STEPS + 1 - 2) * kw["lr"]
    for key, value in masters(model, opt, alone).items():
        torch.testing.assert_close(
            value, want_masters[key], rtol=0, atol=step_bound, msg=lambda m: f"{key} at dp1: {m}"
        )


def test_zero1_bf16_checkpoint_keeps_fp32_masters(tmp_path):
    run_ranks(_zero_bf16_checkpoint, 2, str(tmp_path), timeout=180)


# --- steps whose gradients differ across ranks; parameters unused everywhere; strided parameters ---


class _Two(nn.Module):
    """a then b (b: an expert that gets tokens on some ranks only), and c that no rank uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (nn.Linear(4, 4, bias=False) for _ in range(3))

    def forward(self, x, use_b):
        h = self.a(x)
        return self.b(h) if use_b else h


def _mean_grads(model, xs, uses):
    """The dp mean of every rank's gradient (zeros where a rank had none; None where none had one)."""
    local = []
    for x, use in zip(xs, uses):
        ref = _Two().to(rank_device())
        ref.load_state_dict(model.state_dict())
        ref(x, use).square().sum().backward()
        local.append({n: p.grad for n, p in ref.named_parameters()})
    return {
        n: None
        if all(g[n] is None for g in local)
        else sum(g[n] if g[n] is not None else torch.zeros(4, 4, device=rank_device()) for g in local) / len(local)
        for n in local[0]
    }


def _uneven_steps(rank, world_size):
    model = _Two().to(rank_device())
    sync = oases.dp.GradientSync(model, bucket_bytes=64)  # one parameter per bucket: [c, b, a]
    for step, uses in enumerate([(True, False), (True, True), (True, False), (False, True)]):  # b per rank
        xs = torch.randn(world_size, 3, 4, generator=torch.Generator().manual_seed(step)).to(rank_device())
        want = _mean_grads(model, xs, uses)
        model.zero_grad(set_to_none=True)
        model(xs[rank], uses[rank]).square().sum().backward()  # buckets started in order on both ranks
        for name, p in model.named_parameters():
            if want[name] is None:
                assert p.grad is None, name  # no rank had one: None, as in one process
            else:
                torch.testing.assert_close(p.grad, want[name], msg=lambda m: f"step {step} {name}: {m}")
    # c (registered last: the first bucket) had no gradient anywhere: it moved to the end, so the
    # used buckets still start during the backward (in step 1, where both ranks use b: both buckets)
    assert sync.started_in_backward >= 2, sync.started_in_backward
    sync.close()

    # ZeroOptimizer: c has no gradient anywhere, so AdamW's weight decay leaves it as it is (as torch's)
    model, ref = _Two().to(rank_device()), _Two().to(rank_device())
    zero = oases.dp.ZeroOptimizer(model, optimizer_class=torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    plain = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for step in range(2):
        xs = torch.randn(world_size, 3, 4, generator=torch.Generator().manual_seed(10 + step)).to(rank_device())
        sum(ref(x, True).square().sum() for x in xs).div(world_size).backward()
        plain.step()
        plain.zero_grad()
        model(xs[rank], True).square().sum().backward()
        zero.step()
        zero.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    return True


def test_buckets_pair_up_when_steps_differ_across_ranks_and_unused_stay_none_dp2():
    assert run_ranks(_uneven_steps, 2, timeout=60) == [True, True]


class _Strided(nn.Module):
    """A channels_last conv weight and a parameter stored transposed: neither is contiguous."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3).to(dtype=dtype, memory_format=torch.channels_last)
        self.t = nn.Parameter(torch.randn(5, 4, dtype=dtype).t())  # [4, 5], strides (1, 4)

    def forward(self, x):
        return (self.conv(x).mean((2, 3)) @ self.t).float()


def _zero_strided(rank, world_size):
    for dtype in (torch.float32, torch.bfloat16):
        xs = torch.randn(world_size, 2, 3, 6, 6, generator=torch.Generator().manual_seed(1)).to(rank_device(), dtype)
        ref, model = _Strided(dtype).to(rank_device()), _Strided(dtype).to(rank_device())
        assert not model.conv.weight.is_contiguous() and not model.t.is_contiguous()
        plain = torch.optim.SGD(ref.parameters(), lr=0.1)
        zero = oases.dp.ZeroOptimizer(model, optimizer_class=torch.optim.SGD, lr=0.1)
        sum(ref(x).square().sum() for x in xs).div(world_size).backward()
        plain.step()
        model(xs[rank]).square().sum().backward()
        zero.step()
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert not torch.equal(p, _Strided(dtype).to(rank_device()).get_parameter(name)), name  # it moved
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{dtype} {name}: {m}")
    return True


def test_zero1_updates_strided_parameters_dp2():
    assert run_ranks(_zero_strided, 2, timeout=60) == [True, True]


def _dropped(rank, world_size):
    model = nn.Linear(4, 4).to(rank_device())
    oases.dp.GradientSync(model)  # DDP-style, not kept: nothing would average the gradients
    with pytest.raises(RuntimeError, match=r"garbage-collected while its hooks were registered.* keep a reference"):
        model(torch.randn(3, 4).to(rank_device())).sum().backward()
    sync = oases.dp.GradientSync(nn.Linear(4, 4).to(rank_device()))
    sync.close()
    del sync  # closed first: its hooks are gone, nothing raises
    model = nn.Linear(4, 4).to(rank_device())
    kept = oases.dp.GradientSync(model)
    model(torch.randn(3, 4).to(rank_device())).sum().backward()
    kept.close()
    return True


def test_a_dropped_sync_raises_instead_of_training_unaveraged_dp2():
    assert run_ranks(_dropped, 2, timeout=60) == [True, True]


# --- ZeroOptimizer as a torch.optim.Optimizer: LR schedulers, step hooks, its own state_dict ---


def _zero_as_torch_optimizer(rank, world_size):
    factor = [1.0, 0.5, 0.1]  # the lr changes every step
    ref = _llama()
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    plain_schedule = torch.optim.lr_scheduler.LambdaLR(plain, lambda n: factor[min(n, 2)])
    model = _llama()
    opt = oases.dp.ZeroOptimizer(model, None, torch.optim.AdamW, bucket_bytes=64 * 1024, lr=1e-3)
    assert isinstance(opt, torch.optim.Optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: factor[min(n, 2)])
    stepped, seen = [], []
    opt.register_step_post_hook(lambda o, args, kwargs: stepped.append(o.param_groups[0]["lr"]))
    hooks = [register_optimizer_step_pre_hook(lambda o, a, k: None if o is plain else seen.append(type(o).__name__))]
    for name in ("state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post"):
        hooks.append(getattr(opt, f"register_{name}_hook")(lambda *a, name=name: seen.append(name)))
    for step in range(STEPS):
        ids = _batch(step)
        ref(input_ids=ids, labels=ids).loss.backward()
        plain.step()
        plain.zero_grad()
        plain_schedule.step()
        mine = ids.chunk(world_size)[rank]

        def closure():
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            return loss

        if step < STEPS - 1:
            closure()
            opt.step()
        else:  # torch's closure form: step(closure) runs it (with gradients) and returns its value
            assert torch.is_tensor(opt.step(closure))
        opt.zero_grad()
        schedule.step()
    assert stepped == pytest.approx([1e-3 * f for f in factor]), stepped  # the inner stepped with each lr
    assert seen == ["ZeroOptimizer"] * STEPS, seen  # a global hook: once per step (not again for the inner)
    opt.load_state_dict(opt.state_dict())
    assert seen[STEPS:] == ["state_dict_pre", "state_dict_post", "load_state_dict_pre", "load_state_dict_post"], seen
    for hook in hooks:
        hook.remove()
    copied = copy.deepcopy(opt)  # a working optimizer, as before it was a torch Optimizer
    assert copied.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and copied.state_bytes() == opt.state_bytes()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(plain.param_groups[0]["lr"])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")
    with pytest.raises(TypeError, match="add_param_group: its parameters are fixed"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    return True


def test_zero1_is_a_torch_optimizer_lr_schedulers_and_step_hooks_dp2():
    assert run_ranks(_zero_as_torch_optimizer, 2, timeout=120) == [True, True]


def _zero_state_dict(rank, world_size):
    """bf16 parameters: state_dict() after 2 steps, loaded into a fresh optimizer over the same
    parameters, gives the uninterrupted third step bit for bit (state and fp32 masters); another
    rank's or a plain optimizer's state_dict is refused."""

    def build():
        model = _llama(seed=5).to(torch.bfloat16)
        return model, oases.dp.ZeroOptimizer(model, None, torch.optim.AdamW, bucket_bytes=64 * 1024, lr=1e-3)

    def train(model, opt, steps):
        for step in steps:
            ids = _batch(step).chunk(world_size)[rank]
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(2))
    params = {k: v.clone() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # as a user saves it (state_dict holds references, as torch's)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    assert saved["oases_masters"] and saved["state"], "no fp32 masters or AdamW state saved"
    train(model, opt, [2])
    want = model.state_dict()

    model, fresh = build()
    model.load_state_dict(params)
    fresh.sync_masters()  # rounded to bf16: the saved masters must replace them
    fresh.load_state_dict(saved)
    train(model, fresh, [2])
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key
    others = [None] * world_size
    dist.all_gather_object(others, saved)
    with pytest.raises(ValueError, match="one dp rank's rows"):
        fresh.load_state_dict(others[1 - rank])
    with pytest.raises(ValueError, match="not a ZeroOptimizer.state_dict"):
        fresh.load_state_dict(fresh.inner.state_dict())
    return True


def test_zero1_state_dict_resumes_bit_exactly_on_its_own_rank_dp2():
    assert run_ranks(_zero_state_dict, 2, timeout=120) == [True, True]
