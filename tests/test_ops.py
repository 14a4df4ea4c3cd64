"""Fused ops against a single-process torch model: forward and every gradient, on real gloo ranks.

Each rank builds the whole (unsharded) problem from a shared seed, runs it with plain F.linear
and autograd, then runs the fused op on its shards and compares its outputs and gradients with
the matching slices of the single-process ones.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import oases.comm
import oases.comm.ring as ring_module
from oases import ops

from _spawn import rank_device, run_ranks

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=4e-2, atol=8e-2)}


def _randn(shape, seed, dtype, contiguous=True):
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(shape, generator=g).to(rank_device(), dtype)
    # Same values, stored transposed: a non-contiguous view.
    return (
        torch.randn(list(reversed(shape)), generator=g).to(rank_device(), dtype).permute(*reversed(range(len(shape))))
    )


def _golden(x, w, b, g):
    """Single-process reference: outputs and the gradients of sum(y * g)."""
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = F.linear(x, w, b)
    (y * g).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _block(t, dim, rank, p):
    return t.chunk(p, dim=dim)[rank]


def _check_case(op, rank, p, dim, chunks, dtype, contiguous, bidirectional, seed):
    k, o, other = 4 * p, 4 * p, 3
    n = 2 * chunks  # rows per rank along the sharded dimension
    shape = [p * n, other, k] if dim == 0 else [other, p * n, k]
    x = _randn(shape, seed, dtype, contiguous)
    w = _randn([o, k], seed + 1, dtype)
    b = _randn([o], seed + 2, dtype)
    g = _randn(shape[:-1] + [o], seed + 3, dtype)
    y_ref, gx_ref, gw_ref, gb_ref = _golden(x, w, b, g)
    tol = TOL[dtype]
    kw = dict(chunks=chunks, bidirectional=bidirectional)
    if op == "all_gather_linear":  # column parallel: x sharded on dim, W and b on out features
        xs, ws, bs = _leaf(_block(x, dim, rank, p)), _leaf(_block(w, 0, rank, p)), _leaf(_block(b, 0, rank, p))
        y = ops.all_gather_linear(xs, ws, bs, dim=dim, **kw)
        (y * _block(g, -1, rank, p)).sum().backward()
        want = [
            (y, _block(y_ref, -1, rank, p)),
            (xs.grad, _block(gx_ref, dim, rank, p)),
            (ws.grad, _block(gw_ref, 0, rank, p)),
            (bs.grad, _block(gb_ref, 0, rank, p)),
        ]
    elif op == "linear_reduce_scatter":  # row parallel + SP: x, W sharded on in features
        xs, ws, bs = _leaf(_block(x, -1, rank, p)), _leaf(_block(w, 1, rank, p)), _leaf(b)
        y = ops.linear_reduce_scatter(xs, ws, bs, dim=dim, **kw)
        (y * _block(g, dim, rank, p)).sum().backward()
        gb = bs.grad.clone()
        dist.all_reduce(gb)  # the bias is shared: its gradient is the sum of the ranks' parts
        want = [
            (y, _block(y_ref, dim, rank, p)),
            (xs.grad, _block(gx_ref, -1, rank, p)),
            (ws.grad, _block(gw_ref, 1, rank, p)),
            (gb, gb_ref),
        ]
    else:  # row parallel: x, W sharded on in features, y replicated
        xs, ws, bs = _leaf(_block(x, -1, rank, p)), _leaf(_block(w, 1, rank, p)), _leaf(b)
        y = ops.linear_all_reduce(xs, ws, bs, chunks=chunks)
        (y * g).sum().backward()
        want = [
            (y, y_ref),
            (xs.grad, _block(gx_ref, -1, rank, p)),
            (ws.grad, _block(gw_ref, 1, rank, p)),
            (bs.grad, gb_ref),
        ]
    for name, (got, ref) in zip(["y", "grad_x", "grad_w", "grad_b"], want):
        assert got.dtype == dtype, (op, name, got.dtype)
        torch.testing.assert_close(
            got,
            ref,
            **tol,
            msg=lambda m: (
                f"{op} {name} dim={dim} chunks={chunks} "
                f"{dtype} contiguous={contiguous} bidirectional={bidirectional}: {m}"
            ),
        )


def _check_against_single_process(rank, p):
    cases = 0
    # Chunk counts: one piece, an even and an odd count, and 2p pieces (more than ranks). The
    # rings loop over pieces with no case of their own for any other count.
    combos = itertools.product(
        ["all_gather_linear", "linear_reduce_scatter", "linear_all_reduce"],
        sorted({1, 2, 3, 2 * p}),
        [0, 1],
        [torch.float32, torch.bfloat16],
        [True, False],
        [False, True],
    )
    for i, (op, chunks, dim, dtype, contiguous, bidirectional) in enumerate(combos):
        if dtype == torch.bfloat16 and (not contiguous or bidirectional):
            continue  # bf16 only needs to show the tolerance holds; layouts are covered in fp32
        if op == "linear_all_reduce" and bidirectional:
            continue  # no ring lanes: it uses the backend's all-reduce
        _check_case(op, rank, p, dim, chunks, dtype, contiguous, bidirectional, seed=i)
        cases += 1
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fused_ops_match_single_process(world_size):
    counts = run_ranks(_check_against_single_process, world_size, timeout=120)
    assert counts[0] > 0 and len(set(counts)) == 1


def _check_chunking_is_bitwise(rank, p):
    n, other, k, o = 8, 3, 24, 16
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn([n, other, k], 100 + rank, dtype)
        w = _randn([o, k], 7, dtype)
        b = _randn([o], 8, dtype)
        outs = [
            ops.all_gather_linear(x, w, b, chunks=c, bidirectional=bi) for c in (1, 2, 4, 8) for bi in (False, True)
        ]
        for y in outs[1:]:
            assert torch.equal(y, outs[0]), dtype
    return True


def test_all_gather_linear_chunking_is_bitwise():
    run_ranks(_check_chunking_is_bitwise, 2)


def _check_traffic(rank, p):
    """Each rank sends (p-1)/p of the gathered or scattered tensor: no more."""
    sent = []
    original = ring_module._post

    def counting_post(ring, direction, send, recv, *tag):
        sent.append(send.numel())
        return original(ring, direction, send, recv, *tag)

    ring_module._post = counting_post
    try:
        x = torch.randn(4 * p, 6, device=rank_device())
        ops.all_gather_linear(x, torch.randn(5, 6, device=rank_device()), chunks=2)
        assert sum(sent) == (p - 1) * x.numel(), sent  # (p-1)/p of the p*4 x 6 gathered input
        # Backward: the re-gather of x (only if W needs a gradient) and the reduce-scatter of grad_x
        # (only if x needs one), each (p-1)/p of a p*4 x 6 tensor.
        for need_x, need_w in ((True, True), (True, False), (False, True)):
            y = ops.all_gather_linear(
                x.clone().requires_grad_(need_x),
                torch.randn(5, 6, device=rank_device(), requires_grad=need_w),
                chunks=2,
            )
            sent.clear()
            y.backward(torch.ones_like(y))
            assert sum(sent) == (need_x + need_w) * (p - 1) * x.numel(), (need_x, need_w, sent)
        sent.clear()
        y = ops.linear_reduce_scatter(
            torch.randn(4 * p, 6, device=rank_device()), torch.randn(5, 6, device=rank_device()), chunks=2
        )
        assert sum(sent) == (p - 1) * y.numel(), sent  # (p-1)/p of the p*4 x 5 partial product
    finally:
        ring_module._post = original
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_traffic_is_p_minus_one_over_p(world_size):
    run_ranks(_check_traffic, world_size)


def _check_saves_only_the_shard(rank, p):
    """The autograd node keeps x's shard and W for backward, never the p times larger gathered x."""
    for dim, need_x in ((0, True), (1, True), (0, False)):
        shape = [4, 3, 8] if dim == 0 else [3, 4, 8]  # 4 rows of the sharded dimension per rank
        x = _randn(shape, 70 + rank, torch.float32).requires_grad_(need_x)
        w = _randn([5, 8], 71, torch.float32, contiguous=False).requires_grad_()
        saved = []

        def pack(t):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = ops.all_gather_linear(x, w, chunks=2, dim=dim)
        assert y.shape[dim] == p * 4
        assert x.numel() in saved and max(saved) <= max(x.numel(), w.numel()), (dim, saved)
        y.sum().backward()  # and backward still works from the shard
        assert w.grad is not None and (x.grad is not None) == need_x
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_backward_saves_only_the_local_shard(world_size):
    run_ranks(_check_saves_only_the_shard, world_size)


def _check_partial_requires_grad(rank, p):
    """With W or x frozen, the remaining gradients still match the single-process model."""
    cases = 0
    for i, (dim, chunks, bidirectional, frozen) in enumerate(
        itertools.product([0, 1], [1, 2], [False, True], ["weight", "x"])
    ):
        k, o, other, n = 4 * p, 4 * p, 3, 2 * chunks
        shape = [p * n, other, k] if dim == 0 else [other, p * n, k]
        x, w = _randn(shape, 400 + i, torch.float32), _randn([o, k], 500 + i, torch.float32)
        b, g = _randn([o], 600 + i, torch.float32), _randn(shape[:-1] + [o], 700 + i, torch.float32)
        y_ref, gx_ref, gw_ref, gb_ref = _golden(x, w, b, g)
        xs, ws, bs = _leaf(_block(x, dim, rank, p)), _leaf(_block(w, 0, rank, p)), _leaf(_block(b, 0, rank, p))
        (ws if frozen == "weight" else xs).requires_grad_(False)
        y = ops.all_gather_linear(xs, ws, bs, dim=dim, chunks=chunks, bidirectional=bidirectional)
        (y * _block(g, -1, rank, p)).sum().backward()
        tol = TOL[torch.float32]
        torch.testing.assert_close(y, _block(y_ref, -1, rank, p), **tol)
        torch.testing.assert_close(bs.grad, _block(gb_ref, 0, rank, p), **tol)
        if frozen == "weight":
            assert ws.grad is None
            torch.testing.assert_close(xs.grad, _block(gx_ref, dim, rank, p), **tol)
        else:
            assert xs.grad is None
            torch.testing.assert_close(ws.grad, _block(gw_ref, 0, rank, p), **tol)
        cases += 1
    return cases


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_linear_gradients_with_frozen_inputs(world_size):
    assert run_ranks(_check_partial_requires_grad, world_size, timeout=120) == [16] * world_size


def _check_subgroup(rank, p):
    """Ops on a subgroup of ranks {0, 2} and {1, 3} match the same op on their own data."""
    groups = [oases.comm.new_group([0, 2]), oases.comm.new_group([1, 3])]
    group = groups[rank % 2]
    member = rank // 2
    x = _randn([4, 2, 6], 50 + rank % 2, torch.float32)
    w = _randn([6, 6], 60, torch.float32)
    got = ops.all_gather_linear(x.chunk(2)[member], w, group=group, chunks=2)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    got = ops.linear_all_reduce(
        x[..., :3] if member == 0 else x[..., 3:], w[:, :3] if member == 0 else w[:, 3:], group=group
    )
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    return True


def test_ops_in_subgroups():
    run_ranks(_check_subgroup, 4)


BAD_INPUTS = [
    ("all_gather_linear", dict(x=(5, 4), w=(3, 4), chunks=2), ValueError, "not divisible by chunks"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 5)), ValueError, "in_features"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 4), dim=1), ValueError, "non-feature"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 4), chunks=0), ValueError, "chunks"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 4), chunks=1.5), TypeError, "chunks"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 4), wdtype=torch.float64), TypeError, "weight: dtype"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 4), xdtype=torch.int64), TypeError, "x: expected a floating"),
    ("all_gather_linear", dict(x=(4, 4), w=(3, 4), bias=(4,)), ValueError, "bias"),
    ("linear_reduce_scatter", dict(x=(3, 4), w=(3, 4)), ValueError, "world size"),
    ("linear_reduce_scatter", dict(x=(4, 4), w=(3, 4), chunks=3), ValueError, "chunks=3"),
    ("linear_all_reduce", dict(x=(4, 4), w=(3, 2)), ValueError, "in_features"),
    ("linear_all_reduce", dict(x=(4, 4), w=(3, 4), device="meta"), ValueError, "move one"),
]


def _check_bad_inputs(rank, p):
    started = []
    post, all_reduce = ring_module._post, dist.all_reduce
    ring_module._post = lambda *args: started.append("p2p") or post(*args)
    dist.all_reduce = lambda *args, **kw: started.append("all_reduce") or all_reduce(*args, **kw)
    try:
        for op, spec, error, words in BAD_INPUTS:
            x = torch.ones(spec["x"], dtype=spec.get("xdtype", torch.float32), device=rank_device())
            w = torch.ones(spec["w"], dtype=spec.get("wdtype", torch.float32), device=spec.get("device", rank_device()))
            bias = torch.ones(spec["bias"], device=rank_device()) if "bias" in spec else None
            kw = {k: spec[k] for k in ("dim", "chunks") if k in spec}
            with pytest.raises(error, match=words):
                getattr(ops, op)(x, w, bias, **kw)
            assert not started, (op, spec, started)  # raised before any communication
    finally:
        ring_module._post, dist.all_reduce = post, all_reduce
    dist.barrier()  # reached by every rank: none was left inside a collective
    return True


def test_bad_inputs_raise_on_every_rank_before_communicating():
    run_ranks(_check_bad_inputs, 2)
