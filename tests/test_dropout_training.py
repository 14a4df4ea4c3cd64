"""Dropout that trains on oases.train_step for Hugging Face models (issue 36, item 5).

Small GPT-2 (resid / attn / embd pdrop 0.1, eager attention), Llama (attention_dropout 0.1, sdpa;
eager where masks are recorded), GPT-NeoX (parallel residual, hidden_dropout and attention_dropout
0.1: the layer's own dropout modules on each branch's output), Falcon (parallel_attn=False: its
forward's dropout_add makes the layer run whole in training) and a nanoGPT-style model (Karpathy's
dropouts), at TP 2 on two gloo ranks:

  1. recompute=True, False and "selective" give bit-equal losses and gradients on every schedule
     (the same step seed: the default generator reseeded before each step); sequence parallelism
     draws the same masks (its loss and gradients close to the plain step's);
  2. dropout is really on: the loss differs from the p = 0 model's, about p of the elements are
     dropped; and the masks are the unsharded model's: replayed there (every F.dropout call, the
     ranks' attention-probability masks joined by heads), its loss and gradients equal the step's;
     train_step leaves the default generator as one seed draw leaves it;
  3. masks on replicated activations ([b, t, h]: embeddings, partial sums after the row projection,
     the layer's own dropouts) are the same on both ranks, masks on this rank's attention
     probabilities differ; the loss and the replicated parameters' gradients are bit-equal on both;
  4. after a training step with dropout, the model in eval mode matches the unsharded model again,
     and model(...) in training mode outside train_step (global generator, seeded alike) still runs.
"""

import contextlib
import copy
import importlib.util
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import oases
from oases.schedule import SCHEDULES

from _shards import check_grads
from _spawn import rank_device, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)

P = 0.1
TOL = dict(rtol=1e-4, atol=1e-5)
VOCAB = 96


class _NanoAttention(nn.Module):
    def __init__(self, n_embd, n_head, p):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(p), nn.Dropout(p)
        self.n_head, self.n_embd = n_head, n_embd  # this rank's, once parallelized

    def forward(self, x):
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(-1)
        y = self.attn_dropout(att) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


class _NanoMLP(nn.Module):
    def __init__(self, n_embd, p):
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = (
            nn.Linear(n_embd, 4 * n_embd),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(p),
        )

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class _NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head, p):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), _NanoAttention(n_embd, n_head, p)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), _NanoMLP(n_embd, p)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _NanoGPT(nn.Module):
    """Karpathy's nanoGPT layout with its dropouts (embedding, attention, residual, MLP)."""

    def __init__(self, p, n_embd=64, n_head=4, n_layer=2, block_size=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList(_NanoBlock(n_embd, n_head, p) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, VOCAB, bias=False)

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _reference_loss(model, ids):
    """The unsharded model's causal-LM loss (Hugging Face's, or the same for nanoGPT's logits)."""
    if isinstance(model, _NanoGPT):
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return model(input_ids=ids, labels=ids).loss


def _model(kind, p=P, attn="eager"):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "nanogpt":
        return _NanoGPT(p)
    common = dict(vocab_size=VOCAB, tie_word_embeddings=False, attn_implementation=attn)
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "gpt2":
        config = tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, **common
        )
        config.bos_token_id = config.eos_token_id = 0
        return tf.GPT2LMHeadModel(config)
    if kind == "llama":
        return tf.LlamaForCausalLM(
            tf.LlamaConfig(
                **sizes,
                intermediate_size=128,
                num_key_value_heads=2,
                max_position_embeddings=64,
                attention_dropout=p,
                **common,
            )
        )
    if kind == "neox":
        return tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(
                **sizes,
                intermediate_size=128,
                max_position_embeddings=64,
                hidden_dropout=p,
                attention_dropout=p,
                use_parallel_residual=True,
                **common,
            )
        )
    if kind == "falcon":
        return tf.FalconForCausalLM(
            tf.FalconConfig(
                **sizes, multi_query=False, parallel_attn=False, hidden_dropout=p, attention_dropout=p, **common
            )
        )
    raise AssertionError(kind)


def _parallel(kind, p=P, attn="eager"):
    """(the unsharded model, its TP copy), both in training mode."""
    ref = _model(kind, p, attn).to(rank_device())
    tp = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oases.parallelize(tp)
    return ref.train(), tp.train()


def _ids(b=4, t=12):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(3)).to(rank_device())


def _step(model, ids, seed=100, **kw):
    """train_step from a fresh gradient and the default generator at `seed` (so the step seed is
    the same); -> (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = oases.train_step(model, ids, ids, **kw)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_recompute_modes(rank, world_size, kinds):
    ids = _ids()
    for kind, attn in kinds:
        _, tp = _parallel(kind, attn=attn)
        stack = oases.training.adapt(tp)
        if kind == "falcon":  # its dropout_add cannot be placed on a branch: the layers run whole
            assert all(parts.kind == "whole" and "dropout" in parts.reason for parts in stack.parts)
        else:
            assert all(parts.kind != "whole" for parts in getattr(stack, "parts", ())), kind
        for schedule in SCHEDULES:
            want_loss, want = _step(tp, ids, schedule=schedule)
            for recompute in (False, "selective"):
                loss, grads = _step(tp, ids, schedule=schedule, recompute=recompute)
                where = f"{kind} {schedule} recompute={recompute}"
                assert torch.equal(loss, want_loss), f"{where}: loss {loss} != {want_loss}"
                assert grads.keys() == want.keys(), where
                for name, g in grads.items():
                    assert torch.equal(g, want[name]), f"{where}: grad of {name} differs"
        if kind == "gpt2":  # sequence parallelism: the same masks (its reductions in another order)
            loss, grads = _step(tp, ids, schedule="oases", sequence_parallel=True)
            want_loss, want = _step(tp, ids, schedule="oases")
            torch.testing.assert_close(loss, want_loss, **TOL)
            for name, g in grads.items():
                torch.testing.assert_close(g, want[name], **TOL, msg=lambda m: f"gpt2 SP: grad of {name}: {m}")
    return True


def test_recompute_modes_are_bit_equal_with_dropout_on_every_schedule():
    kinds = (("gpt2", "eager"), ("llama", "sdpa"), ("neox", "eager"), ("falcon", "sdpa"), ("nanogpt", None))
    assert all(run_ranks(_check_recompute_modes, 2, kinds, timeout=150))


@contextlib.contextmanager
def _recording(masks):
    """Inside: every F.dropout call with p > 0 in training appends (p, kept, live) to `masks`
    (live: where the input is not zero; kept: where the output is not zero, or the input was)."""
    real = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        before = input.clone() if inplace else input
        out = real(input, p, training, inplace)
        if training and p > 0:
            masks.append((p, (out != 0) | (before == 0), before != 0))
        return out

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = real


@contextlib.contextmanager
def _replaying(masks):
    """Inside: F.dropout applies the recorded masks in order, scaled by 1 / (1 - p)."""
    real = F.dropout
    todo = list(masks)

    def dropout(input, p=0.5, training=True, inplace=False):
        if not (training and p > 0):
            return real(input, p, training, inplace)
        want_p, kept, _ = todo.pop(0)
        assert want_p == p and kept.shape == input.shape, (p, want_p, kept.shape, input.shape)
        return input * (kept.to(input.dtype) / (1.0 - p))

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = real
    assert not todo, f"{len(todo)} recorded masks left"


def _joined(masks, world_size):
    """The masks the unsharded model would draw: this rank's and the others' attention
    probabilities [b, heads / p, t, t] joined by heads; the [b, t, h] ones (the same on every rank)."""
    joined = []
    for p, kept, live in masks:
        if kept.dim() == 4:
            every = [torch.empty_like(kept) for _ in range(world_size)]
            dist.all_gather(every, kept)
            kept = torch.cat(every, dim=1)
        joined.append((p, kept, None))
    return joined


def _recorded_step(rank, world_size, kind, ids):
    """(the unsharded model, the TP model, its loss and gradients, the masks it drew) of one step
    on the megatron schedule without recomputation (each dropout drawn once, in the unsharded
    model's order)."""
    ref, tp = _parallel(kind)
    _step(tp, ids)  # the first step finds what the layers return (the base model may run twice)
    masks = []
    with _recording(masks):
        loss, grads = _step(tp, ids, schedule="megatron", recompute=False)
    return ref, tp, loss, grads, masks


def _check_on_and_exact(rank, world_size, kinds):
    ids = _ids(8, 16)
    for kind in kinds:
        ref, tp, loss, grads, masks = _recorded_step(rank, world_size, kind, ids)
        # the default generator (the rank's device's): where the step seed's draw leaves it (the step forks it)
        after = _rng_state()
        torch.manual_seed(100)
        torch.randint(0, 2**31 - 1, (1,), device=rank_device())
        assert torch.equal(after, _rng_state()), f"{kind}: train_step moved the default generator"
        # dropout is on: about P dropped; not the p = 0 loss
        dropped = sum(int((~kept & live).sum()) for _, kept, live in masks)
        seen = sum(int(live.sum()) for _, _, live in masks)
        assert masks and abs(dropped / seen - P) < 0.02, f"{kind}: {dropped} of {seen} dropped"
        _, plain = _parallel(kind, p=0.0)
        plain_loss, _ = _step(plain, ids, schedule="megatron")
        assert abs(float(loss) - float(plain_loss)) > 1e-9, f"{kind}: the loss is the p = 0 model's"
        # the unsharded model with the same masks: the same loss and gradients
        with _replaying(_joined(masks, world_size)):
            want = _reference_loss(ref, ids)
            want.backward()
        torch.testing.assert_close(loss, want.detach(), **TOL, msg=lambda m: f"{kind}: loss {m}")
        check_grads(tp, {n: p.grad for n, p in ref.named_parameters()}, rank, world_size, kind, TOL)
    return True


def _rng_state():
    """The state of the default generator of the rank's device (where the step seed is drawn)."""
    dev = rank_device()
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


def test_dropout_is_on_and_draws_the_unsharded_models_masks():
    assert all(run_ranks(_check_on_and_exact, 2, ("gpt2", "llama", "neox", "falcon", "nanogpt"), timeout=150))


def _check_ranks(rank, world_size, kinds):
    ids = _ids(8, 16)
    for kind in kinds:
        _, tp, loss, grads, masks = _recorded_step(rank, world_size, kind, ids)
        # [b, t, h] masks (replicated activations, partial sums after the row projection) the same
        # on every rank, the masks of this rank's attention probabilities [b, heads / p, t, t] not
        shared = [kept for _, kept, _ in masks if kept.dim() == 3]
        ranked = [kept for _, kept, _ in masks if kept.dim() == 4]
        # (Llama: attention dropout alone; Falcon: its rotary attention applies none)
        assert (bool(shared), bool(ranked)) == {"llama": (False, True), "falcon": (True, False)}.get(kind, (True, True))
        for i, kept in enumerate(shared):
            assert _same_on_every_rank(kept, world_size), f"{kind}: mask {i} {tuple(kept.shape)} differs over the ranks"
        for i, kept in enumerate(ranked):
            assert not _same_on_every_rank(kept, world_size), f"{kind}: attention mask {i} is the same on both ranks"
        # the loss and the replicated parameters' gradients bit-equal on every rank
        assert _same_on_every_rank(loss, world_size), f"{kind}: the ranks' losses differ"
        replicated = [n for n in grads if not hasattr(tp.get_submodule(n.rpartition(".")[0]), "tp_layout")]
        assert replicated, kind
        for name in replicated:
            assert _same_on_every_rank(grads[name], world_size), f"{kind}: {name}'s gradient differs over the ranks"
    return True


def _same_on_every_rank(t, world_size):
    every = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(every, t.contiguous())
    return all(torch.equal(e, t) for e in every)


def test_masks_are_shared_on_replicated_activations_and_per_rank_on_heads():
    assert all(run_ranks(_check_ranks, 2, ("gpt2", "llama", "neox", "falcon", "nanogpt"), timeout=150))


def _check_eval_after_dropout(rank, world_size, kinds):
    ids = _ids()
    for kind in kinds:
        ref, tp = _parallel(kind)
        for schedule in ("megatron", "oases"):
            _step(tp, ids, schedule=schedule)  # a training step with dropout
        ref.eval()
        tp.eval()
        for schedule in SCHEDULES:
            ref.zero_grad(set_to_none=True)
            want = _reference_loss(ref, ids)
            want.backward()
            loss, _ = _step(tp, ids, schedule=schedule)
            torch.testing.assert_close(loss, want.detach(), **TOL, msg=lambda m: f"{kind} eval {schedule}: {m}")
            want = {n: p.grad for n, p in ref.named_parameters()}
            check_grads(tp, want, rank, world_size, f"{kind} eval {schedule}", TOL)
        # model(...) outside train_step: torch's dropout on the global generator, seeded alike on the ranks
        tp.train()
        tp.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = _reference_loss(tp, ids)
        loss.backward()
        every = [torch.empty_like(loss.detach()) for _ in range(world_size)]
        dist.all_gather(every, loss.detach())
        assert all(torch.equal(e, every[0]) for e in every), f"{kind}: model(...) losses differ over the ranks"
    return True


def test_eval_mode_matches_the_unsharded_model_after_training_with_dropout():
    assert all(run_ranks(_check_eval_after_dropout, 2, ("gpt2", "neox", "nanogpt"), timeout=120))
