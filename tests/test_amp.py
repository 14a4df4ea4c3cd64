"""oases.amp.GradScaler at TP 2 (2 gloo ranks): an overflow in one rank's gradient shard makes
every rank skip the step and back off the scale (torch's GradScaler, on the same run, lets the
other rank step: the shards diverge); without overflow every rank steps, as one process would.
The forward runs under fp16 autocast (on the harness's device). In the pipeline (loss_scaler=),
an overflow on the last stage makes both stages skip the step."""

import warnings

import pytest
import torch

import oases

from _spawn import harness_device, rank_device, run_ranks

pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    )


def _step(model, scaler, ids, poison):
    """One scaled step; `poison`: put an inf into this rank's shard of q_proj's gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast(harness_device(), torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    if poison:
        model.model.layers[0].self_attn.q_proj.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    model.zero_grad(set_to_none=True)
    return any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # stepped?


def _scalers(rank, world):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(rank_device())
    results = {}
    for name, make in (
        ("oases", lambda: oases.amp.GradScaler(harness_device(), init_scale=2.0**8)),
        ("torch", lambda: torch.amp.GradScaler(harness_device(), init_scale=2.0**8)),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = oases.parallelize(_llama().to(rank_device()))
        scaler = make()
        overflow = _step(model, scaler, ids, poison=rank == 1)
        results[name] = (overflow, scaler.get_scale(), _step(model, scaler, ids, poison=False), scaler.get_scale())
    return results


def test_grad_scaler_skips_the_same_steps_on_every_rank():
    r0, r1 = run_ranks(_scalers, 2, timeout=120)
    # oases: rank 1's overflow is every rank's; both skip, both back off, then both step
    assert r0["oases"] == r1["oases"] == (False, 2.0**7, True, 2.0**7), (r0["oases"], r1["oases"])
    # torch's own: rank 0 steps on its shard while rank 1 skips (what oases.amp prevents)
    assert r0["torch"][0] is True and r1["torch"][0] is False and r0["torch"][1] != r1["torch"][1]


def _pipeline_scaled(rank, world):
    """Pipeline(loss_scaler=oases.amp.GradScaler): PP2 of a tiny GPT. Without overflow it trains
    as the unscaled pipeline (power-of-two scales: bit for bit), with max_grad_norm too (the
    gradients unscaled before the norm is taken); an inf in one gradient of the last
    stage makes both stages skip that step and halve the scale."""
    from torch.distributed.device_mesh import init_device_mesh

    from oases.models import GPTConfig
    from oases.pipeline import Pipeline

    config = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2, layers=4)
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(3)]
    batches = [(tokens.to(rank_device()), targets.to(rank_device())) for tokens, targets in batches]

    def make(scaler=None, clip=None):
        return Pipeline(
            config, mesh, schedule="aiao", segments=2, micro_batches=2, seed=5, loss_scaler=scaler, max_grad_norm=clip
        )

    for clip in (None, 0.05):  # clipped: by the unscaled gradient's norm
        plain, scaled = make(clip=clip), make(oases.amp.GradScaler(harness_device(), init_scale=2.0**12), clip)
        for tokens, targets in batches:
            assert torch.equal(plain.train_step(tokens, targets), scaled.train_step(tokens, targets))
        want, got = plain.state_dict(), scaled.state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want)
        assert clip is None or plain.grad_norm > clip and torch.equal(plain.grad_norm, scaled.grad_norm), clip
        plain.close(), scaled.close()

    scaler = oases.amp.GradScaler(harness_device(), init_scale=2.0**12)
    pipe = make(scaler)
    pipe.train_step(*batches[0])
    before = pipe.state_dict()  # step 1 applied
    overflow = [True]
    if rank == 1:  # the last stage: one gradient of the head's stage overflows, on this rank only
        param = next(p for p in pipe.stage.parameters() if p.requires_grad and p.dim() == 2)
        param.register_hook(lambda grad: torch.full_like(grad, float("inf")) if overflow[0] else grad)
    pipe.train_step(*batches[1])
    after = pipe.state_dict()  # step 2 skipped on both stages
    assert all(torch.equal(before[k], after[k]) for k in before), "a stage stepped on an overflow"
    assert scaler.get_scale() == 2.0**11, scaler.get_scale()
    overflow[0] = False
    pipe.train_step(*batches[2])
    assert any(not torch.equal(before[k], v) for k, v in pipe.state_dict().items())  # steps again
    pipe.close()
    with pytest.raises(TypeError, match="loss_scaler: expected an oases.amp.GradScaler"):
        make(torch.amp.GradScaler(harness_device()))
    with pytest.raises(ValueError, match="loss_scaler: not with zero=True"):
        Pipeline(config, mesh, micro_batches=2, zero=True, loss_scaler=oases.amp.GradScaler(harness_device()))
    return True


def test_pipeline_loss_scaler_skips_on_every_stage():
    run_ranks(_pipeline_scaled, 2, timeout=180)
