"""oases.amp.GradScaler at TP 2 (2 gloo ranks): an overflow in one rank's gradient shard makes
every rank skip the step and back off the scale (torch's GradScaler, on the same run, lets the
other rank step: the shards diverge); without overflow every rank steps, as one process would.
The forward runs under fp16 autocast (CPU)."""
import warnings

import pytest
import torch

from _spawn import run_ranks

import oases

pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False))


def _step(model, scaler, ids, poison):
    """One scaled step; `poison`: put an inf into this rank's shard of q_proj's gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", torch.float16):
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
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    results = {}
    for name, make in (("oases", lambda: oases.amp.GradScaler("cpu", init_scale=2.0**8)),
                       ("torch", lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = oases.parallelize(_llama())
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
