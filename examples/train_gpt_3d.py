"""Train a GPT with pipeline x data (x tensor) parallelism on 2 emulated servers; 1F1B vs FOLD3D's AIAO.

    python examples/train_gpt_3d.py                          # PP2 x DP2 on 4 ranks, 2 hosts, 500 Mbit/s NICs
    python examples/train_gpt_3d.py --tp 2                   # PP2 x DP2 x TP2 on 8 ranks
    python examples/train_gpt_3d.py --bandwidth none         # unshaped loopback, one host

Started outside a distributed launch, the script re-launches itself through `oases-launch
--hosts 2` on 4 * tp ranks: ranks 0..2tp-1 on host 0 (data-parallel replica 0: both pipeline
stages, each TP-sharded tp ways), the rest on host 1. Mesh ("dp", "pp", "tp") = (2, 2, tp), so
TP and PP stay inside a host and the data-parallel gradient sync crosses the shaped NICs.
Each schedule trains the same model (same seed, same batches of the corpus of examples/_common)
with `oases.pipeline.Pipeline`; their losses agree step by step, only the step time differs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from oases.models import GPTConfig
from oases.pipeline import Pipeline

from _common import VOCAB, batches, compare, corpus, launch_or_run, parser, progress, summarize

PP, DP, HOSTS = 2, 2, 2


def _args(argv=None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(tp=1, bandwidth="500mbit", layers=8, hidden=256, batch=16, steps=20)
    p.add_argument("--intra-bandwidth", default=None, help="link rate inside a host (default unshaped)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument(
        "--segments",
        default="2",
        help="aiao's segments ns (layers divisible by 2 * ns), or 'auto' (FOLD3D's rule, measured)",
    )
    p.add_argument("--schedules", default="1f1b,aiao", help="comma-separated, first is the baseline")
    return p.parse_args(argv)


def train(schedule: str, config: GPTConfig, data: torch.Tensor, args, show: bool) -> dict:
    mesh = init_device_mesh("cpu", (DP, PP, args.tp), mesh_dim_names=("dp", "pp", "tp"))
    segments = args.segments if args.segments == "auto" else int(args.segments)
    pipe = Pipeline(
        config,
        mesh,
        schedule=schedule,
        segments=1 if schedule == "1f1b" else segments,
        micro_batches=args.micro_batches,
        seed=0,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
    )
    label = schedule if schedule == "1f1b" else f"{schedule}-ns{args.segments}"
    losses, times = [], []
    for i, (tokens, targets) in enumerate(batches(data, args.steps, args.batch, config.seq_len)):
        dist.barrier()
        start = time.perf_counter()
        losses.append(float(pipe.train_step(tokens, targets)))
        if i == 0 and schedule != "1f1b":  # "auto" is chosen on the first step
            label = f"{schedule}-ns{pipe.segments}"
        if i == args.steps - 1:
            pipe.close()  # the last step's DP sync and update, inside its time
        times.append(time.perf_counter() - start)
        if show:
            progress(label, i + 1, args.steps, losses[-1])
    return summarize(label, times, None, losses, args.batch * config.seq_len)


def run(args) -> None:
    config = GPTConfig(
        vocab_size=len(VOCAB), seq_len=args.seq_len, hidden=args.hidden, heads=args.heads, layers=args.layers
    )
    data = corpus(200_000)
    describe = (
        f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads; batch {args.batch} x "
        f"{args.seq_len} tokens, {args.micro_batches} micro-batches; PP{PP} x DP{DP} x TP{args.tp} "
        f"on {{tp}} ranks, DP across {HOSTS} hosts joined by {{link}}; {args.steps} steps per schedule"
    )
    compare(describe, args.schedules.split(","), lambda schedule, show: train(schedule, config, data, args, show))


def main(argv=None) -> int:
    args = _args(argv)
    return launch_or_run(
        __file__,
        PP * DP * args.tp,
        args.bandwidth,
        argv,
        lambda: run(args),
        hosts=HOSTS,
        intra_bandwidth=args.intra_bandwidth,
    )


if __name__ == "__main__":
    sys.exit(main())
