"""GPT(config, group, tp_degrees=[...]): per-layer TP degrees train exactly like the single-process model.

Each rank computes the golden model itself (one process, plain autograd) and compares the loss,
every parameter's gradient (its shard), the logits, the initialisation, the unsharded state dict
and the clipped gradient norm, for mixed plans on 2 and 4 ranks, with batches the replicas divide
and batches they do not (blocks of unequal size: 5 rows over 2 replicas are 2 + 3).
"""

import io
import json

import pytest
import torch
import torch.distributed as dist

import oases
import oases.plan
from oases._rows import block_rows, padded, part_sizes, unpadded
from oases.cli import main as cli_main
from oases.degrees import check_tp_degrees
from oases.models import GPT, GPTConfig

from _spawn import harness_device, rank_device, run_ranks

CONFIG = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=4, mlp_ratio=2)
BATCH, SEED, DROPOUT_SEED = 4, 7, 1234


def _batch(batch=BATCH, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g)
    targets = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g)
    return tokens, targets


def _golden(config, batch=BATCH, dropout_seed=None, device="cpu"):
    """The single-process model's initial state, logits, loss and gradients (and clipped gradients),
    on `device` (dropout masks come from that device's generator)."""
    model = GPT(config, seed=SEED).to(device)
    tokens, targets = (t.to(device) for t in _batch(batch))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    logits = model(tokens).detach()
    loss = model(tokens, targets, dropout_seed=dropout_seed)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = {n: p.grad for n, p in model.named_parameters()}
    return dict(state=state, logits=logits, loss=loss.detach(), grads=grads, norm=norm, clipped=clipped)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _check_grads(model, want, what):
    for name, p in model.named_parameters():
        _close(p.grad, model.shard_of(name, want[name]), f"{what}: grad of {name}")


def _check_plan(degrees, gold, gold_dropout, batch=BATCH):
    config = GPTConfig(**CONFIG)
    tokens, targets = (t.to(rank_device()) for t in _batch(batch))
    where = f"rank {dist.get_rank()} tp_degrees={degrees} batch={batch}"
    model = GPT(config, tp_degrees=degrees, seed=SEED).to(rank_device())
    if batch == BATCH:  # the initialisation and the checkpoints (not the batch's business), once per plan
        for name, p in model.named_parameters():  # the full model's initialisation, sharded per layer
            torch.testing.assert_close(
                p,
                model.shard_of(name, gold["state"][name]),
                rtol=0,
                atol=0,
                msg=lambda m: f"{where}: init of {name}: {m}",
            )
        full = oases.full_state_dict(model)
        assert full.keys() == gold["state"].keys()
        for key, value in full.items():
            torch.testing.assert_close(value, gold["state"][key], rtol=0, atol=0)
        other = GPT(config, tp_degrees=degrees, seed=SEED + 1).to(rank_device())
        oases.load_full_state_dict(other, gold["state"])  # the unsharded checkpoint into per-layer shards
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m: f"{where}: loaded {name}: {m}")
    _close(model(tokens), gold["logits"], f"{where}: logits")
    loss = model(tokens, targets)  # forward + backward
    loss.backward()
    _close(loss.detach(), gold["loss"], f"{where}: loss")
    _check_grads(model, gold["grads"], where)
    norm = oases.nn.clip_grad_norm_(model, 0.1)
    _close(norm, gold["norm"], f"{where}: clip_grad_norm_ total")
    _check_grads(model, gold["clipped"], f"{where} clipped")

    model = GPT(GPTConfig(**CONFIG, dropout=0.25), tp_degrees=degrees, seed=SEED)  # train_step, dropout
    model.to(rank_device())
    uneven_parts = batch != BATCH and batch >= 2 * dist.get_world_size() // min(degrees)  # a row per replica
    for parts in (1, 2) if uneven_parts else (1,):
        model.zero_grad(set_to_none=True)
        loss = model.train_step(tokens, targets, dropout_seed=DROPOUT_SEED, sub_batches=parts)
        _close(loss, gold_dropout["loss"], f"{where} train_step sub_batches={parts}: loss")
        _check_grads(model, gold_dropout["grads"], f"{where} train_step sub_batches={parts}")


def _bad_arguments(world_size):
    """Every rank raises the same error before any communication (the run would hang otherwise)."""
    config = GPTConfig(**CONFIG)
    bad = [
        ([3, 1, 1, 1], ValueError, "tp_degrees\\[0\\]"),
        ([1, 2], ValueError, "one degree per layer"),
        ([2 * world_size] * 4, ValueError, "power of two dividing"),
        ([0, 1, 1, 1], ValueError, "tp_degrees"),
        ("1221", TypeError, "tp_degrees"),
        ([1.0, 1, 1, 1], TypeError, "tp_degrees\\[0\\]"),
    ]
    for degrees, error, match in bad:
        with pytest.raises(error, match=match):
            GPT(config, tp_degrees=degrees)
    for option in ({"vocab_parallel": True}, {"sequence_parallel": True}, {"offload": True}):
        with pytest.raises(ValueError, match=next(iter(option))):
            GPT(config, tp_degrees=[1] * 4, **option)
    model = GPT(config, tp_degrees=[1] * 4).to(rank_device())
    tokens, targets = (t.to(rank_device()) for t in _batch())
    with pytest.raises(ValueError, match="sub_batches"):
        model.train_step(tokens, targets, sub_batches=9)
    with pytest.raises(ValueError, match=f"at least {world_size} rows"):  # a replica would get no row
        model.train_step(tokens[: world_size - 1], targets[: world_size - 1], sub_batches=1)
    with pytest.raises(ValueError, match=f"got batch size {world_size - 1} \\(use at least {world_size} rows\\)"):
        model(tokens[: world_size - 1])
    with pytest.raises(ValueError, match="sequence_parallel"):  # the schedules run tp_degrees without SP
        oases.train_step(model, tokens, targets, sequence_parallel=True)


def _ranks_main(rank, world_size, plans, plan_path, golden):
    golden = torch.load(io.BytesIO(golden), map_location=rank_device())  # {batch: (gold, gold with dropout)}
    _bad_arguments(world_size)
    if world_size == 4:  # a group that is not the world: rejected before any subgroup is made
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        with pytest.raises(ValueError, match="whole world"):
            GPT(GPTConfig(**CONFIG), pairs[rank // 2], tp_degrees=[1, 2, 2, 1])
    for degrees, batch in plans:
        _check_plan(degrees, *golden[batch], batch)
    if plan_path is not None:
        degrees = oases.plan.load(plan_path)
        assert len(degrees) == CONFIG["layers"]
        _check_plan(degrees, *golden[BATCH])
    return True


def _plan_file(tmp_path, world_size):
    """A plan written by `oases plan` for this model (its degrees are whatever the planner picks)."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps(CONFIG))  # GPTConfig's fields
    out = tmp_path / "plan.json"
    assert (
        cli_main(
            [
                "plan",
                "--model",
                str(model),
                "--world",
                str(world_size),
                "--device-memory",
                "1GB",
                "--link",
                "1gbit",
                "--batch",
                str(BATCH),
                "--tp-max",
                str(world_size),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return str(out)


# (degrees, batch): batches of 5 and 7 rows split unevenly over 2 and 4 replicas (7 over 4: 1 + 2 + 2 + 2,
# over 2: 3 + 4); 5 rows in 2 sub-batches (2 + 3) over 2 replicas: 1 + 1 and 1 + 2.
@pytest.mark.parametrize(
    "world_size, plans",
    [
        (2, [([1, 2, 2, 1], 4), ([1, 2, 2, 1], 5)]),
        (4, [([2, 4, 4, 2], 4), ([4, 1, 2, 4], 4), ([1, 2, 4, 1], 7), ([2, 4, 1, 2], 5)]),
    ],
)
def test_per_layer_degrees_match_single_process(world_size, plans, tmp_path, capsys):
    plan_path = _plan_file(tmp_path, world_size) if world_size == 2 else None
    capsys.readouterr()
    golden = io.BytesIO()  # as bytes: each tensor passed to a rank would cost a file descriptor
    torch.save(
        {
            b: (
                _golden(GPTConfig(**CONFIG), b, device=harness_device()),  # the ranks' device (its dropout masks)
                _golden(GPTConfig(**CONFIG, dropout=0.25), b, DROPOUT_SEED, harness_device()),
            )
            for b in {BATCH, *(b for _, b in plans)}
        },
        golden,
    )
    run_ranks(_ranks_main, world_size, plans, plan_path, golden.getvalue(), timeout=90)


def test_row_blocks_nest():
    """Block j of R replicas is blocks j k .. j k + k - 1 of R k (so rows move inside one replica), for
    batches that R k does not divide too; padded pieces all-gathered and cut give the blocks back."""
    for batch in range(1, 40):
        for replicas in (1, 2, 4):
            for k in (1, 2, 4, 8):
                for j in range(replicas):
                    block = block_rows(batch, replicas, j)
                    parts = [block_rows(batch, replicas * k, j * k + m) for m in range(k)]
                    assert (parts[0].start, parts[-1].stop) == (block.start, block.stop), (batch, replicas, k, j)
                    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
                    assert part_sizes(batch, replicas, j, k) == tuple(s.stop - s.start for s in parts)
                    assert max(s.stop - s.start for s in parts) - min(s.stop - s.start for s in parts) <= 1
    assert part_sizes(11, 2, 0, 4) == (1, 1, 2, 1)  # not an even split of the block's 5 rows (1, 1, 1, 2)
    rows = torch.arange(7.0)[:, None]
    sizes = (1, 2, 2, 2)
    pieces = [padded(rows[s], sizes) for s in (block_rows(7, 4, i) for i in range(4))]
    assert all(piece.shape == (2, 1) for piece in pieces)
    torch.testing.assert_close(unpadded(torch.cat(pieces), sizes), rows, rtol=0, atol=0)


def test_degree_checks_without_ranks():
    assert check_tp_degrees([1, 2, 4], 3, 4) == (1, 2, 4)
    with pytest.raises(ValueError, match="power of two"):
        check_tp_degrees([3, 3], 2, 6)  # divides 6, not a power of two
    with pytest.raises(ValueError, match="one degree per layer"):
        check_tp_degrees([1, 1, 1], 2, 2)
    model = GPT(GPTConfig(**CONFIG), tp_degrees=[1] * 4, seed=SEED)  # one process: the plain model
    plain = GPT(GPTConfig(**CONFIG), seed=SEED)
    tokens, targets = _batch()
    torch.testing.assert_close(model(tokens, targets), plain(tokens, targets), rtol=0, atol=0)
