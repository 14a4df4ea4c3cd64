"""Inputs checked across the TP group (oases.inputs) at every entry point: oases.train_step and
the forward of a model after oases.parallelize (a tiny Hugging Face Llama), GPT.train_step, and
Pipeline.train_step (over the whole mesh).

Per entry point: a batch size, a sequence length or the tokens differing on one rank raise one
ValueError on every rank, naming the input, the ranks and what differs (without the check, the
first raises inside gloo, SIGABRT, and the last trains on another loss per rank); check_inputs=False
runs equal inputs through; "broadcast" makes TP rank 0's batch everyone's: every rank's loss is the
single-process loss on rank 0's batch. Each run ends on a barrier, so a rank left in a collective
fails it by the hard timeout.
"""

import copy
import importlib.util
import re
import warnings

import pytest
import torch
import torch.distributed as dist

import oases
from oases.inputs import agree_inputs, set_check_inputs
from oases.models import GPT, GPTConfig

from _spawn import harness_device, rank_device, run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)
VOCAB, T = 96, 12
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


def _tokens(b, t, seed):
    """Seeded token ids (made on the CPU) on the rank's device."""
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed)).to(rank_device())


def _swapped(ids):
    """ids with two different tokens of row 0 swapped: the same shape, dtype and token counts."""
    out = ids.clone()
    j = int((ids[0] != ids[0, 0]).nonzero()[0])
    out[0, 0], out[0, j] = ids[0, j], ids[0, 0]
    return out


def _raises(pattern, fn, *args, **kwargs):
    """fn(...) raises a ValueError matching `pattern` (re.search) on this rank; returns its message."""
    with pytest.raises(ValueError) as caught:
        fn(*args, **kwargs)
    message = str(caught.value)
    assert re.search(pattern, message), message
    return message


def _mismatches(rank, size, b, name="input_ids", who="TP group"):
    """{case: (this rank's tensor, the message pattern every rank must raise)}: rank 1 differs."""
    ids = _tokens(b, T, 0)
    ranks = ", ".join(map(str, range(size)))
    head = rf"{name}: the {size} ranks of the {who} \(global ranks {ranks}\) must get the same {name}, but "
    return {
        "batch": (
            ids[: b - 1] if rank == 1 else ids,
            head + rf"its batch size differs: global rank 0 passes shape \({b}, {T}\), global rank 1 passes "
            rf"shape \({b - 1}, {T}\)",
        ),
        "sequence": (
            ids[:, : T - 2] if rank == 1 else ids,
            head + rf"its sequence length differs: global rank 0 passes shape \({b}, {T}\), global rank 1 "
            rf"passes shape \({b}, {T - 2}\)",
        ),
        "content": (
            _swapped(ids) if rank == 1 else ids,
            head + rf"its content differs \(the same shape \({b}, {T}\) and dtype int64, other values: "
            rf"global rank 0 vs global rank 1\)",
        ),
    }


# ---- a parallelized Hugging Face Llama: oases.train_step and model(...) -------------------------
def _llama(degrees=None):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
    ).to(rank_device())
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model, tp_degrees=degrees)
    return model, reference


def _check_llama(rank, world_size):
    model, reference = _llama()
    ids = _tokens(4, T, 0)
    fix = r".*; give every rank of a TP group the same batch .* check_inputs=False skips this check$"
    losses = {}
    # (a)-(c) train_step: every rank raises, nothing ran
    for mine, pattern in _mismatches(rank, world_size, 4).values():
        _raises(pattern + fix, oases.train_step, model, mine, mine)
        _raises(pattern, oases.train_step, model, mine, mine, check_inputs=True, schedule="megatron")
    _raises(r"labels: .* its content differs", oases.train_step, model, ids, _swapped(ids) if rank else ids)
    mask = torch.ones_like(ids)
    _raises(
        r"attention_mask: .* whether it is a tensor differs: global rank 0 passes a tensor, global rank 1 passes "
        r"no tensor",
        oases.train_step,
        model,
        ids,
        ids,
        attention_mask=None if rank else mask,
    )
    _raises(
        r"attention_mask: in \"broadcast\" mode every rank takes global rank 0's inputs, which passes no tensor "
        r"for attention_mask while global rank 1 does",
        oases.train_step,
        model,
        ids,
        ids,
        attention_mask=mask if rank else None,
        check_inputs="broadcast",
    )
    _raises(
        r"check_inputs: expected True .*, False .* or \"broadcast\" .*, got 'yes'",
        oases.train_step,
        model,
        ids,
        ids,
        check_inputs="yes",
    )
    assert all(p.grad is None for p in model.parameters()), "a failed check ran nothing"
    # (d) equal inputs, the check off (and on): the unsharded loss
    want = reference(input_ids=ids, labels=ids).loss.detach()
    for mode in (False, True):
        model.zero_grad(set_to_none=True)
        losses[f"train_step {mode}"] = loss = oases.train_step(model, ids, ids, check_inputs=mode)
        torch.testing.assert_close(loss, want, **TOL)
    # (e) broadcast: rank 1's batch (another size, or None) is replaced by rank 0's
    for i, theirs in enumerate((_tokens(3, T - 1, 5), None)):
        model.zero_grad(set_to_none=True)
        mine = ids if rank == 0 else theirs
        losses[f"train_step broadcast {i}"] = loss = oases.train_step(model, mine, mine, check_inputs="broadcast")
        torch.testing.assert_close(loss, want, **TOL)

    # The forward of the parallelized model: the same checks, by keyword or position, at every call.
    for mine, pattern in _mismatches(rank, world_size, 4).values():
        _raises(pattern + r".*; .* oases\.inputs\.set_check_inputs\(model, \"broadcast\"\)", model, input_ids=mine)
        _raises(pattern, model, mine, labels=ids)
    _raises(r"labels: .* its content differs", model, ids, labels=_swapped(ids) if rank else ids)
    model(ids)  # the forward after a failed one: the group is still in step
    _raises(r"input_ids: .* its batch size differs", model, ids[:3] if rank else ids)  # checked every forward
    set_check_inputs(model, False)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, want, **TOL)
    set_check_inputs(model, "broadcast")
    theirs = _tokens(2, T, 9)
    out = model(ids if rank == 0 else theirs, labels=ids if rank == 0 else theirs)
    losses["forward broadcast"] = out.loss.detach()
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(out.logits, reference(ids).logits, **TOL)
    with pytest.raises(ValueError, match=r"mode: expected True .* got 'on'"):
        set_check_inputs(model, "on")
    with pytest.raises(ValueError, match=r"model: LlamaForCausalLM has no input check to switch"):
        set_check_inputs(reference, True)
    set_check_inputs(model, True)

    # Per-layer tp_degrees: the whole group agrees (one layer at degree 1 runs on this rank's rows).
    per_layer, _ = _llama(degrees=[1, 2])
    mine, pattern = _mismatches(rank, world_size, 4)["batch"]
    _raises(pattern, oases.train_step, per_layer, mine, mine)
    _raises(pattern, per_layer, mine, labels=mine)
    dist.barrier()  # every rank got here: none was left in a collective
    return {k: float(v) for k, v in losses.items()}


@needs_transformers
def test_llama_train_step_and_forward_check_inputs_across_the_tp_group():
    losses = run_ranks(_check_llama, 2, timeout=240)
    assert losses[0] == losses[1]  # broadcast: the same loss on both ranks, bit for bit


# ---- oases.models.GPT ----------------------------------------------------------------------------
def _check_gpt(rank, world_size):
    config = GPTConfig(vocab_size=VOCAB, seq_len=T, hidden=32, heads=4, layers=2)
    alone, _ = dist.new_subgroups(group_size=1)
    reference = GPT(config, alone, seed=0).to(rank_device())  # the unsharded model on this rank
    model = GPT(config, seed=0).to(rank_device())
    ids, targets = _tokens(4, T, 0), _tokens(4, T, 1)
    for mine, pattern in _mismatches(rank, world_size, 4, name="tokens").values():
        theirs = targets[: mine.shape[0], : mine.shape[1]]
        _raises(pattern + r".*; give every rank of a TP group", model.train_step, mine, theirs)
    _raises(r"targets: .* its content differs", model.train_step, ids, _swapped(targets) if rank else targets)
    assert all(p.grad is None for p in model.parameters())
    reference(ids, targets).backward()
    want = reference(ids, targets).detach()
    losses = {}
    for mode in (False, True, "broadcast"):
        model.zero_grad(set_to_none=True)
        mine = (ids, targets) if rank == 0 or mode != "broadcast" else (_tokens(6, T, 3), None)
        losses[str(mode)] = loss = model.train_step(*mine, check_inputs=mode)
        torch.testing.assert_close(loss, want, **TOL)
        # and the gradients are the unsharded model's (rank 0's batch on both ranks)
        torch.testing.assert_close(model.wpe.weight.grad, reference.wpe.weight.grad, **TOL)
    # oases.train_step on the GPT: the GPT's own group
    mine = ids[:3] if rank else ids
    _raises(r"input_ids: .* batch size differs", oases.train_step, model, mine, mine)
    # per-layer tp_degrees: the whole group
    per_layer = GPT(config, seed=0, tp_degrees=[1, 2]).to(rank_device())
    mine, pattern = _mismatches(rank, world_size, 4, name="tokens")["batch"]
    _raises(pattern, per_layer.train_step, mine, targets[: mine.shape[0]])
    dist.barrier()
    return {k: float(v) for k, v in losses.items()}


def test_gpt_train_step_checks_inputs_across_the_tp_group():
    losses = run_ranks(_check_gpt, 2, timeout=180)
    assert losses[0] == losses[1]


# ---- Pipeline: every rank of the mesh gets the global batch --------------------------------------
def _check_pipeline(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from oases.pipeline import Pipeline

    config = GPTConfig(vocab_size=VOCAB, seq_len=T, hidden=16, heads=2, layers=4)
    alone, _ = dist.new_subgroups(group_size=1)
    mesh = init_device_mesh(harness_device(), (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))  # stages {0, 1}, {2, 3}
    pipe = Pipeline(config, mesh, schedule="1f1b", micro_batches=2, seed=3)
    ids, targets = _tokens(4, T, 0), _tokens(4, T, 1)
    head = r"tokens: the 4 ranks of the pipeline's mesh \(global ranks 0, 1, 2, 3\) must get the same tokens, but "
    odd = rank == 3  # the second stage's TP rank 1 alone
    _raises(
        head + rf"its batch size differs: global ranks 0, 1, 2 pass shape \(4, {T}\), global rank 3 passes shape "
        rf"\(2, {T}\) \(targets differ as well\); give every rank of the mesh the same global batch",
        pipe.train_step,
        ids[:2] if odd else ids,
        targets[:2] if odd else targets,
    )
    _raises(
        head + r"its sequence length differs",
        pipe.train_step,
        ids[:, :5] if rank == 2 else ids,
        targets[:, :5] if rank == 2 else targets,
    )
    _raises(
        head + r"its content differs \(the same shape \(4, 12\) and dtype int64, other values: global ranks 0, 1, "
        r"3 vs global rank 2\)",
        pipe.train_step,
        _swapped(ids) if rank == 2 else ids,
        targets,
    )
    _raises(
        r"targets: .* its dtype differs: global ranks 0, 2, 3 pass int64, global rank 1 passes int32",
        pipe.train_step,
        ids,
        targets.int() if rank == 1 else targets,
    )
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"train_step: called with gradients disabled"):
        pipe.train_step(ids, targets)  # an evaluation loop's no_grad: every rank raises, nothing posted
    want = GPT(config, alone, seed=3).to(rank_device())(ids, targets).detach()
    pipe.close()
    losses = {}
    for mode in (False, "broadcast"):  # a fresh step each: the first step's loss is the initial weights'
        mine = (ids, targets) if rank == 0 or mode is False else (_tokens(2, 3, 4), targets[:1])
        pipe = Pipeline(config, mesh, schedule="1f1b", micro_batches=2, seed=3)
        losses[str(mode)] = loss = pipe.train_step(*mine, check_inputs=mode)
        torch.testing.assert_close(loss, want, **TOL)
        pipe.close()
    dist.barrier()
    return {k: float(v) for k, v in losses.items()}


def test_pipeline_checks_the_global_batch_across_the_mesh():
    losses = run_ranks(_check_pipeline, 4, timeout=240)
    assert all(l == losses[0] for l in losses)


def test_agree_inputs_without_a_group_is_the_identity():
    """One process (no process group): nothing to agree on; a bad mode still raises."""
    ids = _tokens(2, 3, 0)
    assert agree_inputs({"input_ids": ids, "labels": None})["input_ids"] is ids
    with pytest.raises(ValueError, match=r"check_inputs: expected True"):
        agree_inputs({"input_ids": ids}, mode=1)
