"""oases.nn layers against the unsharded nn.Linear model, on real gloo ranks.

Each rank builds the whole model from a shared seed, runs it in one process with autograd, then
shards it (from_linear) and checks the output, the input gradient and every parameter gradient
against the matching slices of the unsharded ones. Slices are taken here, independently of the
layers' own `shard`.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oases.comm.ring as ring_module
from oases.nn import ColumnParallelLinear, RowParallelLinear
from oases.nn.mappings import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp

from _spawn import rank_device, run_ranks

TOL = dict(rtol=2e-5, atol=2e-5)
S, B, H, FFN = 24, 2, 24, 48  # seq, batch, hidden, MLP width: divisible by 2, 3, 4 (and S/p by 2)


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(rank_device())


def _rows(t, rank, p, stacked=1):
    """Rank's rows of a column-parallel weight/bias: its slice of each stacked block."""
    return torch.cat([block.chunk(p, 0)[rank] for block in t.chunk(stacked, 0)])


def _cols(t, rank, p):
    return t.chunk(p, -1)[rank]


def _forward(blocks, x):
    """Two residual MLP blocks: x + l2(gelu(l1(x))), twice."""
    for l1, l2 in blocks:
        x = x + l2(F.gelu(l1(x)))
    return x


def _check_mlp(rank, p, sequence_parallel, bias, gathered, chunks, seed):
    torch.manual_seed(seed)
    ref = [(nn.Linear(H, FFN, bias).to(rank_device()), nn.Linear(FFN, H, bias).to(rank_device())) for _ in range(2)]
    tp = [
        (
            ColumnParallelLinear.from_linear(
                l1, gather_output=gathered, sequence_parallel=sequence_parallel, chunks=chunks
            ),
            RowParallelLinear.from_linear(
                l2, input_is_parallel=not gathered, sequence_parallel=sequence_parallel, chunks=chunks
            ),
        )
        for l1, l2 in ref
    ]
    x, g = _randn([S, B, H], seed + 1), _randn([S, B, H], seed + 2)
    x_ref = x.clone().requires_grad_()
    y_ref = _forward(ref, x_ref)
    (y_ref * g).sum().backward()

    local = (lambda t: t.chunk(p, 0)[rank]) if sequence_parallel else (lambda t: t)
    x_tp = local(x).clone().requires_grad_()
    y_tp = _forward(tp, x_tp)
    (y_tp * local(g)).sum().backward()

    def where(name):
        return f"{name}: p={p} sequence_parallel={sequence_parallel} bias={bias} gathered={gathered} chunks={chunks}"

    torch.testing.assert_close(y_tp, local(y_ref), **TOL, msg=lambda m: f"{where('y')}: {m}")
    torch.testing.assert_close(x_tp.grad, local(x_ref.grad), **TOL, msg=lambda m: f"{where('grad_x')}: {m}")
    for i, ((l1, l2), (c, r)) in enumerate(zip(ref, tp)):
        pairs = [
            ("col.weight", c.weight.grad, _rows(l1.weight.grad, rank, p)),
            ("row.weight", r.weight.grad, _cols(l2.weight.grad, rank, p)),
        ]
        if bias:
            pairs += [
                ("col.bias", c.bias.grad, _rows(l1.bias.grad, rank, p)),
                ("row.bias", r.bias.grad, l2.bias.grad),
            ]  # replicated: the full gradient
        else:
            assert c.bias is None and r.bias is None
        for name, got, want in pairs:
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{where(f'block {i} {name}')}: {m}")


def _check_stacked(rank, p):
    """A fused q|k|v column layer: each third sharded; gather_output restores the full order."""
    torch.manual_seed(5)
    full = nn.Linear(H, 3 * H).to(rank_device())
    x, g = _randn([B, 3, H], 6), _randn([B, 3, 3 * H], 7)
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    (y_ref * g).sum().backward()
    for gathered in (False, True):
        layer = ColumnParallelLinear.from_linear(full, stacked=3, gather_output=gathered)
        x_tp = x.clone().requires_grad_()
        y = layer(x_tp)
        want = y_ref if gathered else torch.cat([t.chunk(p, -1)[rank] for t in y_ref.chunk(3, -1)], -1)
        torch.testing.assert_close(y, want, **TOL)
        (y * (g if gathered else torch.cat([t.chunk(p, -1)[rank] for t in g.chunk(3, -1)], -1))).sum().backward()
        torch.testing.assert_close(x_tp.grad, x_ref.grad, **TOL)
        torch.testing.assert_close(layer.weight.grad, _rows(full.weight.grad, rank, p, 3), **TOL)
        torch.testing.assert_close(layer.bias.grad, _rows(full.bias.grad, rank, p, 3), **TOL)


def _gather(t, dim):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def _check_init_and_from_linear(rank, p):
    # Init: the same draws as nn.Linear(in, out), each rank keeping its shard.
    for bias in (True, False):
        torch.manual_seed(11)
        col, row, stacked = (
            ColumnParallelLinear(H, FFN, bias),
            RowParallelLinear(FFN, H, bias),
            ColumnParallelLinear(H, 3 * H, bias, stacked=3),
        )
        after = torch.rand(1)
        torch.manual_seed(11)
        l1, l2, l3 = nn.Linear(H, FFN, bias), nn.Linear(FFN, H, bias), nn.Linear(H, 3 * H, bias)
        assert torch.equal(after, torch.rand(1)), "the layers consume the RNG exactly as nn.Linear does"
        assert torch.equal(col.weight, _rows(l1.weight, rank, p))
        assert torch.equal(row.weight, _cols(l2.weight, rank, p))
        assert torch.equal(stacked.weight, _rows(l3.weight, rank, p, 3))
        if bias:
            assert torch.equal(col.bias, _rows(l1.bias, rank, p)) and torch.equal(row.bias, l2.bias)
            assert torch.equal(stacked.bias, _rows(l3.bias, rank, p, 3))
    # from_linear round trip: gathering the shards gives back the layer.
    for dtype in (torch.float32, torch.bfloat16):
        linear = nn.Linear(H, FFN, dtype=dtype).to(rank_device())
        col = ColumnParallelLinear.from_linear(linear)
        row = RowParallelLinear.from_linear(linear)
        assert col.weight.dtype == row.weight.dtype == dtype
        assert col.weight.shape == (FFN // p, H) and row.weight.shape == (FFN, H // p)
        assert torch.equal(_gather(col.weight.data, 0), linear.weight.data)
        assert torch.equal(_gather(col.bias.data, 0), linear.bias.data)
        assert torch.equal(_gather(row.weight.data, 1), linear.weight.data)
        assert torch.equal(row.bias.data, linear.bias.data)
    frozen = nn.Linear(H, H, bias=False).requires_grad_(False)
    assert not ColumnParallelLinear.from_linear(frozen).weight.requires_grad
    text = repr(ColumnParallelLinear(H, FFN, stacked=2, gather_output=True))
    assert f"in_features={H}, out_features={FFN}, bias=True, tp={p} (rank {rank}: out_features {FFN // p})" in text
    assert "stacked=2, gather_output=True" in text
    text = repr(RowParallelLinear(FFN, H, bias=False, sequence_parallel=True, chunks=2))
    assert f"tp={p} (rank {rank}: in_features {FFN // p}), input_is_parallel=True, sequence_parallel=True" in text


def _check_mappings(rank, p):
    """Values, and adjointness: <f(x), y> = <x, f*(y)>, a replicated side counted once, a sharded one summed."""

    def total(v):
        v = v.clone()
        dist.all_reduce(v)
        return v

    replicated, mine = _randn([3, 4 * p], 20), _randn([3, 4 * p], 30 + rank)
    cases = [  # (mapping, x, y, x is replicated, output is replicated, expected output)
        (copy_to_tp, replicated, mine, True, False, replicated),
        (reduce_from_tp, mine, replicated, False, True, total(mine)),
        (split_to_tp, replicated, mine[:, :4], True, False, replicated[:, 4 * rank : 4 * rank + 4]),
        (gather_from_tp, mine[:, :4], replicated, False, True, _gather(mine[:, :4], 1)),
    ]
    for f, x, y, x_replicated, out_replicated, expected in cases:
        x = x.clone().requires_grad_()
        out = f(x)
        torch.testing.assert_close(out, expected, **TOL)
        (out * y).sum().backward()
        lhs, rhs = (out * y).sum().detach(), (x * x.grad).sum().detach()
        lhs = lhs if out_replicated else total(lhs)
        rhs = rhs if x_replicated else total(rhs)
        torch.testing.assert_close(lhs, rhs, **TOL, msg=lambda m: f"{f.__name__}: {m}")


def _check_traffic(rank, p):
    """Messages per pass: only the expected collectives run (elements sent by this rank by ring
    steps, and elements all-reduced by the backend's all-reduce)."""
    sent, reduced = [], []
    post, backend_all_reduce = ring_module._post, dist.all_reduce

    def counting_post(ring, direction, send, recv, *tag):
        sent.append(send.numel())
        return post(ring, direction, send, recv, *tag)

    def counting_all_reduce(t, *args, **kwargs):
        reduced.append(t.numel())
        return backend_all_reduce(t, *args, **kwargs)

    ring_module._post, dist.all_reduce = counting_post, counting_all_reduce
    try:
        act = S * B * H  # one activation
        for sequence_parallel in (False, True):
            torch.manual_seed(3)
            col = ColumnParallelLinear(H, FFN, sequence_parallel=sequence_parallel).to(rank_device())
            row = RowParallelLinear(FFN, H, sequence_parallel=sequence_parallel).to(rank_device())
            x = _randn([S // p if sequence_parallel else S, B, H], 4).requires_grad_()
            sent.clear(), reduced.clear()
            y = row(F.gelu(col(x)))
            if sequence_parallel:  # all-gather + reduce-scatter, (p-1)/p each
                assert (sum(sent), sum(reduced)) == (2 * (p - 1) * act // p, 0)
            else:  # one all-reduce of the activation
                assert (sum(sent), sum(reduced)) == (0, act)
            sent.clear(), reduced.clear()
            y.sum().backward()
            # no SP: grad_x all-reduced by ring; SP: grad all-gather + reduce-scatter, plus the bias all-reduce
            extra = 2 * (p - 1) * H // p if sequence_parallel else 0
            regather = (p - 1) * act // p if sequence_parallel else 0  # all_gather_linear re-gathers its input
            assert (sum(sent), sum(reduced)) == (2 * (p - 1) * act // p + regather + extra, 0), sequence_parallel
    finally:
        ring_module._post, dist.all_reduce = post, backend_all_reduce


BAD_LAYERS = [  # (layer, args(p), kwargs, error, message pattern)
    (
        ColumnParallelLinear,
        lambda p: (H, 2 * p + 1),
        {},
        ValueError,
        r"out_features=\d+ is not divisible by the tensor-parallel world size",
    ),
    (RowParallelLinear, lambda p: (2 * p + 1, H), {}, ValueError, r"in_features=\d+ is not divisible .* multiple of"),
    (ColumnParallelLinear, lambda p: (H, 3 * (2 * p + 1)), dict(stacked=3), ValueError, r"3 blocks of"),
    (ColumnParallelLinear, lambda p: (H, 6), dict(stacked=4), ValueError, r"stacked=4 equal blocks"),
    (ColumnParallelLinear, lambda p: (H, H), dict(chunks=0), ValueError, r"chunks"),
    (RowParallelLinear, lambda p: (H, H), dict(chunks=1.5), TypeError, r"chunks"),
]


def _check_bad_shapes(rank, p):
    for cls, args, kw, error, words in BAD_LAYERS:
        with pytest.raises(error, match=words):
            cls(*args(p), **kw)
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        ColumnParallelLinear.from_linear(nn.Conv1d(2, 2, 1))
    row = RowParallelLinear(H, H, sequence_parallel=True).to(rank_device())
    with pytest.raises(ValueError, match="world size"):
        row(torch.randn(p + 1, B, H // p, device=rank_device()))  # sequence length not divisible by p
    col = ColumnParallelLinear(H, H, sequence_parallel=True, chunks=2).to(rank_device())
    with pytest.raises(ValueError, match="chunks=2"):
        col(torch.randn(3, B, H, device=rank_device()))  # 3 rows per rank in 2 chunks
    with pytest.raises(ValueError, match="split_to_tp"):
        RowParallelLinear(H, H, input_is_parallel=False).to(rank_device())(torch.randn(B, H + 1, device=rank_device()))
    dist.barrier()  # reached by every rank: none was left inside a collective


def _check_layers(rank, p):
    cases = 0
    for i, (sp, bias, gathered, chunks) in enumerate(
        itertools.product([False, True], [True, False], [False, True], [None, 1, 2])
    ):
        _check_mlp(rank, p, sp, bias, gathered, chunks, seed=100 + 10 * i)
        cases += 1
    _check_stacked(rank, p)
    _check_init_and_from_linear(rank, p)
    _check_mappings(rank, p)
    _check_traffic(rank, p)
    _check_in_place(rank, p)
    _check_shared_entry(rank, p)
    _check_bad_shapes(rank, p)
    return cases


def _check_shared_entry(rank, p):
    """Column layers sharing one input entry (as parallelize builds them) stay correct when the
    input changes grad mode, and run under inference mode."""
    from oases.nn._shared_entry import _SharedEntry

    torch.manual_seed(5)
    q, k = ColumnParallelLinear(H, FFN).to(rank_device()), ColumnParallelLinear(H, FFN).to(rank_device())
    entry = _SharedEntry(None)
    q.use_entry(entry)
    k.use_entry(entry)
    x = _randn([S, B, H], 6)
    with torch.inference_mode():
        q(x), k(x)
    q(x)  # no gradient wanted: entered without a graph
    x.requires_grad_()
    (q(x).sum() + k(x).sum()).backward()
    want = torch.zeros_like(x)
    for layer in (q, k):
        want += layer.weight.sum(0)  # d/dx sum(x W^T + b) = column sums of W, summed over ranks
    dist.all_reduce(want)
    torch.testing.assert_close(x.grad, want, **TOL)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_layers_match_unsharded_model(world_size):
    counts = run_ranks(_check_layers, world_size, timeout=120)
    assert counts == [24] * world_size


def _check_in_place(rank, p):
    """Like nn.Linear's, a layer's output may be modified in place (HF Falcon adds to it with +=)."""
    x = _randn([S, B, H], 40).requires_grad_()
    layers = [
        (ColumnParallelLinear(H, FFN).to(rank_device()), x),
        (ColumnParallelLinear(H, FFN, sequence_parallel=True).to(rank_device()), x[: S // p]),
        (RowParallelLinear(H, FFN, sequence_parallel=True).to(rank_device()), x[..., : H // p]),
        (RowParallelLinear(H, FFN).to(rank_device()), x[..., : H // p]),
    ]
    for layer, inp in layers:
        y = layer(inp)
        y += 1
        y.sum().backward()
    return True
