"""oases.load_pretrained / save_pretrained on gloo ranks: Hugging Face directories in and out at any TP degree.

Fixtures, written by transformers' own save_pretrained: a tiny GQA Llama (8 heads, 4 KV heads, so
TP 2 and 4) untied in one file, the same in several files with an index, tied
(tie_word_embeddings=True, no lm_head.weight in the file) and in bf16. The single-process
`LlamaForCausalLM.from_pretrained` of each gives the logits a TP model loaded from it must give.
"""

import importlib.util
import json
import os
import shutil
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import oases
from oases._sharding import ShardRule, tp_rules

from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

TOL = dict(rtol=1e-5, atol=1e-5)  # TP sums in another order than the plain model's
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
TIED = {"lm_head.weight": "model.embed_tokens.weight"}  # the key transformers leaves out of tied files
SMALL = 40_000  # bytes per file: ~9 files for the tiny Llama


def _llama(seed, tied=False, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**config, **kw}, tie_word_embeddings=tied))


def _parallelize(model, group=None, **kw):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"oases.parallelize: left \d+ nn.Linear", UserWarning)
        return oases.parallelize(model, group, **kw)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS.to(next(model.parameters()).device)).logits


def _train_step(model):
    ids = IDS.to(next(model.parameters()).device)
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.1 * param.grad
            param.grad = None


def _file_tensors(path):
    """{key: tensor} of every weight file in the directory `path`."""
    from safetensors.torch import load_file

    found = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            found.update(load_file(os.path.join(path, name)))
    return found


def _assert_shards(model, full):
    """Every parameter and buffer of `model` is exactly its shard of the file's tensor (cast)."""
    rules = tp_rules(model)
    for key, value in model.state_dict().items():
        want = full[key] if key in full else full[TIED[key]]
        if key in rules:
            rule, group = rules[key]
            want = rule.shard(want, dist.get_rank(group), dist.get_world_size(group))
        assert torch.equal(value, want.to(value.device, value.dtype)), f"{key} is not its shard of the file's tensor"


def _assert_equal_dicts(got, want):
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{name: (directory, tied, the logits of transformers' from_pretrained of it)}."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    _llama(0).save_pretrained(root / "untied")
    _llama(0).save_pretrained(root / "parts", max_shard_size=SMALL)
    _llama(0, tied=True).save_pretrained(root / "tied")
    _llama(0).to(torch.bfloat16).save_pretrained(root / "bf16")
    assert os.path.isfile(root / "parts" / "model.safetensors.index.json")
    dirs = {}
    for name in ("untied", "parts", "tied", "bf16"):
        plain = LlamaForCausalLM.from_pretrained(root / name, dtype=torch.float32)
        dirs[name] = (str(root / name), name == "tied", _logits(plain))
    return dirs


# --- load: transformers' directories at TP 2 and 4 --------------------------------------------------


def _check_load(rank, p, dirs, out):
    for name, (path, tied, want) in dirs.items():
        model = _parallelize(_llama(7, tied).to(rank_device()))  # another seed: every value must come from the file
        result = oases.load_pretrained(model, path)
        assert (result.missing_keys, result.unexpected_keys) == ([], []), name
        _assert_shards(model, _file_tensors(path))
        torch.testing.assert_close(_logits(model).cpu(), want, **TOL, msg=lambda m: f"{name} at TP {p}: {m}")

    path, _, want = dirs["untied"]
    model = _parallelize(_llama(8).to(rank_device()))
    oases.load_pretrained(model, os.path.join(path, "model.safetensors"))  # one file, by its name
    torch.testing.assert_close(_logits(model).cpu(), want, **TOL)

    # The checks can fail: each rank reading its neighbour's boxes is caught.
    chunks = ShardRule.chunks
    wrong = lambda self, shape, r, size: chunks(self, shape, (r + 1) % size, size)  # noqa: E731
    model = _parallelize(_llama(8).to(rank_device()))
    with mock.patch.object(ShardRule, "chunks", wrong):
        oases.load_pretrained(model, path)
    with pytest.raises(AssertionError, match="is not its shard of the file's tensor"):
        _assert_shards(model, _file_tensors(path))


def _check_replicas(rank, p, out):
    """Replicas save over the world, only rank 0's sending: two TP-2 pairs ({0, 1}, {2, 3}), and
    per-layer degrees (layer 0 at TP 2); an oases GPT (dataclass config, stacked q|k|v,
    vocabulary shards) saved at TP 4 loads at TP 2."""
    from oases.models import GPT
    from oases.models.gpt import GPTConfig

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    for name, model in (
        ("pairs", _parallelize(_llama(3).to(rank_device()), pair)),
        ("degrees", _parallelize(_llama(3).to(rank_device()), tp_degrees=[2, 4])),
    ):
        _train_step(model)
        full = oases.full_state_dict(model)
        where = os.path.join(out, name)
        oases.save_pretrained(model, where, max_shard_size=SMALL)
        tp4 = _parallelize(_llama(4).to(rank_device()))
        oases.load_pretrained(tp4, where)
        _assert_equal_dicts(oases.full_state_dict(tp4), full)

    config = GPTConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
    gpt = GPT(config, None, seed=0, vocab_parallel=True).to(rank_device())
    where = os.path.join(out, "gpt")
    oases.save_pretrained(gpt, where)
    with open(os.path.join(where, "config.json")) as f:
        assert json.load(f) == dict(vars(config), model_type="oases-gpt")
    back = GPT(config, pair, seed=1, vocab_parallel=True).to(rank_device())
    oases.load_pretrained(back, where)
    _assert_equal_dicts(oases.full_state_dict(back), oases.full_state_dict(gpt))


# --- save at TP 2: transformers loads it --------------------------------------------------------------


def _check_save(rank, p, out):
    saved = {}
    for tied in (False, True):
        tag = "tied" if tied else "untied"
        model = _parallelize(_llama(3, tied).to(rank_device()))
        _train_step(model)  # the values differ from any seed's
        full = oases.full_state_dict(model)
        one, parts = os.path.join(out, tag), os.path.join(out, f"{tag}-parts")
        oases.save_pretrained(model, parts, max_shard_size=SMALL)
        oases.save_pretrained(model, one)
        back = _parallelize(_llama(9, tied).to(rank_device()))
        result = oases.load_pretrained(back, parts)
        assert (result.missing_keys, result.unexpected_keys) == ([], [])
        _assert_equal_dicts(oases.full_state_dict(back), full)
        saved[tag] = (full, _logits(model))

    # Saving again over a multi-file checkpoint, as one file: the old parts and index go.
    oases.save_pretrained(model, parts)
    assert sorted(os.listdir(parts)) == ["config.json", "generation_config.json", "model.safetensors"]

    model.to(torch.bfloat16)
    oases.save_pretrained(model, os.path.join(out, "bf16"))
    saved["bf16"] = (oases.full_state_dict(model), None)
    if rank == 0:
        torch.save(saved, os.path.join(out, "saved.pt"))  # tensors do not travel back through the result queue


def _assert_transformers_loads(tmp_path):
    """What _check_save wrote: transformers' from_pretrained gives the TP models' weights and logits."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    saved = torch.load(tmp_path / "saved.pt", map_location="cpu")
    for tag, (full, want) in saved.items():
        dirs = [tmp_path / tag] + ([tmp_path / f"{tag}-parts"] if tag == "untied" else [])
        for path in dirs:
            plain = LlamaForCausalLM.from_pretrained(path, dtype="auto")
            _assert_equal_dicts(plain.state_dict(), full)
            if want is not None:
                torch.testing.assert_close(_logits(plain), want, **TOL)
    with open(tmp_path / "untied-parts" / "model.safetensors.index.json") as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert len(files) > 2 and list(index["weight_map"]) == list(saved["untied"][0])
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in saved["untied"][0].values())
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys() and handle.metadata() == {"format": "pt"}
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"


# --- bad input: the same error on every rank, the model untouched -----------------------------------


def _check_errors(rank, p, dirs, tmp):
    path = dirs["untied"][0]
    model = _parallelize(_llama(5).to(rank_device()))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' does not exist"):
        oases.load_pretrained(model, os.path.join(tmp, "nowhere"))
    empty = os.path.join(tmp, f"empty{rank}")
    os.makedirs(empty)
    with pytest.raises(FileNotFoundError, match=r"holds neither model\.safetensors nor model\.safetensors\.index"):
        oases.load_pretrained(model, empty)
    broken = os.path.join(tmp, f"broken{rank}")
    shutil.copytree(dirs["parts"][0], broken)
    with open(os.path.join(broken, "model.safetensors.index.json")) as f:
        second = sorted(set(json.load(f)["weight_map"].values()))[1]
    os.remove(os.path.join(broken, second))
    with pytest.raises(FileNotFoundError, match=rf"index\.json names files that do not exist: .*{second}$"):
        oases.load_pretrained(model, broken)

    deeper = _parallelize(_llama(5, num_hidden_layers=3).to(rank_device()))
    with pytest.raises(
        ValueError,
        match=r"nothing was loaded:\n  missing keys: model\.layers\.2\.self_attn\.q_proj"
        r"\.weight, .*, model\.layers\.2\.post_attention_layernorm\.weight$",
    ):
        oases.load_pretrained(deeper, path)
    shallower = _parallelize(_llama(5, num_hidden_layers=1).to(rank_device()))
    with pytest.raises(
        ValueError,
        match=r"nothing was loaded:\n  unexpected keys: model\.layers\.1\.input_layernorm"
        r"\.weight, .*, model\.layers\.1\.self_attn\.v_proj\.weight$",
    ):
        oases.load_pretrained(shallower, path)
    wider = _parallelize(_llama(5, hidden_size=128).to(rank_device()))
    with pytest.raises(
        ValueError,
        match=rf"model\.layers\.0\.self_attn\.q_proj\.weight: safetensors has shape "
        rf"\(64, 64\), the model expects \(128, 128\) \(unsharded; this rank "
        rf"holds \({128 // p}, 128\) of it at TP={p}\)",
    ):
        oases.load_pretrained(wider, path, strict=False)  # shapes are checked regardless
    with pytest.raises(FileExistsError, match="is a file"):
        oases.save_pretrained(model, os.path.join(path, "config.json"))
    below_a_file = os.path.join(path, "config.json", "out")  # only the writer finds out, and tells the others
    raised = NotADirectoryError if rank == 0 else RuntimeError
    with pytest.raises(raised, match=r"config\.json/out" if rank == 0 else r"rank 0 could not prepare .*NotADirectory"):
        oases.save_pretrained(model, below_a_file)
    _assert_equal_dicts(model.state_dict(), before)

    # strict=False: the lists come back, the rest loads, missing tensors stay as they were.
    kept = deeper.model.layers[2].mlp.down_proj.weight.clone()
    missing, unexpected = oases.load_pretrained(deeper, path, strict=False)
    assert unexpected == [] and missing == [k for k in deeper.state_dict() if k.startswith("model.layers.2.")]
    assert torch.equal(deeper.model.layers[2].mlp.down_proj.weight, kept)
    full = _file_tensors(path)
    missing, unexpected = oases.load_pretrained(shallower, path, strict=False)
    assert missing == [] and sorted(unexpected) == sorted(k for k in full if k.startswith("model.layers.1.")) != []
    _assert_shards(shallower.model.layers[0], {k.removeprefix("model.layers.0."): v for k, v in full.items()})


# --- the runs: importing transformers costs each rank ~6 s, so few runs with many checks -------------


def _tp2(rank, p, dirs, out):
    _check_load(rank, p, dirs, out)
    _check_save(rank, p, os.path.join(out, "saved"))
    _check_errors(rank, p, dirs, os.path.join(out, "errors"))
    dist.barrier()
    return True


def test_load_save_and_bad_input_at_tp2(hf_dirs, tmp_path):
    assert run_ranks(_tp2, 2, hf_dirs, str(tmp_path), timeout=120) == [True, True]
    _assert_transformers_loads(tmp_path / "saved")


def _tp4(rank, p, dirs, out):
    _check_load(rank, p, dirs, out)
    _check_replicas(rank, p, out)
    dist.barrier()
    return True


def test_load_at_tp4_and_save_from_replicas(hf_dirs, tmp_path):
    assert run_ranks(_tp4, 4, hf_dirs, str(tmp_path), timeout=120) == [True] * 4


# --- one process, no process group: a plain model ---------------------------------------------------


def test_plain_model_without_a_process_group(hf_dirs, tmp_path):
    from transformers import LlamaForCausalLM

    path, _, want = hf_dirs["parts"]
    model = _llama(11)
    assert oases.load_pretrained(model, path) == ([], [])
    _assert_equal_dicts(model.state_dict(), LlamaForCausalLM.from_pretrained(path).state_dict())
    torch.testing.assert_close(_logits(model), want, **TOL)  # transformers picks sdpa attention
    oases.save_pretrained(model, tmp_path / "out")
    got, written_by_transformers = _file_tensors(tmp_path / "out"), _file_tensors(path)
    _assert_equal_dicts(dict(sorted(got.items())), dict(sorted(written_by_transformers.items())))


def test_a_save_that_dies_while_streaming_leaves_the_previous_one(tmp_path, monkeypatch):
    from oases.storage import hf_write as pretrained  # its _write

    out = tmp_path / "out"
    old = _llama(11)
    oases.save_pretrained(old, out, max_shard_size=SMALL)  # several files and an index
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    written = []

    def dies_after_two(handle, tensor):  # a full disk, a killed writer: the stream stops midway
        if len(written) == 2:
            raise OSError(28, "No space left on device")
        written.append(tensor.shape)
        real_write(handle, tensor)

    real_write = pretrained._write
    monkeypatch.setattr(pretrained, "_write", dies_after_two)
    new = _llama(12)
    with pytest.raises(OSError, match="No space left"):
        oases.save_pretrained(new, out)  # one file this time
    published = {name: (out / name).read_bytes() for name in os.listdir(out) if not name.endswith(".partial")}
    assert published == before  # loaders see the previous save, whole
    back = _llama(13)
    assert oases.load_pretrained(back, out) == ([], [])
    _assert_equal_dicts(back.state_dict(), old.state_dict())

    monkeypatch.setattr(pretrained, "_write", real_write)
    oases.save_pretrained(new, out)  # then it goes through: the old parts and index go, no .partial stays
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert oases.load_pretrained(back, out) == ([], [])
    _assert_equal_dicts(back.state_dict(), new.state_dict())


# --- checkpoints in transformers' own layout: its renamings and expert merges -----------------------


def _converted_models():
    """Models whose transformers checkpoints name tensors otherwise than the model: GPT-NeoX's
    embed_out (lm_head), Mixtral's block_sparse_moe and per-expert w1/w2/w3 (merged into
    experts.gate_up_proj / down_proj), Qwen2-MoE's per-expert gate/up/down_proj."""
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    common.update(attn_implementation="eager")
    moe = dict(common, num_key_value_heads=2, intermediate_size=48)
    return {
        "gpt_neox": (GPTNeoXForCausalLM, GPTNeoXConfig(**common, intermediate_size=64)),
        "mixtral": (MixtralForCausalLM, MixtralConfig(**moe, num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (
            Qwen2MoeForCausalLM,
            Qwen2MoeConfig(
                **moe,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=40,
            ),
        ),
    }


def _load_converted(rank, p, root):
    from safetensors import safe_open

    for name, (cls, config) in _converted_models().items():
        where = os.path.join(root, name)
        with safe_open(os.path.join(where, "model.safetensors"), framework="pt") as handle:
            keys = set(handle.keys())
        assert any(".experts.0." in k or k.startswith("embed_out.") for k in keys), sorted(keys)  # not the model's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = _logits(cls.from_pretrained(where, attn_implementation="eager").to(rank_device()).eval())
            with torch.device("meta"):
                model = cls(config)
            _parallelize(model, device=rank_device(), init_weights=False)
        assert oases.load_pretrained(model.eval(), where) == ([], [])  # strict: every key found, none left over
        torch.testing.assert_close(_logits(model), want, **TOL, msg=lambda m: f"{name}: {m}")
    return True


def test_transformers_layout_checkpoints_load_through_its_mapping_tp2(tmp_path):
    for name, (cls, config) in _converted_models().items():
        torch.manual_seed(0)
        cls(config).save_pretrained(tmp_path / name)
    assert run_ranks(_load_converted, 2, str(tmp_path), timeout=180) == [True, True]


def test_a_save_that_dies_while_renaming_never_mixes_two_saves(tmp_path, monkeypatch):
    out = tmp_path / "out"
    oases.save_pretrained(_llama(11), out, max_shard_size=SMALL)  # several files and an index
    real_replace, renamed = os.replace, []

    def dies_after_one(src, dst):  # the writer is killed between two renames
        if renamed:
            raise KeyboardInterrupt
        renamed.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        oases.save_pretrained(_llama(12), out, max_shard_size=SMALL)  # the same part names
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(renamed) == 1 and "model-00001-of-" in str(renamed[0])  # one new part among old ones
    with pytest.raises(FileNotFoundError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        oases.load_pretrained(_llama(13), out)  # no index over the mix: loud, not old and new weights


def test_merged_expert_boxes_read_only_what_they_cover(tmp_path):
    from oases.storage.hf_files import stored_tensors

    cls, config = _converted_models()["mixtral"]
    torch.manual_seed(0)
    model = cls(config)
    model.save_pretrained(tmp_path)  # per-expert w1 / w3 / w2 in the file
    want = model.state_dict()
    stored = stored_tensors(str(tmp_path), model)
    key = "model.layers.1.mlp.experts.gate_up_proj"  # [E, 2i, h] from w1 (gate) and w3 (up)
    assert stored[key].shape == want[key].shape and stored[key].parts
    experts, rows, _ = want[key].shape
    for box in (
        (slice(0, experts), slice(0, rows), slice(0, 32)),  # all of it
        (slice(1, 3), slice(rows // 2 - 5, rows // 2 + 7), slice(3, 17)),  # across gate | up
        (slice(2, 3), slice(rows // 2, rows), slice(0, 32)),  # up only
        (slice(3, 3), slice(0, rows), slice(0, 32)),  # empty
    ):
        assert torch.equal(stored[key].read(box), want[key][box]), box
    down = "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(stored[down].read(), want[down])
    assert torch.equal(stored["model.embed_tokens.weight"].read(), want["model.embed_tokens.weight"])
