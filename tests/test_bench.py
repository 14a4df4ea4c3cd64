"""The benchmark suite end to end: `python -m bench primitives --quick --nproc 2 --out TMP`, and
`layers --quick` on both models (`--model gpt`, `--model llama`), `pipeline --quick` on 4 ranks,
`offload --quick` and `memory --quick`; `profile --quick` on one rank with an assumed link, read
back by the planner, and `offload --parts step` on one rank; `--device` (auto, cpu, cuda): which
runs are refused before any rank starts, and what reaches the ranks.

`primitives` is the real command (re-launched on 2 gloo ranks through oases-launch by the bench
itself); the other suites run the same command line on the harness's ranks, each rank started as
the launcher starts one (RANK, LOCAL_RANK, WORLD_SIZE set): no interpreter to start for the bench,
the launcher and each rank (15-20 s a suite on 2 cores). Then checks of what each wrote: the
JSON's schema, that every case carries every figure, that the derived figures follow from the
measured ones, the PNG, and the Chrome trace. Never asserts speed (see docs/benchmarks.md: overlap
on a CPU machine). Plus the pure helpers of bench._metrics.
"""

import contextlib
import glob
import io
import json
import math
import os
import subprocess
import sys
import time

import pytest

from _spawn import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is a package at the repository root, not installed

from bench import _metrics  # noqa: E402
from bench.pipeline import GAP_PARTS, HOST_PARTS, scaled_batch  # noqa: E402
from oases.schedule.exposure import CAUSES  # noqa: E402

WORLD_SIZE = 2
SCHEDULES = ("megatron", "merak", "cross_pass", "oases", "oases-sp", "oases-selective", "oases-keep", "oases-auto")
FUSED = {"all_gather_linear", "linear_reduce_scatter", "linear_all_reduce"}
COLLECTIVES = {"ring_all_gather", "ring_reduce_scatter", "all_reduce"}
PEERS = {"serial", "serial_ring", "torch_tp", "torch_symm_mem", "torch_async"}
TIME_KEYS = ("t_compute", "t_comm", "t_serial", "t_overlap", "bound")
SWEEP_KEYS = ("chunks", "t_compute", "t_comm", "t_overlap", "bound", "efficiency", "speedup_vs_serial", "t_torch_async")


def _document(suite, out):
    """The one JSON document the suite wrote into `out`."""
    documents = glob.glob(str(out / f"{suite}-*.json"))
    documents = [d for d in documents if not d.endswith(".trace.json")]
    assert len(documents) == 1, os.listdir(out)
    with open(documents[0]) as f:
        return json.load(f)


def _device_options(nproc):
    """--device cpu where this machine has fewer GPUs than the ranks (NCCL cannot run two ranks on
    one GPU: --device auto is refused there); nothing (auto) elsewhere."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ["--device", "cpu"] if 0 < gpus < nproc else []


def _run_suite(suite, out, *options):
    """Run `python -m bench SUITE --quick [OPTIONS]` (it re-launches itself on 2 ranks through
    oases-launch); return (document, stdout, out dir)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("OASES_")
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            suite,
            "--quick",
            "--nproc",
            str(WORLD_SIZE),
            "--out",
            str(out),
            *_device_options(WORLD_SIZE),
            *options,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, f"bench failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return _document(suite, out), done.stdout, out


def _bench_rank(rank, world_size, argv):
    """One rank of `python -m bench ARGV` as oases-launch starts it (the launch environment, no
    OASES_ link variables: unshaped), on the harness's process group; (exit code, its stdout)."""
    for name in [k for k in os.environ if k.startswith("OASES_")]:
        del os.environ[name]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OASES_BENCH_RELAUNCHED="1",
    )
    from bench.__main__ import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)
    return code, printed.getvalue()


def _run_suite_on_ranks(suite, out, *options, nproc=WORLD_SIZE):
    """The ranks of `python -m bench SUITE --quick --nproc NPROC [OPTIONS]` on the harness (not
    re-launched: that path is the primitives run's); return (document, every rank's stdout, out dir)."""
    argv = [suite, "--quick", "--nproc", str(nproc), "--out", str(out), *_device_options(nproc), *options]
    results = run_ranks(_bench_rank, nproc, argv, timeout=150)
    assert [code for code, _ in results] == [0] * nproc, results
    return _document(suite, out), "".join(printed for _, printed in results), out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The quick primitives suite, run once for the module (the real command, re-launched)."""
    return _run_suite("primitives", tmp_path_factory.mktemp("bench"))


def _is_time(v):
    return isinstance(v, float) and math.isfinite(v) and v > 0


def test_run_metadata(run):
    doc, _, _ = run
    assert doc["suite"] == "primitives"
    assert doc["world_size"] == WORLD_SIZE
    assert doc["device"]["type"] == "cpu" and isinstance(doc["device"]["name"], str) and doc["device"]["name"]
    assert doc["backend"] == "gloo"
    assert doc["threads_per_rank"] == 1
    assert doc["quick"] is True
    link = doc["link"]
    assert set(link) >= {"shaped", "bandwidth", "bytes_per_s", "topology", "requested", "source"}
    assert link["shaped"] is False and link["bandwidth"] is None  # no --bandwidth given
    assert doc["versions"]["torch"] and "triton" in doc["versions"]
    assert {c["case"] for c in doc["cases"]} == FUSED | COLLECTIVES


def test_fused_cases_carry_every_figure(run):
    doc, _, _ = run
    for case in (c for c in doc["cases"] if c["kind"] == "fused"):
        name = case["case"]
        assert set(case["peers"]) == PEERS, name
        for peer_name, peer in case["peers"].items():
            assert set(peer) == {"available", "impl", "t", "reason", "note"}, (name, peer_name)
            if peer["available"]:
                assert _is_time(peer["t"]) and peer["reason"] is None, (name, peer_name)
            else:
                assert peer["t"] is None and peer["reason"], (name, peer_name)
        for peer_name in ("serial", "serial_ring", "torch_tp", "torch_async"):
            assert case["peers"][peer_name]["available"], (name, peer_name, case["peers"][peer_name])
        assert case["peers"]["serial"]["t"] == case["t_serial"]
        assert case["chunks_swept"] == sorted(set(case["chunks_swept"])) and 1 in case["chunks_swept"]
        assert all(case["shapes"]["x"][0] % c == 0 for c in case["chunks_swept"]) or name == "linear_all_reduce"
        # The medians (top level) and the minima ("min") carry the same figures, each consistent.
        assert [row["chunks"] for row in case["sweep"]] == case["chunks_swept"]
        _check_figures(name, case, {p: v["t"] for p, v in case["peers"].items()})
        _check_figures(name + " (min)", case["min"], case["min"]["peer_t"])
        assert case["min"]["t_serial"] <= case["t_serial"]
        traced = case["traced_call"]
        assert traced["chunks"] == case["best_chunks"] and traced["gemm_s"] > 0, (name, traced)


def _check_figures(name, figures, peer_t):
    for key in TIME_KEYS:
        assert _is_time(figures[key]), (name, key, figures[key])
    assert figures["bound"] == max(figures["t_compute"], figures["t_comm"]), name
    assert figures["t_serial"] == peer_t["serial"]
    for peer_name, t in peer_t.items():
        if t is None:
            assert figures["speedup"][peer_name] is None
        else:
            assert figures["speedup"][peer_name] == pytest.approx(t / figures["t_overlap"])
    best = min(figures["sweep"], key=lambda row: row["t_overlap"])
    assert figures["best_chunks"] == best["chunks"] and figures["t_overlap"] == best["t_overlap"]
    for row in figures["sweep"]:
        assert set(row) >= set(SWEEP_KEYS)
        for key in ("t_compute", "t_comm", "t_overlap", "bound"):
            assert _is_time(row[key]), (name, row)
        assert row["bound"] == max(row["t_compute"], row["t_comm"])
        _check_efficiency(row["efficiency"], figures["t_serial"], row["t_overlap"], row["bound"])
        assert row["speedup_vs_serial"] == pytest.approx(figures["t_serial"] / row["t_overlap"])
    assert peer_t["torch_async"] == min(row["t_torch_async"] for row in figures["sweep"])
    _check_efficiency(figures["efficiency"], figures["t_serial"], figures["t_overlap"], figures["bound"])


def _check_efficiency(value, serial, overlap, bound):
    if serial - bound <= _metrics.MIN_HIDEABLE * serial:
        assert value is None
    else:
        assert value == pytest.approx((serial - overlap) / (serial - bound))


def test_torch_symm_mem_peer_is_reported(run):
    doc, _, _ = run
    cases = {c["case"]: c for c in doc["cases"]}
    for name in ("all_gather_linear", "linear_reduce_scatter"):
        peer = cases[name]["peers"]["torch_symm_mem"]
        # On CPU the fused op has no kernel: either its fallback ran (with a note) or it is n/a.
        assert peer["note"] or peer["reason"], peer
    assert cases["linear_all_reduce"]["peers"]["torch_symm_mem"]["available"] is False


def test_collective_cases(run):
    doc, _, _ = run
    for case in (c for c in doc["cases"] if c["kind"] == "collective"):
        for key in ("t_ours", "t_torch", "algbw_ours", "algbw_torch", "busbw_ours", "busbw_torch"):
            assert _is_time(case[key]), (case["case"], key)
        assert isinstance(case["bytes"], int) and case["bytes"] > 0
        assert case["algbw_ours"] == pytest.approx(case["bytes"] / case["t_ours"])
        assert case["busbw_ours"] == pytest.approx(
            _metrics.bus_bandwidth(case["collective"], case["bytes"], case["t_ours"], WORLD_SIZE)
        )
        assert case["speedup_vs_torch"] == pytest.approx(case["t_torch"] / case["t_ours"])


def test_table_on_stdout_once(run):
    _, stdout, _ = run
    assert stdout.count("fused ops at the best chunk count") == 1  # rank 0 only
    assert "collectives" in stdout


def test_png_and_trace(run):
    doc, _, out = run
    png = doc["files"]["png"]
    assert png and os.path.dirname(png) == str(out)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(doc["files"]["trace"]) as f:
        trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert set(e) >= {"name", "ts", "dur", "pid", "tid"}
        assert e["ts"] >= 0 and e["dur"] >= 0
    for rank in range(WORLD_SIZE):
        mine = [e for e in events if e["pid"] == rank]
        assert any(e["tid"] == 0 and e["name"] == "gemm" for e in mine), rank
        assert any(e["tid"] == 1 and e["name"] == "wait" for e in mine), rank
        for name in FUSED:  # each fused op was traced, with its GEMMs inside its span
            span = [e for e in mine if e["tid"] == 2 and e["name"].startswith(name + " ")]
            assert len(span) == 1, (rank, name)
            start, stop = span[0]["ts"], span[0]["ts"] + span[0]["dur"]
            inside = [e for e in mine if e["tid"] == 0 and start <= e["ts"] <= stop]
            assert inside, (rank, name)


def test_efficiency_guard():
    assert _metrics.efficiency(100.0, 60.0, 50.0) == pytest.approx(0.8)
    assert _metrics.efficiency(100.0, 120.0, 50.0) == pytest.approx(-0.4)
    assert _metrics.efficiency(100.0, 99.0, 95.0) is None  # serial ≈ bound: undefined
    assert _metrics.efficiency(100.0, 90.0, 110.0) is None  # serial under the bound
    assert _metrics.bound(3.0, 4.0) == 4.0


def test_chunk_counts():
    assert _metrics.chunk_counts(2, 1024) == [1, 2, 4, 8]
    assert _metrics.chunk_counts(4, 1024) == [1, 2, 4, 8, 16]
    assert _metrics.chunk_counts(3, 6) == [1, 2, 3, 6]
    assert _metrics.chunk_counts(2, 3) == [1]


def test_bus_bandwidth():
    assert _metrics.bus_bandwidth("all_gather", 100, 1.0, 4) == pytest.approx(75.0)
    assert _metrics.bus_bandwidth("all_reduce", 100, 1.0, 4) == pytest.approx(150.0)


def test_suite_options_checked_before_ranks_start(tmp_path, monkeypatch, capfd):
    """A suite's own option refused by the launching process (bench's main, outside a launch):
    argparse's message once, exit code 2, and no rank started (no launcher line, no output folder)."""
    from bench.__main__ import main

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit:
        main(["layers", "--model", "nonsense", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert exit.value.code == 2, err
    assert err.count("invalid choice: 'nonsense'") == 1 and "oases-launch" not in err
    assert not (tmp_path / "o").exists()


def test_layers_suite(tmp_path):
    """The quick layers suite: every schedule and the PyTorch TP peer, with consistent figures."""
    from bench._threads import thread_schedstat

    doc, stdout, _ = _run_suite_on_ranks("layers", tmp_path)
    assert doc["suite"] == "layers" and stdout.count("layers: GPT") == 1
    records = {r["schedule"]: r for r in doc["cases"]}
    _check_layers_records(records, ("torch_tp",))
    assert records["megatron"]["config"]["model"] == "gpt"
    layers = records["megatron"]["config"]["layers"]
    assert records["megatron"]["all_reduces"] == 6 * layers
    assert records["oases"]["all_reduces"] == 8 * layers  # 4 per layer, each as two sub-batch halves
    # q, k, v and fc1 each all-reduce their input's gradient: 2 forward and 4 backward per layer
    assert {kind: c["calls"] for kind, c in records["torch_tp"]["collectives"].items()} == {"all_reduce": 6 * layers}
    assert records["torch_tp"]["sent_bytes"] == records["megatron"]["sent_bytes"]  # as many, as large
    assert 0 < records["oases"]["t_grad_check"] < records["megatron"]["t_step"]  # the invariant's cost, timed
    with open(doc["files"]["trace"]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(WORLD_SIZE))
    assert {e["tid"] for e in events} == {0, 1, 4}  # steps, the waits inside them, all-reduces in flight
    in_flight = [e for e in events if e["tid"] == 4 and e["name"].startswith("oases all_reduce")]
    assert len(in_flight) == WORLD_SIZE * records["oases"]["all_reduces"]
    assert "layers: where the waits went" in stdout and "comm CPU" in stdout
    # the transfers' CPU on the rank that waited most: gloo's threads, measured from /proc; a
    # compute-only step of the same schedule would use next to none (an upper bound: the step's span)
    for name in SCHEDULES:  # (the -sp variant's communicator thread also computes: not measured there)
        e = records[name]["exposure"]
        if name.endswith("-sp"):
            assert e["comm_cpu"] is None, (name, e)
        else:
            assert e["comm_cpu"] is not None and 0 <= e["comm_cpu"] <= 2 * e["step"], (name, e)
        # the main thread's wait for a core beside the transfers, over a step of compute alone (schedstat)
        if thread_schedstat() is None:
            assert e["queued"] is None, (name, e)
        else:
            assert e["queued"] is not None and abs(e["queued"]) < e["step"], (name, e)


def test_other_threads_cpu_counts_other_threads_only():
    """bench._threads: a busy second thread's CPU is counted, the caller's own is not."""
    import threading

    from bench._threads import OtherThreadsCPU

    def spin(seconds):  # `seconds` of this thread's own CPU
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    with OtherThreadsCPU() as alone:
        spin(0.3)  # the caller's own CPU: not counted
    worker = threading.Thread(target=spin, args=(0.3,))
    with OtherThreadsCPU() as other:
        worker.start()
        worker.join()
    # (other threads of this process, e.g. a harness's, may use some CPU in both blocks alike)
    assert alone.seconds is not None and other.seconds is not None, (alone.seconds, other.seconds)
    assert other.seconds - alone.seconds >= 0.2 and alone.seconds < 0.2, (alone.seconds, other.seconds)


def test_thread_schedstat_counts_time_queued_for_a_cpu():
    """bench._threads.thread_schedstat: the calling thread's run-queue wait grows while a process on
    the same CPU competes for it (at least about as much as its own time on the CPU: the two share
    it, other load only adds), not while it sleeps."""
    from bench._threads import thread_schedstat

    if thread_schedstat() is None:
        pytest.skip("no /proc/thread-self/schedstat figures on this kernel")

    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    on0, queued0 = thread_schedstat()
    time.sleep(0.2)  # blocked: neither on a CPU nor queued
    on1, queued1 = thread_schedstat()
    assert on1 - on0 < 0.05 and queued1 - queued0 < 0.05, (on1 - on0, queued1 - queued0)
    os.sched_setaffinity(0, {cpu})  # this thread and a spinning process share one CPU
    rival = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # the rival is running
        on1, queued1 = thread_schedstat()
        end, deadline = time.thread_time() + 0.2, time.perf_counter() + 10.0
        while time.thread_time() < end and time.perf_counter() < deadline:  # 0.2 s of this thread's CPU
            pass
        on2, queued2 = thread_schedstat()
    finally:
        rival.kill()
        rival.wait()
        os.sched_setaffinity(0, before)
    assert on2 - on1 > 0.1 and queued2 - queued1 > 0.5 * (on2 - on1), (on2 - on1, queued2 - queued1)


def _check_layers_records(records, peers):
    """What every layers run reports, whatever the model: our schedules' figures, the peers' own."""
    assert set(records) == set(SCHEDULES) | set(peers)
    for name in SCHEDULES:
        r = records[name]
        assert all(_is_time(r[k]) for k in ("t_step", "t_compute", "t_comm", "bound")), name
        assert r["bound"] == max(r["t_compute"], r["t_comm"]) and 0 <= r["busy"] <= 1, name
        assert r["collectives"] is None and r["collective_calls"] == r["all_reduces"] > 0, name
        # the exposure breakdown of one recorded step: the causes and the ring steps add up to the
        # waits (no ring steps without sequence parallelism); megatron's are all dependency
        e = r["exposure"]
        assert set(e["causes"]) == set(CAUSES) and all(v >= 0 for v in e["causes"].values()), name
        assert sum(e["causes"].values()) == pytest.approx(e["recorded"], rel=1e-6), name
        assert e["recorded"] + e["unattributed"] == pytest.approx(e["waited"], rel=1e-6), name
        assert sum(e["by_phase"].values()) == pytest.approx(e["recorded"], rel=1e-6), name
        if not name.endswith("-sp"):
            assert e["unattributed"] == pytest.approx(0, abs=1e-9) and 0 < e["waited"] < e["step"], name
    megatron = records["megatron"]["exposure"]
    assert megatron["causes"]["dependency"] == pytest.approx(megatron["waited"])
    assert records["oases-sp"]["exposure"]["unattributed"] > 0  # its gathers and scatters: ring steps, unsplit
    for name in ("cross_pass", "oases"):  # two sub-batches: the other one's compute could cover each wait
        causes = records[name]["exposure"]["causes"]
        assert causes["dependency"] < 0.5 * sum(causes.values()), name
    for name, r in records.items():
        assert r["loss"] == pytest.approx(records["megatron"]["loss"], rel=1e-4), name
        assert math.isclose(r["speedup_vs_megatron"], records["megatron"]["t_step"] / r["t_step"]), name
        assert set(r["speedup_vs"]) == set(peers), name
        for peer in peers:
            assert math.isclose(r["speedup_vs"][peer], records[peer]["t_step"] / r["t_step"]), (name, peer)
        assert r["speedup_vs_torch_tp"] == r["speedup_vs"]["torch_tp"]
        assert isinstance(r["sent_bytes"], int) and r["sent_bytes"] > 0, name
        assert r["peak_mib"] is None or r["peak_mib"] >= 0, name
    # no recomputation of a GEMM: graphs kept, no inputs saved (auto: the quick model fits any machine, all kept)
    kept = ("oases-keep", "oases-selective", "oases-auto")
    assert all(records[name]["checkpoint_mib"] > 0 for name in SCHEDULES if name not in kept)
    for name in kept:
        assert records[name]["checkpoint_mib"] == 0, name
        assert records[name]["all_reduces"] == records["oases"]["all_reduces"], name
    assert records["oases-sp"]["checkpoint_mib"] == pytest.approx(records["oases"]["checkpoint_mib"] / WORLD_SIZE)
    assert all(records[name]["checkpoint_mib"] is None for name in peers)
    for name in peers:
        r = records[name]
        assert _is_time(r["t_step"]) and r["t_compute"] is r["t_comm"] is r["bound"] is r["busy"] is None, name
        assert r["peer"]["impl"].startswith(("parallelize_module(", "LlamaForCausalLM.")) and r["peer"]["plan"], name
        sent = sum(_metrics.ring_bytes(kind, c["bytes"], WORLD_SIZE) for kind, c in r["collectives"].items())
        assert r["sent_bytes"] == round(sent), name
        assert r["collective_calls"] == sum(c["calls"] for c in r["collectives"].values()), name
    assert 3 * records["oases"]["sent_bytes"] == 2 * records["megatron"]["sent_bytes"]


def test_layers_suite_llama(tmp_path):
    """The quick layers suite on transformers' LlamaForCausalLM (oases.parallelize + oases.train_step)
    beside torchtitan's DTensor plan, DTensor TP without sequence parallelism and transformers' native
    TP (tp_plan="auto"): same loss (and, in the bench, every peer gradient against the unsharded
    model), the collectives each peer issues. transformers' TP is left out, with its reason printed,
    only where the bench says it cannot run (a CPU run with a GPU visible to the ranks)."""
    import torch

    from bench import _llama

    doc, stdout, _ = _run_suite_on_ranks("layers", tmp_path, "--model", "llama")
    assert doc["suite"] == "layers" and stdout.count("layers: HF LlamaForCausalLM") == 1
    assert doc["command"][-2:] == ["--model", "llama"]
    records = {r["schedule"]: r for r in doc["cases"]}
    hf_reason = _llama.hf_tp_unavailable(torch.device(doc["device"]["type"]))
    if hf_reason:
        assert f"{_llama.HF_TP} skipped: {hf_reason}" in stdout
    _check_layers_records(records, ("torch_tp", "torch_tp_nosp") + (() if hf_reason else ("hf_tp",)))
    config = records["megatron"]["config"]
    assert config["model"] == "llama" and config["vocab"] % WORLD_SIZE == 0
    assert config["heads"] % WORLD_SIZE == 0 and config["kv_heads"] % WORLD_SIZE == 0
    assert config["attn_implementation"] == "sdpa" and config["tie_word_embeddings"] is False
    assert config["vocab_parallel"] is False  # as examples/train_llama.py: a tiny vocabulary replicated
    assert "ours: embedding and LM head replicated, as examples/train_llama.py" in stdout
    layers = config["layers"]
    assert records["megatron"]["all_reduces"] == 6 * layers
    assert records["oases"]["all_reduces"] == 8 * layers

    titan = records["torch_tp"]
    plan = titan["peer"]["plan"]
    assert plan["model.embed_tokens"].startswith(
        "RowwiseParallel(input_layouts=(Replicate(),), output_layouts=(Shard(dim=1),)"
    )
    assert plan["lm_head"].startswith("ColwiseParallel(input_layouts=(Shard(dim=1),), output_layouts=(Shard(dim=-1),)")
    assert "use_local_output=False" in plan["lm_head"] and "loss_parallel" in titan["peer"]["impl"]
    for norm in ("model.norm", "model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm"):
        assert plan[norm].startswith("SequenceParallel("), norm
    assert "'hidden_states': Shard(dim=1)" in plan["model.layers.*.self_attn"]
    assert plan["model.layers.*.mlp"].startswith("PrepareModuleInput(input_layouts=(Shard(dim=1),)")
    for proj in ("self_attn.o_proj", "mlp.down_proj"):
        assert "output_layouts=(Shard(dim=1),)" in plan[f"model.layers.*.{proj}"], proj
    # Sequence parallelism, per step: each block's two inputs all-gathered and two outputs
    # reduce-scattered, and the LM head's input, the embedding's output; backward the duals.
    # All-reduces: loss_parallel's three (max, sum of exponentials, target logit) and the
    # sequence-parallel norms' weight gradients (2 per layer and the final norm).
    calls = {kind: c["calls"] for kind, c in titan["collectives"].items()}
    assert calls == {
        "all_gather_into_tensor": 2 * (2 * layers + 1),
        "reduce_scatter_tensor": 2 * (2 * layers + 1),
        "all_reduce": 3 + 2 * layers + 1,
    }
    # Megatron's layout: one all-reduce per sublayer forward and one backward (q/k/v share theirs).
    nosp = records["torch_tp_nosp"]
    assert {kind: c["calls"] for kind, c in nosp["collectives"].items()} == {"all_reduce": 4 * layers}
    assert nosp["sent_bytes"] * 3 == records["megatron"]["sent_bytes"] * 2  # no recomputed all-reduces
    # transformers' native TP (tp_plan="auto"), its own plan: per layer an all-reduce after o_proj and
    # down_proj, and in backward one per colwise projection's input gradient (q, k, v, gate, up); the
    # vocabulary-parallel embedding's output and the LM head's input gradient; the logits all-gathered.
    if hf_reason is None:
        hf = records["hf_tp"]
        assert hf["peer"]["plan"]["model.layers.*.self_attn.q_proj"] == "colwise"
        assert hf["peer"]["plan"]["model.layers.*.mlp.down_proj"] == "rowwise"
        assert hf["peer"]["plan"]["model.embed_tokens"] == "embedding_rowwise"
        assert hf["peer"]["plan"]["lm_head"] == "colwise_gather_output"
        assert "tp_plan" in hf["peer"]["impl"] or "maybe_distribute_model" in hf["peer"]["impl"]
        assert {kind: c["calls"] for kind, c in hf["collectives"].items()} == {
            "all_gather_into_tensor": 1,
            "all_reduce": 7 * layers + 2,
        }

    with open(doc["files"]["trace"]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(WORLD_SIZE))
    assert {e["tid"] for e in events} == {0, 1, 4}  # steps, waits, all-reduces in flight
    for rank in range(WORLD_SIZE):
        names = {e["name"] for e in events if e["pid"] == rank and e["tid"] == 0}
        peers = ("torch_tp", "torch_tp_nosp") + (() if hf_reason else ("hf_tp",))
        assert names >= {f"{s} step" for s in (*SCHEDULES, *peers)}, rank


def test_pipeline_suite(tmp_path):
    """The quick pipeline suite on 4 ranks (PP2 x DP2, unshaped): every schedule, same losses,
    consistent figures, a timeline per variant and the trace's compute / PP / DP rows."""
    from bench._threads import thread_schedstat

    def parts_of(r):
        return sum(r[k] for k in ("dp_exposed", "pp_wait", "fwd", "bwd", "host"))

    doc, stdout, _ = _run_suite_on_ranks("pipeline", tmp_path, nproc=4)
    assert doc["suite"] == "pipeline" and doc["world_size"] == 4 and stdout.count("pipeline: GPT") == 1
    records = {r["variant"]: r for r in doc["cases"]}
    layers = records["1f1b"]["config"]["layers"]
    expected = {"gpipe", "1f1b"} | {f"aiao-ns{ns}" for ns in (1, 2, 4) if layers % (2 * ns) == 0}
    assert set(records) == expected | {"aiao-ns2-nopre", "aiao-auto"}
    assert not records["aiao-ns2-nopre"]["preemption"] and records["aiao-ns2"]["preemption"]
    auto = records["aiao-auto"]  # segments and r chosen from the times measured on the first step
    assert layers % (2 * auto["segments"]) == 0 and 0 < auto["dp_overlap_ratio"] <= 1
    assert all(auto["measured"][k] > 0 for k in ("forward_s", "backward_s", "dp_comm_s", "pp_comm_s"))
    for name, r in records.items():
        assert r["losses"] == pytest.approx(records["1f1b"]["losses"], rel=1e-5), name
        assert _is_time(r["t_iter"]) and r["t_iter_min"] <= r["t_iter"], name
        assert r["speedup_vs_1f1b"] == pytest.approx(records["1f1b"]["t_iter"] / r["t_iter"]), name
        for key in (
            "dp_exposed",
            "pp_wait",
            "fwd",
            "bwd",
            "send_latency",
            "recv_latency",
            "deferred_chunks",
            "forced_chunks",
            "overlapped_chunks",
        ):
            assert math.isfinite(r[key]) and r[key] >= 0, (name, key)
        assert r["fwd"] > 0 and r["bwd"] > 0 and r["dp_chunks"] > 0, name
        assert r["peak_mib"] is None or r["peak_mib"] >= 0, name
        assert len(r["timeline"]) == 4, name  # one list of spans per rank
        for rank, spans in enumerate(r["timeline"]):
            rows = {row for row, _, _, _ in spans}
            assert rows == {"compute", "pp", "dp"}, (name, rank, rows)
            assert all(stop >= start >= 0 for _, _, start, stop in spans), (name, rank)
    assert records["aiao-ns2-nopre"]["deferred_chunks"] == 0  # nothing held back without preemption
    assert _is_time(records["1f1b"]["dp_alone"]) and _is_time(records["1f1b"]["pp_idle"])
    base = records["1f1b"]
    assert base["config"]["regime"] == "given" and base["config"]["calibration"] == []
    assert base["config"]["steps_per_call"] == 1
    for name, r in records.items():  # the regime the run was in: the stage's DP sync alone / its compute
        assert r["stage_compute"] == pytest.approx(base["fwd"] + base["bwd"]), name
        assert r["dp_to_compute"] == pytest.approx(r["dp_alone"] / r["stage_compute"]), name
        # against 1f1b with its DP sync hidden: the parts add up to the gap, each from the record's figures
        # from one rank's figures: the rank that finished last, and 1f1b's on that rank
        gap, ranks = r["gap"], r["by_rank"]
        assert len(ranks) == 4 and gap["rank"] == max(range(4), key=lambda i: ranks[i]["t_iter"]), name
        mine, theirs = ranks[gap["rank"]], base["by_rank"][gap["rank"]]
        assert mine["t_iter"] <= r["t_iter"] * 1.0001 and gap["t_iter"] == mine["t_iter"], name  # MAX over ranks
        assert gap["ideal"] == pytest.approx(theirs["t_iter"] - theirs["dp_exposed"]), name
        assert gap["dp_exposed"] == mine["dp_exposed"], name
        assert gap["bubble"] == pytest.approx(mine["pp_wait"] - theirs["pp_wait"]), name
        assert gap["compute_slowed"] == pytest.approx(mine["fwd"] + mine["bwd"] - theirs["fwd"] - theirs["bwd"]), name
        meeting = ("input_check", "loss_sum")
        assert gap["meeting"] == pytest.approx(sum(mine[k] - theirs[k] for k in meeting)), name
        timed = ("optimizer", "send_wait", "dp_launch", "threads_close")
        assert set(meeting + timed) == set(HOST_PARTS)
        assert gap["host_timed"] == pytest.approx(sum(mine[k] - theirs[k] for k in timed)), name
        assert set(gap) >= set(GAP_PARTS), name
        # every figure from one call (medians taken key by key would not add up to its wall time), and
        # the timed host parts inside its host time (no region counted twice); with the part checks
        # above, gap - rest is then the timed parts and rest the untimed host time
        for fig in (mine, theirs):
            assert parts_of(fig) == pytest.approx(fig["t_iter"]), (name, fig)
            assert sum(fig[k] for k in HOST_PARTS) <= fig["host"] + 1e-6, (name, fig)
        for k in HOST_PARTS:
            assert gap[k] == pytest.approx(mine[k] - theirs[k]), (name, k)
        assert mine["optimizer"] > 0 and mine["input_check"] > 0 and 0 < mine["host"] < mine["t_iter"], (name, mine)
        if thread_schedstat() is not None:  # the kernel's count of the main thread's time queued for a core
            assert 0 <= mine["queued_compute"] and 0 <= mine["queued"] < mine["t_iter"], (name, mine)
            for k in ("queued", "queued_compute"):
                assert gap[k] == pytest.approx(mine[k] - theirs[k]), (name, k)
        else:  # not measured: None in the JSON
            assert mine["queued"] is None and gap["queued"] is None, (name, mine, gap)
        assert mine["comm_cpu"] > 0, name  # that rank's gloo threads ran its DP sync
        assert math.isfinite(r["comm_cpu"]) and r["comm_cpu"] > 0, name  # gloo's threads did the DP sync
    assert base["gap"]["gap"] == pytest.approx(base["by_rank"][base["gap"]["rank"]]["dp_exposed"])
    assert base["gap"]["compute_slowed"] == 0 and base["gap"]["bubble"] == 0
    assert "with its DP sync hidden" in stdout
    with open(doc["files"]["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(doc["files"]["trace"]) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        assert {e["tid"] for e in events if e["pid"] == rank} == {0, 1, 2, 3}, rank


def test_pipeline_probe_counts_a_launch_inside_a_dp_wait_as_the_wait():
    """bench.pipeline._Probe: DP launches are host time, except the deferred launch SegmentSync.wait
    makes first, which is the wait's (no time counted twice); the optimizer's step is timed."""
    from types import SimpleNamespace

    from bench.pipeline import _Probe

    def pause(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    sync = SimpleNamespace(launch=lambda segment: pause(0.02), launch_deferred=lambda: pause(0.05))
    sync.wait = lambda segment: (sync.launch_deferred(), pause(0.01))  # as SegmentSync.wait: launch first
    optimizer = SimpleNamespace(step=lambda: pause(0.03))
    scheduler = SimpleNamespace(
        track=lambda *a, **k: None, all_reduce=lambda *a, **k: None, close=lambda: None, reset_counters=lambda: None
    )
    comm = SimpleNamespace(recv=lambda *a, **k: None, wait_sends=lambda: None)
    pipe = SimpleNamespace(
        sync=sync,
        comm=comm,
        scheduler=scheduler,
        optimizers=[optimizer],
        register_action_wrapper=lambda wrapper: None,
        register_phase_wrapper=lambda wrapper: None,
    )
    probe = _Probe(pipe, 0)
    pipe.sync.wait(0)
    assert probe.dp_wait >= 0.06 and probe.host["dp_launch"] == 0.0, (probe.dp_wait, probe.host)
    pipe.sync.launch(0)
    pipe.sync.launch_deferred()
    assert 0.07 <= probe.host["dp_launch"] < probe.dp_wait + 0.05, probe.host
    pipe.optimizers[0].step()
    assert probe.host["optimizer"] >= 0.03, probe.host


def test_pipeline_balanced_regime(tmp_path):
    """--regime balanced: the global batch comes from two calibration passes (each scales the
    batch by its DP sync / compute ratio), every variant runs at it with the same losses."""
    doc, _, _ = _run_suite_on_ranks("pipeline", tmp_path, "--regime", "balanced", nproc=4)
    records = {r["variant"]: r for r in doc["cases"]}
    config = records["1f1b"]["config"]
    assert config["regime"] == "balanced" and len(config["calibration"]) == 2
    assert config["steps_per_call"] == 3  # each DP sync may overlap the next step's forwards
    unit, start = config["dp"] * config["micro_batches"], config["calibration"][0]["batch"]
    batch = start
    for step in config["calibration"]:
        assert step["batch"] == batch and _is_time(step["dp_sync_s"]) and _is_time(step["stage_compute_s"])
        assert step["ratio"] == pytest.approx(step["dp_sync_s"] / step["stage_compute_s"])
        batch = scaled_batch(batch, step["ratio"], unit=unit, cap=32 * start)
    assert config["batch"] == batch and batch % unit == 0
    for name, r in records.items():
        assert r["losses"] == pytest.approx(records["1f1b"]["losses"], rel=1e-5), name
        assert r["dp_to_compute"] == pytest.approx(r["dp_alone"] / r["stage_compute"]), name


def test_scaled_batch():
    """The balanced regime's batch: batch x ratio in whole units of dp x micro-batches, bounded."""
    assert scaled_batch(16, 3.2, unit=8, cap=512) == 48
    assert scaled_batch(16, 1.0, unit=8, cap=512) == 16
    assert scaled_batch(16, 0.1, unit=8, cap=512) == 8  # at least one row per micro-batch and replica
    assert scaled_batch(16, 100.0, unit=8, cap=512) == 512  # at most the cap
    assert scaled_batch(16, 100.0, unit=8, cap=20) == 24  # the cap rounded up to whole units


def test_offload_suite(tmp_path):
    """The quick offload suite on 2 ranks: copy paths give tensors back and report throughput, the
    TP schedule and the AIAO pipeline train to the same loss with offload on and off, and the AIAO
    checkpoints kept on the device fall from m x ns forward actions' worth to at most two."""
    doc, stdout, _ = _run_suite_on_ranks("offload", tmp_path)
    assert doc["suite"] == "offload" and stdout.count("offload: AIAO pipeline") == 1
    copies = [r for r in doc["cases"] if r["kind"] == "copy"]
    assert [r["tensors"] for r in copies] == [1, 2, 4, 8, 16, 32, 64]
    for r in copies:
        assert all(v > 0 and math.isfinite(v) for v in r["gb_per_s"].values()), r
        assert r["calls_per_round_trip"]["ours"] == 2 and r["calls_per_round_trip"]["to"] == 2 * r["tensors"]
    step = next(r for r in doc["cases"] if r["kind"] == "step")
    assert step["copies_out"] == step["copies_in"] > 0 and _is_time(step["t_step"]["on"])
    aiao = next(r for r in doc["cases"] if r["kind"] == "aiao")
    m, ns = aiao["micro_batches"], aiao["segments"]
    assert aiao["peak_resident_bytes"]["off"] == m * ns * aiao["action_bytes"]
    assert 0 < aiao["peak_resident_bytes"]["on"] <= 2 * aiao["action_bytes"]
    assert aiao["copies_out"] == aiao["copies_in"] >= m * ns
    assert aiao["host_and_device_memory"] == "the same RAM"  # said in the JSON: this CPU has one memory
    with open(doc["files"]["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_memory_suite(tmp_path):
    """The quick memory suite on 2 ranks: every layout and phase measured beside a positive
    prediction, the optimizer-state figures, the PNG; no memory figure is asserted (RSS moves
    with the allocator and the machine), and the temporary model and checkpoints are removed."""
    doc, stdout, out = _run_suite_on_ranks("memory", tmp_path)
    phases = ("build", "load_pretrained", "train", "save_checkpoint", "load_checkpoint", "save_pretrained")
    assert doc["suite"] == "memory" and stdout.count("memory: optimizer state per rank") == 1
    cases = {(c["dp"], c["tp"], c["zero"]): c for c in doc["cases"]}
    assert set(cases) == {(1, WORLD_SIZE, False), (2, WORLD_SIZE // 2, False), (2, WORLD_SIZE // 2, True)}
    for key, case in cases.items():
        assert [p["phase"] for p in case["phases"]] == list(phases), key
        for p in case["phases"]:
            built = p["phase"] == "build"  # init_weights=False: nothing written, nothing resident predicted
            assert (p["predicted_bytes"] == 0) == built and p["predicted_peak_bytes"] >= p["predicted_bytes"], (key, p)
            assert len(p["per_rank"]) == WORLD_SIZE, key
            for name in ("resident_bytes", "peak_bytes", "tensor_bytes"):
                assert isinstance(p[name], int), (key, name)
            if not built:
                assert p["ratio"] == pytest.approx(p["resident_bytes"] / p["predicted_bytes"]), key
        state = case["optimizer_state"]
        assert state["moment_bytes"] > 0 and state["predicted_bytes"] > 0 and state["master_bytes"] >= 0, key
        assert len(case["train_steps"]) == doc["cases"][0]["config"]["steps"], key
    assert doc["cases"][0]["full_parameter_bytes"] > 0 and doc["cases"][0]["config"]["vocab"] % WORLD_SIZE == 0
    with open(doc["files"]["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not [name for name in os.listdir(out) if name.startswith(".memory-")]


def _no_launch_env(monkeypatch):
    """bench's main as the launching parent: no launch environment."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_device_refusal():
    """--device against the GPUs torch sees: cpu always runs; cuda needs a GPU per rank (NCCL
    cannot run two ranks on one GPU), and so does auto where a GPU is visible."""
    from bench.__main__ import device_refusal

    assert device_refusal("cpu", 16, 1, 1) is None and device_refusal("cpu", 4, 2, 0) is None
    assert device_refusal("auto", 4, 2, 0) is None  # no GPU: gloo on the CPU, as always
    assert device_refusal("cuda", 1, 1, 1) is None and device_refusal("auto", 2, 1, 2) is None
    no_gpu = device_refusal("cuda", 1, 1, 0)
    assert "no GPU" in no_gpu and "--device cpu" in no_gpu
    for device in ("cuda", "auto"):
        shared = device_refusal(device, 2, 1, 1)
        assert "NCCL cannot run two ranks on one GPU" in shared, shared
        assert "--nproc 1 or fewer" in shared and "--device cpu" in shared, shared
    assert "--hosts 2" in device_refusal("cuda", 2, 2, 2)
    # --share-gpu: any number of ranks on one GPU, each its own host; never without a GPU or on cpu
    assert device_refusal("cuda", 4, 1, 1, share_gpu=True) is None and device_refusal("auto", 3, 1, 1, True) is None
    assert "--share-gpu" in device_refusal("cuda", 2, 1, 1)  # the refusal names the way out
    assert "no GPU" in device_refusal("cuda", 2, 1, 0, share_gpu=True)
    assert "--device cuda" in device_refusal("cpu", 2, 1, 1, share_gpu=True)
    assert "torch sees no GPU here: drop --share-gpu" in device_refusal("auto", 2, 1, 0, share_gpu=True)
    assert "give no --hosts" in device_refusal("cuda", 4, 2, 1, share_gpu=True)
    with pytest.raises(ValueError, match="device: expected one of auto, cpu, cuda"):
        device_refusal("tpu", 1, 1, 0)


def test_choose_device_on_cpu():
    """bench._context.choose_device: cpu is gloo on the CPU; auto follows torch; cuda without a GPU
    is a ValueError that names the fix."""
    import torch

    from bench._context import choose_device

    assert choose_device("cpu", 3) == (torch.device("cpu"), "gloo")
    if torch.cuda.is_available():
        assert choose_device("auto", 0) == (torch.device("cuda", 0), "nccl")
        return
    assert choose_device("auto", 0) == (torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match="--device cuda: torch sees no GPU.*--device cpu"):
        choose_device("cuda", 0)


def test_device_cuda_refused_without_gpu(tmp_path, monkeypatch, capfd):
    """`--device cuda` on a machine without a GPU: refused by the launching process, exit 2,
    nothing started or written."""
    import torch

    from bench.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _no_launch_env(monkeypatch)
    with pytest.raises(SystemExit) as exit:
        main(["primitives", "--device", "cuda", "--quick", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert exit.value.code == 2 and "--device cuda: torch sees no GPU" in err and "--device cpu" in err, err
    assert not (tmp_path / "o").exists()


def test_device_cpu_reaches_the_ranks(tmp_path, monkeypatch):
    """--device cpu: the launcher gets the same arguments (--device cpu for every rank) and an
    environment with no GPU visible (CUDA_VISIBLE_DEVICES empty); auto leaves the GPUs alone."""
    import bench.__main__ as bench_main

    _no_launch_env(monkeypatch)
    launched = []

    class _Started:
        def __init__(self, command, env):
            launched.append((command, env))

        def wait(self):
            return 0

    monkeypatch.setattr(bench_main.subprocess, "Popen", _Started)
    argv = ["offload", "--device", "cpu", "--nproc", "4", "--quick", "--out", str(tmp_path)]
    assert bench_main.main(argv) == 0
    command, env = launched[-1]
    assert command[-len(argv) :] == argv and env["CUDA_VISIBLE_DEVICES"] == ""
    assert command[command.index("--nproc") + 1] == "4"
    auto = ["offload", "--nproc", "1", "--quick", "--out", str(tmp_path)]
    if bench_main._device_refusal(bench_main._parser()[0].parse_args(auto)) is None:
        assert bench_main.main(auto) == 0
        visible = launched[-1][1].get("CUDA_VISIBLE_DEVICES")
        assert visible == os.environ.get("CUDA_VISIBLE_DEVICES")  # auto: as the caller has it


def test_share_gpu_reaches_the_launcher(tmp_path, monkeypatch):
    """--share-gpu (the GPU check assumed passed): the launcher is asked for --share-gpu and every
    rank gets the same command line (--share-gpu with it: their JSON labels the shared GPU)."""
    import bench.__main__ as bench_main

    _no_launch_env(monkeypatch)
    launched = []

    class _Started:
        def __init__(self, command, env):
            launched.append(command)

        def wait(self):
            return 0

    monkeypatch.setattr(bench_main.subprocess, "Popen", _Started)
    monkeypatch.setattr(bench_main, "_device_refusal", lambda args: None)  # as where a GPU is visible
    argv = ["link", "--device", "cuda", "--share-gpu", "--nproc", "3", "--quick", "--out", str(tmp_path)]
    assert bench_main.main(argv) == 0
    command = launched[-1]
    launcher = command[: command.index("bench")]
    assert launcher[1:3] == ["-m", "oases.launch"] and "--share-gpu" in launcher
    assert launcher[launcher.index("--nproc") + 1] == "3" and command[-len(argv) :] == argv


def _assert_refused(suite, cases, tmp_path, capfd):
    """Each (options, message) of `cases`: `python -m bench suite ...` exits 2 saying `message`
    before any rank starts (nothing written)."""
    from bench.__main__ import main

    for options, message in cases:
        with pytest.raises(SystemExit) as exit:
            main([suite, "--device", "cpu", "--quick", "--out", str(tmp_path / "o"), *options])
        err = capfd.readouterr().err
        assert exit.value.code == 2 and message in err, (options, err)
    assert not (tmp_path / "o").exists()


def test_profile_one_rank_needs_an_assumed_link(tmp_path, monkeypatch, capfd):
    """profile --nproc 1 without --assume-link, or --assume-link on 2 ranks, or a latency without
    a unit: refused before any rank starts, with the fix in the message."""
    _no_launch_env(monkeypatch)
    cases = [
        (["--nproc", "1"], "pass --assume-link RATE[,LATENCY]"),
        (["--nproc", "2", "--assume-link", "1gbit"], "only for one rank (--nproc 1)"),
        (["--nproc", "1", "--assume-link", "10gbit,50"], "expected a number with a unit s, ms, us or ns"),
    ]
    _assert_refused("profile", cases, tmp_path, capfd)


def test_profile_one_rank_with_assumed_link_plans(tmp_path):
    """`python -m bench profile --device cpu --nproc 1 --quick --assume-link 10gbit,50us` (on the
    harness's one rank): compute, head and memory measured, the overlap skipped, the link stated
    and marked assumed; the planner loads the profile (collectives by its ring formulas from that
    link) and `oases plan` plans Llama-7B on 16 devices with it."""
    from oases.cli import main as oases_main
    from oases.planner import load_profile

    path = tmp_path / "p.json"
    doc, stdout, _ = _run_suite_on_ranks(
        "profile", tmp_path, "--device", "cpu", "--assume-link", "10gbit,50us", "--profile-out", str(path), nproc=1
    )
    assert doc["world_size"] == 1 and doc["device"]["type"] == "cpu" and doc["device"]["requested"] == "cpu"
    assert "p2p (assumed)" in stdout and "not measured: overlap" in stdout
    with open(path) as f:
        profile = json.load(f)
    assert profile["world_size"] == 1 and profile["element_bytes"] == 4 and profile["dtype"] == "float32"
    assert profile["compute"] and profile["head"] and profile["memory"]
    assert all(_is_time(c["forward_s"]) for c in profile["compute"])
    assert profile["overlap"] is None and profile["overlap_efficiency"] == 1.0
    assert set(profile["chunk_efficiency"]) <= {"2", "4"} and profile["chunk_efficiency"]  # --quick: 2, 4
    assert all(0 < e <= 2 for e in profile["chunk_efficiency"].values())
    assert set(profile["skipped"]) == {"collectives", "overlap"}
    link = profile["assumed"]["link"]
    assert link["bytes_per_s"] == 1.25e9 and link["latency_s"] == pytest.approx(50e-6)
    fit = profile["collectives"]["p2p"]["2"]
    assert fit["assumed"] is True and fit["samples"] == [] and fit["bytes_per_s"] == 1.25e9
    assert profile["collectives"]["all_reduce"] == {} and profile["collectives"]["all_gather"] == {}

    loaded = load_profile(str(path))
    assert loaded.link_bytes_per_s == 1.25e9 and loaded.latency_s == pytest.approx(50e-6)
    n = 2**20
    assert loaded.collective_time("p2p", 2, n) == pytest.approx(50e-6 + n / 1.25e9)
    assert loaded.collective_time("all_reduce", 4, n) == pytest.approx(2 * 3 * 50e-6 + 2 * 3 / 4 * n / 1.25e9)
    plan_path = tmp_path / "plan.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = oases_main(
            [
                "plan",
                "--model",
                "llama-7b",
                "--world",
                "16",
                "--device-memory",
                "80GB",
                "--profile",
                str(path),
                "--out",
                str(plan_path),
            ]
        )
    assert code == 0 and "predicted step" in printed.getvalue()
    assert "measured chunked-GEMM efficiency 2: " in printed.getvalue()
    with open(plan_path) as f:
        plan = json.load(f)
    assert plan["profile"]["chunk_efficiency"] == {k: pytest.approx(v) for k, v in profile["chunk_efficiency"].items()}
    assert isinstance(plan["chunks"], int) and plan["chunks"] >= 1


def test_profile_memory_in_dtype():
    """The memory section counts a layer's parameters and a row's input in --dtype (the modules
    built on the meta device)."""
    import torch

    from bench.profile import measure_memory
    from oases.models import GPTConfig

    config = GPTConfig(vocab_size=64, seq_len=16, hidden=64, heads=8, layers=1)
    fp32, bf16 = measure_memory(config, [1, 2]), measure_memory(config, [1, 2], torch.bfloat16)
    h, f = 64, 256
    params = (h * 3 * h + 3 * h + h * h + h + 2 * h) + (h * f + f + f * h + h + 2 * h)  # attention + MLP, norms
    assert fp32[0]["layer_param_bytes"] == 4 * params and bf16[0]["layer_param_bytes"] == 2 * params
    assert fp32[0]["input_bytes_per_row"] == 16 * 64 * 4 and bf16[0]["input_bytes_per_row"] == 16 * 64 * 2
    assert fp32[1]["layer_param_bytes"] < fp32[0]["layer_param_bytes"]


def test_offload_step_on_one_rank(tmp_path):
    """`offload --parts step` on one rank with the --step-* sizes: the step alone, sized as asked
    (under bf16 autocast), the same loss with offload on and off; on a CPU no device peak memory
    (None)."""
    doc, stdout, _ = _run_suite_on_ranks(
        "offload",
        tmp_path,
        "--device",
        "cpu",
        "--parts",
        "step",
        "--step-hidden",
        "96",
        "--step-heads",
        "4",
        "--step-layers",
        "3",
        "--step-seq",
        "24",
        "--step-batch",
        "4",
        "--step-autocast",
        "bfloat16",
        "--step-memory-peak",
        nproc=1,
    )
    assert [r["kind"] for r in doc["cases"]] == ["step"]
    assert "offload: GPT oases schedule, TP 1, hidden 96, 4 heads, 3 layers, batch 4 x 24" in stdout
    assert "round trips" not in stdout and "AIAO" not in stdout
    step = doc["cases"][0]
    assert step["config"] == {
        "hidden": 96,
        "layers": 3,
        "heads": 4,
        "batch": 4,
        "seq_len": 24,
        "tp": 1,
        "autocast": "bfloat16",
    }
    assert "bfloat16 autocast" in stdout
    assert _is_time(step["t_step"]["off"]) and _is_time(step["t_step"]["on"])
    assert step["copies_out"] == step["copies_in"] > 0
    assert step["peak_device_bytes"] == {"off": None, "on": None} and step["peak_device_ratio_on_off"] is None
    assert step["step_device_ratio_on_off"] is None
    assert step["step_device_bytes"] == {"off": None, "on": None}
    assert step["peak_live"] is None  # the allocator's history is CUDA's
    assert doc["files"]["png"] is None  # the figure needs the copies too


def _frames(*names):
    return [
        {"filename": f"/x/python_api/oases/schedule/{n}.py", "line": 10 + i, "name": n} for i, n in enumerate(names)
    ] + [{"filename": "/usr/lib/torch/nn/linear.py", "line": 1, "name": "fwd"}]


def test_live_at_peak_replays_the_allocator_trace():
    """The peak above the start and the blocks live then: frees of blocks from before the trace
    count (at their request), a block freed late (record_stream: requested, completed later) leaves
    at its request, a completion alone moves nothing (its request came before the trace); the
    groups follow the project's innermost frames."""
    from bench._memory_peak import frame_label, live_at_peak

    def a(addr, size, *names):
        return {"action": "alloc", "addr": addr, "size": size, "frames": _frames(*names)}

    def req(addr, size):
        return {"action": "free_requested", "addr": addr, "size": size}

    def done(addr, size):
        return {"action": "free_completed", "addr": addr, "size": size}

    events = [
        a(1, 100, "ckpt"),
        a(2, 50, "work"),  # 150
        req(99, 40),
        done(99, 40),  # 110: a block from before the trace
        req(2, 50),
        a(3, 200, "work"),  # 260: the peak (block 2 requested, completion pending)
        done(2, 50),  # no change: already counted at its request
        done(77, 100),  # a completion alone (requested before): no change
        req(1, 100),
        a(4, 90, "late"),  # 250 < 260
        {"action": "segment_alloc", "addr": 7, "size": 1 << 30},
    ]
    peak, at, live = live_at_peak(events)
    assert (peak, at) == (260, 5)
    assert sorted(e["addr"] for e in live) == [1, 3]
    assert live_at_peak([]) == (0, None, [])
    assert frame_label(_frames("inner", "outer", "top", "more"), depth=2) == "inner.py:10 inner < outer.py:11 outer"
    assert frame_label([{"filename": "/usr/lib/torch/x.py", "line": 3, "name": "f"}]) == "x.py:3 f"
    assert frame_label([]) == "?"


def test_offload_step_options_checked(tmp_path, monkeypatch, capfd):
    """The step's heads must divide its hidden size and split over the ranks; unknown parts are
    refused; all before any rank starts."""
    _no_launch_env(monkeypatch)
    cases = [
        (["--nproc", "1", "--step-hidden", "96", "--step-heads", "5"], "does not divide the step's hidden"),
        (["--nproc", "2", "--step-heads", "3", "--step-hidden", "96"], "pick a multiple of 2"),
        (["--parts", "step,nope"], "unknown part(s) ['nope']"),
    ]
    _assert_refused("offload", cases, tmp_path, capfd)


def test_parse_assume_link():
    """--assume-link RATE[,LATENCY]: the rate as --bandwidth reads it (tc syntax), the latency
    with its unit (30us when left out); anything else a ValueError naming the option."""
    from bench.profile import parse_assume_link, parse_latency

    link = parse_assume_link("25gbit,20us")
    assert link["bytes_per_s"] == 25e9 / 8 and link["latency_s"] == pytest.approx(20e-6)
    assert parse_assume_link("750mbit")["latency_s"] == pytest.approx(30e-6)
    assert [parse_latency(t) for t in ("0.5ms", "1e-5s", "800ns", "2 us")] == pytest.approx([5e-4, 1e-5, 8e-7, 2e-6])
    for bad in ("25gbit,20", "fast,20us", "25gbit,20us,1", ",20us"):
        with pytest.raises(ValueError, match="--assume-link"):
            parse_assume_link(bad)


def test_hf_tp_peer_skipped_on_cpu_where_a_gpu_is_visible(monkeypatch):
    """transformers puts its TP mesh on a visible GPU: a CPU run there skips the peer, saying why
    (on the H200 machine the CPU harness's bench layers test failed on it)."""
    import torch

    from bench import _llama

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = _llama.hf_tp_unavailable(torch.device("cpu"))
    assert reason and "--device cpu hides the GPUs" in reason
    assert _llama.hf_tp_unavailable(torch.device("cuda", 0)) == _llama.hf_tp_unavailable()  # a GPU run keeps it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _llama.hf_tp_unavailable(torch.device("cpu")) == _llama.hf_tp_unavailable()


def test_trainer_suite(tmp_path):
    """The quick trainer suite (one run): OasesTrainer, Trainer on transformers' own TP and a 1-rank
    Trainer, from the same first loss, with figures that follow from one another."""
    doc, stdout, _ = _run_suite_on_ranks("trainer", tmp_path, "--runs", "1")
    assert doc["suite"] == "trainer" and stdout.count("trainer: HF LlamaForCausalLM") == 1
    records = {r["variant"]: r for r in doc["cases"]}
    assert set(records) == {"oases", "hf_tp", "1 rank"} and len(doc["cases"]) == 3
    for name, r in records.items():
        assert _is_time(r["t_step"]) and _is_time(r["t_min"]) and r["t_min"] <= r["t_step"], name
        assert r["steps_per_s"] == pytest.approx(1 / r["t_step"]), name
        assert r["loss_first"] == pytest.approx(records["1 rank"]["loss_first"], rel=1e-4), name
    ours = records["oases"]
    for peer in ("hf_tp", "1 rank"):
        assert ours["speedup_vs"][peer] == pytest.approx(records[peer]["t_step"] / ours["t_step"])
        assert ours["speedup_low"][peer] == ours["speedup_vs"][peer]  # one run: its own ratio
    core = ours["core"]
    assert all(_is_time(core[k]) for k in ("t_train_step", "t_megatron", "t_compute", "t_comm")), core
    assert core["bound"] == max(core["t_compute"], core["t_comm"]) and core["all_reduces"] > 0
    _check_efficiency(core["efficiency"], core["t_megatron"], core["t_train_step"], core["bound"])
    with open(doc["files"]["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_link_suite_reports_both_ops_at_every_size(tmp_path):
    """The quick link suite: all_reduce and ring_p2p at 64 KiB, 256 KiB and 1 MiB, with positive
    times and bus bandwidths that follow from them (busbw = algbw * 2(p-1)/p for all_reduce)."""
    from bench.link import sizes

    assert sizes(1) == [64 * 1024, 256 * 1024, 1024 * 1024] and sizes(0) == [64 * 1024]
    doc, printed, _ = _run_suite_on_ranks("link", tmp_path)
    cases = doc["cases"]
    assert sorted((c["op"], c["bytes"]) for c in cases) == sorted(
        (op, size) for op in ("all_reduce", "ring_p2p") for size in sizes(1)
    )
    for case in cases:
        assert case["t"] > 0 and case["t_min"] <= case["t"]
        factor = 2 * (WORLD_SIZE - 1) / WORLD_SIZE if case["op"] == "all_reduce" else 1.0
        assert case["busbw_gb_s"] == pytest.approx(factor * case["bytes"] / case["t"] / 1e9)
    assert "link: 2 ranks" in printed and "1 MiB" in printed
