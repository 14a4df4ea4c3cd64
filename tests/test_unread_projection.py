"""Fine-grained recomputation does not run the row-parallel output projection's GEMM.

linear_unread(x, W)          F.linear(x, W)'s graph, no forward GEMM: x's and W's gradients
                             equal F.linear's bit for bit (W as [out, in] or a Conv1D's
                             transposed view, main_grad, autocast)
oases schedule, recompute    each sublayer's recomputed graph skips its output projection:
                             the step's FLOPs fall by exactly 2 * tokens * in/p * out per
                             projection (oases.models.GPT, Hugging Face Llama, sequence
                             parallel too), loss and every gradient as the single process
after the projection         a Llama whose MLP output is scaled by a learned gate (times it,
                             or in place): refused by train_step in the first forward on every
                             schedule, before any gradient (model(...).loss.backward(), which
                             reduces before the gate, is exact); by a constant: exact, and the
                             MLP's projection then runs in recomputation (its value is read)
"""

import copy
import importlib.util
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import oases
from oases.models import GPT, GPTConfig
from oases.nn import RowParallelLinear
from oases.ops import linear_unread

from _shards import check_grads, expected_shard
from _spawn import rank_device, run_ranks

_has_transformers = importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 16), (20, 16)])
def test_linear_unread_gradients_equal_linear_bit_for_bit(transposed, shape):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(*shape, generator=g)
    w0 = torch.randn(16, 12, generator=g) if transposed else torch.randn(12, 16, generator=g)
    grad = torch.randn(*shape[:-1], 12, generator=g)
    got = {}
    for name, op in (("linear", F.linear), ("unread", linear_unread)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = op(x, w.t() if transposed else w)
        assert y.shape == (*shape[:-1], 12)
        y.backward(grad)
        got[name] = (x.grad, w.grad)
    assert torch.equal(got["unread"][0], got["linear"][0])
    assert torch.equal(got["unread"][1], got["linear"][1])
    with FlopCounterMode(display=False) as flops:  # no forward GEMM
        linear_unread(x0, w0.t() if transposed else w0)
    assert flops.get_total_flops() == 0


def test_linear_unread_main_grad_and_autocast():
    g = torch.Generator().manual_seed(1)
    x0, w0, grad = torch.randn(6, 16, generator=g), torch.randn(12, 16, generator=g), torch.randn(6, 12, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    main_grad = torch.full((12, 16), 0.5)
    linear_unread(x, w, main_grad=main_grad).backward(grad)
    assert w.grad is None  # the weight's gradient went to main_grad, added
    torch.testing.assert_close(main_grad, 0.5 + grad.t() @ x0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, grad @ w0, rtol=1e-6, atol=1e-6)
    got = {}
    for name, op in (("linear", F.linear), ("unread", linear_unread)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = op(x, w)
        assert y.dtype == torch.bfloat16
        y.backward(grad.to(torch.bfloat16))
        got[name] = (x.grad, w.grad)
    for a, b in zip(got["unread"], got["linear"]):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"weight: in_features 16 does not match x's last dimension 12"):
        linear_unread(torch.zeros(2, 12), w0)
    with pytest.raises(TypeError, match="main_grad: must be float32"):
        linear_unread(x0, w0, main_grad=torch.zeros(12, 16, dtype=torch.float64))


CONFIG = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2)


def _step_flops(step) -> int:
    with FlopCounterMode(display=False) as flops:
        step()
    return flops.get_total_flops()


def _check_gpt(rank, p, want_loss, want_grads):
    want_loss, want_grads = want_loss.to(rank_device()), {n: g.to(rank_device()) for n, g in want_grads.items()}
    config = GPTConfig(**CONFIG)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (4, 16), generator=g).to(rank_device())
    targets = torch.randint(0, 64, (4, 16), generator=g).to(rank_device())
    n, h = 4 * 16, CONFIG["hidden"]
    skipped = CONFIG["layers"] * (2 * n * (h // p) * h + 2 * n * (CONFIG["mlp_ratio"] * h // p) * h)
    for sp in (False, True):
        counted = {}
        for unread in (True, False):
            model = GPT(config, schedule="oases", seed=7, sequence_parallel=sp).to(rank_device())
            if not unread:  # every sublayer's core run in full, as before
                for layer in model.layers():
                    for sub in layer:
                        sub.core_for_gradients = sub.core
            losses = []
            counted[unread] = _step_flops(lambda: losses.append(model.train_step(tokens, targets, recompute=True)))
            where = f"GPT sequence_parallel={sp} unread={unread}"
            torch.testing.assert_close(losses[0], want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
            for name, param in model.named_parameters():
                torch.testing.assert_close(
                    param.grad, model.shard_of(name, want_grads[name]), rtol=1e-4, atol=1e-6, msg=lambda m: where
                )
        assert counted[False] - counted[True] == skipped, (sp, counted, skipped)
    return True


def test_oases_recomputation_skips_the_output_projections_gemm_in_gpt():
    config = GPTConfig(**CONFIG)
    model = GPT(config, seed=7)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (4, 16), generator=g)
    targets = torch.randint(0, 64, (4, 16), generator=g)
    loss = model(tokens, targets)
    loss.backward()
    run_ranks(_check_gpt, 2, loss.detach(), {n: q.grad for n, q in model.named_parameters()}, timeout=120)


LLAMA = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=64,
    max_position_embeddings=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="eager",
    pad_token_id=0,
    tie_word_embeddings=False,
)


_SCALED = {
    "learned": lambda mlp, y: y * mlp.gate_scale,
    "learned in place": lambda mlp, y: y.mul_(mlp.gate_scale),
    "constant": lambda mlp, y: y * 0.75,
}


def _llama(scaled=None):
    """A Hugging Face Llama; `scaled` (a key of _SCALED): each MLP's output times a learned scalar
    (a layer scale, whose gradient needs the down projection's value) or a constant."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA))
    for layer in model.model.layers if scaled else ():
        mlp = layer.mlp
        mlp.gate_scale = nn.Parameter(torch.tensor(0.75), requires_grad=scaled != "constant")
        plain, scale = type(mlp).forward, _SCALED[scaled]
        mlp.forward = types.MethodType(lambda self, x, plain=plain, scale=scale: scale(self, plain(self, x)), mlp)
    return model.to(rank_device())


def _check_llama(rank, p, scaled):
    ref = _llama(scaled)
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(5)).to(rank_device())
    ref(input_ids=ids, labels=ids).loss.backward()
    want = {n: q.grad.clone() for n, q in ref.named_parameters() if q.grad is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = oases.parallelize(copy.deepcopy(ref), None)
    rows = [m for m in tp.modules() if isinstance(m, RowParallelLinear)]
    oases.train_step(tp, ids, ids, schedule="oases", recompute=True)  # a scaled MLP's projection found read (marked)
    read = {r for r in rows if r._output_read}
    assert read == ({layer.mlp.down_proj for layer in tp.model.layers} if scaled else set())
    counted = {}
    for unread in (True, False):
        tp.zero_grad(set_to_none=True)
        for row in rows:  # False: every core run in full, as before
            row._output_read = not unread or row in read
        counted[unread] = _step_flops(lambda: oases.train_step(tp, ids, ids, schedule="oases", recompute=True))
        tp.zero_grad(set_to_none=True)
        oases.train_step(tp, ids, ids, schedule="oases", recompute=True)
        for name, param in tp.named_parameters():
            if name in want:
                torch.testing.assert_close(
                    param.grad,
                    expected_shard(tp, name, want[name], rank, p),
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m: f"scaled={scaled} unread={unread}: {name}: {m}",
                )
    n, h, inter = 4 * 12, LLAMA["hidden_size"], LLAMA["intermediate_size"]
    skipped = LLAMA["num_hidden_layers"] * 2 * n * h * (h // p + (0 if scaled else inter // p))
    assert counted[False] - counted[True] == skipped, (counted, skipped)
    return True


@pytest.mark.skipif(not _has_transformers, reason="transformers is not installed")
@pytest.mark.parametrize("scaled", [None, "constant"])
def test_oases_recomputation_skips_the_output_projections_gemm_in_llama(scaled):
    run_ranks(_check_llama, 2, scaled, timeout=120)


def _check_gated(rank, p, scaled):
    ref = _llama(scaled)
    ids = torch.randint(3, 60, (4, 12), generator=torch.Generator().manual_seed(5)).to(rank_device())
    ref(input_ids=ids, labels=ids).loss.backward()
    want = {n: q.grad.clone() for n, q in ref.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = oases.parallelize(copy.deepcopy(ref), None)
    for schedule, recompute in (("oases", True), ("megatron", True), ("oases", False)):
        with pytest.raises(ValueError, match=r"decoder layer 0's LlamaMLP .* learned scale or gate"):
            oases.train_step(tp, ids, ids, schedule=schedule, recompute=recompute)
        assert all(q.grad is None for q in tp.parameters()), "refused after a backward began"
    tp.zero_grad(set_to_none=True)  # the layers reduce before the scale: exact
    tp(input_ids=ids, labels=ids).loss.backward()
    check_grads(tp, want, rank, p, f"{scaled}, model(...).loss.backward()", dict(rtol=1e-4, atol=1e-5))
    return True


@pytest.mark.skipif(not _has_transformers, reason="transformers is not installed")
@pytest.mark.parametrize("scaled", ["learned", "learned in place"])
def test_a_learned_scale_after_the_output_projection_is_refused_by_train_step(scaled):
    """Its gradient would be a partial sum under the schedules (they reduce after the branch)."""
    run_ranks(_check_gated, 2, scaled, timeout=120)
