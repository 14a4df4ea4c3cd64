"""oases.offload: the host slab, the batched copy engine (extension and Python paths), the
Offloader's states and counts, misuse errors, the saved-tensors context, and the schedules with
offload=True on 2 real gloo ranks (bit-exact against offload=False)."""

from __future__ import annotations

import contextlib
import gc
import math

import pytest
import torch
import torch.nn as nn

from oases import _extension
from oases.offload import (
    ALIGNMENT,
    CopyEngine,
    HostSlab,
    Offloader,
    OffloadStack,
    OffloadState,
    SlabTooSmallError,
    offload_saved_tensors,
)
from oases.offload.slab import _UNBOUNDED, _FirstFit

from _spawn import rank_device, run_ranks

PATHS = [
    pytest.param(
        True, id="extension", marks=pytest.mark.skipif(not _extension.is_available(), reason="oases._C not built")
    ),
    pytest.param(False, id="python"),
]


def _odd_tensors() -> list[torch.Tensor]:
    """Mixed dtypes and layouts: dense, transposed, gapped slice, expanded, zero-size, 0-dim."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 5, generator=g),
        torch.randn(3, 4, generator=g).t(),  # dense, strides (1, 4)
        torch.randint(-(2**62), 2**62, (6,), generator=g, dtype=torch.int64),
        torch.empty(0, 3),
        torch.randn(2, 8, generator=g).to(torch.bfloat16)[:, ::2],  # gaps: copied contiguous
        torch.tensor(3.5, dtype=torch.float64),
        torch.randn(5, generator=g).expand(3, 5),  # stride 0
        torch.randint(0, 256, (7, 3), generator=g, dtype=torch.uint8).permute(1, 0),
        torch.randn(2, 3, generator=g).to(torch.float16),
        torch.tensor([True, False, True]),
    ]


# ---- HostSlab ----------------------------------------------------------------------------------


def test_host_slab_regions_and_errors():
    slab = HostSlab(4 * ALIGNMENT)
    assert slab.capacity == 4 * ALIGNMENT and slab.buffer.dtype == torch.uint8
    assert slab.pinned is torch.cuda.is_available()
    a, b = slab.allocate(1), slab.allocate(ALIGNMENT + 1)  # 1 and 2 aligned units
    assert (a, b) == (0, ALIGNMENT) and slab.in_use == 3 * ALIGNMENT
    with pytest.raises(
        SlabTooSmallError,
        match=rf"this step needs at least {5 * ALIGNMENT} bytes: create "
        rf"HostSlab\({5 * ALIGNMENT}\)",
    ) as err:
        slab.allocate(2 * ALIGNMENT)
    assert err.value.needed == 5 * ALIGNMENT and slab.in_use == 3 * ALIGNMENT  # nothing taken
    slab.free(a)
    slab.free(b)  # coalesced: the whole slab is one free run again
    assert slab.allocate(4 * ALIGNMENT) == 0
    with pytest.raises(ValueError, match="no allocated region starts at 7"):
        slab.free(7)
    with pytest.raises(TypeError, match="nbytes: expected an int"):
        HostSlab(1.5)
    with pytest.raises(ValueError, match="nbytes: must be >= 0"):
        HostSlab(-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory: True needs CUDA"):
            HostSlab(8, pin_memory=True)


def test_first_fit_replay_fits_its_high_water():
    """A slab of the high-water mark of a sequence holds a replay of it, at the same offsets."""
    g = torch.Generator().manual_seed(3)
    ops, live = [], []
    for _ in range(300):
        if live and torch.rand((), generator=g) < 0.45:
            ops.append(("free", live.pop(int(torch.randint(len(live), (), generator=g)))))
        else:
            ops.append(("alloc", len(ops), int(torch.randint(1, 5000, (), generator=g))))
            live.append(len(ops) - 1)

    def replay(regions):
        where = {}
        for op in ops:
            if op[0] == "alloc":
                where[op[1]] = regions.allocate(op[2])
                assert where[op[1]] is not None
            else:
                regions.free(where[op[1]])
        return where

    profile = _FirstFit(_UNBOUNDED)
    first = replay(profile)
    assert replay(_FirstFit(profile.high_water)) == first
    with pytest.raises(AssertionError):
        replay(_FirstFit(profile.high_water - ALIGNMENT))


# ---- CopyEngine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("use_extension", PATHS)
@pytest.mark.parametrize("asynchronous", [True, False], ids=["worker", "inline"])
def test_copy_engine_round_trip(use_extension, asynchronous):
    tensors = [t.contiguous() for t in _odd_tensors()]
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos += -(-(t.numel() * t.element_size()) // ALIGNMENT) * ALIGNMENT
    buffer = torch.zeros(pos + 5, dtype=torch.uint8)
    engine = CopyEngine("cpu", use_extension=use_extension, asynchronous=asynchronous)
    try:
        assert engine.path == ("extension" if use_extension else "python")
        engine.copy_out(tensors, buffer, offsets).wait()
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            assert torch.equal(buffer[off : off + n], t.reshape(-1).view(torch.uint8))
        outs, event = engine.copy_in(buffer, offsets, [(t.shape, t.dtype) for t in tensors])
        event.wait()
        assert event.done()
        for t, o in zip(tensors, outs):
            assert o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        assert dict(engine.calls) == {"out": 1, "in": 1} and dict(engine.bytes) == {"out": nbytes, "in": nbytes}
        with pytest.raises(ValueError, match=r"tensors\[1\]: must be contiguous"):
            engine.copy_out([tensors[0], torch.ones(4, 4).t()], buffer, [0, 256])
        with pytest.raises(ValueError, match=r"offsets\[0\]=-1"):
            engine.copy_out([tensors[0]], buffer, [-1])
    finally:
        engine.close()


@pytest.mark.skipif(not _extension.is_available(), reason="oases._C not built")
def test_extension_splits_large_copies_over_threads():
    """The C++ memcpy splits the concatenated bytes over the intra-op threads (grain 1 MiB): a
    3 MiB tensor between small ones, at odd offsets, lands byte for byte as the Python path puts it."""
    C = _extension.compiled()
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (3, 3 << 20, 0, 17, 1 << 20)]
    offsets = [5, 11, 11, 3 * (1 << 20) + 13, 3 * (1 << 20) + 31]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        slab = torch.zeros(5 << 20, dtype=torch.uint8)
        C.pack(tensors, slab, offsets)
        outs = [torch.empty_like(t) for t in tensors]
        C.unpack(slab, outs, offsets)
    finally:
        torch.set_num_threads(threads)
    for t, o, off in zip(tensors, outs, offsets):
        assert torch.equal(slab[off : off + t.numel()], t) and torch.equal(o, t)
    covered = torch.zeros_like(slab, dtype=torch.bool)
    for t, off in zip(tensors, offsets):
        covered[off : off + t.numel()] = True
    assert not slab[~covered].any()


@pytest.mark.parametrize("use_extension", PATHS)
def test_copies_are_named_in_a_profile(use_extension):
    """While a profiler runs, each batched copy is a range named after its direction and path
    (none is opened otherwise: that costs a small copy's own time)."""
    engine = CopyEngine("cpu", use_extension=use_extension, asynchronous=False)
    buffer = torch.zeros(1024, dtype=torch.uint8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.copy_out([torch.ones(8)], buffer, [0]).wait()
        outs, event = engine.copy_in(buffer, [0], [((8,), torch.float32)])
        event.wait()
    names = {e.key for e in prof.key_averages()}
    assert {f"oases.offload.copy_out:{engine.path}", f"oases.offload.copy_in:{engine.path}"} <= names
    assert torch.equal(outs[0], torch.ones(8))


# ---- Offloader ---------------------------------------------------------------------------------


@pytest.mark.parametrize("use_extension", PATHS)
def test_offloader_states_counts_and_exact_restore(use_extension):
    tensors = _odd_tensors()
    engine = CopyEngine("cpu", use_extension=use_extension)
    off = Offloader(HostSlab(1 << 16), batch=3, engine=engine)
    off.begin_step()
    cs = [off.save(t, group="k") for t in tensors]
    # 10 saves, batch 3: three batches left, the tenth waits for a flush
    assert off.stats.copies_out == 3 and cs[-1].state is OffloadState.ON_DEVICE
    assert [c.batch for c in cs] == [0, 0, 0, 1, 1, 1, 2, 2, 2, None]
    assert all(c.state in (OffloadState.IN_FLIGHT_OUT, OffloadState.ON_HOST) for c in cs[:9])
    with pytest.raises(
        ValueError,
        match=r"prefetch: OffloadHandle\(#9, group='k', \[3\] torch.bool, on device\) "
        r"was never offloaded",
    ):
        off.prefetch([cs[0], cs[-1]])
    assert off.stats.copies_in == 0  # the check ran before any copy
    off.flush("k")
    engine.synchronize()
    assert off.stats.copies_out == math.ceil(len(tensors) / 3) == 4
    assert all(c.state is OffloadState.ON_HOST for c in cs)
    assert off.stats.resident_bytes == 0 and off.slab.in_use > 0
    off.prefetch(reversed(cs[6:]))  # batches 3 and 2: two calls
    assert off.stats.copies_in == 2 and cs[6].state is OffloadState.IN_FLIGHT_IN
    for t, c in zip(tensors, cs):
        restored = off.get(c)  # batches 1 and 0 are fetched here, one call each
        assert restored.dtype == t.dtype and restored.shape == t.shape and torch.equal(restored, t)
        if t.is_contiguous() or t.permute(*reversed(range(t.dim()))).is_contiguous():
            assert restored.stride() == t.stride()  # dense layouts come back as they left
        assert c.state is OffloadState.ON_DEVICE
        off.release(c)
        assert c.state is OffloadState.RELEASED
    stats = off.end_step()
    assert (stats.copies_out, stats.copies_in, stats.saves) == (4, 4, 10)
    assert stats.bytes_out == stats.bytes_in == sum(t.numel() * t.element_size() for t in tensors)
    assert stats.resident_bytes == 0 and off.slab.in_use == 0
    with pytest.raises(ValueError, match=r"release: .* was already released \(double free\)"):
        off.release(cs[0])
    with pytest.raises(ValueError, match=r"get: .* was released"):
        off.get(cs[1])
    with pytest.raises(ValueError, match=r"prefetch: .* was released"):
        off.prefetch([cs[2]])
    with pytest.raises(TypeError, match="get: expected an OffloadHandle that this Offloader's save"):
        off.get(Offloader().save(torch.ones(2)))
    engine.close()


def test_offloader_bad_arguments():
    with pytest.raises(ValueError, match=r"batch: expected an int >= 1"):
        Offloader(batch=0)
    with pytest.raises(TypeError, match="slab: expected an oases.offload.HostSlab"):
        Offloader(slab=1024)
    with pytest.raises(TypeError, match="tensor: expected a torch.Tensor"):
        Offloader().save([1.0])
    with pytest.raises(ValueError, match="tensor: only dense"):
        Offloader().save(torch.eye(3).to_sparse())


def test_slab_too_small_says_the_size_and_moves_nothing():
    a, b = torch.randn(100), torch.randn(300)  # 400 and 1200 bytes: 512 + 1280 aligned
    off = Offloader(HostSlab(1024), batch=2)
    off.save(a)
    with pytest.raises(SlabTooSmallError, match=r"needs at least 1792 bytes: create HostSlab\(1792\)") as err:
        off.save(b)  # the batch of two is placed at once: all or nothing
    assert off.slab.in_use == 0 and off.stats.copies_out == 0
    off = Offloader(HostSlab(err.value.needed), batch=2)
    ca, cb = off.save(a), off.save(b)
    assert torch.equal(off.get(cb), b) and torch.equal(off.get(ca), a)
    off.close()


def test_profiling_step_sizes_the_slab():
    """Without a slab the first step offloads into per-batch buffers and measures the slab size;
    the slab it then allocates holds every later step of the same shapes exactly."""
    off = Offloader(batch=2)
    tensors = [torch.randn(n) for n in (10, 300, 7, 64, 1000)]
    for step in range(3):
        off.begin_step()
        stack = OffloadStack(off, group=0)
        for t in tensors:
            stack.push(t)
        stack.flush()
        assert [torch.equal(stack.pop(), t) for t in reversed(tensors)] == [True] * len(tensors)
        stats = off.end_step()
        assert (stats.copies_out, stats.copies_in) == (3, 3)
        if step == 0:
            assert off.slab is not None and off.slab.capacity == stats.host_high_water > 0
        else:
            assert off.slab.high_water == off.slab.capacity and off.slab.in_use == 0
    off.close()


def test_offload_stack_batches_and_prefetches_ahead():
    """push 7 with batch 2: copies out [0 1] [2 3] [4 5] + flush [6], which also fetches [6];
    popping 6 fetches one batch ahead ([4 5]); each further batch is fetched one batch early."""
    off = Offloader(HostSlab(1 << 16), batch=2, engine=CopyEngine("cpu", asynchronous=False))
    stack = OffloadStack(off, group=1, ahead=1)
    tensors = [torch.full((16,), float(i)) for i in range(7)]
    for t in tensors:
        stack.push(t)
    assert off.stats.copies_out == 3 and off.stats.resident_bytes == 64
    stack.flush()
    assert off.stats.copies_out == 4 and off.stats.copies_in == 1  # [6] on its way
    fetched = []
    for i in reversed(range(7)):
        assert torch.equal(stack.pop(), tensors[i])
        fetched.append(off.stats.copies_in)
    assert fetched == [2, 3, 3, 4, 4, 4, 4] and len(stack) == 0
    # never more than the batch in use and the one ahead (2 + 2), against 7 without offloading
    assert off.stats.peak_resident_bytes == 4 * 64
    off.close()


def test_old_checkpoint_names_warn_and_work():
    """The offload package's old names ("checkpoint" is a training state saved to files): each
    warns, naming the new one, and is the new object; none is in __all__."""
    import oases.offload as offload

    for old, new in (
        ("Checkpoint", "OffloadHandle"),
        ("CheckpointState", "OffloadState"),
        ("CheckpointStack", "OffloadStack"),
    ):
        assert old not in offload.__all__ and new in offload.__all__
        with pytest.warns(DeprecationWarning, match=f"oases.offload.{new}"):
            assert getattr(offload, old) is getattr(offload, new)
    with pytest.warns(DeprecationWarning, match="OffloadStack"):
        from oases.offload import CheckpointStack
    with pytest.raises(AttributeError, match="Checkpoints"):
        offload.Checkpoints  # only the listed names are aliases
    from oases.offload import lifo, offloader

    for module, old, new in (
        (offloader, "Checkpoint", "OffloadHandle"),
        (offloader, "CheckpointState", "OffloadState"),
        (lifo, "CheckpointStack", "OffloadStack"),
    ):  # the modules that held them answer too
        with pytest.warns(DeprecationWarning, match=f"{module.__name__}.{old} is deprecated: use oases.offload.{new}"):
            assert getattr(module, old) is getattr(offload, new)
    off = Offloader(batch=2, engine=CopyEngine("cpu", asynchronous=False))
    off.begin_step()
    stack = CheckpointStack(off, group=0)
    handle = off.save(torch.arange(3.0), group=1)
    stack.push(torch.ones(4))
    stack.flush()
    off.flush(1)
    with pytest.warns(DeprecationWarning, match=r"OffloadStats\.saves"):
        assert off.stats.checkpoints == off.stats.saves == 2
    with pytest.warns(DeprecationWarning, match="handles="):
        off.prefetch(checkpoints=[handle])
    with pytest.raises(TypeError, match="both handles and checkpoints"):
        off.prefetch([handle], checkpoints=[handle])
    assert torch.equal(off.get(handle), torch.arange(3.0)) and torch.equal(stack.pop(), torch.ones(4))
    off.release(handle)
    off.close()


# ---- autograd's saved tensors ------------------------------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(4)])


def _loss_and_grads(model, x, context):
    model.zero_grad(set_to_none=True)
    with context:
        loss = model(x).pow(2).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_tensors_context_is_bit_exact(dtype):
    model = _mlp().to(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    want_loss, want_grads = _loss_and_grads(model, x, contextlib.nullcontext())
    off = Offloader(batch=4)
    for _ in range(2):  # the profiling step, then the slab
        off.begin_step()
        loss, grads = _loss_and_grads(model, x, offload_saved_tensors(off))
        stats = off.end_step()
        assert torch.equal(loss, want_loss)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert stats.saves > 8  # parameters stay: only activations are offloaded
        assert stats.copies_out == stats.copies_in == math.ceil(stats.saves / 4)
        assert stats.resident_bytes == 0 and stats.host_bytes == 0
    off.close()


def test_graph_dropped_without_backward_frees_the_slab():
    model, x = _mlp(), torch.randn(8, 16)
    off = Offloader(HostSlab(1 << 20), batch=4)
    with offload_saved_tensors(off):
        loss = model(x).sum()
    assert off.slab.in_use > 0
    del loss
    gc.collect()
    off.begin_step()  # the offloader frees what dead handles held at its next call
    assert off.slab.in_use == 0 and off.stats.resident_bytes == 0
    off.close()


# ---- the schedules, 2 real ranks ---------------------------------------------------------------

CONFIG = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2, mlp_ratio=2)


def _tp_offload(rank, world_size):
    import oases
    from oases.models import GPT, GPTConfig
    from oases.schedule import RecomputeMemory

    config = GPTConfig(**CONFIG, dropout=0.25)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g).to(rank_device())
    targets = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=g).to(rank_device())
    sublayers = 2 * config.layers
    report = {}
    for schedule, sp, kept in (
        ("oases", False, sublayers),
        ("oases", True, sublayers),
        ("megatron", False, config.layers),
        ("cross_pass", False, config.layers),
    ):
        name = schedule + ("-sp" if sp else "")
        plain = GPT(config, schedule=schedule, seed=3, sequence_parallel=sp).to(rank_device())
        off = GPT(config, schedule=schedule, seed=3, sequence_parallel=sp, offload=Offloader(batch=3))
        off.to(rank_device())
        parts = 1 if schedule == "megatron" else 2
        for step in range(2):  # the profiling step, then the preallocated slab
            memories = RecomputeMemory(), RecomputeMemory()
            losses = [
                m.train_step(tokens, targets, dropout_seed=11 + step, memory=mem, recompute=True)  # what it measures
                for m, mem in zip((plain, off), memories)
            ]
            assert torch.equal(losses[0], losses[1]), (name, step, losses)
            for (n, p), (_, q) in zip(plain.named_parameters(), off.named_parameters()):
                assert torch.equal(p.grad, q.grad), (name, step, n)
            stats = off.offloader.stats
            assert stats.copies_out == stats.copies_in == parts * math.ceil(kept / 3), (name, stats)
            assert stats.saves == parts * kept and stats.resident_bytes == 0
            assert memories[1].peak == stats.peak_resident_bytes <= memories[0].peak, (name, memories, stats)
            if kept > 3:  # more than one batch per sub-batch: some inputs are off the device at the peak
                assert memories[1].peak < memories[0].peak, (name, memories, stats)
        assert off.offloader.slab is not None and off.offloader.slab.in_use == 0
        report[name] = (memories[0].peak, memories[1].peak)
        off.offloader.close()
    # oases.train_step: True takes the model's own offloader; an Offloader is used as given
    model = GPT(GPTConfig(**CONFIG), seed=5, offload=True).to(rank_device())
    reference = GPT(GPTConfig(**CONFIG), seed=5).to(rank_device())
    mine = Offloader(batch=2)
    want = oases.train_step(reference, tokens, tokens, recompute=True)
    assert torch.equal(oases.train_step(model, tokens, tokens, offload=True), want)
    assert model.offloader.stats.copies_out == 2 * math.ceil(sublayers / 8)
    assert model.offloader.slab is not None
    model.zero_grad()
    assert torch.equal(oases.train_step(model, tokens, tokens, offload=mine), want)
    assert mine.stats.copies_out == 2 * math.ceil(sublayers / 2)
    for (n, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    try:
        oases.train_step(model, tokens, tokens, offload="yes")
    except TypeError as err:
        assert "offload: expected a bool or an oases.offload.Offloader" in str(err)
    else:
        raise AssertionError("offload='yes' accepted")
    return report


def test_tp2_schedules_with_offload_are_bit_exact():
    reports = run_ranks(_tp_offload, 2, timeout=90)
    assert reports[0] == reports[1]


def test_without_the_extension_the_python_path_copies(monkeypatch):
    import sys

    import oases

    monkeypatch.setitem(sys.modules, "oases._C", None)  # as if never built
    monkeypatch.delattr(oases, "_C", raising=False)
    _extension.compiled.cache_clear()
    try:
        engine = CopyEngine("cpu", asynchronous=False)
        assert engine.path == "python"
        with pytest.raises(ImportError, match="is not built"):
            CopyEngine("cpu", use_extension=True)
        off = Offloader(batch=2, engine=engine)
        tensors = _odd_tensors()
        cs = [off.save(t) for t in tensors]
        off.flush()
        assert all(torch.equal(off.get(c), t) for c, t in zip(cs, tensors))
        assert engine.calls["out"] == engine.calls["in"] == math.ceil(len(tensors) / 2)
    finally:
        monkeypatch.undo()
        _extension.compiled.cache_clear()
