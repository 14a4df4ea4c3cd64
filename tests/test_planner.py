"""The planner (oases.planner): cost formulas on hand-computed cases, the ILP against brute force,
Centauri's chunk rule and backward priority, FOLD3D's numbers, `oases plan` and oases.plan.load."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

import oases.plan
from oases import planner as P
from oases.cli import main as cli_main
from oases.planner.cost import sequence_parallel_form
from oases.planner.profile import ComputeSample, LinkFit, Profile, profile_from_dict

TINY = P.ModelShape(layers=2, hidden=8, heads=4, seq_len=4, vocab_size=16, ffn_hidden=32)


def _profile(a: float, rows: tuple[int, ...] = (2, 4)) -> Profile:
    """Compute fixed by samples (attention fwd 1 s / bwd 2 s, MLP 3 s / 6 s at TP 2, whatever the
    rows; recomputation, fine-grained or not, at the forward's cost), an all-reduce of `a` seconds
    on 2 ranks, all-gathers free of latency."""
    samples = tuple(
        ComputeSample(kind, 2, r, TINY.seq_len, TINY.hidden, TINY.heads, TINY.ffn_hidden, f, b, record_unread_s=f)
        for r in rows
        for kind, f, b in (("attention", 1.0, 2.0), ("mlp", 3.0, 6.0))
    )
    return Profile(
        device="test",
        flops_per_s=1e9,
        link_bytes_per_s=1e3,
        latency_s=0.0,
        element_bytes=4,
        compute=samples,
        head=((1, 0.0, 0.0),),
        collectives={("all_reduce", 2): LinkFit(a, 1e30)},
    )


# ---- cost model (eqs. 3, 4, 6) --------------------------------------------------------------------
def test_node_cost_megatron_serialises_compute_and_all_reduce():
    work = P.Workload(TINY, rows=4, tp=2, schedule="megatron")
    c = P.layer_cost(work, _profile(0.5), 2)
    # per sublayer: forward (c_f + a) + backward (c_b + a) + recompute (c_f + a)
    # attention 1.5 + 2.5 + 1.5 = 5.5; MLP 3.5 + 6.5 + 3.5 = 13.5
    assert c.time_s == pytest.approx(19.0)
    assert c.compute_s == pytest.approx(16.0) and c.comm_s == pytest.approx(3.0)


def test_node_cost_oases_overlaps_sub_batches():
    work = P.Workload(TINY, rows=4, tp=2, schedule="oases")  # 2 sub-batches of 2 rows
    # compute-bound (a = 0.5): attention 2 max(1, a) + 2 max(1 + 2, a) = 8; MLP 2*3 + 2*9 = 24
    assert P.layer_cost(work, _profile(0.5), 2).time_s == pytest.approx(32.0)
    # the first (and last) layer's first all-reduce has nothing to hide behind: + a
    assert P.layer_cost(work, _profile(0.5), 2, first=True).time_s == pytest.approx(32.5)
    # comm-bound (a = 5): attention 2*5 + 2*5; MLP 2*5 + 2*max(9, 5) = 28 -> 48
    comm_bound = P.layer_cost(work, _profile(5.0), 2)
    assert comm_bound.time_s == pytest.approx(48.0) and comm_bound.dominated_by == "comm"
    # a device that hides half of the shorter side (profile overlap 0.5): + n * 0.5 * min(c, a) per pass
    half = replace(_profile(0.5), overlap=0.5)
    assert P.layer_cost(work, half, 2).time_s == pytest.approx(32.0 + 4 * 2 * 0.5 * 0.5)


def test_merak_pays_its_barriers_and_cross_pass_recomputes_with_all_reduces():
    prof = _profile(0.5)
    cross = P.layer_cost(P.Workload(TINY, rows=4, tp=2, schedule="cross_pass"), prof, 2)
    merak = P.layer_cost(P.Workload(TINY, rows=4, tp=2, schedule="merak"), prof, 2)
    # cross_pass, per sublayer: forward, recompute 2 max(c_f, a), backward 2 max(c_b, a)
    assert cross.time_s == pytest.approx((2 + 2 + 4) + (6 + 6 + 12))
    assert merak.time_s == pytest.approx(cross.time_s + 2 * 0.5)


def test_edge_cost_is_one_all_gather_of_the_wider_activation():
    prof = P.analytical_profile(flops_per_s=1e12, link=1e6, latency_s=0.0, element_bytes=4)
    work = P.Workload(TINY, rows=8, tp=4, schedule="oases")  # n = 2
    assert P.edge_cost(work, prof, 2, 2) == 0.0
    # degree 1 -> 4: [8 * 4/4 = 8 rows, 4, 8] fp32 = 1024 bytes, gathered over 4 ranks in 2 sub-batches:
    # 2 * (3/4 * 512 / 1e6)
    assert P.edge_cost(work, prof, 1, 4) == pytest.approx(2 * 0.75 * 512 / 1e6)
    assert P.edge_cost(work, prof, 4, 1) == P.edge_cost(work, prof, 1, 4)


def test_memory_of_a_layer_shrinks_with_its_degree_and_grows_with_its_rows():
    prof = P.analytical_profile(flops_per_s=1e12, link="1gbit", element_bytes=2)
    work = P.Workload(TINY, rows=8, tp=4, schedule="oases", state_bytes=16)
    for d in (1, 2, 4):
        c = P.layer_cost(work, prof, d)
        assert c.states_bytes == pytest.approx(TINY.layer_parameters() / d * 16)
        assert c.saved_bytes == pytest.approx(2 * (8 * d / 4) * TINY.seq_len * TINY.hidden * 2)  # 2 sublayer inputs
    megatron = P.layer_cost(P.Workload(TINY, rows=8, tp=4, schedule="megatron"), prof, 2)
    assert megatron.saved_bytes == pytest.approx(P.layer_cost(work, prof, 2).saved_bytes / 2)  # one per layer


def test_profile_scales_unsampled_shapes_by_flops():
    doc = {
        "format": "oases-profile",
        "version": 1,
        "device": {"name": "x"},
        "flops_per_s": 1e9,
        "element_bytes": 4,
        "compute": [
            {
                "sublayer": "mlp",
                "tp": 1,
                "rows": 2,
                "seq_len": 4,
                "hidden": 8,
                "heads": 4,
                "ffn_hidden": 32,
                "forward_s": 0.25,
                "backward_s": 0.5,
            }
        ],
        "collectives": {"all_reduce": {"2": {"latency_s": 1e-3, "bytes_per_s": 1e6}}},
    }
    prof = profile_from_dict(doc)
    assert prof.compute_time("mlp", TINY, 8, 1, "forward") == 0.25  # sampled: 2 rows x 4 tokens
    assert prof.compute_time("mlp", TINY, 16, 1, "backward") == pytest.approx(1.0)  # twice the FLOPs
    assert prof.compute_time("mlp", TINY, 8, 2, "forward") == pytest.approx(0.125)  # half a shard's FLOPs
    assert prof.collective_time("all_reduce", 2, 1e6) == pytest.approx(1.001)
    # several rows of one shape and degree: a line through them (t = 0.1 + 0.1 s per row here)
    doc["compute"] = [
        dict(doc["compute"][0], rows=r, forward_s=0.1 + 0.1 * r, backward_s=0.2 + 0.2 * r) for r in (1, 3)
    ]
    line = profile_from_dict(doc)
    assert line.compute_time("mlp", TINY, 2 * 4, 1, "forward") == pytest.approx(0.3)  # 2 rows, not sampled
    assert line.compute_time("mlp", TINY, 3 * 4, 1, "backward") == pytest.approx(0.8)
    assert prof.collective_time("all_reduce", 1, 1e6) == 0.0


def test_compute_is_piecewise_linear_through_the_samples_and_recompute_records():
    # a cache step between 2 and 4 rows: a line through all samples would miss both ends
    doc = {
        "format": "oases-profile",
        "version": 1,
        "device": {"name": "x"},
        "flops_per_s": 1e9,
        "element_bytes": 4,
        "compute": [
            {
                "sublayer": "mlp",
                "tp": 1,
                "rows": r,
                "seq_len": 4,
                "hidden": 8,
                "heads": 4,
                "ffn_hidden": 32,
                "forward_s": f,
                "backward_s": 2 * f,
                "record_s": 1.5 * f,
            }
            for r, f in ((1, 1.0), (2, 2.0), (4, 8.0))
        ],
        "collectives": {},
    }
    prof = profile_from_dict(doc)
    tokens = lambda rows: rows * TINY.seq_len  # noqa: E731
    assert prof.compute_time("mlp", TINY, tokens(4), 1, "forward") == pytest.approx(8.0)
    assert prof.compute_time("mlp", TINY, tokens(3), 1, "forward") == pytest.approx(5.0)  # between 2 and 4 rows
    assert prof.compute_time("mlp", TINY, tokens(8), 1, "backward") == pytest.approx(32.0)  # beyond: proportional
    assert prof.compute_time("mlp", TINY, tokens(0.5), 1, "forward") == pytest.approx(0.5)  # below: not under t/x
    assert prof.compute_time("mlp", TINY, tokens(2), 1, "recompute") == pytest.approx(3.0)  # the recording forward
    del doc["compute"][0]["record_s"]  # profiles without it: recomputation costs the forward
    assert profile_from_dict(doc).compute_time("mlp", TINY, tokens(1), 1, "recompute") == pytest.approx(1.0)


def test_fine_grained_recomputation_costs_the_recording_without_the_output_projection():
    """core_for_gradients skips the row-parallel projection's GEMM: the profile's record_unread_s,
    else the recording scaled by the FLOPs left; the oases schedule's backward costs that."""
    tokens = 2 * TINY.seq_len
    full, proj = TINY.flops("mlp", tokens, 1), TINY.projection_flops("mlp", tokens, 1)
    assert proj == 2 * tokens * TINY.hidden * TINY.ffn_hidden and proj == full / 2  # fc, proj: two equal GEMMs
    assert TINY.projection_flops("attention", tokens, 2) == tokens * TINY.hidden**2
    sample = dict(sublayer="mlp", tp=1, rows=2, seq_len=4, hidden=8, heads=4, ffn_hidden=32)
    sample.update(forward_s=2.0, backward_s=4.0, record_s=3.0)
    doc = {"format": "oases-profile", "version": 1, "device": {"name": "x"}, "flops_per_s": 1e9}
    doc.update(element_bytes=4, compute=[sample], collectives={})
    assert profile_from_dict(doc).compute_time("mlp", TINY, tokens, 1, "recompute_unread") == pytest.approx(1.5)
    sample["record_unread_s"] = 1.25  # measured
    prof = profile_from_dict(doc)
    assert prof.compute_time("mlp", TINY, tokens, 1, "recompute_unread") == pytest.approx(1.25)
    assert prof.compute_time("mlp", TINY, tokens, 1, "recompute") == pytest.approx(3.0)
    gated = replace(TINY, gated_mlp=True)  # the projection is a third of a gated MLP's FLOPs, whatever the sample's
    for rate in (None, 1.25):
        sample["record_unread_s"] = rate
        recorded = profile_from_dict(doc).compute_time("mlp", gated, tokens, 1, "recompute")
        unread = profile_from_dict(doc).compute_time("mlp", gated, tokens, 1, "recompute_unread")
        saved = (3.0 - 1.25) * gated.projection_flops("mlp", tokens, 1) / proj if rate else recorded / 3
        assert unread == pytest.approx(recorded - saved)
    sample["record_unread_s"] = 1.25
    analytical = Profile(device="x", flops_per_s=1e9, link_bytes_per_s=1e8)
    assert analytical.compute_time("attention", TINY, tokens, 2, "recompute_unread") == pytest.approx(
        (TINY.flops("attention", tokens, 2) - tokens * TINY.hidden**2) / 1e9
    )
    moe = replace(TINY, experts=4, experts_per_token=2)
    assert moe.projection_flops("mlp", tokens, 1) == 0  # the router weights the experts: recomputed in full
    assert analytical.compute_time("mlp", moe, tokens, 1, "recompute_unread") == analytical.compute_time(
        "mlp", moe, tokens, 1, "recompute"
    )
    work = P.Workload(TINY, rows=4, tp=1, schedule="oases")  # 2 sub-batches of the sample's 2 rows
    sample["record_unread_s"] = 3.0  # as the recording: the layer's compute 2 x (3.0 - 1.25) more
    slower = P.layer_cost(work, profile_from_dict(doc), 1).compute_s
    assert slower - P.layer_cost(work, prof, 1).compute_s == pytest.approx(2 * (3.0 - 1.25))


def test_link_fit_takes_bandwidth_from_large_messages_and_latency_from_the_rest():
    latency, rate = 1e-3, 50e6
    samples = [(n, latency + n / rate) for n in (2**16, 2**18, 2**20, 2**23)]
    fit = LinkFit.from_samples(samples)
    assert fit.bytes_per_s == pytest.approx(rate) and fit.latency_s == pytest.approx(latency)
    # a small message twice as slow as the line (a noisy sample) moves the latency a little, not the bandwidth
    noisy = LinkFit.from_samples([(2**16, 2 * samples[0][1]), *samples[1:]])
    assert noisy.bytes_per_s == pytest.approx(rate) and noisy.latency_s < 2 * latency
    assert LinkFit.from_samples([(1e6, 0.02)]).bytes_per_s == pytest.approx(5e7)


def test_pass_boundaries_expose_the_shorter_of_a_unit_and_its_all_reduce():
    # comm-bound (a = 5 > c_f): merak's 2 barriers and the first layer's start each cost min(c_f, a),
    # the attention forward (1) or the MLP forward (3): the larger, 3
    prof = _profile(5.0)
    cross = P.layer_cost(P.Workload(TINY, rows=4, tp=2, schedule="cross_pass"), prof, 2)
    merak = P.layer_cost(P.Workload(TINY, rows=4, tp=2, schedule="merak"), prof, 2)
    assert merak.time_s == pytest.approx(cross.time_s + 2 * 3.0)
    first = P.layer_cost(P.Workload(TINY, rows=4, tp=2, schedule="cross_pass"), prof, 2, first=True)
    assert first.time_s == pytest.approx(cross.time_s + 3.0)


def _sp_profile(all_reduce_s: float, all_gather_s: float) -> Profile:
    return replace(
        _profile(all_reduce_s),
        collectives={("all_reduce", 2): LinkFit(all_reduce_s, 1e30), ("all_gather", 2): LinkFit(all_gather_s, 1e30)},
    )


def test_sequence_parallel_replaces_each_all_reduce_by_reduce_scatter_and_all_gathers():
    prof = _sp_profile(4.0, 3.0)  # reduce-scatter timed as the all-gather: 3 s each
    plain = P.Workload(TINY, rows=4, tp=2, schedule="oases")
    sp = replace(plain, sequence_parallel=True)
    c = P.layer_cost(sp, prof, 2)
    # per sublayer, 2 sub-batches: forward RS + AG = 6 s, backward RS + 2 AG (recomputation re-gathers) = 9 s
    # attention 2 max(1, 6) + 2 max(2 + 1, 9) = 30; MLP 2 max(3, 6) + 2 max(6 + 3, 9) = 30
    assert c.time_s == pytest.approx(60.0) and c.comm_s == pytest.approx(2 * 2 * (6 + 9))
    assert c.saved_bytes == pytest.approx(P.layer_cost(plain, prof, 2).saved_bytes / 2)  # the sequence is split
    # the first layer also gathers the first norm's input and the embedding's gradient, exposed
    assert P.layer_cost(sp, prof, 2, first=True).time_s == pytest.approx(60.0 + 3.0 + 2 * 3.0)
    with pytest.raises(ValueError, match="sequence_parallel"):
        P.layer_cost(P.Workload(TINY, rows=4, tp=4, sequence_parallel=True), prof, 2)


def test_sequence_parallel_form_picks_the_cheaper_collectives():
    work = P.Workload(TINY, rows=4, tp=2, schedule="oases")
    slow_all_reduce = sequence_parallel_form(work, _sp_profile(20.0, 1.0))  # the backend's AR >> RS + AG
    assert slow_all_reduce.choice == "rs_ag"
    assert slow_all_reduce.seconds["rs_ag"] < slow_all_reduce.seconds["all_reduce"]
    ring = sequence_parallel_form(work, _sp_profile(10.0, 5.0))  # AR = RS + AG: SP's re-gather costs more
    assert ring.choice == "all_reduce" and ring.seconds["rs_ag"] > ring.seconds["all_reduce"]
    one_rank = sequence_parallel_form(P.Workload(TINY, rows=4, tp=1), _sp_profile(10.0, 5.0))
    assert one_rank.choice == "all_reduce" and "rs_ag" not in one_rank.seconds


def test_plan_chooses_sequence_parallel_when_it_is_faster_or_alone_fits(tmp_path):
    shape = P.ModelShape(layers=4, hidden=1024, heads=16, seq_len=2048, vocab_size=1024)
    base = dict(world=2, batch=4, tp_max=2, variants=(("oases", 2),))
    fast_link = P.plan(shape, device_memory="80GB", link="100gbit", **base)
    assert fast_link.tp == 2 and not fast_link.sequence_parallel
    assert fast_link.form_step_s["rs_ag"] >= fast_link.form_step_s["all_reduce"]
    # memory that holds the sequence-split activations only: TP 2 with sequence parallelism
    # (the all-reduce form's least: every layer recomputed)
    profile = P.analytical_profile(flops_per_s=100e12, link="100gbit")
    dense = P.plan_degrees(P.Workload(shape, rows=4, tp=2), profile, float("inf"), degrees=(2,))
    sp = P.plan_degrees(P.Workload(shape, rows=4, tp=2, sequence_parallel=True), profile, float("inf"), degrees=(2,))
    budget = (sp.memory_bytes + dense.memory_bytes) / 2
    tight = P.plan(shape, device_memory=int(budget), link="100gbit", **base)
    assert tight.sequence_parallel and tight.tp == 2 and tight.memory_bytes <= budget
    assert tight.form_step_s["all_reduce"] is None
    path = tmp_path / "plan.json"
    tight.save(str(path))
    assert oases.plan.sequence_parallel(str(path)) is True and oases.plan.load(str(path)) == [2] * 4
    old = {k: v for k, v in tight.to_dict().items() if k not in ("sequence_parallel", "form_step_s")}
    path.write_text(json.dumps(old))  # a plan written before the planner chose the form
    assert oases.plan.sequence_parallel(str(path)) is False and oases.plan.load(str(path)) == [2] * 4


# ---- the ILP -------------------------------------------------------------------------------------
def _brute_force(node, edge, memory, budget):
    best = None
    for choice in itertools.product(range(len(node[0])), repeat=len(node)):
        if sum(memory[l][i] for l, i in enumerate(choice)) > budget:
            continue
        cost = sum(node[l][i] for l, i in enumerate(choice)) + sum(edge[a][b] for a, b in zip(choice, choice[1:]))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("method", ["milp", "pareto", "auto"])
def test_ilp_known_optimum_with_and_without_memory_pressure(method):
    node = [[1.0, 2.0]] * 3
    edge = [[0.0, 0.1], [0.1, 0.0]]
    memory = [[10.0, 5.0]] * 3
    free = P.solve_chain(node, edge, memory, 30, method=method)
    assert free.choice == (0, 0, 0) and free.objective == pytest.approx(3.0)
    one = P.solve_chain(node, edge, memory, 25, method=method)  # one layer must shrink: at an end (one edge)
    assert one.choice in ((0, 0, 1), (1, 0, 0)) and one.objective == pytest.approx(4.1) and one.memory <= 25
    two = P.solve_chain(node, edge, memory, 20, method=method)
    assert two.choice in ((0, 1, 1), (1, 1, 0)) and two.objective == pytest.approx(5.1)
    with pytest.raises(ValueError, match="budget"):
        P.solve_chain(node, edge, memory, 14, method=method)


def test_ilp_matches_brute_force_on_random_chains():
    rng = np.random.default_rng(0)
    for trial in range(12):
        layers, k = 5, 3
        node = rng.uniform(1, 3, (layers, k)).tolist()
        edge = rng.uniform(0, 1, (k, k))
        np.fill_diagonal(edge, 0.0)
        memory = rng.integers(1, 10, (layers, k)).astype(float).tolist()
        budget = float(np.min(memory, 1).sum() + rng.integers(0, 12))
        expected = _brute_force(node, edge.tolist(), memory, budget)
        for method in ("milp", "pareto"):
            got = P.solve_chain(node, edge, memory, budget, method=method)
            assert got.objective == pytest.approx(expected), (trial, method)
            assert got.memory <= budget + 1e-9


def test_plan_degrees_mixes_degrees_only_when_memory_binds():
    shape = P.load_model("gpt3-1.3b")
    prof = P.analytical_profile(flops_per_s=100e12, link="10gbit")
    work = P.Workload(shape, rows=8, tp=8, schedule="oases")
    roomy = P.plan_degrees(work, prof, 200e9)
    assert len(set(roomy.degrees)) == 1  # nothing binds: the fastest degree everywhere
    fast = roomy.degrees[0]
    uniform_fast = P.plan_degrees(work, prof, 200e9, degrees=(fast,))
    # a budget between "every layer at the fastest degree" and "every layer one degree up"
    budget = (uniform_fast.memory_bytes + P.plan_degrees(work, prof, 200e9, degrees=(2 * fast,)).memory_bytes) / 2
    mixed = P.plan_degrees(work, prof, budget)
    assert set(mixed.degrees) == {fast, 2 * fast} and mixed.memory_bytes <= budget
    uniform_fitting = P.plan_degrees(work, prof, budget, degrees=(2 * fast,))
    assert mixed.time_s < uniform_fitting.time_s  # Table II's pattern: mixed beats the uniform plan that fits
    with pytest.raises(ValueError, match="memory_budget"):
        P.plan_degrees(work, prof, budget, degrees=(fast,))  # the fast degree alone no longer fits


def test_ilp_24_layers_4_degrees_is_quick():
    shape = P.load_model("gpt3-1.3b")  # 24 layers
    prof = P.analytical_profile(flops_per_s=100e12, link="10gbit")
    work = P.Workload(shape, rows=8, tp=8, schedule="oases")
    options = P.tp_degrees(shape, 8)
    assert options == (1, 2, 4, 8)
    per = [[P.layer_cost(work, prof, d, first=i == 0, last=i == 23) for d in options] for i in range(24)]
    node = [[c.time_s for c in row] for row in per]
    memory = [[c.memory_bytes for c in row] for row in per]
    edge = [[P.edge_cost(work, prof, a, b) for b in options] for a in options]
    budget = 0.9 * sum(row[1] for row in memory)  # memory-bound: degree 2 everywhere does not fit
    started = time.perf_counter()
    milp = P.solve_chain(node, edge, memory, budget, method="milp")
    milp_s = time.perf_counter() - started
    pareto = P.solve_chain(node, edge, memory, budget, method="pareto")
    assert pareto.objective == pytest.approx(milp.objective, rel=1e-6)
    assert milp_s < 5.0  # loose: the figure belongs in bench (paper: 157-451 ms)


# ---- Centauri ------------------------------------------------------------------------------------
def test_chunk_count_algorithm_1():
    # nothing to hide behind and free chunks: as many as allowed
    assert P.chunk_count(1.0, 1.0, 0.0, max_chunks=16) == 16
    # overhead per chunk larger than what a chunk hides: one chunk
    assert P.chunk_count(1.0, 1.0, 1.0) == 1
    # comp 1, comm 0.01, in_cost 1e-3: T(1) = 1.011, T(2) = 1.007, T(4) = 1.0065, T(8) = 1.00925
    assert P.chunk_count(1.0, 0.01, 1e-3) == 4
    assert P.chunk_count(1.0, 0.01, 1e-3, allowed=[1, 3]) == 3  # T(3) = 1.00633
    assert P.overlapped_time(1.0, 0.01, 1e-3, 4) == pytest.approx(1.0065)
    with pytest.raises(ValueError, match="comm_cost"):
        P.chunk_count(1.0, -1.0, 0.0)


def test_chunk_count_with_measured_gemm_efficiency():
    """Chunked GEMMs run slower (H200, Llama GEMMs: 0.98, 0.93, 0.83, 0.68 at 2, 4, 8, 16): the
    compute is divided by e(n), so fewer pieces win where the ideal model took many."""
    from oases.costs.chunks import chunk_efficiency

    h200 = {2: 0.98, 4: 0.93, 8: 0.83, 16: 0.68}
    assert chunk_efficiency(h200, 1) == 1.0 and chunk_efficiency(None, 8) == 1.0
    assert chunk_efficiency(h200, 8) == 0.83 and chunk_efficiency(h200, 32) == 0.68
    assert chunk_efficiency(h200, 3) == pytest.approx(0.98 + (0.93 - 0.98) * (math.log2(3) - 1))
    # comp = comm = 1 s, free chunks: ideal takes all 16; measured, T(2) = 1/0.98 + 1/2 ~ 1.52,
    # T(4) = 1/0.93 + 1/4 ~ 1.325, T(8) = 1/0.83 + 1/8 ~ 1.33: four pieces
    assert P.chunk_count(1.0, 1.0, 0.0) == 16
    assert P.chunk_count(1.0, 1.0, 0.0, efficiency=h200) == 4
    assert P.overlapped_time(1.0, 1.0, 0.0, 4, 0.93) == pytest.approx(1 / 0.93 + 1 / 4)
    with pytest.raises(ValueError, match="efficiency"):
        P.chunk_count(1.0, 1.0, 0.0, efficiency={2: 0.0})
    with pytest.raises(TypeError, match="efficiency"):
        P.chunk_count(1.0, 1.0, 0.0, efficiency=[0.9])


def test_plan_records_chunks_from_the_profile_efficiency(tmp_path):
    """A plan's layers and the plan itself carry the chunk count Algorithm 1 picks with the
    profile's efficiency; oases.plan.chunks reads it back for parallelize(model, chunks=...)."""
    shape = P.ModelShape(layers=4, hidden=1024, heads=16, seq_len=2048, vocab_size=1024)
    base = P.analytical_profile(flops_per_s=100e12, link="100gbit", latency_s=1e-6)
    poor_gemms = replace(base, chunk_efficiency={2: 0.5, 4: 0.25, 8: 0.125, 16: 0.0625})
    kwargs = dict(world=2, batch=4, tp_max=2, variants=(("oases", 2),), device_memory="80GB")
    ideal, poor = P.plan(shape, profile=base, **kwargs), P.plan(shape, profile=poor_gemms, **kwargs)
    assert ideal.tp == poor.tp == 2
    assert 1 < ideal.chunks <= 8 and all(layer["chunks"] == ideal.chunks for layer in ideal.layers)
    tokens = 4 // 2 * 2048 // 2  # rows per step at TP 2 (all of them) per sub-batch ("oases": 2) x seq_len
    assert tokens % ideal.chunks == 0  # a count the ops accept (they need it to divide the rows)
    assert poor.chunks == 1  # each piece doubles the GEMM's time: never worth cutting
    path = tmp_path / "plan.json"
    ideal.save(str(path))
    assert oases.plan.chunks(str(path)) == ideal.chunks
    with open(path) as f:
        doc = json.load(f)
    assert doc["profile"]["chunk_efficiency"] == {}
    assert oases.plan.chunks(str(path)) > 1
    del doc["chunks"]  # a plan written before the planner chose it: no chunking
    older = tmp_path / "older.json"
    older.write_text(json.dumps(doc))
    assert oases.plan.chunks(str(older)) == 1


def test_backward_priority_eq_1():
    # dX's reduction (1 s) hides behind dW (1 s): activation first 2 s, weight first 3 s
    assert P.backward_priority(1.0, 1.0, 1.0) == "activation_first"
    # a long reduction the next layer's compute hides anyway: weight first 2 s, activation first 6 s
    assert P.backward_priority(1.0, 1.0, 5.0, next_comp=10.0) == "weight_first"


def test_ops_default_chunks_follow_the_chunk_rule():
    from oases.costs.chunks import op_chunks

    assert op_chunks(4, 4, 4, comm_bytes=64, divides=4) == 1  # tiny: the per-chunk overhead dominates
    big = op_chunks(4096, 1024, 1024, comm_bytes=4096 * 1024 * 4, divides=4096)
    assert big > 1 and 4096 % big == 0


# ---- FOLD3D --------------------------------------------------------------------------------------
def test_choose_segments_and_dp_overlap_ratio():
    # 12 layers on 3 stages: ns in {1, 2, 4}; exposed(ns) = 8/ns + max(0, 2*4*ns*pp - 4*3)
    assert P.choose_segments(12, 3, 1.0, 2.0, 0.1, 8.0, micro_batches=4) == 4
    assert P.choose_segments(12, 3, 1.0, 2.0, 1.0, 8.0, micro_batches=4) == 1  # exposed(2) = 4 + 4: no gain
    with pytest.raises(ValueError, match="layers"):
        P.choose_segments(10, 3, 1.0, 2.0, 0.1, 8.0, micro_batches=4)
    assert P.dp_overlap_ratio(1.0, 2.0, 1.0, segments=2, micro_batches=1) == 1.0  # fits under the backward
    assert P.dp_overlap_ratio(1.0, 2.0, 4.0, segments=2, micro_batches=1) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="segments"):
        P.dp_overlap_ratio(1.0, 2.0, 4.0, segments=0, micro_batches=1)


# ---- search, CLI, oases.plan ---------------------------------------------------------------------
def test_plan_search_is_consistent_and_quick():
    started = time.perf_counter()
    p = P.plan(P.load_model("gpt3-1.3b"), world=8, device_memory="16GB", link="10gbit", batch=16)
    assert time.perf_counter() - started < 5.0
    assert p.dp * p.pp * p.tp == 8 and len(p.tp_degrees) == 24 and p.memory_bytes <= 16e9
    assert all(p.tp % d == 0 for d in p.tp_degrees)
    assert p.step_s <= p.uniform_step_s


def test_cli_writes_a_plan_that_oases_plan_load_reads(tmp_path, capsys):
    config = tmp_path / "model.json"  # a Hugging Face config.json
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 8,
                "hidden_size": 1024,
                "num_attention_heads": 16,
                "intermediate_size": 2816,
                "max_position_embeddings": 1024,
                "vocab_size": 32000,
            }
        )
    )
    out = tmp_path / "plan.json"
    code = cli_main(
        [
            "plan",
            "--model",
            str(config),
            "--world",
            "4",
            "--device-memory",
            "8GB",
            "--link",
            "10gbit",
            "--batch",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0 and capsys.readouterr().out
    expected = P.plan(P.load_model(str(config)), world=4, device_memory="8GB", link="10gbit", batch=8)
    assert oases.plan.load(str(out)) == list(expected.tp_degrees)
    doc = oases.plan.read(str(out))
    assert doc["model"]["layers"] == 8 and doc["dp"] * doc["pp"] * doc["tp"] == 4


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--model", "no-such-model"], "model"),
        (["--device-memory", "24 parsecs"], "device_memory"),
        (["--link", "fast"], "link"),
        (["--world", "0"], "world"),
        (["--device-memory", "1MB"], "device_memory"),
    ],
)
def test_cli_bad_input_names_the_argument(tmp_path, capsys, argv, named):
    base = {"--model": "gpt2-small", "--world": "4", "--device-memory": "16GB", "--link": "10gbit"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    args = ["plan", *itertools.chain.from_iterable(base.items()), "--out", str(tmp_path / "p.json")]
    assert cli_main(args) == 2
    assert named in capsys.readouterr().err


def test_cli_out_checked_before_planning(tmp_path, capsys):
    base = ["plan", "--model", "gpt2-small", "--world", "4", "--device-memory", "16GB", "--link", "10gbit"]
    assert cli_main([*base, "--out", str(tmp_path / "missing" / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "does not exist" in err and "Traceback" not in err
    assert cli_main([*base, "--out", str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err


def test_cli_closed_pipe_ends_quietly(tmp_path):
    """`oases plan ... | head`: the reader is gone before the table is printed; the plan is still
    written, the exit code is 0 and nothing is printed on stderr."""
    out = tmp_path / "plan.json"
    code = "import sys; from oases.cli import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "plan",
            "--model",
            "gpt2-small",
            "--world",
            "4",
            "--device-memory",
            "16GB",
            "--link",
            "10gbit",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # the reader leaves before the first line
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, err
    assert err == "" and out.exists()


def test_bad_inputs_raise_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match="hidden"):
        P.ModelShape(layers=2, hidden=10, heads=4, seq_len=8, vocab_size=8)
    with pytest.raises(TypeError, match="model"):
        P.plan("llama-7b", world=4, device_memory="8GB", link="1gbit", batch=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedule"):
        P.Workload(TINY, rows=4, tp=2, schedule="fastest")
    not_a_plan = tmp_path / "x.json"
    not_a_plan.write_text("{}")
    with pytest.raises(ValueError, match="path"):
        oases.plan.load(str(not_a_plan))
    with pytest.raises(ValueError, match="profile"):
        P.load_profile(str(not_a_plan))
    with pytest.raises(ValueError, match="degree"):
        P.layer_cost(P.Workload(TINY, rows=4, tp=2), _profile(0.5), 3)


def test_memory_phases_by_hand():
    """oases.planner.memory on a hand-computed Llama-like shape: the parts, ZeRO's 1/dp, the phases."""
    shape = P.ModelShape(
        layers=2, hidden=8, heads=4, seq_len=4, vocab_size=16, ffn_hidden=32, kv_heads=2, gated_mlp=True
    )
    layer, vocab = shape.layer_parameters(), 2 * 16 * 8
    rest = shape.embedding_parameters() - vocab  # positions (seq_len * hidden) and the final norm
    plain = P.rank_memory(shape, P.MemoryJob(rows=2, tp=2))
    assert plain.parameters == 2 * layer / 2 + vocab / 2 + rest
    assert plain.weights == plain.gradients == 4 * plain.parameters
    assert plain.optimizer_states == 2 * plain.weights and plain.masters == 0
    work = P.Workload(shape, 2, 2, schedule="oases")
    kept = 2 * 2 * 4 * 8 * 4  # oases keeps 2 sublayer inputs [rows, s, h] per layer, fp32
    assert P.cost.kept_input_bytes(work, 2, 4) == kept
    assert plain.activations == pytest.approx(2 * kept + P.cost.buffer_bytes(work, 2, 4) + 2 * 1 * 4 * 16 * 4 / 2)
    # the largest tensors here are the MLP's [32, 8] (the embedding is [16, 8]):
    assert plain.read_pretrained == 8 * 32 * 4  # down_proj's column half maps all of it
    assert plain.read_chunk == 2 * 32 * 8 / 2 * 4  # DCP: the shard's bytes and its tensor
    assert plain.write_full == (32 * 8 + 32 * 8 / 2) * 4  # gathered tensor + one received shard
    wide = P.rank_memory(replace(shape, vocab_size=128), P.MemoryJob(rows=2, tp=2))
    assert wide.read_pretrained == 128 * 8 / 2 * 4  # the embedding's rows: a contiguous half
    zero = P.rank_memory(shape, P.MemoryJob(rows=2, dp=2, zero=True))
    adamw = P.rank_memory(shape, P.MemoryJob(rows=2, dp=2))
    assert zero.optimizer_states == adamw.optimizer_states / 2 and zero.write_full == 0
    bf16 = P.rank_memory(shape, P.MemoryJob(rows=2, dp=2, zero=True, param_bytes=2))
    assert bf16.masters == 4 * bf16.parameters / 2 and bf16.optimizer_states == zero.optimizer_states
    phases = P.phase_memory(shape, P.MemoryJob(rows=2, tp=2))
    assert tuple(p.phase for p in phases) == P.PHASES
    resident = {p.phase: p.resident_bytes for p in phases}
    assert resident["build"] == 0 and resident["load_pretrained"] == plain.weights  # pages come on first write
    assert P.phase_memory(shape, P.MemoryJob(rows=2, tp=2, init_weights=True))[0].resident_bytes == plain.weights
    assert resident["train"] == resident["save_pretrained"] == plain.states
    assert all(p.peak_bytes >= p.resident_bytes > 0 for p in phases[1:])
    # transients: AdamW's two temporaries of the largest local tensor (the MLP's [32, 8] / 2, fp32); no dp sync
    assert plain.step_transient == 2 * 32 * 8 / 2 * 4 and plain.sync_in_flight == plain.gradient_rows == 0
    peak = {p.phase: p.peak_bytes for p in phases}
    assert peak["train"] == plain.states + plain.gradients + max(plain.activations, plain.step_transient)
    small = P.MemoryJob(rows=2, dp=2, bucket_bytes=100, in_flight=3)  # [32, 8] fp32 = 1024 bytes > 100
    assert P.rank_memory(shape, small).sync_in_flight == 1024 + 2 * 100  # the largest bucket + 2 more
    zero_small = P.rank_memory(shape, replace(small, zero=True))
    assert zero_small.sync_in_flight == (1024 + 2 * 100) * 1.5  # padded blocks + received rows
    assert zero_small.gradient_rows == 4 * zero_small.parameters / 2
    assert zero_small.step_transient == max(2 * 1024 / 2, 1.5 * 1024)  # the all-gather's buffers win
    with pytest.raises(ValueError, match="optimizer"):
        P.MemoryJob(rows=1, optimizer="lamb")
    with pytest.raises(ValueError, match="tp"):
        P.rank_memory(shape, P.MemoryJob(rows=1, tp=8))


def test_shape_from_config():
    shape = P.shape_from_config(
        {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 176,
            "vocab_size": 128,
            "max_position_embeddings": 2048,
        },
        seq_len=16,
    )
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.ffn_hidden, shape.seq_len) == (2, 64, 2, 176, 16)
    assert shape.gated_mlp and shape.vocab_size == 128
    with pytest.raises(TypeError):
        P.shape_from_config(42)


# ---- mixture of experts --------------------------------------------------------------------------
# h 8, 4 heads (head_dim 2), SwiGLU experts of width 16, 4 experts, top-2, a shared MLP of width 8
MOE = P.ModelShape(
    layers=2,
    hidden=8,
    heads=4,
    seq_len=4,
    vocab_size=16,
    ffn_hidden=16,
    gated_mlp=True,
    experts=4,
    experts_per_token=2,
    shared_ffn_hidden=8,
)


def test_moe_parameters_and_flops_by_hand():
    # attention: qkv = 8 + 2*4*2 = 24; 8*24 + 24 + 8*8 + 8 + 2*8 = 304
    assert MOE.parameters("attention") == 304
    # an expert: 3*8*16 + 16 + 8 = 408; the shared MLP: 3*8*8 + 8 + 8 = 208; router 8*4 = 32; norm 16
    assert MOE.parameters("mlp") == 4 * 408 + 208 + 32 + 16 == 1888
    assert MOE.layer_parameters() == 2192 and MOE.router_parameters() == 32
    assert MOE.rank_layer_parameters(1) == 2192
    assert MOE.rank_layer_parameters(2) == (2192 - 32) / 2 + 32 == 1112  # the router replicated
    # per token: router 2*8*4 = 64 (on every rank); 2 experts 2*2*8*16*3 = 1536; shared 2*8*8*3 = 384
    assert MOE.flops("mlp", 1, 1) == 64 + 1536 + 384
    assert MOE.flops("mlp", 10, 2) == 10 * (64 + (1536 + 384) / 2)
    assert MOE.flops("attention", 1, 1) == 2 * 8 * (24 + 8) + 4 * 4 * 8  # unchanged by the experts
    # Mixtral 8x7B: 46.7B parameters (the published count), ~12.9B of them active per token
    mixtral = P.load_model("mixtral-8x7b")
    total = mixtral.layers * mixtral.layer_parameters() + mixtral.embedding_parameters()
    assert total == pytest.approx(46.7e9, rel=1e-3)
    # active: the GEMM weights a token meets (forward FLOPs / 2, attention scores left out) + embedding and head;
    # per layer q, k, v, o 4096 * (6144 + 4096) + 2 experts 2*3*4096*14336 + router 4096*8
    scores = 4 * mixtral.seq_len * mixtral.hidden
    per_layer = (mixtral.flops("attention", 1, 1) - scores + mixtral.flops("mlp", 1, 1)) / 2
    assert per_layer == 41943040 + 352321536 + 32768
    active = mixtral.layers * per_layer + 2 * mixtral.vocab_size * mixtral.hidden
    assert active == pytest.approx(12.9e9, rel=1e-2)


def test_moe_invariants_against_dense():
    dense = replace(MOE, experts=0, experts_per_token=0, shared_ffn_hidden=0)
    one = replace(MOE, experts=1, experts_per_token=1, shared_ffn_hidden=0)
    # one expert, every token through it: the dense MLP plus a router [h, 1]
    assert one.flops("mlp", 12, 2) == dense.flops("mlp", 12, 2) + 2 * 12 * 8 * 1
    assert one.parameters("mlp") == dense.parameters("mlp") + 8 and one.parameters("attention") == dense.parameters(
        "attention"
    )
    # k = E: every expert runs on every token, as a dense MLP E times as wide (plus the router)
    all_of = replace(MOE, experts_per_token=4, shared_ffn_hidden=0)
    assert all_of.flops("mlp", 12, 2) == replace(dense, ffn_hidden=4 * 16).flops("mlp", 12, 2) + 2 * 12 * 8 * 4
    # more experts at the same top-k: memory grows by the experts held, FLOPs only by the router's logits
    wide = replace(MOE, experts=8)
    assert wide.flops("mlp", 12, 2) - MOE.flops("mlp", 12, 2) == 2 * 12 * 8 * 4
    for tp in (1, 2):
        grown = (
            P.rank_memory(wide, P.MemoryJob(rows=2, tp=tp)).parameters
            - P.rank_memory(MOE, P.MemoryJob(rows=2, tp=tp)).parameters
        )
        assert grown == 2 * (4 * 408 / tp + 4 * 8)  # 2 layers: 4 experts split over tp, their router rows replicated


def test_moe_rank_memory_at_tp_1_and_2_by_hand():
    vocab, rest = 2 * 16 * 8, 4 * 8 + 2 * 8  # embedding + head; positions and the final norm (replicated)
    for tp, parameters, buffer in ((1, 2 * 2192 + vocab + rest, 196), (2, 2 * 1112 + vocab / 2 + rest, 124)):
        # buffer per token: 2h + 2kh + E + (4h + 2 (k f + f_shared) + 2 heads s) / tp = 52 + 144 / tp
        job = P.MemoryJob(rows=2, tp=tp)  # fp32, AdamW, oases (2 sub-batches, 2 kept sublayer inputs)
        m = P.rank_memory(MOE, job)
        assert m.parameters == parameters  # 4688 at tp 1, 2400 at tp 2
        assert m.weights == m.gradients == 4 * parameters and m.optimizer_states == 2 * 4 * parameters
        work = P.Workload(MOE, rows=2, tp=tp)
        assert P.cost.buffer_bytes(work, tp, 4) == 1 * 4 * buffer * 4  # one row per sub-batch, s 4, fp32
        kept = 2 * 2 * 4 * 8 * 4  # 2 sublayer inputs [2 rows, 4, 8] per layer, as a dense layer's
        assert P.cost.kept_input_bytes(work, tp, 4) == kept
        logits = 2 * 1 * 4 * 16 * 4 / tp  # vocab-parallel head
        assert m.activations == 2 * kept + 4 * buffer * 4 + logits  # 4672 at tp 1, 3264 at tp 2
        train = next(p for p in P.phase_memory(MOE, job) if p.phase == "train")
        assert train.peak_bytes == 16 * parameters + m.activations  # W + S + G + A (A > AdamW's temporaries)
        states = P.layer_cost(P.Workload(MOE, rows=2, tp=tp, state_bytes=16), _moe_profile(0.5), tp).states_bytes
        assert states == (2192 if tp == 1 else 1112) * 16
    assert P.tp_degrees(MOE, 4) == (1, 2, 4)
    assert P.tp_degrees(replace(MOE, shared_ffn_hidden=2), 4) == (1, 2)  # the shared width must divide too


def _moe_profile(a: float) -> Profile:
    """1 FLOP/s, no compute samples, an all-reduce of `a` seconds (latency only) on 2 ranks."""
    return Profile(
        device="test",
        flops_per_s=1.0,
        link_bytes_per_s=1e3,
        latency_s=0.0,
        element_bytes=4,
        head=((1, 0.0, 0.0),),
        collectives={("all_reduce", 2): LinkFit(a, 1e30)},
    )


def test_moe_layer_cost_adds_the_router_gradient_all_reduce():
    work = P.Workload(MOE, rows=2, tp=2, schedule="megatron")  # 1 sub-batch of 2 rows: 8 tokens
    c = P.layer_cost(work, _moe_profile(0.5), 2)
    # per sublayer: forward c + a, backward 2c + a, recompute c + a; c = FLOPs at 1 FLOP/s
    attention, mlp = 8 * 640 / 2, 8 * (64 + 1920 / 2)  # 2560, 8192
    assert c.compute_s == pytest.approx(4 * (attention + mlp))
    # the MLP's all-reduces are the dense MLP's (3 per sublayer); + 1 per step for the router's gradient
    assert c.comm_s == pytest.approx(2 * 3 * 0.5 + 0.5)
    assert c.time_s == pytest.approx(4 * (attention + mlp) + 3.5)
    dense = replace(work, shape=replace(MOE, experts=0, experts_per_token=0, shared_ffn_hidden=0))
    assert P.layer_cost(dense, _moe_profile(0.5), 2).comm_s == pytest.approx(3.0)


def test_moe_mlp_is_not_timed_by_a_dense_sample_of_its_width():
    moe = replace(TINY, experts=4, experts_per_token=2)  # TINY's sampled shape, its MLP now 4 experts of width 32
    prof = _profile(0.5)  # samples: MLP 3 s forward at TP 2 on 2 and 4 rows, attention 1 s
    assert prof.compute_time("mlp", TINY, 8, 2, "forward") == 3.0  # the dense MLP: sampled
    assert prof.compute_time("attention", moe, 8, 2, "forward") == 1.0  # the attention is the sampled one
    # the MoE's MLP on 8 tokens at TP 2: 8 (64 + 2*2*8*32*2 / 2) = 8704 FLOPs, scaled from the nearest
    # sample by FLOPs (4 rows: 16 * 2*8*32*2 / 2 = 8192 FLOPs in 3 s)
    assert prof.compute_time("mlp", moe, 8, 2, "forward") == pytest.approx(3.0 * 8704 / 8192)


def test_moe_shapes_from_hugging_face_configs():
    mixtral = P.shape_from_config(
        {
            "model_type": "mixtral",
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 112,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "hidden_act": "silu",
            "vocab_size": 128,
            "max_position_embeddings": 256,
        },
        seq_len=16,
    )
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.ffn_hidden, mixtral.shared_ffn_hidden) == (8, 2, 112, 0)
    assert mixtral.gated_mlp and mixtral.kv_heads == 2 and mixtral.seq_len == 16
    qwen = {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 176,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "vocab_size": 128,
        "max_position_embeddings": 256,
    }
    shape = P.shape_from_config(qwen)
    assert (shape.experts, shape.experts_per_token, shape.ffn_hidden, shape.shared_ffn_hidden) == (8, 2, 32, 128)
    qwen3 = {k: v for k, v in qwen.items() if k != "shared_expert_intermediate_size"}
    assert P.shape_from_config(dict(qwen3, model_type="qwen3_moe")).shared_ffn_hidden == 0
    # some layers MoE (layers 1 and 3 of 4; layers 1..3 but 0): every layer costed as MoE
    assert P.shape_from_config(dict(qwen, decoder_sparse_step=2)).experts == 8
    assert P.shape_from_config(dict(qwen, mlp_only_layers=[0])).experts == 8
    # no layer MoE: the dense MLP of intermediate_size
    for dense in (
        dict(qwen, mlp_only_layers=[0, 1, 2, 3]),
        dict(qwen, decoder_sparse_step=5),
        dict(qwen, num_experts=0),
    ):
        shape = P.shape_from_config(dense)
        assert (shape.experts, shape.experts_per_token, shape.shared_ffn_hidden, shape.ffn_hidden) == (0, 0, 0, 176)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        P.shape_from_config({k: v for k, v in qwen.items() if k != "num_experts_per_tok"})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        P.shape_from_config(dict(qwen, decoder_sparse_step=0))
    ours = P.shape_from_config(
        {
            "layers": 2,
            "hidden": 8,
            "heads": 4,
            "seq_len": 4,
            "vocab_size": 16,
            "ffn_hidden": 16,
            "gated_mlp": True,
            "experts": 4,
            "experts_per_token": 2,
            "shared_ffn_hidden": 8,
            "name": "custom",
        }
    )
    assert ours == MOE and P.shape_from_config(MOE.to_dict()) == MOE


def test_moe_bad_shapes_name_the_field():
    with pytest.raises(ValueError, match="experts_per_token"):
        replace(MOE, experts_per_token=5)  # top-5 of 4 experts
    with pytest.raises(ValueError, match="experts_per_token"):
        replace(MOE, experts_per_token=0)
    with pytest.raises(ValueError, match="experts"):
        replace(MOE, experts=0)  # top-2 and a shared MLP without experts
    with pytest.raises(ValueError, match="shared_ffn_hidden"):
        replace(MOE, shared_ffn_hidden=-8)


def test_cli_plans_a_mixtral_config(tmp_path):
    config = tmp_path / "mixtral.json"  # a Mixtral-like config.json, scaled down
    config.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "num_hidden_layers": 4,
                "hidden_size": 1024,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "intermediate_size": 3584,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "hidden_act": "silu",
                "max_position_embeddings": 1024,
                "vocab_size": 32000,
            }
        )
    )
    out = tmp_path / "plan.json"
    code = cli_main(
        [
            "plan",
            "--model",
            str(config),
            "--world",
            "4",
            "--device-memory",
            "8GB",
            "--link",
            "10gbit",
            "--batch",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    doc = oases.plan.read(str(out))
    assert (doc["model"]["experts"], doc["model"]["experts_per_token"], doc["model"]["ffn_hidden"]) == (8, 2, 3584)
    shape = P.load_model(str(config))
    expected = P.plan(shape, world=4, device_memory="8GB", link="10gbit", batch=8)
    assert oases.plan.load(str(out)) == list(expected.tp_degrees)
    # all 8 experts held: a 1-expert model of the same shape needs less memory at the same layout
    one = P.plan(replace(shape, experts=1, experts_per_token=1), world=4, device_memory="8GB", link="10gbit", batch=8)
    assert doc["memory_bytes"] > one.memory_bytes


def test_plan_chooses_each_layers_recomputation_for_the_memory(tmp_path):
    """Memory to spare: every layer kept, the step shorter by what recomputation cost; memory for
    full recomputation only: every layer recomputed; between: a mix, within the device's memory,
    the predicted step falling as memory grows. oases.plan.recompute reads it back as
    train_step's per-layer values."""
    shape = P.ModelShape(layers=4, hidden=1024, heads=16, seq_len=2048, vocab_size=1024)
    base = dict(world=2, batch=4, tp_max=2, variants=(("oases", 2),), link="10gbit")
    roomy = P.plan(shape, device_memory="200GB", **base)
    assert roomy.recompute == ("keep",) * 4 and roomy.step_s < roomy.full_recompute_step_s
    profile = P.analytical_profile(flops_per_s=100e12, link="10gbit")
    least = P.plan_degrees(P.Workload(shape, rows=4, tp=2), profile, float("inf"), degrees=(2,)).memory_bytes
    tight = P.plan(shape, device_memory=int(least), **base)
    assert tight.recompute == ("full",) * 4 and tight.step_s == tight.full_recompute_step_s
    plans = [P.plan(shape, device_memory=int(tight.memory_bytes * f), **base) for f in (1.2, 1.3, 1.5)]
    assert all(p.memory_bytes <= p.device_memory for p in plans)
    steps = [tight.step_s] + [p.step_s for p in plans] + [roomy.step_s]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1], steps
    mixed = [p for p in plans if "full" in p.recompute and set(p.recompute) - {"full"}]
    assert mixed, [p.recompute for p in plans]
    path = tmp_path / "plan.json"
    mixed[0].save(str(path))
    assert oases.plan.recompute(str(path)) == [
        {"full": True, "selective": "selective", "keep": False}[m] for m in mixed[0].recompute
    ]
    old = {k: v for k, v in mixed[0].to_dict().items() if k != "recompute"}
    path.write_text(json.dumps(old))  # a plan written before the planner chose recomputation
    assert oases.plan.recompute(str(path)) == [True] * 4
