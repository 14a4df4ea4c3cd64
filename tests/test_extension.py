"""oases._C (csrc/): batched pack/unpack between tensors and a byte slab, its argument checks,
the lazy loader `oases._extension`, and the CUDA compile check (.ci/compile_cuda.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oases import _extension

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def C():
    return _extension.compiled()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, as a 1-D uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _mixed_tensors(count: int, seed: int) -> list[torch.Tensor]:
    """`count` tensors cycling through float32, bfloat16, int64, uint8 and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = 1 + (7 * i) % 23
        kind = i % 5
        if kind == 0:
            out.append(torch.randn(n, 3, generator=g))
        elif kind == 1:
            out.append(torch.randn(n, generator=g).to(torch.bfloat16))
        elif kind == 2:
            out.append(torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64))
        elif kind == 3:
            out.append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8))
        else:
            out.append(torch.empty(0, 4))
    return out


def _layout(tensors: list[torch.Tensor], *, start: int, align: int, gap: int) -> tuple[list[int], int]:
    """Byte offsets placing each tensor `gap` bytes after the previous one, rounded up to `align`;
    returns (offsets, slab size) with `gap` spare bytes at the end."""
    offsets, pos = [], start
    for t in tensors:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += t.numel() * t.element_size() + gap
    return offsets, pos


# aligned: slab and every range start on 64-byte boundaries (the CUDA kernel's 16-byte words);
# unaligned: the slab starts at an odd address inside its buffer, the ranges at odd offsets.
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_pack_unpack_round_trip(C, aligned):
    tensors = _mixed_tensors(40, seed=int(aligned))
    if aligned:
        offsets, size = _layout(tensors, start=0, align=64, gap=5)
        base = 0
    else:
        offsets, size = _layout(tensors, start=3, align=1, gap=3)
        base = 7
    g = torch.Generator().manual_seed(5)
    backing = torch.randint(0, 256, (base + size + 9,), generator=g, dtype=torch.uint8)
    before = backing.clone()
    slab = backing[base : base + size]  # (size,) uint8 view at byte `base` of the buffer
    if aligned:
        assert slab.data_ptr() % 64 == 0
    else:
        assert slab.data_ptr() % 2 == 1

    C.pack(tensors, slab, offsets)

    covered = torch.zeros_like(backing, dtype=torch.bool)
    for t, off in zip(tensors, offsets):
        nbytes = t.numel() * t.element_size()
        assert torch.equal(slab[off : off + nbytes], _as_bytes(t))
        covered[base + off : base + off + nbytes] = True
    assert covered.any() and not covered.all()
    # Every byte outside the packed ranges, in the slab and around it, is untouched.
    assert torch.equal(backing[~covered], before[~covered])

    packed = backing.clone()
    outs = [torch.full_like(t, 7) for t in tensors]
    C.unpack(slab, outs, offsets)
    for t, o in zip(tensors, outs):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(_as_bytes(o), _as_bytes(t))
    assert torch.equal(backing, packed)  # unpack only reads the slab


def test_no_tensors_and_exact_fit(C):
    slab = torch.zeros(8, dtype=torch.uint8)
    C.pack([], slab, [])
    C.unpack(slab, [], [])
    x = torch.tensor([1.5, -2.0], dtype=torch.float32)  # 8 bytes: exactly the slab
    C.pack([x], slab, [0])
    y = torch.empty(2)
    C.unpack(slab, [y], [0])
    assert torch.equal(x, y)
    C.pack([torch.empty(0)], slab, [8])  # an empty tensor fits at the end


def _owner_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_empty_batch_shares_one_allocation_per_run_laid_out_as_the_slab(C):
    """Small tensors whose slab regions lie end to end (each offset a multiple of its element
    size) become views of one allocation with the slab's layout, so unpack moves the run in one
    copy; a gap, a tensor over 1 MiB, an offset its element size does not divide, or an empty
    tensor ends the run. The bytes round-trip through pack and unpack either way."""
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(5, 3, generator=g),  # run A: 60 bytes at 4
        torch.randn(9, generator=g).to(torch.bfloat16),  #   18 bytes at 64
        torch.randint(0, 256, (3,), generator=g, dtype=torch.uint8),  # 3 at 82
        torch.randn(1, generator=g).to(torch.bfloat16),  # 2 at 85: odd offset, own
        torch.randn(4, generator=g),  # run B (after a gap): 16 at 96
        torch.randn(2, 2, generator=g).double(),  #   32 at 112
        torch.empty(0, 3),  # empty: own
        torch.randn((1 << 18) + 1, generator=g),  # 1 MiB + 4: own
        torch.randn(3, generator=g),
    ]  # 12 bytes after it: own (a run of one)
    offsets = [4, 64, 82, 85, 96, 112, 144, 144, (1 << 20) + 148]
    size = offsets[-1] + 12
    slab = torch.zeros(size, dtype=torch.uint8)
    C.pack(tensors, slab, offsets)
    outs, owners = C.empty_batch(offsets, [t.shape for t in tensors], [t.dtype for t in tensors], torch.device("cpu"))
    assert [o.shape for o in outs] == [t.shape for t in tensors]
    assert [o.dtype for o in outs] == [t.dtype for t in tensors]
    assert all(o.is_contiguous() for o in outs)
    groups = [_owner_of(o) for o in outs]
    assert groups[0] == groups[1] == groups[2]  # run A
    assert groups[4] == groups[5] != groups[0]  # run B
    assert len({groups[i] for i in (0, 3, 4, 7, 8)}) == 5  # the rest: their own
    # owners: run A, the odd one, run B, the empty one, the 1 MiB one, the last one
    assert len(owners) == 6
    assert [_owner_of(o) for i, o in enumerate(owners) if i != 3] == [groups[i] for i in (0, 3, 4, 7, 8)]
    # laid out as the slab: the same relative offsets, the same alignment modulo 16
    for i in (1, 2):
        assert outs[i].data_ptr() - outs[0].data_ptr() == offsets[i] - offsets[0]
    assert (outs[0].data_ptr() - groups[0]) % 16 == offsets[0] % 16
    assert outs[5].data_ptr() - outs[4].data_ptr() == offsets[5] - offsets[4]
    C.unpack(slab, outs, offsets)
    for t, o in zip(tensors, outs):
        assert torch.equal(_as_bytes(o), _as_bytes(t)), (t.dtype, t.shape)


def test_empty_batch_caps_a_run_at_64_mib(C):
    """Runs hold at most 64 MiB: 80 tensors of 1 MiB end to end make two runs (64 + 16)."""
    mib = 1 << 20
    offsets = [i * mib for i in range(80)]
    outs, owners = C.empty_batch(offsets, [(mib // 4,)] * 80, [torch.float32] * 80, torch.device("cpu"))
    assert [o.numel() for o in owners] == [64 * mib, 16 * mib]
    assert len({_owner_of(o) for o in outs[:64]}) == 1 and len({_owner_of(o) for o in outs[64:]}) == 1


def test_empty_batch_checks_its_arguments(C):
    with pytest.raises(RuntimeError, match="specs: need one shape and one dtype per offset"):
        C.empty_batch([0, 8], [(2,)], [torch.float32, torch.float32], torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"specs\[0\]: negative size -2"):
        C.empty_batch([0], [(3, -2)], [torch.float32], torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"offsets\[1\]=-4"):
        C.empty_batch([0, -4], [(1,), (1,)], [torch.float32] * 2, torch.device("cpu"))


def test_build_info(C):
    info = C.build_info()
    assert set(info) == {"cuda", "torch"}
    assert torch.__version__.startswith(info["torch"])
    if torch.version.cuda is None:
        assert info["cuda"] is False


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_offsets_length_mismatch(C, op):
    tensors = [torch.ones(2), torch.ones(3)]
    slab = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"offsets: need one offset per tensor, got 1 offsets for 2"):
        _call(C, op, tensors, slab, [0])


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("offset", [57, -1, 2**63 - 1], ids=["past-end", "negative", "overflow"])
def test_tensor_not_fitting_slab(C, op, offset):
    tensors = [torch.ones(2), torch.ones(2, dtype=torch.float64)]  # 8 and 16 bytes
    slab = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=rf"offsets\[1\]={offset}: tensor of 16 bytes does not fit a slab of 64"):
        _call(C, op, tensors, slab, [0, offset])
    # Every check runs before any byte moves: tensors[0] was not packed either.
    assert not slab.any()
    assert torch.equal(tensors[0], torch.ones(2))


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_non_contiguous_tensor(C, op):
    tensors = [torch.ones(3), torch.ones(4, 4).t()[:, :2]]
    slab = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"tensors\[1\]: must be contiguous"):
        _call(C, op, tensors, slab, [0, 16])


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize(
    "slab",
    [
        torch.zeros(16, dtype=torch.float32),
        torch.zeros(16, dtype=torch.int8),
        torch.zeros(4, 16, dtype=torch.uint8),
        torch.zeros(128, dtype=torch.uint8)[::2],
    ],
    ids=["float32", "int8", "2d", "strided"],
)
def test_slab_not_contiguous_1d_uint8(C, op, slab):
    with pytest.raises(RuntimeError, match=r"slab: must be a contiguous 1-D uint8 tensor"):
        _call(C, op, [torch.ones(2)], slab, [0])


def test_tensor_on_other_device(C):
    with pytest.raises(RuntimeError, match=r"tensors\[0\]: on meta but slab is on cpu"):
        C.pack([torch.empty(2, device="meta")], torch.zeros(8, dtype=torch.uint8), [0])


def _call(C, op, tensors, slab, offsets):
    if op == "pack":
        C.pack(tensors, slab, offsets)
    else:
        C.unpack(slab, tensors, offsets)


# --- the lazy loader ---

_WITHOUT_EXTENSION = r"""
import sys
sys.modules["oases._C"] = None  # as if the extension had never been built

import oases
from oases import _extension

public = [getattr(oases, name) for name in oases.__all__]  # the whole library (imported on first use)
assert "oases.training" in sys.modules and "oases.pipeline" in sys.modules
assert "oases._C" in sys.modules and sys.modules["oases._C"] is None
assert not _extension.is_available()
try:
    _extension.compiled()
except ImportError as err:
    assert "pip install --no-build-isolation -e ." in str(err), str(err)
    assert isinstance(err.__cause__, ImportError), repr(err.__cause__)
else:
    raise AssertionError("compiled() returned without oases._C")
"""


def test_import_oases_without_extension():
    """`import oases` never needs oases._C; compiled() says how to build it (fresh interpreter)."""
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTENSION],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def blocked_extension(monkeypatch):
    """oases._C made unimportable in this process; the real one is back (uncached) afterwards."""
    import oases

    monkeypatch.setitem(sys.modules, "oases._C", None)
    monkeypatch.delattr(oases, "_C", raising=False)
    _extension.compiled.cache_clear()
    yield
    monkeypatch.undo()
    _extension.compiled.cache_clear()


def test_compiled_raises_then_recovers(blocked_extension, monkeypatch):
    with pytest.raises(ImportError, match=r"oases\._C .* is not built: run `pip install --no-build-isolation -e \.`"):
        _extension.compiled()
    assert not _extension.is_available()
    monkeypatch.undo()  # the extension is importable again: a failure was not cached
    assert _extension.compiled().build_info()["torch"]
    assert _extension.is_available()


# --- the CUDA compile check ---


def _nvcc_found() -> bool:
    """Where .ci/compile_cuda.sh looks: PATH, then $CUDA_HOME/bin (default /usr/local/cuda)."""
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.access(os.path.join(cuda_home, "bin", "nvcc"), os.X_OK)


@pytest.mark.skipif(not _nvcc_found(), reason="nvcc not found")
@pytest.mark.timeout(180)
def test_compile_cuda_sources():
    proc = subprocess.run(["bash", ".ci/compile_cuda.sh"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compile_cuda_skips_without_nvcc():
    path = os.pathsep.join(
        d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))
    )
    env = {**os.environ, "PATH": path, "CUDA_HOME": "/nonexistent"}
    proc = subprocess.run(
        ["bash", ".ci/compile_cuda.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "CUDA compile check skipped" in proc.stdout


def test_import_oases_and_its_launcher_load_no_torch():
    """`import oases` binds its names lazily: it and the launcher (oases.launch, what `oases-launch`
    runs before any rank) import no torch; the first public name used loads its module."""
    probe = (
        "import sys, oases, oases.launch\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'oases.')))\n"
        "oases.train_step\n"
        "assert 'oases.training' in sys.modules and 'torch' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
