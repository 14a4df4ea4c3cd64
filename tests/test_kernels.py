"""Triton GEMM kernels against torch (fp64 oracle), under TRITON_INTERPRET=1 (see conftest.py),
or compiled for the GPU when the harness runs on CUDA (tensors on harness_device())."""

import pytest
import torch

from oases_kernels import linear_accumulate, linear_into
from oases_kernels._gemm import Tiles, launch_gemm

from _interpreter import interpreter_failure
from _spawn import harness_device

# Tolerances against the fp64 reference rounded to the output dtype: the kernel accumulates in
# fp32 and rounds once, so it may differ from the rounded reference by about one ulp.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
M, N, K = 37, 45, 70  # none a multiple of a tile: every mask is exercised


DEVICE = harness_device()
_BROKEN = interpreter_failure() if DEVICE == "cpu" else None
pytestmark = pytest.mark.skipif(_BROKEN is not None, reason=_BROKEN or "")


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)


def _reference(x, weight, bias=None, acc=None):
    """x @ weight.T (+ bias) (+ acc) in fp64."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if acc is not None:
        y = y + acc.double()
    return y


def _nan(*shape, dtype):
    """An output buffer whose unwritten elements cannot pass a comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_into_matches_torch(dtype, with_bias):
    x, w = _rand(M, K, dtype=dtype, seed=1), _rand(N, K, dtype=dtype, seed=2)
    bias = _rand(N, dtype=dtype, seed=3) if with_bias else None
    out = _nan(M, N, dtype=dtype)
    got = linear_into(x, w, out, bias=bias)
    assert got.data_ptr() == out.data_ptr() and got.shape == (M, N)
    torch.testing.assert_close(got, _reference(x, w, bias).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_into_strided_inputs(dtype):
    x = _rand(K, M, dtype=dtype, seed=4).t()  # transposed view: strides (1, M)
    w = _rand(N, 2 * K, dtype=dtype, seed=5)[:, ::2]  # every other column: strides (2K, 2)
    wt = _rand(K, N, dtype=dtype, seed=6).t()  # transposed weight: strides (1, N)
    bias = _rand(2 * N, dtype=torch.float32, seed=7)[::2]  # fp32 bias with stride 2
    assert not x.is_contiguous() and not w.is_contiguous() and not wt.is_contiguous()
    out_t = _nan(N, M, dtype=dtype).t()  # transposed out: strides (1, M)
    for weight, out in ((w, _nan(M, N, dtype=dtype)), (wt, out_t)):
        got = linear_into(x, weight, out, bias=bias)
        torch.testing.assert_close(got, _reference(x, weight, bias).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("row_offset", [0, 20, 63])
def test_linear_into_row_slice_leaves_the_rest_untouched(row_offset):
    x, w = _rand(M, K, seed=8), _rand(N, K, seed=9)
    big = _rand(100, N + 7, seed=10)
    out = big[:, 3 : 3 + N]  # row stride N + 7: columns outside out must survive too
    before = big.clone()
    got = linear_into(x, w, out, row_offset=row_offset)
    assert got.data_ptr() == out[row_offset:].data_ptr() and got.shape == (M, N)
    torch.testing.assert_close(got, _reference(x, w).float(), **TOL[torch.float32])
    rows = slice(row_offset, row_offset + M)
    untouched = torch.ones_like(big, dtype=torch.bool)
    untouched[rows, 3 : 3 + N] = False
    assert torch.equal(big[untouched], before[untouched])  # bitwise: nothing else was written


def test_linear_into_casts_to_out_dtype_and_handles_empty():
    x, w = _rand(M, K, dtype=torch.bfloat16, seed=11), _rand(N, K, dtype=torch.bfloat16, seed=12)
    got = linear_into(x, w, _nan(M, N, dtype=torch.float32))  # bf16 inputs, fp32 output
    torch.testing.assert_close(got, _reference(x, w).float(), **TOL[torch.float32])
    out = _rand(8, N, seed=13)
    before = out.clone()
    assert linear_into(x[:0], w, out, row_offset=5).shape == (0, N)
    assert torch.equal(out, before)


def test_grouped_ordering_covers_every_tile():
    # 16-wide tiles give a 5 x 3 grid of programs and GROUP_M=2 leaves a ragged last group.
    x, w, acc = _rand(70, K, seed=14), _rand(N, K, seed=15), _rand(70, N, seed=16)
    out = _nan(70, N, dtype=torch.float32)
    launch_gemm(x, w, out, acc=acc, tiles=Tiles(block_m=16, block_n=16, block_k=16, group_m=2))
    torch.testing.assert_close(out, _reference(x, w, acc=acc).float(), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_accumulate_matches_torch(dtype):
    x, w = _rand(M, K, dtype=dtype, seed=17), _rand(N, K, dtype=dtype, seed=18)
    acc = _rand(N, M, dtype=dtype, seed=19).t()  # non-contiguous acc
    got = linear_accumulate(x, w, acc)
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got, _reference(x, w, acc=acc).to(dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_accumulate_in_place(dtype):
    x, w = _rand(M, K, dtype=dtype, seed=20), _rand(N, K, dtype=dtype, seed=21)
    acc = _rand(M, N, dtype=dtype, seed=22)
    want = _reference(x, w, acc=acc).to(dtype)
    assert linear_accumulate(x, w, acc, out=acc) is acc
    torch.testing.assert_close(acc, want, **TOL[dtype])


def test_linear_accumulate_fp32_acc_with_bf16_inputs():
    # bf16 products are exact in fp32, so an fp32 accumulator must reach fp32 accuracy:
    # any rounding through bf16 (of the partial sums or of acc) would miss by ~1e-2.
    x, w = _rand(M, K, dtype=torch.bfloat16, seed=23), _rand(N, K, dtype=torch.bfloat16, seed=24)
    acc = _rand(M, N, dtype=torch.float32, seed=25) * 100
    want = _reference(x, w, acc=acc).float()
    assert linear_accumulate(x, w, acc, out=acc) is acc
    torch.testing.assert_close(acc, want, **TOL[torch.float32])
    got = linear_accumulate(x, w, acc)  # out defaults to x's dtype
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _reference(x, w, acc=acc).to(torch.bfloat16), **TOL[torch.bfloat16])


def _x(dtype=torch.float32):
    return torch.zeros(4, 32, dtype=dtype)


BAD_CALLS = {
    "in_features": (
        lambda: linear_into(_x(), torch.zeros(8, 64), torch.zeros(4, 8)),
        ValueError,
        "weight: in_features 64 does not match x's last dimension 32",
    ),
    "x 3-D": (
        lambda: linear_into(torch.zeros(2, 4, 32), torch.zeros(8, 32), torch.zeros(8, 8)),
        ValueError,
        "x: expected a 2-D",
    ),
    "x int": (
        lambda: linear_into(_x(torch.int32), torch.zeros(8, 32, dtype=torch.int32), torch.zeros(4, 8)),
        TypeError,
        "x: dtype torch.int32",
    ),
    "weight dtype": (
        lambda: linear_into(_x(), torch.zeros(8, 32, dtype=torch.float16), torch.zeros(4, 8)),
        TypeError,
        "weight: dtype",
    ),
    "out too small": (
        lambda: linear_into(_x(), torch.zeros(8, 32), torch.zeros(6, 8), row_offset=3),
        ValueError,
        r"out: has 6 rows .* = 7",
    ),
    "out columns": (
        lambda: linear_into(_x(), torch.zeros(8, 32), torch.zeros(4, 9)),
        ValueError,
        r"out: expected shape \(R, 8\)",
    ),
    "out dtype": (
        lambda: linear_into(_x(), torch.zeros(8, 32), torch.zeros(4, 8, dtype=torch.int64)),
        TypeError,
        "out: dtype",
    ),
    "out expanded": (
        lambda: linear_into(_x(), torch.zeros(8, 32), torch.zeros(1, 8).expand(4, 8)),
        ValueError,
        "out: is an expanded view",
    ),
    "row_offset": (
        lambda: linear_into(_x(), torch.zeros(8, 32), torch.zeros(4, 8), row_offset=-1),
        ValueError,
        "row_offset",
    ),
    "bias shape": (
        lambda: linear_into(_x(), torch.zeros(8, 32), torch.zeros(4, 8), bias=torch.zeros(9)),
        ValueError,
        "bias: expected shape",
    ),
    "acc shape": (
        lambda: linear_accumulate(_x(), torch.zeros(8, 32), torch.zeros(8, 4)),
        ValueError,
        r"acc: expected shape \(4, 8\)",
    ),
    "acc dtype": (
        lambda: linear_accumulate(
            _x(torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.float16)
        ),
        TypeError,
        "acc: dtype",
    ),
    "acc out shape": (
        lambda: linear_accumulate(_x(), torch.zeros(8, 32), torch.zeros(4, 8), out=torch.zeros(4, 9)),
        ValueError,
        "out: expected",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_inputs_raise_naming_the_argument(name):
    call, error, match = BAD_CALLS[name]
    with pytest.raises(error, match=match):
        call()
