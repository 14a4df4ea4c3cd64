"""Packed rows (several documents in one row, `position_ids` restarting at each, as Hugging Face's
padding-free collators and TRL's packing make them) through oases.train_step: the loss and every
gradient of the unsharded model's forward on the same rows and positions, on every schedule."""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch

import oases
from oases.schedule import SCHEDULES

from _shards import expected_shard
from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

TOL = dict(rtol=1e-4, atol=1e-5)
VOCAB = 96


def _model(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, num_hidden_layers=2, attn_implementation="eager")
    if kind == "llama":
        config = tf.LlamaConfig(
            **small, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
        )
        return tf.LlamaForCausalLM(config).to(rank_device())
    if kind == "gpt2":  # learned absolute positions: position_ids pick the embedding's rows
        config = tf.GPT2Config(**small, n_embd=64, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0)
        config.attn_pdrop = 0.0
        return tf.GPT2LMHeadModel(config).to(rank_device())
    raise AssertionError(kind)


def packed_batch(rows: int, lengths: list[list[int]], seed: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels, position_ids) [rows, t]: row i packs documents of lengths[i] (each row
    the same total t); each document's first label is -100 (as DataCollatorWithFlattening makes it)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths[0])
    ids = torch.randint(0, VOCAB, (rows, t), generator=g)
    labels = ids.clone()
    positions = torch.empty(rows, t, dtype=torch.long)
    for i, docs in enumerate(lengths):
        assert sum(docs) == t
        start = 0
        for n in docs:
            positions[i, start : start + n] = torch.arange(n)
            labels[i, start] = -100
            start += n
    return ids.to(rank_device()), labels.to(rank_device()), positions.to(rank_device())


def _reference(model, ids, labels, positions):
    out = model(input_ids=ids, labels=labels, position_ids=positions, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_packed(rank, world_size, kind):
    ref = _model(kind)
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids, labels, positions = packed_batch(4, [[5, 7], [12], [3, 4, 5], [8, 4]], seed=3)
    # the packing is seen: the documents apart give other logits than the rows read whole
    with torch.no_grad():
        apart = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
        whole = ref(input_ids=ids, use_cache=False).logits
    assert (apart - whole).abs().max() > 1e-2, "packing changed nothing: the test cannot fail"
    cases = [(s, None, False, True) for s in SCHEDULES] + [("oases", 4, True, True), ("oases", 2, False, False)]
    for schedule, sub_batches, sp, recompute in cases:
        ref.zero_grad(set_to_none=True)
        tp.zero_grad(set_to_none=True)
        want_loss, want_grads = _reference(ref, ids, labels, positions)
        loss = oases.train_step(
            tp,
            ids,
            labels,
            position_ids=positions,
            schedule=schedule,
            sub_batches=sub_batches,
            sequence_parallel=sp,
            recompute=recompute,
        )
        where = f"{kind} p={world_size} {schedule} sub_batches={sub_batches} sp={sp} recompute={recompute}"
        torch.testing.assert_close(loss, want_loss, **TOL, msg=lambda m: f"{where}: loss {m}")
        for name, param in tp.named_parameters():
            torch.testing.assert_close(
                param.grad,
                expected_shard(tp, name, want_grads[name], rank, world_size),
                **TOL,
                msg=lambda m: f"{where}: grad of {name}: {m}",
            )
    return True


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_packed_rows_match_unsharded_on_every_schedule(kind):
    assert run_ranks(_check_packed, 2, kind) == [True, True]


def _check_refusals(rank, world_size):
    tp = _model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    ids, labels, positions = packed_batch(2, [[5, 7], [12]], seed=1)
    with pytest.raises(ValueError, match=r"position_ids: shape \(2, 11\) differs"):
        oases.train_step(tp, ids, labels, position_ids=positions[:, :11])
    with pytest.raises(TypeError, match="position_ids: expected an integer tensor"):
        oases.train_step(tp, ids, labels, position_ids=positions.float())
    # ranks that disagree on the positions: refused on every rank before the step
    mine = positions.clone()
    if rank == 1:
        mine[1] = torch.cat([torch.arange(6), torch.arange(6)])
    with pytest.raises(ValueError, match="position_ids"):
        oases.train_step(tp, ids, labels, position_ids=mine)
    gpt = oases.models.GPT(oases.models.GPTConfig(vocab_size=VOCAB, seq_len=12, hidden=32, heads=4)).to(rank_device())
    with pytest.raises(ValueError, match="position_ids: GPT takes no token positions"):
        oases.train_step(gpt, ids, labels, position_ids=positions)
    return True


def test_bad_position_ids_are_refused_on_every_rank():
    assert run_ranks(_check_refusals, 2) == [True, True]
