"""The GPU path, checked where a CPU can check it, and for real where the harness runs on CUDA.

On CPU (gloo, Triton's interpreter):
  - the kernel launch plan: the interpreter-safe plan (upcast, one config) only under the
    interpreter, the GPU plan (input-dtype tl.dot, several configs) otherwise, and the GPU
    kernel body (no upcast) computing right where the interpreter can run it (fp32, fp16);
  - the rings' ordering, driven through a side that records who waits where: every transfer
    is posted and waited for on the comm side, every GEMM (produce) runs on the compute side
    before the partial sum it extends is waited for, and the compute side is handed the result
    before it reads it;
  - main_grad: fp32 accumulation of the weight gradient (ops and layers), exact against the
    unfused path for fp32 and against an fp64 oracle for bf16.
With OASES_TEST_DEVICE=cuda (or GPUs present), the same rank functions also run on cuda tensors
over NCCL, and the batched copy kernel is compared with torch's copies.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import oases.comm.ring as ring_module
from oases import ops
from oases.comm._streams import _HostSide
from oases.comm.topology import ring_of
from oases.nn import ColumnParallelLinear, RowParallelLinear

from _interpreter import interpreter_failure
from _spawn import harness_device, run_ranks

DEVICE = harness_device()
on_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs the harness on CUDA (OASES_TEST_DEVICE=cuda)")
on_cpu = pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter runs only with the CPU harness")
_BROKEN = interpreter_failure() if DEVICE == "cpu" else None
interpreted = pytest.mark.skipif(_BROKEN is not None, reason=_BROKEN or "")  # runs a kernel under the interpreter


def _randn(shape, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


# --- Kernel launch plan ---------------------------------------------------------------------------


def test_launch_plan_interpreter_upcasts_with_one_config():
    from oases_kernels._gemm import INTERPRETER_TILES, launch_plan

    plan = launch_plan(interpret=True)
    assert plan.upcast is True and plan.tiles == (INTERPRETER_TILES,)


def test_launch_plan_gpu_autotunes_in_the_input_dtype():
    import triton

    from oases_kernels._gemm import GPU_TILES, _gemm_kernel_tuned, launch_plan

    plan = launch_plan(interpret=False)
    assert plan.upcast is False and plan.tiles == GPU_TILES
    assert 2 <= len(set(plan.tiles)) == len(plan.tiles) <= 8  # a small list, no duplicates
    for t in plan.tiles:
        for size in (t.block_m, t.block_n, t.block_k, t.num_warps):
            assert size & (size - 1) == 0, t  # powers of two: tl.arange and tl.dot need them
        assert t.block_k >= 16 and t.block_m >= 16 and t.block_n >= 16, t  # tensor-core tiles
        config = t.config()
        assert isinstance(config, triton.Config)
        assert config.kwargs == {"BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP_M": t.group_m}
        assert (config.num_warps, config.num_stages) == (t.num_warps, t.num_stages)
    assert len(_gemm_kernel_tuned.configs) == len(GPU_TILES)
    assert list(_gemm_kernel_tuned.keys) == ["M", "N", "K"]


@on_cpu
def test_interpreter_is_detected_under_the_cpu_harness():
    from oases_kernels._gemm import interpreting, launch_plan

    assert interpreting() and launch_plan(interpreting()).upcast


@on_cpu
@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_kernel_body_without_upcast_is_right(dtype):
    """The GPU plan's tl.dot in the input dtype, run by the interpreter with one config (its bf16
    dot is wrong, so bf16 is left to the GPU run of test_kernels.py)."""
    from oases_kernels._gemm import LaunchPlan, Tiles, launch_gemm

    x, w, acc = _randn((37, 70), 1, dtype), _randn((45, 70), 2, dtype), _randn((37, 45), 3)
    out = torch.full((37, 45), float("nan"), dtype=torch.float32)
    launch_gemm(x, w, out, acc=acc, plan=LaunchPlan(upcast=False, tiles=(Tiles(),)))
    want = x.double() @ w.double().T + acc.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, want.float(), rtol=tol, atol=tol)


# The GPU kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed; Triton's own ptxas),
# in a fresh process (the suite's process runs Triton's interpreter): one process compiles every
# case of COMPILED, each reported on its own line (a failure as its traceback).
COMPILED = [("bfloat16", 80, 0), ("bfloat16", 90, 0), ("float16", 80, -1)]
_COMPILE = r"""
import json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from oases_kernels._gemm import GPU_TILES, _gemm_kernel, _input_precision, launch_plan
import torch


def compile_case(dtype, capability, tile):
    t = GPU_TILES[tile]
    plan = launch_plan(interpret=False)
    ptr = "*" + {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    sig = {name: ptr for name in ("x_ptr", "w_ptr", "out_ptr", "bias_ptr")}
    sig["acc_ptr"] = "*fp32"
    sig.update({name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk",
                                         "stride_om", "stride_on", "stride_am", "stride_an", "stride_b")})
    consts = {"HAS_BIAS": True, "HAS_ACC": True, "INPUT_PRECISION": _input_precision(getattr(torch, dtype)),
              "UPCAST": plan.upcast, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k,
              "GROUP_M": t.group_m}
    sig.update({name: "constexpr" for name in consts})
    kernel = triton.compile(ASTSource(fn=_gemm_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": t.num_warps, "num_stages": t.num_stages})
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    mma = [line.strip() for line in kernel.asm["ptx"].splitlines() if "mma" in line and f".{short}" in line]
    return {"mma": mma[:1], "shared": kernel.metadata.shared}


for case in json.loads(sys.argv[1]):
    try:
        result = compile_case(*case)
    except Exception:
        result = {"error": traceback.format_exc()}
    print(json.dumps({"case": case, **result}), flush=True)
"""


@pytest.fixture(scope="module")
def compiled():
    """{(dtype, capability, tile): what _COMPILE reported} for every case of COMPILED."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(COMPILED)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"case"')]
    return {tuple(line.pop("case")): line for line in lines}


@pytest.mark.parametrize("dtype, capability, tile", COMPILED)
def test_gpu_kernel_compiles_to_16_bit_tensor_core_mma(compiled, dtype, capability, tile):
    """No upcast on the GPU: the PTX multiplies 16-bit operands into an fp32 accumulator
    (mma.sync ...f32.bf16.bf16.f32; wgmma on sm_90 for large tiles), and the tiles fit shared memory."""
    result = compiled.get((dtype, capability, tile), {"error": f"not reported: {compiled}"})
    assert "error" not in result, result["error"]
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    assert result["mma"], "no 16-bit MMA instruction in the PTX"
    assert f".f32.{short}.{short}" in result["mma"][0], result["mma"]  # D(f32) = A(16) B(16) + C
    if capability == 90 and tile == 0:  # Hopper's warpgroup MMA for a 4+-warp, 64+-row tile
        assert result["mma"][0].startswith("wgmma"), result["mma"]
    assert result["shared"] <= {80: 163 * 1024, 90: 227 * 1024}[capability]


# --- Ring ordering -------------------------------------------------------------------------------


class _RecordingSide(_HostSide):
    """The host side (same results), recording on which side each step happens."""

    def __init__(self):
        self.log = []
        self.in_comm = False

    @contextlib.contextmanager
    def comm(self):
        assert not self.in_comm, "comm contexts do not nest"
        self.in_comm = True
        try:
            yield
        finally:
            self.in_comm = False

    def handoff(self, *tensors):
        self.log.append(("handoff", self.in_comm))

    def to_compute(self):
        self.log.append(("to_compute", self.in_comm))


@contextlib.contextmanager
def _recording_posts(side):
    """Log every ring step posted and waited for (the ring's two private steps, wrapped here),
    with the side it happens on."""
    post, wait = ring_module._post, ring_module._wait

    def logged(kind, f):
        def call(*args, **kwargs):
            side.log.append((kind, side.in_comm))
            return f(*args, **kwargs)

        return call

    ring_module._post, ring_module._wait = logged("post", post), logged("wait", wait)
    try:
        yield
    finally:
        ring_module._post, ring_module._wait = post, wait


def _check_ring_ordering(rank, p):
    ring = ring_of(None)
    device = DEVICE
    cases = 0
    for chunks, bidirectional in ((1, False), (2, True)):
        n = 4 * chunks
        # Reduce-scatter: produce (the GEMM) on the compute side before each wait; waits and posts
        # on the comm side; the compute side is handed `out` at the end.
        full = _randn((p * n, 3), seed=rank + 10 * chunks, device=device)
        want = torch.empty((n, 3), device=device)
        dist.reduce_scatter_tensor(want, full.clone())
        side = _RecordingSide()

        def produce(rows):
            side.log.append(("gemm", side.in_comm))
            return full[rows]

        out = torch.empty((n, 3), device=device)
        with _recording_posts(side):
            for _ in ring_module.reduce_scatter_rows(produce, out, ring, chunks, bidirectional, side=side):
                side.log.append(("caller", side.in_comm))
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        kinds = [k for k, _ in side.log]
        assert all(in_comm for k, in_comm in side.log if k in ("wait", "post")), side.log
        assert not any(in_comm for k, in_comm in side.log if k in ("gemm", "caller", "handoff", "to_compute"))
        pieces = chunks * (2 if bidirectional else 1)
        assert kinds.count("gemm") == p * pieces and kinds.count("wait") == (p - 1) * pieces
        # Each wait comes after the GEMM of the piece it accumulates, and that GEMM after a handoff.
        for i, kind in enumerate(kinds):
            if kind == "wait":
                before = kinds[:i]
                assert before[-2:] == ["gemm", "handoff"], side.log
        assert kinds[-1] == "to_compute"
        cases += 1

        # All-gather: posts (also the forwards of received pieces) and waits on the comm side; the
        # compute side is handed each received piece before the caller reads it.
        shard = _randn((n, 3), seed=100 + rank, device=device)
        want = torch.empty((p * n, 3), device=device)
        dist.all_gather_into_tensor(want, shard)
        side = _RecordingSide()
        out = torch.empty((p * n, 3), device=device)
        with _recording_posts(side):
            for rows in ring_module.all_gather_rows(shard, out, ring, chunks, bidirectional, side=side):
                side.log.append(("caller", side.in_comm))
        assert torch.equal(out, want)
        assert all(in_comm for k, in_comm in side.log if k in ("wait", "post")), side.log
        kinds = [k for k, _ in side.log]
        assert kinds[0] == "handoff" and kinds.count("post") == (p - 1) * pieces
        received = [i for i, k in enumerate(kinds) if k == "caller"][chunks:]  # after own pieces
        assert all(kinds[i - 1] == "to_compute" for i in received), side.log
        cases += 1
    return cases


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_waits_only_on_the_comm_side(world_size):
    assert run_ranks(_check_ring_ordering, world_size) == [4] * world_size


# --- main_grad (gradient-accumulation fusion) ----------------------------------------------------


def _check_ops_main_grad(rank, p, forced_triton):
    """Each op's main_grad += grad_w in fp32: exact (fp32) and against an fp64 oracle (bf16).
    forced_triton: the CUDA path's Triton GEMM (linear_accumulate into main_grad) on CPU tensors
    under the interpreter."""
    from oases.ops import gemm

    if forced_triton:
        gemm._use_triton = lambda x: True
    device = DEVICE
    n, k, o = 8, 12, 6
    for dtype in (torch.float32, torch.bfloat16):
        xs = [_randn((n, k), seed=10 + r, dtype=dtype, device=device) for r in range(p)]
        w = _randn((o, k), seed=3, dtype=dtype, device=device).requires_grad_()
        g_full = _randn((p * n, o), seed=4, dtype=dtype, device=device)
        x_cat = torch.cat(xs).double()
        cases = {
            # op, its input, grad_y, the fp64 weight gradient
            "all_gather_linear": (
                lambda x, **kw: ops.all_gather_linear(x, w, None, **kw),
                xs[rank],
                g_full,
                g_full.double().t() @ x_cat,
            ),
            "linear_reduce_scatter": (
                lambda x, **kw: ops.linear_reduce_scatter(x, w, None, **kw),
                x_cat.to(dtype),
                g_full.chunk(p)[rank],
                g_full.double().t() @ x_cat,
            ),
            "linear_all_reduce": (
                lambda x, **kw: ops.linear_all_reduce(x, w, None, **kw),
                xs[rank],
                g_full[:n],
                g_full[:n].double().t() @ xs[rank].double(),
            ),
        }
        for name, (op, x, g, want) in cases.items():
            w.grad = None
            op(x).backward(g)
            unfused = w.grad.clone()
            main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
            w.grad = None
            y = op(x, main_grad=main_grad)
            y.backward(g)
            assert w.grad is None, name
            if dtype == torch.float32 and not forced_triton and device == "cpu":
                assert torch.equal(main_grad, unfused), name  # same GEMMs, same order, from zero
            elif dtype == torch.float32:  # cuBLAS may pick another algorithm for addmm than mm
                torch.testing.assert_close(main_grad, unfused, rtol=1e-6, atol=1e-6, msg=name)
            torch.testing.assert_close(main_grad.double(), want, rtol=1e-5, atol=1e-5, msg=name)
            op(x, main_grad=main_grad).backward(g)  # a second micro-batch accumulates
            torch.testing.assert_close(main_grad.double(), 2 * want, rtol=1e-5, atol=2e-5, msg=name)
        # The unfused bf16 gradient is rounded to bf16; main_grad keeps fp32 accuracy.
        if dtype == torch.bfloat16:
            assert (unfused.double() - want).abs().max() > (main_grad.double() / 2 - want).abs().max()
    return True


@pytest.mark.parametrize("forced_triton", [False, pytest.param(True, marks=[on_cpu, interpreted])])
def test_ops_accumulate_main_grad_in_fp32(forced_triton):
    assert run_ranks(_check_ops_main_grad, 2, forced_triton, timeout=120) == [True, True]


def _check_layers_main_grad(rank, p):
    """TP layers with gradient_accumulation_fusion: main_grad equals the unfused .grad (fp32),
    after one backward exactly, after two (summed) closely; .grad stays None."""
    device = DEVICE
    h, f, s, b = 8, 16, 4, 2
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        col = ColumnParallelLinear(h, f, sequence_parallel=sequence_parallel, device=device)
        row = RowParallelLinear(f, h, sequence_parallel=sequence_parallel, device=device)
        fused = [
            ColumnParallelLinear.from_linear(
                _unsharded(col), sequence_parallel=sequence_parallel, gradient_accumulation_fusion=True
            ),
            RowParallelLinear.from_linear(
                _unsharded(row), sequence_parallel=sequence_parallel, gradient_accumulation_fusion=True
            ),
        ]
        assert "gradient_accumulation_fusion=True" in repr(fused[0])
        rows = s // p if sequence_parallel else s
        for step in range(2):
            x = _randn((rows, b, h), seed=20 + step + (rank if sequence_parallel else 0), device=device)
            row(torch.relu(col(x))).sum().backward()
            fused[1](torch.relu(fused[0](x))).sum().backward()
            for plain, layer in zip((col, row), fused):
                assert layer.weight.grad is None and layer.weight.main_grad.dtype == torch.float32
                if step == 0 and device == "cpu":  # the same BLAS calls from zero: bitwise
                    assert torch.equal(layer.weight.main_grad, plain.weight.grad)
                else:
                    torch.testing.assert_close(layer.weight.main_grad, plain.weight.grad, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(layer.bias.grad, plain.bias.grad, rtol=1e-6, atol=1e-6)
        with torch.no_grad():  # no backward to come: main_grad is left alone
            before = fused[0].weight.main_grad.clone()
            fused[0](x)
            assert torch.equal(fused[0].weight.main_grad, before)
    return True


def _unsharded(layer):
    """The full nn.Linear a TP layer is a shard of (gathered over the group)."""
    dim = 0 if isinstance(layer, ColumnParallelLinear) else 1
    parts = [torch.empty_like(layer.weight) for _ in range(layer.world_size)]
    dist.all_gather(parts, layer.weight.detach().contiguous())
    weight = torch.cat(parts, dim)
    full = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device)
    with torch.no_grad():
        full.weight.copy_(weight)
        if dim == 0:
            parts = [torch.empty_like(layer.bias) for _ in range(layer.world_size)]
            dist.all_gather(parts, layer.bias.detach().contiguous())
            full.bias.copy_(torch.cat(parts))
        else:
            full.bias.copy_(layer.bias)
    return full


def test_layers_gradient_accumulation_fusion():
    assert run_ranks(_check_layers_main_grad, 2, timeout=120) == [True, True]


def _check_bad_main_grad(rank, p):
    w = torch.zeros(3, 4)
    x = torch.zeros(4, 4)
    for main_grad, error, words in (
        (torch.zeros(3, 4, dtype=torch.bfloat16), TypeError, "main_grad: must be float32"),
        (torch.zeros(4, 3), ValueError, "main_grad: must have weight's shape"),
        ("grad", TypeError, "main_grad: expected a torch.Tensor"),
    ):
        for op in (ops.all_gather_linear, ops.linear_reduce_scatter, ops.linear_all_reduce):
            with pytest.raises(error, match=words):
                op(x, w, None, main_grad=main_grad)
    with pytest.raises(TypeError, match="gradient_accumulation_fusion must be a bool"):
        ColumnParallelLinear(4, 4, gradient_accumulation_fusion="yes")
    with pytest.raises(TypeError, match="gradient_accumulation_fusion must be a bool"):
        RowParallelLinear(4, 4, gradient_accumulation_fusion=1)
    return True


def test_bad_main_grad_raises_naming_the_argument():
    run_ranks(_check_bad_main_grad, 1)


# --- The fused ops on the harness device (NCCL and the comm stream on CUDA) ----------------------


def _check_fused_ops(rank, p):
    """Outputs against oases.ops.reference (torch's collectives), input gradients against their
    closed forms, for every op, chunked and bidirectional, on harness_device() tensors."""
    device = DEVICE
    n, k, o = 8, 12, 6
    w = _randn((o, k), seed=1, device=device)
    b = _randn((o,), seed=2, device=device)
    for chunks, bidirectional in ((1, False), (2, True)):
        kw = dict(chunks=chunks)
        # all_gather_linear: every rank's grad_y is g, so grad_x = p * (g @ W)[this rank's rows].
        x = _randn((n, k), seed=10 + rank, device=device).requires_grad_()
        g = _randn((p * n, o), seed=3, device=device)
        y = ops.all_gather_linear(x, w, b, bidirectional=bidirectional, **kw)
        torch.testing.assert_close(y, ops.reference.all_gather_linear(x.detach(), w, b), rtol=1e-5, atol=1e-5)
        y.backward(g)
        torch.testing.assert_close(x.grad, p * (g @ w)[rank * n : (rank + 1) * n], rtol=1e-5, atol=1e-5)
        # linear_reduce_scatter: grad_x = all_gather(grad_y) @ W.
        x = _randn((p * n, k), seed=20 + rank, device=device).requires_grad_()
        g_full = _randn((p * n, o), seed=4, device=device)
        y = ops.linear_reduce_scatter(x, w, b, bidirectional=bidirectional, **kw)
        torch.testing.assert_close(y, ops.reference.linear_reduce_scatter(x.detach(), w, b), rtol=1e-5, atol=1e-5)
        y.backward(g_full.chunk(p)[rank])
        torch.testing.assert_close(x.grad, g_full @ w, rtol=1e-5, atol=1e-5)
        # linear_all_reduce: grad_x = grad_y @ W, no communication.
        x = _randn((2 * n, k), seed=30 + rank, device=device).requires_grad_()
        y = ops.linear_all_reduce(x, w, b, **kw)
        torch.testing.assert_close(y, ops.reference.linear_all_reduce(x.detach(), w, b), rtol=1e-5, atol=1e-5)
        y.backward(g[: 2 * n])
        torch.testing.assert_close(x.grad, g[: 2 * n] @ w, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_ops_on_the_harness_device(world_size):
    assert run_ranks(_check_fused_ops, world_size, timeout=120) == [True] * world_size


# --- CUDA only -----------------------------------------------------------------------------------


def _check_cuda_collectives(rank, p):
    import oases.comm as oc

    for chunks, bidirectional in ((1, False), (2, True)):
        inputs = [_randn((8, 6), seed=r + chunks, device="cuda") for r in range(p)]
        assert torch.equal(
            oc.ring_all_gather(inputs[rank], chunks=chunks, bidirectional=bidirectional), torch.cat(inputs)
        )
        full = [t.repeat(p, 1) for t in inputs]
        want = sum(full).chunk(p)[rank]
        got = oc.ring_reduce_scatter(full[rank], chunks=chunks, bidirectional=bidirectional)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return True


@on_cuda
def test_cuda_ring_collectives_match_torch():
    assert run_ranks(_check_cuda_collectives, 2) == [True, True]


@on_cuda
def test_cuda_batched_copy_matches_torch_copies():
    from oases import _extension

    _C = _extension.compiled()
    if not _C.build_info()["cuda"]:
        pytest.skip("oases._C was built without CUDA (make cuda-build builds it with CUDA)")
    tensors = [torch.randn(n, device="cuda") for n in (0, 1, 7, 1000)]
    tensors.append(torch.randn(3, 5, device="cuda").to(torch.bfloat16))
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel() * t.element_size() + 13  # unaligned gaps
    slab = torch.zeros(total, dtype=torch.uint8, device="cuda")
    _C.pack(tensors, slab, offsets)
    for t, offset in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        assert torch.equal(slab[offset : offset + nbytes], t.reshape(-1).view(torch.uint8))
    copies = [torch.empty_like(t) for t in tensors]
    _C.unpack(slab, copies, offsets)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(copies, tensors))
