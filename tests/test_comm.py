"""Ring collectives against torch.distributed's own, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist

import oases.comm as oc

from _spawn import rank_device, run_ranks


def _data(world_size, shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(rank_device()) for _ in range(world_size)]


def _check_collectives(rank, world_size):
    cases = 0
    for dim in (0, 1, -1):
        for chunks in (1, 2, 3):
            for bidirectional in (False, True):
                shape = [6, 12, 6]
                inputs = _data(world_size, shape, seed=chunks + 10 * dim)
                t = inputs[rank]
                got = oc.ring_all_gather(t, dim=dim, chunks=chunks, bidirectional=bidirectional)
                assert torch.equal(got, torch.cat(inputs, dim)), (dim, chunks, bidirectional)

                full = [a.repeat_interleave(world_size, dim=dim % 3) for a in inputs]
                want = sum(full).chunk(world_size, dim=dim % 3)[rank]
                got = oc.ring_reduce_scatter(full[rank], dim=dim, chunks=chunks, bidirectional=bidirectional)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

                odd = _data(world_size, [5, 7], seed=chunks)[rank]
                want = odd.clone()
                dist.all_reduce(want)
                assert oc.all_reduce(odd, chunks=chunks, bidirectional=bidirectional) is odd
                torch.testing.assert_close(odd, want, rtol=1e-6, atol=1e-6)
                cases += 1
    # Non-contiguous input and output of all_reduce stay in place.
    base = _data(world_size, [4, 6], seed=3)[rank]
    view = base.t()
    want = view.clone()
    dist.all_reduce(want)
    oc.all_reduce(view, chunks=2)
    torch.testing.assert_close(view, want, rtol=1e-6, atol=1e-6)
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_collectives_match_torch(world_size):
    assert run_ranks(_check_collectives, world_size) == [18] * world_size
