"""Pipeline targets with -100 (no loss there: padding, prompt tokens), as torch's and Hugging Face's
ignore_index: the loss is the mean over the other positions of the global batch, so a DP rank or a
micro-batch with more padding weighs by its tokens, not by its rows.

    a Llama at PP2 x DP2 (aiao, 2 segments) and PP2 x TP2 (vocabulary-parallel head), targets with
    whole padded rows and padded tails: train_step's losses, eval_step, and the state after 3 SGD
    steps == one process's F.cross_entropy(..., ignore_index=-100)           # fp32 tolerance
    targets all -100, or another negative value: ValueError on every rank before any communication
    oases.models.GPT's loss (forward, train_step at TP 2, its pipeline) == F.cross_entropy(ignore_index=-100)
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from oases.pipeline import Pipeline

from _spawn import harness_device, rank_device, run_ranks
from _tiny_llama import tiny_llama

SEED, BATCH, T, VOCAB, STEPS = 5, 8, 8, 32, 3


def _llama():
    return tiny_llama().to(rank_device())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _batches():
    """Targets padded unevenly: the first DP rank's rows mostly padding, the second's hardly."""
    g = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, T), generator=g)
        targets = torch.randint(0, VOCAB, (BATCH, T), generator=g)
        targets[0] = -100  # a whole padded row
        targets[1:3, 2:] = -100  # padded tails
        targets[5, :3] = -100  # a masked prompt
        batches.append((tokens, targets))
    return batches


def _golden():
    torch.manual_seed(SEED)
    model = _llama()
    opt = _sgd(model.parameters())

    def loss_of(tokens, targets):
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    batches = [(tokens.to(rank_device()), targets.to(rank_device())) for tokens, targets in _batches()]
    losses = []
    for tokens, targets in batches:
        loss = loss_of(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    with torch.no_grad():
        evaluated = loss_of(*batches[0])
    return losses, evaluated, model.state_dict()


def _ignored(rank, world_size):
    losses, evaluated, want = _golden()
    for mesh_shape, schedule, segments in (((2, 2, 1), "aiao", 2), ((1, 2, 2), "1f1b", 1)):
        where = f"{mesh_shape} {schedule}"
        mesh = init_device_mesh(harness_device(), mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
        pipe = Pipeline(_llama, mesh, schedule=schedule, segments=segments, micro_batches=2, optimizer=_sgd, seed=SEED)
        for step, batch in enumerate(_batches()):
            got = pipe.train_step(*batch)
            torch.testing.assert_close(got, losses[step], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where} {step}: {m}")
        torch.testing.assert_close(pipe.eval_step(*_batches()[0]), evaluated, rtol=1e-5, atol=1e-5)
        state = pipe.state_dict()
        for key, value in state.items():
            torch.testing.assert_close(
                value.cpu(), want[key].cpu(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{where} {key}: {m}"
            )
        tokens, targets = _batches()[0]
        with pytest.raises(ValueError, match="targets: every position is -100"):
            pipe.train_step(tokens, torch.full_like(targets, -100))
        with pytest.raises(ValueError, match=r"targets: values must lie in \[0, vocab_size = 32\) or be -100"):
            pipe.train_step(tokens, targets.masked_fill(targets == -100, -1))
        pipe.close()
    dist.barrier()  # no rank was left inside a collective
    return True


def test_ignored_targets_give_the_single_process_mean_4_ranks():
    pytest.importorskip("transformers")
    assert run_ranks(_ignored, 4, timeout=180) == [True] * 4


def _gpt_ignored(rank, world_size):
    """oases.models.GPT's own loss (forward and train_step at TP 2, the pipeline of it at PP 2)
    with -100 targets: F.cross_entropy(ignore_index=-100) of its logits."""
    from oases.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=VOCAB, seq_len=T, hidden=16, heads=2, mlp_ratio=2, layers=2)
    tokens, targets = (t.to(rank_device()) for t in _batches()[0])
    alone, _ = dist.new_subgroups(group_size=1)
    single = GPT(config, alone, seed=SEED).to(rank_device())
    want = F.cross_entropy(single(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(single(tokens, targets), want, rtol=1e-6, atol=1e-6)
    sharded = GPT(config, None, seed=SEED).to(rank_device())  # TP 2 over both ranks
    torch.testing.assert_close(sharded(tokens, targets), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sharded.train_step(tokens, targets), want, rtol=1e-5, atol=1e-5)
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(config, mesh, schedule="1f1b", micro_batches=2, optimizer=_sgd, seed=SEED)
    torch.testing.assert_close(pipe.train_step(tokens, targets), want, rtol=1e-5, atol=1e-5)
    pipe.close()
    return True


def test_gpt_loss_ignores_minus_100_as_torch_2_ranks():
    assert run_ranks(_gpt_ignored, 2, timeout=120) == [True, True]
