"""recompute="auto": each layer's recomputation chosen for a memory budget, on 2 gloo ranks.

What it proves: the budget decides (every layer kept when it allows, every layer recomputed at the
smallest budget that fits, a mix between, the predicted peak within the budget), both ranks choose
alike, the choice is measured once per input shape, the step is the unsharded model's (and bit-equal
to full recomputation with dropout: the probe draws no random numbers), an explicit budget too small
is refused on every rank by name, the default budget falls back to full recomputation with a warning,
and sequence parallelism only recomputes.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import oases
from oases.costs.recompute import FULL, KEEP, SELECTIVE, LayerModes, choose_modes
from oases.models import GPT, GPTConfig
from oases.schedule import RecomputeMemory

from _shards import expected_shard
from _spawn import cpu_only, rank_device, run_ranks

transformers = pytest.importorskip("transformers")

LAYERS = 4


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=LAYERS,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _step(model, ids, budget, **kw):
    memory = RecomputeMemory()
    model.zero_grad(set_to_none=True)
    loss = oases.train_step(model, ids, ids, recompute="auto", memory_budget=budget, memory=memory, **kw)
    return loss, memory.choice, {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_budgets(rank, world_size):
    ref = _llama().to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1)).to(rank_device())
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    _, roomy, _ = _step(tp, ids, 10**12)
    least, most = roomy.smallest, roomy.predicted
    # the planner's model of each mode's bytes (oases.costs.recompute.mode_elements) against the probe's
    from oases.planner import Workload, shape_from_config
    from oases.planner.cost import mode_bytes

    work = Workload(shape_from_config(ref.config, seq_len=ids.shape[1]), rows=ids.shape[0], tp=world_size)
    modelled = mode_bytes(work, world_size, 4)
    measured = roomy.layers[0]
    ratios = [modelled[i] / getattr(measured, m) for i, m in enumerate(("full", "selective", "keep"))]
    assert roomy.modes == (KEEP,) * LAYERS and most == roomy.base + roomy.transient + sum(m.keep for m in roomy.layers)
    results = {}
    for name, budget in (("most", most), ("least", least), ("between", (least + most) / 2)):
        loss, choice, grads = _step(tp, ids, budget)
        assert choice.predicted <= budget, (name, choice)
        torch.testing.assert_close(loss, out.loss, rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, expected_shard(tp, n, want[n], rank, world_size), rtol=1e-4, atol=1e-5)
        results[name] = list(choice.modes)
    assert results["most"] == [KEEP] * LAYERS and results["least"] == [FULL] * LAYERS
    assert set(results["between"]) - {FULL} and FULL in results["between"], results["between"]  # a mix

    # measured once per input shape: the cached choice is reused (the probe is not run again)
    from oases.schedule import budget as budget_module

    probes = []
    real = budget_module._probe
    budget_module._probe = lambda *a, **k: probes.append(1) or real(*a, **k)
    try:
        _step(tp, ids, most)
        assert probes == []
        _step(tp, ids[:, :16], most)  # another shape: measured
        assert probes == [1]
    finally:
        budget_module._probe = real

    # an explicit budget below full recomputation's need: refused, naming the smallest that fits
    with pytest.raises(ValueError, match=rf"memory_budget: .* give at least {int(least)} bytes"):
        _step(tp, ids, least - 1)

    # the default budget (the device's memory) too small: full recomputation, one warning
    real_available, real_free = budget_module._meminfo_available, torch.cuda.mem_get_info
    budget_module._meminfo_available = lambda: 1  # the CPU's MemAvailable
    torch.cuda.mem_get_info = lambda device=None: (1, real_free(device)[1])  # a GPU's free bytes
    try:
        with pytest.warns(UserWarning, match="recompute='auto': the device's memory"):
            _, fallback, _ = _step(tp, ids[:, :8], None)
        assert fallback.modes == (FULL,) * LAYERS
    finally:
        budget_module._meminfo_available = real_available
        torch.cuda.mem_get_info = real_free

    # sequence parallelism: every layer recomputes
    _, sp, _ = _step(tp, ids, 10**12, sequence_parallel=True)
    assert sp.modes == (FULL,) * LAYERS and sp.reason == "sequence parallel"
    dist.barrier()
    return results, ratios


def test_the_budget_decides_each_layer_and_ranks_agree():
    ranks = run_ranks(_check_budgets, 2, timeout=180)
    assert ranks[0][0] == ranks[1][0]  # both ranks chose the same modes
    full, selective, keep = ranks[0][1]  # the planner's bytes / the probe's, at TP 2
    assert full == pytest.approx(1.0, abs=1e-9) and selective == pytest.approx(1.0, abs=0.03), ranks[0][1]
    assert keep == pytest.approx(1.0, abs=0.12), ranks[0][1]  # 0.90 measured: the model counts fewer unsharded tensors


def _check_dropout(rank, world_size):
    """GPT with dropout: "auto" (keeping every layer) gives full recomputation's loss and
    gradients bit for bit: the probe draws no random numbers and moves no mask."""
    config = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=3, mlp_ratio=2, dropout=0.25)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3)).to(rank_device())
    got = {}
    for recompute in (True, "auto"):
        torch.manual_seed(7)
        model = GPT(config, schedule="oases", seed=5).to(rank_device())
        memory = RecomputeMemory()
        loss = model.train_step(tokens, tokens, recompute=recompute, memory_budget=10**12, memory=memory)
        got[recompute] = loss, [p.grad.clone() for p in model.parameters()], memory.choice
    assert got["auto"][2].modes == (KEEP,) * 3
    assert torch.equal(got[True][0], got["auto"][0])
    assert all(torch.equal(a, b) for a, b in zip(got[True][1], got["auto"][1]))
    return True


def test_auto_with_dropout_is_bit_equal_to_full_recomputation():
    assert run_ranks(_check_dropout, 2, timeout=120) == [True, True]


def test_greedy_upgrades_by_time_saved_per_byte():
    """choose_modes: nothing beyond full when the budget is the inputs; selective first (most time
    saved per byte), then keep; None below full recomputation's need."""
    layer = LayerModes(full=1.0, selective=6.0, keep=10.0)
    layers = [layer] * 3
    assert choose_modes(layers, 3.0) == (FULL,) * 3
    assert choose_modes(layers, 2.0) is None
    assert choose_modes(layers, 3 + 3 * 5.0) == (SELECTIVE,) * 3
    assert choose_modes(layers, 3 + 3 * 5.0 + 4.0) == (SELECTIVE, SELECTIVE, KEEP)
    assert choose_modes(layers, 30.0) == (KEEP,) * 3
    # a layer whose selective graph holds as much as its kept one: kept directly
    assert choose_modes([LayerModes(1.0, 10.0, 10.0)], 10.0) == (KEEP,)


def _check_peak(rank, world_size):
    """The step's measured peak (VmRSS rise, glibc returning every large block) against the
    predicted activations and transients of each choice: never above (+5%), not far below."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench._rss import PeakRSS, exact_malloc, settle

    exact_malloc()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=384,
        num_hidden_layers=3,
        intermediate_size=1024,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=1024,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model)
    ids = torch.randint(0, 1024, (8, 192), generator=torch.Generator().manual_seed(2))
    memory = RecomputeMemory()
    oases.train_step(model, ids, ids, recompute="auto", memory_budget=10**12, memory=memory)  # gradients made
    roomy = memory.choice
    ratios = {}
    for budget in (roomy.predicted, roomy.smallest):
        oases.train_step(model, ids, ids, recompute="auto", memory_budget=budget)  # measured and chosen
        memory = RecomputeMemory()
        settle()
        with PeakRSS(interval=0.0005) as peak:
            oases.train_step(model, ids, ids, recompute="auto", memory_budget=budget, memory=memory)
        predicted = memory.choice.predicted - memory.choice.base  # what the step adds: activations, transients
        ratios[memory.choice.modes[0]] = peak.rise / predicted
    return ratios


@cpu_only("measures the step's peak in host memory (VmRSS)")
def test_the_measured_peak_stays_within_the_prediction():
    (ratios,) = run_ranks(_check_peak, 1, timeout=120)
    assert set(ratios) == {KEEP, FULL}, ratios
    for mode, ratio in ratios.items():
        assert 0.7 <= ratio <= 1.05, ratios  # measured 0.87-0.99 of the prediction on this machine


def test_bench_recompute_quick(tmp_path):
    """`python -m bench recompute --quick`: the sweep from full recomputation's need to every layer
    kept, each budget's choice within it, every layer recomputed at the first and kept at the last."""
    from test_bench import _run_suite_on_ranks

    doc, stdout, _ = _run_suite_on_ranks("recompute", tmp_path)
    records = doc["cases"]
    assert "recompute: recompute='auto' across budgets" in stdout and len(records) == 3
    layers = records[0]["config"]["layers"]
    assert records[0]["modes"]["full"] == layers and records[-1]["modes"]["keep"] == layers
    for r in records:
        assert r["predicted_peak_bytes"] <= r["budget_bytes"] * (1 + 1e-9)
        assert all(t > 0 for t in r["t_step"].values()) and r["measured_rise_bytes"] >= 0
