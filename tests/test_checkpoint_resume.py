"""oases.save_checkpoint / load_checkpoint as training checkpoints, on gloo ranks.

Sharded (each rank writes its own boxes of the unsharded tensors, nobody gathers the model), with
the optimizer's state, step, extra and RNG states; atomic (a marker, then a rename) with rotation;
resumable bit for bit at the same layout and within float error at another TP degree; older
checkpoints (the unsharded state dict at the top level) still load. Models: Hugging Face Llama
(MHA, so TP 4 fits) and the toy MLP of test_checkpoint.
"""

import json
import os
import re
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_checkpoint import HAVE_TRANSFORMERS, TOY_PLAN, _llama, _parallelize, _toy

import oases

from _spawn import rank_device, run_ranks

needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers")
TOL = dict(rtol=1e-5, atol=1e-5)


def _ids(step):
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(100 + step)).to(rank_device())


def _train(model, opt, steps):
    for step in steps:
        ids = _ids(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _llama_tp(seed, group=None, tp_degrees=None):
    """Llama (MHA) parallelized over `group`, or over the world with per-layer degrees."""
    if tp_degrees is None:
        return _parallelize(_llama(4, seed).to(rank_device()), group, None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"oases.parallelize: left \d+ nn.Linear", UserWarning)
        return oases.parallelize(_llama(4, seed).to(rank_device()), tp_degrees=tp_degrees)


def _adamw(model, lr=1e-2):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _snapshot(model, opt):
    """({param name: value}, {param name: {state name: value}}), cloned."""
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    return params, state


def _here(storage, location):
    """torch.load's map_location: another rank's device tensors onto this rank's, CPU ones (AdamW's step) stay."""
    return storage if location == "cpu" else storage.to(device=rank_device())


def _same(got, want, what, tol):
    if tol:
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what} differs"


def _assert_same(got, want, **tol):
    """Two _snapshot()s: equal (bit for bit), or close within `tol`; same dtypes and devices."""
    (params, state), (want_params, want_state) = got, want
    assert params.keys() == want_params.keys() and state.keys() == want_state.keys()
    for name in want_params:
        _same(params[name], want_params[name], name, tol)
        assert state[name].keys() == want_state[name].keys(), name
        for k, v in want_state[name].items():
            assert (state[name][k].dtype, state[name][k].device) == (v.dtype, v.device), (name, k)
            _same(state[name][k], v, f"{name} {k}", tol)


# --- resume: bit for bit at the same layout; TP 2 -> TP 4, per-layer degrees, TP 1 ----------------


def _run_tp2(rank, pair, path):
    """Ranks 0, 1: the uninterrupted TP 2 run, checkpointed at steps 2, 4, 6 (keep=2) and 5 (`after`)."""
    root = os.path.join(path, "run")
    model = _llama_tp(0, pair)
    opt = _adamw(model)
    _train(model, opt, [1, 2])
    where = oases.save_checkpoint(model, root, optimizer=opt, step=2, extra={"data": 2}, keep=2, group=pair)
    assert where == os.path.join(root, "step-000000002") and sorted(os.listdir(root)) == ["step-000000002"]
    marker = json.load(open(os.path.join(where, "oases_checkpoint.json")))
    assert (marker["format"], marker["world_size"], marker["step"]) == (1, 2, 2)
    stored = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
    q = stored["model.model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.size) == (64, 64) and len(q.chunks) == 2  # the unsharded tensor, a chunk per rank
    assert tuple(stored["optim.state.model.layers.0.self_attn.q_proj.weight.exp_avg"].size) == (64, 64)
    assert tuple(stored["optim.state.model.layers.0.self_attn.q_proj.weight.step"].size) == ()

    _train(model, opt, [3, 4])
    oases.save_checkpoint(model, root, optimizer=opt, step=4, extra={"data": 4}, keep=2, group=pair)
    torch.save(torch.rand(3), os.path.join(path, f"drawn{rank}.pt"))  # the RNG right after saving
    _train(model, opt, [5])
    oases.save_checkpoint(model, os.path.join(path, "after"), optimizer=opt, group=pair)  # step=None: right there
    _train(model, opt, [6])
    dist.barrier(group=pair)
    if rank == 0:  # a writer that died before publishing, and one that died before writing .metadata
        shutil.copytree(os.path.join(root, "step-000000004"), os.path.join(root, "step-000000009"))
        os.remove(os.path.join(root, "step-000000009", "oases_checkpoint.json"))
        os.makedirs(os.path.join(root, ".step-000000005.partial"))
    dist.barrier(group=pair)
    oases.save_checkpoint(model, root, optimizer=opt, step=6, keep=2, group=pair)
    # keep=2: step 2 and the stale partial go; the incomplete step-9 is not ours to delete.
    assert sorted(os.listdir(root)) == ["step-000000004", "step-000000006", "step-000000009"]
    torch.save(_snapshot(model, opt), os.path.join(path, f"want{rank}.pt"))


def _resume_tp2(rank, pair, path):
    """Ranks 2, 3: resume run/step-4 in a fresh model and optimizer, go on to step 6: what ranks 0, 1 have."""
    root = os.path.join(path, "run")
    want = torch.load(os.path.join(path, f"want{rank - 2}.pt"), map_location=_here)
    torch.manual_seed(123)
    model = _llama_tp(7, pair)
    opt = _adamw(model, lr=0.5)
    state = oases.load_checkpoint(model, os.path.join(root, "step-000000004"), optimizer=opt, group=pair)
    assert isinstance(state, oases.CheckpointState)
    assert (state.step, state.extra, state.missing_keys, state.unexpected_keys) == (4, {"data": 4}, [], [])
    assert state.path == os.path.join(root, "step-000000004")
    assert torch.equal(torch.rand(3), torch.load(os.path.join(path, f"drawn{rank - 2}.pt")))  # RNG restored
    assert opt.param_groups[0]["lr"] == 1e-2  # hyper-parameters are the checkpoint's
    _train(model, opt, range(state.extra["data"] + 1, 7))
    _assert_same(_snapshot(model, opt), want)

    # The root loads its newest complete step (the incomplete newer one is skipped, with a warning),
    # here into the trained optimizer: its own state tensors are read into, none is allocated.
    _train(model, opt, [7])
    held = {name: {k: v.data_ptr() for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:  # one warning for the group, on its rank 0
        warnings.simplefilter("always")
        state = oases.load_checkpoint(model, root, optimizer=opt, group=pair)
    skipped = [str(w.message) for w in caught if "skipped checkpoints" in str(w.message)]
    assert len(skipped) == (1 if rank == 2 else 0), skipped
    if rank == 2:
        assert re.search(
            r"do not verify: .*step-000000009 \(oases_checkpoint.json: missing: incomplete.*loading .*step-000000006",
            skipped[0],
        )
    assert (state.step, state.extra, state.path) == (6, None, os.path.join(root, "step-000000006"))
    _assert_same(_snapshot(model, opt), want)
    assert held == {name: {k: v.data_ptr() for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"step-000000009' is incomplete \(no oases_checkpoint.json"):
        oases.load_checkpoint(model, os.path.join(root, "step-000000009"), group=pair)


def _resharded(rank, world_size, solo, path):
    """Every rank: run/step-4 (TP 2) loaded at TP 4, per-layer degrees [4, 2] and TP 1, one step on."""
    source, after = os.path.join(path, "run", "step-000000004"), os.path.join(path, "after")

    def resumed(model, group=None):
        opt = _adamw(model, lr=0.5)
        with pytest.warns(UserWarning, match=r"saved by 2 ranks, this group has (4|1): RNG states not restored"):
            state = oases.load_checkpoint(model, source, optimizer=opt, group=group)
        assert state.step == 4
        _train(model, opt, [5])
        return model, opt

    def reference(model, group=None):  # the uninterrupted run at step 5, read at this layout
        opt = _adamw(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            oases.load_checkpoint(model, after, optimizer=opt, group=group)
        return model, opt

    # TP 4 over the world: each rank reads the overlaps of its quarter with the saved halves.
    _assert_same(_snapshot(*resumed(_llama_tp(5))), _snapshot(*reference(_llama_tp(6))), **TOL)

    # Per-layer degrees [4, 2]: layer 1's two replicas hold the same boxes, written once (DCP dedup).
    degrees = resumed(_llama_tp(5, tp_degrees=[4, 2]))
    _assert_same(_snapshot(*degrees), _snapshot(*reference(_llama_tp(6, tp_degrees=[4, 2]))), **TOL)
    mixed = oases.save_checkpoint(degrees[0], os.path.join(path, "mixed"), optimizer=degrees[1])
    stored = dcp.FileSystemReader(mixed).read_metadata().state_dict_metadata
    for layer, degree in ((0, 4), (1, 2)):
        for key in (
            f"model.model.layers.{layer}.mlp.up_proj.weight",
            f"optim.state.model.layers.{layer}.mlp.up_proj.weight.exp_avg_sq",
        ):
            assert len(stored[key].chunks) == degree, key  # one chunk per shard, not per rank

    # TP 1 in a group of one: the whole model on the rank, read from the halves (and from `mixed`).
    tp1 = resumed(_llama(4, 5).to(rank_device()), group=solo)
    _assert_same(_snapshot(*tp1), _snapshot(*reference(_llama(4, 6).to(rank_device()), group=solo)), **TOL)
    plain = _llama(4, 9).to(rank_device())
    oases.load_checkpoint(plain, mixed, group=solo)
    for (name, p), q in zip(plain.named_parameters(), tp1[0].parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")


def _check_resume(rank, world_size, path):
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    if rank < 2:
        _run_tp2(rank, pair, path)
    dist.barrier()
    if rank >= 2:
        _resume_tp2(rank, pair, path)
    _resharded(rank, world_size, solo, path)
    dist.barrier()
    return True


@needs_transformers
def test_resume_exact_at_tp2_and_resharded_at_tp4_per_layer_degrees_tp1(tmp_path):
    assert run_ranks(_check_resume, 4, str(tmp_path), timeout=120) == [True] * 4


# --- older checkpoints, no full model, bad input ---------------------------------------------------


def _toy_step(model, opt, seed):
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _no_full_model(*args, **kwargs):
    raise AssertionError("a rank gathered or held the full model")


def _forbid_full_model():
    """Every oases module's reference to full_state_dict / load_full_state_dict (the defining one, the
    package's re-exports, any module that imported them, under any name) replaced by _no_full_model."""
    import sys

    from oases.storage import unsharded

    originals = {id(unsharded.full_state_dict), id(unsharded.load_full_state_dict)}
    for module in list(sys.modules.values()):
        if module is not None and module.__name__.split(".")[0] == "oases":
            for name, value in list(vars(module).items()):  # (vars: no lazy import, no deprecation warning)
                if id(value) in originals:
                    setattr(module, name, _no_full_model)


def _check_old_and_sharded(rank, p, path):
    """Older checkpoints load; save and load work with full_state_dict / load_full_state_dict raising."""
    model = _parallelize(_toy(0).to(rank_device()), None, TOY_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _toy_step(model, opt, 1)
    full = oases.full_state_dict(model)

    # A checkpoint of older Oases: the unsharded state dict at the top level, no marker.
    old = os.path.join(path, "old")
    dcp.save(full, checkpoint_id=old)
    want = _parallelize(_toy(3).to(rank_device()), None, TOY_PLAN)
    oases.load_full_state_dict(want, full)  # each rank's shards, cut from the full tensors

    _forbid_full_model()
    loaded = _parallelize(_toy(3).to(rank_device()), None, TOY_PLAN)
    state = oases.load_checkpoint(loaded, old)
    assert (state.step, state.extra, state.path, state.missing_keys, state.unexpected_keys) == (None, None, old, [], [])
    for key, value in want.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(
        ValueError,
        match=r"optimizer: checkpoint '.*old' was written by an older "
        r"oases.save_checkpoint and holds no optimizer state",
    ):
        oases.load_checkpoint(loaded, old, optimizer=torch.optim.AdamW(loaded.parameters()))

    # Saving and loading with the optimizer, nobody holding the full model (gathering raises).
    where = oases.save_checkpoint(model, os.path.join(path, "new"), optimizer=opt)
    again = _parallelize(_toy(4).to(rank_device()), None, TOY_PLAN)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1.0)
    oases.load_checkpoint(again, where, optimizer=again_opt)
    for (name, a), b in zip(again.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
        for k, v in opt.state[b].items():
            assert torch.equal(again_opt.state[a][k], v), (name, k)

    # Saving again at the same path (step=None) replaces that checkpoint.
    _toy_step(model, opt, 2)
    assert oases.save_checkpoint(model, where, extra="second") == where
    assert sorted(os.listdir(path)) == ["new", "old"]
    assert oases.load_checkpoint(again, where).extra == "second"
    for (name, a), b in zip(again.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    dist.barrier()


def _check_bad_input(rank, p, path):
    """Each bad model, optimizer, directory or argument: the same error on every rank, nothing changed."""
    model = _parallelize(_toy(0).to(rank_device()), None, TOY_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _toy_step(model, opt, 1)
    plain = oases.save_checkpoint(model, os.path.join(path, "plain"))  # no optimizer
    root = os.path.join(path, "root")
    where = oases.save_checkpoint(model, root, optimizer=opt, step=1)
    target = _parallelize(_toy(5).to(rank_device()), None, TOY_PLAN)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in target.state_dict().items()}

    stranger = torch.optim.AdamW([*model.parameters(), torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(
        ValueError,
        match=r"optimizer: param_groups\[0\]\['params'\]\[6\] \(shape \(3,\)\) is not a "
        r"parameter of the model .* build the optimizer from model.parameters\(\)",
    ):
        oases.save_checkpoint(model, os.path.join(path, "x"), optimizer=stranger)
    with pytest.raises(ValueError, match=r"is not a parameter of the model"):
        oases.load_checkpoint(target, where, optimizer=stranger)
    with pytest.raises(
        TypeError,
        match=r"optimizer: expected a torch.optim.Optimizer or an oases.dp.ZeroOptimizer, "
        r"got dict",
    ):
        oases.load_checkpoint(target, where, optimizer={})
    with pytest.raises(
        ValueError,
        match=r"optimizer: checkpoint '.*plain' holds no optimizer state \(saved without "
        r"optimizer=\); load it with optimizer=None",
    ):
        oases.load_checkpoint(target, plain, optimizer=target_opt)
    two = torch.optim.AdamW([{"params": list(target.parameters())[:2]}, {"params": list(target.parameters())[2:]}])
    with pytest.raises(ValueError, match=r"optimizer: has 2 param_groups, checkpoint '.*step-000000001' has 1"):
        oases.load_checkpoint(target, root, optimizer=two)
    fewer = torch.optim.AdamW(list(target.parameters())[1:])
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\] does not hold the parameters .* missing "
        r"\['ffn.w1.weight'\], not in the checkpoint \[\]",
    ):
        oases.load_checkpoint(target, root, optimizer=fewer)

    # State that depends on the rank's shard without being a piece of the parameter's (Adafactor's
    # factored row_var [rows, 1] / col_var [1, cols] of a sharded weight): refused on save, and on
    # load where the checkpoint (written unsharded) holds it for a parameter this model shards.
    factored = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    _toy_step(model, factored, 2)
    with pytest.raises(
        ValueError,
        match=r"optimizer: Adafactor's state 'row_var' of ffn\.w1\.weight has shape \(32, 1\), not the shape of "
        r"the parameter \(\(32, 16\) on this rank, a part of it\).* use an optimizer whose state is elementwise",
    ):
        oases.save_checkpoint(model, os.path.join(path, "x"), optimizer=factored)
    whole = _toy(0).to(rank_device())
    whole_opt = torch.optim.Adafactor(whole.parameters(), lr=1e-2)
    _toy_step(whole, whole_opt, 2)
    unsharded = oases.save_checkpoint(whole, os.path.join(path, "adafactor"), optimizer=whole_opt)
    with pytest.raises(
        ValueError, match=r"optimizer: Adafactor's state 'row_var' of ffn\.w1\.weight has shape \(64, 1\)"
    ):
        oases.load_checkpoint(target, unsharded, optimizer=torch.optim.Adafactor(target.parameters()))
    alone = _toy(5).to(rank_device())  # where nothing is sharded, it loads
    oases.load_checkpoint(alone, unsharded, optimizer=torch.optim.Adafactor(alone.parameters()))

    # Wrong directories: none there, an empty root, a checkpoint its writer never published.
    with pytest.raises(FileNotFoundError, match=r"path: '.*nowhere' is not a directory"):
        oases.load_checkpoint(target, os.path.join(path, "nowhere"))
    os.makedirs(os.path.join(path, "empty", str(rank)))
    with pytest.raises(
        FileNotFoundError,
        match=r"path: no checkpoint in '.*empty/\d': looked for a DCP checkpoint "
        r"there \(a .metadata file\) and for complete step-NNNNNNNNN",
    ):
        oases.load_checkpoint(target, os.path.join(path, "empty", str(rank)))
    dist.barrier()
    if rank == 0:
        shutil.copytree(where, os.path.join(path, "died"))
        os.remove(os.path.join(path, "died", "oases_checkpoint.json"))
    dist.barrier()
    with pytest.raises(
        ValueError,
        match=r"path: checkpoint '.*died' is incomplete \(no oases_checkpoint.json: its "
        r"writer died before publishing it\)",
    ):
        oases.load_checkpoint(target, os.path.join(path, "died"))

    # Another model's checkpoint; keys on one side only.
    other = _parallelize(_toy(0, ffn=48).to(rank_device()), None, TOY_PLAN)
    wide = oases.save_checkpoint(other, os.path.join(path, "ffn48"), optimizer=torch.optim.AdamW(other.parameters()))
    with pytest.raises(
        ValueError,
        match=r"ffn48' does not fit the model; nothing was loaded:\n  ffn\.w1\.weight: "
        r"checkpoint has shape \(96, 16\), the model expects \(64, 16\)",
    ):
        oases.load_checkpoint(target, wide, optimizer=target_opt)
    target.register_buffer("more", torch.ones(2))
    with pytest.raises(ValueError, match=r"nothing was loaded:\n  missing keys: more$"):
        oases.load_checkpoint(target, where)
    del target.more
    head = target.head
    del target.head
    with pytest.raises(ValueError, match=r"nothing was loaded:\n  unexpected keys: head\.weight, head\.bias$"):
        oases.load_checkpoint(target, where)
    for key, value in target.state_dict().items():  # nothing changed
        assert torch.equal(value, before[key]), key
    state = oases.load_checkpoint(target, where, strict=False)
    assert (state.missing_keys, state.unexpected_keys) == ([], ["head.weight", "head.bias"])
    target.head = head

    # Bad arguments to save_checkpoint; a directory that is not a checkpoint is never replaced.
    with pytest.raises(TypeError, match=r"step: expected an int >= 0 or None, got True"):
        oases.save_checkpoint(model, root, step=True)
    with pytest.raises(ValueError, match=r"keep: must be >= 1, got 0"):
        oases.save_checkpoint(model, root, step=2, keep=0)
    with pytest.raises(ValueError, match=r"keep: rotation needs step="):
        oases.save_checkpoint(model, root, keep=2)
    with pytest.raises(TypeError, match=r"extra: cannot be pickled"):
        oases.save_checkpoint(model, root, step=2, extra=lambda: 0)
    with pytest.raises(ValueError, match=r"path: '.*root' is a non-empty directory that holds no checkpoint"):
        oases.save_checkpoint(model, root)
    assert sorted(os.listdir(root)) == ["step-000000001"]
    dist.barrier()  # nobody was left waiting in a collective
    return True


def _check_toy(rank, p, path):
    _check_old_and_sharded(rank, p, os.path.join(path, "old"))
    _check_bad_input(rank, p, os.path.join(path, "bad"))  # ends with a barrier: nobody was left waiting
    return True


@pytest.mark.parametrize("world_size", [2])
def test_old_checkpoints_no_full_model_and_bad_input_on_every_rank(world_size, tmp_path):
    assert run_ranks(_check_toy, world_size, str(tmp_path), timeout=120) == [True] * world_size
