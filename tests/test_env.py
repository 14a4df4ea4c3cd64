"""`oases env` / `python -m oases.env`: the bug-report screen (text and JSON, every field), robust
probes, and `--probe-link` (outside a launch: usage and exit 2; inside oases-launch over a shaped
200mbit link: the rate it prints is the link's, as root with network namespaces and tc).

The command-line runs are real processes with hard timeouts; the launch is stopped with SIGTERM
(which deletes its namespaces) if it overruns.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
import time

import pytest

import oases
from oases import _env_report, env
from oases.cli import main as oases_main
from oases.launch import parse_bandwidth
from oases.planner.profile import parse_link

from _spawn import finish_process

pytestmark = pytest.mark.timeout(60)
OASES_SCRIPT = os.path.join(os.path.dirname(sys.executable), "oases")  # the console script (setup.py)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launch's variables (the test may itself run under one)."""
    names = set(env.TORCHRUN_VARIABLES) | {"GROUP_WORLD_SIZE"}
    out = {k: v for k, v in os.environ.items() if k not in names and not k.startswith("OASES_")}
    out.update(extra)
    return out


def _start(argv: list[str], environ: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)


def _label(key: str) -> str:
    return env._LABELS.get(key, key.replace("_", " "))


def test_command_lines_print_every_field():
    """(a) `python -m oases.env` (text) and the console script's `oases env --json` exit 0 with every
    field. Both start at once: each pays torch's import."""
    script = [OASES_SCRIPT] if os.path.exists(OASES_SCRIPT) else [sys.executable, "-m", "oases"]
    procs = {
        "text": _start([sys.executable, "-m", "oases.env"], _clean_env(OASES_MARK="text")),
        "json": _start([*script, "env", "--json"], _clean_env(OASES_MARK="json", LOCAL_RANK="0", MASTER_PORT="29511")),
    }
    done = {name: finish_process(proc, 50) for name, proc in procs.items()}

    code, text, err = done["text"]
    assert code == 0, err
    lines = text.splitlines()
    assert lines[0].startswith("oases env")
    for section, keys in env.FIELDS.items():
        assert env._TITLES.get(section, section) in lines, section
        for key in keys:
            assert any(line.startswith(f"  {_label(key)}:") for line in lines), (section, key)
    assert any(line.split() == ["version:", oases.__version__] for line in lines)
    assert "OASES_MARK=text" in text
    assert not any(line.startswith("  torchrun:") and "RANK" in line for line in lines)  # none set

    code, out, err = done["json"]
    assert code == 0, err
    report = json.loads(out)
    assert list(report) == list(env.FIELDS)
    for section, keys in env.FIELDS.items():
        assert set(keys) <= set(report[section]), section
    assert report["oases"]["version"] == oases.__version__
    assert report["python"]["executable"]
    assert isinstance(report["torch"]["cuda_available"], bool) and isinstance(report["torch"]["gloo"], bool)
    assert isinstance(report["extension"]["built"], bool)
    assert isinstance(report["gpus"]["devices"], list)
    assert report["environment"]["torchrun"] == {"LOCAL_RANK": "0", "MASTER_PORT": "29511"}
    assert report["environment"]["oases"] == {"OASES_MARK": "json"}
    shaping = report["link_shaping"]
    assert isinstance(shaping["root"], bool)
    assert shaping["network_namespace"] == "works" or shaping["network_namespace"].startswith(("refused", "not tried"))


def test_probe_link_outside_a_launch_exits_2(monkeypatch, capsys):
    """(c) through every entry point (python -m oases.env, oases env, python -m oases env): no
    RANK/WORLD_SIZE -> how to run it, exit 2; and the other usage errors."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert env.main(["--probe-link"]) == 2
    err = capsys.readouterr().err
    assert "not inside a launch" in err and "oases-launch --nproc 2 --bandwidth 1gbit -m oases.env --probe-link" in err
    assert oases_main(["env", "--probe-link", "--json"]) == 2
    captured = capsys.readouterr()
    assert "not inside a launch" in captured.err and captured.out == ""
    monkeypatch.setattr(sys, "argv", ["oases", "env", "--probe-link"])
    with pytest.raises(SystemExit) as exit_status:
        runpy.run_module("oases", run_name="__main__")  # python -m oases env --probe-link
    assert exit_status.value.code == 2
    assert "not inside a launch" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert env.main(["--probe-link"]) == 2
    assert "needs 2 or more ranks" in capsys.readouterr().err
    assert env.main(["--probe-link", "--sizes", "1MiB"]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_collect_reports_a_failing_probe_and_goes_on(monkeypatch):
    """A probe that raises becomes "error: ..." in its value; a failing section gives it to every key;
    the text still renders; environment variables are read at call time."""

    def broken() -> dict:
        raise RuntimeError("no torch here")

    monkeypatch.setitem(env._SECTIONS, "torch", broken)
    monkeypatch.setitem(env._SECTIONS, "python", lambda: {"version": lambda: 1 / 0, "executable": lambda: "x"})
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("OASES_BANDWIDTH", "1gbit")
    report = env.collect()
    assert report["torch"] == {key: "error: RuntimeError: no torch here" for key in env.FIELDS["torch"]}
    assert report["python"]["version"].startswith("error: ZeroDivisionError")
    assert report["python"]["executable"] == "x"
    assert report["environment"]["torchrun"]["RANK"] == "3"
    assert report["environment"]["oases"]["OASES_BANDWIDTH"] == "1gbit"
    text = env.render(report)
    assert "error: RuntimeError: no torch here" in text and "RANK=3" in text
    json.dumps(report)  # JSON types only


def test_commands_time_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(env.CommandTimeout, match="timed out after 0.3 s"):
        env._command(["sleep", "20"], 0.3)
    assert time.monotonic() - start < 5
    assert env._guarded(lambda: env._command(["/nonexistent/tool"], 1)).startswith("error: FileNotFoundError")


@pytest.mark.parametrize(
    "bytes_per_s, text",
    [
        (25e6, "200mbit"),
        (125e6, "1gbit"),
        (3.125e9, "25gbit"),
        (24.8e6, "198mbit"),
        (93.75e6, "750mbit"),
        (1500.0, "12kbit"),
    ],
)
def test_format_link_is_what_oases_plan_link_reads(bytes_per_s, text):
    assert env.format_link(bytes_per_s) == text
    assert parse_link(text) == pytest.approx(bytes_per_s, rel=5e-3)


def test_probe_summary_fits_the_samples_and_prints_the_link(monkeypatch):
    """The fit is the planner's (LinkFit.from_samples): samples of 0.1 ms + n / 25 MB/s give 200mbit."""
    monkeypatch.setenv("OASES_BANDWIDTH", "200mbit")
    monkeypatch.setenv("OASES_TOPOLOGY", "shared")
    sizes = [2**16, 2**18, 2**20, 2**22]
    p2p = [(n, 1e-4 + n / 25e6) for n in sizes]
    gathered = [(n, 2e-4 + n / 25e6) for n in sizes]  # 2 ranks sharing one link: the ring sees R / 2
    result = env.summarize_probe(p2p, gathered, world_size=2, repeats=3)
    assert result["link"] == "200mbit" and result["requested"] == "200mbit"
    assert result["latency_s"] == pytest.approx(1e-4, rel=1e-6)
    assert result["p2p"]["bytes_per_s"] == pytest.approx(25e6, rel=1e-6)
    assert result["all_gather"]["ring_link_bytes_per_s"] == pytest.approx(12.5e6, rel=1e-6)
    text = env.render_probe(result)
    assert "link: 200mbit   latency: 0.100 ms" in text
    assert "--link 200mbit" in text and "concurrent transfers share the link" in text
    json.dumps(result)


@pytest.mark.timeout(90)
def test_probe_link_on_a_shaped_launch_measures_the_set_rate():
    """(b) 2 ranks of oases-launch over a shaped 200mbit link: the p2p rate --probe-link reports
    (and the --link text it prints) is within 20% of 200mbit."""
    ok, why = env.shaping_status()
    if not ok:
        pytest.skip(f"oases-launch cannot shape links here: {why}")
    proc = _start(
        [
            sys.executable,
            "-m",
            "oases.launch",
            "--nproc",
            "2",
            "--bandwidth",
            "200mbit",
            "-m",
            "oases.env",
            "--probe-link",
            "--json",
            "--sizes",
            "64KiB,256KiB,1MiB,4MiB",
            "--repeats",
            "3",
            "--timeout",
            "60",
        ],
        _clean_env(),
    )
    code, out, err = finish_process(proc, 75)
    assert code == 0, err
    assert "cannot shape" not in err, err
    result = json.loads(out)  # rank 0's only: the other rank prints nothing
    requested = parse_bandwidth("200mbit")
    assert result["requested"] == "200mbit" and result["world_size"] == 2
    assert 0.8 <= result["p2p"]["bytes_per_s"] / requested <= 1.2, result
    assert 0.8 <= parse_link(result["link"]) / requested <= 1.2, result
    assert result["latency_s"] >= 0 and math.isfinite(result["latency_s"])
    assert [n for n, _ in result["all_gather"]["samples"]] == [2**16, 2**18, 2**20, 2**22]
    assert result["all_gather"]["bytes_per_s"] > 0


def _fake_tools(folder, ip_body: str) -> str:
    """A PATH holding only an `ip` running `ip_body` and a `tc` that succeeds."""
    for name, body in (("ip", ip_body), ("tc", "exit 0")):
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return str(folder)


@pytest.mark.parametrize(
    "ip_body, expected",
    [
        (
            "echo 'mount --make-shared /run/netns failed: Operation not permitted' >&2; exit 1",
            "refused: mount --make-shared /run/netns failed: Operation not permitted",
        ),
        ("exec /bin/sleep 30", "refused: `ip netns add oases-env-"),  # hangs: killed at the time limit
    ],
    ids=["ip-refuses", "ip-hangs"],
)
def test_link_shaping_reports_why_a_namespace_is_refused(monkeypatch, tmp_path, ip_body, expected):
    """As root with ip and tc: what `ip netns add` says (or that it timed out) becomes the reason;
    without root the launcher's own check (find_tools) gives it, and nothing is tried."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", _fake_tools(tmp_path, ip_body))
    monkeypatch.setattr(_env_report, "COMMAND_TIMEOUT_S", 0.5)  # read where the probes run
    start = time.monotonic()
    shaping = env._link_shaping()
    assert time.monotonic() - start < 10
    assert shaping["root"] is True and shaping["ip"] == str(tmp_path / "ip")
    assert shaping["network_namespace"].startswith(expected), shaping
    assert shaping["oases_launch_bandwidth"].startswith("runs unshaped (refused: "), shaping
    assert env.shaping_status()[0] is False
    if "sleep" in ip_body:
        assert "timed out after 0.5 s" in shaping["network_namespace"]

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    shaping = env._link_shaping()
    assert (shaping["root"], shaping["network_namespace"], shaping["tc_shaping"]) == (
        False,
        "refused: needs root",
        "not tried: needs root",
    )
    assert env.shaping_status() == (False, "runs unshaped (refused: needs root)")
