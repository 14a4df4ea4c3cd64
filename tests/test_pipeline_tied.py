"""oases.pipeline.Pipeline with tied input/output embeddings (Hugging Face Llama, tie_word_embeddings=True).

The weight W shared by the embedding and the head has a copy on the first stage and one on the
last; after each step their gradients are summed over the pair of ranks holding them. Checked
against the same model trained in one process on the whole batch with the same optimizer:

    losses of every step, the final state (pipe.state_dict())           # fp32 tolerance
    the two copies of W, and AdamW's moments of them, after every step  # bit-identical
    W in exactly one segment optimizer of a stage holding it (pp = 1: segment 0's)
    checkpoint: save mid-run, a new pipeline (meta build) loads and continues   # bit-exact;
                W written once, by the first stage
    save_pretrained: transformers loads it tied, under the keys it writes itself; logits match
    load_pretrained of that export: both copies read it

at PP2 (1f1b, aiao over 2 segments, gpipe), pp = 1 over two segments (one copy in both), PP2 x DP2
(with the tied bucket's DP sync deferred to the next step), PP2 x TP2 (vocabulary-parallel shards
of W) and PP4 (middle stages hold no copy); real builds, and meta builds replaying the single-process
initialisation on each stage.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from oases.pipeline import Pipeline

from _spawn import harness_device, rank_device, run_ranks
from _tiny_llama import tiny_llama
from _tolerances import state_atol

pytest.importorskip("transformers")

SEED, STEPS, SAVED_AT, VOCAB, T = 5, 3, 1, 32, 8
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
TIED = "model.embed_tokens.weight"  # the tensor's first key; lm_head.weight is the same Parameter


def _model(meta=False):
    model = tiny_llama(tied=True, meta=meta)
    return model if meta else model.to(rank_device())


def _batches(batch):
    g = torch.Generator().manual_seed(batch)
    return [
        (torch.randint(0, VOCAB, (batch, T), generator=g), torch.randint(0, VOCAB, (batch, T), generator=g))
        for _ in range(STEPS)
    ]


def _golden(optimizer, batch):
    """(losses, state_dict, model) of the single-process model after STEPS steps on the whole batch."""
    torch.manual_seed(SEED)
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for tokens, targets in _batches(batch):
        opt.zero_grad()
        tokens, targets = tokens.to(rank_device()), targets.to(rank_device())
        loss = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict(), model


def _pipeline(mesh_shape, schedule, segments, m, optimizer, meta=False, **options):
    mesh = init_device_mesh(harness_device(), mesh_shape, mesh_dim_names=("dp", "pp", "tp"))
    return Pipeline(
        lambda: _model(meta),
        mesh,
        schedule=schedule,
        segments=segments,
        micro_batches=m,
        optimizer=OPTIMIZERS[optimizer],
        seed=SEED,
        **options,
    )


def _check_copies(pipe, where):
    """Both copies of W (this rank's shard of it) and their optimizer state are bit-identical, and
    W is trained by exactly one segment optimizer where a copy is held."""
    w = pipe.model.model.embed_tokens.weight
    assert pipe.model.lm_head.weight is w, where  # one Parameter serves both on every rank
    holder = pipe.layout.stage in (0, pipe.pp - 1)
    assert w.shape[0] == VOCAB // dist.get_world_size(pipe.tp_group), where  # TP: its vocabulary-parallel shard
    if holder and pipe.pp > 1 and pipe.dp > 1:  # its own DP bucket, the same on both stages
        assert len(pipe.sync.buckets) == pipe.segments + 1, where
        assert [[id(p) for p in b] for b in pipe.sync.buckets[-1]] == [[id(w)]], where
    owners = [k for k, opt in enumerate(pipe.optimizers) if any(p is w for g in opt.param_groups for p in g["params"])]
    assert owners == ([pipe.stage.tied_segment()] if holder else []), (where, owners)
    if pipe.pp == 1:
        assert owners == [0], where
        return
    state = pipe.optimizers[owners[0]].state.get(w, {}) if holder else {}
    mine = (w.detach().cpu().clone(), {k: v.cpu().clone() for k, v in state.items()}) if holder else None
    parts = [None] * pipe.pp
    dist.all_gather_object(parts, mine, group=pipe.pp_group)
    (first, first_state), (last, last_state) = parts[0], parts[-1]
    assert torch.equal(first, last), where
    assert first_state.keys() == last_state.keys(), where
    for key, value in first_state.items():
        assert torch.equal(value, last_state[key]), (where, key)


def _assert_state(state, want, where, *, exact=False, optimizer="sgd"):
    assert list(state) == list(want), where
    for key, value in state.items():
        if exact:
            assert torch.equal(value.cpu(), want[key].cpu()), (where, key)
        else:
            torch.testing.assert_close(
                value.cpu(),
                want[key].cpu(),
                rtol=1e-4,
                atol=state_atol(optimizer),
                msg=lambda msg: f"{where}: {key}: {msg}",
            )


def _resume(case, root, losses, final, where):
    """A new pipeline (built on meta, no init) loads the checkpoint of step SAVED_AT and continues
    bit-exactly; W was written by the first stage only."""
    mesh_shape, schedule, segments, m, optimizer, batch, options = case
    pipe = _pipeline(mesh_shape, schedule, segments, m, optimizer, meta=True, init_weights=False, **options)
    assert pipe.load_checkpoint(root).step == SAVED_AT, where
    _check_copies(pipe, where)
    for step in range(SAVED_AT, STEPS):
        assert torch.equal(pipe.train_step(*_batches(batch)[step]), losses[step]), (where, step)
        _check_copies(pipe, where)
    _assert_state(pipe.state_dict(), final, where, exact=True)
    pipe.close()
    from oases.storage import dcp as _dcp

    dp, pp, tp = mesh_shape
    first = {d * pp * tp + t for d in range(dp) for t in range(tp)}  # the first stage's global ranks
    written = {}  # key -> the ranks whose files hold its boxes
    for index, info in _dcp.read_metadata(os.path.join(root, f"step-{SAVED_AT:09d}")).storage_data.items():
        written.setdefault(index.fqn, set()).add(int(info.relative_path.split("_")[2]))  # __<rank>_<n>.distcp
    keys = [f"model.{TIED}", "model.lm_head.weight"] + ([f"optim.state.{TIED}.exp_avg"] if optimizer == "adamw" else [])
    for key in keys:
        assert written[key] <= first, (where, key, written[key])


def _train(rank, world_size, cases, tmp):
    for case in cases:
        mesh_shape, schedule, segments, m, optimizer, batch, options = case
        where = f"{mesh_shape} {schedule} ns={segments} m={m} {optimizer} B={batch} {options}"
        want_losses, want_state, golden = _golden(optimizer, batch)
        resume, export = options.pop("resume", False), options.pop("export", False)
        pipe = _pipeline(mesh_shape, schedule, segments, m, optimizer, **options)
        _check_copies(pipe, where)  # the same initial values on both
        losses = []
        for step, (tokens, targets) in enumerate(_batches(batch)):
            losses.append(pipe.train_step(tokens, targets))
            torch.testing.assert_close(
                losses[-1],
                want_losses[step],
                rtol=1e-5,
                atol=1e-5,
                msg=lambda msg: f"{where}: loss of step {step}: {msg}",
            )
            if resume and step + 1 == SAVED_AT:
                pipe.save_checkpoint(os.path.join(tmp, "ckpt"), step=SAVED_AT)
            _check_copies(pipe, where)  # (this step's update is still pending)
        final = pipe.state_dict()  # applies it
        _check_copies(pipe, where)
        _assert_state(final, want_state, where, optimizer=optimizer)
        if export:
            _export(pipe, golden, final, os.path.join(tmp, "out"), where)
        pipe.close()
        if resume:
            _resume(
                (mesh_shape, schedule, segments, m, optimizer, batch, options),
                os.path.join(tmp, "ckpt"),
                losses,
                final,
                where,
            )
        if export:
            _reload(mesh_shape, schedule, segments, m, optimizer, os.path.join(tmp, "out"), final, where)
        dist.barrier()
    return True


def _export(pipe, golden, final, out, where):
    """save_pretrained: transformers loads it tied, W stored once under the key it writes itself;
    the logits are the single-process model's."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    pipe.save_pretrained(out)
    if dist.get_rank() == 0:
        exported = LlamaForCausalLM.from_pretrained(out)
        assert exported.lm_head.weight is exported.model.embed_tokens.weight, where
        _assert_state(exported.state_dict(), final, where, exact=True)
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert TIED in keys and "lm_head.weight" not in keys, (where, sorted(keys))
        exported.to(rank_device())
        tokens = _batches(4)[0][0].to(rank_device())
        with torch.no_grad():
            torch.testing.assert_close(
                exported(input_ids=tokens).logits, golden(input_ids=tokens).logits, rtol=1e-4, atol=1e-4
            )
    dist.barrier()


def _reload(mesh_shape, schedule, segments, m, optimizer, out, final, where):
    """load_pretrained of the export into a meta build: both copies read W."""
    pipe = _pipeline(mesh_shape, schedule, segments, m, optimizer, meta=True, init_weights=False)
    pipe.load_pretrained(out)
    _check_copies(pipe, where)
    _assert_state(pipe.state_dict(), final, where, exact=True)
    pipe.close()


# mesh (dp, pp, tp), schedule, segments, micro_batches, optimizer, global batch, options
CASES_2 = [
    ((1, 2, 1), "aiao", 2, 2, "adamw", 4, dict(resume=True, export=True)),
    ((1, 2, 1), "1f1b", 1, 3, "sgd", 4, {}),
    ((1, 2, 1), "gpipe", 2, 2, "adamw", 4, dict(meta=True)),  # built on meta: both copies replay W's init
    ((2, 1, 1), "aiao", 2, 2, "adamw", 4, {}),  # pp = 1: one copy, in the first and last segment
]
CASES_4 = [
    ((2, 2, 1), "aiao", 2, 2, "adamw", 8, dict(dp_overlap_ratio=0.0, resume=True)),  # W's DP sync: next step
    ((1, 2, 2), "1f1b", 1, 2, "adamw", 4, dict(meta=True)),  # each stage: its vocabulary-parallel shard of W
    ((1, 4, 1), "1f1b", 1, 4, "sgd", 4, {}),  # stages 1 and 2 hold no copy
]


def test_tied_embeddings_match_single_process_pp2(tmp_path):
    assert run_ranks(_train, 2, CASES_2, str(tmp_path), timeout=180) == [True] * 2


def test_tied_embeddings_match_single_process_4_ranks(tmp_path):
    assert run_ranks(_train, 4, CASES_4, str(tmp_path), timeout=240) == [True] * 4
