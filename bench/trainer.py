"""Suite `trainer`: transformers' Trainer on Oases (OasesTrainer) against transformers' own TP and one rank.

    python -m bench trainer --bandwidth 750mbit     # 2 ranks on the emulated 750 Mbit/s link
    python -m bench trainer                         # unshaped loopback
    python -m bench trainer --quick --runs 1        # small shapes, seconds (tests)

One model, one data set, one TrainingArguments, three ways to train it:

    oases    OasesTrainer(model=model, args=args, ..., tp_size=p, schedule=--schedule): the plain
             model, parallelized inside (oases.parallelize over the TP mesh, its defaults), trained
             with oases.train_step; what a Trainer user gets by changing one class name
    hf_tp    transformers.Trainer on transformers' own TP: the same weights saved and loaded with
             `from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto", tp_size=p))`
             (bench._llama.hf_tp: the model's own plan on DTensor); accelerate 1.15 refuses the
             ParallelismConfig Trainer makes for it on CPU ranks (MULTI_CPU), a check lifted here on
             CPU only (_accelerate_tp_on_cpu), nothing else changed
    1 rank   transformers.Trainer in one process of its own, with as many intra-op threads as each
             rank has: one device's worth of compute. Every rank starts one at once, so that each
             runs on a machine as loaded as under TP (on a shared host the other cores' load
             counts alike); MAX over them, as for the TP variants

The model is `bench layers --model llama`'s (transformers' LlamaForCausalLM, seeded: 2 layers,
hidden 512, 8 heads, 4 KV heads, vocabulary padded to a multiple of p; --quick: hidden 64), the
data `--batch` x `--seq-len` rows of random tokens (labels = inputs), the arguments: AdamW at a
constant 1e-3, max_grad_norm 1.0, fp32, a loss logged every step, save_strategy "no". Each
variant trains `--warmup + --iters + 1` steps from the same weights on the same batches, `--runs`
times, the variants taking turns (oases, hf_tp, 1 rank, oases, ...) so a drifting machine drifts
for all of them. The three must log the same first loss (to 1e-4): a wrong peer fails the run.

    t_step      the median interval between consecutive optimizer steps' ends after the first
                --warmup (Trainer's whole step: batch, forward, backward, clipping, optimizer,
                logging), MAX over ranks; t_min the fastest interval (MAX over ranks)
    steps/s     1 / t_step
    x hf_tp, x 1 rank   oases' t_step ratio in the same run; `low` = the lower of the runs' ratios

Beside the trainer's step, oases' core (a second table, on the model the last OasesTrainer
trained): `oases.train_step` alone on one batch, timed round-robin with megatron's schedule,
the same step with its all-reduces counted but not sent (t_compute, Communicator.dry_run) and
its all-reduces alone (t_comm); bound = max(t_compute, t_comm), efficiency against megatron's
step as in `bench layers`, and the trainer's overhead = t_step - train_step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bench import _llama, _metrics
from bench._peers import agree
from bench._report import Table, pyplot, save_figure

OURS, HF_TP, ONE = "oases", _llama.HF_TP, "1 rank"
VARIANTS = (OURS, HF_TP, ONE)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
LOSS_RTOL = 1e-4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=None, help="default 512 (--quick: 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=None, help="per_device_train_batch_size; default 8 (--quick: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (--quick: 16)")
    parser.add_argument("--schedule", default="oases", help="OasesTrainer's schedule (default: oases)")
    parser.add_argument("--runs", type=int, default=2, help="rounds of the three variants (default: 2)")


def check_args(args, world: int) -> Optional[str]:
    """Refusals the launching process can state before any rank starts."""
    if world < 2:
        return "trainer: --nproc 2 or more (the TP variants shard over every rank)"
    if args.runs < 1:
        return f"trainer: --runs must be >= 1, got {args.runs}"
    from oases.schedule import SCHEDULES

    if args.schedule not in SCHEDULES:
        return f"trainer: --schedule must be one of {', '.join(SCHEDULES)}, got {args.schedule!r}"
    return None


def _spec(args, ctx) -> dict[str, Any]:
    """What every variant (the 1-rank process too) builds the same model, data and arguments from."""
    quick = args.quick
    return {
        "config": {
            "hidden": args.hidden or (64 if quick else 512),
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "layers": args.layers,
            "seq_len": args.seq_len or (16 if quick else 64),
            "world_size": ctx.world_size,
        },
        "batch": args.batch or (4 if quick else 8),
        "steps": args.warmup + args.iters + 1,
        "warmup": args.warmup,
        "device": ctx.device.type,
        "threads": torch.get_num_threads(),
    }


# ---- what the three variants share ------------------------------------------------------------------
def _rows(spec: dict, vocab: int) -> list[dict[str, torch.Tensor]]:
    """steps x batch rows of random tokens (seed 0), labels = inputs (the model shifts them)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (spec["steps"] * spec["batch"], spec["config"]["seq_len"]), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _training_args(spec: dict, output_dir: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=spec["batch"],
        max_steps=spec["steps"],
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=spec["device"] == "cpu",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def _clock():
    """A TrainerCallback recording when each optimizer step ended."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    return Clock()


def _train(make: Callable[..., Any], spec: dict, output_dir: str) -> tuple[dict, Any]:
    """make(args, train_dataset, callbacks) -> a Trainer; train it. (this rank's figures, the trainer)"""
    from transformers import PrinterCallback

    clock = _clock()
    trainer = make(_training_args(spec, output_dir), callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # the logs stay in trainer.state.log_history
    trainer.train()
    intervals = [b - a for a, b in zip(clock.ends, clock.ends[1:])][spec["warmup"] :]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    figures = {"median": statistics.median(intervals), "min": min(intervals), "losses": losses}
    return figures, trainer


def _reset_accelerate() -> None:
    """Forget the last Trainer's accelerate state, so that the next one sets up its own layout."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


@contextlib.contextmanager
def _accelerate_tp_on_cpu(device: torch.device):
    """accelerate 1.15 refuses, on CPU ranks, the ParallelismConfig(tp_size=p) that Trainer makes for
    a model loaded with DistributedConfig ("ParallelismConfig is only compatible DistributedType.FSDP
    (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got
    DistributedType.MULTI_CPU."); inside, that one check is skipped on CPU (the mesh, the data split
    by DP rank and the rest are accelerate's own). On GPUs nothing changes."""
    from accelerate.parallelism_config import ParallelismConfig

    check = ParallelismConfig._validate_accelerator

    def validate(config, accelerator) -> None:
        if accelerator.distributed_type.name != "MULTI_CPU":
            check(config, accelerator)

    if device.type == "cpu":
        ParallelismConfig._validate_accelerator = validate
    try:
        yield
    finally:
        ParallelismConfig._validate_accelerator = check


# ---- the variants -------------------------------------------------------------------------------------
def _ours(spec: dict, reference, rows, schedule: str, out: str) -> tuple[dict, Any]:
    from transformers import default_data_collator

    from oases.integrations.transformers import OasesTrainer

    def make(args, callbacks):
        return OasesTrainer(
            model=copy.deepcopy(reference),
            args=args,
            train_dataset=rows,
            data_collator=default_data_collator,
            callbacks=callbacks,
            tp_size=dist.get_world_size(),
            schedule=schedule,
        )

    return _train(make, spec, out)


def _hf_tp(spec: dict, reference, rows, device: torch.device, out: str) -> tuple[dict, Any]:
    from transformers import Trainer, default_data_collator

    peer = _llama.hf_tp(reference, dist.get_world_size(), from_pretrained=agree(_llama.has_accelerate(), device))

    def make(args, callbacks):
        with _accelerate_tp_on_cpu(device):
            return Trainer(
                model=peer.model,
                args=args,
                train_dataset=rows,
                data_collator=default_data_collator,
                callbacks=callbacks,
            )

    figures, trainer = _train(make, spec, out)
    figures["peer"] = peer.describe()
    return figures, trainer


def _one_rank(spec: dict, out: str) -> dict:
    """The 1-rank variant: every rank runs `python -m bench.trainer SPEC OUT` at once (no launch
    environment: a plain Trainer in one process), so that each process has the machine as loaded
    as under TP (the other cores busy); this rank's figures."""
    path = os.path.join(out, f"one-rank-{dist.get_rank()}.json")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    if spec["device"] == "cuda":  # this rank's GPU, as the process's only one (cuda:0 there)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[torch.cuda.current_device()]
    done = subprocess.run(
        [sys.executable, "-m", "bench.trainer", json.dumps(spec), path],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    error = None if done.returncode == 0 else f"the 1-rank Trainer failed ({done.returncode}): {done.stderr[-2000:]}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = next((e for e in errors if e), None)
    if failed is not None:
        raise RuntimeError(f"trainer: {failed}")
    with open(path) as f:
        return json.load(f)


def _alone(spec: dict, path: str) -> None:
    """The 1-rank process: a plain transformers.Trainer on the same model, data and arguments."""
    from transformers import Trainer, default_data_collator
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    config = _llama.llama_config(**spec["config"])
    reference = _llama.build(config)
    rows = _rows(spec, config.vocab_size)
    with tempfile.TemporaryDirectory() as out:

        def make(args, callbacks):
            return Trainer(
                model=reference, args=args, train_dataset=rows, data_collator=default_data_collator, callbacks=callbacks
            )

        figures, _ = _train(make, spec, out)
    with open(path, "w") as f:
        json.dump(figures, f)


# ---- oases' core: the step without the Trainer around it ---------------------------------------------
def _core(ctx, trainer, rows, spec: dict, schedule: str) -> dict:
    """oases.train_step on the trainer's model: the step, megatron's, compute-only, all-reduces alone."""
    import oases
    from oases.schedule import Communicator

    model, group, p = trainer.model, trainer.device_mesh["tp"].get_group(), trainer.tp_size
    ids = torch.stack([r["input_ids"] for r in rows[: spec["batch"]]]).to(ctx.device)
    comms = {name: Communicator(group, p) for name in ("megatron", schedule)}

    def step(name: str) -> Callable[[], object]:
        def run() -> object:
            model.zero_grad(set_to_none=True)
            return oases.train_step(model, ids, ids, schedule=name, comm=comms[name], recompute=trainer.recompute)

        return run

    def dry() -> object:
        with comms[schedule].dry_run():
            return step(schedule)()

    step(schedule)()
    comms[schedule].reset()
    step(schedule)()
    calls, sent = sum(comms[schedule].calls.values()), sum(comms[schedule].bytes.values())
    replay = torch.zeros(round(sent / max(calls, 1) * p / (2 * max(p - 1, 1)) / 4), device=ctx.device)

    def all_reduces() -> None:
        for _ in range(calls):
            dist.all_reduce(replay, group=group)

    timed = ctx.timer.measure(
        {"train_step": step(schedule), "megatron": step("megatron"), "compute": dry, "comm": all_reduces}
    )
    model.zero_grad(set_to_none=True)
    t_step, t_megatron = timed["train_step"].median, timed["megatron"].median
    t_compute, t_comm = timed["compute"].median, timed["comm"].median
    bound = _metrics.bound(t_compute, t_comm)
    return {
        "schedule": schedule,
        "t_train_step": t_step,
        "t_megatron": t_megatron,
        "t_compute": t_compute,
        "t_comm": t_comm,
        "bound": bound,
        "efficiency": _metrics.efficiency(t_megatron, t_step, bound),
        "speedup_vs_megatron": _metrics.speedup(t_megatron, t_step),
        "all_reduces": calls,
        "sent_bytes": sent,
    }


# ---- the suite ---------------------------------------------------------------------------------------
def run(args, ctx) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    spec = _spec(args, ctx)
    config = _llama.llama_config(**spec["config"])
    reference = _llama.build(config).to(ctx.device)
    rows = _rows(spec, config.vocab_size)
    reason = _llama.hf_tp_unavailable(ctx.device)
    if not agree(reason is None, ctx.device):
        raise RuntimeError(f"trainer: transformers' own TP cannot run here: {reason or 'unavailable on another rank'}")
    box = [tempfile.mkdtemp(prefix="bench-trainer-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    out, runs, last = box[0], [], None
    try:
        for index in range(args.runs):
            figures: dict[str, dict] = {}
            for name in VARIANTS:
                with ctx.trace.span(f"{name} run {index + 1}", 0):
                    if name == OURS:
                        figures[name], last = _ours(spec, reference, rows, args.schedule, os.path.join(out, name))
                    elif name == HF_TP:
                        figures[name], _ = _hf_tp(spec, reference, rows, ctx.device, os.path.join(out, name))
                    else:
                        figures[name] = _one_rank(spec, out)
                _reset_accelerate()
            runs.append(_reduced(ctx, figures))
        core = _core(ctx, last, rows, spec, args.schedule)
    finally:
        dist.barrier()
        if ctx.rank == 0:
            import shutil

            shutil.rmtree(out, ignore_errors=True)
    return _records(args, config, spec, runs, core)


def _reduced(ctx, figures: dict[str, dict]) -> dict[str, dict]:
    """Each variant's times, MAX over ranks; the first losses checked against the 1-rank Trainer's."""
    for name in VARIANTS:
        local = torch.tensor([figures[name]["median"], figures[name]["min"]], dtype=torch.float64)
        figures[name]["median"], figures[name]["min"] = ctx.timer.max_over_ranks(local).tolist()
    want = figures[ONE]["losses"][0]
    for name, f in figures.items():
        if abs(f["losses"][0] - want) > LOSS_RTOL * abs(want):
            raise AssertionError(
                f"trainer: {name}'s first loss {f['losses'][0]} differs from the 1-rank Trainer's {want}"
            )
    return figures


def _records(args, config, spec: dict, runs: list[dict], core: dict) -> list[dict]:
    c = config
    title = (
        f"HF LlamaForCausalLM {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads "
        f"({c.num_key_value_heads} KV), vocab {c.vocab_size}, batch {spec['batch']} x {spec['config']['seq_len']}, "
        f"{spec['steps']} steps a run"
    )
    records = []
    for index, figures in enumerate(runs):
        ours = figures[OURS]["median"]
        for name in VARIANTS:
            f = figures[name]
            records.append(
                {
                    "variant": name,
                    "run": index + 1,
                    "t_step": f["median"],
                    "t_min": f["min"],
                    "steps_per_s": 1.0 / f["median"],
                    "speedup_vs": {
                        peer: _metrics.speedup(figures[peer]["median"], ours) for peer in VARIANTS if peer != OURS
                    }
                    if name == OURS
                    else None,
                    "loss_first": f["losses"][0],
                    "loss_last": f["losses"][-1],
                    "peer": f.get("peer"),
                }
            )
    mine = [r for r in records if r["variant"] == OURS]
    lowest = {peer: min(r["speedup_vs"][peer] for r in mine) for peer in VARIANTS if peer != OURS}
    for r in records:
        r.update(
            title=title,
            config={**spec["config"], "batch": spec["batch"], "steps": spec["steps"], "schedule": args.schedule},
            speedup_low=lowest if r["variant"] == OURS else None,
            core=core,
        )
    return records


def tables(records: list[dict]) -> list[Table]:
    rows = []
    for r in records:
        vs = r["speedup_vs"] or {}
        rows.append(
            [
                r["variant"],
                r["run"],
                1e3 * r["t_step"],
                1e3 * r["t_min"],
                r["steps_per_s"],
                vs.get(HF_TP),
                vs.get(ONE),
                r["loss_first"],
                r["loss_last"],
            ]
        )
    low = next(r["speedup_low"] for r in records if r["variant"] == OURS)
    core = records[0]["core"]
    ms = 1e3
    return [
        Table(
            f"trainer: {records[0]['title']}",
            ["variant", "run", "t_step ms", "t_min ms", "steps/s", f"x {HF_TP}", f"x {ONE}", "loss first", "loss last"],
            rows,
            [
                f"oases vs {HF_TP}: "
                + ", ".join(f"{r['speedup_vs'][HF_TP]:.2f}x" for r in records if r["variant"] == OURS)
                + f" (low {low[HF_TP]:.2f}x); vs {ONE}: "
                + ", ".join(f"{r['speedup_vs'][ONE]:.2f}x" for r in records if r["variant"] == OURS)
                + f" (low {low[ONE]:.2f}x)",
                "t_step = median interval between optimizer steps' ends after the warm-up (the whole Trainer step), "
                "MAX over ranks; x = the peer's t_step / oases' in the same run",
                f"{HF_TP}: from_pretrained(DistributedConfig(tp_plan='auto')), Trainer on it; on CPU accelerate's "
                "MULTI_CPU refusal of its ParallelismConfig skipped (see bench.trainer)",
                f"{ONE}: plain Trainer, one process, as many intra-op threads as a rank; one on every rank at once "
                "(the machine as loaded as under TP), MAX over them",
            ],
        ),
        Table(
            f"trainer: oases' core (oases.train_step alone on the trained model, schedule {core['schedule']})",
            ["train_step ms", "megatron ms", "t_compute ms", "t_comm ms", "bound ms", "efficiency", "x megatron"],
            [
                [
                    ms * core["t_train_step"],
                    ms * core["t_megatron"],
                    ms * core["t_compute"],
                    ms * core["t_comm"],
                    ms * core["bound"],
                    core["efficiency"],
                    core["speedup_vs_megatron"],
                ]
            ],
            [
                "bound = max(t_compute, t_comm); efficiency = (t_megatron - train_step) / (t_megatron - bound); "
                f"{core['all_reduces']} all-reduces, {core['sent_bytes'] / 2**20:.1f} MiB sent per step",
                "trainer overhead (oases' t_step - train_step), by run: "
                + ", ".join(
                    f"{ms * (r['t_step'] - core['t_train_step']):.0f} ms" for r in records if r["variant"] == OURS
                ),
            ],
        ),
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    plt = pyplot()

    runs = sorted({r["run"] for r in records})
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, run_index in enumerate(runs):
        mine = {r["variant"]: r for r in records if r["run"] == run_index}
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(VARIANTS))]
        ax.bar(xs, [1e3 * mine[v]["t_step"] for v in VARIANTS], width=width, label=f"t_step, run {run_index}")
    core = records[0]["core"]
    for value, style, label in ((core["t_train_step"], "--", "oases.train_step alone"), (core["bound"], ":", "bound")):
        ax.hlines(1e3 * value, -0.4, 0.4, colors="black", linestyles=style, label=label)
    ax.set_xticks(range(len(VARIANTS)))
    ax.set_xticklabels(VARIANTS)
    ax.set_ylabel("ms per optimizer step (MAX over ranks)")
    ax.set_title(f"{records[0]['title']}\n{title}", fontsize=8)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


if __name__ == "__main__":  # the 1-rank variant's process: python -m bench.trainer SPEC OUT
    _alone(json.loads(sys.argv[1]), sys.argv[2])
