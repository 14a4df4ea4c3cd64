"""Checkpoints that do not lie, on 2 gloo ranks: checksums, fallback to the newest step that
verifies, exact steps, durable publishing, damaged checkpoints refused by name on every rank.

Each case damages the newest step (step 3) of a run saved at steps 1, 2, 3 the way real disks and
copies do (cut short after its completion file, 64 bytes flipped, files deleted, another run's
files mixed in, another format), then loads: the root falls back to step 2 on every rank with one
warning on rank 0 naming the step, the file and the reason; step=3 or the step directory raises a
ValueError naming them on every rank, and the model is unchanged. The toy MLP of test_checkpoint.
"""

import json
import os
import pickle
import re
import shutil
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import TOY_PLAN, _parallelize, _toy
from test_checkpoint_resume import _toy_step

import oases
from oases.storage import integrity as _dcp  # its MARKER, checksums, marker and _BLOCK
from oases.storage.dcp import read_metadata

from _spawn import rank_device, run_ranks

STEP3 = "step-000000003"


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _load(model, opt, path, **kw):
    """load_checkpoint, and the 'skipped' warnings it gave on this rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = oases.load_checkpoint(model, path, optimizer=opt, **kw)
    return state, [str(w.message) for w in caught if "skipped checkpoints" in str(w.message)]


def _on(rank, who, action):
    """`action()` on rank `who` alone, every rank waiting for it."""
    if rank == who:
        action()
    dist.barrier()


def _item(where, key, offset):
    """(file, offset, length) where the stored chunk of `key` at `offset` lies."""
    for index, info in read_metadata(where).storage_data.items():
        if index.fqn == key and tuple(index.offset) == offset:
            return info.relative_path, info.offset, info.length
    raise AssertionError(f"no chunk of {key} at {offset}")


def _flip(path, at, n=64):
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path, by=100):
    os.truncate(path, os.path.getsize(path) - by)


class _Recorder:
    """os.fsync / os.rename / os.replace of this process, recorded as (op, path...) in order."""

    def __enter__(self):
        self.events, self.saved = [], (os.fsync, os.rename, os.replace)
        fsync, rename, replace = self.saved

        def on_fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return fsync(fd)

        def on_rename(src, dst):
            self.events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
            return rename(src, dst)

        def on_replace(src, dst):
            self.events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
            return replace(src, dst)

        os.fsync, os.rename, os.replace = on_fsync, on_rename, on_replace
        return self

    def __exit__(self, *exc):
        os.fsync, os.rename, os.replace = self.saved

    def index(self, event):
        return self.events.index(event)

    def last(self, event):
        return len(self.events) - 1 - self.events[::-1].index(event)


def _check_integrity(rank, p, path):
    path = os.path.realpath(path)
    root = os.path.join(path, "run")
    model = _parallelize(_toy(0).to(rank_device()), None, TOY_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = {}
    for step in (1, 2, 3):
        _toy_step(model, opt, step)
        oases.save_checkpoint(model, root, optimizer=opt, step=step, extra={"step": step}, keep=3)
        saved[step] = _state(model)
    step3 = os.path.join(root, STEP3)
    w2 = _item(step3, "model.ffn.w2.weight", (0, 16))  # rank 1's half of a row-parallel weight: only it reads it

    # The marker, written last, records every file: size, crc32, and each stored item's (offset, length, crc32).
    marker = json.load(open(os.path.join(step3, _dcp.MARKER)))
    files = marker["checksums"]["files"]
    assert marker["checksums"]["algorithm"] == "crc32"
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert files["__1_0.distcp"]["size"] == os.path.getsize(os.path.join(step3, "__1_0.distcp"))
    assert [w2[1], w2[2]] in [item[:2] for item in files[w2[0]]["items"]]

    target = _parallelize(_toy(5).to(rank_device()), None, TOY_PLAN)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    state, skipped = _load(target, target_opt, root)
    assert (state.step, state.extra, skipped) == (3, {"step": 3}, []) and _same(target, saved[3])

    _on(rank, 0, lambda: shutil.copytree(step3, os.path.join(path, "pristine")))

    def restore():
        shutil.rmtree(step3)
        shutil.copytree(os.path.join(path, "pristine"), step3)

    def falls_back(reason, **kw):
        """The root loads step 2 on every rank, warned once, on rank 0; step=3 and the directory raise."""
        state, skipped = _load(target, target_opt, root, **kw)
        assert (state.step, state.path) == (2, os.path.join(root, "step-000000002")) and _same(target, saved[2])
        assert len(skipped) == (1 if rank == 0 else 0), skipped
        if rank == 0:
            assert re.search(rf"{STEP3} \({reason}", skipped[0]), skipped[0]
            assert skipped[0].endswith("; loading " + os.path.join(root, "step-000000002"))
        before = _state(target)
        for how in (dict(path=root, step=3), dict(path=step3)):
            with pytest.raises(ValueError, match=rf"checkpoint '{step3}' cannot be loaded: {reason}"):
                oases.load_checkpoint(target, how["path"], optimizer=target_opt, step=how.get("step"), **kw)
        assert _same(target, before)  # refused before anything was read into it

    # oases.verify_checkpoint: None for a sound step; why not for a damaged one, the same on every rank.
    assert oases.verify_checkpoint(step3) is None
    # A shard file cut short after the completion file was written: size, checked even with verify=False.
    _on(rank, 0, lambda: _truncate(os.path.join(step3, "__1_0.distcp")))
    assert re.match(r"__1_0\.distcp: size \d+ bytes, \d+ were written", oases.verify_checkpoint(step3) or "")
    falls_back(r"__1_0\.distcp: size \d+ bytes, \d+ were written .*found by rank 0", verify=False)
    falls_back(r"__1_0\.distcp: size")
    _on(rank, 0, restore)

    _on(rank, 0, lambda: _flip(os.path.join(step3, "__0_0.distcp"), 100, n=8))
    why = oases.verify_checkpoint(step3) or ""  # every file's whole checksum, read once between the ranks
    assert re.match(r"__0_0\.distcp: checksum: crc32 .* found by rank 1 of the group$", why), why
    _on(rank, 0, restore)

    # 64 bytes flipped in the data of an item only rank 1 reads: rank 1 finds it, every rank falls back.
    def flip_w2():
        with open(os.path.join(step3, w2[0]), "rb") as f:
            f.seek(w2[1])
            at = w2[1] + f.read(w2[2]).index(saved[3]["ffn.w2.weight"].cpu().numpy().tobytes())
        _flip(os.path.join(step3, w2[0]), at + 256)

    _on(rank, 1, flip_w2)
    falls_back(rf"{w2[0]}: checksum: bytes \[{w2[1]}, {w2[1] + w2[2]}\) have crc32 .*found by rank 1")
    state, skipped = _load(target, target_opt, root, verify=False)  # what verify=False trusts: no word
    assert (state.step, skipped) == (3, []) and _same(target, saved[3]) == (rank == 0)
    _on(rank, 0, restore)
    _on(rank, 0, lambda: _flip(os.path.join(step3, ".metadata"), 200))
    falls_back(r"\.metadata: checksum")
    _on(rank, 0, restore)

    # Half-deleted: a shard file, or DCP's .metadata, gone.
    _on(rank, 0, lambda: os.remove(os.path.join(step3, "__0_0.distcp")))
    falls_back(r"__0_0\.distcp: missing")
    _on(rank, 0, restore)
    _on(rank, 0, lambda: os.remove(os.path.join(step3, ".metadata")))
    falls_back(r"\.metadata: missing")
    _on(rank, 0, restore)

    # Mixed: another step's shard in its place, another world's shard beside them.
    _on(rank, 0, lambda: shutil.copy(os.path.join(root, "step-000000002", "__1_0.distcp"), step3))
    falls_back(r"__1_0\.distcp: (size|checksum)")
    _on(rank, 0, restore)
    _on(rank, 0, lambda: shutil.copy(os.path.join(step3, "__1_0.distcp"), os.path.join(step3, "__2_0.distcp")))
    falls_back(r"__2_0\.distcp: foreign")
    _on(rank, 0, restore)

    # The completion file: empty, or edited without its checksum.
    _on(rank, 0, lambda: open(os.path.join(step3, _dcp.MARKER), "w").close())
    falls_back(r"oases_checkpoint\.json: unreadable")
    _on(rank, 0, restore)
    edited = json.dumps(dict(marker, step=4))
    _on(rank, 0, lambda: open(os.path.join(step3, _dcp.MARKER), "w").write(edited))
    falls_back(r"oases_checkpoint\.json: checksum")
    _on(rank, 0, restore)

    # Another format version: refused by name (not skipped), on every rank, nothing read.
    newer = _dcp.marker_text(dict(marker, format=99))
    _on(rank, 0, lambda: open(os.path.join(step3, _dcp.MARKER), "w").write(newer))
    before = _state(target)
    for how in (dict(), dict(step=3)):
        with pytest.raises(ValueError, match=rf"checkpoint '{step3}' has format 99 in its oases_checkpoint.json"):
            oases.load_checkpoint(target, root, optimizer=target_opt, **how)
    assert _same(target, before)
    _on(rank, 0, restore)

    # A checkpoint without checksums (oases before them): still checked by size, from .metadata's extents.
    older = _dcp.marker_text({key: value for key, value in marker.items() if key != "checksums"})

    def unrecorded_and_cut():
        open(os.path.join(step3, _dcp.MARKER), "w").write(older)
        _truncate(os.path.join(step3, "__1_0.distcp"))

    _on(rank, 0, unrecorded_and_cut)
    falls_back(r"__1_0\.distcp: size \d+ bytes, its items end at byte \d+ \(truncated\)")
    _on(rank, 0, restore)

    # step=N: exactly that step.
    state, skipped = _load(target, target_opt, root, step=1)
    assert (state.step, skipped) == (1, []) and _same(target, saved[1])
    with pytest.raises(FileNotFoundError, match=r"step: no checkpoint '.*step-000000007' \(steps under .*: 3, 2, 1\)"):
        oases.load_checkpoint(target, root, step=7)
    with pytest.raises(ValueError, match=r"step: '.*step-000000003' is a checkpoint directory itself"):
        oases.load_checkpoint(target, step3, step=3)

    # Rotation counts only sound steps: a damaged step 3 does not push the good step 2 out.
    _on(rank, 0, lambda: _truncate(os.path.join(step3, "__0_0.distcp")))
    _toy_step(model, opt, 4)
    with _Recorder() as record:
        where = oases.save_checkpoint(model, root, optimizer=opt, step=4, keep=2)
    assert sorted(os.listdir(root)) == ["step-000000002", STEP3, "step-000000004"]
    if rank == 0:  # durable: the marker and files, then the rename, then the root's entries (after rotation too)
        partial = os.path.join(root, ".step-000000004.partial")
        published = record.index(("rename", partial, where))
        assert record.index(("fsync", partial)) < published < record.index(("fsync", root))
        assert record.last(("fsync", root)) > record.index(
            ("rename", os.path.join(root, "step-000000001"), os.path.join(root, ".step-000000001.deleting"))
        )
        assert record.index(("fsync", os.path.join(partial, _dcp.MARKER + ".tmp"))) < published
    _on(rank, 0, lambda: _truncate(os.path.join(where, "__1_0.distcp")))
    state, skipped = _load(target, target_opt, root)
    assert state.step == 2 and _same(target, saved[2])
    if rank == 0:
        assert "step-000000004 (__1_0.distcp: size" in skipped[0] and f"{STEP3} (__0_0.distcp: size" in skipped[0]

    # Every step damaged: a ValueError naming each, not a FileNotFoundError (which reads as "no checkpoint yet").
    _on(rank, 0, lambda: [_truncate(os.path.join(root, "step-000000002", "__0_0.distcp"))])
    with pytest.raises(
        ValueError, match=r"no checkpoint in '.*run' verifies: .*step-000000004 .*step-000000003 .*step-000000002"
    ):
        oases.load_checkpoint(target, root)

    # save_pretrained: each file fsynced before its rename, the directory after.
    out = os.path.join(path, "hf")
    with _Recorder() as record:
        oases.save_pretrained(model, out)
    if rank == 0:
        weights = os.path.join(out, "model.safetensors")
        renamed = record.index(("rename", os.path.join(out, ".model.safetensors.partial"), weights))
        assert record.index(("fsync", os.path.join(out, ".model.safetensors.partial"))) < renamed
        assert record.last(("fsync", out)) > renamed
    dist.barrier()
    return True


def test_damaged_checkpoints_fall_back_or_raise_by_name_on_every_rank(tmp_path):
    assert run_ranks(_check_integrity, 2, str(tmp_path), timeout=120) == [True, True]


def _pwn(flag):
    """What a hostile pickle runs: leaves `flag` behind."""
    open(flag, "w").close()
    return 0


class _Hostile:
    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return (_pwn, (self.flag,))


def _check_trust(rank, p, path):
    """trusted=False reads what oases writes (extra, RNG, the optimizer's state and groups) as
    trusted=True does, and refuses, on every rank and before running it, a pickle naming code."""
    path = os.path.realpath(path)
    root, flag = os.path.join(path, "run"), os.path.join(path, "pwned")  # extra is one copy: rank 0's
    model = _parallelize(_toy(0).to(rank_device()), None, TOY_PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _toy_step(model, opt, 1)
    extra = {"data": [3, 1.5, "shard-7", None, (1, 2)], "t": torch.arange(3), "nested": {"ok": True}}
    oases.save_checkpoint(model, root, optimizer=opt, step=1, extra=extra)
    loaded = []
    for trusted in (True, False):
        target = _parallelize(_toy(5).to(rank_device()), None, TOY_PLAN)
        target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
        torch.manual_seed(100 + rank)
        state = oases.load_checkpoint(target, root, optimizer=target_opt, trusted=trusted)
        assert state.extra["data"] == extra["data"] and torch.equal(state.extra["t"], extra["t"])
        _toy_step(target, target_opt, 2)  # the optimizer's moments and step, and the RNG, restored alike
        loaded.append((_state(target), torch.rand(4)))
    assert _same(model, loaded[0][0]) is False  # a step was taken after the save
    assert all(torch.equal(v, loaded[1][0][k]) for k, v in loaded[0][0].items())
    assert torch.equal(loaded[0][1], loaded[1][1])

    # An entry whose pickle calls a function: refused untrusted (nothing run), run trusted.
    oases.save_checkpoint(model, root, optimizer=opt, step=2, extra={"data": _Hostile(flag)})
    with pytest.raises(
        ValueError, match=r"trusted: checkpoint .*step-000000002' holds oases.extra, which names .*_pwn"
    ):
        oases.load_checkpoint(model, root, optimizer=opt, trusted=False)
    assert not os.path.exists(flag)
    oases.load_checkpoint(model, root, optimizer=opt)
    assert os.path.exists(flag)  # the reason for trusted=False
    dist.barrier()  # every rank has seen it before it goes
    _on(rank, 0, lambda: os.remove(flag))

    # DCP's .metadata replaced by a pickle naming code (no marker: read as a checkpoint of older oases).
    step1 = os.path.join(root, "step-000000001")

    def forge():
        os.remove(os.path.join(step1, _dcp.MARKER))
        with open(os.path.join(step1, _dcp.METADATA), "wb") as f:
            pickle.dump(_Hostile(flag), f)

    _on(rank, 0, forge)
    with pytest.raises(ValueError, match=r"trusted: checkpoint .*step-000000001' holds \.metadata, which names .*_pwn"):
        oases.load_checkpoint(model, step1, trusted=False)
    assert not os.path.exists(flag)
    return True


def test_untrusted_load_runs_no_pickle(tmp_path):
    assert run_ranks(_check_trust, 2, str(tmp_path), timeout=120) == [True, True]


def test_checksums_per_file_and_per_item_across_read_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(_dcp, "_BLOCK", 1000)  # items straddle the reads' blocks
    data = bytes(range(256)) * 40  # 10240 bytes
    path = str(tmp_path / "f")
    open(path, "wb").write(data)
    items = [(0, 10), (10, 2990), (3000, 7000), (3000, 0), (9990, 250), (500, 4000)]  # one overlaps others
    got = _dcp.file_checksums(path, items)
    assert (got["size"], got["crc32"]) == (len(data), zlib.crc32(data))
    assert got["items"] == [[o, n, zlib.crc32(data[o : o + n])] for o, n in sorted(items)]
    with pytest.raises(OSError, match=r"10240 bytes, but an item was written at bytes \[10000, 10500\)"):
        _dcp.file_checksums(path, [(10000, 500)])
    view = memoryview(bytearray(300))
    with open(path, "rb", buffering=0) as f:
        assert _dcp._range_crc(f, 123, 4567, view) == zlib.crc32(data[123:4690])
        with pytest.raises(EOFError):
            _dcp._range_crc(f, 10000, 500, view)

    # The marker checks itself: an edit without its checksum is found, as a value a bit off would be.
    text = _dcp.marker_text({"format": 1, "step": 3})
    open(tmp_path / _dcp.MARKER, "w").write(text)
    assert _dcp.read_marker(str(tmp_path)) == {"format": 1, "step": 3, "marker_crc32": json.loads(text)["marker_crc32"]}
    open(tmp_path / _dcp.MARKER, "w").write(text.replace('"step": 3', '"step": 4'))
    with pytest.raises(_dcp.Damaged, match=r"oases_checkpoint.json: checksum: its content does not match"):
        _dcp.read_marker(str(tmp_path))
    open(tmp_path / _dcp.MARKER, "w").write(text[:-5])
    with pytest.raises(_dcp.Damaged, match=r"oases_checkpoint.json: unreadable: not JSON"):
        _dcp.read_marker(str(tmp_path))
