"""Suite `planner`: the cost model's predicted step time against the measured one.

    python -m bench planner --bandwidth 750mbit           # 2 ranks, hidden 256 and 512
    python -m bench planner --bandwidth 250mbit --hiddens 512
    python -m bench planner --quick                       # seconds (tests)

One run profiles this machine and link (bench.profile's microbenchmarks: sublayer compute per TP
degree and rows, all-reduce / all-gather fits, overlap efficiency), predicts each configuration's
step with oases.planner (Workload + step_cost, eqs. 3-5) from that profile alone, and measures
the step (median, MAX over ranks) with oases.models.GPT on the existing runtime. The compute and
overlap microbenchmarks run round-robin with the steps in one Timer.measure (the link fits
before): on a shared machine whose load moves compute times by up to 2x within minutes, the
profile and the steps it predicts then see the same load.

    tp2-<schedule>[-n]   GPT on the 2-rank TP group, train_step on `schedule` with n sub-batches
                         (every layer at TP degree 2)
    tp2-<schedule>-sp    the same with sequence_parallel=True (each all-reduce as reduce-scatter +
                         all-gather: the planner's other collective form)
    dp-<schedule>[-n]    every layer at TP degree 1: GPT on a group of one, each rank its half of
                         the batch, then the gradients summed over the ranks (one flat all-reduce)

`--breakdown` also times each configuration's compute alone (communication dry-run; DP: without
the gradient all-reduce) and the time its host thread waited on communication, beside the
predicted compute: where an error comes from.

Reports per configuration predicted / measured / error, and over all: Spearman's rank
correlation and the mean and largest |error| (targets: Spearman >= 0.9, within 20%); a scatter
plot (PNG). Links differ between runs, not within one: run the suite at several --bandwidth.

`--mixed` times a per-layer plan instead (the Oases Table II pattern): with the same measured
profile, oases.planner.plan_degrees picks a degree per layer under a per-rank memory budget
(default: halfway between uniform degree 1 and uniform degree 2, so degree 1 everywhere does not
fit), and the suite measures GPT(config, group, tp_degrees=planned) against the uniform plans
[2]*L and [1]*L on the same runtime (train_step on the overlapped "oases" schedule, 2 sub-batches,
each layer at its degree), and against that schedule at TP 2 without tp_degrees:

    python -m bench planner --bandwidth 250mbit --mixed --hiddens 128 --layers 4 --batch 16
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from bench import profile as _profile
from bench._report import Table, pyplot, save_figure
from oases.models import GPT, GPTConfig
from oases.planner import ModelShape, Workload, plan_degrees, step_cost
from oases.planner.profile import profile_from_dict

VARIANTS = (("megatron", 1), ("merak", 2), ("cross_pass", 2), ("oases", 2), ("oases", 4))
SP_VARIANTS = (("oases", 2),)  # sequence parallel: each all-reduce as reduce-scatter + all-gather
DP_VARIANTS = (("megatron", 1), ("oases", 2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hiddens", default=None, help="hidden sizes, comma-separated (default 256,512; --quick: 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=None, help="default 8 (--quick: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (--quick: 16)")
    parser.add_argument(
        "--mixed", action="store_true", help="time the planner's per-layer plan against the uniform plans (see above)"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each configuration's compute alone (communication dry-run; DP: without "
        "the gradient all-reduce) and its exposed communication, beside the predicted parts",
    )
    parser.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="with --mixed: per-rank bytes (default: halfway between uniform degree 1 and 2)",
    )


def _flat_all_reduce(model: torch.nn.Module) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _dry(model, fn) -> None:
    with model.comm.dry_run():
        fn()


def _configurations(ctx, config: GPTConfig, shape: ModelShape, alone, tokens: torch.Tensor, targets: torch.Tensor):
    """{name: step fn}, {name: (Workload, degree)}, {name: the step's compute alone}, {name: TP model}."""
    batch = tokens.shape[0]
    half = slice(ctx.rank * batch // 2, (ctx.rank + 1) * batch // 2)
    steps, works, compute_only, models = {}, {}, {}, {}
    tp_cases = [
        (f"tp2-{s}" + (f"-{n}" if n != (1 if s == "megatron" else 2) else ""), s, n, False) for s, n in VARIANTS
    ]
    tp_cases += [(f"tp2-{s}-sp", s, n, True) for s, n in SP_VARIANTS]
    for name, schedule, n, sp in tp_cases:
        model = GPT(config, ctx.group, schedule=schedule, seed=0, sequence_parallel=sp)
        models[name] = model
        steps[name] = lambda m=model, n=n: m.train_step(tokens, targets, sub_batches=n, recompute=True)
        compute_only[name] = lambda m=model, n=n: _dry(
            m, lambda: m.train_step(tokens, targets, sub_batches=n, recompute=True)
        )
        works[name] = (Workload(shape, rows=batch, tp=2, schedule=schedule, sub_batches=n, sequence_parallel=sp), 2)
    for schedule, n in DP_VARIANTS:
        name = f"dp-{schedule}"
        model = GPT(config, alone, schedule=schedule, seed=0)

        def dp_step(m=model, n=n) -> None:
            m.train_step(tokens[half], targets[half], sub_batches=n, recompute=True)
            _flat_all_reduce(m)

        steps[name] = dp_step
        compute_only[name] = lambda m=model, n=n: m.train_step(
            tokens[half], targets[half], sub_batches=n, recompute=True
        )
        works[name] = (Workload(shape, rows=batch, tp=2, schedule=schedule, sub_batches=n), 1)
    return steps, works, compute_only, models


def _breakdown(ctx, steps: dict, alone: dict, models: dict) -> dict[str, dict[str, float]]:
    """Per configuration: the step's compute alone (`alone`: timed with communication dry-run; DP:
    without the gradient all-reduce) and the seconds the step's host thread waited on
    communication (TP schedules: Communicator.waited; DP: the gradient all-reduce, not overlapped)."""
    waited = {}
    for name, model in models.items():
        model.comm.reset()
        for _ in range(3):
            steps[name]()
        waited[name] = model.comm.waited / 3
    local = torch.tensor([waited.get(name, 0.0) for name in steps], dtype=torch.float64)
    local = ctx.timer.max_over_ranks(local).tolist()
    return {
        name: {"measured_compute_s": alone[name].median, "measured_waited_s": local[i] if name in models else None}
        for i, name in enumerate(steps)
    }


def _spearman(x: list[float], y: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def run(args, ctx) -> list[dict]:
    if ctx.world_size != 2:
        raise ValueError(
            f"--nproc: the planner suite runs on 2 ranks (TP 2 and its DP counterpart), got {ctx.world_size}"
        )
    quick = args.quick
    hiddens = [int(h) for h in (args.hiddens or ("64" if quick else "256,512")).split(",")]
    batch, seq_len = args.batch or (4 if quick else 8), args.seq_len or (16 if quick else 64)
    singles = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank makes every group
    alone = singles[ctx.rank]
    g = torch.Generator().manual_seed(0)
    records = []
    for hidden in hiddens:
        config = GPTConfig(vocab_size=64, seq_len=seq_len, hidden=hidden, heads=args.heads, layers=args.layers)
        shape = ModelShape(
            layers=config.layers,
            hidden=hidden,
            heads=config.heads,
            seq_len=seq_len,
            vocab_size=config.vocab_size,
            ffn_hidden=config.mlp_ratio * hidden,
            name=f"gpt-h{hidden}",
        )
        started = time.perf_counter()
        rows = sorted({max(batch * d // 2 // n, 1) for d in (1, 2) for _, n in (*VARIANTS, *DP_VARIANTS)})
        head = _profile.measure_head(ctx, config, sorted({batch // 2, batch}))
        row_bytes = seq_len * hidden * 4
        layer_bytes = _profile.measure_memory(config, [1])[0]["layer_param_bytes"]
        sizes = sorted({row_bytes * r for r in rows} | {layer_bytes * config.layers})
        collectives = _profile.measure_collectives(ctx, sizes)
        tokens = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g)
        targets = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g)
        if args.mixed:
            compute = _profile.measure_compute(ctx, config, [1, 2], rows)
            overlap = _profile.measure_overlap(ctx, config, batch // 2, 2)
            doc = _profile.profile_document(ctx, config, compute, head, collectives, [], overlap)
            profile = replace(profile_from_dict(doc, source="measured in this run"), element_bytes=4)
            records += _mixed_case(ctx, config, shape, profile, tokens, targets, args.memory_budget)
            continue
        steps, works, compute_only, models = _configurations(ctx, config, shape, alone, tokens, targets)
        # the profile's compute and overlap calls run round-robin with the steps (one Timer.measure):
        # a shared machine's load, which moves compute times by up to 2x within minutes, then weighs
        # on the microbenchmarks and on the steps they predict alike
        compute_fns = _profile.compute_variants(ctx, config, [1, 2], rows)
        overlap_fns = _profile.overlap_variants(ctx, config, batch // 2, 2)  # the oases schedule's unit
        dry = {f"dry/{name}": fn for name, fn in compute_only.items()} if args.breakdown else {}
        measured = ctx.timer.measure({**steps, **compute_fns, **overlap_fns, **dry})
        compute = _profile.compute_samples(config, compute_fns, measured)
        overlap = _profile.overlap_result(overlap_fns, measured)
        doc = _profile.profile_document(ctx, config, compute, head, collectives, [], overlap)
        profile = replace(profile_from_dict(doc, source="measured in this run"), element_bytes=4)
        profile_s = time.perf_counter() - started
        parts = (
            _breakdown(ctx, steps, {name: measured[f"dry/{name}"] for name in compute_only}, models)
            if args.breakdown
            else {}
        )
        for name, (work, degree) in works.items():
            cost = step_cost(work, profile, [degree] * config.layers)
            t = measured[name].median
            records.append(
                {
                    "config": name,
                    "hidden": hidden,
                    "layers": config.layers,
                    "batch": batch,
                    "seq_len": seq_len,
                    "schedule": work.schedule,
                    "sub_batches": work.n,
                    "tp_degree": degree,
                    "sequence_parallel": work.sequence_parallel,
                    "predicted_s": cost.time_s,
                    "predicted_compute_s": cost.compute_s,
                    "predicted_comm_s": cost.comm_s,
                    "predicted_memory_bytes": cost.memory_bytes,
                    "measured_s": t,
                    "measured_min_s": measured[name].min,
                    "error": (cost.time_s - t) / t,
                    "profile_s": profile_s,
                    "overlap_efficiency": profile.overlap,
                    "overlap": overlap,
                    **parts.get(name, {}),
                    "profile": {"compute": compute, "head": head, "collectives": collectives},
                }
            )
    if args.mixed:
        return records
    predicted_all = [r["predicted_s"] for r in records]
    measured_all = [r["measured_s"] for r in records]
    rho = _spearman(predicted_all, measured_all) if len(records) > 2 else float("nan")
    errors = [abs(r["error"]) for r in records]
    for r in records:
        r["spearman"] = None if np.isnan(rho) else rho
        r["mean_abs_error"] = float(np.mean(errors))
        r["max_abs_error"] = float(np.max(errors))
        r["within_20pct"] = sum(e <= 0.2 for e in errors)
    return records


def _mixed_case(
    ctx,
    config: GPTConfig,
    shape: ModelShape,
    profile,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    budget: Optional[float],
) -> list[dict]:
    """The planner's per-layer degrees under `budget` against the uniform plans, all measured."""
    work = Workload(shape, rows=tokens.shape[0], tp=2, schedule="oases", sub_batches=2)
    uniform = {d: plan_degrees(work, profile, math.inf, degrees=(d,)) for d in (1, 2)}
    budget = budget or (uniform[1].memory_bytes + uniform[2].memory_bytes) / 2
    planned = plan_degrees(work, profile, budget)
    plans = {"planned": planned.degrees, "uniform-2": (2,) * config.layers, "uniform-1": (1,) * config.layers}
    steps = {}
    for name, degrees in plans.items():
        model = GPT(config, ctx.group, tp_degrees=list(degrees), schedule="oases", seed=0)
        steps[name] = lambda m=model: m.train_step(tokens, targets, sub_batches=2, recompute=True)
    overlapped = GPT(config, ctx.group, schedule="oases", seed=0)
    steps["tp2-oases"] = lambda: overlapped.train_step(tokens, targets, sub_batches=2, recompute=True)
    predicted = {
        name: plan_degrees(work, profile, math.inf, degrees=tuple(sorted(set(d)))) if len(set(d)) == 1 else planned
        for name, d in plans.items()
    }
    measured = ctx.timer.measure(steps)
    fits = [name for name in ("uniform-1", "uniform-2") if predicted[name].memory_bytes <= budget]
    best = min(fits, key=lambda name: measured[name].median, default=None)
    records = []
    for name, timing in measured.items():
        p = predicted.get(name)
        records.append(
            {
                "case": "mixed",
                "config": name,
                "hidden": config.hidden,
                "layers": config.layers,
                "batch": tokens.shape[0],
                "seq_len": tokens.shape[1],
                "tp_degrees": list(plans.get(name, (2,) * config.layers)),
                "runtime": "train_step oases, 2 sub-batches" + ("" if p is None else ", tp_degrees"),
                "predicted_s": None if p is None else p.time_s,
                "predicted_memory_bytes": None if p is None else p.memory_bytes,
                "fits_budget": None if p is None else p.memory_bytes <= budget,
                "memory_budget_bytes": budget,
                "measured_s": timing.median,
                "measured_min_s": timing.min,
                "best_fitting_uniform": best,
                "speedup_vs_best_fitting_uniform": (None if best is None else measured[best].median / timing.median),
            }
        )
    return records


def _mixed_tables(records: list[dict]) -> list[Table]:
    rows = [
        [
            r["config"],
            r["hidden"],
            str(r["tp_degrees"]),
            r["runtime"],
            "-" if r["predicted_s"] is None else 1e3 * r["predicted_s"],
            "-" if r["predicted_memory_bytes"] is None else r["predicted_memory_bytes"] / 1e6,
            "-" if r["fits_budget"] is None else ("yes" if r["fits_budget"] else "no"),
            1e3 * r["measured_s"],
            "-" if r["speedup_vs_best_fitting_uniform"] is None else r["speedup_vs_best_fitting_uniform"],
        ]
        for r in records
    ]
    r0 = records[0]
    return [
        Table(
            f"planner --mixed: per-layer plan vs uniform ({r0['layers']} layers, batch {r0['batch']} x "
            f"{r0['seq_len']}, memory budget {r0['memory_budget_bytes'] / 1e6:.2f} MB per rank)",
            [
                "config",
                "hidden",
                "degrees",
                "runtime",
                "predicted ms",
                "pred MB",
                "fits",
                "measured ms",
                "x vs best fitting uniform",
            ],
            rows,
            [
                "predicted: oases.planner.plan_degrees (schedule oases, 2 sub-batches) from the profile measured "
                "in this run; every plan runs on that schedule (per-layer degrees included)",
                "the budget is declared, not this machine's: every plan fits in its RAM",
            ],
        )
    ]


def tables(records: list[dict]) -> list[Table]:
    if records and records[0].get("case") == "mixed":
        return _mixed_tables(records)
    rows = [
        [
            r["config"],
            r["hidden"],
            r["tp_degree"],
            r["sub_batches"],
            1e3 * r["predicted_compute_s"],
            1e3 * r["predicted_comm_s"],
            1e3 * r["predicted_s"],
            1e3 * r["measured_s"],
            100 * r["error"],
        ]
        for r in records
    ]
    header = [
        "config",
        "hidden",
        "degree",
        "n",
        "pred comp ms",
        "pred comm ms",
        "predicted ms",
        "measured ms",
        "error %",
    ]
    r0 = records[0]
    if "measured_compute_s" in r0:  # --breakdown
        header += ["meas comp ms", "comp err %", "meas waited ms"]
        for row, r in zip(rows, records):
            waited = r["measured_waited_s"]
            row += [
                1e3 * r["measured_compute_s"],
                100 * (r["predicted_compute_s"] - r["measured_compute_s"]) / r["measured_compute_s"],
                "-" if waited is None else 1e3 * waited,
            ]
    spearman = "n/a" if r0["spearman"] is None else f"{r0['spearman']:.3f}"
    return [
        Table(
            f"planner: predicted vs measured step ({r0['layers']} layers, batch {r0['batch']} x {r0['seq_len']})",
            header,
            rows,
            [
                f"Spearman {spearman} over {len(records)} configurations; |error| mean "
                f"{100 * r0['mean_abs_error']:.1f}%, max {100 * r0['max_abs_error']:.1f}%, "
                f"{r0['within_20pct']}/{len(records)} within 20%",
                "predicted: oases.planner.step_cost from a profile measured in this run (compute per sublayer, "
                "TP degree and rows; collectives fitted as latency + bytes / bandwidth; overlap efficiency "
                + ", ".join(f"{o:.2f}" for o in sorted({r["overlap_efficiency"] for r in records}))
                + ")",
            ],
        )
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    if records and records[0].get("case") == "mixed":
        return False
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 5))
    pred = np.array([1e3 * r["predicted_s"] for r in records])
    meas = np.array([1e3 * r["measured_s"] for r in records])
    for hidden in sorted({r["hidden"] for r in records}):
        pick = [i for i, r in enumerate(records) if r["hidden"] == hidden]
        ax.scatter(meas[pick], pred[pick], label=f"hidden {hidden}", zorder=3)  # above the band
        for i in pick:
            ax.annotate(records[i]["config"], (meas[i], pred[i]), fontsize=6)
    top = 1.1 * max(pred.max(), meas.max())
    line = np.array([0, top])
    ax.plot(line, line, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(line, 0.8 * line, 1.2 * line, color="0.85", label="within 20%")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step ms (median, MAX over ranks)")
    ax.set_ylabel("predicted step ms (oases.planner)")
    rho = records[0]["spearman"]
    ax.set_title(f"{title}\nSpearman {rho if rho is None else round(rho, 3)}", fontsize=8)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
