"""The large-model story of oases.pipeline.Pipeline at PP2 and DP2 x PP2, on gloo ranks, against one process:

    factory: with torch.device("meta"): return LlamaForCausalLM(cfg)   # each stage allocates only its part
    pipe = Pipeline(factory, mesh, init_weights=False); pipe.load_pretrained(dir)   # dir: HF save_pretrained
    train, pipe.save_checkpoint(root, step=, extra=, keep=), train on
    fresh pipeline + pipe.load_checkpoint(root) + the same steps     # bit-identical parameters
    pipe.save_pretrained(out)                                        # from_pretrained equals pipe.state_dict()

Checked besides: losses equal the single-process model's; non-owned parameters stay on meta and the
allocated bytes are the stage's; init_weights=True gives the single-process build's values (a
nanoGPT-style model too); at PP2 a real-device build resumes from the same checkpoint; at
DP2 x PP2 the checkpoint loads into a DP2 x TP2 model with oases.load_checkpoint (parameters and
AdamW moments), whose oases.save_checkpoint loads into a PP2 x TP2 pipeline (sharded meta build;
a step and its export agree);
another model's checkpoint or weights raise ValueError on every rank.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import oases
from oases.pipeline import Pipeline

from _nanogpt import Block
from _spawn import harness_device, rank_device, run_ranks

pytest.importorskip("transformers")

SEED, STEPS, SAVED_AT, BATCH, T = 3, 4, 2, 4, 8


def _config(vocab=64):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _factory():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_config())


class _NanoGPT(nn.Module):
    """nanoGPT's layout (transformer.{wte, wpe, h, ln_f}, lm_head): not a Hugging Face model, so the
    pipeline finds its embedding and head by running them on a meta copy."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(64, 32),
                wpe=nn.Embedding(T, 32),
                h=nn.ModuleList(Block(32, 4) for _ in range(4)),
                ln_f=nn.LayerNorm(32),
            )
        )
        self.lm_head = nn.Linear(32, 64, bias=False)

    def loss(self, tokens, targets):
        t = self.transformer
        x = t.wte(tokens) + t.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in t.h:
            x = block(x)
        return F.cross_entropy(self.lm_head(t.ln_f(x)).flatten(0, 1), targets.flatten())


def _meta_nanogpt():
    with torch.device("meta"):
        return _NanoGPT()


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (BATCH, T), generator=g), torch.randint(0, 64, (BATCH, T), generator=g)


def _pipeline(dp, schedule, segments, **options):
    mesh = init_device_mesh(harness_device(), (dp, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    return Pipeline(
        _factory, mesh, schedule=schedule, segments=segments, micro_batches=2, optimizer=_adamw, seed=SEED, **options
    )


def _golden_losses(pretrained):
    """The single-process model's mean token loss (targets as given) on each step, trained with AdamW."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(pretrained).to(rank_device())
    opt = _adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.to(rank_device()) for t in _batch(step))
        loss = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _check_allocation(pipe):
    """Only the stage's layers, the embedding on stage 0 and the head on stage 1 are allocated."""
    stage, layout = pipe.layout.stage, pipe.layout
    layers = {i for k in range(layout.segments) for i in layout.layers_of(k)}
    mine = {f"model.layers.{i}." for i in layers}
    mine |= {"model.embed_tokens."} if stage == 0 else {"model.norm.", "lm_head."}
    held = 0
    for name, p in pipe.model.named_parameters():
        assert p.is_meta != any(name.startswith(m) for m in mine), (stage, name)
        held += 0 if p.is_meta else p.numel() * p.element_size()
    embed, head, layer = (
        64 * 32 * 4,
        (64 * 32 + 32) * 4,
        sum(p.numel() * 4 for n, p in pipe.model.named_parameters() if n.startswith("model.layers.0.")),
    )
    assert held == len(layers) * layer + (embed if stage == 0 else head), (stage, held)
    assert not any(b.is_meta for b in pipe.model.buffers())  # rotary tables: every stage's ctx needs them


def _moments(pipe):
    """{param name.state: tensor} of every stage's optimizers, gathered on every rank."""
    names = {id(p): n for n, p in pipe.model.named_parameters()}
    mine = {
        f"{names[id(p)]}.{k}": v.cpu().clone()
        for opt in pipe.optimizers
        for p, s in opt.state.items()
        for k, v in s.items()
        if k != "step"
    }
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _load_into_tp2(root, state, moments, again):
    """DP2 x TP2: oases.load_checkpoint of the pipeline's checkpoint equals the pipeline's state;
    then oases.save_checkpoint of that model into `again`, for a pipeline to load."""
    import warnings

    from transformers import LlamaForCausalLM

    from oases._sharding import tp_rules

    mesh = init_device_mesh(harness_device(), (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lm_head left replicated by the default plan
        oases.parallelize(model, mesh.get_group("tp"), device=rank_device(), init_weights=False)
    opt = _adamw(model.parameters())
    got = oases.load_checkpoint(model, root, optimizer=opt)
    assert got.step == SAVED_AT and got.extra == {"data": SAVED_AT}, got
    full = oases.full_state_dict(model)
    assert full.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(full[key].cpu(), value.cpu()), key
    rules, rank = tp_rules(model), mesh.get_local_rank("tp")
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            want = moments[f"{names[id(p)]}.{k}"]
            rule = rules.get(names[id(p)])
            assert torch.equal(s[k].cpu(), want if rule is None else rule[0].shard(want, rank, 2)), (names[id(p)], k)
    oases.save_checkpoint(model, again, optimizer=opt, step=SAVED_AT)


def _load_into_pp2_tp2(root, state, loss, out):
    """PP2 x TP2 (meta build, sharded): the DP2 x TP2 model's checkpoint loads; a step and the export agree."""
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh(harness_device(), (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(_factory, mesh, schedule="1f1b", micro_batches=2, optimizer=_adamw, init_weights=False)
    with pytest.raises(FileNotFoundError, match=f"step-{SAVED_AT + 1:09d}"):  # step=: that step or an error
        pipe.load_checkpoint(root, step=SAVED_AT + 1)
    assert pipe.load_checkpoint(root, step=SAVED_AT, verify=False, trusted=False).step == SAVED_AT  # no pickle run
    got = pipe.state_dict()
    for key, value in state.items():
        assert torch.equal(got[key].cpu(), value.cpu()), key
    torch.testing.assert_close(pipe.train_step(*_batch(SAVED_AT)), loss, rtol=1e-5, atol=1e-5)
    pipe.save_pretrained(out)
    got = pipe.state_dict()
    if dist.get_rank() == 0:
        exported = LlamaForCausalLM.from_pretrained(out).state_dict()
        for key, value in got.items():
            assert torch.equal(exported[key], value.cpu()), key
    pipe.close()


def _real_build_resumes(schedule, segments, root, losses, final):
    """A factory that builds a real model (every tensor allocated, other stages' layers released):
    the same checkpoint resumes it bit-exactly too."""
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(
        lambda: LlamaForCausalLM(_config()).to(rank_device()),
        mesh,
        schedule=schedule,
        segments=segments,
        micro_batches=2,
        optimizer=_adamw,
        seed=SEED,
    )
    assert pipe.freed_bytes > 0
    pipe.load_checkpoint(root)
    for step in range(SAVED_AT, STEPS):
        assert torch.equal(pipe.train_step(*_batch(step)), losses[step]), step
    state = pipe.state_dict()
    for key, value in final.items():
        assert torch.equal(state[key], value), key
    pipe.close()


def _nanogpt_on_meta(schedule, segments):
    """A model that is not Hugging Face's: its parts found on a meta copy, its values the plain build's."""
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(_meta_nanogpt, mesh, schedule=schedule, segments=segments, micro_batches=2, seed=SEED)
    assert pipe.model.transformer.wte.weight.is_meta == (pipe.layout.stage == 1)
    assert pipe.model.lm_head.weight.is_meta == (pipe.layout.stage == 0)
    torch.manual_seed(SEED)
    plain = _NanoGPT().to(rank_device())
    state = pipe.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key].cpu(), value.cpu()), key
    want = plain.loss(*(t.to(rank_device()) for t in _batch(0))).detach()
    torch.testing.assert_close(pipe.train_step(*_batch(0)), want, rtol=1e-5, atol=1e-5)
    pipe.close()


def _story(rank, world_size, dp, schedule, segments, pretrained, other, tmp):
    from transformers import LlamaForCausalLM

    root, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "out")
    golden = _golden_losses(pretrained)
    pipe = _pipeline(dp, schedule, segments, init_weights=False)
    _check_allocation(pipe)
    pipe.load_pretrained(pretrained)
    losses = []
    for step in range(STEPS):
        losses.append(pipe.train_step(*_batch(step)))
        torch.testing.assert_close(losses[-1], golden[step], rtol=1e-5, atol=1e-5)
        if step + 1 in (SAVED_AT - 1, SAVED_AT):  # keep=1: only the newest stays
            pipe.save_checkpoint(root, step=step + 1, extra={"data": step + 1}, keep=1)
        if step + 1 == SAVED_AT and dp > 1:
            saved_state, saved_moments = pipe.state_dict(), _moments(pipe)
    if rank == 0:
        assert os.listdir(root) == [f"step-{SAVED_AT:09d}"]
    final = pipe.state_dict()
    pipe.close()

    resumed = _pipeline(dp, schedule, segments, init_weights=False)
    state = resumed.load_checkpoint(root)
    assert state.step == SAVED_AT and state.extra == {"data": SAVED_AT}, state
    for step in range(SAVED_AT, STEPS):
        assert torch.equal(resumed.train_step(*_batch(step)), losses[step]), step
    again = resumed.state_dict()
    assert again.keys() == final.keys()
    for key, value in final.items():
        assert torch.equal(again[key], value), key

    resumed.save_pretrained(out)
    if rank == 0:
        exported = LlamaForCausalLM.from_pretrained(out).state_dict()
        assert exported.keys() == again.keys()
        for key, value in again.items():
            assert torch.equal(exported[key], value.cpu()), key

    # Another model's checkpoint and weights: refused on every rank before any collective.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        oases.save_checkpoint(LlamaForCausalLM(_config(vocab=48)).to(rank_device()), os.path.join(tmp, "other-ckpt"))
    for load, path in ((resumed.load_checkpoint, "other-ckpt"), (resumed.load_pretrained, other)):
        with pytest.raises(ValueError, match="does not fit the model"):
            load(os.path.join(tmp, path))
    dist.barrier()  # nobody was left inside a collective
    resumed.close()

    if dp > 1:
        tp2 = os.path.join(tmp, "tp2")  # the round trip: pipeline -> DP2 x TP2 model -> PP2 x TP2 pipeline
        _load_into_tp2(os.path.join(root, f"step-{SAVED_AT:09d}"), saved_state, saved_moments, tp2)
        _load_into_pp2_tp2(tp2, saved_state, losses[SAVED_AT], os.path.join(tmp, "out-tp2"))
    else:
        _real_build_resumes(schedule, segments, root, losses, final)
        _nanogpt_on_meta(schedule, segments)
        with pytest.raises(ValueError, match="segments='auto'"):  # which layers a stage allocates depends on it
            _pipeline(dp, "aiao", "auto")
        with pytest.raises(ValueError, match="init_weights=False: only for a factory that builds"):
            Pipeline(
                lambda: LlamaForCausalLM(_config()).to(rank_device()),
                init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp")),
                init_weights=False,
            )
        dist.barrier()

    built = _pipeline(dp, schedule, segments, init_weights=True)  # the single-process build's values
    torch.manual_seed(SEED)
    plain = LlamaForCausalLM(_config()).state_dict()
    state = built.state_dict()
    assert state.keys() == plain.keys()
    for key, value in plain.items():
        assert torch.equal(state[key].cpu(), value), key
    built.close()
    return True


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from transformers import LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("weights")
    for name, vocab in (("pretrained", 64), ("other", 48)):
        torch.manual_seed(0)
        LlamaForCausalLM(_config(vocab)).save_pretrained(tmp / name)
    return str(tmp / "pretrained"), str(tmp / "other")


def test_meta_build_pretrained_checkpoint_resume_export_pp2(weights, tmp_path):
    assert run_ranks(_story, 2, 1, "aiao", 2, *weights, str(tmp_path), timeout=240) == [True] * 2


def test_meta_build_pretrained_checkpoint_resume_export_dp2_pp2(weights, tmp_path):
    assert run_ranks(_story, 4, 2, "1f1b", 1, *weights, str(tmp_path), timeout=300) == [True] * 4


def _neox_config():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=64,
        intermediate_size=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def _meta_neox():
    from transformers import GPTNeoXForCausalLM

    with torch.device("meta"):
        return GPTNeoXForCausalLM(_neox_config())


def _load_transformers_layout(rank, world_size, where):
    from transformers import GPTNeoXForCausalLM

    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(_meta_neox, mesh, micro_batches=2, optimizer=_adamw, seed=SEED, init_weights=False)
    assert pipe.load_pretrained(where) == ([], [])
    want = GPTNeoXForCausalLM.from_pretrained(where).state_dict()
    state = pipe.state_dict()
    assert state.keys() == want.keys()
    for key, value in want.items():  # lm_head.weight too, stored as embed_out.weight
        assert torch.equal(state[key].cpu(), value), key
    pipe.close()
    return True


def test_pipeline_loads_a_transformers_layout_checkpoint_pp2(tmp_path):
    from safetensors import safe_open
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(0)
    GPTNeoXForCausalLM(_neox_config()).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert "embed_out.weight" in handle.keys()  # transformers' name, not the model's lm_head
    assert run_ranks(_load_transformers_layout, 2, str(tmp_path), timeout=240) == [True, True]


def _frozen_lower():
    model = _NanoGPT()
    for module in (model.transformer.wte, model.transformer.wpe, model.transformer.h[0], model.transformer.h[1]):
        module.requires_grad_(False)  # fine-tuning the upper half: stage 0 has nothing to train
    return model.to(rank_device())


def _frozen_stage(rank, world_size):
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    with pytest.raises(ValueError, match=r"a segment of a pipeline stage has no parameter that requires grad"):
        Pipeline(_frozen_lower, mesh, schedule="1f1b", micro_batches=2, optimizer=_adamw, seed=SEED)
    dist.barrier()  # both stages raised: neither is left waiting
    return True


def test_a_stage_with_nothing_to_train_is_refused_on_every_rank_pp2():
    assert run_ranks(_frozen_stage, 2, timeout=60) == [True, True]
