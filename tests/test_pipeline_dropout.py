"""oases.pipeline.Pipeline trains with dropout (issue 36, item 5): each train_step draws one seed
(the same on every stage and TP rank of a DP replica) and hands it to every micro-batch's SubBatch
with the micro-batch's rows of the global batch, so every layer's masks come from seeded streams
(oases.models._branch) and the recomputation of each checkpointed layer redraws them.

Models: a tied tiny Hugging Face Llama (attention_dropout 0.1: the attention probabilities' masks,
each TP rank's stream) and oases.models.GPT (dropout 0.1: a residual mask on the replicated stream).

  1. PP2: the pipeline with dropout is one process with the same masks: GPT against the model's
     own forward with the same step seed, Llama against oases.train_step (the same seed and
     sub-batch rows, recompute=False: no recomputation there), losses and weights after 2 steps
     (fp32 tolerance); the losses differ from the p = 0 pipeline's;
  2. PP2: recomputation by torch.utils.checkpoint (the default), by offload=True, and none at all
     (the layers' graphs kept) give bit-equal losses and weights after 2 steps;
  3. PP2 x TP2, every rank's default generator seeded differently: the replicated parameters (the
     norms) stay bit-equal over each TP group after 2 steps (one mask on replicated activations),
     and the GPT's losses are one process's with the seed of global rank 0's generator; PP2 x DP2
     (aiao, 2 segments): the GPT is one process (each replica's rows keyed apart, the same seed);
  4. eval_step after 2 steps with dropout is the p = 0 model's eval loss on the same weights
     (eval mode: no dropout), and leaves the default generator as it was;
  5. still refused: router jitter noise (Mixtral), at build; a model built in eval mode (adapted
     without its dropout) and switched to training mode, at train_step.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import oases
import oases.pipeline.stages as stages
from oases.models import GPT, GPTConfig
from oases.pipeline import Pipeline

from _spawn import harness_device, rank_device, run_ranks
from _tiny_llama import tiny_llama

pytest.importorskip("transformers")

P, SEED, DRAW, STEPS, BATCH, T, VOCAB = 0.1, 3, 11, 2, 4, 8, 32
GPT_SIZES = dict(vocab_size=VOCAB, seq_len=T, hidden=16, heads=2, mlp_ratio=2, layers=4)
TOL = dict(rtol=1e-4, atol=1e-5)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _llama(p=P):
    model = tiny_llama(tied=True)
    for layer in model.model.layers:  # (what attention_dropout=p in the config sets)
        layer.self_attn.attention_dropout = p
    model.config.attention_dropout = p
    return model


def _batches():
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, VOCAB, (BATCH, T), generator=g), torch.randint(0, VOCAB, (BATCH, T), generator=g))
        for _ in range(STEPS + 1)
    ]


def _pipeline(kind, mesh_shape, p=P, **options):
    mesh = init_device_mesh(harness_device(), mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
    config = GPTConfig(**GPT_SIZES, dropout=p) if kind == "gpt" else (lambda: _llama(p).to(rank_device()))
    options = {"schedule": "1f1b", **options}
    return Pipeline(config, mesh, micro_batches=2, optimizer=_sgd, seed=SEED, **options)


def _train(pipe, draw=DRAW):
    """(losses, state) after STEPS steps, the default generator seeded with `draw` first (the step
    seeds come from it)."""
    torch.manual_seed(draw)
    losses = [pipe.train_step(*batch) for batch in _batches()[:STEPS]]
    state = pipe.state_dict()
    return losses, state


def _loss_sum(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def _golden(kind, draw=DRAW):
    """(losses, state) of one process with the pipeline's masks: each step's seed drawn as the
    pipeline's first rank draws it; GPT through its own forward (masks over the whole batch,
    sliced), Llama through oases.train_step (the pipeline's micro-batches as its sub-batches, no
    recomputation)."""
    if kind == "gpt":
        alone, _ = dist.new_subgroups(group_size=1)
        model = GPT(GPTConfig(**GPT_SIZES, dropout=P), alone, seed=SEED)
    else:
        torch.manual_seed(SEED)
        model = _llama()
    model.to(rank_device())
    opt, losses = _sgd(model.parameters()), []
    torch.manual_seed(draw)
    for tokens, targets in _batches()[:STEPS]:
        tokens, targets = tokens.to(rank_device()), targets.to(rank_device())
        if kind == "gpt":  # drawn as the pipeline draws it: from the default generator of its device
            seed = int(torch.randint(0, 2**31 - 1, (1,), device=rank_device()))
            loss = model(tokens, targets, dropout_seed=seed)
            loss.backward()
        else:
            loss = oases.train_step(
                model, tokens, targets, sub_batches=2, loss_fn=_loss_sum, recompute=False, check_inputs=False
            )
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, model.state_dict()


def _close_states(state, want, where):
    assert list(state) == list(want), where
    for key, value in state.items():
        torch.testing.assert_close(value.cpu(), want[key].cpu(), **TOL, msg=lambda m: f"{where}: {key}: {m}")


def _equal_states(state, want, where):
    assert list(state) == list(want), where
    for key, value in state.items():
        assert torch.equal(value, want[key]), (where, key)


def _as_one_process(rank, world_size):
    for kind in ("gpt", "llama"):
        pipe = _pipeline(kind, (1, 2, 1))
        losses, state = _train(pipe)
        pipe.close()
        want_losses, want_state = _golden(kind)
        for step, (loss, want) in enumerate(zip(losses, want_losses)):
            assert torch.isfinite(loss), (kind, step)
            torch.testing.assert_close(loss, want, **TOL, msg=lambda m: f"{kind} step {step}: {m}")
        _close_states(state, want_state, kind)
        plain = _pipeline(kind, (1, 2, 1), p=0.0)
        plain_losses, _ = _train(plain)
        plain.close()
        for step, (loss, without) in enumerate(zip(losses, plain_losses)):  # dropout is on
            assert abs(float(loss) - float(without)) > 1e-6, (kind, step, float(loss), float(without))
    dist.barrier()
    return True


def test_pipeline_with_dropout_trains_as_one_process_with_its_masks():
    assert run_ranks(_as_one_process, 2, timeout=120) == [True] * 2


@contextlib.contextmanager
def _no_recomputation():
    """The stage's layers run as they are, their graphs kept (torch.utils.checkpoint stood in for)."""
    saved = stages.checkpoint
    stages.checkpoint = lambda fn, *args, use_reentrant: fn(*args)
    try:
        yield
    finally:
        stages.checkpoint = saved


def _recomputed(rank, world_size):
    for kind in ("gpt", "llama"):
        runs = {}
        for name, options, around in (
            ("checkpoint", {}, contextlib.nullcontext()),
            ("offload", dict(offload=True), contextlib.nullcontext()),
            ("kept", {}, _no_recomputation()),
        ):
            with around:
                pipe = _pipeline(kind, (1, 2, 1), **options)
                runs[name] = _train(pipe)
                pipe.close()
        (losses, state) = runs["kept"]
        for name in ("checkpoint", "offload"):
            where = f"{kind} {name}"
            assert [float(x) for x in runs[name][0]] == [float(x) for x in losses], where
            _equal_states(runs[name][1], state, where)
    dist.barrier()
    return True


def test_recomputation_redraws_the_same_masks():
    assert run_ranks(_recomputed, 2, timeout=120) == [True] * 2


_REPLICATED = ("norm", "norm_f", "layernorm")  # the norms: replicated over TP, their inputs too


def _replicated_masks(rank, world_size):
    for kind in ("gpt", "llama"):
        pipe = _pipeline(kind, (1, 2, 2))
        torch.manual_seed(100 + rank)  # every rank's generator apart: only the seed's broadcast agrees them
        losses = [pipe.train_step(*batch) for batch in _batches()[:STEPS]]
        pipe.state_dict()  # the last update applied
        mine = {id(p) for p in pipe.stage.parameters()}
        norms = {
            n: p.detach().cpu().clone()
            for n, p in pipe.model.named_parameters()
            if id(p) in mine and any(part in n for part in _REPLICATED)
        }
        assert norms, kind
        parts = [None] * 2
        dist.all_gather_object(parts, norms, group=pipe.tp_group)
        for name, value in norms.items():
            assert torch.equal(parts[0][name], value) and torch.equal(parts[1][name], value), (kind, name)
        assert all(torch.isfinite(loss) for loss in losses), kind
        pipe.close()
        if kind == "gpt":  # the seeds are global rank 0's draws (stage 0, TP rank 0)
            want, _ = _golden("gpt", draw=100)
            for step, (loss, golden) in enumerate(zip(losses, want)):
                torch.testing.assert_close(loss, golden, **TOL, msg=lambda m: f"gpt tp2 step {step}: {m}")
    # DP2 x PP2 (aiao over 2 segments, a DP sync deferred): each replica's micro-batches keyed by
    # their rows of the global batch; replicas drawing the same seed make one process's masks
    pipe = _pipeline("gpt", (2, 2, 1), schedule="aiao", segments=2, dp_overlap_ratio=0.5)
    losses, state = _train(pipe)
    pipe.close()
    want_losses, want_state = _golden("gpt")
    for step, (loss, want) in enumerate(zip(losses, want_losses)):
        torch.testing.assert_close(loss, want, **TOL, msg=lambda m: f"gpt dp2 step {step}: {m}")
    _close_states(state, want_state, "gpt dp2")
    dist.barrier()
    return True


def test_replicated_masks_agree_over_tp_and_dp_replicas_draw_their_rows_4_ranks():
    assert run_ranks(_replicated_masks, 4, timeout=180) == [True] * 4


def _rng_state():
    """The state of the default generator of the ranks' device (where a step's dropout seed is drawn)."""
    return torch.cuda.get_rng_state() if rank_device().type == "cuda" else torch.get_rng_state()


def _evaluated(rank, world_size):
    batch = _batches()[STEPS]
    for kind in ("gpt", "llama"):
        pipe = _pipeline(kind, (1, 2, 1))
        _, state = _train(pipe)
        before = _rng_state()
        got = pipe.eval_step(*batch)
        assert torch.equal(_rng_state(), before), kind  # no seed drawn, no mask
        assert torch.equal(pipe.eval_step(*batch), got), kind
        pipe.close()
        if kind == "gpt":
            alone, _ = dist.new_subgroups(group_size=1)
            plain = GPT(GPTConfig(**GPT_SIZES), alone, seed=0)
        else:
            plain = _llama(0.0)
        plain.to(rank_device()).load_state_dict(state)
        plain.eval()
        tokens, targets = batch[0].to(rank_device()), batch[1].to(rank_device())
        with torch.no_grad():
            if kind == "gpt":
                want = plain(tokens, targets)
            else:
                want = _loss_sum(plain(input_ids=tokens).logits, targets) / targets.numel()
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{kind}: {m}")
    dist.barrier()
    return True


def test_eval_step_after_dropout_is_the_p0_models_eval():
    assert run_ranks(_evaluated, 2, timeout=120) == [True] * 2


def _refused(rank, world_size):
    import transformers as tf

    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    # router jitter noise: drawn anew by each recomputation, whatever the seed
    jitter = tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        router_jitter_noise=0.1,
    )
    with pytest.raises(ValueError, match=r"decoder layer 0's .* draws random noise in training \(jitter_noise=0.1\)"):
        Pipeline(lambda: tf.MixtralForCausalLM(jitter).to(rank_device()), mesh, micro_batches=2, seed=SEED)
    # a model built in eval mode (as from_pretrained returns it) was adapted without its dropout
    pipe = Pipeline(lambda: _llama().eval().to(rank_device()), mesh, micro_batches=2, optimizer=_sgd, seed=SEED)
    pipe.model.train()
    with pytest.raises(ValueError, match=r"dropout 0.1 .* was in eval mode when the pipeline was built"):
        pipe.train_step(*_batches()[0])
    pipe.model.eval()  # trained in eval mode: no dropout, nothing to seed
    assert torch.isfinite(pipe.train_step(*_batches()[0]))
    pipe.close()
    dist.barrier()
    return True


def test_router_jitter_and_a_model_built_in_eval_mode_are_refused():
    assert run_ranks(_refused, 2, timeout=120) == [True] * 2
