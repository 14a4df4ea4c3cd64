"""`python -m bench recompute`: train_step's recompute="auto" across memory budgets, from full
recomputation's need to every layer kept (the budget sweep).

    python -m bench recompute                         # 2 ranks, HF Llama (8 layers, hidden 512)
    python -m bench recompute --bandwidth 2gbit       # on a shaped link
    python -m bench recompute --quick                 # small, seconds (tests)

The model is bench.layers' HF Llama (transformers' LlamaForCausalLM, oases.parallelize at TP =
the ranks). One step at an unbounded budget gives the choice's figures: `smallest` (every layer
recomputed) and `most` (every layer kept). Then for each of `--points` budgets evenly from the
smallest to the most, per rank:

    choice     the modes recompute="auto" picked (counts of keep / selective / full) and its
               predicted peak (RecomputeChoice.predicted; the activations and transients: minus `base`)
    t_step     oases.train_step(model, ids, ids, recompute="auto", memory_budget=budget): median
               and min over --iters (MAX over ranks), the choice measured before timing
    rise       VmRSS rise during one step (glibc returning every large block: bench._rss), MAX over
               ranks, beside the predicted activations and transients
    pinned     recompute=True and recompute=False at the same shape, in the same round-robin

A CPU measurement of a CPU run (the device's allocator is not involved): the prediction's own
check. Records carry the budgets and figures in bytes and seconds; the PNG plots step time and
the measured rise against the budget.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from bench._llama import parallelized
from bench._report import Table, pyplot, save_figure
from bench._rss import PeakRSS, exact_malloc, settle

QUICK = dict(layers=2, hidden=128, heads=4, kv_heads=2, batch=4, seq_len=32, points=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--points", type=int, default=6, help="budgets in the sweep (default 6)")
    parser.add_argument("--schedule", default="oases")


def _settings(args) -> dict[str, int]:
    if args.quick:
        return dict(QUICK)
    keys = ("layers", "hidden", "heads", "kv_heads", "batch", "seq_len", "points")
    return {k: getattr(args, k) for k in keys}


def _max(ctx, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def run(args, ctx) -> list[dict]:
    import oases
    from oases.schedule import RecomputeMemory

    exact_malloc()
    s = _settings(args)
    config, model = parallelized(s, ctx)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (s["batch"], s["seq_len"]), generator=g).to(ctx.device)

    def step(recompute: Any, budget: Any = None, memory: Any = None) -> None:
        model.zero_grad(set_to_none=False)
        oases.train_step(
            model, ids, ids, schedule=args.schedule, recompute=recompute, memory_budget=budget, memory=memory
        )

    memory = RecomputeMemory()
    step("auto", 10**15, memory)
    roomy = memory.choice
    smallest, most = roomy.smallest, roomy.predicted
    n = max(2, s["points"])
    budgets = [smallest + (most - smallest) * i / (n - 1) for i in range(n)]
    records = []
    for budget in budgets:
        memory = RecomputeMemory()
        step("auto", budget, memory)  # measured and chosen (cached from here on)
        choice = memory.choice
        timing = ctx.timer.measure(
            {
                "auto": lambda b=budget: step("auto", b),
                "full": lambda: step(True),
                "keep": lambda: step(False),
            }
        )
        settle()
        with PeakRSS(interval=0.0005) as peak:
            step("auto", budget)
        predicted = choice.predicted - choice.base
        (rise,) = _max(ctx, [float(peak.rise)])
        records.append(
            {
                "kind": "budget",
                "budget_bytes": budget,
                "modes": {m: choice.modes.count(m) for m in ("keep", "selective", "full")},
                "layer_modes": list(choice.modes),
                "predicted_peak_bytes": choice.predicted,
                "predicted_rise_bytes": predicted,
                "measured_rise_bytes": rise,
                "rise_over_predicted": rise / predicted if predicted else None,
                "t_step": {name: t.median for name, t in timing.items()},
                "t_step_min": {name: t.min for name, t in timing.items()},
                "smallest_bytes": smallest,
                "most_bytes": most,
                "config": {**s, "schedule": args.schedule, "tp": ctx.world_size},
            }
        )
    return records


def tables(records: list[dict]) -> list[Table]:
    rows = []
    for r in records:
        modes = r["modes"]
        t = r["t_step"]
        rows.append(
            [
                f"{r['budget_bytes'] / 2**20:.1f}",
                f"{modes['keep']}/{modes['selective']}/{modes['full']}",
                f"{r['predicted_rise_bytes'] / 2**20:.1f}",
                f"{r['measured_rise_bytes'] / 2**20:.1f}",
                f"{r['rise_over_predicted']:.2f}" if r["rise_over_predicted"] is not None else None,
                f"{1e3 * t['auto']:.1f}",
                f"{1e3 * t['full']:.1f}",
                f"{1e3 * t['keep']:.1f}",
                f"{t['full'] / t['auto']:.2f}x",
            ]
        )
    c = records[0]["config"] if records else {}
    return [
        Table(
            f"recompute: recompute='auto' across budgets (HF Llama {c.get('layers')} layers, hidden "
            f"{c.get('hidden')}, batch {c.get('batch')} x {c.get('seq_len')}, TP {c.get('tp')}, {c.get('schedule')})",
            [
                "budget MiB",
                "keep/sel/full",
                "predicted MiB",
                "rise MiB",
                "rise/pred",
                "auto ms",
                "full ms",
                "keep ms",
                "full/auto",
            ],
            rows,
            [
                "budget: the rank's whole peak; predicted / rise: what the step adds (activations and transients),",
                "predicted by the probe and measured as the VmRSS rise of one step (MAX over ranks);",
                "auto / full / keep: recompute='auto' at that budget, recompute=True and False, timed round-robin",
            ],
        )
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    if not records:
        return False
    plt = pyplot()

    budgets = [r["budget_bytes"] / 2**20 for r in records]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(budgets, [1e3 * r["t_step"]["auto"] for r in records], marker="o", label="recompute='auto'")
    left.plot(budgets, [1e3 * r["t_step"]["full"] for r in records], linestyle="--", label="recompute=True")
    left.plot(budgets, [1e3 * r["t_step"]["keep"] for r in records], linestyle=":", label="recompute=False")
    left.set_xlabel("memory_budget (MiB, the rank's peak)")
    left.set_ylabel("ms per step (median, MAX over ranks)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(budgets, [r["predicted_rise_bytes"] / 2**20 for r in records], marker="o", label="predicted")
    right.plot(budgets, [r["measured_rise_bytes"] / 2**20 for r in records], marker="s", label="measured (VmRSS)")
    right.set_xlabel("memory_budget (MiB)")
    right.set_ylabel("what the step adds (MiB)")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
