"""Kill-anywhere: checkpoints survive a SIGKILL of every rank at any file operation, and damage to any file.

    dry run:  the toy MLP at TP 2 trained to step 5; steps 1, 2 saved (keep=2) and step 2 exported;
              then the save and the export of step 3 counted: each rank's file operations, in order
    kill run: for each kill point (rank r, its k-th operation: every operation but the writes, and a
              seeded write of each file: 24 points over preparing, the shard files of both ranks,
              .metadata, the marker, the publishing rename and rotation; 11 over the export), a
              fresh pair of ranks trains to step 3 and saves again over a copy of the dry run's
              directory as it was before step 3: both SIGKILLed (one killpg) right before that operation
    relaunch: the root loads step 3 if rank 0 had renamed it into place, else step 2, skipping
              nothing; the parameters and AdamW state are the dry run's bit for bit; a save over the
              leftovers and the training on to step 5 end as the dry run did; the export directory
              holds the old export or the new one, whole, and takes a new one

Besides: a cut and single bit flips in each kind of file a checkpoint holds (.distcp of each rank,
.metadata, oases_checkpoint.json) send the root back to the previous step on every rank, naming the
file, and make step= raise a ValueError naming it; a rank SIGKILLed inside load_checkpoint
(verifying, or reading data) makes its peer raise within seconds, not at the group's timeout, and a
relaunch loads; a damaged newest step of a Pipeline (PP 2) checkpoint falls back alike, and
training on from the step it loads is exact.

Replacing a step-less checkpoint (save_checkpoint(model, path) over an older one), killed at each
operation of its publishing: path holds the old checkpoint or the new one (the two directories
are exchanged in one atomic renameat2 where Linux has it). save_pretrained killed inside the
write of config.json leaves the previous one whole (configs are staged and renamed into place).

Ranks are forked from one driver process (itself started by tests/_spawn.py's forkserver) that has
this module imported: a pair starts in about a tenth of a second, in a process group of its own, so
one killpg stops both and nothing else; kill runs go two pairs at a time. Every wait is bounded.
"""

import builtins
import dataclasses
import io
import json
import os
import pickle
import random
import re
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import TOY_PLAN, _parallelize, _toy
from test_checkpoint_resume import _toy_step

import oases
from oases.storage import publish as _dcp  # its _exchange, MARKER and METADATA

import _spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, process groups, /proc")

SAVED, FINAL, KEEP = 3, 5, 2  # steps 1, 2 published before the killed save of step 3; every run ends at 5
STEP = "step-{:09d}"
PUBLISH = ("rename", f"run/.{STEP.format(SAVED)}.partial -> run/{STEP.format(SAVED)}")
EXPORT = ("replace", "hf/.model.safetensors.partial -> hf/model.safetensors")
TIMEOUT = 30.0  # seconds for one run of ranks (each takes well under one)


# --- ranks forked from one driver, in a process group of their own ----------------------------------


def _rank(fn, rank, world_size, args, timeout, pgid, port_pipe, results):
    """A forked rank: joins process group `pgid` (0: its own), gloo over a store rank 0 serves (its port
    through `port_pipe`), runs fn; (kind, value) pickled to results/<rank>. Never returns."""
    code = 1
    try:
        os.setpgid(0, pgid)
        torch.set_num_threads(1)
        read_end, write_end = port_pipe
        if rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
            )
            os.write(write_end, b"%08d" % store.port * (world_size - 1))
        else:
            if not select.select([read_end], [], [], timeout)[0]:
                raise TimeoutError(f"rank 0 served no store within {timeout} s")
            port = int(os.read(read_end, 8))
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        outcome = ("ok", fn(rank, world_size, *args))
        code = 0
    except BaseException:  # report everything, SystemExit too
        outcome = ("error", traceback.format_exc())
    try:
        with open(os.path.join(results, f"{rank}.tmp"), "wb") as f:
            pickle.dump(outcome, f)
        os.rename(os.path.join(results, f"{rank}.tmp"), os.path.join(results, str(rank)))
    finally:
        os._exit(code)


class _Group:
    """One run: fn on `world_size` ranks forked now, in a process group of their own (rank 0's);
    done() reaps them (killing the group past `timeout`); result() is [(exit code, "ok" | "error" |
    None, value)] by rank."""

    def __init__(self, fn, world_size, args, timeout):
        self.results, self.pids, self.codes = tempfile.mkdtemp(prefix="oases-ranks-"), [], {}
        self.deadline = time.monotonic() + timeout
        port_pipe = os.pipe()
        try:
            for rank in range(world_size):
                pid = os.fork()
                if pid == 0:
                    _rank(
                        fn, rank, world_size, args, timeout, self.pids[0] if self.pids else 0, port_pipe, self.results
                    )
                try:  # the parent sets it too, so the group exists before the next rank joins it
                    os.setpgid(pid, self.pids[0] if self.pids else pid)
                except (PermissionError, ProcessLookupError):  # the child was first (or is gone)
                    pass
                self.pids.append(pid)
        finally:
            for fd in port_pipe:
                os.close(fd)
        assert self.pids[0] != os.getpgid(0)

    def done(self):
        for pid in self.pids:
            if pid not in self.codes:
                reaped, status = os.waitpid(pid, os.WNOHANG)
                if reaped:
                    self.codes[pid] = os.waitstatus_to_exitcode(status)
        if len(self.codes) < len(self.pids) and time.monotonic() > self.deadline:
            os.killpg(self.pids[0], signal.SIGKILL)
        return len(self.codes) == len(self.pids)

    def result(self):
        out = []
        for rank, pid in enumerate(self.pids):
            path = os.path.join(self.results, str(rank))
            if os.path.exists(path):
                with open(path, "rb") as f:
                    out.append((self.codes[pid], *pickle.load(f)))
            else:
                out.append((self.codes[pid], None, None))
        shutil.rmtree(self.results, ignore_errors=True)
        return out


def _drive(conn, sys_path):
    """The driver: imports this module once, then runs each batch of requests (fn, world_size, args,
    timeout), `parallel` at a time, until None."""
    sys.path[:] = sys_path
    while (batch := conn.recv()) is not None:
        requests, parallel = batch
        waiting, running, results = list(enumerate(requests)), {}, [None] * len(requests)
        while waiting or running:
            while waiting and len(running) < parallel:
                i, request = waiting.pop(0)
                running[i] = _Group(*request)
            for i in [i for i, group in running.items() if group.done()]:
                results[i] = running.pop(i).result()
            time.sleep(0.002)
        conn.send(results)


class _Ranks:
    """run(fn, world_size, *args) -> [(exit code, kind, value)] by rank, the ranks forked from a driver
    process; a rank killed by a signal is a result (exit code -9). run_all(requests) runs several,
    two at a time; ok() expects every rank to finish."""

    def __init__(self):
        self.conn, there = _spawn._CONTEXT.Pipe()
        self.driver = _spawn._CONTEXT.Process(target=_drive, args=(there, list(sys.path)), daemon=True)
        self.driver.start()
        there.close()

    def run_all(self, requests, timeout=TIMEOUT, parallel=2):
        """[run(fn, world_size, *args)] of each (fn, world_size, *args) of `requests`."""
        self.conn.send(([(fn, n, args, timeout) for fn, n, *args in requests], parallel))
        wait = timeout * len(requests) / parallel + 15
        if not self.conn.poll(wait):
            raise AssertionError(f"the driver did not answer within {wait:.0f} s")
        return self.conn.recv()

    def run(self, fn, world_size, *args, timeout=TIMEOUT):
        return self.run_all([(fn, world_size, *args)], timeout)[0]

    def ok(self, fn, world_size, *args, timeout=TIMEOUT):
        outcome = self.run(fn, world_size, *args, timeout=timeout)
        failed = [f"--- rank {r}: exit code {c}\n{got}" for r, (c, kind, got) in enumerate(outcome) if kind != "ok"]
        if failed:
            raise AssertionError("distributed run failed:\n" + "\n".join(failed))
        return [value for _, _, value in outcome]

    def close(self):
        try:
            self.conn.send(None)
            self.driver.join(10)
        finally:
            if self.driver.is_alive():
                self.driver.kill()
                self.driver.join()


@pytest.fixture(scope="module")
def ranks():
    forked = _Ranks()
    yield forked
    forked.close()


# --- file operations, counted; SIGKILL at the k-th ----------------------------------------------------


class _Counted:
    """A file opened for writing whose write() calls are operations of `wire`."""

    def __init__(self, f, wire, name):
        self._f, self._wire, self._name = f, wire, name

    def write(self, data):
        self._wire.count("write", self._name)
        return self._f.write(data)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)


class _Tripwire:
    """This process's file operations under `base`, named (kind, path relative to `base`) in order:
    mkdir, rmtree, remove, rename, replace, fsync, open for writing (for reading too with `reads`) and
    each write() to a file opened for writing. With `at`: SIGKILL right before the `at`-th, to the
    process group `pgid` (every rank at once) or to this process alone (None), after writing the
    operation to base/killed."""

    _PATCHED = (
        (os, "mkdir"),
        (os, "remove"),
        (shutil, "rmtree"),
        (os, "rename"),
        (os, "replace"),
        (_dcp, "_exchange"),  # renameat2(RENAME_EXCHANGE): a ctypes call, not an os function
        (os, "fsync"),
    )

    def __init__(self, base, at=None, pgid=None, reads=False):
        self.base, self.at, self.pgid, self.reads = os.path.realpath(base), at, pgid, reads
        self.ops = []

    def name(self, path):
        return os.path.relpath(os.path.realpath(os.fspath(path)), self.base)

    def op(self, kind, *paths):
        """Count the operation `kind` on `paths` unless all are outside `base`; SIGKILL at the `at`-th."""
        names = [self.name(path) for path in paths]
        if not all(name.startswith("..") for name in names):
            self.count(kind, " -> ".join(names))

    def count(self, kind, name):
        if len(self.ops) == self.at:
            with self.open(os.path.join(self.base, "killed"), "w") as f:
                json.dump([kind, name], f)
            if self.pgid is None:
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                assert self.pgid != os.getpgid(os.getppid())  # never the driver's group
                os.killpg(self.pgid, signal.SIGKILL)
            time.sleep(60)  # the signal is on its way
        self.ops.append((kind, name))

    def _one(self, kind, call):
        def counted(path, *args, **kwargs):
            self.op(kind, path)
            return call(path, *args, **kwargs)

        return counted

    def _two(self, kind, call):
        def counted(src, dst, *args, **kwargs):
            self.op(kind, src, dst)
            return call(src, dst, *args, **kwargs)

        return counted

    def _fsync(self, fd):
        self.op("fsync", os.readlink(f"/proc/self/fd/{fd}"))
        return self.saved[-1](fd)

    def _open(self, file, mode="r", *args, **kwargs):
        if isinstance(file, int):
            return self.open(file, mode, *args, **kwargs)
        writing, name = any(c in mode for c in "wax+"), self.name(file)
        if (writing or self.reads) and not name.startswith(".."):
            self.count("open-w" if writing else "open-r", name)
        f = self.open(file, mode, *args, **kwargs)
        return _Counted(f, self, name) if writing and not name.startswith("..") else f

    def __enter__(self):
        self.saved, self.open = [getattr(module, attr) for module, attr in self._PATCHED], builtins.open
        kinds = [attr for _, attr in self._PATCHED]
        os.mkdir, os.remove, shutil.rmtree = (self._one(k, f) for k, f in zip(kinds[:3], self.saved[:3]))
        os.rename, os.replace, _dcp._exchange = (self._two(k, f) for k, f in zip(kinds[3:6], self.saved[3:6]))
        os.fsync = self._fsync
        builtins.open = io.open = self._open  # pathlib's open (DCP's files) is io.open
        return self

    def __exit__(self, *exc):
        for (module, attr), f in zip(self._PATCHED, self.saved):
            setattr(module, attr, f)
        builtins.open = io.open = self.open


def _phase(ops, k):
    """Which part of a save or an export its operation `k` belongs to."""
    kind, name = ops[k]
    if name.startswith("hf"):
        return "config" if "config.json" in name else "weights" if "model." in name else "export"
    if (kind, name) == PUBLISH:
        return "publish"
    if ".deleting" in name or (kind, name) == ("fsync", "run") and any(".deleting" in n for _, n in ops[:k]):
        return "rotation"
    for part, phase in ((".distcp", "shard"), (".metadata", "metadata"), (_dcp.MARKER, "marker")):
        if part in name:
            return phase
    return "prepare" if kind in ("rmtree", "mkdir") else "publish"


def _kill_points(ops, seed=38):
    """[(rank, k)]: every operation but the writes, and a seeded choice of one write to each file."""
    rng, points = random.Random(seed), []
    for rank, mine in enumerate(ops):
        writes = {}
        for k, (kind, name) in enumerate(mine):
            if kind == "write":
                writes.setdefault(name, []).append(k)
            else:
                points.append((rank, k))
        points += [(rank, rng.choice(ks)) for _, ks in sorted(writes.items())]
    return sorted(points)


# --- the toy run, uninterrupted ------------------------------------------------------------------------


@dataclasses.dataclass
class ToyConfig:
    """A dataclass config, so that save_pretrained writes config.json too."""

    h: int = 16
    ffn: int = 32


def _model(seed=0):
    model = _parallelize(_toy(seed), None, TOY_PLAN)
    model.config = ToyConfig()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _snapshot(model, opt):
    """{name: ndarray} of this rank's model state and AdamW state (numpy: it crosses processes)."""
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out.update({f"optim.{name}.{k}": v.numpy().copy() for k, v in opt.state[p].items()})
    return out


def _assert_exact(got, want, where):
    assert got.keys() == want.keys(), where
    for key, value in want.items():
        same = (got[key].dtype, got[key].shape) == (value.dtype, value.shape) and got[key].tobytes() == value.tobytes()
        assert same, f"{where}: {key} differs"


def _load(model, opt, path, **kw):
    """load_checkpoint, and the 'skipped' warnings it gave on this rank."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = oases.load_checkpoint(model, path, optimizer=opt, **kw)
    return state, [str(w.message) for w in caught if "skipped checkpoints" in str(w.message)]


def _save(what, model, opt, base, step):
    """The save a kill run interrupts: "run" save_checkpoint of `step` under base/run (keep=KEEP),
    "hf" save_pretrained to base/hf, "latest" a step-less checkpoint base/latest (extra: `step`)."""
    if what == "run":
        oases.save_checkpoint(model, os.path.join(base, "run"), optimizer=opt, step=step, keep=KEEP)
    elif what == "hf":
        oases.save_pretrained(model, os.path.join(base, "hf"))
    else:
        oases.save_checkpoint(model, os.path.join(base, "latest"), optimizer=opt, extra=step)


SAVES = ("run", "hf", "latest")


def _uninterrupted(rank, world_size, base):
    """Train to FINAL: steps 1, 2 saved under dry/run (keep=KEEP), step 2 also exported (dry/hf) and
    saved step-less (dry/latest), and dry/ then copied to template/; each save of step SAVED
    counted. Returns ({what: its ops}, {step: this rank's state})."""
    dry = os.path.join(base, "dry")
    model, opt = _model()
    states, ops = {}, {}
    for step in range(1, FINAL + 1):
        _toy_step(model, opt, step)
        states[step] = _snapshot(model, opt)
        if step < SAVED:
            _save("run", model, opt, dry, step)
        if step == SAVED - 1:
            _save("hf", model, opt, dry, step)
            _save("latest", model, opt, dry, step)
            if rank == 0:
                shutil.copytree(dry, os.path.join(base, "template"))
            dist.barrier()
        if step == SAVED:
            for what in SAVES:
                with _Tripwire(dry) as wire:
                    _save(what, model, opt, dry, step)
                ops[what] = wire.ops
    return ops, states


@pytest.fixture(scope="module")
def uninterrupted(ranks, tmp_path_factory):
    """(base, {"run" | "hf" | "latest": [ops by rank]}, [{step: state} by rank]) of the dry run."""
    base = str(tmp_path_factory.mktemp("faults"))
    results = ranks.ok(_uninterrupted, 2, base)
    ops = {what: [r[0][what] for r in results] for what in SAVES}
    yield base, ops, [r[1] for r in results]
    shutil.rmtree(base, ignore_errors=True)


# --- kill anywhere inside save_checkpoint and save_pretrained ------------------------------------------


def _killed(rank, world_size, base, what, who, at):
    """Train to step SAVED, then save (`what`, as `_save`); rank `who` kills both ranks right before
    its `at`-th file operation."""
    model, opt = _model()
    for step in range(1, SAVED + 1):
        _toy_step(model, opt, step)
    with _Tripwire(base, at=at if rank == who else None, pgid=os.getpgid(0)) as wire:
        _save(what, model, opt, base, SAVED)
    return wire.ops  # reached only if `at` is past the save's last operation: a failure


def _kill_all(ranks, base, tmp_path, ops, what, done, points):
    """The save `what` killed at each of `points` (rank, k), each over a copy of the template:
    [(its directory, whether rank 0 had done `done` before, the point in words)]."""
    runs = [tmp_path / f"{what}-{who}-{at}" for who, at in points]
    for run in runs:
        shutil.copytree(os.path.join(base, "template"), run)
    outcomes = ranks.run_all([(_killed, 2, str(run), what, who, at) for run, (who, at) in zip(runs, points)])
    cases = []
    for run, (who, at), exits in zip(runs, points, outcomes):
        point = f"{what}: rank {who} before {ops[who][at]}"
        assert [code for code, _, _ in exits] == [-signal.SIGKILL] * 2, (point, exits)
        with open(run / "killed") as f:
            assert tuple(json.load(f)) == ops[who][at], point  # the run did what the dry run did, up to there
        cases.append((str(run), who == 0 and at > ops[0].index(done), point))
    return cases


def _resume_each(rank, world_size, cases, states):
    """For each (base, step): base/run loads exactly `step`, bit-exact, nothing skipped; a save over
    the leftovers leaves that step and the new one only; trained on to FINAL, the dry run's state."""
    for base, step in cases:
        root, where = os.path.join(base, "run"), f"{base} (expected step {step})"
        model, opt = _model(seed=5)
        state, skipped = _load(model, opt, root)
        assert (state.step, skipped) == (step, []), (where, state.step, skipped)
        _assert_exact(_snapshot(model, opt), states[rank][step], where)
        _toy_step(model, opt, step + 1)
        oases.save_checkpoint(model, root, optimizer=opt, step=step + 1, keep=KEEP)
        assert sorted(os.listdir(root)) == [STEP.format(step), STEP.format(step + 1)], where
        for later in range(step + 2, FINAL + 1):
            _toy_step(model, opt, later)
        _assert_exact(_snapshot(model, opt), states[rank][FINAL], where)
    return True


def test_kill_anywhere_inside_save_checkpoint(ranks, uninterrupted, tmp_path):
    base, ops, states = uninterrupted
    ops = ops["run"]
    points = _kill_points(ops)
    phases = {(rank, _phase(ops[rank], k)) for rank, k in points}
    assert {p for _, p in phases} == {"prepare", "shard", "metadata", "marker", "publish", "rotation"}, phases
    assert {(0, "shard"), (1, "shard")} <= phases and len(points) >= 20, phases
    killed = _kill_all(ranks, base, tmp_path, ops, "run", PUBLISH, points)
    assert {published for _, published, _ in killed} == {True, False}
    cases = [(run, SAVED if published else SAVED - 1) for run, published, _ in killed]
    resumed = ranks.run_all([(_resume_each, 2, cases[half::2], states) for half in (0, 1)], timeout=120)
    assert [[(code, kind) for code, kind, _ in group] for group in resumed] == [[(0, "ok")] * 2] * 2, resumed


def _export(path):
    """(config.json's bytes, {key: ndarray} of model.safetensors) of an export directory."""
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json"), "rb") as f:
        config = f.read()
    json.loads(config)  # a whole JSON document
    return config, load_file(os.path.join(path, "model.safetensors"))


def _same_export(got, want):
    return (
        got[0] == want[0]
        and got[1].keys() == want[1].keys()
        and all(got[1][k].tobytes() == v.tobytes() for k, v in want[1].items())
    )


def _export_again(rank, world_size, runs):
    """A new export into each killed one's directory: its leftovers gone."""
    model, _ = _model(seed=5)
    for run in runs:
        oases.save_pretrained(model, os.path.join(run, "hf"))
        assert sorted(os.listdir(os.path.join(run, "hf"))) == ["config.json", "model.safetensors"], run
    return True


def _inside_config_write(ops, k):
    return ops[k][0] == "write" and ops[k][1].endswith("config.json")


@pytest.mark.parametrize("inside", [False, True], ids=["weights", "config-write"])
def test_kill_anywhere_inside_save_pretrained(ranks, uninterrupted, tmp_path, inside):
    """The export directory holds the old export or the new one, whole; a new export replaces it."""
    base, ops, _ = uninterrupted
    ops = ops["hf"]
    points = [(r, k) for r, k in _kill_points(ops) if _inside_config_write(ops[r], k) == inside]
    if not inside:
        assert {_phase(ops[r], k) for r, k in points} == {"export", "weights", "config"} and len(points) >= 10
    old, new = _export(os.path.join(base, "template", "hf")), _export(os.path.join(base, "dry", "hf"))
    assert not _same_export(old, new)
    exported = _kill_all(ranks, base, tmp_path, ops, "hf", EXPORT, points)
    for run, published, point in exported:
        hf = os.path.join(run, "hf")
        assert sorted(n for n in os.listdir(hf) if not n.startswith(".")) == ["config.json", "model.safetensors"]
        assert _same_export(_export(hf), new if published else old), point
    assert ranks.ok(_export_again, 2, [run for run, _, _ in exported]) == [True, True]


def _load_latest(rank, world_size, runs, states):
    """[the step (extra) each run's `latest` loads, its state checked exact; or what loading raised]."""
    steps = []
    for run in runs:
        model, opt = _model(seed=5)
        try:
            state, _ = _load(model, opt, os.path.join(run, "latest"))
        except (OSError, ValueError) as e:
            steps.append(f"{type(e).__name__}: {e}")
            continue
        _assert_exact(_snapshot(model, opt), states[rank][state.extra], run)
        steps.append(state.extra)
    return steps


def test_kill_while_replacing_a_step_less_checkpoint(ranks, uninterrupted, tmp_path):
    """save_checkpoint(model, path) over an older one: killed while publishing (before, at and after
    the one atomic exchange of the two directories), path holds the old or the new."""
    base, ops, states = uninterrupted
    ops = ops["latest"]
    new = ("_exchange", ".latest.partial -> latest")  # renameat2(RENAME_EXCHANGE): no moment without one
    assert new in ops[0] and ("rename", "latest -> .latest.deleting") not in ops[0], ops[0]
    publishing = range(ops[0].index(("fsync", ".latest.partial")), len(ops[0]))  # the marker is in, durable
    points = [(0, k) for k in publishing]
    killed = _kill_all(ranks, base, tmp_path, ops, "latest", new, points)
    got = ranks.ok(_load_latest, 2, [run for run, _, _ in killed], states)
    assert got[0] == [SAVED if published else SAVED - 1 for _, published, _ in killed], [p for _, _, p in killed]
    assert got[1] == got[0]


# --- damage to each kind of file -----------------------------------------------------------------------


def _flip_bit(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << (at % 8))]))


def _damages(sizes, seed=38):
    """[(file, "cut" | "flip", byte)]: each file cut by a byte (the marker by half), and a bit flipped
    at two seeded places of each."""
    rng = random.Random(seed)
    out = [(name, "cut", size // 2 if name == _dcp.MARKER else size - 1) for name, size in sorted(sizes.items())]
    out += [(name, "flip", rng.randrange(size)) for name, size in sorted(sizes.items()) for _ in range(2)]
    return out


def _check_damage(rank, world_size, base, states):
    """Step 2 of a copy of the template damaged each way: the root loads step 1 on every rank,
    exactly, one warning on rank 0 naming step 2 and the file; step=2 raises naming the file."""
    root = os.path.join(base, "run")
    newest = os.path.join(root, STEP.format(SAVED - 1))
    pristine = os.path.join(base, "pristine")
    sizes = {name: os.path.getsize(os.path.join(newest, name)) for name in os.listdir(newest)}
    assert sorted(sizes) == [".metadata", "__0_0.distcp", "__1_0.distcp", _dcp.MARKER]
    if rank == 0:
        shutil.copytree(newest, pristine)
    seen = []
    for name, how, at in _damages(sizes):
        where = f"{name} {how} at byte {at}"
        if rank == 0:
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            if how == "cut":
                os.truncate(os.path.join(newest, name), at)
            else:
                _flip_bit(os.path.join(newest, name), at)
        dist.barrier()
        model, opt = _model(seed=5)
        state, skipped = _load(model, opt, root)
        assert state.step == SAVED - 2, (where, state.step)
        _assert_exact(_snapshot(model, opt), states[rank][SAVED - 2], where)
        assert len(skipped) == (rank == 0), (where, skipped)
        if rank == 0:
            assert f"{newest} ({name}: " in skipped[0], (where, skipped)
            seen.append(skipped[0].split(f"{newest} ({name}: ")[1].split()[0])  # what is wrong: size, checksum, ...
        with pytest.raises(ValueError, match=re.escape(f"'{newest}' cannot be loaded: {name}: ")):
            oases.load_checkpoint(model, root, optimizer=opt, step=SAVED - 1)
        dist.barrier()
    return seen


def test_a_cut_or_a_flipped_bit_in_any_file_falls_back(ranks, uninterrupted, tmp_path):
    base, _, states = uninterrupted
    shutil.copytree(os.path.join(base, "template"), tmp_path / "copy")
    seen = ranks.ok(_check_damage, 2, str(tmp_path / "copy"), states)[0]
    assert set(seen) <= {"size", "checksum:", "unreadable:"} and "checksum:" in seen and "size" in seen, seen


# --- a rank that dies inside load_checkpoint -----------------------------------------------------------


def _dies_in_load(rank, world_size, base, who, phase):
    """Rank `who` SIGKILLs itself inside load_checkpoint, at its first opening of the marker
    (phase "verify") or of a shard file in dcp.load, after the last opening of .metadata ("read");
    the other rank, loading and then at a barrier: (what it raised, seconds it took)."""
    root = os.path.join(base, "run")
    model, opt = _model(seed=5)
    with _Tripwire(base, reads=True) as dry:  # where this rank opens what
        oases.load_checkpoint(model, root, optimizer=opt)
    names = [name for _, name in dry.ops]
    if phase == "verify":
        at = next(k for k, name in enumerate(names) if name.endswith(_dcp.MARKER))
    else:
        last = max(k for k, name in enumerate(names) if name.endswith(_dcp.METADATA))
        at = next(k for k, name in enumerate(names) if k > last and name.endswith(".distcp"))
    dist.barrier()
    start = time.monotonic()
    try:
        with _Tripwire(base, at=at if rank == who else None, reads=True):
            oases.load_checkpoint(model, root, optimizer=opt)
        dist.barrier()
    except Exception as e:  # noqa: BLE001 -- what the survivor raises is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", time.monotonic() - start
    return None, time.monotonic() - start


def _load_exact(rank, world_size, base, states):
    model, opt = _model(seed=5)
    state, skipped = _load(model, opt, os.path.join(base, "run"))
    assert (state.step, skipped) == (SAVED - 1, [])
    _assert_exact(_snapshot(model, opt), states[rank][SAVED - 1], base)
    return True


def test_a_rank_killed_inside_load_checkpoint_stops_its_peer(ranks, uninterrupted, tmp_path):
    base, _, states = uninterrupted
    run = tmp_path / "copy"
    shutil.copytree(os.path.join(base, "template"), run)
    for who, phase in ((1, "verify"), (1, "read"), (0, "read")):
        outcome = ranks.run(_dies_in_load, 2, str(run), who, phase, timeout=60)
        code, kind, value = outcome[1 - who]
        assert outcome[who][0] == -signal.SIGKILL and kind == "ok", (who, phase, outcome)
        raised, seconds = value
        assert raised is not None and seconds < 10, (who, phase, value)  # the group's timeout is 60 s
        with open(run / "killed") as f:
            assert json.load(f)[1].endswith(_dcp.MARKER if phase == "verify" else ".distcp"), (who, phase)
        os.remove(run / "killed")
    assert ranks.ok(_load_exact, 2, str(run), states) == [True, True]  # relaunched: loads


# --- a Pipeline's damaged newest step -----------------------------------------------------------------


def _pipeline():
    from torch.distributed.device_mesh import init_device_mesh

    from oases.models import GPTConfig
    from oases.pipeline import Pipeline

    config = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, mlp_ratio=2, layers=2)
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "pp", "tp"))
    return Pipeline(config, mesh, schedule="1f1b", micro_batches=2, optimizer=_adamw, seed=3)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def _pipeline_falls_back(rank, world_size, path):
    """PP 2: steps 1, 2 saved; step 2 damaged (rank 1's shard cut by a byte, or a bit of rank 0's
    flipped): step=2 raises naming the file and reads nothing; the root loads step 1 on every rank
    (one warning, on rank 0, naming step 2 and the file); trained on, step 3 is the uninterrupted one."""
    root = os.path.join(path, "ckpt")
    newest, pristine = os.path.join(root, STEP.format(2)), os.path.join(path, "pristine")
    pipe, states = _pipeline(), {}
    for step in (1, 2, 3):
        pipe.train_step(*_batch(step))
        if step < 3:
            pipe.save_checkpoint(root, step=step, keep=2)
        states[step] = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    if rank == 0:
        shutil.copytree(newest, pristine)
    for name, how, reason in (("__1_0.distcp", "cut", "size"), ("__0_0.distcp", "flip", "checksum")):
        if rank == 0:
            shutil.rmtree(newest)
            shutil.copytree(pristine, newest)
            file = os.path.join(newest, name)
            size = os.path.getsize(file)
            os.truncate(file, size - 1) if how == "cut" else _flip_bit(file, size // 2)
        dist.barrier()
        pipe = _pipeline()
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        with pytest.raises(ValueError, match=re.escape(f"checkpoint '{newest}' cannot be loaded: {name}: {reason}")):
            pipe.load_checkpoint(root, step=2)
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items()), name  # nothing read
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert pipe.load_checkpoint(root).step == 1, name
        skipped = [str(w.message) for w in caught if "skipped checkpoints" in str(w.message)]
        assert len(skipped) == (rank == 0) and all(f"{newest} ({name}: {reason}" in s for s in skipped), skipped
        assert all(torch.equal(v, states[1][k]) for k, v in pipe.state_dict().items()), name
        for step in (2, 3):  # on from step 1: the uninterrupted run's state
            pipe.train_step(*_batch(step))
        assert all(torch.equal(v, states[3][k]) for k, v in pipe.state_dict().items()), name
        pipe.close()
    return True


def test_a_damaged_pipeline_checkpoint_falls_back_on_every_rank(ranks, tmp_path):
    assert ranks.ok(_pipeline_falls_back, 2, str(tmp_path), timeout=60) == [True, True]


def test_bench_checkpoint_quick(tmp_path):
    """`python -m bench checkpoint --quick`: save, the three loads and verify_checkpoint timed on a
    real checkpoint, the parts of a save measured on each rank's own files, the checkpoints removed."""
    from test_bench import _run_suite_on_ranks

    doc, stdout, out = _run_suite_on_ranks("checkpoint", tmp_path)
    records = doc["cases"]
    ops = {r["name"]: r for r in records if r["kind"] == "operation"}
    parts = {r["name"].split(" (")[0]: r for r in records if r["kind"] == "part"}
    assert set(ops) == {"save", "load", "load verify=False", "load trusted=False", "verify_checkpoint"}, ops
    assert set(parts) == {"crc32", "checksums", "write", "fsync", "dir fsync"}, parts
    assert all(r["t"] > 0 for r in records), records
    total, own = ops["save"]["checkpoint_bytes"], parts["checksums"]["rank_bytes_max"]
    assert 0 < own < total and parts["checksums"]["bytes"] == own and parts["fsync"]["bytes"] == own
    assert parts["write"]["written_bytes"] <= total  # the ranks' shares are the checkpoint's tensor files
    for name in ("checksums", "fsync", "dir fsync"):
        assert 0 < parts[name]["share_of_save"] < 1, parts[name]
    assert "the parts of a save" in stdout and "load trusted=False" in stdout
    assert not list(out.glob("bench-checkpoint-*")), list(out.iterdir())  # cleaned up
