"""A parallelized model in a user's own loop: loss.backward(), oases.nn.clip_grad_norm_, AdamW,
torch.autocast(bfloat16); the same parameters as the unsharded model after the same steps."""

import copy
import importlib.util
import warnings

import pytest
import torch

import oases
from oases.models import GPT, GPTConfig

from _spawn import harness_device, rank_device, run_ranks

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=128,
            vocab_size=96,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    )


def _train(model, steps, step_fn, clip):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for i in range(steps):
        ids = torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(i)).to(rank_device())
        optimizer.zero_grad(set_to_none=True)
        step_fn(model, ids)
        norms.append(float(clip(model)))
        optimizer.step()
    return norms


def _hf_loss_backward(model, ids):
    model(input_ids=ids, labels=ids).loss.backward()


def _check_llama_loop(rank, world_size):
    ref = _llama().to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = {**oases.nn.DEFAULT_PLAN, "embed_tokens": "vocab", "lm_head": "vocab_head"}
        oases.parallelize(tp, plan=plan)
    ref_norms = _train(ref, 3, _hf_loss_backward, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    for name, step_fn in (
        ("loss.backward", _hf_loss_backward),
        ("train_step", lambda m, ids: oases.train_step(m, ids, ids, schedule="oases")),
    ):
        model = copy.deepcopy(tp)
        norms = _train(model, 3, step_fn, lambda m: oases.nn.clip_grad_norm_(m, 0.5))
        assert norms == pytest.approx(ref_norms, rel=1e-4), (name, norms, ref_norms)
        assert norms[0] > 0.5, "the clip must bite for the test to mean anything"
        state, want = oases.full_state_dict(model), ref.state_dict()
        for key in want:
            torch.testing.assert_close(
                state[key],
                want[key],
                rtol=1e-4,
                atol=1e-4,  # 1% of an AdamW step
                msg=lambda m: f"{name} {key}: {m}",
            )
    return True


@needs_transformers
def test_llama_user_loop_with_clipping_matches_unsharded():
    run_ranks(_check_llama_loop, 2, timeout=120)


def _check_autocast(rank, world_size, want_loss):
    config = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2)
    model = GPT(config, seed=1, vocab_parallel=True).to(rank_device())
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2)).to(rank_device())
    with torch.autocast(harness_device(), dtype=torch.bfloat16):
        loss = model(tokens, tokens)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(loss.float(), want_loss.to(rank_device()), rtol=2e-2, atol=2e-2)
    return True


def test_gpt_autocast_bf16_at_tp2():
    config = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = GPT(config, seed=1)(tokens, tokens)  # fp32, one process
    run_ranks(_check_autocast, 2, want)
