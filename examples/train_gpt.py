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
import os
import sys
import time

import torch
import torch.distributed as dist

from oases.models import GPT, GPTConfig


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--bandwidth", default="750mbit", help="emulated link rate, or 'none' (default 750mbit)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedules", default="megatron,oases", help="comma-separated, first is the baseline")
    return p.parse_args(argv)


# ---- data: a deterministic corpus from a tiny grammar, one character per token -------------
VOCAB = "abcdefghijklmnopqrstuvwxyz .\n"
WORDS = {
    "det": ["the", "a", "every", "no"],
    "adj": ["small", "quiet", "red", "clever", "old", "bright"],
    "noun": ["server", "link", "rank", "kernel", "model", "switch", "cluster"],
    "verb": ["sends", "waits for", "computes", "gathers", "reduces", "overlaps"],
}
SENTENCE = ["det", "adj", "noun", "verb", "det", "adj", "noun"]


def corpus(chars: int, seed: int = 0) -> torch.Tensor:
    """`chars` tokens (ids into VOCAB) of sentences like "the quiet link overlaps a red kernel."."""
    g = torch.Generator().manual_seed(seed)
    text, length = [], 0
    while length < chars:
        words = [WORDS[part][int(torch.randint(0, len(WORDS[part]), (), generator=g))] for part in SENTENCE]
        line = " ".join(words) + ".\n"
        text.append(line)
        length += len(line)
    return torch.tensor([VOCAB.index(c) for c in "".join(text)[:chars]], dtype=torch.long)


def batches(data: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int = 1):
    """`steps` (tokens, targets) pairs of [batch, seq_len] windows; targets shifted by one."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


# ---- one training run --------------------------------------------------------------------------
def _progress(label: str, done: int, total: int, loss: float) -> None:
    """A bar redrawn in place on a terminal; every 10th step on its own line in a log."""
    width = 30
    bar = "#" * (width * done // total) + "-" * (width - width * done // total)
    line = f"  {label:<10} [{bar}] {done:>3}/{total} loss {loss:.4f}"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if done == total else "", flush=True)
    elif done % 10 == 0 or done == total:
        print(line, flush=True)


def train(schedule: str, config: GPTConfig, data: torch.Tensor, args, show: bool) -> dict:
    model = GPT(config, schedule=schedule, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, times, waited = [], [], []
    for step, (tokens, targets) in enumerate(batches(data, args.steps, args.batch, config.seq_len)):
        dist.barrier()
        start, waited_before = time.perf_counter(), model.comm.waited
        optimizer.zero_grad(set_to_none=True)
        loss = model.train_step(tokens, targets)
        optimizer.step()
        times.append(time.perf_counter() - start)
        waited.append(model.comm.waited - waited_before)
        losses.append(float(loss))
        if show:
            _progress(schedule, step + 1, args.steps, losses[-1])
    warm = 2 if len(times) > 4 else 0  # the first steps pay one-off allocation costs
    # The slowest rank sets the pace: max over ranks of each step's time; busy: the least busy rank.
    timed = torch.tensor(times[warm:], dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    busy = torch.tensor([1.0 - sum(waited[warm:]) / sum(times[warm:])], dtype=torch.float64)
    dist.all_reduce(busy, op=dist.ReduceOp.MIN)
    step_time = float(timed.median())
    return {"schedule": schedule, "step_s": step_time, "tokens_per_s": args.batch * config.seq_len / step_time,
            "busy": float(busy), "loss_first": losses[0], "loss_last": losses[-1]}


def run(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=len(VOCAB), seq_len=args.seq_len, hidden=args.hidden, heads=args.heads,
                       layers=args.layers)
    data = corpus(200_000)
    link = os.environ.get("OASES_BANDWIDTH", "unshaped loopback")
    if rank == 0:
        print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads; batch {args.batch} x "
              f"{args.seq_len} tokens; TP={world} on {link}; {args.steps} steps per schedule")
    results = [train(s, config, data, args, show=rank == 0) for s in args.schedules.split(",")]
    if rank == 0:
        base = results[0]
        print(f"\n{'schedule':<10} {'step ms':>9} {'tokens/s':>10} {'busy':>6} {'loss first':>11} "
              f"{'loss last':>10} {'speedup':>8}")
        for r in results:
            print(f"{r['schedule']:<10} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.0f} {r['busy']:>6.2f} "
                  f"{r['loss_first']:>11.4f} {r['loss_last']:>10.4f} {base['step_s'] / r['step_s']:>7.2f}x")
        print("busy: fraction of the step not blocked on communication (the least busy rank)")
        print(f"\n{results[-1]['schedule']} vs {base['schedule']}: "
              f"{base['step_s'] / results[-1]['step_s']:.2f}x faster per training step, same losses")
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = _args(argv)
    if "RANK" in os.environ:  # already one rank of a launch
        run(args)
        return 0
    from oases.launch import main as launch

    shaping = [] if args.bandwidth == "none" else ["--bandwidth", args.bandwidth]
    return launch(["--nproc", str(args.tp), *shaping, os.path.abspath(__file__),
                   *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
