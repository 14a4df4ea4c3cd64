"""Suite `memory`: resident memory per rank (VmRSS) through a Llama's training job, phase by phase,
beside the planner's prediction (oases.planner.memory).

    python -m bench memory                 # 2 ranks: TP 2 + AdamW; DP 2 x TP 1 + AdamW; + ZeRO-1
                                           # (about 10 minutes and 16 GiB on 2 CPU cores)
    python -m bench memory --nproc 4       # TP 4; DP 2 x TP 2 + AdamW; + ZeRO-1
    python -m bench memory --quick         # a model of a few MiB: seconds (tests)

Rank 0 writes a Hugging Face LlamaForCausalLM (32k vocabulary, about 1.5 GiB of fp32 parameters;
--hidden / --layers / --vocab) with transformers' save_pretrained into a temporary folder under
--out, removed at the end. Then, per layout, every rank runs the phases of a job and reads VmRSS:

    build            with torch.device("meta"): LlamaForCausalLM(config); oases.parallelize(model,
                     tp_group, plan=DEFAULT_PLAN + vocab-parallel embedding / head, device="cpu",
                     init_weights=False)
    load_pretrained  oases.load_pretrained(model, dir)
    train            optimizer = AdamW | ZeroOptimizer(model, dp_group, AdamW); --steps x
                     (oases.train_step(model, ids, ids, schedule=, grad_sync=); step; zero_grad)
    save_checkpoint  oases.save_checkpoint(model, root, optimizer=, step=)
    load_checkpoint  oases.load_checkpoint(model, root, optimizer=)
    save_pretrained  oases.save_pretrained(model, out)

resident = VmRSS after the phase (gc.collect + malloc_trim first) minus VmRSS at the layout's start;
peak = the highest VmRSS sampled every --interval s during the phase minus the same start; MAX over
ranks. glibc's mmap threshold is fixed at 128 KiB (bench._rss.exact_malloc; --glibc-default leaves
it dynamic and skips the trims), so a freed tensor leaves RSS at once. The prediction is the
planner's model of the layout (shape from the HF config, tp, dp, ZeRO, AdamW, schedule, batch),
never the tensors this run allocated; `tensors` beside it is what the rank's tensors hold
(parameters, gradients, optimizer states, ZeRO masters), for explaining the gaps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from bench._report import Table, pyplot, save_figure
from bench._rss import PeakRSS, exact_malloc, rss_bytes, settle
from oases.planner import PHASES, MemoryJob, phase_memory, rank_memory, shape_from_config

MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --quick: 128)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; --quick: 2)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000; --quick: 2048)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, split over dp (default 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64; --quick: 16)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 3; --quick: 2)")
    parser.add_argument("--schedule", default="oases", help="oases.train_step schedule (default oases)")
    parser.add_argument("--interval", type=float, default=0.002, help="VmRSS sampling period, s (default 0.002)")
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's mmap threshold dynamic and skip malloc_trim (shows what they change)",
    )


def _config(args, tiny: bool = False) -> Any:
    """The Llama: heads of 128 (at least 8 heads), KV heads half of them, MLP 11/4 x hidden; `tiny`:
    the --quick model whatever the options (the warm-up's)."""
    from transformers import LlamaConfig

    quick = args.quick or tiny
    hidden = 128 if tiny else args.hidden or (128 if quick else 2048)
    heads = max(8, hidden // 128)
    return LlamaConfig(
        vocab_size=2048 if tiny else args.vocab or (2048 if quick else 32000),
        hidden_size=hidden,
        intermediate_size=11 * hidden // 4,
        num_hidden_layers=2 if tiny else args.layers or (2 if quick else 6),
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=max(256, _seq_len(args)),
        tie_word_embeddings=False,
    )


def _seq_len(args) -> int:
    return args.seq_len or (16 if args.quick else 64)


def _steps(args) -> int:
    return args.steps or (2 if args.quick else 3)


def _layouts(world: int) -> list[tuple[int, int, bool]]:
    """(dp, tp, zero) per layout: TP over every rank, then DP 2 x TP world/2 with AdamW and ZeRO-1."""
    out = [(1, world, False)]
    if world % 2 == 0:
        out += [(2, world // 2, False), (2, world // 2, True)]
    return out


class _Job:
    """One layout's training job on this rank: one method per phase, the state they share."""

    def __init__(self, args, config, dp: int, tp: int, zero: bool, folder: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        self.tp_group, self.dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
        self.args, self.config, self.dp, self.zero, self.folder = args, config, dp, zero, folder
        self.model: Optional[torch.nn.Module] = None
        self.opt: Any = None
        self.sync: Any = None  # GradientSync (ZeroOptimizer's own under ZeRO)
        self.steps: list[dict[str, int]] = []  # VmRSS peaks of each step's train_step and optimizer step
        self.refused: Optional[str] = None  # why save_checkpoint did not take the optimizer

    def build(self) -> None:
        from transformers import LlamaForCausalLM

        import oases

        with torch.device("meta"):
            self.model = LlamaForCausalLM(self.config)
        plan = {**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab", "lm_head": "vocab_head"}
        oases.parallelize(self.model, self.tp_group, plan=plan, device="cpu", init_weights=False)

    def load_pretrained(self) -> None:
        import oases

        oases.load_pretrained(self.model, os.path.join(self.folder, "pretrained"))

    def train(self) -> None:
        import oases

        if self.zero:
            self.opt = oases.dp.ZeroOptimizer(self.model, self.dp_group, torch.optim.AdamW, lr=1e-5)
            self.sync = self.opt.sync
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
            self.sync = oases.dp.GradientSync(self.model, self.dp_group) if self.dp > 1 else None
        args, vocab = self.args, self.config.vocab_size
        for step in range(_steps(args)):
            ids = torch.randint(0, vocab, (args.batch, _seq_len(args)), generator=torch.Generator().manual_seed(step))
            ids = ids.chunk(self.dp)[dist.get_rank(self.dp_group)]  # this replica's rows
            with PeakRSS(args.interval) as backward:
                oases.train_step(
                    self.model, ids, ids, schedule=args.schedule, grad_sync=self.sync, recompute=True
                )  # the planner's model: full recomputation
            with PeakRSS(args.interval) as update:
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.steps.append({"train_step": backward.peak, "optimizer_step": update.peak})

    def save_checkpoint(self) -> None:
        import oases

        root = os.path.join(self.folder, "checkpoint")
        try:  # checks run before any collective: every rank refuses alike
            oases.save_checkpoint(self.model, root, optimizer=self.opt, step=1)
        except (TypeError, ValueError) as error:
            self.refused = f"{type(error).__name__}: {error}"
            oases.save_checkpoint(self.model, root, step=1)

    def load_checkpoint(self) -> None:
        import oases

        oases.load_checkpoint(
            self.model, os.path.join(self.folder, "checkpoint"), optimizer=None if self.refused else self.opt
        )

    def save_pretrained(self) -> None:
        import oases

        oases.save_pretrained(self.model, os.path.join(self.folder, "export"))

    def close(self) -> None:
        """Remove the gradient hooks: in torch 2.13 a cycle through a tensor's post-accumulate-grad
        hooks is never collected, so a GradientSync left open keeps every parameter alive."""
        if self.sync is not None:
            self.sync.close()

    def tensor_bytes(self) -> dict[str, int]:
        """What this rank's tensors hold: parameters, gradients, optimizer states, and ZeRO's masters
        and their gradients where they have storage of their own (fp32 masters of fp32 rows are views)."""

        def size(t: Any) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        params = list(self.model.parameters()) if self.model is not None else []
        out = {
            "parameters": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params),
            "optimizer_states": 0,
            "masters": 0,
        }
        if self.opt is not None:
            out["optimizer_states"] = sum(size(v) for s in self.opt.state.values() for v in s.values())
        if self.zero and self.opt is not None:
            for p in params:
                master = self.opt.master_of(p)[0]
                own = master.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                out["masters"] += size(master) * own + size(master.grad)
        return out


def _measure(job: _Job, phases: tuple[str, ...], interval: float, trim: bool) -> dict[str, Any]:
    """This rank's VmRSS through the phases, in bytes above its VmRSS at the start."""
    settle(trim)
    start = rss_bytes()
    out: dict[str, Any] = {"start": start, "phases": {}}
    for phase in phases:
        dist.barrier()
        with PeakRSS(interval) as peak:
            getattr(job, phase)()
        settle(trim)
        out["phases"][phase] = {
            "resident": rss_bytes() - start,
            "peak": peak.peak - start,
            "tensors": job.tensor_bytes(),
        }
    out["steps"] = [{k: v - start for k, v in step.items()} for step in job.steps]
    return out


def _write_pretrained(config, path: str) -> int:
    """Rank 0: a randomly initialised LlamaForCausalLM saved by transformers; its parameter bytes."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path)
    return full


def _run_layout(args, ctx, config, shape, dp: int, tp: int, zero: bool, folder: str, baseline: int) -> dict:
    trim = not args.glibc_default
    job = _Job(args, config, dp, tp, zero, folder)
    mine = _measure(job, PHASES, args.interval, trim)
    mine["left_over"] = mine["start"] - baseline
    mine["refused"] = job.refused
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    job.close()
    del job
    settle(trim)
    dist.barrier()
    if ctx.rank == 0:
        for name in ("checkpoint", "export"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    predicted_job = MemoryJob(
        rows=args.batch // dp,
        tp=tp,
        dp=dp,
        optimizer="adamw",
        zero=zero,
        schedule=args.schedule,
        vocab_parallel=True,
        param_bytes=4,
    )
    parts = rank_memory(shape, predicted_job)
    phases = []
    for p in phase_memory(shape, predicted_job):
        resident = max(r["phases"][p.phase]["resident"] for r in ranks)
        peak = max(r["phases"][p.phase]["peak"] for r in ranks)
        tensors = max(sum(r["phases"][p.phase]["tensors"].values()) for r in ranks)
        phases.append(
            {
                "phase": p.phase,
                "resident_bytes": resident,
                "peak_bytes": peak,
                "tensor_bytes": tensors,
                "predicted_bytes": p.resident_bytes,
                "predicted_peak_bytes": p.peak_bytes,
                "ratio": _ratio(resident, p.resident_bytes),
                "peak_ratio": _ratio(peak, p.peak_bytes),
                "per_rank": [{k: r["phases"][p.phase][k] for k in ("resident", "peak")} for r in ranks],
            }
        )
    rss_states = max(r["phases"]["train"]["resident"] - r["phases"]["load_pretrained"]["resident"] for r in ranks)
    return {
        "kind": "layout",
        "layout": f"TP{tp}" if dp == 1 else f"DP{dp} x TP{tp}",
        "dp": dp,
        "tp": tp,
        "zero": zero,
        "optimizer": "ZeroOptimizer(AdamW)" if zero else "AdamW",
        "phases": phases,
        "optimizer_state": {
            "moment_bytes": max(r["phases"]["train"]["tensors"]["optimizer_states"] for r in ranks),
            "master_bytes": max(r["phases"]["train"]["tensors"]["masters"] for r in ranks),
            "rss_bytes": rss_states,
            "predicted_bytes": parts.optimizer_states + parts.masters,
        },
        "predicted_parts": {
            k: getattr(parts, k)
            for k in (
                "parameters",
                "weights",
                "gradients",
                "optimizer_states",
                "masters",
                "activations",
                "read_pretrained",
                "read_chunk",
                "write_full",
            )
        },
        "start_above_baseline_bytes": max(r["left_over"] for r in ranks),
        "train_steps": [
            {k: max(r["steps"][i][k] for r in ranks) for k in ("train_step", "optimizer_step")}
            for i in range(len(ranks[0]["steps"]))
        ],
        "checkpoint_optimizer": ranks[0]["refused"] is None,
        "checkpoint_refusal": ranks[0]["refused"],
    }


def _ratio(measured: float, predicted: float) -> Optional[float]:
    """measured / predicted; None where nothing is predicted (the build's untouched pages)."""
    return measured / predicted if predicted else None


def run(args, ctx) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # parallelize's and transformers' notices
        return _run(args, ctx)


def _run(args, ctx) -> list[dict]:
    if args.batch < 1 or any(args.batch % dp for dp, _, _ in _layouts(ctx.world_size)):
        raise ValueError(f"--batch: {args.batch} must be a positive multiple of the data-parallel degree 2")
    trim = not args.glibc_default
    exact = exact_malloc() if trim else False
    config = _config(args)
    shape = shape_from_config(config, seq_len=_seq_len(args))
    settle(trim)
    baseline = rss_bytes()  # imports (transformers' Llama included) and the process group
    baselines: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(baselines, baseline)
    folder = [None]
    if ctx.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        folder = [tempfile.mkdtemp(prefix=".memory-", dir=args.out)]
    dist.broadcast_object_list(folder, src=0)
    full = [0]
    try:
        _warm_up(args, ctx, os.path.join(folder[0], "warm-up"))
        if ctx.rank == 0:
            full = [_write_pretrained(config, os.path.join(folder[0], "pretrained"))]
        dist.broadcast_object_list(full, src=0)
        records = [
            _run_layout(args, ctx, config, shape, dp, tp, zero, folder[0], baseline)
            for dp, tp, zero in _layouts(ctx.world_size)
        ]
        dist.barrier()  # every rank is done with the files
    finally:
        if ctx.rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    common = {
        "config": {
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "vocab": config.vocab_size,
            "ffn_hidden": config.intermediate_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "batch": args.batch,
            "seq_len": _seq_len(args),
            "steps": _steps(args),
            "schedule": args.schedule,
            "dtype": "float32",
            "plan": "DEFAULT_PLAN + embed_tokens: vocab, lm_head: vocab_head",
        },
        "shape": shape.to_dict(),
        "full_parameter_bytes": full[0],
        "baseline_bytes": max(baselines),
        "malloc": {"mmap_threshold": 128 * 1024 if exact else "glibc default (dynamic)", "malloc_trim": trim},
        "interval_s": args.interval,
    }
    return [dict(r, **common) for r in records]


def _warm_up(args, ctx, folder: str) -> None:
    """Every phase once on the --quick model at TP world, unmeasured: lazy imports and first-call
    caches (checkpoint, safetensors, the schedule's code paths) land before the layouts' starts."""
    tiny = _config(args, tiny=True)
    if ctx.rank == 0:
        _write_pretrained(tiny, os.path.join(folder, "pretrained"))
    dist.barrier()
    job = _Job(args, tiny, 1, ctx.world_size, False, folder)
    for phase in PHASES:
        getattr(job, phase)()
    job.close()
    del job
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


def tables(records: list[dict]) -> list[Table]:
    layouts = [r for r in records if r["kind"] == "layout"]
    first = layouts[0]
    c = first["config"]
    out = []
    for r in layouts:
        rows = [
            [
                p["phase"],
                p["resident_bytes"] / MIB,
                p["peak_bytes"] / MIB,
                p["predicted_bytes"] / MIB,
                p["ratio"],
                p["predicted_peak_bytes"] / MIB,
                p["peak_ratio"],
                p["tensor_bytes"] / MIB,
            ]
            for p in r["phases"]
        ]
        notes = [
            f"MiB above the rank's VmRSS at the layout's start ({r['start_above_baseline_bytes'] / MIB:.0f} MiB "
            f"above the baseline of {r['baseline_bytes'] / MIB:.0f} MiB after imports + init_process_group), "
            "MAX over ranks; peak sampled every "
            f"{r['interval_s'] * 1e3:g} ms; malloc: mmap threshold {r['malloc']['mmap_threshold']}, "
            f"trim {r['malloc']['malloc_trim']}",
            "predicted: oases.planner.memory (build 0: init_weights=False leaves the shards' pages untouched "
            "until load_pretrained writes them; W after load; W + S + M after train; peak: + G + ZeRO's rows + "
            "max(A + buckets in flight, the optimizer step's temporaries) in train, + the largest read / chunk "
            "/ full tensor in load / export); tensors: bytes the rank's tensors hold after the phase",
        ]
        peaks = ", ".join(f"{s['train_step'] / MIB:.0f} / {s['optimizer_step'] / MIB:.0f}" for s in r["train_steps"])
        notes.append(f"train peaks per step, train_step / optimizer step: {peaks} MiB")
        if not r["checkpoint_optimizer"]:
            notes.append(f"optimizer not checkpointed: {r['checkpoint_refusal'][:160]}")
        out.append(
            Table(
                f"memory: {r['layout']}, {r['optimizer']}; Llama h {c['hidden']}, {c['layers']} layers, "
                f"V {c['vocab']}, F = {r['full_parameter_bytes'] / MIB:.0f} MiB fp32; batch {c['batch']} x "
                f"{c['seq_len']}, {c['schedule']}, {c['steps']} steps",
                [
                    "phase",
                    "resident MiB",
                    "peak MiB",
                    "pred MiB",
                    "res/pred",
                    "pred peak MiB",
                    "peak/pred",
                    "tensors MiB",
                ],
                rows,
                notes,
            )
        )
    rows, notes = [], []
    for r in layouts:
        s = r["optimizer_state"]
        rows.append(
            [
                r["layout"],
                r["optimizer"],
                s["moment_bytes"] / MIB,
                s["master_bytes"] / MIB,
                s["rss_bytes"] / MIB,
                s["predicted_bytes"] / MIB,
            ]
        )
    for z in (r for r in layouts if r["zero"]):
        plain = next((r for r in layouts if not r["zero"] and (r["dp"], r["tp"]) == (z["dp"], z["tp"])), None)
        if plain is not None:
            zs, ps = z["optimizer_state"], plain["optimizer_state"]
            notes.append(
                f"ZeRO-1 at dp {z['dp']} ({z['layout']}): AdamW moments per rank x"
                f"{zs['moment_bytes'] / ps['moment_bytes']:.3f} (tensors), resident after train minus after "
                f"load x{zs['rss_bytes'] / ps['rss_bytes']:.3f} (RSS, masters included)"
            )
    notes.append(
        "moments: exp_avg + exp_avg_sq (+ step) tensors; masters: ZeroOptimizer's masters with storage "
        "of their own (fp32 masters of fp32 rows are views: 0); RSS: resident after train - after "
        "load_pretrained"
    )
    out.append(
        Table(
            "memory: optimizer state per rank",
            ["layout", "optimizer", "moments MiB", "masters MiB", "RSS MiB", "pred MiB"],
            rows,
            notes,
        )
    )
    return out


def plot(records: list[dict], path: str, title: str) -> bool:
    plt = pyplot()

    layouts = [r for r in records if r["kind"] == "layout"]
    fig, axes = plt.subplots(1, len(layouts), figsize=(5.2 * len(layouts), 4.4), squeeze=False, sharey=True)
    for ax, r in zip(axes[0], layouts):
        x = range(len(r["phases"]))
        mib = {
            k: [p[k] / MIB for p in r["phases"]]
            for k in ("resident_bytes", "predicted_bytes", "peak_bytes", "predicted_peak_bytes")
        }
        ax.bar([i - 0.2 for i in x], mib["resident_bytes"], 0.4, label="resident (measured)", color="tab:blue")
        ax.bar([i + 0.2 for i in x], mib["predicted_bytes"], 0.4, label="resident (predicted)", color="tab:orange")
        ax.plot([i - 0.2 for i in x], mib["peak_bytes"], "v", color="navy", label="peak (measured)")
        ax.plot([i + 0.2 for i in x], mib["predicted_peak_bytes"], "v", color="saddlebrown", label="peak (predicted)")
        ax.set_xticks(list(x))
        ax.set_xticklabels([p["phase"].replace("_", "\n") for p in r["phases"]], fontsize=7)
        ax.set_title(f"{r['layout']}, {r['optimizer']}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("MiB above the layout's start (MAX over ranks)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
