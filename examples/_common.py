"""What the training examples share: a deterministic corpus, batches, a progress bar, the
summary table, and the re-launch through oases-launch when started outside a distributed launch."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

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


# ---- reporting -----------------------------------------------------------------------------------
def progress(label: str, done: int, total: int, loss: float) -> None:
    """A bar redrawn in place on a terminal; every 10th step on its own line in a log."""
    width = 30
    bar = "#" * (width * done // total) + "-" * (width - width * done // total)
    line = f"  {label:<10} [{bar}] {done:>3}/{total} loss {loss:.4f}"
    if sys.stdout.isatty():
        print("\r" + line, end="\n" if done == total else "", flush=True)
    elif done % 10 == 0 or done == total:
        print(line, flush=True)


def summarize(
    schedule: str, times: list[float], waited: Optional[list[float]], losses: list[float], tokens: int
) -> dict:
    """One schedule's figures over every rank: median step time of the slowest rank, the least
    busy rank's busy fraction (share of the step not blocked on communication), first/last loss."""
    warm = 2 if len(times) > 4 else 0  # the first steps pay one-off allocation costs
    timed = torch.tensor(times[warm:], dtype=torch.float64)
    dist.all_reduce(timed, op=dist.ReduceOp.MAX)
    busy = None
    if waited is not None:  # None: the step's waits are not observable from the example
        busy = torch.tensor([1.0 - sum(waited[warm:]) / sum(times[warm:])], dtype=torch.float64)
        dist.all_reduce(busy, op=dist.ReduceOp.MIN)
    step_time = float(timed.median())
    return {
        "schedule": schedule,
        "step_s": step_time,
        "tokens_per_s": tokens / step_time,
        "busy": None if busy is None else float(busy),
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def print_table(results: list[dict]) -> bool:
    """The comparison table; the first result is the baseline of the speedup column. Returns
    whether every schedule ended on the baseline's loss (to 1e-4)."""
    base = results[0]
    print(
        f"\n{'schedule':<12} {'step ms':>9} {'tokens/s':>10} {'busy':>6} {'loss first':>11} "
        f"{'loss last':>10} {'speedup':>8}"
    )
    for r in results:
        busy = "n/a" if r["busy"] is None else f"{r['busy']:.2f}"
        print(
            f"{r['schedule']:<12} {1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>10.0f} {busy:>6} "
            f"{r['loss_first']:>11.4f} {r['loss_last']:>10.4f} {base['step_s'] / r['step_s']:>7.2f}x"
        )
    print("busy: fraction of the step not blocked on communication (the least busy rank)")
    for r in results:
        if r.get("recompute"):
            print(f"{r['schedule']}: {r['recompute']}")
    same = all(abs(r["loss_last"] - base["loss_last"]) <= 1e-4 * abs(base["loss_last"]) for r in results)
    print()
    for r in results[1:]:
        ratio = base["step_s"] / r["step_s"]
        pace = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
        print(
            f"{r['schedule']} vs {base['schedule']}: {pace} per training step"
            + (", same losses (to 1e-4)" if same else ", BUT THE LOSSES DIFFER")
        )
    return same


def parser(description: str) -> argparse.ArgumentParser:
    """The options both examples take: ranks, link, steps and the model's sizes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--bandwidth", default="750mbit", help="emulated link rate, or 'none' (default 750mbit)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    return p


def train_loop(
    label: str,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    data: Iterable,
    waited: Callable[[], float],
    steps: int,
    tokens_per_step: int,
    show: bool,
) -> dict:
    """`steps` timed training steps (step(tokens, targets) -> loss, then optimizer.step());
    `waited()` is the communicator's running time blocked on communication. -> summarize(...)."""
    losses, times, blocked = [], [], []
    for i, (tokens, targets) in enumerate(data):
        dist.barrier()
        start, waited_before = time.perf_counter(), waited()
        optimizer.zero_grad(set_to_none=True)
        loss = step(tokens, targets)
        optimizer.step()
        times.append(time.perf_counter() - start)
        blocked.append(waited() - waited_before)
        losses.append(float(loss))
        if show:
            progress(label, i + 1, steps, losses[-1])
    return summarize(label, times, blocked, losses, tokens_per_step)


def compare(describe: str, labels: list[str], train: Callable[[str, bool], dict]) -> None:
    """One rank of a launch: train each of `labels` in turn, print the table on rank 0; exit
    with an error there if the losses differ."""
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    link = os.environ.get("OASES_BANDWIDTH", "unshaped loopback")
    if rank == 0:
        print(describe.format(tp=world, link=link))
    results = [train(label, rank == 0) for label in labels]
    same = print_table(results) if rank == 0 else True
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    if not same:
        raise SystemExit("the schedules' losses differ: a numerics bug")


def launch_or_run(
    script: str,
    tp: int,
    bandwidth: str,
    argv,
    run: Callable[[], None],
    *,
    hosts: int = 1,
    intra_bandwidth: Optional[str] = None,
) -> int:
    """Inside a launch (RANK set): run(). Outside: re-launch `script` on `tp` ranks through
    oases-launch, on a link shaped to `bandwidth` ('none': unshaped); with `hosts` > 1 the ranks
    are packed into that many emulated servers joined by `bandwidth` (`intra_bandwidth` inside one)."""
    if "RANK" in os.environ:
        run()
        return 0
    from oases.launch import main as launch

    shaping = [] if bandwidth == "none" else ["--bandwidth", bandwidth]
    if shaping and hosts > 1:
        shaping += ["--hosts", str(hosts)] + ([] if intra_bandwidth is None else ["--intra-bandwidth", intra_bandwidth])
    return launch(["--nproc", str(tp), *shaping, os.path.abspath(script), *(sys.argv[1:] if argv is None else argv)])
