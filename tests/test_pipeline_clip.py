"""Pipeline(max_grad_norm=c): each update's gradient clipped by the whole model's 2-norm, against
one process running torch.nn.utils.clip_grad_norm_(model.parameters(), c) before each SGD step.

A Hugging Face Llama with tied input/output embeddings (a copy of W on the first and the last
stage, counted once), c below every step's norm (every step is clipped):

    losses of every step and the final state (pipe.state_dict())      # fp32 tolerance
    pipe.grad_norm after train_step n + 1 (and after state_dict())    # == torch's norm of step n
                                                                      #    (and of the last step)

at PP2 x DP2 (aiao over 2 segments, the DP sync partly deferred), PP2 x DP2 with zero=True (the norm
of each dp rank's rows, summed over dp), PP2 x TP2 (vocabulary-parallel and column / row shards
summed over tp, norms' weights once) and PP4 (middle stages hold no copy of W). A bad max_grad_norm
is refused on every rank before any communication.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from oases.pipeline import Pipeline

from _spawn import harness_device, rank_device, run_ranks
from _tiny_llama import tiny_llama

pytest.importorskip("transformers")

SEED, STEPS, VOCAB, T, BATCH, CLIP = 5, 3, 32, 8, 8, 0.5


def _model():
    return tiny_llama(tied=True).to(rank_device())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _batches():
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, VOCAB, (BATCH, T), generator=g), torch.randint(0, VOCAB, (BATCH, T), generator=g))
        for _ in range(STEPS)
    ]


def _golden():
    """(losses, norms, state_dict) of the single-process model: clip_grad_norm_(CLIP) before each step."""
    torch.manual_seed(SEED)
    model = _model()
    opt = _sgd(model.parameters())
    losses, norms = [], []
    for tokens, targets in _batches():
        tokens, targets = tokens.to(rank_device()), targets.to(rank_device())
        opt.zero_grad()
        loss = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        losses.append(loss.detach())
    return losses, norms, model.state_dict()


def _clipped(rank, world_size, cases):
    want_losses, want_norms, want = _golden()
    assert min(want_norms) > CLIP, want_norms  # every step is clipped
    for mesh_shape, schedule, segments, options in cases:
        where = f"{mesh_shape} {schedule} ns={segments} {options}"
        mesh = init_device_mesh(harness_device(), mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
        pipe = Pipeline(
            _model,
            mesh,
            schedule=schedule,
            segments=segments,
            micro_batches=mesh_shape[1],
            optimizer=_sgd,
            seed=SEED,
            max_grad_norm=CLIP,
            **options,
        )
        norms = []
        for step, batch in enumerate(_batches()):
            loss = pipe.train_step(*batch)
            torch.testing.assert_close(loss, want_losses[step], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
            norms.append(pipe.grad_norm)  # the previous step's: applied in this train_step
        state = pipe.state_dict()  # applies the last update
        norms = norms[1:] + [pipe.grad_norm]
        pipe.close()
        for step, (got, norm) in enumerate(zip(norms, want_norms)):
            torch.testing.assert_close(got, norm, rtol=1e-5, atol=0, msg=lambda m: f"{where}: norm {step}: {m}")
        assert list(state) == list(want), where
        for key, value in state.items():
            torch.testing.assert_close(
                value.cpu(), want[key].cpu(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {key}: {m}"
            )
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1.0"):
        mesh = init_device_mesh(harness_device(), cases[0][0], mesh_dim_names=("dp", "pp", "tp"))
        with pytest.raises(ValueError, match="max_grad_norm: expected a finite number > 0"):
            Pipeline(_model, mesh, max_grad_norm=bad)
    dist.barrier()  # no rank was left inside a collective
    return True


CASES = [
    ((2, 2, 1), "aiao", 2, dict(dp_overlap_ratio=0.5)),  # some DP buckets deferred to the next step
    ((2, 2, 1), "1f1b", 1, dict(zero=True)),
    ((1, 2, 2), "1f1b", 1, {}),
    ((1, 4, 1), "1f1b", 1, {}),
]


def test_clipping_matches_torch_clip_grad_norm_on_one_process_4_ranks():
    assert run_ranks(_clipped, 4, CASES, timeout=240) == [True] * 4
