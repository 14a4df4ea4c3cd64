"""Every schedule trains the TP GPT exactly like the single-process model: loss, every gradient."""

import pytest
import torch

from oases.models import GPT, GPTConfig
from oases.schedule import SCHEDULES, Communicator, RecomputeMemory

from _spawn import harness_device, rank_device, run_ranks

CONFIG = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2)


def _batch(batch, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g)
    targets = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g)
    return tokens, targets


def _single_process(config, batch, seed, dropout_seed):
    """The golden model: one process, plain autograd, no recomputation, no communication; on the
    ranks' device (dropout masks come from its generator), returned on the CPU."""
    device = harness_device()
    model = GPT(config, seed=seed).to(device)
    tokens, targets = (t.to(device) for t in _batch(batch, seed))
    loss = model(tokens, targets, dropout_seed=dropout_seed)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def _check_schedules(rank, world_size, cases):
    dev = rank_device()
    for config, batch, seed, dropout_seed, want_loss, want_grads in cases:
        tokens, targets = (t.to(dev) for t in _batch(batch, seed))
        want_loss, want_grads = want_loss.to(dev), {n: g.to(dev) for n, g in want_grads.items()}
        variants = [(s, False, False) for s in SCHEDULES] + [(s, False, True) for s in SCHEDULES]
        variants += [("oases", True, False), ("megatron", True, True)]
        variants += [("oases", False, False, "selective"), ("cross_pass", True, False, "selective")]
        layers = config.layers
        variants += [("oases", False, False, [i % 2 == 0 for i in range(layers)])]  # one mode per layer
        variants += [("megatron", True, False, ["selective" if i % 2 else False for i in range(layers)])]
        for schedule, vocab_parallel, sp, *recompute in variants:
            recompute = recompute[0] if recompute else True
            model = GPT(config, schedule=schedule, seed=seed, vocab_parallel=vocab_parallel, sequence_parallel=sp)
            model.to(dev)
            loss = model.train_step(tokens, targets, dropout_seed=dropout_seed, recompute=recompute)
            where = (
                f"{schedule} tp={world_size} batch={batch} dropout={config.dropout} "
                f"vocab_parallel={vocab_parallel} sequence_parallel={sp} recompute={recompute}"
            )
            if vocab_parallel:
                assert model.wte.weight.shape[0] == config.vocab_size // world_size
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: loss {m}")
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    p.grad,
                    model.shard_of(name, want_grads[name]),
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m: f"{where}: grad of {name}: {m}",
                )
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_schedule_matches_single_process(world_size):
    cases = []
    for batch, dropout in ((4, 0.0), (3, 0.0), (4, 0.25)):
        config = GPTConfig(**CONFIG, dropout=dropout)
        seed, dropout_seed = 10 + batch, (1234 if dropout else None)
        cases.append((config, batch, seed, dropout_seed, *_single_process(config, batch, seed, dropout_seed)))
    run_ranks(_check_schedules, world_size, cases, timeout=120)


def _count_communication(rank, world_size):
    config = GPTConfig(**CONFIG)
    tokens, targets = (t.to(rank_device()) for t in _batch(4, 0))
    counts = {}
    variants = [(s, s, False, False) for s in SCHEDULES] + [("oases-sp", "oases", True, False)]
    variants += [("oases-vocab", "oases", False, True), ("megatron-vocab", "megatron", False, True)]
    for name, schedule, sp, vocab_parallel in variants:
        model = GPT(config, schedule=schedule, sequence_parallel=sp, vocab_parallel=vocab_parallel).to(rank_device())
        memory = RecomputeMemory()
        model.train_step(tokens, targets, memory=memory, recompute=True)  # counts the recomputation
        assert memory.held == 0, name
        counts[name] = (dict(model.comm.calls), dict(model.comm.bytes), memory.peak)
    return counts


def test_oases_moves_two_thirds_of_megatrons_bytes():
    world_size = 2
    counts = run_ranks(_count_communication, world_size)[0]
    layers, activation = CONFIG["layers"], 4 * CONFIG["seq_len"] * CONFIG["hidden"] * 4  # fp32 bytes
    peaks = {name: c[2] for name, c in counts.items()}  # inputs kept for recomputation, whole batch
    assert peaks["oases"] == 2 * layers * activation  # every sublayer's input
    assert peaks["megatron"] == peaks["merak"] == peaks["cross_pass"] == layers * activation  # every layer's
    assert peaks["oases-sp"] == peaks["oases"] // world_size  # this rank's slice of the sequence
    counts = {name: c[:2] for name, c in counts.items()}
    calls, sent = counts["megatron"]
    assert calls == {"forward": 2 * layers, "recompute": 2 * layers, "backward": 2 * layers}
    assert sent == {phase: 2 * layers * activation for phase in calls}
    for schedule in ("merak", "cross_pass"):  # the same traffic, as half-size sub-batch all-reduces
        calls, sent = counts[schedule]
        assert calls == {"forward": 4 * layers, "recompute": 4 * layers, "backward": 4 * layers}
        assert sent == counts["megatron"][1]
    calls, sent = counts["oases"]
    assert calls == {"forward": 4 * layers, "backward": 4 * layers}  # recomputation sends nothing
    assert 3 * sum(sent.values()) == 2 * sum(counts["megatron"][1].values())
    # vocab_parallel: the schedule also runs the embedding's all-reduce (forward) and the LM head's
    # input-gradient all-reduce (backward), one activation each per sub-batch (embed_split, head_split)
    for schedule in ("oases", "megatron"):
        calls, sent = counts[f"{schedule}-vocab"]
        plain_calls, plain_sent = counts[schedule]
        sub_batches = 2 if schedule == "oases" else 1
        extra = {"forward": 1, "backward": 1}
        assert calls == {k: v + sub_batches * extra.get(k, 0) for k, v in plain_calls.items()}, schedule
        assert sent == {k: v + activation * extra.get(k, 0) for k, v in plain_sent.items()}, schedule
    # Sequence parallel (p = 2: a gather into n bytes or a scatter of n bytes sends n / 2): per
    # sublayer a gather and a scatter forward and backward (one all-reduce's bytes each way) and
    # the re-gather of the normed input in recomputation; plus the gather before the head, its
    # adjoint before the embedding, and one all-reduce of the norms' and biases' gradients.
    calls, sent = counts["oases-sp"]
    sublayers, norm_and_bias = 2 * layers, 3 * CONFIG["hidden"] * 4
    assert calls == {
        "forward": 2 * 2 * sublayers + 2,
        "recompute": 2 * sublayers,
        "backward": 2 * 2 * sublayers + 2 + 1,
    }
    assert sent == {
        "forward": sublayers * activation + activation // 2,
        "recompute": sublayers * activation // 2,
        "backward": sublayers * activation + activation // 2 + sublayers * norm_and_bias,
    }


def test_batch_smaller_than_sub_batches_is_rejected():
    model = GPT(GPTConfig(**CONFIG), schedule="oases")
    with pytest.raises(ValueError, match="sub-batches"):
        model.train_step(*_batch(1, 0))


def _check_shared_dropout_seed(rank, world_size):
    """Ranks whose default generators differ still draw the same dropout masks."""
    import torch.distributed as dist

    torch.manual_seed(100 + rank)
    model = GPT(GPTConfig(**CONFIG, dropout=0.5), schedule="oases").to(rank_device())
    loss = model.train_step(*(t.to(rank_device()) for t in _batch(4, 0))).reshape(1)
    losses = [torch.zeros(1, device=rank_device()) for _ in range(world_size)]
    dist.all_gather(losses, loss)
    assert all(torch.equal(l, losses[0]) for l in losses), losses
    return True


def test_dropout_masks_agree_across_ranks_without_a_seed():
    run_ranks(_check_shared_dropout_seed, 2)


def _check_forward_and_sub_batches(rank, world_size, want_loss, want_grads, want_shifted, want_logits, want_state):
    """At TP > 1, model(tokens, targets).backward() and every sub-batch count give the golden gradients;
    oases.train_step(gpt, ...) gives Hugging Face's shifted loss."""
    import oases

    dev = rank_device()
    tokens, targets = (t.to(dev) for t in _batch(5, 3))
    want_loss, want_shifted, want_logits = want_loss.to(dev), want_shifted.to(dev), want_logits.to(dev)
    want_grads = {n: g.to(dev) for n, g in want_grads.items()}
    want_state = {k: v.to(dev) for k, v in want_state.items()}
    cases = []
    for vocab_parallel in (False, True):
        model = GPT(GPTConfig(**CONFIG), seed=3, vocab_parallel=vocab_parallel).to(dev)
        loss = model(tokens, targets)
        loss.backward()
        cases.append((f"forward vocab_parallel={vocab_parallel}", loss.detach(), model))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), want_logits, rtol=1e-5, atol=1e-5)
        state = oases.full_state_dict(model)  # the single-process model's, exactly
        assert state.keys() == want_state.keys()
        assert all(torch.equal(state[k], want_state[k]) for k in state), vocab_parallel
    for parts in (1, 3, 5):
        m = GPT(GPTConfig(**CONFIG), schedule="oases", seed=3).to(dev)
        cases.append((f"sub_batches={parts}", m.train_step(tokens, targets, sub_batches=parts), m))
    for where, got, m in cases:
        torch.testing.assert_close(got, want_loss, rtol=1e-5, atol=1e-6, msg=lambda msg: f"{where}: loss {msg}")
        for name, p in m.named_parameters():
            torch.testing.assert_close(
                p.grad,
                m.shard_of(name, want_grads[name]),
                rtol=1e-4,
                atol=1e-6,
                msg=lambda msg: f"{where}: grad of {name}: {msg}",
            )
    for vocab_parallel in (False, True):
        m = GPT(GPTConfig(**CONFIG), seed=3, vocab_parallel=vocab_parallel).to(dev)
        shifted = oases.train_step(m, tokens, targets, schedule="cross_pass", sub_batches=2)
        torch.testing.assert_close(shifted, want_shifted, rtol=1e-5, atol=1e-6)
    return True


def test_forward_is_differentiable_and_sub_batches_are_a_parameter():
    import torch.nn.functional as F

    model = GPT(GPTConfig(**CONFIG), seed=3)
    tokens, targets = _batch(5, 3)
    loss = model(tokens, targets)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens)
        shifted = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())
    grads = {n: p.grad for n, p in model.named_parameters()}
    run_ranks(_check_forward_and_sub_batches, 2, loss.detach(), grads, shifted, logits, model.state_dict())


def test_checkpoint_memory_is_the_old_name_of_recompute_memory():
    """CheckpointMemory ("checkpoint" is a training state saved to files) warns and is
    RecomputeMemory; it is not in __all__, and no other name is aliased."""
    import oases.schedule as schedule

    assert "CheckpointMemory" not in schedule.__all__ and "RecomputeMemory" in schedule.__all__
    with pytest.warns(DeprecationWarning, match="oases.schedule.RecomputeMemory"):
        from oases.schedule import CheckpointMemory
    assert CheckpointMemory is RecomputeMemory
    with pytest.raises(AttributeError, match="Checkpoints"):
        schedule.Checkpoints
    from oases.schedule import table

    with pytest.warns(
        DeprecationWarning, match="table.CheckpointMemory is deprecated: use oases.schedule.RecomputeMemory"
    ):
        assert table.CheckpointMemory is RecomputeMemory  # the module that held it answers too


class _LoggedCommunicator(Communicator):
    """A Communicator that logs each all-reduce it starts: ("all_reduce", phase, shape)."""

    def __init__(self, group, world_size, log):
        super().__init__(group, world_size)
        self.log = log

    def all_reduce(self, t, phase):
        self.log.append(("all_reduce", phase, tuple(t.shape)))
        return super().all_reduce(t, phase)


def _vocab_order(rank, world_size):
    import torch.distributed as dist

    model = GPT(GPTConfig(**CONFIG), schedule="oases", vocab_parallel=True).to(rank_device())
    log = []
    embed_split, head_split = model.embed_split, model.head_split
    model.embed_split = lambda ids, where: log.append(("embed", where.rows.start)) or embed_split(ids, where)
    model.head_split = lambda x, ctx: log.append(("head", ctx.rows.start)) or head_split(x, ctx)
    model.comm = _LoggedCommunicator(dist.group.WORLD, world_size, log)
    tokens, targets = (t.to(rank_device()) for t in _batch(4, 0))
    model.train_step(tokens, targets, recompute=True)  # (auto would first probe embed_split and head_split)
    return log


def test_vocab_parallel_all_reduces_overlap_the_other_sub_batch():
    """Each sub-batch's embedding all-reduce starts before the other sub-batch embeds, and its
    head's input-gradient all-reduce before the other runs its head: the schedule yields across
    them (before embed_split and head_split, both ran blocking inside the step's own compute)."""
    log = run_ranks(_vocab_order, 2)[0]
    act = (2, CONFIG["seq_len"], CONFIG["hidden"])  # one sub-batch's activation
    assert log[:4] == [("embed", 0), ("all_reduce", "forward", act), ("embed", 2), ("all_reduce", "forward", act)]
    heads = [i for i, event in enumerate(log) if event[0] == "head"]
    assert [log[i] for i in heads] == [("head", 0), ("head", 2)]
    assert log[heads[0] + 1] == ("all_reduce", "backward", act)  # A's head gradient, then B runs on
    assert log[heads[1] + 1] == ("all_reduce", "backward", act)
    assert heads[1] == heads[0] + 2  # B's head runs while A's head gradient is summed
