"""The schedule's own all-reduces of a vocabulary-parallel embedding and LM head (embed_split,
head_split): where the split is taken, where it is refused, and that the step stays exact."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from test_train_step import TOL, _batch, _model, _reference

import oases
from oases.models.hf import _Given
from oases.schedule import Communicator

from _shards import expected_shard as _expected
from _spawn import rank_device, run_ranks


def test_given_stands_in_for_the_embedding():
    """The stand-in gives a fresh copy of the summed embeddings per call (a base may scale it in
    place), reads other attributes from the embedding, and refuses other ids."""
    embedding = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2, 3]])
    summed = torch.randn(1, 3, 4)
    given = _Given(embedding, ids, summed)
    first = given(ids)
    first.mul_(2)  # in place, as CTRL's base scales its embeddings
    assert torch.equal(given(ids.clone()), summed) and given(ids) is not summed
    assert given.weight is embedding.weight and given.num_embeddings == 10
    with pytest.raises(RuntimeError, match="other ids than the step's"):
        given(torch.tensor([[1, 2, 4]]))


def _split_or_not(rank, world_size):
    """(oases forward / backward all-reduce counts) for a Llama with the split and with a forward
    hook on its embedding (split refused: the hook must run); each exact."""
    counts = {}
    ids, labels, _ = _batch(4, 12, seed=5, padded=False)
    ids, labels = ids.to(rank_device()), labels.to(rank_device())
    for case in ("llama", "llama-hooked"):
        ref = _model("llama").to(rank_device())
        tp = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(tp)
        called = []
        if case == "llama-hooked":  # doubles the embeddings (NEFTune-like): on the summed output
            for model in (ref, tp):
                model.model.embed_tokens.register_forward_hook(lambda m, args, out: called.append(1) or 2 * out)
        ref.zero_grad(set_to_none=True)
        want_loss, want_grads = _reference(ref, ids, labels, None)
        called.clear()
        comm = Communicator(dist.group.WORLD, world_size)
        loss = oases.train_step(tp, ids, labels, schedule="oases", comm=comm, recompute=True)  # no probe's call
        assert called == ([1, 1] if case == "llama-hooked" else []), case  # once per sub-batch
        torch.testing.assert_close(loss, want_loss, **TOL)
        for name, param in tp.named_parameters():
            torch.testing.assert_close(
                param.grad, _expected(tp, name, want_grads[name], rank, world_size), **TOL, msg=f"{case} {name}"
            )
        counts[case] = dict(comm.calls)
    return counts


def test_split_taken_and_refused_for_a_hooked_embedding():
    counts = run_ranks(_split_or_not, 2, timeout=120)[0]
    layers = 2  # test_train_step.SMALL: 2 sublayers a layer, 2 sub-batches
    assert counts["llama"] == {"forward": 4 * layers + 2, "backward": 4 * layers + 2}
    # a hook on the embedding: it runs whole (its all-reduce inside); the head's is still split
    assert counts["llama-hooked"] == {"forward": 4 * layers, "backward": 4 * layers + 2}
