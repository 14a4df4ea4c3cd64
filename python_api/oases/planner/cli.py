"""`oases plan`: pick a layout and per-layer TP degrees for a model on a cluster, print it, write JSON.

    oases plan --model llama-7b --world 16 --device-memory 24GB --link 25gbit
    oases plan --model my_config.json --world 8 --device-memory 16GB --profile bench/profiles/cpu-x.json
    python -m oases plan ...                                 # the same (the command line: oases.cli)

The JSON (default plan.json) is read back by `oases.plan.load(path)` (the per-layer degrees) and
`oases.plan.sequence_parallel(path)` (whether to train with sequence_parallel=True).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from oases.planner.model import PRESETS, load_model
from oases.planner.profile import analytical_profile, load_profile
from oases.planner.search import Plan, plan

__all__ = ["DESCRIPTION", "add_arguments", "run", "render"]

DESCRIPTION = __doc__.splitlines()[0]


def _runs(values: Sequence) -> list[tuple[int, int]]:
    """[(first, last)] index ranges of equal consecutive values."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append((start, i - 1))
            start = i
    return out


def _form_line(p: Plan) -> str:
    """Which collective form won (Centauri's primitive substitution) and the other's step."""

    def ms(form: str) -> str:
        t = p.form_step_s.get(form)
        return "does not fit / cannot run" if t is None else f"{1e3 * t:.1f} ms"

    chosen = "reduce-scatter + all-gather (sequence_parallel=True)" if p.sequence_parallel else "all-reduce"
    efficiency = p.profile.get("chunk_efficiency") or {}
    measured = (
        "measured chunked-GEMM efficiency " + ", ".join(f"{n}: {e:.2f}" for n, e in efficiency.items())
        if efficiency
        else "chunked GEMMs assumed ideal (the profile has no chunk_efficiency)"
    )
    return (
        f"collectives: {chosen}; predicted step with all-reduces {ms('all_reduce')}, with RS + AG {ms('rs_ag')}\n"
        f"chunks: {p.chunks} per fused op (parallelize(model, chunks={p.chunks}); {measured})"
    )


def _recompute_line(p: Plan) -> str:
    """Each layer's recomputation (runs of equal layers folded) and what it saves."""
    modes = p.recompute or ("full",) * len(p.tp_degrees)
    runs = ", ".join(f"{modes[a]} {a}" if a == b else f"{modes[a]} {a}-{b}" for a, b in _runs(modes))
    saved = p.full_recompute_step_s - p.step_s if p.full_recompute_step_s else 0.0
    return (
        f"recompute per layer: {runs} (train_step(recompute=oases.plan.recompute(path))); "
        f"{1e3 * saved:.1f} ms less than recomputing every layer"
    )


def render(p: Plan) -> str:
    """The plan as a table: layout, per-layer degrees (runs of equal layers folded), predictions."""
    m = p.model
    experts = f", {m.experts} experts, top-{m.experts_per_token}" if m.experts else ""
    lines = [
        f"oases plan: {m.name} ({m.layers} layers, hidden {m.hidden}, {m.heads} heads{experts}, seq {m.seq_len}), "
        f"batch {p.batch}, {p.world} devices of {p.device_memory / 1e9:.3g} GB, profile {p.profile.get('source')}",
        f"layout: dp {p.dp} x pp {p.pp} x tp {p.tp}; schedule {p.schedule}, {p.sub_batches} sub-batch(es), "
        f"{p.micro_batches} micro-batch(es), {p.segments} segment(s), dp overlap ratio {p.dp_overlap_ratio:.2f}",
        _form_line(p),
        "",
    ]
    header = ["layers", "TP degree", "time ms", "compute ms", "comm ms", "memory MB", "dominated by"]
    rows = []
    keys = [(x["degree"], round(x["time_s"], 9), round(x["memory_bytes"])) for x in p.layers]
    for a, b in _runs(keys):
        x = p.layers[a]
        span = str(a) if a == b else f"{a}-{b}"
        rows.append(
            [
                span,
                str(x["degree"]),
                f"{1e3 * x['time_s']:.2f}",
                f"{1e3 * x['compute_s']:.2f}",
                f"{1e3 * x['comm_s']:.2f}",
                f"{x['memory_bytes'] / 1e6:.1f}",
                x["dominated_by"],
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = "  ".join("-" * w for w in widths)
    lines += [
        f"per layer of one pipeline stage ({m.layers // p.pp} layers"
        + (", repeated on each stage)" if p.pp > 1 else ")"),
        rule,
        "  ".join(h.rjust(w) for h, w in zip(header, widths)),
        rule,
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines += [rule, ""]
    uniform = p.uniform_step_s
    if p.mixed:
        verdict = (
            f"mixed per-layer degrees: {uniform / p.step_s:.3f}x faster than uniform TP {p.tp} ({1e3 * uniform:.1f} ms)"
            if uniform != float("inf")
            else f"uniform TP {p.tp} does not fit in memory"
        )
    else:
        verdict = "uniform: no mixed plan of this layout is predicted faster"
    lines += [
        f"predicted step: {1e3 * p.step_s:.1f} ms   memory: {p.memory_bytes / 1e9:.2f} GB per device   "
        f"dominated by: {p.dominated_by} (compute {1e3 * p.compute_s:.1f} ms, exposed comm "
        f"{1e3 * p.exposed_comm_s:.1f} ms)",
        verdict,
        _recompute_line(p),
        f"TP degrees per layer: {list(p.tp_degrees)}",
        f"planned in {1e3 * p.planner_s:.0f} ms over {p.candidates} layouts",
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `oases plan`."""
    p.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}) or a JSON config file "
        "(ModelShape fields, GPTConfig's or a Hugging Face config.json)",
    )
    p.add_argument("--world", required=True, type=int, help="number of devices (ranks)")
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 24GB, 80GiB")
    p.add_argument(
        "--link",
        help="link rate, tc syntax (25gbit, 750mbit); with --profile it replaces the "
        "measured link (required without --profile)",
    )
    p.add_argument("--profile", help="a profile JSON from `python -m bench profile` (default: analytical)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 2 x world)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--tp-max", type=int, default=8, help="largest TP group, e.g. GPUs per server (default 8)")
    p.add_argument(
        "--flops",
        type=float,
        default=100e12,
        help="device FLOP/s for the analytical model without --profile (default 1e14)",
    )
    p.add_argument("--out", default="plan.json", help="where to write the plan (default: plan.json)")


def run(args: argparse.Namespace) -> int:
    """`oases plan` on parsed arguments: 0 when the plan is written, 2 on a bad argument."""
    try:
        _check_out(args.out)
        shape = load_model(args.model, seq_len=args.seq_len)
        if args.profile:
            profile = load_profile(args.profile, link=args.link)
        elif args.link:
            profile = analytical_profile(flops_per_s=args.flops, link=args.link)
        else:
            raise ValueError("link: give --link RATE (e.g. 25gbit) or --profile FILE")
        batch = 2 * args.world if args.batch is None else args.batch
        result = plan(
            shape, world=args.world, device_memory=args.device_memory, batch=batch, profile=profile, tp_max=args.tp_max
        )
    except (ValueError, TypeError) as err:
        print(f"oases plan: {err}", file=sys.stderr)
        return 2
    result.save(args.out)
    try:
        print(render(result))
        print(f"wrote {args.out}", flush=True)
    except BrokenPipeError:  # `oases plan ... | head`: the reader left; the plan is written
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


def _check_out(path: str) -> None:
    """ValueError unless `path` can be written (checked before the search, which may take a while)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--out: {path} is a directory; name a file, e.g. {os.path.join(path, 'plan.json')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--out: the folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--out: the folder {folder} is not writable; choose another path")
