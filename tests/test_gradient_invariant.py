"""Issue 36, items 1 and 2: no silently wrong gradient.

The invariant (oases.check_gradients, run by oases.train_step on a model's first step): a parameter
whole on every rank of the TP group ends the backward with the same gradient on every rank; each
injected cause is caught on every rank, naming the parameter, and nothing is raised for a correct
model (the HF matrix calls it after every check: tests/test_models_matrix.py).

The rule (oases.nn._region_parameters): parameters inside a dense region (an MLP between its column
and row layers) are placed by where their gradient comes from: a learned activation's scalars
(Apertus' xIELU) summed over the group, per-feature parameters sharded with the features, the
a norm over the inner features refused by name. Each then trains exactly: logits,
loss and every gradient of model(...) and of oases.train_step on every schedule equal the
unsharded model's, and checkpoints hold the unsharded tensors.
"""

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn

import oases
from oases.schedule import SCHEDULES

from _shards import check_grads
from _spawn import rank_device, run_ranks
from test_models_matrix import SMALL

TOL = dict(rtol=1e-4, atol=1e-5)


def _quiet_parallelize(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return oases.parallelize(model, **kwargs)


def _ids():
    return torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(1)).to(rank_device())


def _apertus():
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tiny config's rope note; xIELU's missing CUDA kernel
        config = tf.ApertusConfig(**SMALL)
        return tf.ApertusForCausalLM(config).to(rank_device())


class _GatedSiLU(nn.Module):
    """An activation with a learned per-feature gate [I] and a learned scalar temperature."""

    def __init__(self, inner):
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, inner))
        self.temperature = nn.Parameter(torch.tensor([1.3]))

    def forward(self, x):
        return nn.functional.silu(x * self.temperature) * self.gate


class _InputScale(nn.Module):
    """A learned per-channel scale of the MLP's input (hidden width): whole features, left whole."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.8, 1.2, hidden))

    def forward(self, x):
        return x * self.weight


class _InScaledMLP(nn.Module):
    """A Llama MLP scaling its input by a child's per-channel weight (hidden width): whole features in
    model(...), where the column layers sum their input's gradient; in a schedule's core the sum
    comes at the sublayer's input, before the scale, so its gradient there is this rank's share."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.in_scale = _InputScale(hidden)

    def forward(self, x):
        x = self.in_scale(x)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _LlamaMLPWithBias(nn.Module):
    """A Llama MLP with a learned activation child and a per-feature bias of its own on the inner features."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = _GatedSiLU(inner)
        self.inner_bias = nn.Parameter(torch.linspace(-0.2, 0.2, inner))

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * (self.up_proj(x) + self.inner_bias))


def _llama(mlp=None):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, tie_word_embeddings=False))
    if mlp is not None:
        for layer in model.model.layers:
            layer.mlp = mlp()
    return model.to(rank_device())


def _reference(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}


def _check_exact(kind, ref, rank, p, root):
    tp = copy.deepcopy(ref)
    _quiet_parallelize(tp)
    ids = _ids()
    want_logits, want_loss, want = _reference(ref, ids)
    tp.zero_grad(set_to_none=True)
    out = tp(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want_logits, **TOL, msg=lambda m: f"{kind}: logits {m}")
    out.loss.backward()
    oases.check_gradients(tp)
    check_grads(tp, want, rank, p, f"{kind} forward", TOL)
    for schedule in SCHEDULES:
        for recompute in (True, False):
            tp.zero_grad(set_to_none=True)
            loss = oases.train_step(tp, ids, ids, schedule=schedule, recompute=recompute, check_grads=1)
            where = f"{kind} {schedule} recompute={recompute}"
            torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
            check_grads(tp, want, rank, p, where, TOL)
    path = os.path.join(root, kind)
    oases.save_checkpoint(tp, path)
    fresh = copy.deepcopy(ref)
    _quiet_parallelize(fresh)
    with torch.no_grad():
        for q in fresh.parameters():
            q.mul_(-2.0)
    oases.load_checkpoint(fresh, path)
    for (name, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), f"{kind}: {name} after load_checkpoint"
    full = oases.full_state_dict(tp)
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), f"{kind}: {key} in full_state_dict"
    return tp


def _learned_activations(rank, p, root):
    tp = _check_exact("apertus", _apertus(), rank, p, root)
    styles = {part.name: part.style for part in oases.summary(tp).parts}
    assert styles["model.layers.0.mlp.act_fn"] == "summed", styles
    tp = _check_exact("gated", _llama(lambda: _LlamaMLPWithBias(64, 128)), rank, p, root)
    act = tp.model.layers[0].mlp.act_fn
    assert act.gate.shape == (128 // p,) and act.tp_summed == ("temperature",)  # per feature: sharded; scalar: summed
    assert tp.model.layers[0].mlp.inner_bias.shape == (128 // p,)
    styles = {part.name: part.style for part in oases.summary(tp).parts}
    assert styles["model.layers.0.mlp.act_fn"] == "sharded" and styles["model.layers.0.mlp"] == "sharded", styles
    return True


def test_learned_activations_and_inner_parameters_train_exactly_tp2():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_learned_activations, 2, root, timeout=240)


class _ShardScaledMLP(nn.Module):
    """A Llama MLP scaling the sharded features by a scalar of its own: a place no rule can see
    (the same parameter on the reduced output would be right in model(...))."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x) * self.scale)


class _NormedAct(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.norm = nn.LayerNorm(inner)

    def forward(self, x):
        return self.norm(nn.functional.silu(x))


class _NormedMLP(_LlamaMLPWithBias):
    """An MLP normalising its inner features: each rank would normalise its shard alone."""

    def __init__(self, hidden, inner):
        super().__init__(hidden, inner)
        self.act_fn = _NormedAct(inner)


class _LearnedAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.8]))

    def forward(self, x):
        return nn.functional.silu(x) * self.alpha


def _refused_and_caught(rank, p):
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.act_fn\.norm\.weight: a norm over the inner"):
        _quiet_parallelize(_llama(lambda: _NormedMLP(64, 128)))  # refused by rule, before anything changes

    ids = _ids()
    causes = {}
    # 0. the MLP's own scalar on its sharded features (no rule sees where its forward applies it)
    tp = _llama(lambda: _ShardScaledMLP(64, 128))
    _quiet_parallelize(tp)
    causes["model.layers.0.mlp.scale"] = tp
    # 1. a learned activation swapped in after parallelize: nothing sums its gradient
    tp = _llama()
    _quiet_parallelize(tp)
    tp.model.layers[1].mlp.act_fn = _LearnedAct().to(rank_device())
    causes["model.layers.1.mlp.act_fn.alpha"] = tp
    # 2. a learned gate on the sharded features, held by the decoder layer and applied by a hook
    tp = _llama()
    _quiet_parallelize(tp)
    layer = tp.model.layers[0]
    layer.feature_gate = nn.Parameter(torch.tensor(1.1, device=rank_device()))
    layer.mlp.up_proj.register_forward_hook(lambda m, args, out: out * layer.feature_gate)
    causes["model.layers.0.feature_gate"] = tp
    # 3. a hook that scales the attention's head shards with a parameter of the model's norm
    tp = _llama()
    _quiet_parallelize(tp)
    norm = tp.model.norm
    tp.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: out * norm.weight[0])
    causes["model.norm.weight"] = tp
    for name, tp in causes.items():
        tp.zero_grad(set_to_none=True)
        tp(input_ids=ids, labels=ids).loss.backward()
        with pytest.raises(RuntimeError, match=rf"oases.check_gradients: .*{name} \(\|grad\|"):
            oases.check_gradients(tp)
        tp.zero_grad(set_to_none=True)
        with pytest.raises(RuntimeError, match=rf"tensor-parallel group .*{name} .*Likely cause"):
            oases.train_step(tp, ids, ids, schedule="oases")  # the model's first train_step: checked
        oases.train_step(tp, ids, ids, schedule="oases")  # its second: not checked by default
        with pytest.raises(RuntimeError, match=name):
            oases.train_step(tp, ids, ids, schedule="merak", check_grads=1)

    # a scale on the MLP's input inside it: whole in model(...) (left whole, not summed), partial in
    # train_step's core: caught at the first step, never silent
    tp = _llama(lambda: _InScaledMLP(64, 128))
    _quiet_parallelize(tp)
    assert not hasattr(tp.model.layers[0].mlp.in_scale, "tp_summed")
    tp(input_ids=ids, labels=ids).loss.backward()
    oases.check_gradients(tp)
    tp.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.in_scale\.weight"):
        oases.train_step(tp, ids, ids)

    # the cadence: check_grads=N checks a model's first step and every N-th
    tp = _llama()
    _quiet_parallelize(tp)
    norm_w = tp.model.norm.weight
    for step in range(4):
        if step == 1:  # from the second step on, a partial gradient
            tp.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, a, out: out * norm_w[0])
        if step == 3:
            with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
                oases.train_step(tp, ids, ids, check_grads=3)
        else:
            oases.train_step(tp, ids, ids, check_grads=3)  # step 0 checked (clean), 1 and 2 not
    assert oases.train_step(tp, ids, ids, check_grads=False) is not None
    for bad in (0, -1, 1.5, "first"):
        with pytest.raises(ValueError, match="check_grads: expected True, False or a positive int"):
            oases.train_step(tp, ids, ids, check_grads=bad)
    return True


def test_injected_partial_gradients_are_caught_on_every_rank_tp2():
    run_ranks(_refused_and_caught, 2, timeout=180)


def _data_parallel(rank, p):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).to(rank_device())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(rank_device())  # each replica its own rows
    sync = oases.dp.GradientSync(model)
    model(x).square().sum().backward()
    sync.finish()
    oases.check_gradients(model, dp_group=dist.group.WORLD)  # averaged: alike
    if rank == 1:
        model[0].bias.grad.mul_(1.5)  # a replica whose gradient was changed after the sync
    with pytest.raises(RuntimeError, match=r"data-parallel replicas: 0\.bias"):
        oases.check_gradients(model, dp_group=dist.group.WORLD)
    sync.close()
    model.zero_grad(set_to_none=True)
    if rank == 0:
        model(x).sum().backward()  # a gradient on some ranks only
    with pytest.raises(RuntimeError, match=r"0\.weight \(a gradient on some ranks only\)"):
        oases.check_gradients(model, dp_group=dist.group.WORLD)
    with pytest.raises(TypeError, match="model: expected an nn.Module"):
        oases.check_gradients([model])
    return True


def test_data_parallel_gradients_checked_over_replicas():
    run_ranks(_data_parallel, 2, timeout=60)
