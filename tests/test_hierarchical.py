"""Hierarchical (inter-/intra-host) collectives against the flat rings and torch, on real gloo
ranks split into emulated hosts; and Centauri's collective-level choices (pure planner tests)."""

import math
import os

import pytest
import torch
import torch.distributed as dist

import oases.comm as oc
from oases.costs.link import LinkFit
from oases.planner import all_reduce_form, flat_time, hierarchical_time, partition

from _spawn import rank_device, run_ranks

FAST = LinkFit(30e-6, 1.7e9)  # a host's loopback
SLOW = LinkFit(30e-6, 25e6)  # 200 Mbit/s NICs
MIB = 2**20


def _inputs(world_size, shape, seed, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # every partial sum exact: any summation order gives the same bits
        return [torch.randint(-8, 8, shape, generator=g).float().to(rank_device()) for _ in range(world_size)]
    return [torch.randn(shape, generator=g).to(rank_device()) for _ in range(world_size)]


def _count(prof, name):
    return sum(1 for e in prof.events() if e.name == name)


def _check_hierarchical(rank, world_size, ranks_per_host):
    hosts = oc.HostGroups.create(ranks_per_host)
    assert (hosts.hosts, hosts.ranks_per_host) == (world_size // ranks_per_host, ranks_per_host)
    assert (hosts.host, hosts.local) == divmod(rank, ranks_per_host)
    p = world_size
    checked = 0
    for shape, dim in (([4, 3], 0), ([2, 4, 3], 1), ([3, 8], -1), ([8], 0)):
        for chunks in (1, 2):
            seed = 7 * len(shape) + chunks + dim
            shards = _inputs(p, shape, seed)
            got = oc.hierarchical_all_gather(shards[rank], hosts, dim=dim, chunks=chunks)
            assert torch.equal(got, oc.ring_all_gather(shards[rank], dim=dim, chunks=chunks)), (shape, dim)
            assert torch.equal(got, torch.cat(shards, dim)), (shape, dim)

            full_shape = list(shape)
            full_shape[dim] *= p
            exact = _inputs(p, full_shape, seed, integer=True)
            got = oc.hierarchical_reduce_scatter(exact[rank], hosts, dim=dim, chunks=chunks)
            assert torch.equal(got, oc.ring_reduce_scatter(exact[rank], dim=dim, chunks=chunks)), (shape, dim)
            assert torch.equal(got, sum(exact).chunk(p, dim)[rank]), (shape, dim)

            noisy = _inputs(p, full_shape, seed + 1)  # another summation order: equal to rounding
            got = oc.hierarchical_reduce_scatter(noisy[rank], hosts, dim=dim, chunks=chunks)
            flat = oc.ring_reduce_scatter(noisy[rank], dim=dim, chunks=chunks)
            torch.testing.assert_close(got, flat, rtol=1e-6, atol=1e-6)
            want = sum(x.double() for x in noisy).chunk(p, dim)[rank].float()
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            checked += 1

    # All-reduce: any shape, in place, non-contiguous too.
    for shape in ([5, 7], [16], [3, 4, 2]):
        t = _inputs(p, shape, 40 + len(shape))[rank]
        want = t.clone()
        dist.all_reduce(want)
        assert oc.hierarchical_all_reduce(t, hosts, chunks=2) is t
        torch.testing.assert_close(t, want, rtol=1e-6, atol=1e-6)
    view = _inputs(p, [4, 6], 3)[rank].t()
    want = view.clone()
    dist.all_reduce(want)
    oc.hierarchical_all_reduce(view, hosts)
    torch.testing.assert_close(view, want, rtol=1e-6, atol=1e-6)

    # Adjointness: <RS(x), y> summed over ranks = <x, AG(y)> summed over ranks.
    x, y = _inputs(p, [4 * p, 3], 50)[rank].double(), _inputs(p, [4, 3], 51)[rank].double()
    sums = torch.tensor(
        [
            (oc.hierarchical_reduce_scatter(x, hosts) * y).sum().item(),
            (x * oc.hierarchical_all_gather(y, hosts)).sum().item(),
        ],
        dtype=torch.float64,
        device=rank_device(),
    )
    dist.all_reduce(sums)
    assert math.isclose(sums[0].item(), sums[1].item(), rel_tol=1e-12)

    # Collective counts: two rings per hierarchical collective, one level each.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        oc.hierarchical_reduce_scatter(torch.ones(2 * p, 2, device=rank_device()), hosts)
        oc.hierarchical_all_gather(torch.ones(2, 2, device=rank_device()), hosts)
    assert _count(prof, "oases::ring_reduce_scatter") == 2 and _count(prof, "oases::ring_all_gather") == 2

    # Planned forms: hierarchical when the NIC is slow, flat on equal links; same result either way.
    links_slow, links_equal = oc.HostLinks(FAST, SLOW), oc.HostLinks(SLOW, SLOW)
    t = _inputs(p, [64 * p, 256], 60, integer=True)[rank]  # 64 KiB per rank
    want_form = "hierarchical" if hosts.hosts > 1 and ranks_per_host > 1 else "flat"
    assert oc.planned_form("reduce_scatter", t, hosts, links_slow) == want_form
    assert oc.planned_form("reduce_scatter", t, hosts, links_equal) == "flat"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = oc.planned_reduce_scatter(t, hosts, links_slow)
    assert _count(prof, f"oases::planned[reduce_scatter:{want_form}]") == 1
    assert torch.equal(got, oc.planned_reduce_scatter(t, hosts, links_equal))
    shard = t[:64]
    assert oc.planned_form("all_gather", shard, hosts, links_slow) == want_form
    assert torch.equal(oc.planned_all_gather(shard, hosts, links_slow), oc.ring_all_gather(shard))
    s = t.clone()
    torch.testing.assert_close(oc.planned_all_reduce(s, hosts, links_slow), oc.all_reduce(t.clone()))

    # from_env reads the launcher's layout (LOCAL_WORLD_SIZE ranks per host).
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_host)
    again = oc.HostGroups.from_env()
    assert (again.hosts, again.ranks_per_host, again.host, again.local) == (
        hosts.hosts,
        ranks_per_host,
        hosts.host,
        hosts.local,
    )
    return checked


def _check_bad_inputs(rank, world_size, ranks_per_host):
    """Each bad call raises on every rank before any message; a real collective after each one
    proves no rank was left inside a ring."""
    hosts = oc.HostGroups.create(ranks_per_host)
    p = world_size
    dev = rank_device()
    bad = [
        lambda: oc.hierarchical_reduce_scatter(torch.ones(ranks_per_host * 3, 2, device=dev), hosts),  # not by P
        lambda: oc.hierarchical_reduce_scatter(torch.ones(p * 3, 2, device=dev), hosts, chunks=2),  # chunks
        lambda: oc.hierarchical_reduce_scatter(torch.ones(p, 2, device=dev), hosts, dim=2),  # dim
        lambda: oc.hierarchical_all_gather(torch.ones(3, 2, device=dev), hosts, chunks=2),  # chunks
        lambda: oc.hierarchical_all_gather(torch.ones((), device=dev), hosts),  # 0-d
        lambda: oc.hierarchical_all_reduce(torch.ones(4, device=dev), hosts, chunks=0),  # chunks
        lambda: oc.HostGroups.create(3),  # uneven hosts
        lambda: oc.HostGroups.create(1, ranks=[0, 0]),  # ranks
    ]
    type_errors = [
        lambda: oc.hierarchical_all_gather(torch.ones(4, dtype=torch.int64, device=dev), hosts),  # dtype
        lambda: oc.hierarchical_reduce_scatter(torch.ones(p, device=dev), "hosts"),  # hosts
        lambda: oc.planned_reduce_scatter(torch.ones(p, 2, device=dev), hosts, links=None),  # links
    ]
    raised = 0
    for kind, calls in ((ValueError, bad), (TypeError, type_errors)):
        for call in calls:
            with pytest.raises(kind):
                call()
            raised += 1
            probe = torch.ones(1, device=dev)
            dist.all_reduce(probe)
            assert probe.item() == world_size
    # A sub-group: ranks 1 and 3 as 2 hosts of 1 (the others get None, but take part in creating it).
    sub = oc.HostGroups.create(1, ranks=[1, 3]) if world_size == 4 else None
    if sub is not None:
        t = torch.full((2, 2), float(rank), device=dev)
        assert torch.equal(oc.hierarchical_reduce_scatter(t, sub), torch.full((1, 2), 4.0, device=dev))
        assert torch.equal(oc.hierarchical_all_gather(t[:1], sub), torch.tensor([[1.0, 1.0], [3.0, 3.0]], device=dev))
    assert (sub is None) == (rank in (0, 2) or world_size != 4)
    return raised


@pytest.mark.parametrize("world_size,ranks_per_host", [(4, 2), (2, 2)])
def test_hierarchical_matches_flat(world_size, ranks_per_host):
    assert run_ranks(_check_hierarchical, world_size, ranks_per_host) == [8] * world_size


@pytest.mark.parametrize("world_size,ranks_per_host", [(4, 2)])
def test_bad_inputs_raise_on_every_rank(world_size, ranks_per_host):
    assert run_ranks(_check_bad_inputs, world_size, ranks_per_host) == [11] * world_size


# --- the planner's choices (pure functions) ---------------------------------------------------


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather", "all_reduce"])
def test_partition_hierarchical_when_nic_is_slow(kind):
    choice = partition(kind, 4 * MIB, 2, 2, FAST, SLOW)
    assert choice.choice == "hierarchical"
    assert choice.seconds["hierarchical"] < choice.seconds["flat"]
    # Many ranks per host: inter bytes (h-1)/h T against (P-1)/P T; the gain grows with k.
    assert partition(kind, 4 * MIB, 8, 2, FAST, SLOW).seconds["hierarchical"] < 0.7 * flat_time(
        kind, 4 * MIB, 8, 2, FAST, SLOW
    )


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather", "all_reduce"])
def test_partition_flat_on_one_host_or_equal_links(kind):
    assert partition(kind, 4 * MIB, 4, 1, FAST, SLOW).choice == "flat"  # one host
    assert partition(kind, 4 * MIB, 1, 4, FAST, SLOW).choice == "flat"  # one rank per host
    assert partition(kind, 4 * MIB, 2, 2, SLOW, SLOW).choice == "flat"  # equal links
    assert partition(kind, 4 * MIB, 2, 2, FAST, FAST).choice == "flat"
    assert partition(kind, 0, 2, 2, FAST, SLOW).seconds == {"flat": 0.0, "hierarchical": 0.0}


def test_model_formulas():
    t, a, b_in, b_out = 4e6, 1e-5, 1e9, 1e7
    m = t / 4
    flat = 3 * max(a + m / b_in, a + m / b_out)
    hier = (a + t / b_in) + (a + 2 * m / b_out)
    intra, inter = LinkFit(a, b_in), LinkFit(a, b_out)
    assert flat_time("reduce_scatter", t, 2, 2, intra, inter) == pytest.approx(flat)
    assert hierarchical_time("all_gather", t, 2, 2, intra, inter) == pytest.approx(hier)
    assert hierarchical_time("all_reduce", t, 2, 2, intra, inter) == pytest.approx(2 * hier)
    # One host: the ring of k ranks on one shared link.
    assert flat_time("all_gather", t, 4, 1, intra, inter) == pytest.approx(3 * (a + t / b_in))


def test_all_reduce_form_extremes():
    # Enough compute on both sides hides both halves: substitute.
    both = all_reduce_form(all_reduce_s=1.0, reduce_scatter_s=0.5, all_gather_s=0.5, before_s=2.0, after_s=2.0)
    assert both.choice == "rs_ag" and both.seconds == {"all_reduce": 1.0, "rs_ag": 0.0}
    # Nothing to overlap and a native all-reduce as fast as the rings: keep it.
    assert all_reduce_form(all_reduce_s=1.0, reduce_scatter_s=0.5, all_gather_s=0.5).choice == "all_reduce"
    # Nothing to overlap but a slow native all-reduce (gloo's): the rings win alone.
    assert all_reduce_form(all_reduce_s=1.5, reduce_scatter_s=0.5, all_gather_s=0.5).choice == "rs_ag"
    # A device that hides nothing gains nothing from compute beside the rings.
    none = all_reduce_form(all_reduce_s=1.0, reduce_scatter_s=0.5, all_gather_s=0.5, before_s=9, after_s=9, overlap=0.0)
    assert none.choice == "all_reduce" and none.seconds["rs_ag"] == 1.0
    half = all_reduce_form(all_reduce_s=1.0, reduce_scatter_s=0.6, all_gather_s=0.6, before_s=0.2, after_s=0.0)
    assert half.seconds["rs_ag"] == pytest.approx(1.0) and half.choice == "all_reduce"  # tie: one call


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: partition("broadcast", 1, 2, 2, FAST, SLOW), "kind"),
        (lambda: partition("all_gather", -1, 2, 2, FAST, SLOW), "nbytes"),
        (lambda: partition("all_gather", float("nan"), 2, 2, FAST, SLOW), "nbytes"),
        (lambda: partition("all_gather", 1, 0, 2, FAST, SLOW), "ranks_per_host"),
        (lambda: partition("all_gather", 1, 2, True, FAST, SLOW), "hosts"),
        (lambda: partition("all_gather", 1, 2, 2, None, SLOW), "intra"),
        (lambda: partition("all_gather", 1, 2, 2, FAST, LinkFit(0.0, 0.0)), "inter.bytes_per_s"),
        (lambda: all_reduce_form(all_reduce_s=-1, reduce_scatter_s=0, all_gather_s=0), "all_reduce_s"),
        (lambda: all_reduce_form(all_reduce_s=1, reduce_scatter_s=0, all_gather_s=0, before_s=math.inf), "before_s"),
        (lambda: all_reduce_form(all_reduce_s=1, reduce_scatter_s=0, all_gather_s=0, overlap=1.5), "overlap"),
    ],
)
def test_planner_arguments_are_validated(call, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        call()
