"""Train a small GPT with tensor parallelism on the Megatron and the Oases schedules; compare.

    python examples/train_gpt.py                       # 2 ranks on a 750 Mbit/s emulated link
    python examples/train_gpt.py --bandwidth none      # unshaped loopback
    torchrun --nproc-per-node 2 examples/train_gpt.py  # on a real cluster (no re-launch)

Started outside a distributed launch, the script re-launches itself through `oases-launch` with
`--nproc --tp` ranks on a link shaped to `--bandwidth`. Each schedule trains the same model
(same seed) on the same batches of a deterministic character-level corpus ("the quiet link
overlaps a red kernel."), so their losses agree step by step; only the step time differs.
"""

from __future__ import annotations

import argparse
import sys

import torch

from oases.models import GPT, GPTConfig

from _common import VOCAB, batches, compare, corpus, launch_or_run, parser, train_loop


def _args(argv=None) -> argparse.Namespace:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--schedules", default="megatron,oases", help="comma-separated, first is the baseline")
    return p.parse_args(argv)


def train(schedule: str, config: GPTConfig, data: torch.Tensor, args, show: bool) -> dict:
    model = GPT(config, schedule=schedule, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return train_loop(
        schedule,
        model.train_step,
        optimizer,
        batches(data, args.steps, args.batch, config.seq_len),
        lambda: model.comm.waited,
        args.steps,
        args.batch * config.seq_len,
        show,
    )


def run(args) -> None:
    config = GPTConfig(
        vocab_size=len(VOCAB), seq_len=args.seq_len, hidden=args.hidden, heads=args.heads, layers=args.layers
    )
    data = corpus(200_000)
    describe = (
        f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads; batch {args.batch} x "
        f"{args.seq_len} tokens; TP={{tp}} on {{link}}; {args.steps} steps per schedule"
    )
    compare(describe, args.schedules.split(","), lambda schedule, show: train(schedule, config, data, args, show))


def main(argv=None) -> int:
    args = _args(argv)
    return launch_or_run(__file__, args.tp, args.bandwidth, argv, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
