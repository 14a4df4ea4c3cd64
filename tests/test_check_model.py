"""`oases check-model` (issue 36, item 6): a tiny model of a config's architecture, checked on local
ranks against the unsharded model; one verdict per check and TP degree, exit 1 on any failure.

tiny_config keeps what the sharding depends on (query / key-value head ratio, multi-query, layer
kinds, experts) and shrinks the rest; the command on a config.json passes at TP 4 and writes
its JSON; a model with an injected partial gradient fails loudly (the invariant and the gradients,
on every schedule); a config no causal LM can be built from exits 2.
"""

import json
import os

import pytest

from oases.check_model import Verdict, check_model, render, tiny_config
from oases.cli import main

from test_gradient_invariant import _ShardScaledMLP  # an MLP scaling its shards by its own scalar


def test_tiny_config_keeps_the_architecture():
    import transformers as tf

    llama = tiny_config("llama")
    assert type(llama) is tf.LlamaConfig and llama.num_hidden_layers == 2
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.hidden_size) == (4, 4, 64)
    assert llama.intermediate_size == round(11008 / 4096 * 64 / 32) * 32  # the ratio to the hidden width kept
    gqa = tiny_config(tf.Qwen2Config(num_attention_heads=28, num_key_value_heads=4, hidden_size=3584))
    assert (gqa.num_attention_heads, gqa.num_key_value_heads) == (16, 4)  # 7 query heads per kv head -> 4
    mqa = tiny_config("gpt_bigcode")
    assert mqa.multi_query is True and mqa.n_head == 12  # multi-query stays multi-query (its 12 heads kept)
    gemma3 = tiny_config("gemma3_text")
    assert sorted(set(gemma3.layer_types)) == ["full_attention", "sliding_attention"]
    assert gemma3.num_hidden_layers == len(gemma3.layer_types) == 2
    mixtral = tiny_config("mixtral")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    phi = tiny_config(tf.PhiConfig(resid_pdrop=0.1, attention_dropout=0.1))
    assert phi.resid_pdrop == 0.0 and phi.attention_dropout == 0.0
    with pytest.raises(ValueError):
        tiny_config("no_such_model_type")


def _shard_scaled_llama(config):
    """(module-level: pickled to the ranks by name)"""
    import transformers as tf

    model = tf.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp = _ShardScaledMLP(config.hidden_size, config.intermediate_size)
    return model


def test_an_injected_partial_gradient_fails_loudly():
    verdicts = check_model("llama", tp=(2,), build=_shard_scaled_llama, timeout=300)
    by_check = {v.check: v for v in verdicts}
    assert by_check["parallelize"].ok and by_check["logits"].ok  # the forward is right
    assert by_check["invariant"].ok is False and "model.layers.0.mlp.scale" in by_check["invariant"].detail
    assert by_check["grads model(...)"].ok is False and "mlp.scale" in by_check["grads model(...)"].detail
    assert all(v.ok is False for v in verdicts if v.check.startswith("train_step"))  # raised by the invariant
    assert "FAIL" in render(verdicts, "t")


def test_check_model_command_on_a_config_file(tmp_path, capsys):
    import transformers as tf

    config = tf.Qwen3Config(num_attention_heads=8, num_key_value_heads=1, hidden_size=256, head_dim=32)
    config.save_pretrained(tmp_path)
    out = tmp_path / "verdicts.json"
    # TP 2 with the key-value head replicated (1 of them, the tiny model's too): the replication TP 4
    # gives 2 kv heads, on 2 ranks instead of 4 (the suite's time); TP 4 itself: test_models_matrix
    assert main(["check-model", str(tmp_path / "config.json"), "--tp", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in printed and "FAIL" not in printed, printed
    doc = json.loads(out.read_text())
    verdicts = [Verdict(**v) for v in doc["verdicts"]]
    assert {v.tp for v in verdicts} == {2} and all(v.ok for v in verdicts), verdicts
    checks = {v.check for v in verdicts}
    assert {"coverage", "invariant", "export", "train_step oases sp", "train_step megatron"} <= checks
    assert main(["check-model", str(tmp_path / "nowhere"), "--tp", "2"]) == 2
    assert "no tiny causal LM" in capsys.readouterr().out
    assert os.path.exists(tmp_path / "config.json")
