"""Suite `layers`: a TP GPT's training step on every schedule, beside PyTorch's own TP.

    python -m bench layers --bandwidth 500mbit      # communication comparable to compute
    python -m bench layers                          # unshaped: what sub-batching alone does here

The ablation of the Oases paper (megatron -> merak -> cross_pass -> oases) on the same model,
data and weights, measured in one run (variants round-robin, medians, MAX over ranks). Per
schedule:

    t_step      forward + backward (`GPT.train_step`)
    t_compute   the same step with the all-reduces counted but not sent (Communicator.dry_run)
    t_comm      the step's all-reduces alone: as many, as large, blocking, back to back
    bound       max(t_compute, t_comm); efficiency = (t_megatron - t_step) / (t_megatron - bound)
    busy        1 - (time blocked on communication) / t_step, the least busy rank
    peak MiB    rise of the process's peak resident memory during one step (VmHWM reset first,
                glibc set to return freed blocks at once; measured after all timings)
    sent MiB    bytes all-reduced per step

`torch_tp` is the same model written for PyTorch's DTensor tensor parallelism
(`parallelize_module`, ColwiseParallel for q/k/v/fc1, RowwiseParallel for proj/fc2) with the
same weights, trained with plain autograd (no recomputation, blocking collectives); its loss is
checked against ours before timing. Sub-batches run smaller GEMMs, which on a CPU can be faster
by themselves (cache): compare t_compute across schedules, and run the suite unshaped too.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bench import _metrics
from bench._report import Table
from oases.models import GPT, GPTConfig
from oases.schedule import SCHEDULES
from oases.schedule.runtime import _Work

BASELINE = "megatron"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc malloc.h)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=None, help="default 512 (--quick: 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=None, help="default 8 (--quick: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (--quick: 16)")


def _config(args) -> tuple[GPTConfig, int]:
    quick = args.quick
    hidden = args.hidden or (64 if quick else 512)
    seq_len = args.seq_len or (16 if quick else 64)
    batch = args.batch or (4 if quick else 8)
    return GPTConfig(vocab_size=64, seq_len=seq_len, hidden=hidden, heads=args.heads, layers=args.layers), batch


# ---- PyTorch's tensor parallelism on the same model -------------------------------------------
class _Block(nn.Module):
    """The same pre-LN block as oases.models.GPT, in the form DTensor TP expects (q, k, v apart)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        h, width = c.hidden, c.mlp_ratio * c.hidden
        self.head_dim = h // c.heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.proj = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, width), nn.Linear(width, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class _TorchGPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.hidden), nn.Embedding(c.seq_len, c.hidden)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.layers))
        self.norm_f, self.lm_head = nn.LayerNorm(c.hidden), nn.Linear(c.hidden, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _torch_tp(config: GPTConfig, ours: GPT, mesh) -> nn.Module:
    """_TorchGPT parallelized by DTensor, holding the same weights as `ours` (this rank's shards)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _TorchGPT(config).to(ours.wte.weight.device)
    plan = {}
    for i in range(config.layers):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("proj", "fc2")})
    parallelize_module(model, mesh, plan)
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            local = name.replace(".0.norm.", ".norm1.").replace(".1.norm.", ".norm2.")
            local = local.replace(".0.qkv.", ".{}.").replace(".0.proj.", ".proj.")
            local = local.replace(".1.fc1.", ".fc1.").replace(".1.fc2.", ".fc2.")
            targets = [local.format(n) for n in "qkv"] if "{}" in local else [local]
            for target, part in zip(targets, p.chunk(len(targets))):
                dest = theirs[target]
                (dest.to_local() if hasattr(dest, "to_local") else dest).copy_(part)
    return model


# ---- measurements -----------------------------------------------------------------------------
def _peak_rise_mib(step) -> Optional[float]:
    """Rise of this process's peak resident memory over one call of `step` (Linux, glibc).

    glibc keeps freed blocks for reuse, so resident memory would not follow the tensors alive;
    with every block over 64 KiB mmap-ed and returned at once (mallopt), it does. That slows
    allocation, so call this only after every timing. None where /proc or glibc is missing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)

        def status(key: str) -> int:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(key))

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        before = status("VmRSS:")
    except (OSError, StopIteration):
        return None
    step()
    return (status("VmHWM:") - before) / 1024


@contextlib.contextmanager
def _traced_waits(ctx, label: str):
    """Record every communication wait of the block as a span on tid 1, the block on tid 0."""
    original = _Work.wait

    def wait(work):
        with ctx.trace.span(f"{label} wait", 1):
            original(work)

    _Work.wait = wait
    try:
        with ctx.trace.span(f"{label} step", 0):
            yield
    finally:
        _Work.wait = original


def run(args, ctx) -> list[dict]:
    config, batch = _config(args)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(ctx.device)
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(ctx.device)
    models = {name: GPT(config, ctx.group, schedule=name, seed=0).to(ctx.device) for name in SCHEDULES}
    losses = {name: float(m.train_step(tokens, targets)) for name, m in models.items()}

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch_tp = _torch_tp(config, models[BASELINE], mesh)
    with torch.no_grad():
        losses["torch_tp"] = float(torch_tp(tokens, targets))
    for name, loss in losses.items():
        if abs(loss - losses[BASELINE]) > 1e-4 * abs(losses[BASELINE]):
            raise AssertionError(f"layers: {name} loss {loss} differs from {BASELINE}'s {losses[BASELINE]}")

    def torch_step() -> None:
        torch_tp(tokens, targets).backward()

    steps = {name: (lambda m=m: m.train_step(tokens, targets)) for name, m in models.items()}
    timed = ctx.timer.measure({**steps, "torch_tp": torch_step})

    for m in models.values():
        m.comm.dry_run = True
    compute = ctx.timer.measure({name: (lambda m=m: m.train_step(tokens, targets)) for name, m in models.items()})

    records = []
    for name, m in models.items():
        m.comm.dry_run = False
        m.comm.reset()
        busy_before = time.perf_counter()
        with _traced_waits(ctx, name):
            m.train_step(tokens, targets)
        step_s = time.perf_counter() - busy_before
        calls, sent = sum(m.comm.calls.values()), sum(m.comm.bytes.values())
        # MIN over ranks of the busy share (host time: on CUDA, waits do not block the host)
        busy = -ctx.timer.max_over_ranks(torch.tensor([m.comm.waited / step_s - 1.0], dtype=torch.float64))
        size = sent // max(calls, 1) // 4
        replay = torch.zeros(size, device=ctx.device)
        t_comm = ctx.timer.measure({"comm": lambda: [dist.all_reduce(replay) for _ in range(calls)]})["comm"]
        records.append(_record(name, timed[name].median, compute[name].median, t_comm.median,
                               float(busy), calls, sent, losses[name]))
    records.append(_record("torch_tp", timed["torch_tp"].median, None, None, None, None, None,
                           losses["torch_tp"]))
    for r, step in zip(records, [*steps.values(), torch_step]):  # after every timing: see _peak_rise_mib
        peak = _peak_rise_mib(step)
        r["peak_mib"] = None if peak is None else float(ctx.timer.max_over_ranks(torch.tensor([peak], dtype=torch.float64)))
    base = next(r for r in records if r["schedule"] == BASELINE)
    for r in records:
        r["speedup_vs_megatron"] = _metrics.speedup(base["t_step"], r["t_step"])
        r["speedup_vs_torch_tp"] = _metrics.speedup(records[-1]["t_step"], r["t_step"])
        r["efficiency"] = (None if r["bound"] is None
                           else _metrics.efficiency(base["t_step"], r["t_step"], r["bound"]))
    for r in records:
        r["config"] = {"hidden": config.hidden, "layers": config.layers, "heads": config.heads,
                       "batch": batch, "seq_len": config.seq_len}
    return records


def _record(name: str, t_step: float, t_compute: Optional[float], t_comm: Optional[float],
            busy: Optional[float], calls: Optional[int], sent: Optional[int], loss: float) -> dict:
    bound = None if t_compute is None else _metrics.bound(t_compute, t_comm)
    return {"schedule": name, "t_step": t_step, "t_compute": t_compute, "t_comm": t_comm, "bound": bound,
            "busy": busy, "all_reduces": calls, "sent_bytes": sent, "loss": loss}


def tables(records: list[dict]) -> list[Table]:
    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else 1e3 * v

    c = records[0]["config"]
    rows = [[r["schedule"], ms(r["t_step"]), ms(r["t_compute"]), ms(r["t_comm"]), ms(r["bound"]),
             r["efficiency"], r["busy"], r["speedup_vs_megatron"], r["speedup_vs_torch_tp"], r["peak_mib"],
             None if r["sent_bytes"] is None else r["sent_bytes"] / 2**20, r["all_reduces"]] for r in records]
    return [Table(
        f"layers: GPT {c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, batch {c['batch']} x {c['seq_len']}",
        ["schedule", "t_step ms", "t_compute ms", "t_comm ms", "bound ms", "efficiency", "busy",
         "x megatron", "x torch_tp", "peak MiB", "sent MiB", "all-reduces"], rows,
        ["efficiency = (t_megatron - t_step) / (t_megatron - bound); busy = share of the step not "
         "blocked on communication (least busy rank)",
         "torch_tp: DTensor ColwiseParallel/RowwiseParallel, plain autograd (no recomputation)"])]


def plot(records: list[dict], path: str, title: str) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["schedule"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [1e3 * r["t_step"] for r in records], color="tab:blue", label="t_step")
    ax.bar(names, [1e3 * (r["t_compute"] or 0) for r in records], color="tab:green", width=0.4,
           label="t_compute (communication not sent)")
    for i, r in enumerate(records):
        if r["bound"] is not None:
            ax.hlines(1e3 * r["bound"], i - 0.4, i + 0.4, colors="black", linestyles=":",
                      label="bound max(compute, comm)" if i == 0 else None)
    ax.set_ylabel("ms per training step (MAX over ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
