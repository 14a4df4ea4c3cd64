"""Pipeline(zero=True): ZeRO-1 in the per-segment DP sync, against one process on the whole batch.

PP2 x DP2 on 4 ranks, the tiny GPT of test_pipeline, AdamW, schedules 1f1b and aiao (two segments,
small buckets so some are deferred, small pieces so the rings are chunked):

    losses and every parameter after 3 steps == the single-process run's      (fp32 tolerance)
    optimizer state per rank == AdamW's on this rank's rows: about half the plain pipeline's
    segment k+1's all-gather starts before segment k's forward and ends after it (the overlap)
    a checkpoint at step 2 loads into PP2 x DP2 without zero, and (2 ranks) into PP2 x DP1 with and
    without zero: the third step gives the single-process parameters again
    bad arguments (zero not a bool, zero with dp_hierarchy) raise on every rank
    a LambdaLR on each ZeRO optimizer (aiao, deferred updates): the single process's LambdaLR run
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from oases.dp import ShardedOptimizer
from oases.models import GPT, GPTConfig
from oases.pipeline import Pipeline, ZeroSegmentSync

from _spawn import harness_device, rank_device, run_ranks

CONFIG = dict(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2, layers=4)
STEPS, SEED, BATCH, SAVED_AT = 3, 7, 4, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _batches():
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["seq_len"]), generator=g),
            torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["seq_len"]), generator=g),
        )
        for _ in range(STEPS)
    ]


FACTOR = [1.0, 0.5, 0.1]  # an lr schedule that changes the lr every step


def _golden(scheduled=False):
    """(losses, state_dict) of the single-process GPT after STEPS AdamW steps on the whole batch;
    `scheduled`: a LambdaLR by FACTOR stepped after each."""
    alone, _ = dist.new_subgroups(group_size=1)
    model = GPT(GPTConfig(**CONFIG), alone, seed=SEED).to(rank_device())
    opt = _adamw(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: FACTOR[min(n, 2)]) if scheduled else None
    losses = []
    for tokens, targets in _batches():
        loss = model(tokens.to(rank_device()), targets.to(rank_device()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduled:
            scheduler.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


def _pipeline(dp, schedule, segments, zero, **options):
    mesh = init_device_mesh(harness_device(), (dp, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    return Pipeline(
        GPTConfig(**CONFIG),
        mesh,
        schedule=schedule,
        segments=segments,
        micro_batches=2,
        optimizer=_adamw,
        seed=SEED,
        zero=zero,
        **options,
    )


def _assert_state(state, want, where):
    assert list(state) == list(want), where
    for name, value in state.items():
        torch.testing.assert_close(value.cpu(), want[name].cpu(), **TOL, msg=lambda m: f"{where}: {name}: {m}")


def _state_bytes(pipe):
    """Bytes of optimizer state on this rank (AdamW's exp_avg, exp_avg_sq, step)."""
    return sum(
        v.numel() * v.element_size()
        for opt in pipe.optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _record_order(pipe, events):
    """Log ("F", k) at each forward of segment k and ("gather" | "gathered", k) at each all-gather's
    start and wait, to check where the all-gathers run."""
    forward, gather, wait = pipe.stage.forward_segment, pipe.sync.gather, pipe.sync.wait_gather

    def on_forward(k, *args, **kwargs):
        events.append(("F", k))
        return forward(k, *args, **kwargs)

    def on_gather(k):
        events.append(("gather", k))
        gather(k)

    def on_wait(k):
        wait(k)
        events.append(("gathered", k))

    pipe.stage.forward_segment, pipe.sync.gather, pipe.sync.wait_gather = on_forward, on_gather, on_wait


def _train(rank, world_size, root):
    want_losses, want = _golden()
    batches = _batches()
    measured = {}
    cases = [("1f1b", 1, {}), ("aiao", 2, dict(dp_overlap_ratio=0.5, dp_bucket_numel=400, dp_chunk_bytes=256))]
    for schedule, segments, options in cases:
        where = f"PP2 x DP2 zero {schedule} ns={segments} {options}"
        plain = _pipeline(2, schedule, segments, False, **options)  # pipelines on one mesh train one at a time
        for tokens, targets in batches:
            plain.train_step(tokens, targets)
        plain.state_dict()  # applies its last update
        plain_bytes = _state_bytes(plain)
        plain.close()
        pipe = _pipeline(2, schedule, segments, True, **options)
        assert isinstance(pipe.sync, ZeroSegmentSync) and all(isinstance(o, ShardedOptimizer) for o in pipe.optimizers)
        if options:  # some buckets really are deferred to the next step
            assert any(now < len(b) for now, b in zip(pipe.sync.now, pipe.sync.buckets)), where
        events = []
        _record_order(pipe, events)
        for step, (tokens, targets) in enumerate(batches):
            events.append(("step", step))
            loss = pipe.train_step(tokens, targets)
            torch.testing.assert_close(loss, want_losses[step], **TOL, msg=lambda m: f"{where}: loss {step}: {m}")
            if schedule == "aiao" and step == SAVED_AT - 1:  # at step 2, under the same pending updates
                pipe.save_checkpoint(root, step=SAVED_AT)
        assert pipe.scheduler.dp_chunks > 0 and pipe._update_pending == set(range(segments)), where
        _assert_state(pipe.state_dict(), want, where)
        # State: AdamW's on this rank's rows, exp_avg and exp_avg_sq of ceil(n/2) rows (or n - that) + step:
        # half the plain pipeline's, up to half a row per parameter.
        slots = [opt.slots[id(p)] for opt in pipe.optimizers for p in opt.params]
        zero_bytes = _state_bytes(pipe)
        assert zero_bytes == sum(8 * (s.stop - s.start) * s.k + 4 for s in slots), where
        assert zero_bytes == sum(o.state_bytes() for o in pipe.optimizers), where  # fp32: no master copies
        assert plain_bytes == sum(8 * s.n * s.k + 4 for s in slots), where
        assert abs(zero_bytes - plain_bytes / 2) <= sum(4 * s.k + 2 for s in slots), (where, zero_bytes, plain_bytes)
        measured[schedule] = (zero_bytes, plain_bytes)
        if schedule == "aiao":  # the second step applies the first's update: AG¹ runs under F⁰
            second = events[events.index(("step", 1)) : events.index(("step", 2))]
            first_f0, first_f1 = second.index(("F", 0)), second.index(("F", 1))
            assert second.index(("gather", 0)) < second.index(("gather", 1)) < second.index(("gathered", 0)), second
            assert second.index(("gathered", 0)) < first_f0 < second.index(("gathered", 1)) < first_f1, second
        pipe.close()

    # The checkpoint of step 2 (PP2 x DP2, zero) into a plain PP2 x DP2 pipeline: the third step.
    pipe = _pipeline(2, "aiao", 2, False)
    assert pipe.load_checkpoint(root).step == SAVED_AT
    pipe.train_step(*batches[SAVED_AT])
    _assert_state(pipe.state_dict(), want, "PP2 x DP2 zero checkpoint -> PP2 x DP2 plain")
    pipe.close()
    return measured


def _resume_dp1(rank, world_size, root):
    """The PP2 x DP2 zero checkpoint at PP2 x DP1, with and without zero; bad input."""
    _, want = _golden()
    for zero in (True, False):
        pipe = _pipeline(1, "1f1b", 1, zero)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # saved by 4 ranks: RNG states not restored
            assert pipe.load_checkpoint(root).step == SAVED_AT
        pipe.train_step(*_batches()[SAVED_AT])
        _assert_state(pipe.state_dict(), want, f"PP2 x DP2 zero checkpoint -> PP2 x DP1 zero={zero}")
        if zero:
            with pytest.raises(RuntimeError, match="sync_segment: with zero=True"):
                pipe.sync_segment(0)
        pipe.close()
    with pytest.raises(TypeError, match="zero: expected a bool"):
        _pipeline(1, "1f1b", 1, 1)
    with pytest.raises(ValueError, match="zero: .*dp_hierarchy=False"):
        _pipeline(1, "1f1b", 1, True, dp_hierarchy=True)
    dist.barrier()
    return True


def _lr_scheduled(rank, world_size):
    """A LambdaLR on each of the pipeline's ZeRO optimizers, stepped after each train_step (the
    loop a user writes): each deferred update uses its own step's lr, as the single process."""
    want_losses, want = _golden(scheduled=True)
    pipe = _pipeline(2, "aiao", 2, True, dp_overlap_ratio=0.5, dp_bucket_numel=400, dp_chunk_bytes=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "lr_scheduler.step() before optimizer.step()" (deferred)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda n: FACTOR[min(n, 2)]) for o in pipe.optimizers]
        for step, (tokens, targets) in enumerate(_batches()):
            loss = pipe.train_step(tokens, targets)
            torch.testing.assert_close(loss, want_losses[step], **TOL, msg=lambda m: f"loss {step}: {m}")
            for s in schedulers:
                s.step()
    _assert_state(pipe.state_dict(), want, "PP2 x DP2 zero aiao, LambdaLR")
    pipe.close()
    return True


def test_zero_pipeline_takes_torch_lr_schedulers_pp2_dp2():
    assert run_ranks(_lr_scheduled, 4, timeout=120) == [True] * 4


def test_zero_pipeline_pp2_dp2_matches_single_process_and_its_checkpoint_loads_at_dp1(tmp_path):
    root = str(tmp_path / "ckpt")
    measured = run_ranks(_train, 4, root, timeout=150)
    for schedule in ("1f1b", "aiao"):
        zero, plain = max(m[schedule][0] for m in measured), max(m[schedule][1] for m in measured)
        print(f"optimizer state per rank, {schedule}: zero {zero} B, plain {plain} B ({zero / plain:.3f})")
    assert run_ranks(_resume_dp1, 2, root, timeout=90) == [True, True]
