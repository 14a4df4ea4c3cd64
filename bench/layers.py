"""Suite `layers`: a TP model's training step on every schedule, beside PyTorch's own TP.

    python -m bench layers --bandwidth 750mbit                  # oases.models.GPT (default --model gpt)
    python -m bench layers --model llama --bandwidth 750mbit    # transformers' LlamaForCausalLM
    python -m bench layers --model llama                        # unshaped: what sub-batching alone does

The ablation of the Oases paper (megatron -> merak -> cross_pass -> oases) on the same model,
data and weights, measured in one run (variants round-robin, medians, MAX over ranks). Models:

    gpt     oases.models.GPT (2 layers, hidden 512, 8 heads, batch 8 x 64), `GPT.train_step`
    llama   transformers' LlamaForCausalLM as examples/train_llama.py builds it (2 layers, hidden
            512, 8 heads, 4 KV heads, intermediate 1408, vocabulary padded to a multiple of p,
            sdpa, untied embeddings; batch 8 x 64), sharded as that example shards it,
            `oases.parallelize(model, vocab_parallel=False)`: its 30-token embedding and LM head
            replicated (`--vocab-parallel`: sharded over the vocabulary, parallelize's default,
            whose [b, t, h] all-reduces of the embedding's output and of the head's input
            gradient the schedule runs, per sub-batch, overlapped with the other); one step =
            `oases.train_step(model, ids, ids, schedule=s, comm=comm)`

Per schedule (and `oases-sp`: the oases schedule with sequence parallelism, whose
gathers and scatters are counted in `sent` and replayed as all-reduces of the same bytes in t_comm;
`oases-keep`: the oases schedule without recomputation, `train_step(..., recompute=False)`, each
sublayer's forward graph kept as the peers keep autograd's activations; `oases-selective`: those
graphs saving only GEMM and attention outputs, `recompute="selective"`; `oases-auto`: train_step's
default, `recompute="auto"`, each layer's mode chosen for the device's memory; the plain schedules
pin `recompute=True`, full recomputation):

    t_step      forward + backward (gradients zeroed first for llama, as a training loop does)
    t_compute   the same step with the all-reduces counted but not sent (Communicator.dry_run()),
                timed in the same round-robin as every step
    t_comm      the step's all-reduces alone: as many, as large, blocking, back to back
    bound       max(t_compute, t_comm); efficiency = (t_megatron - t_step) / (t_megatron - bound)
    busy        1 - (time blocked on communication) / t_step, the least busy rank
    exposure    (a second table, CPU) one recorded step's waits split by cause for the rank that
                waited most (oases.schedule.exposure: dependency, issue order, latency, bandwidth,
                interference, host; ring steps not split) and the compute's own slow-down; every
                all-reduce's time in flight also goes to the trace
    peak MiB    rise of the process's peak resident memory during one step (VmHWM reset first,
                glibc set to return freed blocks at once; measured after all timings)
    sent MiB    bytes each rank sends per step, by ring (oases.schedule.Communicator's count; a
                peer's collectives counted alike: all-reduce 2 (p-1)/p n, all-gather and
                reduce-scatter (p-1)/p n of a full tensor of n bytes)
    t_input_check  (JSON; a share of megatron's t_step in the table's notes) the input check each of
                our steps runs first (oases.inputs: one all_gather of a shape + content-hash summary of
                the batch over the TP group), timed alone
    t_grad_check   (JSON; a share of megatron's t_step in the notes) oases.check_gradients on our
                model after a step, timed alone: the gradient invariant train_step checks on a
                model's first step (every N-th with check_grads=N)

The PyTorch peers hold the same weights, train with plain autograd (no recomputation) and must
give our loss on the first step, checked before any timing (a wrong peer fails the run):

    gpt     torch_tp       the same GPT written for DTensor TP (`parallelize_module`, ColwiseParallel
                           q/k/v/fc1, RowwiseParallel proj/fc2)
    llama   torch_tp       torchtitan's `apply_tp` plan on the HF model (sequence parallel,
                           vocabulary-parallel embedding and LM head, loss_parallel); see bench._llama
            torch_tp_nosp  DTensor TP in Megatron's layout (no sequence parallelism), the stronger
                           peer on gloo, whose reduce-scatter is an all-reduce
            hf_tp          transformers' native TP, what a Hugging Face user runs first:
                           `from_pretrained(dir, tp_plan="auto")` (the model's own plan, DTensor);
                           with `accelerate` absent, the same plan applied by transformers' own
                           steps (see bench._llama.hf_tp); skipped, with the reason printed, where
                           transformers has no native TP
    (llama: every peer gradient is also checked against the unsharded model's.)

Sub-batches run smaller GEMMs, which on a CPU can be faster by themselves (cache): compare
t_compute across schedules, and run the suite unshaped too.

The trace: one extra step of each schedule of ours, not measured (profiled: every op slower), on
tid 0, its waits on tid 1 from the library's `oases::schedule::wait` profiler range (a
Communicator handle's wait(); bench._trace.WAIT_RANGES, read through torch.profiler), with each
all-reduce's time in flight on tid 4 where the exposure breakdown runs; each peer's step on tid 0.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bench import _metrics
from bench._peers import CollectiveLog, agree
from bench._report import Table, pyplot, save_figure
from bench._rss import hwm_rise_mib
from bench._threads import OtherThreadsCPU, thread_queued
from bench._trace import COMPUTE, IN_FLIGHT, WAIT_RANGES, profiled
from oases.costs.link import LinkFit
from oases.inputs import agree_inputs
from oases.models import GPT, GPTConfig
from oases.nn import check_gradients
from oases.schedule import SCHEDULES, Communicator, RecomputeMemory
from oases.schedule.exposure import CAUSES, attribute, gather_logs

BASELINE = "megatron"
MODELS = ("gpt", "llama")
# Our variants: every schedule, and the oases schedule with sequence parallelism ("-sp").
VARIANTS = (*SCHEDULES, "oases-sp", "oases-selective", "oases-keep", "oases-auto")
# train_step's recompute of a variant's suffix; the plain schedules pin True (full recomputation)
_RECOMPUTE = {"-keep": False, "-selective": "selective", "-auto": "auto"}


def _variant(name: str) -> tuple[str, bool, object]:
    """(schedule, sequence_parallel, recompute) of a variant name."""
    recompute = next((r for suffix, r in _RECOMPUTE.items() if name.endswith(suffix)), True)
    base = name.removesuffix("-sp").removesuffix("-keep").removesuffix("-selective").removesuffix("-auto")
    return base, name.endswith("-sp"), recompute


_SHORT = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="gpt",
        help="gpt: oases.models.GPT; llama: transformers' LlamaForCausalLM through "
        "oases.train_step, beside torchtitan's DTensor plan (default: gpt)",
    )
    parser.add_argument("--hidden", type=int, default=None, help="default 512 (--quick: 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4, help="llama: key/value heads (default 4)")
    parser.add_argument("--batch", type=int, default=None, help="default 8 (--quick: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64 (--quick: 16)")
    parser.add_argument(
        "--vocab-parallel",
        action="store_true",
        help="llama: shard our model's embedding and LM head over the vocabulary (parallelize's default); "
        "without it they stay replicated, as examples/train_llama.py holds its 30-token vocabulary",
    )
    parser.add_argument(
        "--sub-batches",
        type=int,
        default=None,
        choices=range(1, 9),
        metavar="N",
        help="sub-batches of merak, cross_pass and oases (default: each schedule's own, 2)",
    )


def _sub_batches(args, variant: str) -> Optional[int]:
    """--sub-batches for the schedules that split the batch (not megatron's one program)."""
    return None if variant == "megatron" else getattr(args, "sub_batches", None)


def _sizes(args) -> tuple[int, int, int]:
    """(hidden, seq_len, batch) from the arguments, --quick's defaults when not given."""
    quick = args.quick
    hidden, seq_len, batch = args.hidden or (64 if quick else 512), args.seq_len or (16 if quick else 64), args.batch
    return hidden, seq_len, batch or (4 if quick else 8)


def _config(args) -> tuple[GPTConfig, int]:
    hidden, seq_len, batch = _sizes(args)
    return GPTConfig(vocab_size=64, seq_len=seq_len, hidden=hidden, heads=args.heads, layers=args.layers), batch


@dataclass
class _Case:
    """One model on every schedule and its PyTorch peers, built alike on every rank, ready to time."""

    title: str
    config: dict[str, Any]
    ours: dict[str, Callable[[], torch.Tensor]]  # schedule -> one training step; returns the loss
    comms: dict[str, Communicator]  # schedule -> the Communicator its step issues on
    peers: dict[str, Callable[[], torch.Tensor]]  # peer -> one training step; returns the loss
    peer_info: dict[str, dict[str, Any]]  # peer -> impl, plan, notes (for the JSON)
    notes: list[str]  # for the table
    check: Optional[Callable[[], None]] = None  # after every step ran once: further checks (raise)
    inputs: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # a step's inputs, for its input check
    grad_check: Optional[Callable[[], None]] = None  # oases.check_gradients on our model (its gradients present)
    real_step: Optional[Callable[[], object]] = None  # fresh gradients of one real step (not dry) before timing it


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


def _gpt_case(args, ctx) -> _Case:
    config, batch = _config(args)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(ctx.device)
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(ctx.device)
    models = {
        name: GPT(config, ctx.group, schedule=_variant(name)[0], seed=0, sequence_parallel=_variant(name)[1]).to(
            ctx.device
        )
        for name in VARIANTS
    }

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    torch_tp = _torch_tp(config, models[BASELINE], mesh)

    def torch_step() -> torch.Tensor:
        loss = torch_tp(tokens, targets)
        loss.backward()
        return loss.detach()

    plan = {f"blocks.*.{n}": "ColwiseParallel()" for n in ("q", "k", "v", "fc1")}
    plan.update({f"blocks.*.{n}": "RowwiseParallel()" for n in ("proj", "fc2")})
    return _Case(
        title=(
            f"GPT {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
            f"batch {batch} x {config.seq_len}"
        ),
        config={
            "model": "gpt",
            "sub_batches": args.sub_batches,
            "hidden": config.hidden,
            "layers": config.layers,
            "heads": config.heads,
            "batch": batch,
            "seq_len": config.seq_len,
        },
        ours={
            name: (
                lambda memory=None, m=m, n=_sub_batches(args, name), keep=_variant(name)[2]: m.train_step(
                    tokens, targets, memory=memory, sub_batches=n, recompute=keep
                )
            )
            for name, m in models.items()
        },
        comms={name: m.comm for name, m in models.items()},
        peers={"torch_tp": torch_step},
        peer_info={
            "torch_tp": {
                "impl": "parallelize_module(_TorchGPT, init_device_mesh(cpu, (p,)), plan)",
                "description": "the same GPT in DTensor TP, plain autograd",
                "plan": plan,
                "notes": ["no recomputation; gradients accumulate across steps, as ours"],
            }
        },
        notes=["torch_tp: DTensor ColwiseParallel/RowwiseParallel, plain autograd (no recomputation)"],
        inputs={"tokens": tokens, "targets": targets},
        grad_check=lambda m=models[BASELINE]: check_gradients(m),
        real_step=lambda m=models[BASELINE]: (
            m.zero_grad(set_to_none=True),
            m.train_step(tokens, targets, recompute=True),
        ),
    )


def _llama_case(args, ctx) -> _Case:
    from torch.distributed.device_mesh import init_device_mesh

    import oases
    from bench import _llama

    hidden, seq_len, batch = _sizes(args)
    vocab_parallel = bool(getattr(args, "vocab_parallel", False))
    config = _llama.llama_config(
        hidden=hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        layers=args.layers,
        seq_len=seq_len,
        world_size=ctx.world_size,
    )
    reference = _llama.build(config).to(ctx.device)  # unsharded: the weights every variant copies
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=g).to(ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    peers = {name: _llama.torch_tp(name, reference, mesh) for name in _llama.PLANS}
    hf_reason = _llama.hf_tp_unavailable(ctx.device)
    if not agree(hf_reason is None, ctx.device):
        hf_reason = hf_reason or "unavailable on another rank"
        if ctx.rank == 0:
            print(f"layers: {_llama.HF_TP} skipped: {hf_reason}", flush=True)
    else:  # every rank takes the same route (accelerate installed or not)
        from_pretrained = agree(_llama.has_accelerate(), ctx.device)
        peers[_llama.HF_TP] = _llama.hf_tp(reference, ctx.world_size, from_pretrained=from_pretrained)
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LM head stays replicated, as the warning would say
        oases.parallelize(model, vocab_parallel=vocab_parallel)
    comms = {name: Communicator(dist.group.WORLD, ctx.world_size) for name in VARIANTS}

    def ours(name: str, memory: Optional[RecomputeMemory] = None) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        schedule, sequence_parallel, recompute = _variant(name)
        return oases.train_step(
            model,
            ids,
            ids,
            schedule=schedule,
            sequence_parallel=sequence_parallel,
            comm=comms[name],
            memory=memory,
            sub_batches=_sub_batches(args, name),
            recompute=recompute,
        )

    def check() -> None:
        """Every peer's gradients (of its first step) against the unsharded model's."""
        reference.zero_grad(set_to_none=True)
        reference(input_ids=ids, labels=ids).loss.backward()
        for peer in peers.values():
            _llama.check_gradients(peer, reference)

    c = config
    notes = [f"{name}: {peer.description}" for name, peer in peers.items()]
    notes += [
        "torch_tp peers: parallelize_module on init_device_mesh(cpu, (p,)) over gloo, same weights, plain "
        "autograd (no recomputation), position_ids = arange(s) passed to the HF forward; every peer's "
        "loss and every gradient checked before timing",
        *(
            [f"{_llama.HF_TP}: {n}" for n in peers[_llama.HF_TP].notes]
            if _llama.HF_TP in peers
            else [f"{_llama.HF_TP} skipped: {hf_reason}"]
        ),
        "gloo runs a reduce-scatter as an all-reduce: sequence parallelism's reduce-scatters move "
        "twice their ring bytes here (hence torch_tp_nosp)",
        (
            "ours: embedding and LM head sharded over the vocabulary (--vocab-parallel: parallelize's default); "
            "the schedule runs the all-reduces of the embedding's output and of the head's input gradient "
            "(counted in t_comm and sent, overlapped with the other sub-batch); the loss's statistics "
            "([2, tokens] and a max) are the loss's own, blocking: counted in t_compute (dry_run does not skip them)"
            if vocab_parallel
            else f"ours: embedding and LM head replicated, as examples/train_llama.py shards its {c.vocab_size}-token "
            "vocabulary (parallelize(model, vocab_parallel=False)); --vocab-parallel shards them"
        ),
    ]
    return _Case(
        title=(
            f"HF LlamaForCausalLM {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads ({c.num_key_value_heads} KV), intermediate {c.intermediate_size}, "
            f"vocab {c.vocab_size}, batch {batch} x {seq_len}"
        ),
        config={
            "model": "llama",
            "sub_batches": args.sub_batches,
            "hidden": c.hidden_size,
            "layers": c.num_hidden_layers,
            "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads,
            "intermediate": c.intermediate_size,
            "vocab": c.vocab_size,
            "batch": batch,
            "seq_len": seq_len,
            "attn_implementation": "sdpa",
            "tie_word_embeddings": False,
            "vocab_parallel": vocab_parallel,
        },
        ours={name: (lambda memory=None, name=name: ours(name, memory)) for name in VARIANTS},
        comms=comms,
        peers={name: (lambda peer=peer: peer.step(ids)) for name, peer in peers.items()},
        peer_info={name: peer.describe() for name, peer in peers.items()},
        notes=notes,
        check=check,
        inputs={"input_ids": ids, "labels": ids, "attention_mask": None},
        grad_check=lambda: check_gradients(model),
        real_step=lambda: ours(BASELINE),  # zeroes the gradients first
    )


# ---- measurements -----------------------------------------------------------------------------
def _trace_step(ctx, name: str, step: Callable[[], object], comm: Communicator, in_flight: bool) -> None:
    """One step of ours for the trace only (the profiler slows every op, so no figure comes from
    it): the step on tid COMPUTE, its waits on tid COMM (the library's `oases::schedule::wait`
    ranges, bench._trace.WAIT_RANGES), with `in_flight` every all-reduce's time in flight on tid
    IN_FLIGHT (the same step's oases.schedule.exposure log)."""
    with (
        profiled(ctx.trace, WAIT_RANGES) as span,
        comm.recording() if in_flight else contextlib.nullcontext() as log,
    ):
        with span(f"{name} step", COMPUTE, label=name):
            step()
    for r in log.records if log is not None else ():
        if r.ended is not None:
            ctx.trace.interval(f"{name} all_reduce {r.phase}", IN_FLIGHT, r.issued, r.ended, bytes=r.nbytes)


_DRY = "dry/"  # the timer's name for a step's compute-only run


def _dry(step: Callable[[], object], comm: Communicator) -> Callable[[], object]:
    """`step` with `comm`'s collectives counted but not sent (Communicator.dry_run)."""

    def compute_only() -> object:
        with comm.dry_run():
            return step()

    return compute_only


def run(args, ctx) -> list[dict]:
    case = _llama_case(args, ctx) if args.model == "llama" else _gpt_case(args, ctx)
    steps = {**case.ours, **case.peers}
    losses = {name: float(step()) for name, step in steps.items()}  # the first step of each
    for name, loss in losses.items():
        if abs(loss - losses[BASELINE]) > 1e-4 * abs(losses[BASELINE]):
            raise AssertionError(f"layers: {name} loss {loss} differs from {BASELINE}'s {losses[BASELINE]}")
    if case.check is not None:
        case.check()
        case.check = None  # lets go of what it held (llama: the unsharded model)

    # Each step of ours also runs compute-only (its Communicator's dry run) in the same round-robin as
    # every step: a machine whose speed drifts (a shared host) moves the bound and the steps alike.
    timed = ctx.timer.measure(
        {**steps, **{_DRY + name: _dry(step, case.comms[name]) for name, step in case.ours.items()}}
    )
    compute = {name: timed[_DRY + name] for name in case.ours}
    # The TP group's input check every step of ours runs first (oases.inputs; check_inputs=True), alone.
    t_check = ctx.timer.measure({"check": lambda: agree_inputs(case.inputs, ctx.group, device=ctx.device)})["check"]
    # The gradient invariant oases.train_step checks on a model's first step (oases.check_gradients), alone.
    # Its gradients from one real step: the dry runs timed above left partial sums in .grad.
    t_grads = None
    if case.grad_check is not None:
        case.real_step()
        t_grads = ctx.timer.measure({"grads": case.grad_check})["grads"]

    records = []
    link = _exposure_link(ctx)  # None on CUDA or one rank: no breakdown there
    for name, step in case.ours.items():
        comm = case.comms[name]
        _trace_step(ctx, name, step, comm, in_flight=link is not None)
        comm.reset()
        busy_before, queued = time.perf_counter(), thread_queued()
        with (
            comm.recording() if link is not None else contextlib.nullcontext() as log,
            OtherThreadsCPU() as comm_cpu,
        ):
            step()
        step_s, waited, queued = time.perf_counter() - busy_before, comm.waited, thread_queued() - queued
        calls, sent = sum(comm.calls.values()), sum(comm.bytes.values())
        # MIN over ranks of the busy share (host time: on CUDA, waits do not block the host)
        busy = -ctx.timer.max_over_ranks(torch.tensor([waited / step_s - 1.0], dtype=torch.float64))
        if link is not None:  # the exposure's `queued`: the same in a step of compute alone
            queued_alone = _queued_in(_dry(step, comm))
            dist.barrier(group=ctx.group)  # the ranks leave it at different times: meet before the next timing
        p = ctx.world_size  # all-reduces sending as many bytes by ring: 2 (p-1)/p numel*4 each
        replay = torch.zeros(round(sent / max(calls, 1) * p / (2 * max(p - 1, 1)) / 4), device=ctx.device)
        t_comm = ctx.timer.measure({"comm": lambda: [dist.all_reduce(replay) for _ in range(calls)]})["comm"]
        memory = RecomputeMemory()
        step(memory=memory)
        records.append(
            _record(
                name,
                timed[name].median,
                compute[name].median,
                t_comm.median,
                float(busy),
                calls,
                sent,
                None,
                losses[name],
            )
        )
        records[-1]["checkpoint_mib"] = memory.peak / 2**20
        # other threads' CPU is the transfers' only with one intra-op thread and no communicator thread
        # (sequence parallelism's runs norms and finishes there): else not measured
        transfers_cpu = comm_cpu.seconds if torch.get_num_threads() == 1 and not name.endswith("-sp") else None
        records[-1]["exposure"] = (
            None
            if link is None
            else _exposure(ctx, log, waited, step_s, compute[name].median, link, transfers_cpu, queued - queued_alone)
        )
    for name, step in case.peers.items():
        with ctx.trace.span(f"{name} step", 0):
            step()
        with CollectiveLog() as log:
            step()
        collectives = log.summary()
        sent = sum(_metrics.ring_bytes(kind, c["bytes"], ctx.world_size) for kind, c in collectives.items())
        calls = sum(c["calls"] for c in collectives.values())
        r = _record(name, timed[name].median, None, None, None, calls, round(sent), collectives, losses[name])
        r["peer"] = case.peer_info[name]
        r["checkpoint_mib"] = None
        records.append(r)
    for r in records:  # after every timing: see hwm_rise_mib
        peak = hwm_rise_mib(steps[r["schedule"]])
        r["peak_mib"] = (
            None if peak is None else float(ctx.timer.max_over_ranks(torch.tensor([peak], dtype=torch.float64)))
        )
    by_name = {r["schedule"]: r for r in records}
    for r in records:
        r["speedup_vs_megatron"] = _metrics.speedup(by_name[BASELINE]["t_step"], r["t_step"])
        r["speedup_vs"] = {peer: _metrics.speedup(by_name[peer]["t_step"], r["t_step"]) for peer in case.peers}
        r["speedup_vs_torch_tp"] = r["speedup_vs"]["torch_tp"]
        r["efficiency"] = (
            None if r["bound"] is None else _metrics.efficiency(by_name[BASELINE]["t_step"], r["t_step"], r["bound"])
        )
        r["t_input_check"] = t_check.median  # included in our t_step; the peers run none
        r["t_grad_check"] = None if t_grads is None else t_grads.median  # a model's first train_step only
        r["config"] = case.config
        r["title"] = case.title
        r["notes"] = (
            case.notes
            + [
                f"input check (oases.inputs: all_gather of a shape + content-hash summary, on by default and "
                f"included in every t_step of ours): {1e6 * t_check.median:.0f} us per step = "
                f"{100 * t_check.median / by_name[BASELINE]['t_step']:.2f}% of {BASELINE}'s t_step"
            ]
            + (
                []
                if t_grads is None
                else [
                    f"gradient invariant (oases.check_gradients: digests of the whole parameters' gradients, one "
                    f"all-reduce; oases.train_step runs it on a model's first step only, check_grads=N every N-th): "
                    f"{1e6 * t_grads.median:.0f} us = {100 * t_grads.median / by_name[BASELINE]['t_step']:.2f}% of "
                    f"{BASELINE}'s t_step"
                ]
            )
        )
    return records


EXPOSURE_SIZES = ((64, 20), (1 << 20, 4))  # (bytes, calls back to back) of the all-reduces the link is fitted to


def _exposure_link(ctx) -> Optional[LinkFit]:
    """The link model of the exposure breakdown: a LinkFit through all-reduces of EXPOSURE_SIZES,
    each timed alone, back to back as a step issues them (CPU only: on CUDA a wait does not block
    the host; None there and on one rank)."""
    if ctx.world_size < 2 or ctx.is_cuda:
        return None
    samples = []
    for nbytes, calls in EXPOSURE_SIZES:
        t = torch.zeros(nbytes // 4, device=ctx.device)
        timing = ctx.timer.measure({"alone": lambda t=t, calls=calls: [dist.all_reduce(t) for _ in range(calls)]})
        samples.append((nbytes, timing["alone"].median / calls))
    return LinkFit.from_samples(samples)


def _queued_in(fn: Callable[[], object]) -> float:
    """The calling thread's run-queue wait during fn() (NaN without schedstat)."""
    before = thread_queued()
    fn()
    return thread_queued() - before


def _exposure(
    ctx,
    log,
    waited: float,
    step_s: float,
    t_compute: float,
    link: LinkFit,
    comm_cpu_s: Optional[float],
    queued_s: float,
) -> dict:
    """The recorded step's waits split by cause (oases.schedule.exposure) for the rank that
    waited most. `recorded`: its waits on asynchronous all-reduces, which the causes add up to;
    `unattributed`: the rest (ring steps: sequence parallelism's gathers and scatters).
    `compute_slowed`: the step's time not waiting, minus t_compute (the same step with nothing
    sent): compute slowed while the transfers run (CPU interference on the compute side; noise
    when small). `comm_cpu`: the CPU seconds that rank's other threads (gloo's, the communicator's)
    used during the step (bench._threads; None where those threads also compute: intra-op threads
    > 1, or sequence parallelism's communicator thread): the transfers' own cost to the cores
    the compute runs on, one measured part of what slows it. `queued`: the main thread's time ready
    to run but waiting for a core (Linux schedstat) in the step, minus the same in one step of
    compute alone (`queued_s`; None without schedstat): the other part, the cores the transfers
    (gloo's threads, the kernel's network work) took from the compute, as the scheduler counted it."""
    logs = gather_logs(log, ctx.group)
    per_rank = attribute(logs, link)
    figures = torch.tensor(
        [waited, step_s, log.waited, -1.0 if comm_cpu_s is None else comm_cpu_s, queued_s], dtype=torch.float64
    )
    gathered = [torch.zeros_like(figures) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, figures, group=ctx.group)
    rank = max(range(ctx.world_size), key=lambda r: float(gathered[r][0]))
    waited_r, step_r, recorded_r, comm_cpu_r, queued_r = (float(v) for v in gathered[rank])
    causes = per_rank[rank]
    by_phase: dict[str, float] = {}  # that rank's recorded waits per pass (forward, recompute, backward)
    for r in logs[rank]:
        by_phase[r.phase] = by_phase.get(r.phase, 0.0) + sum(w1 - w0 for w0, w1, _ in r.waits)
    return {
        "rank": rank,
        "waited": waited_r,
        "step": step_r,
        "causes": causes,
        "recorded": recorded_r,
        "by_phase": by_phase,
        "unattributed": waited_r - recorded_r,
        "compute_slowed": step_r - waited_r - t_compute,
        "comm_cpu": None if comm_cpu_r < 0 else comm_cpu_r,
        "queued": None if math.isnan(queued_r) else queued_r,
        "link": {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s},
    }


def _record(
    name: str,
    t_step: float,
    t_compute: Optional[float],
    t_comm: Optional[float],
    busy: Optional[float],
    calls: int,
    sent: int,
    collectives: Optional[dict],
    loss: float,
) -> dict:
    """collectives: a peer's, {kind: {"calls", "bytes" of the full tensors}} (ours: None, counted by
    the Communicator: `calls` all-reduces, `sent` bytes sent by ring)."""
    bound = None if t_compute is None else _metrics.bound(t_compute, t_comm)
    all_reduces = calls if collectives is None else collectives.get("all_reduce", {}).get("calls", 0)
    return {
        "schedule": name,
        "t_step": t_step,
        "t_compute": t_compute,
        "t_comm": t_comm,
        "bound": bound,
        "busy": busy,
        "all_reduces": all_reduces,
        "collective_calls": calls,
        "sent_bytes": sent,
        "collectives": collectives,
        "loss": loss,
        "peer": None,
    }


def _collectives(r: dict) -> str:
    if r["collectives"] is None:  # ours, counted by the Communicator (sequence parallel: mostly AG and RS)
        return f"{r['collective_calls']} {'AG/RS/AR' if r['schedule'].endswith('-sp') else 'AR'}"
    return " + ".join(f"{c['calls']} {_SHORT.get(kind, kind)}" for kind, c in r["collectives"].items()) or "0"


def tables(records: list[dict]) -> list[Table]:
    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else 1e3 * v

    peers = list(records[0]["speedup_vs"])
    rows = [
        [
            r["schedule"],
            ms(r["t_step"]),
            ms(r["t_compute"]),
            ms(r["t_comm"]),
            ms(r["bound"]),
            r["efficiency"],
            r["busy"],
            r["speedup_vs_megatron"],
            *(r["speedup_vs"][p] for p in peers),
            r["peak_mib"],
            r["checkpoint_mib"],
            r["sent_bytes"] / 2**20,
            _collectives(r),
        ]
        for r in records
    ]
    return [
        Table(
            f"layers: {records[0]['title']}",
            [
                "schedule",
                "t_step ms",
                "t_compute ms",
                "t_comm ms",
                "bound ms",
                "efficiency",
                "busy",
                "x megatron",
                *(f"x {p}" for p in peers),
                "peak MiB",
                "ckpt MiB",
                "sent MiB",
                "collectives",
            ],
            rows,
            [
                "efficiency = (t_megatron - t_step) / (t_megatron - bound); busy = share of the step not "
                "blocked on communication (least busy rank)",
                "ckpt MiB = sublayer inputs kept for recomputation at most at once (oases.schedule.RecomputeMemory; "
                "peers keep autograd's activations instead)",
                "sent MiB = bytes each rank sends per step by ring: all-reduce (AR) 2 (p-1)/p n, all-gather (AG) "
                "and reduce-scatter (RS) (p-1)/p n, for a full tensor of n bytes",
                *records[0]["notes"],
            ],
        ),
        *_exposure_table(records),
    ]


def _exposure_table(records: list[dict]) -> list[Table]:
    """Where each schedule's waits went (one recorded step, the rank that waited most)."""
    rows = []
    for r in records:
        e = r.get("exposure")
        if e is None:
            continue
        phases = e["by_phase"]
        rows.append(
            [
                r["schedule"],
                1e3 * e["step"],
                1e3 * e["waited"],
                *(1e3 * e["causes"][c] for c in CAUSES),
                1e3 * e["unattributed"],
                1e3 * e["compute_slowed"],
                None if e.get("comm_cpu") is None else 1e3 * e["comm_cpu"],
                None if e.get("queued") is None else 1e3 * e["queued"],
                " / ".join(f"{1e3 * phases.get(p, 0.0):.0f}" for p in ("forward", "recompute", "backward")),
            ]
        )
    if not rows:
        return []
    return [
        Table(
            "layers: where the waits went (ms; one recorded step, the rank that waited most)",
            [
                "schedule",
                "step",
                "waited",
                *CAUSES,
                "ring steps",
                "compute slowed",
                "comm CPU",
                "queued",
                "fwd / recomp / bwd",
            ],
            rows,
            [
                "waited = dependency + issue order + latency + bandwidth + interference + host + ring steps "
                "(oases.schedule.exposure): dependency = no other sub-batch ran while it waited; issue order = "
                "a peer had not issued it yet; latency / bandwidth = the link's own time for it (a ring's "
                "messages / its bytes, fitted from all-reduces timed alone) not covered by compute; "
                "interference = slower than that link time (the cores that compute also reduce, or "
                "collectives sharing the link); host = waking up after it completed; ring steps = waits "
                "inside ring all-gathers / reduce-scatters (sequence parallelism), not split",
                "compute slowed = step - waited - t_compute: the compute's own slow-down while transfers run",
                "comm CPU = CPU time that rank's other threads (gloo's, the communicator's) used in the step: "
                "the transfers' own cost to the cores the compute needs (on a CPU run every core computes), "
                "which overlap cannot hide",
                "queued = the time that rank's main thread was ready to run but waited for a core (Linux "
                "schedstat), minus the same in a step of compute alone: the cores the transfers (gloo's threads, "
                "the kernel's network work) took from the compute, as the scheduler counted it",
                "fwd / recomp / bwd = the recorded waits by the pass of their all-reduce",
            ],
        )
    ]


def plot(records: list[dict], path: str, title: str) -> bool:
    plt = pyplot()

    names = [r["schedule"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [1e3 * r["t_step"] for r in records], color="tab:blue", label="t_step")
    ax.bar(
        names,
        [1e3 * (r["t_compute"] or 0) for r in records],
        color="tab:green",
        width=0.4,
        label="t_compute (communication not sent)",
    )
    for i, r in enumerate(records):
        if r["bound"] is not None:
            ax.hlines(
                1e3 * r["bound"],
                i - 0.4,
                i + 0.4,
                colors="black",
                linestyles=":",
                label="bound max(compute, comm)" if i == 0 else None,
            )
    ax.set_ylabel("ms per training step (MAX over ranks)")
    ax.set_title(f"{records[0]['title']}\n{title}", fontsize=8)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)  # the peers' names are long
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)
