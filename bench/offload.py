"""Suite `offload`: batched offload of saved tensors (oases.offload) against per-tensor copies, and the
oases schedule's step with offload on and off.

    python -m bench offload                  # 2 ranks; --quick for seconds
    python -m bench offload --device cuda --nproc 1 --parts step --step-hidden 2048 --step-heads 16 \
        --step-layers 8 --step-seq-len 2048 --step-batch 8     # one GPU, a model of a few GB

--parts picks what runs (default all three: copies, step, aiao).

Copies (each rank alone, MAX over ranks), n = 1 .. 64 tensors of --tensor-kib KiB each, one
round trip = every tensor to the host and back, GB/s = 2 n size / time:

    to            per tensor: t.to("cpu", copy=True), then h.to(device, copy=True)
    save_on_cpu   torch.autograd.graph.save_on_cpu's own pack and unpack hooks, per tensor
    ours          CopyEngine: one copy_out into a HostSlab and one copy_in, on its copy stream
                  (CPU: a worker thread; oases._C memcpy, GIL released), waited for
    ours_inline   the same calls run in the caller (no thread hop)
    ours_python   the Python fallback (one copy_ per tensor), the engine's reference path

Step: oases.models.GPT on the "oases" schedule (TP over the ranks), `train_step` with
offload=False and with an Offloader (batch --batch-size, its profiling step in the warm-up):
t_step, the ratio, peak device-resident bytes of the recompute inputs (oases.schedule.RecomputeMemory; with
offload the Offloader's account: saved until the copy out is issued, back from the copy in to
release), copies per step. Sized by --step-hidden, --step-heads, --step-layers, --step-seq-len and
--step-batch (defaults: --hidden, 8, --layers, --seq-len, --batch). On CUDA also the allocator's
figures of one more step of each variant: the peak bytes allocated on the device during it
(torch.cuda.max_memory_allocated, reset before each), the bytes allocated before it (both models,
their gradients), and the ratio of the peaks on / off; MAX over ranks. None on a CPU, which has
no device memory of its own. Both variants' models stay resident, so each peak counts both.

On a CPU the "device" and the "host" are the same RAM: offloading frees no memory, and every copy
takes memory bandwidth from compute on the same cores. The figures here measure the engine's
own costs (calls, allocation, threads, the GIL), not a PCIe link; the resident bytes are what a
GPU would keep.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

import torch

from bench._memory_peak import peak_allocations
from bench._report import Table, pyplot, save_figure
from oases.models import GPT, GPTConfig
from oases.offload import ALIGNMENT, CopyEngine, HostSlab, Offloader
from oases.schedule import RecomputeMemory

COUNTS = (1, 2, 4, 8, 16, 32, 64)
COPIERS = ("to", "save_on_cpu", "ours", "ours_inline", "ours_python")
PARTS = ("copies", "step", "aiao")
MIN_BYTES_PER_CALL = 8 << 20  # a timed call repeats the round trip until it moved this much


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-kib", type=int, default=None, help="KiB per tensor (default 64; --quick: 16)")
    parser.add_argument("--hidden", type=int, default=None, help="GPT hidden size (default 512; --quick: 64)")
    parser.add_argument("--layers", type=int, default=None, help="GPT layers (default 4; --quick: 2)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; --quick: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 128 (--quick: 16)")
    parser.add_argument("--batch-size", type=int, default=2, help="saved tensors per offload copy (default 2)")
    parser.add_argument(
        "--parts",
        type=_parts,
        default=PARTS,
        metavar="PART[,PART...]",
        help=f"what to run, comma-separated from {', '.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--step-hidden", type=_positive, default=None, help="the step's GPT hidden size (default: --hidden's)"
    )
    parser.add_argument(
        "--step-heads",
        type=_positive,
        default=8,
        help="the step's attention heads (default 8); must divide --step-hidden, and the ranks must divide it",
    )
    parser.add_argument(
        "--step-layers", type=_positive, default=None, help="the step's GPT layers (default: --layers's)"
    )
    parser.add_argument(
        "--step-seq-len",
        "--step-seq",
        dest="step_seq_len",
        type=_positive,
        default=None,
        help="the step's sequence length (default: --seq-len's)",
    )
    parser.add_argument(
        "--step-batch", type=_positive, default=None, help="the step's sequences per step (default: --batch's)"
    )
    parser.add_argument(
        "--step-memory-peak",
        action="store_true",
        help="CUDA: one more step per variant with the allocator's history recorded; the JSON and a "
        "table show the allocations live at the step's peak, by the code that made them",
    )
    parser.add_argument(
        "--step-autocast",
        choices=("bfloat16", "float16"),
        default=None,
        help="run the step under torch.autocast in this dtype (default: none, fp32), as a GPU user trains",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parts(text: str) -> tuple[str, ...]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or text!r}; choose from {', '.join(PARTS)}")
    return tuple(p for p in PARTS if p in names)


def check_args(args, world_size: int) -> Optional[str]:
    """Why the step cannot be built with these options on `world_size` ranks (bench's main calls
    it before any rank starts), or None."""
    if "step" not in args.parts:
        return None
    hidden, heads = _step_shape(args)[0], args.step_heads
    if hidden % heads:
        return f"offload --step-heads {heads}: does not divide the step's hidden size {hidden}; pick a divisor"
    if heads % world_size:
        return (
            f"offload --step-heads {heads}: the {world_size} ranks split the heads (tensor parallel); "
            f"pick a multiple of {world_size}"
        )
    return None


def _step_shape(args) -> tuple[int, int, int, int]:
    """(hidden, layers, batch, seq_len) of the step: --step-* where given, else the suite's sizes."""
    quick = args.quick
    hidden = args.step_hidden or args.hidden or (64 if quick else 512)
    layers = args.step_layers or args.layers or (2 if quick else 4)
    batch = args.step_batch or args.batch or (4 if quick else 8)
    seq_len = args.step_seq_len or args.seq_len or (16 if quick else 128)
    return hidden, layers, batch, seq_len


def _round_trips(ctx, kib: int) -> list[dict]:
    device, pinned = ctx.device, ctx.device.type == "cuda"
    size = kib << 10
    numel = size // 4
    tensors = [torch.randn(numel, device=device) for _ in range(max(COUNTS))]  # fp32, `kib` KiB each
    offsets = [i * (-(-size // ALIGNMENT) * ALIGNMENT) for i in range(max(COUNTS))]
    slab = HostSlab(offsets[-1] + size)
    engines = {
        "ours": CopyEngine(device),
        "ours_inline": CopyEngine(device, asynchronous=False),
        "ours_python": CopyEngine(device, use_extension=False),
    }
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=pinned)

    def to_copies(ts):
        back = [t.to("cpu", copy=True) for t in ts]
        return [h.to(device, copy=True) for h in back]

    def saved_on_cpu(ts):
        packed = [hooks.pack_hook(t) for t in ts]
        return [hooks.unpack_hook(p) for p in packed]

    def ours(engine):
        def run(ts):
            engine.copy_out(ts, slab.buffer, offsets[: len(ts)]).wait()
            outs, event = engine.copy_in(slab.buffer, offsets[: len(ts)], [(t.shape, t.dtype) for t in ts])
            event.wait()
            return outs

        return run

    copiers = {"to": to_copies, "save_on_cpu": saved_on_cpu, **{name: ours(e) for name, e in engines.items()}}
    for name, copy in copiers.items():  # every path gives the tensors back, bit for bit
        if not all(torch.equal(a, b) for a, b in zip(copy(tensors[:3]), tensors[:3])):
            raise AssertionError(f"offload bench: {name} did not give the tensors back")
    records = []
    for n in COUNTS:
        ts = tensors[:n]
        reps = max(1, MIN_BYTES_PER_CALL // (n * size))

        def repeated(copy, ts=ts, reps=reps):
            return lambda: [copy(ts) for _ in range(reps)]

        timed = ctx.timer.measure({name: repeated(copy) for name, copy in copiers.items()})
        moved = 2 * n * size * reps
        records.append(
            {
                "kind": "copy",
                "tensors": n,
                "tensor_bytes": size,
                "reps": reps,
                "t_round_trip": {name: t.median / reps for name, t in timed.items()},
                "gb_per_s": {name: moved / t.median / 1e9 for name, t in timed.items()},
                "calls_per_round_trip": {
                    "to": 2 * n,
                    "save_on_cpu": 2 * n,
                    "ours": 2,
                    "ours_inline": 2,
                    "ours_python": 2,
                },
            }
        )
    for engine in engines.values():
        engine.close()
    return records


def device_peak(ctx, fn: Callable[[], object]) -> tuple[Optional[int], Optional[int]]:
    """Run fn once; on CUDA return (bytes allocated on ctx.device before it, the peak allocated
    while it ran: torch.cuda.max_memory_allocated after a reset), on a CPU (None, None)."""
    if not ctx.is_cuda:
        fn()
        return None, None
    torch.cuda.synchronize(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    before = torch.cuda.memory_allocated(ctx.device)
    fn()
    torch.cuda.synchronize(ctx.device)
    return before, torch.cuda.max_memory_allocated(ctx.device)


def _step(args, ctx) -> dict:
    hidden, layers, batch, seq_len = _step_shape(args)
    heads = args.step_heads
    config = GPTConfig(vocab_size=64, seq_len=seq_len, hidden=hidden, heads=heads, layers=layers)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g).to(ctx.device)
    targets = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g).to(ctx.device)
    offloader = Offloader(batch=args.batch_size)
    models = {
        "off": GPT(config, ctx.group, schedule="oases", seed=0).to(ctx.device),
        "on": GPT(config, ctx.group, schedule="oases", seed=0, offload=offloader).to(ctx.device),
    }
    autocast = getattr(torch, args.step_autocast) if args.step_autocast else None

    def step_of(model):
        def step(memory=None):
            with torch.autocast(ctx.device.type, autocast, enabled=autocast is not None):
                return model.train_step(tokens, targets, memory=memory, recompute=True)

        return step

    steps = {name: step_of(m) for name, m in models.items()}
    losses = {name: step() for name, step in steps.items()}  # "on": its profiling step sizes the slab
    if not torch.equal(losses["off"], losses["on"]):
        raise AssertionError(f"offload bench: loss with offload {losses['on']} differs from {losses['off']}")
    timed = ctx.timer.measure(steps)
    memories = {name: RecomputeMemory() for name in steps}
    before: dict[str, Optional[int]] = {}
    peak: dict[str, Optional[int]] = {}
    for name, step in steps.items():
        before[name], peak[name] = device_peak(ctx, lambda step=step, name=name: step(memory=memories[name]))
    if ctx.is_cuda:  # the figures of the rank that needs the most (every rank holds its shard)
        names = list(steps)
        reduced = ctx.timer.max_over_ranks(
            torch.tensor([float(before[n]) for n in names] + [float(peak[n]) for n in names], dtype=torch.float64)
        )
        before = {n: int(reduced[i]) for i, n in enumerate(names)}
        peak = {n: int(reduced[len(names) + i]) for i, n in enumerate(names)}
    peak_live = None
    if getattr(args, "step_memory_peak", False) and ctx.is_cuda:
        peak_live = {name: peak_allocations(step, ctx.device) for name, step in steps.items()}
    stats = offloader.stats
    record = {
        "kind": "step",
        "schedule": "oases",
        "offload_batch": args.batch_size,
        "config": {
            "hidden": hidden,
            "layers": layers,
            "heads": heads,
            "batch": batch,
            "seq_len": seq_len,
            "tp": ctx.world_size,
            "autocast": args.step_autocast,
        },
        "t_step": {name: t.median for name, t in timed.items()},
        "t_step_min": {name: t.min for name, t in timed.items()},
        "ratio_on_off": timed["on"].median / timed["off"].median,
        "peak_resident_bytes": {name: m.peak for name, m in memories.items()},
        "peak_device_bytes": peak,
        "device_bytes_before_step": before,
        "step_device_bytes": {n: None if peak[n] is None else peak[n] - before[n] for n in peak},
        "peak_device_ratio_on_off": None if peak["off"] is None else peak["on"] / peak["off"],
        # the step's own memory (peak minus what was allocated before it): what offload saves
        "step_device_ratio_on_off": None
        if peak["off"] is None
        else (peak["on"] - before["on"]) / max(1, peak["off"] - before["off"]),
        # "checkpoints": the saves (OffloadStats.saves); the key keeps its name: the JSON files are read back
        "checkpoints": stats.saves,
        "copies_out": stats.copies_out,
        "copies_in": stats.copies_in,
        "bytes_out": stats.bytes_out,
        "slab_bytes": offloader.slab.capacity,
        "loss": float(losses["off"]),
        "copy_path": offloader.engine(ctx.device).path,
        "peak_live": peak_live,
    }
    offloader.close()
    return record


def _aiao(args, ctx) -> dict:
    """FOLD3D's setting: AIAO over pp = world size stages, m = 8 micro-batches, ns = 2 segments,
    with and without offload. Without, every layer input of every (segment, micro-batch) is kept
    until its backward (counted from the shapes: m * ns * layers per (segment, stage) tensors);
    with, the Offloader's account of what it keeps on the device."""
    from torch.distributed.device_mesh import init_device_mesh

    from oases.pipeline import Pipeline

    quick, pp, m, ns = args.quick, ctx.world_size, 8, 2
    hidden, seq_len = args.hidden or (64 if quick else 512), args.seq_len or (16 if quick else 128)
    layers = pp * ns * (1 if quick else 2)
    batch = m * (1 if quick else 2)
    config = GPTConfig(vocab_size=64, seq_len=seq_len, hidden=hidden, heads=8, layers=layers)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g)
    mesh = init_device_mesh(ctx.device.type, (1, pp, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipes = {
        name: Pipeline(
            config,
            mesh,
            schedule="aiao",
            segments=ns,
            micro_batches=m,
            seed=0,
            offload=Offloader(batch=args.batch_size) if name == "on" else False,
        )
        for name in ("off", "on")
    }
    losses = {}
    for name, pipe in pipes.items():  # "on": its profiling step sizes the slab
        losses[name] = float(pipe.train_step(tokens, targets))
        pipe.close()
    if losses["off"] != losses["on"]:
        raise AssertionError(f"offload bench: AIAO loss with offload {losses['on']} differs from {losses['off']}")

    def step(pipe):
        def run():
            pipe.train_step(tokens, targets)
            pipe.close()

        return run

    timed = ctx.timer.measure({name: step(pipe) for name, pipe in pipes.items()})
    per_action = layers // (pp * ns)  # layer inputs one forward action keeps
    micro_bytes = (batch // m) * seq_len * hidden * 4  # one micro-batch's activation (fp32)
    kept_off = m * ns * per_action * micro_bytes  # every action's layer inputs, until its backward
    stats = pipes["on"].offload_stats
    peak_on = ctx.timer.max_over_ranks(torch.tensor([float(stats.peak_resident_bytes)], dtype=torch.float64))
    return {
        "kind": "aiao",
        "measured": True,
        "pp": pp,
        "micro_batches": m,
        "segments": ns,
        "config": {"hidden": hidden, "layers": layers, "batch": batch, "seq_len": seq_len},
        "t_step": {name: t.median for name, t in timed.items()},
        "ratio_on_off": timed["on"].median / timed["off"].median,
        "peak_resident_bytes": {"off": kept_off, "on": float(peak_on)},
        "action_bytes": per_action * micro_bytes,
        "copies_out": stats.copies_out,
        "copies_in": stats.copies_in,
        "loss": losses["off"],
    }


def run(args, ctx) -> list[dict]:
    parts = getattr(args, "parts", PARTS)
    records = []
    if "copies" in parts:
        records += _round_trips(ctx, args.tensor_kib or (16 if args.quick else 64))
    if "step" in parts:
        records.append(_step(args, ctx))
    if "aiao" in parts:
        records.append(_aiao(args, ctx))
    memory = "separate" if ctx.is_cuda else "the same RAM"
    for r in records:
        r["device"], r["host_and_device_memory"] = ctx.device.type, memory
    return records


def tables(records: list[dict]) -> list[Table]:
    """The tables of the parts that ran (copies, step, aiao)."""
    copies = [r for r in records if r["kind"] == "copy"]
    step = next((r for r in records if r["kind"] == "step"), None)
    aiao = next((r for r in records if r["kind"] == "aiao"), None)
    out = []
    if copies:
        out.append(_copy_table(copies))
    if step is not None:
        out.append(_step_table(step))
        if step.get("peak_live"):
            out.append(_peak_table(step["peak_live"]))
    if aiao is not None:
        out.append(_aiao_table(aiao))
    return out


def _copy_table(copies: list[dict]) -> Table:
    same_ram = copies[0]["host_and_device_memory"] == "the same RAM"
    rows = [
        [
            r["tensors"],
            *(r["gb_per_s"][c] for c in COPIERS),
            r["t_round_trip"]["to"] / r["t_round_trip"]["ours"],
            r["t_round_trip"]["to"] / r["t_round_trip"]["ours_inline"],
        ]
        for r in copies
    ]
    kib = copies[0]["tensor_bytes"] >> 10
    copy_notes = [
        f"GB/s = 2 x tensors x {kib} KiB / round-trip time (out and back), median, MAX over ranks",
        "x to = time of per-tensor .to() / ours (target >= 3 at 64 small tensors)",
    ]
    if same_ram:
        copy_notes += [
            "CPU: device and host are the same RAM. save_on_cpu copies nothing here (tensor.cpu() of a "
            "CPU tensor is the tensor itself): its figure is the hooks' overhead, not a copy",
            "both ranks copy at once on the shared cores and memory bus",
        ]
    return Table(
        f"offload: round trips of n tensors of {kib} KiB (GB/s)",
        ["tensors", *COPIERS, "x to", "x to (inline)"],
        rows,
        copy_notes,
    )


def _step_table(step: dict) -> Table:
    same_ram = step["host_and_device_memory"] == "the same RAM"
    c = step["config"]
    off, on = step["t_step"]["off"], step["t_step"]["on"]
    mib = {k: v / 2**20 for k, v in step["peak_resident_bytes"].items()}
    peaks = step.get("peak_device_bytes") or {"off": None, "on": None}
    gib = {k: None if v is None else v / 2**30 for k, v in peaks.items()}
    own = step.get("step_device_bytes") or {"off": None, "on": None}
    own_gib = {k: None if v is None else v / 2**30 for k, v in own.items()}
    step_rows = [
        ["off", 1e3 * off, None, mib["off"], own_gib["off"], None, gib["off"], None, None],
        [
            "on",
            1e3 * on,
            step["ratio_on_off"],
            mib["on"],
            own_gib["on"],
            step.get("step_device_ratio_on_off"),
            gib["on"],
            step["copies_out"],
            step["copies_in"],
        ],
    ]
    step_notes = [
        f"{step['checkpoints']} sublayer inputs per step (2 sub-batches), {step['offload_batch']} per copy; "
        f"slab {step['slab_bytes'] / 2**20:.2f} MiB (sized by the profiling step); copy path "
        f"{step['copy_path']}",
        "kept MiB = peak device-resident bytes of the recompute inputs (with offload: as the Offloader accounts them)",
        "target: t_step(on) <= 1.05 x t_step(off) when the copies are hidden",
    ]
    if same_ram:
        step_notes.append(
            "CPU: offloading frees no memory here (same RAM); t_step(on) pays the memcpy and the copy "
            "thread on the cores that compute; on a GPU the copies run on the DMA engines"
        )
    else:
        step_notes.append(
            "step GiB = the step's own device memory: torch.cuda.max_memory_allocated during one step "
            "(reset before each variant) minus what was allocated before it, MAX over ranks; step on / "
            "off = their ratio; peak GiB = the whole peak, both variants' models and gradients resident"
        )
    return Table(
        f"offload: GPT oases schedule, TP {c['tp']}, hidden {c['hidden']}, {c.get('heads', 8)} heads, "
        f"{c['layers']} layers, batch {c['batch']} x {c['seq_len']}"
        + (f", {c['autocast']} autocast" if c.get("autocast") else ""),
        [
            "offload",
            "t_step ms",
            "on / off",
            "kept MiB",
            "step GiB",
            "step on / off",
            "peak GiB",
            "copies out",
            "copies in",
        ],
        step_rows,
        step_notes,
    )


def _peak_table(peak_live: dict) -> Table:
    rows, notes = [], []
    for name, summary in peak_live.items():
        notes.append(
            f"{name}: peak {summary['peak_bytes'] / 2**30:.2f} GiB above the step's start, reached by "
            f"{summary['set_by']}; {summary['other_bytes'] / 2**30:.2f} GiB in smaller groups"
        )
        for g in summary["groups"]:
            rows.append([name, g["bytes"] / 2**30, g["count"], g["frame"]])
    notes.append(
        "the blocks live at the step's peak (torch.cuda.memory._record_memory_history, one step per "
        "variant), by the innermost project frames of their allocation"
    )
    return Table(
        "offload: where the step's peak device memory goes", ["offload", "GiB", "blocks", "allocated at"], rows, notes
    )


def _aiao_table(aiao: dict) -> Table:
    a = aiao["config"]
    act = aiao["action_bytes"]
    aiao_rows = [
        [
            name,
            1e3 * aiao["t_step"][name],
            aiao["ratio_on_off"] if name == "on" else None,
            aiao["peak_resident_bytes"][name] / 2**20,
            aiao["peak_resident_bytes"][name] / act,
        ]
        for name in ("off", "on")
    ]
    aiao_notes = [
        f"kept MiB: off = every layer input of the m x ns forward actions, kept until its backward "
        f"(counted from the shapes); on = the Offloader's peak account; 'actions' = that / one forward "
        f"action's inputs ({act / 2**20:.2f} MiB). Target: on <= 2 actions' worth, off = m x ns = "
        f"{aiao['micro_batches'] * aiao['segments']}",
        f"copies per step (on): {aiao['copies_out']} out, {aiao['copies_in']} in; same loss "
        f"{aiao['loss']:.6f} both ways",
    ]
    return Table(
        f"offload: AIAO pipeline, PP{aiao['pp']}, m = {aiao['micro_batches']}, ns = {aiao['segments']}, "
        f"hidden {a['hidden']}, {a['layers']} layers, batch {a['batch']} x {a['seq_len']}",
        ["offload", "t_iter ms", "on / off", "kept MiB", "actions"],
        aiao_rows,
        aiao_notes,
    )


def plot(records: list[dict], path: str, title: str) -> bool:
    plt = pyplot()

    copies = [r for r in records if r["kind"] == "copy"]
    step = next((r for r in records if r["kind"] == "step"), None)
    if not copies or step is None:  # the figure shows both parts side by side
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    counts = [r["tensors"] for r in copies]
    for name in COPIERS:
        left.plot(counts, [r["gb_per_s"][name] for r in copies], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_xticks(counts)
    left.set_xticklabels([str(c) for c in counts])
    left.set_xlabel(f"tensors per round trip ({copies[0]['tensor_bytes'] >> 10} KiB each)")
    left.set_ylabel("GB/s (out and back, MAX over ranks)")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    left.set_title(f"copies ({step['host_and_device_memory']} for host and device)", fontsize=9)
    names = ["off", "on"]
    bars = right.bar(names, [1e3 * step["t_step"][n] for n in names], color=["tab:gray", "tab:blue"])
    for bar, n in zip(bars, names):
        right.annotate(
            f"kept {step['peak_resident_bytes'][n] / 2**20:.2f} MiB",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    right.set_ylabel("ms per training step (MAX over ranks)")
    right.set_title(f"GPT oases schedule, offload off / on (x{step['ratio_on_off']:.2f})", fontsize=9)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
