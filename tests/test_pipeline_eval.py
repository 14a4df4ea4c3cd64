"""Pipeline.eval_step: the loss of a batch under the current parameters, forwards only, against one
process running `model.eval()` under `torch.no_grad()`:

    eval_step before training                   == the single process's eval loss at init
    train 1 and 2 steps (the last update pending), eval_step
                                                == its eval loss after 1 and 2 steps (the update applied)
    the third train_step and the final state    == the single process's (evaluation changed nothing)
    eval_step under torch.no_grad() and torch.inference_mode() works (training goes on after it);
                                                every module's training mode comes back
    every module in eval mode during eval_step, in training mode again after

at PP2 x DP2 (GPT, aiao over 2 segments, the DP sync partly deferred), PP2 x DP2 with zero=True, and
PP2 x TP2 (a Hugging Face Llama with tied embeddings, 1f1b).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from oases.models import GPT, GPTConfig
from oases.pipeline import Pipeline

from _spawn import harness_device, rank_device, run_ranks
from _tiny_llama import tiny_llama

GPT_CONFIG = dict(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2, layers=4)
SEED, BATCH, T, VOCAB = 7, 8, 8, 32
TOL = dict(rtol=1e-5, atol=1e-5)


def _llama():
    return tiny_llama(tied=True).to(rank_device())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # state made at the first update


def _batches():
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randint(0, VOCAB, (BATCH, T), generator=g), torch.randint(0, VOCAB, (BATCH, T), generator=g))
        for _ in range(4)
    ]


def _single(kind):
    """(model, its loss on a batch) of one process, as the pipeline builds it."""
    if kind == "gpt":
        alone, _ = dist.new_subgroups(group_size=1)
        model = GPT(GPTConfig(**GPT_CONFIG), alone, seed=SEED).to(rank_device())
        return model, lambda tokens, targets: model(tokens, targets)
    torch.manual_seed(SEED)
    model = _llama()

    def loss(tokens, targets):
        return F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())

    return model, loss


def _golden(kind):
    """(eval loss at init, train losses of steps 1-3, {1, 2: eval loss after that many steps}, final state)."""
    model, loss_of = _single(kind)
    opt = _sgd(model.parameters())
    batches = [(tokens.to(rank_device()), targets.to(rank_device())) for tokens, targets in _batches()]

    def evaluate(batch):
        model.eval()
        with torch.no_grad():
            value = loss_of(*batch)
        model.train()
        return value

    at_init = evaluate(batches[3])
    losses, after = [], {}
    for step in range(3):
        if step in (1, 2):
            after[step] = evaluate(batches[3])
        loss = loss_of(*batches[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return at_init, losses, after, model.state_dict()


def _pipeline(kind, mesh_shape, schedule, segments, **options):
    mesh = init_device_mesh(harness_device(), mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
    config = GPTConfig(**GPT_CONFIG) if kind == "gpt" else _llama
    return Pipeline(
        config, mesh, schedule=schedule, segments=segments, micro_batches=2, optimizer=_sgd, seed=SEED, **options
    )


def _evaluated(rank, world_size, cases):
    batches = _batches()
    for kind, mesh_shape, schedule, segments, options in cases:
        where = f"{kind} {mesh_shape} {schedule} ns={segments} {options}"
        at_init, losses, after, final = _golden(kind)
        pipe = _pipeline(kind, mesh_shape, schedule, segments, **options)
        torch.testing.assert_close(pipe.eval_step(*batches[3]), at_init, **TOL, msg=lambda m: f"{where}: init {m}")
        for step in range(3):
            if step in (1, 2):  # the last step's update is pending: applied first
                with torch.no_grad() if step == 2 else torch.inference_mode():  # allowed: it runs no backward
                    got = pipe.eval_step(*batches[3])  # (the first update makes the momentum: not in inference mode)
                torch.testing.assert_close(got, after[step], **TOL, msg=lambda m: f"{where}: after {step} {m}")
            loss = pipe.train_step(*batches[step])
            torch.testing.assert_close(loss, losses[step], **TOL, msg=lambda m: f"{where}: step {step} {m}")
        assert all(m.training for m in pipe.model.modules()), where  # training mode back
        state = pipe.state_dict()
        pipe.close()
        assert list(state) == list(final), where
        for key, value in state.items():
            torch.testing.assert_close(
                value.cpu(), final[key].cpu(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {key}: {m}"
            )

    # eval mode during eval_step (as model.eval(): mode-dependent modules see it), training mode after
    pipe = _pipeline("gpt", cases[0][1], "1f1b", 1)
    seen, forward = [], pipe.stage.forward_segment
    pipe.stage.forward_segment = lambda *a, **k: (seen.append(pipe.model.training), forward(*a, **k))[1]
    pipe.eval_step(*batches[0])
    assert seen and not any(seen) and pipe.model.training, seen
    seen.clear()
    pipe.train_step(*batches[0])
    assert seen and all(seen), seen
    pipe.close()
    dist.barrier()
    return True


def test_eval_step_matches_single_process_eval_4_ranks():
    pytest.importorskip("transformers")
    cases = [
        ("gpt", (2, 2, 1), "aiao", 2, dict(dp_overlap_ratio=0.5)),
        ("gpt", (2, 2, 1), "1f1b", 1, dict(zero=True)),
        ("llama", (1, 2, 2), "1f1b", 1, {}),
    ]
    assert run_ranks(_evaluated, 4, cases, timeout=240) == [True] * 4
