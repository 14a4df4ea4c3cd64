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

__all__ = ["Verdict", "tiny_config", "check_model", "add_arguments", "run", "DESCRIPTION"]

DESCRIPTION = __doc__.split("\n\n")[0]
TOL = dict(rtol=1e-4, atol=1e-5)
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv")
_INNER = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_k", "top_k")
_SMALL = {  # (key, value) set where the config has the key (not None)
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "max_seq_len": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "sliding_window": 8,
    "router_jitter_noise": 0.0,
    "n_group": 1,  # DeepSeek's grouped routing: one group of the 4 experts
    "topk_group": 1,
}


@dataclass(frozen=True)
class Verdict:
    """One check at one TP degree: `ok` True (passed), False (failed) or None (skipped); `detail` says why."""

    check: str
    tp: int
    ok: Optional[bool]
    detail: str = ""


def _first(d: dict, keys: Sequence[str]) -> Optional[str]:
    return next((k for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def tiny_config(config: Any) -> Any:
    """A config of the same architecture, shrunk (module doc); `config` a transformers
    PretrainedConfig, a path to a config.json or a directory holding one, or a model type."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, str):
        if os.path.isdir(config) or os.path.isfile(config):
            path = config if os.path.isdir(config) else os.path.dirname(os.path.abspath(config)) or "."
            if os.path.isfile(config) and os.path.basename(config) != "config.json":
                with open(config) as f:
                    d = json.load(f)
                config = AutoConfig.for_model(d.pop("model_type"), **d)
            else:
                config = AutoConfig.from_pretrained(path, local_files_only=True)
        else:
            config = AutoConfig.for_model(config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"config: expected a model type, a config path or a PretrainedConfig, got {config!r}")
    text = getattr(config, "text_config", None)
    config = text if isinstance(text, PretrainedConfig) and _first(vars(text), _HIDDEN) else config
    d = config.to_dict()
    heads_key, kv_key = _first(d, _HEADS), _first(d, _KV_HEADS)
    heads = d[heads_key] if heads_key else 4
    kv = d[kv_key] if kv_key else heads
    if kv_key is None:  # a default left unset (Nemotron's None): one key-value head per query head
        kv_key = next((k for k in _KV_HEADS if k in d and d[k] is None), None)
    if d.get("multi_query") is True:
        kv = 1
    attn = d.get("attn_config") if isinstance(d.get("attn_config"), dict) else None  # DBRX's nested configs
    if attn is not None and isinstance(attn.get("kv_n_heads"), int):
        kv = attn["kv_n_heads"]
    group = heads // kv if kv and heads % kv == 0 else 1
    kv_small = 1 if kv == 1 else 1 << (min(kv, 4).bit_length() - 1)
    heads_small = kv_small * max(1, min(group, 16 // kv_small))
    hidden_key = _first(d, _HIDDEN)
    hidden = d[hidden_key] if hidden_key else None
    new: dict[str, Any] = {}
    if hidden_key:
        new[hidden_key] = heads_small * 16
    if heads_key:
        new[heads_key] = heads_small
    if kv_key:
        new[kv_key] = kv_small
    if isinstance(d.get("head_dim"), int):  # MLA's is the rotary part's (qk_rope_head_dim)
        new["head_dim"] = _SMALL["qk_rope_head_dim"] if d["head_dim"] == d.get("qk_rope_head_dim") else 16
    inner_key = _first(d, _INNER)
    if inner_key and hidden:
        new[inner_key] = max(32, round(d[inner_key] / hidden * heads_small * 16 / 32) * 32)
    for key in _EXPERTS:
        if _first(d, (key,)):
            new[key] = 4
    for key in _TOP_K:
        if _first(d, (key,)):
            new[key] = min(d[key], 2)
        elif key in d and d[key] is None and any(_first(d, (e,)) for e in _EXPERTS):
            new[key] = 2  # a default left unset (DeepSeek-V2's)
    new.update((k, v) for k, v in _SMALL.items() if d.get(k) is not None)
    if isinstance(d.get("rotary_dim"), int):  # GPT-J's, CodeGen's: within the head
        new["rotary_dim"] = 8
    if hidden_key and isinstance(d.get("word_embed_proj_dim"), int):  # OPT's: equal to the width, or half of it
        new["word_embed_proj_dim"] = new[hidden_key] if d["word_embed_proj_dim"] == hidden else new[hidden_key] // 2
    layers_key = _first(d, _LAYERS)
    kinds = list(dict.fromkeys(d["layer_types"])) if isinstance(d.get("layer_types"), list) else []
    if layers_key:
        new[layers_key] = max(2, len(kinds))
    if kinds:
        new["layer_types"] = (kinds * 2)[: max(2, len(kinds))]
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] > 0:
        new["first_k_dense_replace"] = 1  # one dense layer, one MoE layer
    if isinstance(d.get("mlp_only_layers"), list):
        new["mlp_only_layers"] = []
    for key, value in d.items():  # dropout 0: exact comparisons
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            new[key] = 0.0
    for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(d.get(key), int) and d[key] >= 128:
            new[key] = value
    if attn is not None:
        new["attn_config"] = {  # rope_theta and clip_qkv: transformers' default DBRX config cannot run without them
            **attn,
            "kv_n_heads": kv_small,
            "rope_theta": attn.get("rope_theta", 10000.0),
            "clip_qkv": attn.get("clip_qkv") or 8.0,
        }
        new["attn_config"].update({k: 0.0 for k in ("attn_pdrop",) if k in attn})
    ffn = d.get("ffn_config") if isinstance(d.get("ffn_config"), dict) else None
    if ffn is not None and hidden:
        small_hidden = heads_small * 16
        new["ffn_config"] = {**ffn, "hidden_size": small_hidden, "moe_num_experts": 4}
        if isinstance(ffn.get("ffn_hidden_size"), int):
            new["ffn_config"]["ffn_hidden_size"] = max(
                32, round(ffn["ffn_hidden_size"] / hidden * small_hidden / 32) * 32
            )
        if isinstance(ffn.get("moe_top_k"), int):
            new["ffn_config"]["moe_top_k"] = min(ffn["moe_top_k"], 2)
    d.update(new)
    for key in ("architectures", "_name_or_path", "transformers_version"):
        d.pop(key, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = type(config).from_dict(d, attn_implementation="eager")
    return small


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
    from oases.schedule import SCHEDULES

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
        bad = _compare("loss", loss.detach(), want_out.loss.detach()) or _grads(tp, want, rank, p)
        out.append(Verdict(name, p, bad is None, bad or ""))
    try:
        where = os.path.join(root, f"export-{p}")
        oases.save_pretrained(tp, where)
        bad = None
        trained = oases.full_state_dict(tp)  # a collective: on every rank
        if rank == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = type(ref).from_pretrained(where).state_dict()
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
        out.append(Verdict("export", p, bad is None, bad or ""))
    except Exception as error:  # noqa: BLE001 (reported as the verdict)
        out.append(Verdict("export", p, False, _one_line(error)))
    return out


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


def _heads_of(config: Any) -> tuple[Optional[int], Optional[int]]:
    d = config.to_dict()
    heads_key, kv_key = _first(d, _HEADS), _first(d, _KV_HEADS)
    heads = d[heads_key] if heads_key else None
    return heads, (d[kv_key] if kv_key else heads)


def _run_degree(config: Any, p: int, build: Optional[Callable], timeout: float) -> list[Verdict]:
    heads, kv = _heads_of(config)
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
    heads, kv = _heads_of(small)
    title = f"oases check-model {args.config}: {kind}, tiny config ({heads} heads, {kv} key-value heads)"
    print(render(verdicts, title), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "model": kind, "verdicts": [asdict(v) for v in verdicts]}, f, indent=1)
    return 1 if any(v.ok is False for v in verdicts) else 0
