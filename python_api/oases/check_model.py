"""`oases check-model`: before a long job, check that oases trains your architecture exactly.

    oases check-model llama                        # a model type, with transformers' defaults
    oases check-model path/to/config.json          # a config file, or a directory holding one
    oases check-model qwen3 --tp 2 4 --json out.json
    oases.check_model.check_model("apertus")       # the same from Python: a list of Verdicts

A tiny model of the same architecture is built from the config (`tiny_config`: 2 layers, or one
per distinct `layer_types` entry; head_dim 16; at most 16 query heads keeping the query / key-value
ratio (multi-query stays multi-query); the intermediate width keeping its ratio to the hidden one;
4 routed experts, 2 per token; vocabulary 128; dropout 0; eager attention), with the same random
weights on every rank, and on `tp` local ranks (gloo on 127.0.0.1, one process per rank, a hard
timeout) checked against the unsharded model in each rank:

    parallelize        oases.parallelize(model) with the default plan (a refusal: its message)
    coverage           the decoder layers' projections all sharded (oases.summary)
    logits             model(...)'s logits equal the unsharded model's (rtol 1e-4, atol 1e-5)
    grads model(...)   loss.backward(): every parameter's gradient equals its shard of the unsharded one
    invariant          oases.check_gradients (whole parameters' gradients alike on every rank)
    train_step S       oases.train_step on schedule S (each of oases.schedule.SCHEDULES, and
                       oases-sp: sequence parallel, skipped where the layers run whole): loss, every gradient
    export             oases.save_pretrained read back by transformers' from_pretrained (rank 0) and
                       by oases.load_pretrained into a fresh TP model, both equal to the trained weights

One verdict per check and TP degree: "ok", "FAIL" (with what differed) or "skipped" (why: heads not
divisible, a refusal upstream). The command prints a table and exits 1 on any failure, 2 when no
tiny model can be built.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from oases._tiny_config import heads_of, tiny_config

__all__ = ["Verdict", "tiny_config", "check_model", "add_arguments", "run", "DESCRIPTION"]

DESCRIPTION = __doc__.split("\n\n")[0]
TOL = dict(rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class Verdict:
    """One check at one TP degree: `ok` True (passed), False (failed) or None (skipped); `detail` says why."""

    check: str
    tp: int
    ok: Optional[bool]
    detail: str = ""


def _compare(name: str, got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if torch.allclose(got, want, **TOL):
        return None
    err = float((got.double() - want.double()).abs().max())
    return f"{name}: max |diff| {err:.3g} (|want| max {float(want.abs().max()):.3g})"


def _grads(tp: torch.nn.Module, want: dict[str, torch.Tensor], rank: int, p: int) -> Optional[str]:
    """The first parameter whose gradient is not its shard of the unsharded one (None: all equal)."""
    for name, q in tp.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = tp.get_submodule(owner)
        rule = module.tp_layout().get(leaf) if hasattr(module, "tp_layout") else None
        full = want[name]
        expected = full if rule is None else rule.shard(full, rank, p)
        if q.grad is None:
            return f"{name}: no gradient"
        bad = _compare(f"grad of {name}", q.grad, expected)
        if bad:
            return bad
    return None


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400]


def _rank_checks(rank: int, p: int, config: Any, build: Optional[Callable], root: str) -> list[Verdict]:
    """Every check of the module doc on this rank (the process group is up)."""
    import transformers

    import oases

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build(config) if build is not None else transformers.AutoModelForCausalLM.from_config(config)

    out: list[Verdict] = []
    ref = make()
    tp = copy.deepcopy(ref)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(tp)
    except (ValueError, TypeError) as error:
        return [Verdict("parallelize", p, False, _one_line(error))]
    out.append(Verdict("parallelize", p, True))
    summary = oases.summary(tp)
    coverage = "n/a" if summary.layer_coverage is None else f"{summary.layer_coverage:.0%}"
    out.append(
        Verdict(
            "coverage",
            p,
            not summary.left_whole,
            f"decoder layers {coverage} sharded, {summary.share:.0%} of the parameters on this rank"
            + (f"; left whole: {', '.join(summary.left_whole)}" if summary.left_whole else ""),
        )
    )
    vocab = int(getattr(config, "vocab_size", 128))
    ids = torch.randint(3, min(vocab, 128) - 1, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ref.zero_grad(set_to_none=True)
    want_out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    want_out.loss.backward()
    want = {n: q.grad.clone() for n, q in ref.named_parameters() if q.grad is not None}
    tp.zero_grad(set_to_none=True)
    try:
        got = tp(input_ids=ids, attention_mask=mask, labels=labels)
        bad = _compare("logits", got.logits, want_out.logits.detach())
        out.append(Verdict("logits", p, bad is None, bad or ""))
        got.loss.backward()
        bad = _grads(tp, want, rank, p)
        out.append(Verdict("grads model(...)", p, bad is None, bad or ""))
    except Exception as error:  # noqa: BLE001 (reported as the verdict)
        out.append(Verdict("logits", p, False, _one_line(error)))
    try:
        oases.check_gradients(tp)
        out.append(Verdict("invariant", p, True))
    except RuntimeError as error:
        out.append(Verdict("invariant", p, False, _one_line(error)))
    out += _schedule_checks(tp, p, rank, (ids, labels, mask), want_out.loss.detach(), want)
    out.append(_export_check(tp, type(ref), make, p, rank, root))
    return out


def _schedule_checks(
    tp: torch.nn.Module, p: int, rank: int, batch: tuple, want_loss: torch.Tensor, want: dict[str, torch.Tensor]
) -> list[Verdict]:
    """oases.train_step on every schedule (and "oases" with sequence parallelism): the loss and
    every gradient against the single process's."""
    import oases
    from oases.schedule import SCHEDULES

    ids, labels, mask = batch
    out: list[Verdict] = []
    split = {part.kind for part in oases.models.HFStack(tp).parts}
    for schedule, sp in [(s, False) for s in SCHEDULES] + [("oases", True)]:
        name = f"train_step {schedule}" + (" sp" if sp else "")
        if sp and "whole" in split:
            out.append(Verdict(name, p, None, "decoder layers run whole: sequence parallelism refused"))
            continue
        tp.zero_grad(set_to_none=True)
        try:
            loss = oases.train_step(
                tp, ids, labels, schedule=schedule, attention_mask=mask, sequence_parallel=sp, check_grads=1
            )
        except (ValueError, RuntimeError) as error:
            out.append(Verdict(name, p, False, _one_line(error)))
            continue
        bad = _compare("loss", loss.detach(), want_loss) or _grads(tp, want, rank, p)
        out.append(Verdict(name, p, bad is None, bad or ""))
    return out


def _export_check(
    tp: torch.nn.Module, cls: type, make: Callable[[], torch.nn.Module], p: int, rank: int, root: str
) -> Verdict:
    """save_pretrained, then from_pretrained (rank 0) and load_pretrained (every rank) give the
    trained weights back."""
    import oases

    try:
        where = os.path.join(root, f"export-{p}")
        oases.save_pretrained(tp, where)
        bad = None
        trained = oases.full_state_dict(tp)  # a collective: on every rank
        if rank == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = cls.from_pretrained(where).state_dict()
            for key, value in trained.items():
                if key in back and not torch.equal(back[key], value):
                    bad = f"{key}: from_pretrained differs from the trained weights"
                    break
        fresh = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(fresh)
        oases.load_pretrained(fresh, where)
        for (key, a), (_, b) in zip(tp.state_dict().items(), fresh.state_dict().items()):
            if not torch.equal(a, b):
                bad = bad or f"{key}: load_pretrained differs from the saved weights"
                break
        return Verdict("export", p, bad is None, bad or "")
    except Exception as error:  # noqa: BLE001 (reported as the verdict)
        return Verdict("export", p, False, _one_line(error))


def _rank_main(rank: int, p: int, port: int, config: Any, build: Optional[Callable], root: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # from_pretrained's, once per rank
    hf_logging.set_verbosity_error()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=p, timeout=timedelta(seconds=120))
        results.put((rank, "ok", _rank_checks(rank, p, config, build, root)))
    except BaseException:  # noqa: BLE001 (sent to the parent)
        results.put((rank, "error", traceback.format_exc(limit=8)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_degree(config: Any, p: int, build: Optional[Callable], timeout: float) -> list[Verdict]:
    heads, kv = heads_of(config)
    if heads is not None and heads % p:
        return [Verdict("parallelize", p, None, f"{heads} query heads do not divide by {p}")]
    if kv is not None and kv % p and p % kv:
        return [Verdict("parallelize", p, None, f"{kv} key-value heads neither divide nor are divided by {p}")]
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as root:
        port = _free_port()
        procs = [
            context.Process(target=_rank_main, args=(r, p, port, config, build, root, results), daemon=True)
            for r in range(p)
        ]
        for proc in procs:
            proc.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < p and time.monotonic() < deadline:
                try:
                    rank, kind, value = results.get(timeout=0.5)
                except queue.Empty:  # a rank that died before reporting (an import error, a signal) ends the run
                    dead = [r for r, proc in enumerate(procs) if r not in got and proc.exitcode not in (None, 0)]
                    if dead:
                        got[dead[0]] = ("error", f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                        break
                    continue
                got[rank] = (kind, value)
                if kind == "error":
                    break
        finally:
            for proc in procs:
                proc.join(timeout=5 if len(got) == p else 0.1)
                if proc.is_alive():
                    proc.kill()
    errors = {r: v for r, (k, v) in got.items() if k == "error"}
    if errors or len(got) < p:
        rank, tb = next(iter(errors.items()), (None, f"timed out after {timeout:.0f} s"))
        where = f"rank {rank}: " if rank is not None else ""
        return [Verdict("run", p, False, where + tb.strip().splitlines()[-1][:400])]
    merged = []
    for verdicts in zip(*(got[r][1] for r in range(p))):
        failed = next((v for v in verdicts if v.ok is False), None)
        merged.append(failed or verdicts[0])
    return merged


def check_model(
    config: Any,
    *,
    tp: Sequence[int] = (2, 4),
    build: Optional[Callable[[Any], torch.nn.Module]] = None,
    timeout: float = 600.0,
) -> list[Verdict]:
    """Build a tiny model of `config`'s architecture and check it at each TP degree (module doc).

    ::

        small = tiny_config(config)
        for p in tp: on p local gloo ranks, every check of the module doc -> Verdict(check, p, ok, detail)

    Args:
        config: a model type ("llama"), a config.json path or a directory holding one, or a PretrainedConfig.
        tp: the TP degrees to check (each its own group of local processes).
        build: `build(small_config) -> model` (default: AutoModelForCausalLM.from_config); a picklable
            (module-level) function, run on every rank with the same seed.
        timeout: seconds each TP degree may take before its ranks are killed (a failed "run" verdict).

    Returns:
        The verdicts, every check of each degree in order.
    """
    small = tiny_config(config)
    verdicts = []
    for p in tp:
        verdicts += _run_degree(small, p, build, timeout)
    return verdicts


def render(verdicts: Sequence[Verdict], title: str) -> str:
    """A table: one row per check, one column per TP degree, then each failure's detail."""
    degrees = sorted({v.tp for v in verdicts})
    checks = list(dict.fromkeys(v.check for v in verdicts))
    cell = {(v.check, v.tp): v for v in verdicts}
    word = {True: "ok", False: "FAIL", None: "skipped"}
    lines = [title, f"{'check':<26}" + "".join(f"{'tp=' + str(p):<10}" for p in degrees)]
    for check in checks:
        lines.append(
            f"{check:<26}" + "".join(f"{word[cell[check, p].ok] if (check, p) in cell else '-':<10}" for p in degrees)
        )
    notes = [v for v in verdicts if v.ok is not True and v.detail]
    lines += [f"  tp={v.tp} {v.check}: {word[v.ok]}: {v.detail}" for v in notes]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `oases check-model`."""
    parser.add_argument("config", help="a model type (llama, qwen3, ...), a config.json, or a directory holding one")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="TP degrees to check (default: 2 4)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per TP degree (default 600)")
    parser.add_argument("--json", help="also write the verdicts to this JSON file")


def run(args: argparse.Namespace) -> int:
    """`oases check-model`: print the table; 0 when every check passed or was skipped, 1 on a failure,
    2 when no tiny model can be built from the config."""
    try:
        small = tiny_config(args.config)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kind = type(AutoModelForCausalLM.from_config(small)).__name__
    except Exception as error:  # noqa: BLE001 (the config is the user's: say what failed)
        print(f"oases check-model: no tiny causal LM from {args.config!r}: {_one_line(error)}")
        return 2
    verdicts = []
    for p in args.tp:
        verdicts += _run_degree(small, p, None, args.timeout)
    heads, kv = heads_of(small)
    title = f"oases check-model {args.config}: {kind}, tiny config ({heads} heads, {kv} key-value heads)"
    print(render(verdicts, title), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "model": kind, "verdicts": [asdict(v) for v in verdicts]}, f, indent=1)
    return 1 if any(v.ok is False for v in verdicts) else 0
