"""parallelize(model built on meta, device=...): only this rank's shards allocated, and the full
model they make is the one `Cls(config)` gives under the same seed in one process, at every layout.

Each run builds the reference in the rank's own process (same seed), so nothing but the values
crosses ranks: `oases.full_state_dict` of the sharded model must equal the reference's state dict
exactly, its logits must match, and the CPU random state after parallelize must be the one the
plain build leaves (so a run that draws afterwards, dropout or data, is the same too).
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import oases

from _spawn import rank_device, run_ranks

pytest.importorskip("transformers")


def _config(kind, tied=False):
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    if kind.startswith("llama"):  # "llama": GQA (2 KV heads), "llama-mha": 4 KV heads (TP 4)
        kv = 4 if kind == "llama-mha" else 2
        if kind == "llama-odd":  # a vocabulary TP 2 does not divide: padded shards
            common = dict(common, vocab_size=129)
        return tf.LlamaForCausalLM, tf.LlamaConfig(num_key_value_heads=kv, tie_word_embeddings=tied, **common)
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied, **common
        )
    return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**common)


def _meta_parallelized(cls, config, **kw):
    """cls(config) built on meta, then parallelize(device=rank_device(), **kw) (the head's warning silenced)."""
    with torch.device("meta"):
        model = cls(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(model, device=rank_device(), **kw)
    return model


def _meta_build_matches(rank, world_size, kind, tied, degrees):
    cls, config = _config(kind, tied)
    torch.manual_seed(7)
    reference = cls(config).to(rank_device())
    after_reference = torch.get_rng_state()
    torch.manual_seed(7)
    model = _meta_parallelized(cls, config, tp_degrees=degrees)
    assert torch.equal(torch.get_rng_state(), after_reference), "the random state differs from the plain build's"
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    sharded = {n for n, m in model.named_modules() if hasattr(m, "tp_layout")}
    assert sharded, "nothing was sharded"
    local = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in reference.parameters())
    if degrees is None:
        assert local < full, (local, full)  # only shards are held
    state = oases.full_state_dict(model)
    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    for name, buffer in reference.named_buffers():  # non-persistent ones (rotary inv_freq) too
        assert torch.equal(model.get_buffer(name), buffer), name
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1)).to(rank_device())
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    return local


@pytest.mark.parametrize(
    "kind,tied", [("llama", False), ("llama", True), ("llama-odd", True), ("qwen3", False), ("neox", False)]
)
def test_meta_build_is_the_plain_build_tp2(kind, tied):
    run_ranks(_meta_build_matches, 2, kind, tied, None, timeout=120)


def test_meta_build_at_tp4_and_per_layer_degrees():
    run_ranks(_meta_build_matches, 4, "llama-mha", False, None, timeout=120)
    run_ranks(_meta_build_matches, 2, "llama", False, [1, 2], timeout=120)


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.randn(8))  # drawn in the constructor, no reset_parameters


class _OwnInit(nn.Module):
    """nanoGPT's way: the model initialises its modules itself, after their constructors."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


def _refusals(rank, world_size):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = _Custom()
    with pytest.raises(ValueError, match="scale"):  # cannot be replayed: named, nothing allocated
        oases.parallelize(model, plan={"up": "column", "down": "row"}, device=rank_device())
    with torch.device("meta"):
        model = _Custom()
    oases.parallelize(model, plan={"up": "column", "down": "row"}, device=rank_device(), init_weights=False)
    assert model.up.weight.shape == (16 // world_size, 8) and not model.scale.is_meta
    with torch.device("meta"):
        model = _Custom()
    for load in (oases.load_pretrained, oases.load_checkpoint):  # a meta model takes nothing in, silently
        with pytest.raises(ValueError, match=r"model: every tensor is on the meta device .* init_weights=False\)"):
            load(model, "nowhere")
    with pytest.raises(ValueError, match=r"model: every tensor is on the meta device"):
        oases.load_full_state_dict(model, _Custom().state_dict())
    with pytest.raises(ValueError, match=r"model: every tensor is on the meta device"):
        oases.full_state_dict(model)
    with torch.device("meta"):
        model = _OwnInit()
    with pytest.raises(ValueError, match=r"initialisation of its own .* \(_OwnInit._init_weights \(the model\)\)"):
        oases.parallelize(model, plan={"up": "column", "down": "row"}, device=rank_device())  # reset_parameters' values
    assert model.up.weight.is_meta
    oases.parallelize(model, plan={"up": "column", "down": "row"}, device=rank_device(), init_weights=False)
    assert model.up.weight.shape == (16 // world_size, 8)
    with torch.device("meta"):
        model = _Custom()
    with pytest.raises(ValueError, match="device='cpu'"):
        oases.parallelize(model, plan={"up": "column", "down": "row"})
    with pytest.raises(ValueError, match="meta device"):
        oases.parallelize(_Custom(), plan={"up": "column", "down": "row"}, device=rank_device())
    with pytest.raises(TypeError, match="init_weights"):
        oases.parallelize(_Custom(), plan={"up": "column", "down": "row"}, init_weights=1)
    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    with torch.device("meta"):  # GPT-2's init writes c_proj from its parent: refused, not silently wrong
        model = GPT2LMHeadModel(config)
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(model, device=rank_device())
    except ValueError as refused:
        assert "outside that module" in str(refused), refused
    else:  # transformers 5.0's GPT-2 init stays inside each module: then the build is the plain one's
        import transformers

        assert transformers.__version__.startswith("5.0."), "GPT-2 on meta was not refused"
        torch.manual_seed(0)
        plain = GPT2LMHeadModel(config).to(rank_device())
        built = oases.full_state_dict(model)
        for key, value in plain.state_dict().items():
            assert torch.equal(built[key], value), key
    dist.barrier()  # every rank raised alike: nobody is left waiting


def test_meta_build_refusals():
    run_ranks(_refusals, 2, timeout=60)


def _empty_then_load(rank, world_size, path):
    from transformers import LlamaForCausalLM

    cls, config = _config("llama-odd")
    reference = LlamaForCausalLM.from_pretrained(path).to(rank_device())
    state = torch.get_rng_state()
    model = _meta_parallelized(cls, config, init_weights=False)
    assert torch.equal(torch.get_rng_state(), state), "init_weights=False drew random numbers"
    for name, buffer in reference.named_buffers():  # non-persistent: computed, not loaded
        assert torch.equal(model.get_buffer(name), buffer), name
    oases.load_pretrained(model, path)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1)).to(rank_device())
    out, want = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()), "a padding row poisoned the gradients"


def _padding_rows_start_at_zero(rank, world_size):
    model = _meta_parallelized(*_config("llama-odd"), init_weights=False)
    held = model.get_input_embeddings().vocab_end_index - model.get_input_embeddings().vocab_start_index
    return [bool((m.weight[held:] == 0).all()) for m in (model.get_input_embeddings(), model.get_output_embeddings())]


def test_meta_build_without_init_then_load_pretrained(tmp_path):
    cls, config = _config("llama-odd")
    torch.manual_seed(3)
    cls(config).save_pretrained(tmp_path)
    run_ranks(_empty_then_load, 2, str(tmp_path), timeout=120)
    assert run_ranks(_padding_rows_start_at_zero, 2, timeout=60) == [[True, True], [True, True]]


def _allocate_some(rank, world_size):
    cls, config = _config("llama")
    torch.manual_seed(7)
    reference = cls(config).to(rank_device())
    torch.manual_seed(7)
    held = lambda name: name.startswith("model.layers.1.") or name.startswith("lm_head")  # noqa: E731
    model = _meta_parallelized(cls, config, allocate=held)
    for name, p in model.named_parameters():
        assert p.is_meta != held(name), name
        if held(name):
            rule = oases._sharding.tp_rules(model).get(name)
            full = reference.get_parameter(name).detach()
            assert torch.equal(p, full if rule is None else rule[0].shard(full, rank, world_size)), name


def test_meta_build_allocates_only_what_it_is_asked():
    run_ranks(_allocate_some, 2, timeout=60)
