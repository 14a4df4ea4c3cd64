"""Suite `profile`: the microbenchmarks the planner reads (oases.planner.load_profile).

    python -m bench profile                          # 2 ranks, unshaped loopback
    python -m bench profile --bandwidth 750mbit      # the links shaped as for training
    python -m bench profile --quick --out /tmp/p     # small shapes (tests)
    python -m bench profile --device cuda --nproc 1 --assume-link 25gbit,20us   # one GPU

Every sample runs on the rank's device (bench --device: a GPU per rank on CUDA, else the CPU), in
--dtype (float32 by default; the profile's element_bytes follow it). With one rank nothing can be
communicated: the compute, head and memory sections are measured, the overlap is skipped
(recorded in "skipped"; overlap_efficiency 1.0), and the collectives come from the link the user
states with --assume-link RATE[,LATENCY] (required then): the p2p fit of ranks 0 -> 1 is that
link, latency + nbytes / rate, marked "assumed": true, and the planner derives every all-reduce
and all-gather from it by its ring formulas (oases.planner.profile); the document's "assumed"
says so. With two ranks or more the collectives are measured and --assume-link is refused.

Measured on every rank at once (each rank's median, then the MAX over ranks), for one
transformer layer of oases.models.GPT (hidden, heads, seq_len from the options):

    compute      attention and MLP sublayers (norm + TP-local core + finish), forward (no grad, as
                 the schedules run it), recording forward (recomputation) and backward (autograd,
                 after a recording forward), per TP degree d (this rank's 1/d shard: heads / d, MLP
                 width / d) and rows per sub-batch, rotating over COLD_COPIES sublayers (weights
                 from memory, as in a stack)
    overlap      an all-reduce and MLP forwards of about as long, alone and at once: the share of
                 the shorter one hidden on this device (its cores drive the transfers too)
    head         final norm + LM head + cross-entropy, forward + backward, per rows
    collectives  all-reduce and all-gather per group size (2, 4, ... up to the ranks), p2p between
                 ranks 0 and 1, over a sweep of sizes; each fitted to t = latency_s + nbytes /
                 bytes_per_s (nbytes: the full tensor; bandwidth from the largest sizes, latency
                 from the rest: LinkFit.from_samples)
    memory       per TP degree: a layer's parameter bytes and the bytes of one row's sublayer input
                 (in --dtype)
    chunks       the MLP's first GEMM at the largest rows and TP degree, whole and cut into c = 2, 4,
                 8, 16 row pieces (--quick: 2, 4) written into their output slices: chunk_efficiency
                 {c: t(whole) / t(c pieces)}, which the planner's chunk choice (Centauri's
                 Algorithm 1, oases.planner.chunk_count) divides the compute by

Writes the profile to `--profile-out` (default bench/profiles/<device>.json, named by the CPU
model or GPU name), beside the run's usual JSON; the profile carries the versions and the link.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import re
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench._report import Table, pyplot, save_figure, write_json
from oases.models import GPTConfig
from oases.models._gpt_sublayers import _MLP, _Attention  # the GPT's own sublayers: the planner models exactly these
from oases.planner.profile import PROFILE_FORMAT, PROFILE_VERSION, LinkFit
from oases.schedule import SubBatch

PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_LATENCY = "30us"  # --assume-link without a latency: oases.costs.link.DEFAULT_LATENCY_S
_LATENCY_PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
_LATENCY = re.compile(r"(?P<number>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)\s*(?P<unit>s|ms|us|µs|ns)", re.IGNORECASE)
_SUBLAYERS = {"attention": _Attention, "mlp": _MLP}
COLD_COPIES = 4  # sublayers a compute sample rotates over (see measure_compute)
RUN_S = 0.03  # a compute sample's call repeats its sublayer for at least this long (see compute_variants)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=None, help="default 512 (--quick: 64)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (--quick: 16)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--rows", default=None, help="rows per sub-batch to time, comma-separated (default 1,2,4,8)")
    parser.add_argument(
        "--profile-out", default=None, help="where to write the profile (default bench/profiles/<device>.json)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="the sublayers' and head's parameters and activations (default float32); "
        "the profile's element_bytes follow it",
    )
    parser.add_argument(
        "--assume-link",
        type=_assume_link_arg,
        default=None,
        metavar="RATE[,LATENCY]",
        help="one rank only (--nproc 1), required there: the link to plan with, as no collective "
        "can be measured on one rank, e.g. 25gbit,20us (rate in tc syntax as --bandwidth; "
        f"latency per message with a unit s, ms, us or ns, default {DEFAULT_LATENCY}); "
        "recorded in the profile as assumed, not measured",
    )


def parse_latency(text: str) -> float:
    """Seconds of a latency written with its unit: "20us", "0.5ms", "1e-5s", "800ns" (a bare
    number is refused: 20 what?)."""
    match = _LATENCY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"latency {text!r}: expected a number with a unit s, ms, us or ns, e.g. 20us or 0.5ms")
    return float(match["number"]) / _LATENCY_PER_SECOND[match["unit"].lower()]


def parse_assume_link(text: str) -> dict[str, Any]:
    """The link of `--assume-link RATE[,LATENCY]`: {"text", "rate", "bytes_per_s", "latency",
    "latency_s"}; RATE as --bandwidth (tc syntax, oases.launch.parse_bandwidth: 25gbit = 3.125e9
    bytes/s), LATENCY as parse_latency (default DEFAULT_LATENCY)."""
    from oases.launch import parse_bandwidth

    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"--assume-link {text!r}: expected RATE[,LATENCY], e.g. 25gbit or 25gbit,20us")
    latency = parts[1] if len(parts) == 2 else DEFAULT_LATENCY
    try:
        bytes_per_s = parse_bandwidth(parts[0])
        latency_s = parse_latency(latency)
    except ValueError as err:
        raise ValueError(f"--assume-link {text!r}: {err}") from None
    return {"text": text, "rate": parts[0], "bytes_per_s": bytes_per_s, "latency": latency, "latency_s": latency_s}


def _assume_link_arg(text: str) -> dict[str, Any]:
    try:
        return parse_assume_link(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_args(args, world_size: int) -> Optional[str]:
    """Why this suite cannot run on `world_size` ranks with these options (bench's main calls it
    before any rank starts), or None: one rank measures no collective, so it needs --assume-link;
    more ranks measure them, so --assume-link would contradict the measurement."""
    if world_size == 1 and args.assume_link is None:
        return (
            "profile --nproc 1: one rank cannot measure the collectives the planner needs; pass "
            "--assume-link RATE[,LATENCY] (e.g. --assume-link 25gbit,20us: the link of the cluster to plan "
            "for, recorded in the profile as assumed), or run 2 or more ranks"
        )
    if world_size > 1 and args.assume_link is not None:
        return (
            f"profile --assume-link: only for one rank (--nproc 1); with {world_size} ranks the collectives "
            "are measured (to plan for another link, give `oases plan --link RATE` with this profile)"
        )
    return None


def _config(args) -> GPTConfig:
    hidden = args.hidden or (64 if args.quick else 512)
    return GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len or (16 if args.quick else 64),
        hidden=hidden,
        heads=args.heads,
        layers=1,
    )


def _degrees(world: int, config: GPTConfig) -> list[int]:
    out, d = [], 1
    while d <= world:
        if config.heads % d == 0:
            out.append(d)
        d *= 2
    return out


# ---- compute -------------------------------------------------------------------------------------
def _dtype(args) -> torch.dtype:
    return DTYPES[getattr(args, "dtype", "float32")]


def _sublayer_fns(subs: list, x: torch.Tensor, where: SubBatch) -> dict[str, Callable[[], object]]:
    """forward (no grad), both (recording forward + backward), record (recording forward) and
    record_unread (the recording that fine-grained recomputation runs: core_for_gradients, no
    output projection GEMM) of one of `subs` per call, in turn."""
    turn = itertools.cycle(subs)
    grad = torch.randn_like(x)

    def forward() -> torch.Tensor:
        sub = next(turn)
        with torch.no_grad():
            return x + sub.finish(sub.core(sub.norm(x)), where)

    def both() -> None:
        sub = next(turn)
        leaf = x.detach().requires_grad_()
        y = leaf + sub.finish(sub.core(sub.norm(leaf)), where)
        y.backward(grad)

    def record() -> None:
        sub = next(turn)
        leaf = x.detach().requires_grad_()
        leaf + sub.finish(sub.core(sub.norm(leaf)), where)

    def record_unread() -> None:
        sub = next(turn)
        leaf = x.detach().requires_grad_()
        leaf + sub.finish(sub.core_for_gradients(sub.norm(leaf)), where)

    return {"forward": forward, "both": both, "record": record, "record_unread": record_unread}


def _repeated(fn: Callable[[], object], times: int) -> Callable[[], object]:
    def run() -> None:
        for _ in range(times):
            fn()

    run.times = times  # type: ignore[attr-defined]
    return run


def compute_variants(
    ctx, config: GPTConfig, degrees: Sequence[int], rows: Sequence[int], dtype: torch.dtype = torch.float32
) -> dict[str, Callable[[], object]]:
    """The timed calls of the compute samples, {"compute/<sublayer>/<tp>/<rows>/<call>": fn}
    (for Timer.measure, alone or round-robin with other variants; see compute_samples). Each call
    runs its sublayer back to back for at least RUN_S (the same count on every rank): a
    millisecond burst right after a barrier gets a core that a step, computing for a tenth of a
    second, shares with the machine's other threads (on a loaded 2-core machine: 1.2-1.6x).
    Sublayers and inputs live on ctx.device in `dtype`."""
    torch.manual_seed(0)
    fns = {}
    for d in degrees:
        for kind, cls in _SUBLAYERS.items():
            # a step runs each layer's weights once per pass, the others' in between: time a rotation
            # over COLD_COPIES sublayers so the weights and gradients come from memory, as in a stack
            with ctx.device:  # initialised where they run (a GPU fills large layers faster than the CPU)
                subs = [cls(config, 0, d, None).to(dtype) for _ in range(COLD_COPIES)]
            for r in rows:
                x = torch.randn(r, config.seq_len, config.hidden, device=ctx.device, dtype=dtype)
                for call, fn in _sublayer_fns(subs, x, SubBatch(slice(0, r), r, None)).items():
                    fns[f"compute/{kind}/{d}/{r}/{call}"] = fn
    return _each_for_run_s(ctx, fns)


def _each_for_run_s(ctx, fns: dict[str, Callable[[], object]]) -> dict[str, Callable[[], object]]:
    """Each fn repeated back to back for at least RUN_S (its time once, after a warm-up call; the
    same count on every rank: the MAX over ranks), see compute_variants."""
    once = []
    for fn in fns.values():
        fn()
        ctx.sync()  # CUDA: the kernels, not their launches
        started = time.perf_counter()
        fn()
        ctx.sync()
        once.append(time.perf_counter() - started)
    times = torch.tensor([min(max(math.ceil(RUN_S / max(t, 1e-6)), 1), 64) for t in once], dtype=torch.float64)
    times = ctx.timer.max_over_ranks(times).tolist()
    return {name: _repeated(fn, int(k)) for (name, fn), k in zip(fns.items(), times)}


def compute_samples(config: GPTConfig, fns: Mapping[str, Any], timings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The profile's compute samples (seconds per sublayer call) from the timings of
    compute_variants' `fns`."""
    calls = {name: getattr(fn, "times", 1) for name, fn in fns.items()}
    out = []
    for name in fns:
        if not (name.startswith("compute/") and name.endswith("/forward")):
            continue
        _, kind, d, r, _ = name.split("/")
        prefix = name[: -len("forward")]
        record = timings[prefix + "record"].median / calls[prefix + "record"]
        unread = timings[prefix + "record_unread"].median / calls[prefix + "record_unread"]
        forward, both = timings[name].median / calls[name], timings[prefix + "both"].median / calls[prefix + "both"]
        out.append(
            {
                "sublayer": kind,
                "tp": int(d),
                "rows": int(r),
                "seq_len": config.seq_len,
                "hidden": config.hidden,
                "heads": config.heads,
                "ffn_hidden": config.hidden * config.mlp_ratio,
                "forward_s": forward,
                "backward_s": max(both - record, 0.0),
                "record_s": record,
                "record_unread_s": unread,
            }
        )
    return out


def measure_compute(
    ctx, config: GPTConfig, degrees: Sequence[int], rows: Sequence[int], dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """Seconds of each sublayer's forward, recording forward and backward per TP degree and rows
    (MAX over ranks), on ctx.device in `dtype`."""
    fns = compute_variants(ctx, config, degrees, rows, dtype)
    return compute_samples(config, fns, ctx.timer.measure(fns))


def chunk_variants(
    ctx, config: GPTConfig, rows: int, degree: int, counts: Sequence[int], dtype: torch.dtype = torch.float32
) -> dict[str, Callable[[], object]]:
    """The MLP's first GEMM of one rank (rows x seq_len tokens, hidden -> ffn / degree) whole and
    cut into c row pieces written into their slices of one output, {"chunks/<c>": fn}, c = 1 and
    each of `counts` that divides the tokens; each fn repeated as compute_variants' are."""
    tokens, ffn = rows * config.seq_len, config.hidden * config.mlp_ratio // degree
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, config.hidden, generator=g).to(ctx.device, dtype)
    wt = torch.randn(ffn, config.hidden, generator=g).to(ctx.device, dtype).t()
    y = torch.empty(tokens, ffn, device=ctx.device, dtype=dtype)

    def pieces(c: int) -> Callable[[], None]:
        bounds = [(k * tokens // c, (k + 1) * tokens // c) for k in range(c)]

        def run() -> None:
            for a, b in bounds:
                torch.matmul(x[a:b], wt, out=y[a:b])

        return run

    return _each_for_run_s(ctx, {f"chunks/{c}": pieces(c) for c in (1, *counts) if tokens % c == 0})


def efficiency_from_timings(fns: Mapping[str, Any], timings: Mapping[str, Any]) -> dict[str, float]:
    """{"c": time of the whole GEMM / time of it in c pieces} from chunk_variants' timings (the
    planner's chunk choice reads it: oases.planner.chunk_count's `efficiency`)."""
    per_call = {int(name.split("/")[1]): timings[name].median / getattr(fn, "times", 1) for name, fn in fns.items()}
    # clamped to (0, 2]: the planner refuses a profile outside it (a timing glitch, not a finding)
    return {str(c): min(per_call[1] / t, 2.0) for c, t in sorted(per_call.items()) if c > 1}


def measure_chunk_efficiency(
    ctx, config: GPTConfig, rows: int, degree: int, counts: Sequence[int], dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    fns = chunk_variants(ctx, config, rows, degree, counts, dtype)
    return efficiency_from_timings(fns, ctx.timer.measure(fns))


def measure_head(
    ctx, config: GPTConfig, rows: Sequence[int], dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """Seconds of the GPT's head (final norm, LM head, summed cross-entropy) forward and backward,
    on ctx.device in `dtype`."""
    torch.manual_seed(0)
    with ctx.device:
        norm = torch.nn.LayerNorm(config.hidden).to(dtype)
        head = torch.nn.Linear(config.hidden, config.vocab_size, bias=False).to(dtype)
    out = []
    for r in rows:
        x = torch.randn(r, config.seq_len, config.hidden, device=ctx.device, dtype=dtype)
        targets = torch.randint(0, config.vocab_size, (r, config.seq_len), device=ctx.device)

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return F.cross_entropy(head(norm(x)).flatten(0, 1), targets.flatten(), reduction="sum")

        def both() -> None:
            leaf = x.detach().requires_grad_()
            F.cross_entropy(head(norm(leaf)).flatten(0, 1), targets.flatten(), reduction="sum").backward()

        t = ctx.timer.measure({"forward": forward, "both": both})
        out.append(
            {
                "rows": r,
                "tokens": r * config.seq_len,
                "hidden": config.hidden,
                "vocab_size": config.vocab_size,
                "forward_s": t["forward"].median,
                "backward_s": max(t["both"].median - t["forward"].median, 0.0),
            }
        )
    return out


# ---- collectives ---------------------------------------------------------------------------------
def fit_link(samples: Sequence[tuple[float, float]]) -> dict[str, float]:
    """t = latency_s + nbytes / bytes_per_s over (nbytes, seconds) samples: oases.planner's
    LinkFit.from_samples (bandwidth from the largest sizes, latency from the remainders)."""
    fit = LinkFit.from_samples(samples)
    return {
        "latency_s": fit.latency_s,
        "bytes_per_s": fit.bytes_per_s,
        "samples": [[float(a), float(b)] for a, b in sorted(samples)],
    }


def _subgroups(world: int, size: int) -> list:
    """Every rank creates every block's group (new_group is collective); returns them all."""
    return [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]


def measure_collectives(ctx, sizes: Sequence[int]) -> dict[str, dict[str, dict[str, Any]]]:
    """{kind: {group size: fit}} for all_reduce and all_gather over powers of two up to the world,
    and p2p ("2": ranks 0 -> 1). `sizes` are the full tensors' bytes."""
    out: dict[str, dict[str, dict[str, Any]]] = {"all_reduce": {}, "all_gather": {}, "p2p": {}}
    group_size = 2
    while group_size <= ctx.world_size:
        groups = _subgroups(ctx.world_size, group_size) if group_size < ctx.world_size else [None]
        mine = groups[ctx.rank // group_size]
        ar, ag = [], []
        for nbytes in sizes:
            numel = max(nbytes // 4 // group_size * group_size, group_size)
            full = torch.zeros(numel, device=ctx.device)
            shard = torch.zeros(numel // group_size, device=ctx.device)
            t = ctx.timer.measure(
                {
                    "all_reduce": lambda: dist.all_reduce(full, group=mine),
                    "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=mine),
                }
            )
            ar.append((numel * 4, t["all_reduce"].median))
            ag.append((numel * 4, t["all_gather"].median))
        out["all_reduce"][str(group_size)] = fit_link(ar)
        out["all_gather"][str(group_size)] = fit_link(ag)
        group_size *= 2
    if ctx.world_size >= 2:
        p2p = []
        for nbytes in sizes:
            buf = torch.zeros(max(nbytes // 4, 1), device=ctx.device)

            def send_recv() -> None:
                if ctx.rank == 0:
                    dist.send(buf, 1)
                elif ctx.rank == 1:
                    dist.recv(buf, 0)

            p2p.append((buf.numel() * 4, ctx.timer.measure({"p2p": send_recv})["p2p"].median))
        out["p2p"]["2"] = fit_link(p2p)
    return out


def assumed_collectives(link: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The collectives section of a one-rank profile from the link of parse_assume_link: the p2p
    fit of ranks 0 -> 1 is the link itself (latency_s + nbytes / bytes_per_s), marked "assumed"
    with no samples; no all-reduce or all-gather fit, so the planner derives them for every group
    size from that link by its ring formulas (oases.planner.profile.Profile.collective_time)."""
    fit = {
        "latency_s": float(link["latency_s"]),
        "bytes_per_s": float(link["bytes_per_s"]),
        "samples": [],
        "assumed": True,
        "source": f"--assume-link {link['text']}",
    }
    return {"all_reduce": {}, "all_gather": {}, "p2p": {"2": fit}}


def overlap_variants(
    ctx, config: GPTConfig, rows: int, degree: int, dtype: torch.dtype = torch.float32
) -> dict[str, Callable[[], object]]:
    """The timed calls of the overlap measurement (see measure_overlap), {"overlap/compute" |
    "overlap/comm" | "overlap/both": fn}; a first timing picks the forwards per call."""
    with ctx.device:
        sub = _MLP(config, 0, degree, None).to(dtype)
    x = torch.randn(rows, config.seq_len, config.hidden, device=ctx.device, dtype=dtype)
    buf = torch.zeros(rows, config.seq_len, config.hidden, device=ctx.device, dtype=dtype)

    def forward() -> None:
        with torch.no_grad():
            sub.core(sub.norm(x))

    first = ctx.timer.measure({"compute": forward, "comm": lambda: dist.all_reduce(buf)})
    k = int(min(max(round(first["comm"].median / max(first["compute"].median, 1e-6)), 1), 64))

    def compute() -> None:
        for _ in range(k):
            forward()

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    compute.forwards = k  # type: ignore[attr-defined]
    return {"overlap/compute": compute, "overlap/comm": lambda: dist.all_reduce(buf), "overlap/both": both}


def overlap_result(fns: Mapping[str, Any], timings: Mapping[str, Any]) -> dict[str, float]:
    """(t_c + t_a - t_both) / min(t_c, t_a) in [0, 1] from the timings of overlap_variants' calls."""
    c, a, ab = (timings[f"overlap/{k}"].median for k in ("compute", "comm", "both"))
    eta = min(max((c + a - ab) / max(min(c, a), 1e-12), 0.0), 1.0)
    return {
        "compute_s": c,
        "comm_s": a,
        "both_s": ab,
        "forwards": fns["overlap/compute"].forwards,
        "overlap_efficiency": float(eta),
    }


def measure_overlap(
    ctx, config: GPTConfig, rows: int, degree: int, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """How much of an all-reduce a sublayer's compute hides on this device (the threads that
    drive the transfer share the cores with the compute): an all-reduce of a sub-batch's
    activation ([rows, seq_len, hidden]) alone, k MLP forwards on `rows` (at `degree`) alone, with
    k chosen so both take about as long (a balanced pair: the estimate below divides by the
    shorter one), and both at once (the all-reduce asynchronous)
        -> overlap = (t_c + t_a - t_both) / min(t_c, t_a), in [0, 1]; the median of 3 rounds."""
    fns = overlap_variants(ctx, config, rows, degree, dtype)
    rounds = sorted(
        (overlap_result(fns, ctx.timer.measure(fns)) for _ in range(3)), key=lambda r: r["overlap_efficiency"]
    )
    return rounds[1]


# ---- memory --------------------------------------------------------------------------------------
def measure_memory(
    config: GPTConfig, degrees: Sequence[int], dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """Per TP degree: parameter bytes of one layer's shard (counted from the modules, built on the
    meta device: no memory, no initialisation) and the bytes of one row's sublayer input (what
    fine-grained recomputation keeps per sublayer), both in `dtype`."""
    element = torch.empty((), dtype=dtype).element_size()
    out = []
    for d in degrees:
        with torch.device("meta"):
            params = sum(p.numel() for cls in _SUBLAYERS.values() for p in cls(config, 0, d, None).parameters())
        out.append(
            {
                "tp": d,
                "layer_param_bytes": params * element,
                "input_bytes_per_row": config.seq_len * config.hidden * element,
            }
        )
    return out


def device_slug(device: dict[str, str]) -> str:
    """A file name for a device: {"type": "cpu", "name": "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"}
    -> "cpu-intel-xeon-platinum-8375c"."""
    text = re.sub(r"\((r|tm)\)", "", device["name"].lower())
    text = re.sub(r"\bcpu\b.*$", "", text)  # "... CPU @ 2.90GHz": the model is what comes before
    return "-".join([device["type"], *re.findall(r"[a-z0-9]+", text)])[:60]


def profile_document(
    ctx,
    config: GPTConfig,
    compute,
    head,
    collectives,
    memory,
    overlap: Optional[dict[str, float]] = None,
    *,
    dtype: torch.dtype = torch.float32,
    chunks: Optional[dict[str, float]] = None,
    assumed: Optional[dict[str, Any]] = None,
    skipped: Optional[dict[str, str]] = None,
) -> dict[str, Any]:
    """The planner's profile (oases.planner.profile_from_dict reads it). `assumed`: what was
    stated rather than measured ({"link": parse_assume_link's dict, ...}; None: all measured);
    `skipped`: {section: why} for sections one run could not measure."""
    flops = []
    for c in compute:  # achieved FLOP/s of the largest samples, for shapes the profile did not sample
        tokens = c["rows"] * c["seq_len"]
        h, f, s = c["hidden"], c["ffn_hidden"], c["seq_len"]
        fl = (
            (8 * tokens * h * h + 4 * tokens * s * h) / c["tp"]
            if c["sublayer"] == "attention"
            else 4 * tokens * h * f / c["tp"]
        )
        flops.append((fl, fl / max(c["forward_s"], 1e-9)))
    rate = float(np.median([r for fl, r in sorted(flops)[-max(1, len(flops) // 3) :]]))
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": ctx.meta["device"],
        "versions": ctx.meta["versions"],
        "link": ctx.meta["link"],
        "threads_per_rank": ctx.meta["threads_per_rank"],
        "world_size": ctx.world_size,
        "dtype": str(dtype).removeprefix("torch."),
        "element_bytes": torch.empty((), dtype=dtype).element_size(),
        "flops_per_s": rate,
        "overlap_efficiency": 1.0 if overlap is None else overlap["overlap_efficiency"],
        "overlap": overlap,
        "chunk_efficiency": chunks or {},
        "model": {
            "hidden": config.hidden,
            "heads": config.heads,
            "seq_len": config.seq_len,
            "ffn_hidden": config.hidden * config.mlp_ratio,
            "vocab_size": config.vocab_size,
        },
        "compute": compute,
        "head": head,
        "collectives": collectives,
        "memory": memory,
        "assumed": assumed or {},
        "skipped": skipped or {},
    }


def run(args, ctx) -> list[dict]:
    refusal = check_args(args, ctx.world_size)
    if refusal:
        raise ValueError(refusal)
    config, dtype = _config(args), _dtype(args)
    rows = [int(r) for r in args.rows.split(",")] if args.rows else ([1, 2] if args.quick else [1, 2, 4, 8])
    degrees = _degrees(ctx.world_size, config)
    row_bytes = config.seq_len * config.hidden * 4
    sizes = sorted({row_bytes * r for r in rows} | ({16384} if args.quick else {65536, 4 * 2**20}))
    compute = measure_compute(ctx, config, degrees, rows, dtype)
    head = measure_head(ctx, config, rows, dtype)
    memory = measure_memory(config, degrees, dtype)
    chunks = measure_chunk_efficiency(
        ctx, config, max(rows), degrees[-1], (2, 4) if args.quick else (2, 4, 8, 16), dtype
    )
    assumed: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    if ctx.world_size > 1:
        collectives = measure_collectives(ctx, sizes)
        overlap = measure_overlap(ctx, config, max(rows), degrees[-1], dtype)
    else:  # check_args: --assume-link given
        collectives = assumed_collectives(args.assume_link)
        overlap = None
        assumed = {
            "link": args.assume_link,
            "collectives": "p2p (2) is the assumed link; all-reduce and all-gather follow from it by the "
            "planner's ring formulas",
            "overlap_efficiency": 1.0,
        }
        skipped = {
            "collectives": "one rank: nothing to communicate with (--assume-link states the link)",
            "overlap": "one rank: no all-reduce to overlap with compute (overlap_efficiency 1.0 assumed)",
        }
    doc = profile_document(
        ctx,
        config,
        compute,
        head,
        collectives,
        memory,
        overlap,
        dtype=dtype,
        chunks=chunks,
        assumed=assumed,
        skipped=skipped,
    )
    if ctx.rank == 0:
        path = args.profile_out or os.path.join(PROFILES_DIR, device_slug(ctx.meta["device"]) + ".json")
        write_json(path, doc)
        print(f"wrote profile {path}", flush=True)
    records = [{"kind": "compute", **c} for c in compute] + [{"kind": "head", **h} for h in head]
    for kind, fits in collectives.items():
        for group, fit in fits.items():
            records.append(
                {
                    "kind": kind,
                    "group": int(group),
                    "latency_s": fit["latency_s"],
                    "bytes_per_s": fit["bytes_per_s"],
                    "samples": fit["samples"],
                    "assumed": bool(fit.get("assumed", False)),
                }
            )
    records += [{"kind": "memory", **m} for m in memory]
    if overlap is not None:
        records.append({"kind": "overlap", **overlap})
    records += [{"kind": "skipped", "section": section, "reason": why} for section, why in skipped.items()]
    return records


def tables(records: list[dict]) -> list[Table]:
    compute = [
        [r["sublayer"], r["tp"], r["rows"], 1e3 * r["forward_s"], 1e3 * r["backward_s"]]
        for r in records
        if r["kind"] == "compute"
    ]
    links = [
        [
            r["kind"] + (" (assumed)" if r.get("assumed") else ""),
            r["group"],
            1e6 * r["latency_s"],
            r["bytes_per_s"] / 1e6,
            len(r["samples"]),
        ]
        for r in records
        if r["kind"] in ("all_reduce", "all_gather", "p2p")
    ]
    head = [[r["rows"], 1e3 * r["forward_s"], 1e3 * r["backward_s"]] for r in records if r["kind"] == "head"]
    overlap = [
        f"overlap efficiency {r['overlap_efficiency']:.2f}: {r.get('forwards', 1)} MLP forward(s) "
        f"{1e3 * r['compute_s']:.1f} ms, an all-reduce {1e3 * r['comm_s']:.1f} ms, "
        f"both at once {1e3 * r['both_s']:.1f} ms"
        for r in records
        if r["kind"] == "overlap"
    ]
    overlap += [f"not measured: {r['section']}: {r['reason']}" for r in records if r["kind"] == "skipped"]
    return [
        Table(
            "profile: sublayer compute per TP degree (this rank's shard)",
            ["sublayer", "tp", "rows", "forward ms", "backward ms"],
            compute,
        ),
        Table("profile: LM head", ["rows", "forward ms", "backward ms"], head),
        Table(
            "profile: communication, t = latency + bytes / bandwidth (bytes: the full tensor)",
            ["kind", "group", "latency us", "MB/s", "sizes"],
            links,
            overlap,
        ),
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    plt = pyplot()

    fits = [r for r in records if r["kind"] in ("all_reduce", "all_gather", "p2p") and r["samples"]]
    if not fits:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in fits:
        n = np.array([s[0] for s in r["samples"]])
        ax.scatter(n / 2**20, [1e3 * s[1] for s in r["samples"]], label=f"{r['kind']} ({r['group']})")
        ax.plot(n / 2**20, 1e3 * (r["latency_s"] + n / r["bytes_per_s"]), linewidth=1)
    ax.set_xlabel("MiB (full tensor)")
    ax.set_ylabel("ms (MAX over ranks)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    return save_figure(fig, path)
