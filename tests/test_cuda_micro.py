"""bench.cuda_micro: the one-GPU micro-benchmarks.

On CPU: `python -m bench.cuda_micro --out DIR` exits 2 saying there is no GPU (and writes
nothing), and the pure helpers are right: the Llama GEMM shapes under TP, row chunking, input-set
rotation, the efficiency and summary arithmetic, percentiles, the copy combinations, the kernel
cases, the text and markdown tables (bench._report) and the report files; a synthetic result reads
back as bench.cuda_plots reads it; the chunked_gemm section runs on a CPU stand-in; host_times
(bench._timing) runs round-robin. On a GPU: `--quick` runs every section without an error and
writes both files. Never asserts speed.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is a package at the repository root, not installed

from bench import _cuda_copies as copies  # noqa: E402
from bench import _cuda_gemm as gemm  # noqa: E402
from bench import _report, _timing  # noqa: E402
from bench import cuda_micro as cm  # noqa: E402

SECTIONS = ("ceilings", "chunked_gemm", "triton_vs_cublas", "batched_copies", "stream_priority")


def _run(out, *options, timeout):
    # conftest sets TRITON_INTERPRET=1 for a CPU harness; the benchmark must compile for the GPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "bench.cuda_micro", "--out", str(out), *options],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_without_gpu_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    done = _run(out, timeout=60)
    assert done.returncode == cm.EXIT_NO_GPU == 2, done.stderr
    assert "no CUDA GPU" in done.stderr and "torch.cuda.is_available() is False" in done.stderr
    assert not out.exists()
    quick = _run(out, "--quick", timeout=60)
    assert quick.returncode == 2, quick.stderr


def test_unknown_section_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cm._parse(["--sections", "ceilings,nope"])
    assert exit_info.value.code == 2
    assert "nope" in capsys.readouterr().err
    assert cm._parse(["--sections", "ceilings, stream_priority"]).sections == ["ceilings", "stream_priority"]
    assert cm._parse([]).sections == list(SECTIONS) == list(cm.SECTIONS) == list(cm.BUDGETS)


def test_layer_gemms_are_the_llama_shapes_under_tp():
    shapes = {g.name: (g.M, g.N, g.K) for g in gemm.layer_gemms(gemm.LLAMA_7B, 2, 4096)}
    assert shapes == {
        "qkv": (4096, 6144, 4096),
        "attn_out": (4096, 4096, 2048),
        "gate_up": (4096, 11008, 4096),
        "down": (4096, 4096, 5504),
    }
    shapes = {g.name: (g.M, g.N, g.K) for g in gemm.layer_gemms(gemm.LLAMA_13B, 8, 8192)}
    assert shapes == {
        "qkv": (8192, 1920, 5120),
        "attn_out": (8192, 5120, 640),
        "gate_up": (8192, 3456, 5120),
        "down": (8192, 5120, 1728),
    }
    assert tuple(g.name for g in gemm.layer_gemms(gemm.TINY, 2, 256)) == gemm.GEMM_NAMES
    for model in (gemm.LLAMA_7B, gemm.LLAMA_13B):  # every tp the section uses divides every shape
        for tp in (2, 4, 8):
            gemm.layer_gemms(model, tp, 4096)
    with pytest.raises(ValueError, match="not divisible by tp = 3"):
        gemm.layer_gemms(gemm.LLAMA_7B, 3, 4096)
    assert gemm.Gemm("g", 2, 3, 5).flops == 60


def test_row_chunks_cover_the_rows_once():
    assert gemm.row_chunks(8192, 16) == [(512 * i, 512 * (i + 1)) for i in range(16)]
    assert gemm.row_chunks(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert gemm.row_chunks(2, 4) == [(0, 1), (1, 2)]
    assert gemm.row_chunks(0, 2) == []
    assert gemm.row_chunks(7, 1) == [(0, 7)]
    for rows, chunks in ((4096, 16), (1000, 7), (5, 5)):
        bounds = gemm.row_chunks(rows, chunks)
        assert bounds[0][0] == 0 and bounds[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [b - a for a, b in bounds]
        assert max(sizes) - min(sizes) <= 1
    for bad in ((-1, 2), (4, 0)):
        with pytest.raises(ValueError):
            gemm.row_chunks(*bad)


def test_rotation_sets_hold_more_than_three_l2():
    l2 = 50 << 20
    assert gemm.rotation_sets(400 << 20, l2) == 1  # one set is already 8x L2
    assert gemm.rotation_sets(150 << 20, l2) == 1  # exactly 3x
    assert gemm.rotation_sets(40 << 20, l2) == 4  # 4 x 40 MiB > 150 MiB
    assert gemm.rotation_sets(1 << 20, l2) == 8  # capped
    assert gemm.rotation_sets(1 << 20, l2, max_sets=3) == 3
    assert gemm.rotation_sets(0, l2) == 1


def test_efficiency_and_summary_arithmetic():
    eff = gemm.efficiencies({1: 2.0, 2: 2.5, 4: 4.0})
    assert eff == {1: 1.0, 2: 0.8, 4: 0.5}
    assert gemm.geomean([0.5, 2.0]) == pytest.approx(1.0)
    assert gemm.geomean([0.8]) == pytest.approx(0.8)
    for bad in ([], [1.0, 0.0], [-1.0]):
        with pytest.raises(ValueError):
            gemm.geomean(bad)
    rows = [{"eff_c2": 0.8, "eff_c4": 0.5}, {"eff_c2": 0.2, "eff_c4": 0.5}, {"eff_c2": None}]
    summary = gemm.summarize_by_chunks(rows, (1, 2, 4, 8))
    assert [r["chunks"] for r in summary] == [2, 4, 8]
    assert summary[0] == {"chunks": 2, "shapes": 2, "geomean_eff": pytest.approx(0.4), "min_eff": 0.2, "max_eff": 0.8}
    assert summary[1]["geomean_eff"] == pytest.approx(0.5) and summary[1]["shapes"] == 2
    assert summary[2] == {"chunks": 8, "shapes": 0, "geomean_eff": None, "min_eff": None, "max_eff": None}


def test_percentile_is_linear_between_ranks():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert copies.percentile(values, 0) == 1.0
    assert copies.percentile(values, 50) == 3.0
    assert copies.percentile(values, 100) == 5.0
    assert copies.percentile(values, 90) == pytest.approx(4.6)
    assert copies.percentile([7.0], 90) == 7.0
    assert copies.percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    with pytest.raises(ValueError):
        copies.percentile([], 50)


def test_copy_combos_skip_batches_over_the_cap():
    kib, mib, gib = 1 << 10, 1 << 20, 1 << 30
    combos = copies.copy_combos((16, 64, 256), (16 * kib, 256 * kib, mib, 16 * mib), 2 * gib)
    assert len(combos) == 11 and (256, 16 * mib) not in combos and (64, 16 * mib) in combos
    assert combos[:3] == [(16, 16 * kib), (64, 16 * kib), (256, 16 * kib)]
    assert max(n * s for n, s in combos) == gib
    assert copies.copy_combos((4,), (8,), 31) == []


def test_kernel_cases_put_each_kernel_on_its_gemms():
    cases = gemm.kernel_cases(gemm.LLAMA_7B, (2, 8), 8192, fp16=True)
    assert len(cases) == 9
    bf16 = [c for c in cases if c.dtype == torch.bfloat16]
    assert {(c.tp, c.gemm.name) for c in bf16} == {(tp, g) for tp in (2, 8) for g in gemm.GEMM_NAMES}
    for c in bf16:
        expected = "linear_into" if c.gemm.name in ("qkv", "gate_up") else "linear_accumulate"
        assert c.kernel == expected and c.gemm.M == 8192
    (fp16,) = [c for c in cases if c.dtype == torch.float16]
    assert (fp16.kernel, fp16.tp, fp16.gemm.name) == ("linear_into", 2, "qkv")
    assert len(gemm.kernel_cases(gemm.TINY, (2,), 256, fp16=False)) == 4


def test_cells_and_sizes():
    def cell(value):
        return _report.cell(value, cm.DIGITS)

    assert cell(None) == "n/a" and cell(True) == "yes" and cell(3) == "3"
    assert cell(0.123456) == "0.1235" and cell(2.5e-6) == "2.5e-06" and cell(999.94) == "999.9"
    assert cell(123456.7) == "123457" and cell(float("nan")) == "nan" and cell(-math.inf) == "-inf"
    # the other suites' default: two decimals below 1000
    assert _report.cell(0.123456) == "0.12" and _report.cell(1234.5) == "1234" and _report.cell(False) == "no"
    assert _report.size_label(16 << 10) == "16 KiB" and _report.size_label(1 << 20) == "1 MiB"
    assert _report.size_label(2 << 30) == "2 GiB" and _report.size_label(1536) == "1536 B"


def _table():
    return _report.Table(
        "t: a|b",
        ["name", "ms", "eff"],
        [{"name": "qkv", "ms": 1.5, "eff": None, "hidden": 1}, {"name": "x|y", "ms": 12, "eff": 0.98765}],
        ["a note"],
        digits=cm.DIGITS,
    )


def test_text_table():
    lines = _report.render(_table()).splitlines()
    assert lines[0] == "t: a|b"
    assert lines[2].split() == ["name", "ms", "eff"]
    assert lines[4].split() == ["qkv", "1.5", "n/a"]
    assert lines[5].split() == ["x|y", "12", "0.9877"]
    assert lines[1] == lines[3] == lines[6] and set(lines[1]) <= {"-", " "}
    assert lines[7] == "a note"
    assert len({len(line) for line in lines[1:7]}) == 1  # aligned columns
    assert "hidden" not in _report.render(_table())


def test_markdown_table():
    text = _report.render_markdown(_table())
    lines = text.splitlines()
    assert lines[0] == "### t: a|b" and lines[1] == ""
    assert lines[2] == "| name | ms | eff |"
    assert lines[3] == "|---|---|---|"
    assert lines[4] == "| qkv | 1.5 | n/a |"
    assert lines[5] == "| x\\|y | 12 | 0.9877 |"  # a '|' in a cell is escaped
    assert lines[6:] == ["", "- a note"]
    assert text.endswith("\n")
    assert _report.render_markdown(_report.Table("empty", ["a"])).splitlines() == ["### empty", "", "| a |", "|---|"]


def test_report_files(tmp_path):
    report = cm.Report(str(tmp_path / "r"), {"gpu": "test", "quick": True})
    ok = cm.Section("ceilings", headline="fine", info={"range": (0, -5)}, seconds=1.25)
    ok.table("ceil", ["measure", "rate"]).rows.append({"measure": "d2d", "rate": float("inf"), "extra": {1: 2}})
    failed = cm.Section("chunked_gemm", error="Traceback ...\nRuntimeError: boom\n", seconds=0.5)
    report.sections += [ok, failed]
    report.write()
    files = sorted(os.listdir(tmp_path / "r"))
    assert files == [cm.JSON_NAME, cm.MD_NAME]  # no temporary file left
    with open(tmp_path / "r" / cm.JSON_NAME) as f:
        doc = json.load(f)
    assert doc["meta"] == {"gpu": "test", "quick": True}
    assert list(doc["sections"]) == ["ceilings", "chunked_gemm"]
    s = doc["sections"]["ceilings"]
    assert s["error"] is None and s["seconds"] == 1.25 and s["headline"] == "fine" and s["info"] == {"range": [0, -5]}
    assert s["tables"] == [
        {
            "title": "ceil",
            "columns": ["measure", "rate"],
            "notes": [],
            "rows": [{"measure": "d2d", "rate": "inf", "extra": {"1": 2}}],
        }
    ]
    assert doc["sections"]["chunked_gemm"]["error"].endswith("RuntimeError: boom\n")
    md = (tmp_path / "r" / cm.MD_NAME).read_text()
    assert "## ceilings (ok, 1.25 s)" in md and "## chunked_gemm (FAILED, 0.5 s)" in md
    assert "| d2d | inf |" in md and "RuntimeError: boom" in md
    report.sections.pop()
    report.write()  # rewritten in place, as after every section
    with open(tmp_path / "r" / cm.JSON_NAME) as f:
        assert list(json.load(f)["sections"]) == ["ceilings"]


def test_jsonable():
    assert _report.jsonable({"a": (1, float("nan")), 2: torch.float16, "b": [None, True, -math.inf]}) == {
        "a": [1, "nan"],
        "2": "torch.float16",
        "b": [None, True, "-inf"],
    }


def test_a_synthetic_result_reads_back_as_the_plots_read_it(tmp_path):
    """A section filled as chunked_gemm and batched_copies fill theirs (records with keys only the
    JSON has), written by the report: the JSON keeps every key, the text and markdown show the
    columns, and bench.cuda_plots draws from it (no GPU)."""
    from bench import cuda_plots

    report = cm.Report(str(tmp_path), {"gpu": "synthetic", "torch": torch.__version__, "triton": None})
    gemms = cm.Section("chunked_gemm", seconds=1.0)
    per_layer = gemms.table("chunked_gemm: per layer = sum of its 4 GEMMs' medians", ["model", "tp", "T", "t_c1_ms"])
    for tp in (2, 4):
        per_layer.rows.append(
            {"model": "tiny", "tp": tp, "T": 256, "t_c1_ms": 1.0 / tp, "eff_c2": 0.9, "eff_c4": 0.8, "t_ms": {"1": 0.5}}
        )
    copies_ = cm.Section("batched_copies", info={"engine_path": "python"}, seconds=2.0)
    table = copies_.table("batched_copies: n fp32 tensors", ["dir", "n", "size", "engine_GBps", "x_copy"])
    for direction in ("d2h", "h2d"):
        table.rows.append(
            {
                "dir": direction,
                "n": 4,
                "size": "16 KiB",
                "total": "64 KiB",
                "engine_GBps": 12.3456,
                "to_GBps": 3.0,
                "copy_GBps": 4.0,
                "x_copy": 3.0864,
                "t_ms": {"engine": 0.005},
            }
        )
    report.sections += [gemms, copies_]
    report.write()
    with open(tmp_path / cm.JSON_NAME) as f:
        doc = json.load(f)
    (layer,) = doc["sections"]["chunked_gemm"]["tables"]
    assert layer["columns"] == ["model", "tp", "T", "t_c1_ms"] and layer["rows"][0]["eff_c2"] == 0.9
    assert layer["rows"][1]["t_ms"] == {"1": 0.5}
    text = _report.render(table)
    assert "12.35" in text and "3.086" in text and "t_ms" not in text and "total" not in text
    assert "| d2h | 4 | 16 KiB | 12.35 | 3.086 |" in (tmp_path / cm.MD_NAME).read_text()
    assert cuda_plots.plot_chunked_gemm(doc, str(tmp_path / "c.png"))
    assert cuda_plots.plot_batched_copies(doc, str(tmp_path / "b.png"))


def test_chunked_gemm_section_on_a_cpu_stand_in(tmp_path, monkeypatch):
    """The section's own work (shapes, checks, the three tables, the headline) on the CPU, a host
    clock standing in for the CUDA events: every chunked result matches the one GEMM."""

    def host_clock(fns, *, sets=1, warmup=2, iters=5, issue=None):
        if issue is not None:
            issue.update(dict.fromkeys(fns, 0.0))
        return _timing.host_times({name: (lambda fn=fn: fn(0)) for name, fn in fns.items()}, warmup=0, iters=1)

    monkeypatch.setattr(gemm, "event_times", host_clock)
    report = cm.Report(str(tmp_path), {"gpu": "cpu stand-in"})
    section = cm.Section("chunked_gemm")
    gemm.chunked_gemm(cm.Ctx(torch.device("cpu"), True, 1 << 20, report), section)
    per_gemm, per_layer, summary = section.tables
    assert [r["gemm"] for r in per_gemm.rows] == list(gemm.GEMM_NAMES)
    assert all(
        r["rel_err"] < 1e-2 and r["host_bound"] == "-" and set(r["t_ms"]) == {"1", "2", "4"} for r in per_gemm.rows
    )
    (layer,) = per_layer.rows
    assert layer["t_c1_ms"] == pytest.approx(sum(r["t_ms"]["1"] for r in per_gemm.rows))
    assert [r["chunks"] for r in summary.rows] == [2, 4] and all(r["shapes"] == 4 for r in summary.rows)
    assert section.headline.startswith("chunked_gemm geomean efficiency: c=2 ")


def test_host_times_run_round_robin_and_keep_results_until_the_sync():
    calls, synced = [], []

    def fn(name):
        def call():
            calls.append(name)
            return name

        return call

    times = _timing.host_times({"a": fn("a"), "b": fn("b")}, warmup=1, iters=3, sync=lambda: synced.append(len(calls)))
    assert calls == ["a", "b"] * 4 and set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    # warm-up: a sync before each call; timed: a sync before and after each call
    assert synced == [0, 1] + [n for i in range(2, 8) for n in (i, i + 1)]


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch, capsys):
    """The driver loop, with stand-in sections (no GPU needed): a section that raises gets its
    traceback in the JSON, what it added before raising is kept, and the next section runs."""
    seen = []

    def fails(ctx, section):
        section.table("partial", ["a"]).rows.append({"a": 1})
        seen.append(ctx.deadline)
        raise RuntimeError("boom")

    def works(ctx, section):
        assert [s.name for s in ctx.report.sections] == ["first", "second"]  # "first" was written
        section.table("fine", ["a"]).rows.append({"a": 2})
        section.headline = "all good"

    monkeypatch.setattr(cm, "SECTIONS", {"first": fails, "second": works})
    monkeypatch.setattr(cm, "BUDGETS", {"first": 1.0, "second": 1.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: (_ for _ in ()).throw(RuntimeError("x")))
    assert cm.main(["--out", str(tmp_path), "--watchdog", "60"]) == 1
    with open(tmp_path / cm.JSON_NAME) as f:
        doc = json.load(f)
    first, second = doc["sections"]["first"], doc["sections"]["second"]
    assert first["error"].rstrip().endswith("RuntimeError: boom") and first["tables"][0]["rows"] == [{"a": 1}]
    assert second["error"] is None and second["headline"] == "all good"
    assert doc["meta"]["gpu"].startswith("properties unavailable")
    assert len(seen) == 1 and math.isfinite(seen[0])
    out = capsys.readouterr().out
    assert "[first: FAILED" in out and "[second: ok" in out and "all good" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_run_on_gpu(tmp_path):
    out = tmp_path / "out"
    done = _run(out, "--quick", "--watchdog", "500", timeout=600)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    with open(out / cm.JSON_NAME) as f:
        doc = json.load(f)
    assert doc["meta"]["quick"] is True and doc["meta"]["gpu"]
    assert list(doc["sections"]) == list(SECTIONS)
    for name, section in doc["sections"].items():
        assert section["error"] is None, f"{name}: {section['error']}"
        assert section["tables"] and all(t["rows"] for t in section["tables"]), name
    assert doc["sections"]["batched_copies"]["info"]["engine_path"] in ("extension", "python")
    assert doc["sections"]["batched_copies"]["info"]["roundtrip_exact"] is True
    for row in doc["sections"]["chunked_gemm"]["tables"][0]["rows"]:
        assert row["rel_err"] < 1e-2
    for row in doc["sections"]["triton_vs_cublas"]["tables"][0]["rows"]:
        assert row["err_triton"] < 2e-2 and row["ratio"] > 0
    assert (out / cm.MD_NAME).read_text().startswith("# cuda_micro")
    assert "== summary" in done.stdout


# --- bench.cuda_plots: the PNGs of a results file (no GPU) ------------------------------------------


def test_plots_of_the_committed_h200_results(tmp_path):
    """Every plot renders from the results committed under docs/results/gpu (and a section that
    failed or is missing is skipped, not an error)."""
    import glob
    import json

    from bench import cuda_plots

    files = sorted(glob.glob(os.path.join(REPO, "docs", "results", "gpu", "*", "cuda_micro.json")))
    assert files, "no committed GPU results"
    assert cuda_plots.main([files[0], "--out", str(tmp_path)]) == 0
    for name in cuda_plots.PLOTS:
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    with open(files[0]) as f:
        results = json.load(f)
    results["sections"]["chunked_gemm"]["error"] = "boom"
    del results["sections"]["batched_copies"]
    assert not cuda_plots.plot_chunked_gemm(results, str(tmp_path / "x.png"))
    assert not cuda_plots.plot_batched_copies(results, str(tmp_path / "y.png"))
    assert cuda_plots.plot_triton_vs_cublas(results, str(tmp_path / "z.png"))
