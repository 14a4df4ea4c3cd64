"""oases.train_step on GPT(config, group, tp_degrees=[...]): every non-sequence-parallel schedule
gives the single-process model's loss and gradients, each layer communicating on its own degree.

The golden model runs in the parent (one process, plain autograd, Hugging Face's shifted-label
loss); each rank compares the loss and every parameter's gradient (its shard), with and without
dropout, over several steps (gradients accumulate), and counts the calls on every communicator.
Then Hugging Face models after oases.parallelize(model, tp_degrees=[...]) against the unsharded
model's own forward and loss.backward(), with left padding (per-row masks that matter). Some
sub-batches' rows do not divide over the replicas (3 rows over 2: 1 + 2), so blocks differ in size.
"""

import io

import pytest
import torch

import oases
from oases.models import GPT, GPTConfig
from oases.schedule import SCHEDULES, split_rows
from oases.training import causal_lm_loss_sum

from _spawn import harness_device, rank_device, run_ranks

CONFIG = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4, mlp_ratio=2)
SEED, STEP_SEED, DROPOUT = 7, 99, 0.25


def _batch(batch):
    g = torch.Generator().manual_seed(SEED + batch)
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g)
    labels = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g)
    labels[0, 3:6] = -100  # ignored positions: the normalizer counts the others
    return ids, labels


def _step_seed(device="cpu"):
    """The dropout seed GPT.step_seed draws on the group's first rank after torch.manual_seed(STEP_SEED)
    (from the default generator of the model's device)."""
    torch.manual_seed(STEP_SEED)
    return int(torch.randint(0, 2**31 - 1, (1,), device=device))


def _golden(batch, dropout, device="cpu"):
    """Loss and gradients of the single-process model (no schedule, no recomputation) on `device`
    (dropout masks come from that device's generator)."""
    model = GPT(GPTConfig(**CONFIG, dropout=dropout), seed=SEED).to(device)
    ids, labels = (t.to(device) for t in _batch(batch))
    logits = model(ids, dropout_seed=_step_seed(device) if dropout else None)
    loss = causal_lm_loss_sum(logits, labels) / int((labels[:, 1:] != -100).sum())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _expected_calls(model, schedule, parts):
    """{communicator id: {phase: calls}} for one oases.train_step (sublayers: 2 per layer)."""
    plan, placements = SCHEDULES[schedule], model.layer_placements()
    want = {}

    def add(comm, phase, n):
        if comm.world_size > 1 and n:
            want.setdefault(id(comm), {}).setdefault(phase, 0)
            want[id(comm)][phase] += n

    moves = [(at.rows_in, at) for at in placements.layers] + [(placements.rows_out, None)]
    for at in placements.layers:
        add(at.comm, "forward", 2 * parts)
        add(at.comm, "backward", 2 * parts)
        if not plan.fine_grained_recompute:
            add(at.comm, "recompute", 2 * parts)
        if at.replica_comm is not None:
            add(at.replica_comm, "backward", 1)  # one flat sum per layer, per step
    for move, _ in moves:
        if move is not None:
            add(move.comm, "backward" if move.down else "forward", parts)  # the all-gather side
    return want


def _all_comms(model):
    placements = model.layer_placements()
    comms = {}
    for at in placements.layers:
        for c in (at.comm, at.replica_comm, at.rows_in and at.rows_in.comm):
            if c is not None:
                comms[id(c)] = c
    if placements.rows_out is not None:
        comms[id(placements.rows_out.comm)] = placements.rows_out.comm
    return comms


def _bad_arguments(world_size, degrees, batch):
    """Every rank raises before any communication (a hang otherwise)."""
    model = GPT(GPTConfig(**CONFIG), tp_degrees=degrees, seed=SEED).to(rank_device())
    ids, labels = (t.to(rank_device()) for t in _batch(batch))
    most = world_size // min(degrees)
    small = most * 2 - 1 if most > 1 else None  # two sub-batches whose rows do not split into the replicas
    if small is not None:
        with pytest.raises(
            ValueError, match=f"gives \\[{most - 1}, {most}\\] rows \\(use a batch of at least {2 * most} rows"
        ):
            oases.train_step(model, ids[:small], labels[:small], schedule="oases")
    with pytest.raises(ValueError, match="sequence_parallel"):
        oases.train_step(model, ids, labels, sequence_parallel=True)
    with pytest.raises(ValueError, match="comm"):
        oases.train_step(model, ids, labels, comm=model.comm)
    with pytest.raises(ValueError, match="offload"):
        oases.train_step(model, ids, labels, offload=True)


def _ranks_main(rank, world_size, plans, golden_bytes):
    golden = torch.load(io.BytesIO(golden_bytes), map_location=rank_device())
    for degrees, batch, sub_batches in plans:
        _bad_arguments(world_size, degrees, batch)
        ids, labels = (t.to(rank_device()) for t in _batch(batch))
        for dropout in (0.0, DROPOUT):
            want_loss, want_grads = golden[batch, dropout]
            model = GPT(GPTConfig(**CONFIG, dropout=dropout), tp_degrees=degrees, seed=SEED).to(rank_device())
            assert model.layer_placements() is model.layer_placements()  # made once, kept by the model
            runs = [(s, None) for s in SCHEDULES] + [("oases", sub_batches), ("merak", sub_batches)]
            for schedule, parts in runs:
                where = f"rank {rank} tp_degrees={degrees} {schedule} sub_batches={parts} dropout={dropout}"
                model.zero_grad(set_to_none=True)
                for c in _all_comms(model).values():
                    c.reset()
                torch.manual_seed(STEP_SEED)  # step_seed: the same dropout masks as the golden model
                loss = oases.train_step(model, ids, labels, schedule=schedule, sub_batches=parts)
                _close(loss, want_loss, f"{where}: loss")
                for name, p in model.named_parameters():
                    _close(p.grad, model.shard_of(name, want_grads[name]), f"{where}: grad of {name}")
                n = len(split_rows(batch, parts or SCHEDULES[schedule].sub_batches))
                got = {i: {k: v for k, v in c.calls.items() if v} for i, c in _all_comms(model).items()}
                got = {i: v for i, v in got.items() if v}
                assert got == _expected_calls(model, schedule, n), where
            # a second step accumulates into .grad (the replica sums add only this step's part)
            torch.manual_seed(STEP_SEED)
            oases.train_step(model, ids, labels, schedule="oases")
            for name, p in model.named_parameters():
                _close(p.grad, 2 * model.shard_of(name, want_grads[name]), f"rank {rank} {degrees} accumulated {name}")
            # the blocking path afterwards: its replica-sum hooks are back on
            model.zero_grad(set_to_none=True)
            seed = _step_seed(rank_device()) if dropout else None
            logits = model(ids, dropout_seed=seed)
            loss = causal_lm_loss_sum(logits, labels) / int((labels[:, 1:] != -100).sum())
            loss.backward()
            _close(loss.detach(), want_loss, f"rank {rank} {degrees} blocking loss")
            for name, p in model.named_parameters():
                _close(p.grad, model.shard_of(name, want_grads[name]), f"rank {rank} {degrees} blocking {name}")
    return True


# (degrees, batch, sub_batches for the extra oases / merak runs); the schedules' own split is 1
# (megatron) or 2. Uneven blocks: 6 rows in 2 sub-batches of 3 over 2 replicas; 9 rows in 2 (4 + 5)
# and 1 over 4 replicas (over 2: 4 + 5 -> 2 + 2 and 2 + 3).
@pytest.mark.parametrize(
    "world_size, plans",
    [
        (2, [([1, 2, 2, 1], 4, 1), ([2, 1, 1, 2], 8, 4), ([1, 2, 2, 1], 6, 3)]),
        (4, [([2, 4, 4, 2], 4, 1), ([4, 1, 2, 4], 8, 1), ([1, 2, 4, 1], 9, 1)]),
    ],
)
def test_tp_degrees_on_every_schedule_match_single_process(world_size, plans):
    golden = {}
    for _, batch, _ in plans:
        for dropout in (0.0, DROPOUT):
            golden[batch, dropout] = _golden(batch, dropout, harness_device())  # the ranks' device, its masks
    data = io.BytesIO()  # as bytes: each tensor passed to a rank would cost a file descriptor
    torch.save(golden, data)
    run_ranks(_ranks_main, world_size, plans, data.getvalue(), timeout=240)


# ---- Hugging Face models after oases.parallelize(model, tp_degrees=[...]) -------------------------------

HF_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=96,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attn_implementation="eager",
)


def _hf_model(kind, layers, heads, kv_heads):
    import transformers as tf

    torch.manual_seed(0)
    attn = dict(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**HF_SMALL, **attn))
    if kind == "qwen2":  # q/k/v with biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**HF_SMALL, **attn))
    if kind == "neox":  # parallel residual, dense biases (plain at degree 1)
        return tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(
                **HF_SMALL,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                use_parallel_residual=True,
            )
        )
    raise AssertionError(kind)


def _hf_batch(b, t, padded):
    g = torch.Generator().manual_seed(b + 11)
    ids = torch.randint(0, HF_SMALL["vocab_size"], (b, t), generator=g)
    labels, mask = ids.clone(), None
    if padded:  # left padding of different lengths: the 4-d masks differ per row, and matter (with
        mask = torch.ones(b, t, dtype=torch.long)  # right padding a causal mask would hide the pads anyway)
        for i in range(b):
            mask[i, : 1 + i % 4] = 0
        labels[mask == 0] = -100
    dev = rank_device()  # made on the CPU, used on the rank's device
    return ids.to(dev), labels.to(dev), None if mask is None else mask.to(dev)


def _hf_expected(tp, name, full, degrees, rank, p):
    """This rank's slice of the unsharded tensor: by its module's tp_layout at its layer's degree."""
    owner, _, leaf = name.rpartition(".")
    module = tp.get_submodule(owner)
    rule = module.tp_layout().get(leaf) if hasattr(module, "tp_layout") else None
    if rule is None:
        return full
    parts = name.split(".layers.")
    d = degrees[int(parts[1].split(".")[0])] if len(parts) > 1 else p
    return rule.shard(full, rank % d, d)


def _hf_ranks_main(rank, world_size, models, cases):
    import copy
    import warnings

    for kind, heads, kv_heads, degrees in models:
        ref = _hf_model(kind, len(degrees), heads, kv_heads).to(rank_device())
        tp = copy.deepcopy(ref)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.parallelize(tp, tp_degrees=degrees)
        ids, labels, mask = _hf_batch(4, 12, False)
        with pytest.raises(ValueError, match="replicas"):  # 3 rows in 2 sub-batches: 1 + 2, 2 replicas need 2 each
            oases.train_step(tp, ids[:3], labels[:3])
        for schedule, sub_batches, b, padded in cases:
            ids, labels, mask = _hf_batch(b, 12, padded)
            ref.zero_grad(set_to_none=True)
            tp.zero_grad(set_to_none=True)
            out = ref(input_ids=ids, labels=labels, attention_mask=mask)
            out.loss.backward()
            want = {n: q.grad for n, q in ref.named_parameters()}
            loss = oases.train_step(tp, ids, labels, schedule=schedule, sub_batches=sub_batches, attention_mask=mask)
            where = (
                f"rank {rank} {kind} tp_degrees={degrees} {schedule} sub_batches={sub_batches} b={b} padded={padded}"
            )
            torch.testing.assert_close(
                loss, out.loss.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: loss {m}"
            )
            for name, q in tp.named_parameters():
                assert q.grad is not None, f"{where}: {name} got no gradient"
                torch.testing.assert_close(
                    q.grad,
                    _hf_expected(tp, name, want[name], degrees, rank, world_size),
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m: f"{where}: grad of {name}: {m}",
                )
        placements = tp.oases_layer_placements
        assert tuple(at.place.degree for at in placements.layers) == tuple(degrees)
        oases.train_step(tp, ids, labels, schedule="oases", attention_mask=mask)
        assert tp.oases_layer_placements is placements  # made once, kept on the model
    return True


@pytest.mark.parametrize(
    "world_size, models",
    [
        (2, [("llama", 4, 2, [1, 2, 2, 1]), ("neox", 4, 4, [2, 1, 1, 2])]),
        (4, [("qwen2", 4, 4, [4, 1, 2, 4])]),
    ],
)
def test_parallelized_hf_models_with_tp_degrees_match_unsharded(world_size, models):
    pytest.importorskip("transformers")
    batch = 8 if world_size == 4 else 4
    cases = [(s, None, batch, True) for s in SCHEDULES] + [("oases", 4, 2 * batch, False)]
    cases += [("megatron", None, 5, True), ("oases", None, 9, True)] if world_size == 4 else [("oases", None, 6, True)]
    run_ranks(_hf_ranks_main, world_size, models, cases, timeout=300)


def test_one_process():
    """Without tp_degrees the schedules take the one-communicator path (no placements); with
    tp_degrees on one process (all degree 1) the placed path is the plain model."""
    assert GPT(GPTConfig(**CONFIG), seed=SEED).layer_placements() is None
    want_loss, want_grads = _golden(4, DROPOUT)
    model = GPT(GPTConfig(**CONFIG, dropout=DROPOUT), tp_degrees=[1] * CONFIG["layers"], seed=SEED)
    torch.manual_seed(STEP_SEED)
    ids, labels = _batch(4)
    _close(oases.train_step(model, ids, labels, schedule="cross_pass"), want_loss, "one process: loss")
    for name, p in model.named_parameters():
        _close(p.grad, want_grads[name], f"one process: grad of {name}")
