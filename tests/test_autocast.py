"""torch.autocast around the fused ops, a parallelized Hugging Face model and oases.train_step
(CPU bf16, 2 gloo ranks), against the same computation without TP under the same autocast.

The ops: all_gather_linear, linear_reduce_scatter and linear_all_reduce on fp32 operands inside
autocast give bf16 outputs close to their plain references' (bf16 tolerance: partial sums round
before the reduction), gradients in the operands' fp32. The model: a tiny Llama at TP 2 (default
plan, vocabulary-parallel head) gives logits, loss and every gradient within bf16 tolerance of the
unsharded model under the same autocast, via model(...) and via train_step on every schedule with
and without sequence parallelism; the same checks fail without autocast on the sharded side
(the comparison can tell bf16 from fp32).
"""

import warnings

import pytest
import torch

import oases
from oases import ops
from oases.schedule import SCHEDULES

from _shards import expected_shard as _expected
from _spawn import harness_device, rank_device, run_ranks

pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _close(a, b, what, rel=3e-2):
    """||a - b|| <= rel ||b||: bf16 rounding (8 bits of mantissa) on both sides, summed differently."""
    a, b = a.double(), b.double()
    err = (a - b).norm() / b.norm().clamp_min(1e-12)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel}"
    return float(err)


def _single_process(x_full, w_full, bias, lin):
    """F.linear on the whole operands under autocast, the loss sum(y * lin), and the grads (fp32)."""
    x, w, b = (t.clone().requires_grad_() for t in (x_full, w_full, bias))
    with torch.autocast(harness_device(), BF16):
        y = torch.nn.functional.linear(x, w, b)
    (y.float() * lin).sum().backward()
    return y, x.grad, w.grad, b.grad


def _ops(rank, world):
    g, dev = torch.Generator().manual_seed(0), rank_device()
    x_full = torch.randn(8, 6, 32, generator=g).to(dev)
    w_full = (torch.randn(24, 32, generator=g) / 6).to(dev)
    bias = torch.randn(24, generator=g).to(dev)
    lin = torch.linspace(-1, 1, 24, device=dev)
    rows, cols, outs = (slice(r * n, (r + 1) * n) for r, n in ((rank, 4), (rank, 16), (rank, 12)))
    y, gx, gw, gb = _single_process(x_full, w_full, bias, lin)
    cases = {  # name: (op, x, weight, bias, the loss's weights, expected y, grad x, grad weight, grad bias)
        "all_gather_linear": (
            ops.all_gather_linear,
            x_full[rows],
            w_full[outs],
            bias[outs],
            lin[outs],
            y[..., outs],
            gx[rows],
            gw[outs],
            gb[outs],
        ),
        "linear_reduce_scatter": (
            ops.linear_reduce_scatter,
            x_full[..., cols],
            w_full[:, cols],
            bias,
            lin,
            y[rows],
            gx[..., cols],
            gw[:, cols],
            lin.expand(4 * 6, 24).sum(0),
        ),
        "linear_all_reduce": (
            ops.linear_all_reduce,
            x_full[..., cols],
            w_full[:, cols],
            bias,
            lin,
            y,
            gx[..., cols],
            gw[:, cols],
            gb,
        ),
    }
    for name, (op, x, w, b, weights, *want) in cases.items():
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        with torch.autocast(harness_device(), BF16):
            out = op(xs, ws, bs)
        assert out.dtype == BF16, (name, out.dtype)
        (out.float() * weights).sum().backward()
        assert ws.grad.dtype == xs.grad.dtype == bs.grad.dtype == torch.float32, name
        for what, a, b in zip(("y", "grad x", "grad weight", "grad bias"), (out, xs.grad, ws.grad, bs.grad), want):
            _close(a, b, f"{name} {what}")


def test_fused_ops_under_autocast():
    run_ranks(_ops, 2, timeout=90)


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
    )


def _check_grads(model, want, where, rank, world):
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, (where, name)
        _close(p.grad, _expected(model, name, want[name], rank, world), f"{where}: grad of {name}")


def _model(rank, world):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1)).to(rank_device())
    plain = _llama().to(rank_device())
    with torch.autocast(harness_device(), BF16):
        out = plain(input_ids=ids, labels=ids)
    out.loss.backward()
    want_loss = out.loss.detach().float()
    want = {n: p.grad.clone() for n, p in plain.named_parameters()}

    def sharded():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return oases.parallelize(_llama().to(rank_device()))

    model = sharded()
    with torch.autocast(harness_device(), BF16):
        out = model(input_ids=ids, labels=ids)
    assert out.logits.dtype == BF16
    out.loss.backward()
    _close(out.loss.float(), want_loss, "model(...) loss", rel=1e-2)
    _check_grads(model, want, "model(...)", rank, world)
    for schedule in SCHEDULES:
        for sp in (False, True):
            model = sharded()
            with torch.autocast(harness_device(), BF16):
                loss = oases.train_step(model, ids, ids, schedule=schedule, sequence_parallel=sp)
            _close(loss.float(), want_loss, f"{schedule} sp={sp} loss", rel=1e-2)
            _check_grads(model, want, f"{schedule} sp={sp}", rank, world)
    # the comparison tells bf16 from fp32: the fp32 sharded model's gradients miss the bf16 ones
    model = sharded()
    model(input_ids=ids, labels=ids).loss.backward()
    errors = []
    for name, p in model.named_parameters():
        full = _expected(model, name, want[name], rank, world).double()
        errors.append(float((p.grad.double() - full).norm() / full.norm()))
    assert max(errors) > 1e-3, max(errors)


def test_parallelized_llama_under_autocast():
    run_ranks(_model, 2, timeout=240)
