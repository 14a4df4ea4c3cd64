"""oases.pipeline trains exactly like the single-process GPT: every schedule, PP x DP x TP layouts.

Each rank function runs many cases to pay the process start-up once. The golden run is
`GPT(config, seed=seed)` on one process (no process group: computed inside each rank, which is
cheaper than shipping tensors to the ranks), trained on the same global batches with the same
optimizer; after 3 steps every parameter of `Pipeline.state_dict()` and every loss must match.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from oases.models import GPT, GPTConfig
from oases.pipeline import Pipeline, actions

from _spawn import harness_device, rank_device, run_ranks
from _tolerances import state_atol

CONFIG = dict(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2)
STEPS, SEED = 3, 7
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def _batches(batch):
    g = torch.Generator().manual_seed(batch)
    return [
        (
            torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g),
            torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["seq_len"]), generator=g),
        )
        for _ in range(STEPS)
    ]


def _golden(layers, optimizer, batch, alone):
    """(losses, state_dict) of the single-process GPT after STEPS steps (`alone`: a group of one)."""
    model = GPT(GPTConfig(**CONFIG, layers=layers), alone, seed=SEED).to(rank_device())
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for tokens, targets in _batches(batch):
        opt.zero_grad()
        loss = model(tokens.to(rank_device()), targets.to(rank_device()))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


# (dp, pp, tp), layers, schedule, segments, micro_batches, optimizer, global batch
CASES_2 = [
    ((1, 2, 1), 4, "gpipe", 1, 3, "sgd", 4),  # m not divisible by pp; micro-batches of 2, 1, 1 rows
    ((1, 2, 1), 4, "1f1b", 1, 3, "adamw", 4),
    ((1, 2, 1), 4, "aiao", 2, 3, "sgd", 4),
]
CASES_4 = [
    ((1, 4, 1), 4, "gpipe", 1, 4, "adamw", 4),
    ((1, 4, 1), 4, "1f1b", 1, 5, "sgd", 6),
    ((1, 4, 1), 4, "aiao", 1, 4, "sgd", 4),
    ((2, 2, 1), 4, "gpipe", 1, 2, "sgd", 6),
    ((2, 2, 1), 4, "1f1b", 1, 3, "adamw", 6),  # each DP rank: 3 rows, 3 micro-batches
    ((2, 2, 1), 4, "aiao", 2, 3, "sgd", 8),  # 4 rows -> micro-batches of 2, 1, 1
    ((2, 2, 1), 4, "aiao", 1, 2, "adamw", 4),
    ((1, 2, 2), 4, "gpipe", 1, 2, "adamw", 4),
    ((1, 2, 2), 4, "1f1b", 1, 3, "sgd", 4),
    ((1, 2, 2), 4, "aiao", 2, 3, "adamw", 3),
    ((1, 2, 2), 6, "aiao", 3, 2, "sgd", 4),  # 6 layers: 3 segments of 2 stages of 1 layer
    ((1, 2, 2), 4, "gpipe", 2, 2, "sgd", 4),  # gpipe over 2 segments: micro-batch-major
    ((2, 1, 2), 4, "aiao", 2, 2, "adamw", 4),  # pp = 1: segments chained in memory
]
CASES_8 = [
    ((2, 2, 2), 4, "1f1b", 1, 3, "sgd", 6),
    ((2, 2, 2), 4, "aiao", 2, 2, "adamw", 4),
]


def _assert_state(state, want_state, where, *, rtol, optimizer):
    """The pipeline's full state dict: the single-process model's keys, in order, and values
    (within tests/_tolerances.py's bound for `optimizer`)."""
    assert list(state) == list(want_state), where
    for name, value in state.items():
        torch.testing.assert_close(
            value.cpu(),
            want_state[name].cpu(),
            rtol=rtol,
            atol=state_atol(optimizer),
            msg=lambda msg: f"{where}: {name}: {msg}",
        )


def _train_cases(rank, world_size, cases):
    alone, _ = dist.new_subgroups(group_size=1)  # this rank by itself: the unsharded GPT
    for (dp, pp, tp), layers, schedule, segments, m, optimizer, batch, *options in cases:
        options = options[0] if options else {}
        want_losses, want_state = _golden(layers, optimizer, batch, alone)
        where = (
            f"dp={dp} pp={pp} tp={tp} layers={layers} {schedule} ns={segments} m={m} {optimizer} B={batch} {options}"
        )
        mesh = init_device_mesh(harness_device(), (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        pipe = Pipeline(
            GPTConfig(**CONFIG, layers=layers),
            mesh,
            schedule=schedule,
            segments=segments,
            micro_batches=m,
            optimizer=OPTIMIZERS[optimizer],
            seed=SEED,
            **{k: v for k, v in options.items() if k != "probe"},
        )
        if options.get("dp_overlap_ratio", 1.0) in (0.0, 0.5):  # some buckets really are deferred
            assert any(now < len(b) for now, b in zip(pipe.sync.now, pipe.sync.buckets)), where
        for step, (tokens, targets) in enumerate(_batches(batch)):
            loss = pipe.train_step(tokens, targets)
            torch.testing.assert_close(
                loss, want_losses[step], rtol=1e-5, atol=1e-5, msg=lambda msg: f"{where}: loss of step {step}: {msg}"
            )
            if options.get("probe") == step:  # applies the pending updates mid-run: never twice
                pipe.state_dict()
        if dp > 1 and options.get("probe") is None:  # the last step's updates wait for state_dict()
            assert pipe._update_pending == set(range(pipe.segments)), where
        if "auto" in (segments, options.get("dp_overlap_ratio")):  # chosen by FOLD3D's rules from measured times
            from oases.planner.fold3d import choose_segments, dp_overlap_ratio

            t = pipe.measured
            assert t["forward_s"] > 0 and t["backward_s"] > 0 and t["pp_comm_s"] > 0 and t["dp_comm_s"] > 0, t
            want = (
                segments
                if segments != "auto"
                else choose_segments(
                    layers, pp, t["forward_s"], t["backward_s"], t["pp_comm_s"], t["dp_comm_s"], micro_batches=m
                )
            )
            assert pipe.segments == want and layers % (pp * want) == 0, (where, t, pipe.segments)
            if options.get("dp_overlap_ratio") == "auto":
                assert pipe.dp_overlap_ratio == dp_overlap_ratio(
                    t["forward_s"], t["backward_s"], t["dp_comm_s"], segments=want, micro_batches=m
                ), where
        sched = pipe.scheduler  # (the preemption invariant itself: test_pp_transfer_preempts_dp_chunks)
        if dp > 1:
            assert sched.dp_chunks > 0, where
        lazy = pp > 1 and pipe.segments > 1 and pipe.layout.stage == 0  # segment k -> k+1 activations
        if lazy and schedule == "aiao":  # every one, into one slab sized for a step and kept across steps
            assert pipe.comm.lazy_receives == STEPS * m * (pipe.segments - 1), where
            each = sum(-(-s.numel() * 4 // 256) * 256 for s in pipe._executor.split(*_batches(batch)[0]).shapes)
            assert pipe.comm.slab.capacity == each * (pipe.segments - 1) and pipe.comm.slab.in_use == 0, where
        elif lazy:  # gpipe: only those that are their link's next receive (send order)
            assert 0 < pipe.comm.lazy_receives <= STEPS * m * (pipe.segments - 1), where
        else:
            assert pipe.comm.lazy_receives == 0 and pipe.comm.slab is None, where
        if pp > 1:  # other stages' layers are freed on this rank
            assert pipe.freed_bytes > 0 and any(p.numel() == 0 for p in pipe.model.parameters()), where
        with pytest.warns(DeprecationWarning, match="Pipeline.actions"):  # the old name of the actions
            assert pipe.plan is pipe.actions and all(a.kind in ("F", "B") for a in pipe.actions), where
        held = set(pipe.stage.state_dict())  # this stage's part of the model only
        assert held < set(want_state) if pp > 1 else held == set(want_state), where
        _assert_state(pipe.state_dict(), want_state, where, rtol=1e-5, optimizer=optimizer)
        pipe.close()
    return True


# Per-segment asynchronous DP sync: small buckets so a segment has several (some deferred at r < 1).
DP_ASYNC_4 = [
    ((2, 2, 1), 4, "aiao", 1, 2, "sgd", 4, dict(dp_overlap_ratio=0.5, dp_bucket_numel=800)),
    ((2, 2, 1), 4, "aiao", 2, 3, "adamw", 6, dict(dp_overlap_ratio=0.5, dp_bucket_numel=800, probe=0)),
    ((2, 2, 1), 4, "aiao", 2, 2, "sgd", 4, dict(dp_overlap_ratio=1.0, preemption=False)),
    ((2, 2, 1), 6, "aiao", 3, 2, "adamw", 4, dict(dp_overlap_ratio=1.0, dp_bucket_numel=800)),
    ((2, 2, 1), 6, "aiao", 3, 3, "sgd", 6, dict(dp_overlap_ratio=0.5, dp_bucket_numel=800, preemption=False)),
    ((2, 2, 1), 4, "1f1b", 1, 2, "adamw", 4, dict(dp_overlap_ratio=0.5, dp_bucket_numel=800)),
    ((2, 2, 1), 4, "1f1b", 1, 3, "sgd", 6, dict(dp_overlap_ratio=0.0, dp_bucket_numel=800, preemption=False)),
    ((2, 2, 1), 8, "aiao", "auto", 2, "adamw", 4, dict(dp_overlap_ratio="auto", dp_bucket_numel=800)),
    ((2, 2, 1), 4, "aiao", 2, 2, "sgd", 4, dict(dp_chunk_bytes=256)),  # many small preemptible pieces
]
DP_ASYNC_8 = [
    ((2, 2, 2), 6, "aiao", 3, 2, "adamw", 4, dict(dp_overlap_ratio=0.5, dp_bucket_numel=400)),
    ((2, 2, 2), 4, "aiao", 2, 3, "sgd", 6, dict(dp_overlap_ratio=1.0, preemption=False)),
    ((2, 2, 2), 4, "1f1b", 1, 2, "adamw", 4, dict(dp_overlap_ratio=0.5, dp_bucket_numel=400, probe=1)),
]


def test_pp2_matches_single_process_2_ranks():
    run_ranks(_train_cases, 2, CASES_2, timeout=60)


def test_every_schedule_and_layout_matches_single_process_4_ranks():
    run_ranks(_train_cases, 4, CASES_4, timeout=120)


def test_dp2_pp2_tp2_matches_single_process_8_ranks():
    run_ranks(_train_cases, 8, CASES_8, timeout=120)


def test_async_dp_sync_matches_single_process_pp2_dp2():
    run_ranks(_train_cases, 4, DP_ASYNC_4, timeout=120)


def test_async_dp_sync_matches_single_process_pp2_dp2_tp2():
    run_ranks(_train_cases, 8, DP_ASYNC_8, timeout=120)


# Hugging Face models through a factory (the adapters of oases.train_step), against the same model
# made the same way in one process, with the pipeline's loss (mean token cross-entropy, targets as given).
HF_SMALL = dict(
    hidden_size=32,
    num_hidden_layers=4,
    intermediate_size=64,
    vocab_size=CONFIG["vocab_size"],
    max_position_embeddings=16,
    tie_word_embeddings=False,
    attn_implementation="eager",
    num_attention_heads=4,
)


def _hf(kind):
    import transformers as tf

    if kind == "llama":  # GQA
        return tf.LlamaForCausalLM(tf.LlamaConfig(**HF_SMALL, num_key_value_heads=2))
    if kind == "llama-tied":  # input and output embeddings share one parameter
        return tf.LlamaForCausalLM(tf.LlamaConfig(**dict(HF_SMALL, tie_word_embeddings=True), num_key_value_heads=2))
    if kind == "llama-frozen":  # frozen parameters: never stepped (AdamW's weight decay would move them)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**HF_SMALL, num_key_value_heads=2))
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[0].input_layernorm.weight.requires_grad_(False)
        return model
    if kind == "qwen3":  # per-head q/k norms (their gradient is summed over TP)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**HF_SMALL, num_key_value_heads=2, head_dim=8))
    if kind == "neox":  # parallel residual: one sublayer per layer
        return tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(**HF_SMALL, hidden_dropout=0.0, attention_dropout=0.0, use_parallel_residual=True)
        )
    raise AssertionError(kind)


def _hf_golden(kind, optimizer, batch, device):
    torch.manual_seed(SEED)
    model = _hf(kind).to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for tokens, targets in _batches(batch):
        opt.zero_grad()
        logits = model(input_ids=tokens.to(device)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.to(device).flatten())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


def _train_hf_cases(rank, world_size, cases, device=None):
    device = device or harness_device()  # a device type: the mesh's, and where the models go
    for kind, (dp, pp, tp), schedule, segments, m, optimizer, batch, *options in cases:
        options = options[0] if options else {}
        where = f"{kind} dp={dp} pp={pp} tp={tp} {schedule} ns={segments} m={m} {optimizer} B={batch} {options}"
        want_losses, want_state = _hf_golden(kind, optimizer, batch, device)  # on the pipeline's device
        mesh = init_device_mesh(device, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        pipe = Pipeline(
            lambda: _hf(kind).to(device),
            mesh,
            schedule=schedule,
            segments=segments,
            micro_batches=m,
            optimizer=OPTIMIZERS[optimizer],
            seed=SEED,
            **options,
        )
        for step, (tokens, targets) in enumerate(_batches(batch)):
            loss = pipe.train_step(tokens, targets)
            torch.testing.assert_close(
                loss.cpu(),
                want_losses[step].cpu(),
                rtol=1e-5,
                atol=1e-5,
                msg=lambda msg: f"{where}: loss of step {step}: {msg}",
            )
        _assert_state(pipe.state_dict(), want_state, where, rtol=1e-4, optimizer=optimizer)
        pipe.close()
    return True


HF_CASES_2 = [
    ("llama", (1, 2, 1), "aiao", 2, 3, "sgd", 4),
    ("llama-tied", (2, 1, 1), "aiao", "auto", 2, "adamw", 4),  # pp = 1 (pp > 1: tests/test_pipeline_tied.py)
]
HF_CASES_4 = [
    ("llama", (1, 2, 2), "1f1b", 1, 3, "adamw", 4),
    ("qwen3", (2, 2, 1), "aiao", 2, 2, "sgd", 4),
    ("neox", (1, 2, 2), "gpipe", 1, 2, "sgd", 4),
    ("llama-frozen", (2, 2, 1), "aiao", 2, 2, "adamw", 4),  # frozen: unchanged; DP sums the others
    ("llama-frozen", (1, 2, 2), "aiao", 2, 2, "sgd", 4, dict(offload=True)),  # frozen embedding, offloaded layers
]


def test_hf_model_factory_matches_single_process_pp2():
    pytest.importorskip("transformers")
    run_ranks(_train_hf_cases, 2, HF_CASES_2, timeout=90)


def test_hf_model_factory_matches_single_process_4_ranks():
    pytest.importorskip("transformers")
    run_ranks(_train_hf_cases, 4, HF_CASES_4, timeout=150)


@pytest.mark.skipif(harness_device() != "cuda", reason="needs the harness on CUDA (OASES_TEST_DEVICE=cuda)")
def test_hf_model_factory_on_cuda_matches_single_process_pp2():
    """The GPU path: NCCL links (send order), the DP thread's stream, lazy receives through the
    slab, CUDA transfers polled by the scheduler. Not run here (no GPU); on one GPU the two ranks
    share it (tests/_spawn.py), `make gpu-check` / `gpu-check-local` run it."""
    pytest.importorskip("transformers")
    cases = [("llama", (1, 2, 1), "aiao", 2, 3, "sgd", 4), ("llama", (1, 2, 1), "1f1b", 1, 3, "adamw", 4)]
    run_ranks(_train_hf_cases, 2, cases, "cuda", timeout=180)


def _preemption(rank, world_size):
    """Two ranks, two groups over them ("pp" and "dp"). Rank 0 has a PP receive in flight when its
    DP all-reduce starts; rank 1 sends that message only after a pause, so with preemption rank 0's
    first DP chunk must wait for the receive, and without it must go while the receive flies."""
    from oases.pipeline.comm_scheduler import CommScheduler

    pp_group, dp_group = dist.new_group([0, 1]), dist.new_group([0, 1])
    results = {}
    for preemption in (True, False):
        sched = CommScheduler(preemption=preemption, hold_timeout=60.0)
        flat = torch.arange(12, dtype=torch.float32, device=rank_device()) * (rank + 1)
        message = torch.full((4,), 7.0, device=rank_device()) if rank == 1 else torch.zeros(4, device=rank_device())
        if rank == 0:
            recv = sched.track(dist.irecv(message, 1, group=pp_group, tag=16), "recv", 1)
        synced = sched.submit(lambda: sched.all_reduce(flat, dp_group, chunks=2))
        if rank == 1:
            time.sleep(0.3)  # rank 0's DP thread reaches its gate meanwhile (with the receive in flight)
            sched.track(dist.isend(message, 0, group=pp_group, tag=16), "send", 0).wait()
        else:
            recv.wait()
        synced.result()
        torch.testing.assert_close(flat.cpu(), torch.arange(12, dtype=torch.float32) * 3)  # summed over both
        torch.testing.assert_close(message.cpu(), torch.full((4,), 7.0))
        results[preemption] = (
            sched.deferred_chunks,
            sched.overlapped_chunks,
            sched.forced_chunks,
            sched.dp_chunks,
            sorted(sched.pp_latency["recv"] + sched.pp_latency["send"]),
        )
        sched.close()
    return results


def test_pp_transfer_preempts_dp_chunks():
    results = run_ranks(_preemption, 2, timeout=60)
    on, off = results[0][True], results[0][False]
    deferred, overlapped, forced, chunks, latency = on
    assert deferred == 1 and overlapped == 0 and forced == 0 and chunks > 1  # held once, then free
    assert latency[0] >= 0.25  # the receive flew for rank 1's pause
    deferred, overlapped, forced, chunks, latency = off
    assert deferred == 0 and overlapped >= 1 and forced == 0  # its first chunk went beside the receive


def _loss_sum_order(rank, world_size):
    """PP2 x DP2: on the last stage, the loss's all-reduce over dp is issued before any DP sync is
    launched (else it queues behind their chunks on the same links); every rank returns it."""
    import oases.pipeline._execute as execute

    events = []

    class _Recording:  # torch.distributed as _execute sees it, its all_reduce recorded
        def __getattr__(self, name):
            return getattr(dist, name)

        def all_reduce(self, *args, **kwargs):
            events.append("loss_sum")
            return dist.all_reduce(*args, **kwargs)

    alone, _ = dist.new_subgroups(group_size=1)
    want = _golden(4, "sgd", 8, alone)[0][0]  # the single-process loss of the first batch
    execute.dist = _Recording()
    mesh = init_device_mesh(harness_device(), (2, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    got = {}
    try:
        for schedule, segments in (("1f1b", 1), ("aiao", 2)):
            pipe = Pipeline(
                GPTConfig(**CONFIG, layers=4),
                mesh,
                schedule=schedule,
                segments=segments,
                optimizer=OPTIMIZERS["sgd"],
                seed=SEED,
            )
            launch = pipe.sync.launch
            pipe.sync.launch = lambda segment: (events.append("launch"), launch(segment))[1]
            tokens, targets = _batches(8)[0]
            events.clear()
            loss = pipe.train_step(tokens, targets)
            pipe.close()
            got[schedule] = (list(events), float(loss))
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)  # the sum over dp, every stage
    finally:
        execute.dist = dist
    return got


def test_loss_sum_goes_before_the_dp_syncs():
    results = run_ranks(_loss_sum_order, 4, timeout=60)
    for schedule in ("1f1b", "aiao"):
        losses = {results[r][schedule][1] for r in range(4)}
        assert len(losses) == 1, (schedule, losses)  # the same loss on every rank
        for rank in range(4):
            events = results[rank][schedule][0]
            assert "launch" in events, (schedule, rank, events)
            if rank % 2 == 1:  # the last stage (rank = d * pp + s): its loss sum first, once
                assert events.count("loss_sum") == 1 and events[0] == "loss_sum", (schedule, rank, events)
            else:
                assert "loss_sum" not in events, (schedule, rank, events)


def _bad_configurations(rank, world_size):
    config = GPTConfig(**CONFIG, layers=4)
    mesh = init_device_mesh(harness_device(), (2, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    bad = [
        (dict(config=GPTConfig(**CONFIG, layers=3)), "config.layers"),  # 3 % (pp=2)
        (dict(segments=3, schedule="aiao"), "config.layers"),  # 4 % (2 * 3)
        (dict(schedule="interleaved"), "schedule"),
        (dict(schedule="1f1b", segments=2), "segments"),
        (dict(schedule="1f1b", micro_batches=1), "micro_batches"),
        (dict(segments="many"), "segments"),
        (dict(dp_overlap_ratio="fast"), "dp_overlap_ratio"),
        (dict(dp_overlap_ratio=1.5), "dp_overlap_ratio"),
        (dict(dp_bucket_numel=0), "dp_bucket_numel"),
        (dict(dp_chunk_bytes=0), "dp_chunk_bytes"),
        (dict(mesh=init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))), "world size"),
        (dict(mesh=init_device_mesh(harness_device(), (2, 2), mesh_dim_names=("dp", "pp"))), "mesh"),
        (dict(config=3), "config: expected an oases.models.GPTConfig or a model factory"),
        (dict(config=lambda: 3), "the factory returned int"),
    ]
    import transformers as tf

    def layers_tied():  # a weight shared by layers 0 and 3 (stages 0 and 1); tied embeddings are supported
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**HF_SMALL))
        model.model.layers[3].input_layernorm.weight = model.model.layers[0].input_layernorm.weight
        return model.to(rank_device())

    def three_layers():
        return tf.LlamaForCausalLM(tf.LlamaConfig(**dict(HF_SMALL, num_hidden_layers=3))).to(rank_device())

    bad += [
        (dict(config=layers_tied), "model.layers.0.input_layernorm.weight is used in more than one place"),
        (dict(config=three_layers), "model: 3 layers are not divisible by pp"),
    ]
    for change, match in bad:
        kwargs = dict(config=config, mesh=mesh, schedule="gpipe", segments=1, micro_batches=2) | change
        with pytest.raises(ValueError, match=match):
            Pipeline(kwargs.pop("config"), kwargs.pop("mesh"), **kwargs)
    pipe = Pipeline(config, mesh, schedule="1f1b", micro_batches=2)
    tokens, targets = _batches(3)[0]
    with pytest.raises(ValueError, match="dp = 2"):  # 3 rows over 2 DP ranks
        pipe.train_step(tokens, targets)
    tokens, targets = _batches(2)[0]
    with pytest.raises(ValueError, match="micro_batches"):  # 1 row per DP rank, 2 micro-batches
        pipe.train_step(tokens, targets)
    with pytest.raises(ValueError, match="targets"):
        pipe.train_step(tokens, targets[:, :-1])
    tokens, targets = _batches(4)[0]
    with pytest.raises(ValueError, match="targets: expected int64"):  # would raise on the last stage only
        pipe.train_step(tokens, targets.float())
    with pytest.raises(ValueError, match=r"targets: values must lie in \[0, vocab_size"):
        pipe.train_step(tokens, targets + config.vocab_size)
    with pytest.raises(ValueError, match=r"tokens: values must lie"):  # would raise on the first stage only
        pipe.train_step(tokens - config.vocab_size, targets)
    with pytest.raises(ValueError, match="positions"):
        pipe.train_step(tokens[:, :0], targets[:, :0])
    dist.barrier()  # no rank was left inside a collective
    return True


def test_bad_configurations_raise_on_every_rank():
    assert run_ranks(_bad_configurations, 4, timeout=60) == [True] * 4


def test_dp_chunks_bound_the_bytes_a_ring_piece_moves():
    from oases.pipeline.dp_sync import chunks_for

    assert chunks_for(1000, 4, 2, 1 << 18) == 1  # small bucket: one piece per block
    assert chunks_for(4 << 20, 4, 2, 1 << 20) == 8  # 8 MiB block, 1 MiB pieces
    assert chunks_for(4 << 20, 4, 2, 3 << 20) == 3  # rounded up: pieces <= 3 MiB
    assert chunks_for(10, 2, 4, 1) == 3  # never more pieces than the block's 3 elements


def test_stage_layout_folds_segments():
    from oases.pipeline import StageLayout

    # FOLD3D §3.2: 12 layers, ns = 2, p = 3 -> stage 0 holds (0, 1) and (6, 7)
    held = [[list(StageLayout(12, 3, 2, s).layers_of(k)) for k in range(2)] for s in range(3)]
    assert held == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert StageLayout(12, 3, 2, 0).is_first(0) and not StageLayout(12, 3, 2, 0).is_first(1)
    assert StageLayout(12, 3, 2, 2).is_last(1) and not StageLayout(12, 3, 2, 2).is_last(0)


@pytest.mark.parametrize("schedule,segments", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("aiao", 1), ("aiao", 3)])
@pytest.mark.parametrize("stages,micro_batches", [(2, 3), (4, 4), (4, 7)])
def test_schedules_run_every_action_once_forward_first(schedule, segments, stages, micro_batches):
    for stage in range(stages):
        plan = actions(schedule, stage=stage, stages=stages, segments=segments, micro_batches=micro_batches)
        everything = {(kind, k, i) for kind in "FB" for k in range(segments) for i in range(micro_batches)}
        assert sorted(plan) == sorted(everything) and len(plan) == len(everything)
        for a in plan:  # a backward comes after its forward and after the later segment's backward
            assert plan.index(("F", a.segment, a.micro_batch)) <= plan.index(a)
            if a.kind == "B" and a.segment + 1 < segments:
                assert plan.index(("B", a.segment + 1, a.micro_batch)) < plan.index(a)


def test_one_f_one_b_is_megatrons_order():
    def names(stage):
        return " ".join(
            f"{a.kind}{a.micro_batch}" for a in actions("1f1b", stage=stage, stages=2, segments=1, micro_batches=3)
        )

    assert names(0) == "F0 F1 B0 F2 B1 B2"
    assert names(1) == "F0 B0 F1 B1 F2 B2"


class _NoLinks:
    """Links without groups: StageComm.expect and post order checks need only the ranks."""

    def __init__(self, stages):
        self.ranks, self.groups = tuple(range(stages)), {}


@pytest.mark.parametrize("schedule,segments", [("gpipe", 1), ("gpipe", 3), ("1f1b", 1), ("aiao", 1), ("aiao", 3)])
@pytest.mark.parametrize("stages,micro_batches", [(2, 3), (3, 4), (4, 7)])
def test_each_link_delivers_in_the_order_its_receiver_uses(schedule, segments, stages, micro_batches):
    """Links match messages by order (as NCCL does): for every stage and link, the keys the
    neighbour sends, in its order, are the keys this stage's actions wait for, in their order."""
    from oases.pipeline.comm_scheduler import CommScheduler
    from oases.pipeline.p2p import StageComm, link_of

    last = stages * segments - 1
    for stage in range(stages):
        comm = StageComm(_NoLinks(stages), stage, stages, CommScheduler())
        comm.expect(schedule, segments, micro_batches)
        used: dict = {}
        for a in actions(schedule, stage=stage, stages=stages, segments=segments, micro_batches=micro_batches):
            v = a.segment * stages + stage
            key = (
                ("act", v - 1, a.micro_batch)
                if a.kind == "F" and v > 0
                else ("grad", v, a.micro_batch)
                if a.kind == "B" and v < last
                else None
            )
            if key is not None:
                used.setdefault(link_of(key, stages)[0], []).append(key)
        assert {name: lane.keys for name, lane in comm._lanes.items()} == used, (stage, used)
        assert sum(map(len, used.values())) == 2 * micro_batches * segments - micro_batches * (
            (stage == 0) + (stage == stages - 1)
        )  # every F/B waits for one, but on the chain's two ends


@pytest.mark.parametrize("stages", [2, 3, 4, 6])
def test_links_connect_without_a_cycle(stages):
    """NCCL blocks both ends of a pair at its first message: replay the connecting messages with
    that rendezvous rule (a message goes once both ends have reached it) and every stage ends."""
    from oases.pipeline.p2p import LINKS, _connect_order

    order = _connect_order(stages)
    todo = {s: [m for m in order if s in m[1:]] for s in range(stages)}  # each stage's messages, in order
    while any(todo.values()):
        ready = [m for m in order if all(todo[end] and todo[end][0] == m for end in m[1:])]
        assert ready, f"cycle: every stage blocks at {[t[0] if t else None for t in todo.values()]}"
        for m in ready:
            for end in m[1:]:
                todo[end].pop(0)
    pairs = {(name, src, dst) for name, src, dst in order}  # every pair that carries messages, once
    assert len(pairs) == len(order) == 2 * (stages - 1) + 2 and {m[0] for m in order} == set(LINKS)


def _link_order(rank, world_size):
    """Over a link, a receive takes the next message sent (not the one with its key): posting out
    of the send order raises before anything is received; in order, each buffer gets its key's data."""
    from oases.pipeline.comm_scheduler import CommScheduler
    from oases.pipeline.p2p import StageComm

    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    from oases.pipeline.p2p import make_links

    comm = StageComm(make_links(mesh, rank_device()), rank, 2, CommScheduler(), rank_device())
    comm.expect("gpipe", 1, 3)
    shape = torch.Size((2, 3))
    if rank == 0:  # stage 0 sends activations of micro-batches 0, 1, 2 and receives their gradients
        for i in range(3):
            comm.send(("act", 0, i), torch.full(shape, float(i), device=rank_device()))
        with pytest.raises(RuntimeError, match="out of send order"):
            comm.post_recv(("grad", 0, 1), shape)
        got = [comm.recv(("grad", 0, i), shape) for i in range(3)]
    else:
        comm.post_recv(("act", 0, 0), shape)
        with pytest.raises(RuntimeError, match="out of send order"):
            comm.post_recv(("act", 0, 2), shape)
        got = [comm.recv(("act", 0, i), shape) for i in range(3)]
        for i in range(3):
            comm.send(("grad", 0, i), torch.full(shape, 10.0 + i, device=rank_device()))
    comm.wait_sends()
    comm.scheduler.close()
    return [float(t[0, 0]) for t in got]


def test_link_receives_are_matched_in_send_order():
    got = run_ranks(_link_order, 2, timeout=60)
    assert got == [[10.0, 11.0, 12.0], [0.0, 1.0, 2.0]]


def _backend_check(rank, world_size):
    from oases.pipeline.pipeline import _check_backend

    _check_backend(dist.group.WORLD, rank_device())  # gloo carries CPU tensors, NCCL CUDA ones
    other, need = ("cuda", "nccl") if rank_device().type == "cpu" else ("cpu", "gloo")
    with pytest.raises(ValueError, match=f"{other} tensors need '{need}'"):
        _check_backend(dist.group.WORLD, torch.device(other))
    return True


def _failed_step(rank, world_size):
    """A step that raises mid-way leaves receives posted on links that match in order: the next
    step refuses to run (on every rank) instead of pairing stale receives with new messages."""
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(GPTConfig(**CONFIG, layers=2), mesh, schedule="gpipe", micro_batches=2)
    tokens, targets = _batches(2)[0]

    def broken(action, run):
        raise KeyError("on purpose")

    handle = pipe.register_action_wrapper(broken)
    with pytest.raises(KeyError, match="on purpose"):
        pipe.train_step(tokens, targets)
    handle.remove()
    with pytest.raises(RuntimeError, match="an earlier step failed mid-way") as info:
        pipe.train_step(tokens, targets)
    assert isinstance(info.value.__cause__, KeyError)
    # Stage 1's receives stay posted (that is the point), so its scheduler's reapers never finish:
    # not closed. The barrier: no rank leaves, closing its connections, while its peer still posts.
    dist.barrier()
    return True


def _wrapped_actions(rank, world_size):
    """register_action_wrapper: every action of the stage's step passes through each wrapper once, in
    the schedule's order, the first registered outermost; the step's loss and gradients are those of
    an unwrapped step; handle.remove() unregisters; a wrapper that is not callable is refused.
    register_phase_wrapper: the step's input check and loss sum, once each."""
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipes = [Pipeline(GPTConfig(**CONFIG, layers=2), mesh, schedule="1f1b", micro_batches=3) for _ in range(2)]
    tokens, targets = _batches(6)[0]
    seen = []

    def outer(action, run):
        seen.append(("outer", action))
        run()
        seen.append(("outer done", action))

    def inner(action, run):
        seen.append(("inner", action))
        run()

    phases = []

    def phase(name, run):  # register_phase_wrapper: the step's two host phases, in order
        phases.append(name)
        run()

    handles = [pipes[0].register_action_wrapper(outer), pipes[0].register_action_wrapper(inner)]
    handles.append(pipes[0].register_phase_wrapper(phase))
    wrapped, plain = (pipe.train_step(tokens, targets) for pipe in pipes)
    assert torch.equal(wrapped, plain)
    assert phases == ["input_check", "loss_sum"], phases
    for p, q in zip(pipes[0].stage.parameters(), pipes[1].stage.parameters()):
        assert torch.equal(p.grad, q.grad)
    want = actions("1f1b", stage=rank, stages=2, segments=1, micro_batches=3)
    assert seen == [entry for a in want for entry in (("outer", a), ("inner", a), ("outer done", a))], seen
    for handle in handles:
        handle.remove()
    seen.clear()
    pipes[0].train_step(tokens, targets)
    assert seen == [] and phases == ["input_check", "loss_sum"]
    with pytest.raises(TypeError, match="wrapper: expected a callable"):
        pipes[0].register_action_wrapper("not callable")
    with pytest.raises(TypeError, match=r"wrapper: expected a callable wrapper\(phase, run\)"):
        pipes[0].register_phase_wrapper("not callable")
    for pipe in pipes:
        pipe.close()
    # A wrapper that never runs the action, or runs it twice, fails the step. One stage (DP 2): no
    # receive is left posted by the failed step for the next pipeline's messages to land in.
    dp_mesh = init_device_mesh(harness_device(), (2, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    for wrapper, said in (
        (lambda action, run: None, "no wrapper called run"),
        (lambda a, run: (run(), run()), "twice"),
    ):
        pipe = Pipeline(GPTConfig(**CONFIG, layers=2), dp_mesh, schedule="gpipe", micro_batches=2)
        pipe.register_action_wrapper(wrapper)
        with pytest.raises(RuntimeError, match=said):
            pipe.train_step(tokens, targets)
    # A phase wrapper that skips the input check (a collective; here on every rank alike) fails the
    # pipeline as a failed action does: the next step refuses to run.
    pipe = Pipeline(GPTConfig(**CONFIG, layers=2), dp_mesh, schedule="gpipe", micro_batches=2)
    pipe.register_phase_wrapper(lambda phase, run: None)
    with pytest.raises(RuntimeError, match="register_phase_wrapper: no wrapper called run"):
        pipe.train_step(tokens, targets)
    with pytest.raises(RuntimeError, match="an earlier step failed mid-way"):
        pipe.train_step(tokens, targets)
    dist.barrier()
    return True


def _auto_refuses_resume(rank, world_size, root):
    """segments="auto" is chosen at the first train_step, which rebuilds the optimizers: a checkpoint
    cannot be loaded before it (ValueError on every rank, before any collective)."""
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(GPTConfig(**CONFIG, layers=4), mesh, schedule="aiao", segments="auto", micro_batches=2)
    with pytest.raises(ValueError, match="segments='auto' is chosen at the first train_step"):
        pipe.load_checkpoint(root)
    pipe.close()
    return True


def test_auto_segments_refuse_a_checkpoint_before_the_first_step(tmp_path):
    assert run_ranks(_auto_refuses_resume, 2, str(tmp_path), timeout=60) == [True, True]


def test_action_wrappers_see_every_action_in_order():
    assert run_ranks(_wrapped_actions, 2, timeout=60) == [True, True]


def test_a_failed_step_blocks_the_next_one():
    assert run_ranks(_failed_step, 2, timeout=60) == [True, True]


def test_backend_must_carry_the_models_device():
    assert run_ranks(_backend_check, 2, timeout=60) == [True, True]


DYING_RANK_SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from oases.models import GPTConfig
from oases.pipeline import Pipeline

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
pipe = Pipeline(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2, layers=4), mesh,
                schedule="aiao", segments=2, micro_batches=2)
tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))  # the same on every rank
pipe.train_step(tokens, tokens)
if dist.get_rank() == 3:  # stage 1 of DP replica 1: its peers wait for its activations and DP sync
    forward = pipe.stage.forward_segment
    def dying(k, x, ctx, **options):
        if k == 1:
            raise RuntimeError("rank 3 dies mid-iteration on purpose")
        return forward(k, x, ctx, **options)
    pipe.stage.forward_segment = dying
pipe.train_step(tokens, tokens)
print("unreachable: the step finished")
"""


def test_a_rank_dying_mid_iteration_ends_the_run_with_its_error(tmp_path):
    """Under oases-launch (torchrun), the other ranks, blocked in receives and the DP sync, are
    stopped and the run ends with the dead rank's traceback instead of hanging."""
    import subprocess
    import sys

    script = tmp_path / "dying.py"
    script.write_text(DYING_RANK_SCRIPT)
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "oases.launch", "--nproc", "4", str(script)], capture_output=True, text=True, timeout=90
    )
    assert run.returncode != 0
    assert "RuntimeError: rank 3 dies mid-iteration on purpose" in run.stderr
    assert "unreachable" not in run.stdout
    assert time.monotonic() - start < 60


def _offload_cases(rank, world_size, cases):
    """Pipeline(offload=True) against the same pipeline without: the same losses and parameters,
    bit for bit; the per-layer checkpoints went through the offloader in batched copies."""
    for (dp, pp, tp), layers, schedule, segments, m, batch, offload_batch in cases:
        where = f"dp={dp} pp={pp} tp={tp} layers={layers} {schedule} ns={segments} m={m} batch={offload_batch}"
        runs = {}
        for offload in (False, True):
            from oases.offload import Offloader

            mesh = init_device_mesh(harness_device(), (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
            pipe = Pipeline(
                GPTConfig(**CONFIG, layers=layers),
                mesh,
                schedule=schedule,
                segments=segments,
                micro_batches=m,
                optimizer=OPTIMIZERS["adamw"],
                seed=SEED,
                offload=Offloader(batch=offload_batch) if offload else False,
            )
            losses = [pipe.train_step(tokens, targets) for tokens, targets in _batches(batch)]
            stats = pipe.offload_stats
            runs[offload] = (losses, pipe.state_dict())
            pipe.close()
        for a, b in zip(runs[False][0], runs[True][0]):
            assert torch.equal(a, b), (where, a, b)
        for name, value in runs[False][1].items():
            assert torch.equal(value, runs[True][1][name]), (where, name)
        per_action = layers // (pp * segments)  # layer inputs saved per forward action of this stage
        saves = m * segments * per_action
        assert stats.saves == saves, (where, stats)
        copies = m * segments * -(-per_action // offload_batch)  # ceil per (segment, micro-batch) group
        assert stats.copies_out == copies and stats.copies_in == copies, (where, stats)
        one_action = per_action * max(CONFIG["seq_len"] * CONFIG["hidden"] * 4 * -(-batch // dp // m), 0)
        # Resident at most what one forward keeps before its flush, plus two backwards' prefetches.
        assert stats.peak_resident_bytes <= 3 * one_action, (where, stats)
    return True


OFFLOAD_4 = [
    ((2, 2, 1), 8, "aiao", 2, 4, 8, 1),  # each F(k, i): 2 layer inputs, 2 copies each way
    ((2, 2, 1), 4, "1f1b", 1, 3, 6, 2),
    ((1, 2, 2), 4, "aiao", 2, 2, 4, 2),  # TP inside a stage: recomputation all-reduces too
]


def test_offload_is_bit_exact_and_batched_pp2_dp2():
    run_ranks(_offload_cases, 4, OFFLOAD_4, timeout=150)


# The DP sync in two levels (dp_hierarchy): 4 DP ranks on 2 emulated hosts of 2 (LOCAL_WORLD_SIZE,
# as oases-launch --hosts 2 sets it); small buckets so each segment has several.
DP_HIER_4 = [
    ((4, 1, 1), 4, "aiao", 2, 2, "sgd", 8, dict(dp_hierarchy=True, dp_bucket_numel=800, dp_overlap_ratio=0.5)),
    ((4, 1, 1), 4, "gpipe", 1, 2, "adamw", 8, dict(dp_hierarchy=True, dp_bucket_numel=800)),
]


def _dp_hierarchy(rank, world_size, cases):
    import os

    from oases.comm import ring_all_gather, ring_reduce_scatter
    from oases.comm.hierarchical import HostGroups, hierarchical_all_gather_steps, hierarchical_reduce_scatter_steps

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    for name in ("OASES_BANDWIDTH", "OASES_INTRA_BANDWIDTH"):
        os.environ.pop(name, None)
    # The step forms: one yield per ring step, and the flat rings' results (integer-valued data:
    # exact whatever the summation order).
    hosts = HostGroups.create(2)
    x = (
        torch.randint(-50, 50, (world_size * 6, 3), generator=torch.Generator().manual_seed(rank))
        .float()
        .to(rank_device())
    )
    steps = hierarchical_reduce_scatter_steps(x, hosts, chunks=2)
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            own = done.value
            break
    assert yields == (2 + 2) * 2  # intra ring (k = 2 steps) + inter ring (h = 2), 2 chunks each
    assert torch.equal(own, ring_reduce_scatter(x, chunks=2))
    steps = hierarchical_all_gather_steps(own, hosts, chunks=2)
    full = None
    while full is None:
        try:
            next(steps)
        except StopIteration as done:
            full = done.value
    assert torch.equal(full, ring_all_gather(own, chunks=2))

    alone, _ = dist.new_subgroups(group_size=1)
    for (dp, pp, tp), layers, schedule, segments, m, optimizer, batch, options in cases:
        want_losses, want_state = _golden(layers, optimizer, batch, alone)
        where = f"dp={dp} pp={pp} tp={tp} {schedule} ns={segments} m={m} {optimizer} {options}"
        mesh = init_device_mesh(harness_device(), (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        pipe = Pipeline(
            GPTConfig(**CONFIG, layers=layers),
            mesh,
            schedule=schedule,
            segments=segments,
            micro_batches=m,
            optimizer=OPTIMIZERS[optimizer],
            seed=SEED,
            **options,
        )
        groups = pipe.sync.hosts
        assert pipe.dp_hierarchical and (groups.hosts, groups.ranks_per_host) == (2, 2), where
        assert (groups.host, groups.local) == divmod(rank, 2), where
        for step, (tokens, targets) in enumerate(_batches(batch)):
            loss = pipe.train_step(tokens, targets)
            torch.testing.assert_close(
                loss, want_losses[step], rtol=1e-5, atol=1e-5, msg=lambda msg: f"{where}: loss of step {step}: {msg}"
            )
        _assert_state(pipe.state_dict(), want_state, where, rtol=1e-5, optimizer=optimizer)
        buckets = sum(len(b) for b in pipe.sync.buckets)
        assert buckets > pipe.segments, where  # several buckets per segment
        assert pipe.scheduler.hierarchical_syncs == STEPS * buckets, where  # every bucket, every step
        pipe.close()

    # "auto": oases.planner.partition on the launcher's links, for the largest bucket (about 40 KB here).
    config = GPTConfig(**CONFIG, layers=4)
    mesh = init_device_mesh(harness_device(), (4, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    for env, hierarchical in (
        ({"OASES_BANDWIDTH": "100mbit"}, True),  # slow NICs: two levels
        ({"OASES_INTRA_BANDWIDTH": "10mbit"}, False),
    ):  # slow inside hosts: flat
        os.environ.update(env)
        pipe = Pipeline(config, mesh, schedule="gpipe", micro_batches=2, dp_hierarchy="auto")
        assert pipe.dp_hierarchical is hierarchical and (pipe.sync.hosts is not None) is hierarchical, env
        pipe.train_step(*_batches(8)[0])
        pipe.close()
        assert (pipe.scheduler.hierarchical_syncs > 0) is hierarchical, env
        for name in env:
            del os.environ[name]
    pipe = Pipeline(config, mesh, schedule="gpipe", micro_batches=2)  # the default: flat
    assert not pipe.dp_hierarchical and pipe.sync.hosts is None
    pipe.close()

    # PP2 x DP2: each dp group ({0, 2}, {1, 3}) has one rank on each host of 2.
    mesh = init_device_mesh(harness_device(), (2, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    pipe = Pipeline(config, mesh, schedule="gpipe", micro_batches=2, dp_hierarchy=True)
    assert (pipe.sync.hosts.hosts, pipe.sync.hosts.ranks_per_host) == (2, 1)
    pipe.close()

    # Bad configurations: ValueError on every rank, before any communication.
    mesh = init_device_mesh(harness_device(), (4, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    for value, local, match in (
        ("yes", "2", "dp_hierarchy: expected"),
        (1, "2", "dp_hierarchy: expected"),
        (0.0, "2", "dp_hierarchy: expected"),  # not False: would turn it on
        (True, "3", "not packed evenly"),  # hosts {0, 1, 2} and {3}
        ("auto", "3", "not packed evenly"),
        (True, None, "LOCAL_WORLD_SIZE"),
        (True, "two", "LOCAL_WORLD_SIZE"),
    ):
        if local is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = local
        with pytest.raises(ValueError, match=match):
            Pipeline(config, mesh, schedule="gpipe", micro_batches=2, dp_hierarchy=value)
    os.environ.update(LOCAL_WORLD_SIZE="2", OASES_BANDWIDTH="fast")  # "auto" reads the links first
    with pytest.raises(ValueError, match="OASES_BANDWIDTH"):
        Pipeline(config, mesh, schedule="gpipe", micro_batches=2, dp_hierarchy="auto")
    dist.barrier()  # no rank was left inside a collective
    return True


def test_dp_sync_runs_in_two_levels_over_hosts_and_matches_single_process():
    assert run_ranks(_dp_hierarchy, 4, DP_HIER_4, timeout=40) == [True] * 4


class _Counting(torch.optim.Optimizer):
    """SGD whose step size grows with a counter it keeps in its param group (as schedule-free AdamW
    and Prodigy keep theirs): the pipeline must leave what the step writes there."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr, k=0))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-float(group["lr"]) * (group["k"] + 1))
            group["k"] += 1


def _lr_scheduled(rank, world_size):
    import warnings

    factor = [1.0, 0.5, 0.1, 0.0]  # a schedule that changes the lr every step
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(3)]
    alone, _ = dist.new_subgroups(group_size=1)
    mesh = init_device_mesh(harness_device(), (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    makes = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "sgd, lr a tensor": lambda p: torch.optim.SGD(p, lr=torch.tensor(0.1)),  # the scheduler fills it in place
        "a counter in its group": lambda p: _Counting(p, lr=0.05),
    }
    for name, make in makes.items():
        model = GPT(GPTConfig(**CONFIG, layers=4), alone, seed=7).to(rank_device())
        plain = make(model.parameters())
        want = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "lr_scheduler.step() before optimizer.step()" (deferred)
            scheduler = torch.optim.lr_scheduler.LambdaLR(plain, lambda n: factor[min(n, 3)])
            for tokens, targets in batches:
                loss = model(tokens.to(rank_device()), targets.to(rank_device()))
                loss.backward()
                plain.step()
                plain.zero_grad()
                scheduler.step()
                want.append(loss.item())
            pipe = Pipeline(
                GPTConfig(**CONFIG, layers=4), mesh, schedule="1f1b", micro_batches=2, seed=7, optimizer=make
            )
            schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda n: factor[min(n, 3)]) for o in pipe.optimizers]
            got = []
            for tokens, targets in batches:  # the loop a user writes: step, then the schedulers
                got.append(pipe.train_step(tokens, targets).item())
                for s in schedulers:
                    s.step()
        state = pipe.state_dict()  # applies the last pending update, with its step's lr
        counters = [o.param_groups[0].get("k") for o in pipe.optimizers]
        pipe.close()
        assert got == pytest.approx(want, rel=1e-5), name
        assert counters == [plain.param_groups[0].get("k")] * len(counters), (name, counters)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(
                state[key].cpu(), value.cpu(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}, {key}: {m}"
            )
    return True


def test_a_learning_rate_schedule_applies_each_step_with_its_own_lr_pp2():
    # the pipeline applies a step's update at the next train_step, after the user's scheduler.step()
    assert run_ranks(_lr_scheduled, 2, timeout=120) == [True, True]
