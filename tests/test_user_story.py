"""The large-model user story at TP 2, end to end on gloo ranks, against one process:

    with torch.device("meta"): model = LlamaForCausalLM(config)      # no memory
    oases.parallelize(model, device="cpu", init_weights=False)         # this rank's shards only
    oases.load_pretrained(model, pretrained_dir)                      # this rank's slices only
    train with oases.train_step + AdamW, oases.save_checkpoint(..., optimizer=, step=, extra=) each step
    <every rank killed with SIGKILL while publishing a checkpoint>
    relaunch: the same build, oases.load_checkpoint(model, root, optimizer=) -> step, extra; train on
    oases.save_pretrained(model, out_dir)                             # transformers loads it

Checked: logits after loading equal the single-process model's; the resumed run's parameters and
optimizer state are bit-identical to an uninterrupted run's; the half-written checkpoint is
skipped (the previous one loads); the export loads with from_pretrained and equals the model.
"""

import os
import signal
import warnings

import numpy as np
import pytest
import torch

import oases

from _spawn import rank_device, run_ranks

pytest.importorskip("transformers")

STEPS = 4
KILLED_AT = 3  # the checkpoint of step 3 is being published when every rank dies


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _batch(step):
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(100 + step)).to(rank_device())


def _build(pretrained):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lm_head left replicated by the default plan
        oases.parallelize(model, device=rank_device(), init_weights=False)
    oases.load_pretrained(model, pretrained)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps, root):
    for step in steps:
        oases.train_step(model, _batch(step), _batch(step), schedule="oases")
        opt.step()
        opt.zero_grad()
        oases.save_checkpoint(model, root, optimizer=opt, step=step + 1, extra={"data": step + 1}, keep=2)


def _numpy(tensors):  # tensors cross the result queue by value (a shared fd dies with its rank)
    return {k: v.detach().cpu().numpy().copy() for k, v in tensors.items()}


def _snapshot(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {
        names[id(p)] + "." + k: v for p, s in opt.state.items() for k, v in s.items() if isinstance(v, torch.Tensor)
    }
    return _numpy(model.state_dict()), _numpy(moments)


def _uninterrupted(rank, world_size, pretrained, root):
    from transformers import LlamaForCausalLM

    model, opt = _build(pretrained)
    reference = LlamaForCausalLM.from_pretrained(pretrained).to(rank_device())
    ids = _batch(0)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    _train(model, opt, range(STEPS), root)
    full = _numpy(oases.full_state_dict(model))  # a collective: every rank
    return _snapshot(model, opt), full if rank == 0 else None


def _killed(rank, world_size, pretrained, root):
    model, opt = _build(pretrained)
    real_rename = os.rename

    def die_while_publishing(src, dst):  # kill -9 in the middle of publishing step KILLED_AT's checkpoint
        if os.path.basename(os.fspath(dst)) == f"step-{KILLED_AT:09d}":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst)

    os.rename = die_while_publishing
    _train(model, opt, range(STEPS), root)


def _resumed(rank, world_size, pretrained, root, out):
    model, opt = _build(pretrained)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the half-written checkpoint is skipped with a warning
        state = oases.load_checkpoint(model, root, optimizer=opt)
    assert state.step == KILLED_AT - 1 and state.extra == {"data": KILLED_AT - 1}, state
    _train(model, opt, range(state.step, STEPS), root)
    oases.save_pretrained(model, out)
    return _snapshot(model, opt)


def test_build_load_train_kill_resume_export_tp2(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(tmp_path / "pretrained")
    pretrained = str(tmp_path / "pretrained")
    uninterrupted = run_ranks(_uninterrupted, 2, pretrained, str(tmp_path / "a"), timeout=180)
    assert sorted(os.listdir(tmp_path / "a")) == [f"step-{s:09d}" for s in (STEPS - 1, STEPS)]  # keep=2
    with pytest.raises(AssertionError, match="died"):
        run_ranks(_killed, 2, pretrained, str(tmp_path / "b"), timeout=180)
    published = [n for n in os.listdir(tmp_path / "b") if n.startswith("step-")]
    assert f"step-{KILLED_AT - 1:09d}" in published and f"step-{KILLED_AT:09d}" not in published, published
    resumed = run_ranks(_resumed, 2, pretrained, str(tmp_path / "b"), str(tmp_path / "out"), timeout=180)
    # every rank's parameters and AdamW moments equal the uninterrupted run's, bit for bit
    for (state, moments), ((want_state, want_moments), _) in zip(resumed, uninterrupted):
        assert state.keys() == want_state.keys() and moments.keys() == want_moments.keys()
        for key in want_state:
            assert np.array_equal(state[key], want_state[key]), key
        for key in want_moments:
            assert np.array_equal(moments[key], want_moments[key]), key
    full = uninterrupted[0][1]
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert exported.keys() == full.keys()
    for key, value in full.items():
        assert np.array_equal(exported[key].numpy(), value), key
