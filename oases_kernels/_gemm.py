"""The one GEMM kernel behind oases_kernels, its launcher and the shared argument checks.

    out = x @ weight.T (+ bias) (+ acc)      x (M, K), weight (N, K), bias (N,), acc/out (M, N)

Every operand is read through its own strides, so transposed and sliced views need no copy, and
`out` may be a row slice of a larger buffer: the tiles are stored straight into it. Accumulation
is fp32; bias and acc are added in fp32 in the epilogue; the result is cast to out's dtype.

How a launch is made depends on where Triton runs (`launch_plan`):

    on a GPU                  tl.dot in the input dtype (fp16/bf16 tensor cores; fp32 as torch's
                              matmul precision says), fp32 accumulator; autotuned over GPU_TILES
                              (the first call per (M, N, K) times them, later calls reuse the pick)
    TRITON_INTERPRET=1 (CPU)  operands upcast to fp32 before tl.dot (the interpreter's bf16 dot is
                              wrong; exact for fp16/bf16) and one config, INTERPRETER_TILES
                              (multi-config autotuning needs a driver to time candidates)
"""

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Tiles:
    """One launch config: tile sizes, grouped ordering, warps and software-pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def config(self) -> "triton.Config":
        return triton.Config(
            {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "GROUP_M": self.group_m},
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


INTERPRETER_TILES = Tiles()
DEFAULT_TILES = INTERPRETER_TILES  # the name older callers use

# Candidates for sm_80 / sm_90 (the shapes of the Triton matmul tutorial's list), small enough
# that the first call's tuning stays short: large square tiles for big pieces, narrow ones for
# the thin pieces a ring cuts a shard into.
GPU_TILES: tuple[Tiles, ...] = (
    Tiles(128, 256, 64, 8, num_warps=8, num_stages=3),
    Tiles(128, 128, 32, 8, num_warps=4, num_stages=4),
    Tiles(128, 64, 32, 8, num_warps=4, num_stages=4),
    Tiles(64, 128, 32, 8, num_warps=4, num_stages=4),
    Tiles(64, 64, 64, 8, num_warps=4, num_stages=3),
    Tiles(32, 64, 32, 8, num_warps=2, num_stages=5),
)


@dataclass(frozen=True)
class LaunchPlan:
    """How to launch: upcast before tl.dot or not, and the configs (one: as is; several: autotune)."""

    upcast: bool
    tiles: tuple[Tiles, ...]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off")


def launch_plan(interpret: bool) -> LaunchPlan:
    """The interpreter-safe plan under TRITON_INTERPRET=1, the GPU plan otherwise (see the module doc)."""
    if interpret:
        return LaunchPlan(upcast=True, tiles=(INTERPRETER_TILES,))
    return LaunchPlan(upcast=False, tiles=GPU_TILES)


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    bias_ptr,
    acc_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_am,
    stride_an,
    stride_b,
    HAS_BIAS: tl.constexpr,
    HAS_ACC: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped ordering: GROUP_M consecutive row tiles sweep the column tiles together, so the
    # weight tiles they share stay in L2. The last group may hold fewer than GROUP_M row tiles.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % rows_in_group
    pid_n = (pid % pids_per_group) // rows_in_group

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,) rows of x and out
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,) rows of weight
    rk = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rk[:, None] * stride_wk + rn[None, :] * stride_wn  # (BLOCK_K, BLOCK_N) of weight.T

    result = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong; exact for fp16/bf16
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        result = tl.dot(a, b, result, input_precision=INPUT_PRECISION)  # fp32 accumulator
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_BIAS:
        result += tl.load(bias_ptr + rn * stride_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_ACC:
        acc_ptrs = acc_ptr + rm[:, None] * stride_am + rn[None, :] * stride_an
        result += tl.load(acc_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask)


# The autotuned launcher for GPUs. `out` is restored after each timed candidate: with acc = out
# (an in-place accumulate) the timing runs would otherwise add the product several times.
_gemm_kernel_tuned = triton.autotune(
    configs=[t.config() for t in GPU_TILES],
    key=["M", "N", "K"],
    restore_value=["out_ptr"],
)(_gemm_kernel)


def _input_precision(dtype: torch.dtype) -> str:
    # fp16/bf16 upcast to fp32 fit tf32's 10-bit mantissa exactly (and a 16-bit dot ignores the
    # setting); fp32 follows torch's setting.
    if dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def launch_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    acc: Optional[torch.Tensor] = None,
    tiles: Optional[Tiles] = None,
    plan: Optional[LaunchPlan] = None,
) -> None:
    """out[:M, :N] = x @ weight.T (+ bias) (+ acc); the caller has checked every argument.

    plan: default launch_plan(interpreting()). tiles: launch with exactly this config (no
    autotuning), keeping the plan's upcast choice.
    """
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return
    plan = plan if plan is not None else launch_plan(interpreting())
    if tiles is not None:
        plan = LaunchPlan(plan.upcast, (tiles,))
    acc_strides = acc.stride() if acc is not None else (0, 0)
    args = (
        x,
        weight,
        out,
        bias if bias is not None else out,  # placeholders are never read: HAS_* is False
        acc if acc is not None else out,
        M,
        N,
        K,
        *x.stride(),
        *weight.stride(),
        *out.stride(),
        *acc_strides,
        bias.stride(0) if bias is not None else 0,
    )
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_ACC=acc is not None,
        INPUT_PRECISION=_input_precision(x.dtype),
        UPCAST=plan.upcast,
    )
    if len(plan.tiles) == 1:
        t = plan.tiles[0]
        grid = (triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n),)
        _gemm_kernel[grid](
            *args,
            **flags,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=t.block_k,
            GROUP_M=t.group_m,
            num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
    else:

        def grid(meta):
            return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

        _gemm_kernel_tuned[grid](*args, **flags)


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int]:
    """Check x (M, K) and weight (N, K) and return (M, N, K)."""
    if x.dim() != 2:
        raise ValueError(
            f"x: expected a 2-D (M, K) tensor, got shape {tuple(x.shape)}; "
            "flatten leading dimensions with x.reshape(-1, x.shape[-1])"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D (N, K) tensor in nn.Linear layout, got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight: in_features {weight.shape[1]} does not match x's last "
            f"dimension {x.shape[1]}; weight must be (out_features, in_features)"
        )
    if x.dtype not in DTYPES:
        raise TypeError(f"x: dtype {x.dtype} is not supported; use one of {_names(DTYPES)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} does not match x's {x.dtype}; cast with weight.to(x.dtype)")
    check_dtype_device("weight", weight, [x.dtype], x.device)
    return x.shape[0], weight.shape[0], x.shape[1]


def x_or_fp32(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """Dtypes allowed for bias and acc: x's own, or fp32 (kept for accurate accumulation)."""
    return (dtype,) if dtype == torch.float32 else (dtype, torch.float32)


def check_dtype_device(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype], device: torch.device) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not allowed here; use one of {_names(dtypes)}")
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device} but x is on {device}; move it with .to(x.device)")


def check_writable(name: str, t: torch.Tensor) -> None:
    """Refuse expanded views: several output elements sharing one address would race."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name}: is an expanded view (a stride is 0); pass a real buffer, e.g. .clone() it first")
