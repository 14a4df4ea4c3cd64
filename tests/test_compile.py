"""torch.compile and oases (2 gloo ranks): parallelize and train_step accept a compiled model.

parallelize(torch.compile(model)) shards the original in place and returns the compiled wrapper,
whose forward (dynamo with the eager backend: graphs between the collectives' breaks) gives the
logits of the parallelized model run eagerly, bit for bit; oases.train_step(compiled, ...) runs
the schedule on the original's sublayers: the loss and every gradient of the uncompiled call; a
communicating op is one graph break (counted with torch._dynamo.explain). The functions that
take a model (state dicts, checkpoints, Hugging Face files, summary) see the original's keys.
"""

import warnings

import pytest
import torch

import oases

from _spawn import rank_device, run_ranks

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
    ).to(rank_device())


def _compiled(rank, world):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(rank_device())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = oases.parallelize(_llama())
        compiled = oases.parallelize(torch.compile(_llama(), backend="eager"))
    assert type(compiled).__name__ == "OptimizedModule"
    assert isinstance(compiled._orig_mod.model.layers[0].self_attn.q_proj, oases.nn.ColumnParallelLinear)
    with torch.no_grad():
        want, got = eager(input_ids=ids).logits, compiled(input_ids=ids).logits
    assert torch.equal(got, want), float((got - want).abs().max())
    loss = oases.train_step(compiled, ids, ids, schedule="oases")
    want_loss = oases.train_step(eager, ids, ids, schedule="oases")
    assert torch.equal(loss, want_loss)
    for (name, p), q in zip(compiled._orig_mod.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # each communicating op is a graph break of its own (torch.compiler.disable), not one per ring
    # step or per host sync inside it: 16 on this one-layer model with torch 2.13 (28 before; 17
    # with two layers), 17 with torch 2.11 (its dynamo breaks once more; seen on the H200 machine)
    breaks = torch._dynamo.explain(eager)(input_ids=ids).graph_break_count
    most = 16 if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13) else 17
    assert breaks <= most, (breaks, torch.__version__)


def test_parallelize_and_train_step_take_a_compiled_model():
    run_ranks(_compiled, 2, timeout=240)


def _files_of_a_compiled_model(rank, world, root):
    import json

    from safetensors import safe_open

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = oases.parallelize(torch.compile(_llama(), backend="eager"))
        plain = oases.parallelize(_llama())
    keys = list(_llama().state_dict())
    assert list(oases.full_state_dict(compiled)) == keys
    assert [p.name for p in oases.summary(compiled).parts][:2] == [
        "model.embed_tokens",
        "model.layers.0.self_attn.q_proj",
    ]
    oases.save_pretrained(compiled, f"{root}/hf")
    if rank == 0:
        with safe_open(f"{root}/hf/model.safetensors", "pt") as f:
            assert sorted(f.keys()) == sorted(keys)
        with open(f"{root}/hf/config.json") as f:
            assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    oases.load_pretrained(compiled, f"{root}/hf")  # strict: every key found
    oases.save_checkpoint(compiled, f"{root}/ckpt")
    for model in (plain, compiled):  # a compiled model's checkpoint is a plain model's, both ways
        state = oases.load_checkpoint(model, f"{root}/ckpt")
        assert not state.missing_keys and not state.unexpected_keys
    oases.load_full_state_dict(compiled, _llama().state_dict())
    for p, q in zip(compiled._orig_mod.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_state_dicts_checkpoints_and_files_see_through_torch_compile(tmp_path):
    run_ranks(_files_of_a_compiled_model, 2, str(tmp_path), timeout=240)
