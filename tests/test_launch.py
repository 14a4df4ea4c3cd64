"""oases-launch end to end: rank environment, a failing rank, clean-up, the unshaped fallback,
and (as root with iproute2) the shaped links' achieved bandwidth; on one emulated server and on
several (--hosts).

Each test runs `python -m oases.launch` as a subprocess with a hard timeout below the test's own
limit; a launcher that overruns gets SIGTERM (it stops its ranks and deletes its namespaces),
then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import oases.launch._cli as launch_cli
from oases.launch import main, parse_bandwidth

from _spawn import finish_process, stop_process

LAUNCH = (sys.executable, "-m", "oases.launch")
CAN_SHAPE = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_shaping = pytest.mark.skipif(not CAN_SHAPE, reason="shaping needs root and iproute2 ip + tc")
pytestmark = pytest.mark.timeout(60)  # per test; the selftests have more

# Rank scripts. Light ones do not import torch: a launch then costs the launcher's start only.
ENV_SCRIPT = """
import json, os, socket, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((os.environ["MASTER_ADDR"], 9))  # no packet: only asks which source address routes
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "OASES_BANDWIDTH", "OASES_TOPOLOGY",
         "GROUP_RANK", "GROUP_WORLD_SIZE", "OASES_HOSTS", "OASES_INTRA_BANDWIDTH", "OASES_SHARE_GPU",
         "NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"]
record = {name: os.environ.get(name) for name in names}
record.update(all_reduce=total.item(), argv=sys.argv[2:], source=probe.getsockname()[0],
              netns=os.readlink("/proc/self/ns/net"))
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump(record, out)
dist.destroy_process_group()
"""

CRASH_SCRIPT = """
import os, sys, time, traceback

def fail():
    raise RuntimeError("rank 1 fails on purpose")

if os.environ["RANK"] == "1":
    try:
        fail()
    except RuntimeError:
        traceback.print_exc()
        sys.exit(3)
time.sleep(120)  # rank 0 would wait for rank 1 forever
"""

WAIT_SCRIPT = """
import os, sys, time
open(os.path.join(sys.argv[1], "started" + os.environ["RANK"]), "w").close()
time.sleep(120)
"""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    pid: int  # the launcher's: its namespaces are named oases-<pid>...
    seconds: float


def launch(*args: str, env: dict | None = None, timeout: float = 45.0) -> Run:
    """Run oases-launch to the end (at most `timeout` s, below each test's own limit)."""
    start = time.monotonic()
    proc = subprocess.Popen([*LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    code, stdout, stderr = finish_process(proc, timeout)
    return Run(code, stdout, stderr, proc.pid, time.monotonic() - start)


def namespaces_of(pid: int) -> list[str]:
    """This launcher's namespaces still listed by `ip netns list`."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [name for name in names if name == f"oases-{pid}" or name.startswith(f"oases-{pid}-")]


def root_links() -> set[str]:
    """Network devices of the launcher's (this test's) namespace: a run must add none for good."""
    listing = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in listing.splitlines() if line.strip()}


def write_script(directory: Path, source: str) -> str:
    path = directory / "rank_script.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def env_without(*names: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in names}
    env.update(extra)
    return env


def test_parse_bandwidth_reads_tc_rates():
    assert parse_bandwidth("1gbit") == 125e6
    assert parse_bandwidth("250mbit") == 31.25e6
    assert parse_bandwidth(" 8Gbit ") == 1e9
    assert parse_bandwidth("1.5gbit") == 187.5e6
    assert parse_bandwidth("100mbps") == 100e6  # bps: bytes
    assert parse_bandwidth("1gibit") == 2**30 / 8  # IEC prefix
    assert parse_bandwidth("1mibps") == 2**20
    assert parse_bandwidth("8000") == 1000.0  # bare number: bit/s, as in tc
    for bad in ["", "fast", "1 gbit", "1g", "-1gbit", "0mbit", "1bit", "1gbitx"]:
        with pytest.raises(ValueError):
            parse_bandwidth(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["--nproc", "2"],  # nothing to run
        ["--nproc", "0", "x.py"],
        ["--bandwidth", "fast", "x.py"],
        ["--topology", "switch", "x.py"],  # topology without a bandwidth
        ["--nproc", "1", "--selftest"],
        ["--nproc", "2", "--selftest", "x.py"],
        ["--nproc", "4", "--hosts", "2", "x.py"],  # hosts without a bandwidth
        ["--nproc", "4", "--bandwidth", "1gbit", "--intra-bandwidth", "8gbit", "x.py"],  # one host
        ["--nproc", "4", "--hosts", "2", "--bandwidth", "1gbit", "--topology", "switch", "x.py"],
        ["--nproc", "2", "--hosts", "2", "--bandwidth", "1gbit", "--selftest"],  # no pair inside a host
        ["--nproc", "4", "--hosts", "0", "--bandwidth", "1gbit", "x.py"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert "oases-launch: error:" in capsys.readouterr().err


@pytest.mark.parametrize("nproc, hosts", [(3, 2), (8, 3), (1, 2)])
def test_nproc_not_divisible_by_hosts_is_a_clear_error(capsys, nproc, hosts):
    with pytest.raises(SystemExit) as exit:
        main(["--nproc", str(nproc), "--hosts", str(hosts), "--bandwidth", "1gbit", "x.py"])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"oases-launch: error: --nproc {nproc} ranks cannot be packed evenly into "
        f"--hosts {hosts}: --nproc must be divisible by --hosts"
    )


# (topology, nproc, launcher options, launcher environment, expected OMP_NUM_THREADS): the three
# cases also cover the thread rule: the environment's value, else 1, and --threads over both.
ENV_CASES = [
    pytest.param(None, 2, [], {"OMP_NUM_THREADS": "3"}, "3", id="unshaped"),
    pytest.param("shared", 2, [], {}, "1", id="shared", marks=needs_shaping),
    pytest.param("switch", 3, ["--threads", "2"], {"OMP_NUM_THREADS": "3"}, "2", id="switch", marks=needs_shaping),
]


@pytest.mark.parametrize("topology, nproc, options, extra_env, threads", ENV_CASES)
def test_ranks_get_torchrun_environment(tmp_path, topology, nproc, options, extra_env, threads):
    shaping = ["--bandwidth", "1gbit", "--topology", topology] if topology else []
    script = write_script(tmp_path, ENV_SCRIPT)
    env = env_without("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", **extra_env)
    run = launch("--nproc", str(nproc), *shaping, *options, script, str(tmp_path), "--lr", "3", env=env)
    assert run.returncode == 0, run.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    ports = {rank["MASTER_PORT"] for rank in ranks}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert len({rank["MASTER_ADDR"] for rank in ranks}) == 1
    for r, rank in enumerate(ranks):
        assert (rank["RANK"], rank["LOCAL_RANK"]) == (str(r), str(r))
        assert rank["WORLD_SIZE"] == rank["LOCAL_WORLD_SIZE"] == str(nproc)
        assert rank["all_reduce"] == nproc * (nproc + 1) / 2  # rendezvous worked
        assert rank["argv"] == ["--lr", "3"]
        assert rank["OMP_NUM_THREADS"] == threads
        assert rank["OASES_BANDWIDTH"] == ("1gbit" if topology else None)
        assert rank["OASES_TOPOLOGY"] == topology
    own_netns = os.readlink("/proc/self/ns/net")
    spaces = {rank["netns"] for rank in ranks}
    if topology is None:
        assert spaces == {own_netns}
        assert ranks[0]["MASTER_ADDR"] == "127.0.0.1"
        assert ranks[0]["GLOO_SOCKET_IFNAME"] is None
    elif topology == "shared":  # one namespace, its loopback shaped
        assert len(spaces) == 1 and own_netns not in spaces
        assert ranks[0]["MASTER_ADDR"] == "127.0.0.1"
        assert {rank["GLOO_SOCKET_IFNAME"] for rank in ranks} == {"lo"}
    else:  # a namespace and an address per rank; MASTER_ADDR is rank 0's
        assert len(spaces) == nproc and own_netns not in spaces
        assert [rank["GLOO_SOCKET_IFNAME"] for rank in ranks] == [f"nic{r}" for r in range(nproc)]
        assert len({rank["source"] for rank in ranks}) == nproc
        assert ranks[0]["source"] == ranks[0]["MASTER_ADDR"] != "127.0.0.1"
    if topology:
        assert namespaces_of(run.pid) == []


@pytest.mark.parametrize(
    "shaped", [pytest.param(True, id="shaped", marks=needs_shaping), pytest.param(False, id="unshaped")]
)
def test_hosts_give_each_rank_its_host(tmp_path, shaped):
    """--hosts 2 --nproc 4: ranks 0, 1 on host 0 and 2, 3 on host 1, with torchrun's multi-node
    environment; shaped, each host is a namespace with its own address (unshaped: the layout only)."""
    nproc, hosts = 4, 2
    script = write_script(tmp_path, ENV_SCRIPT)
    env = env_without("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")
    if not shaped:  # a PATH without iproute2, as on a machine without it
        (tmp_path / "bin").mkdir()
        env["PATH"] = str(tmp_path / "bin")
    links_before = root_links() if shaped else set()
    run = launch(
        "--nproc",
        str(nproc),
        "--hosts",
        str(hosts),
        "--bandwidth",
        "1gbit",
        script,
        str(tmp_path),
        "--lr",
        "3",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    per_host = nproc // hosts
    for r, rank in enumerate(ranks):
        assert (rank["RANK"], rank["WORLD_SIZE"]) == (str(r), str(nproc))
        assert (rank["LOCAL_RANK"], rank["LOCAL_WORLD_SIZE"]) == (str(r % per_host), str(per_host))
        assert (rank["GROUP_RANK"], rank["GROUP_WORLD_SIZE"]) == (str(r // per_host), str(hosts))
        assert rank["all_reduce"] == nproc * (nproc + 1) / 2  # rendezvous worked across hosts
        assert rank["argv"] == ["--lr", "3"]
        assert rank["OASES_BANDWIDTH"] == ("1gbit" if shaped else None)
        assert rank["OASES_TOPOLOGY"] == ("hosts" if shaped else None)
        assert rank["OASES_HOSTS"] == (str(hosts) if shaped else None)
        assert rank["OASES_INTRA_BANDWIDTH"] is None
    assert len({rank["MASTER_ADDR"] for rank in ranks}) == 1
    own_netns = os.readlink("/proc/self/ns/net")
    if not shaped:
        assert {rank["netns"] for rank in ranks} == {own_netns}
        assert ranks[0]["MASTER_ADDR"] == "127.0.0.1"
        return
    # (namespace, address) of each rank: one pair per host, the same for all its ranks
    where = [(rank["netns"], rank["source"]) for rank in ranks]
    assert len(set(where)) == hosts
    assert all(where[r] == where[r - r % per_host] for r in range(nproc))
    assert len({address for _, address in where}) == hosts
    assert own_netns not in {space for space, _ in where}
    assert ranks[0]["source"] == ranks[0]["MASTER_ADDR"] != "127.0.0.1"  # host 0's address
    assert {rank["GLOO_SOCKET_IFNAME"] for rank in ranks} == {"eth0"}
    assert namespaces_of(run.pid) == []
    assert root_links() <= links_before  # no veth left behind


# Shaping options of the clean-up tests: nproc 2 makes three namespaces either way (bridge + 2).
CLEANUP_CASES = [
    pytest.param(["--topology", "switch"], id="switch"),
    pytest.param(["--hosts", "2"], id="hosts"),
]


@pytest.mark.parametrize("shaping", CLEANUP_CASES)
def test_failing_rank_ends_the_run(tmp_path, shaping):
    # Shaped when possible: then the namespaces must be gone too.
    shaping = ["--bandwidth", "1gbit", *shaping] if CAN_SHAPE else []
    links_before = root_links() if CAN_SHAPE else set()
    run = launch("--nproc", "2", *shaping, write_script(tmp_path, CRASH_SCRIPT))
    assert run.returncode == 3
    assert "RuntimeError: rank 1 fails on purpose" in run.stderr  # its traceback came through
    assert run.seconds < 30  # rank 0, asleep for 120 s, was stopped (it held the output pipes)
    if CAN_SHAPE:
        assert namespaces_of(run.pid) == []
        assert root_links() <= links_before


@needs_shaping
@pytest.mark.parametrize("shaping", CLEANUP_CASES)
def test_ctrl_c_stops_ranks_and_deletes_namespaces(tmp_path, shaping):
    script = write_script(tmp_path, WAIT_SCRIPT)
    command = [*LAUNCH, "--nproc", "2", "--bandwidth", "1gbit", *shaping, script, str(tmp_path)]
    links_before = root_links()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            deadline = time.monotonic() + 40
            while not all((tmp_path / f"started{r}").exists() for r in range(2)):
                assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
                time.sleep(0.1)
            assert len(namespaces_of(proc.pid)) == 3  # bridge + one per rank (or host)
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=20)  # returns once the ranks, holding the pipes, are gone
        finally:
            if proc.returncode is None:
                stop_process(proc)
    assert proc.returncode == 128 + signal.SIGINT
    assert namespaces_of(proc.pid) == []
    assert root_links() <= links_before


def test_without_tc_the_selftest_runs_unshaped_after_one_line(tmp_path):
    no_tools = tmp_path / "bin"  # a PATH without iproute2, as on a machine without it
    no_tools.mkdir()
    run = launch("--nproc", "2", "--bandwidth", "1gbit", "--selftest", env=env_without("PATH", PATH=str(no_tools)))
    assert run.returncode == 0, run.stderr
    notices = [line for line in run.stderr.splitlines() if line.startswith("oases-launch:")]
    assert len(notices) == 1
    assert "cannot shape the network" in notices[0] and notices[0].endswith("running unshaped")
    assert run.stdout.startswith("requested unshaped, achieved ")  # no OASES_BANDWIDTH in the ranks


@needs_shaping
@pytest.mark.timeout(90)
@pytest.mark.parametrize("topology", ["shared", "switch"])
def test_shaped_link_delivers_requested_bandwidth(tmp_path, topology):
    """The launcher's contract: the rank-to-rank rate is the requested one (broad band: shared
    machine); `shared` splits it between two concurrent directions, `switch` gives it to each."""
    result_path = tmp_path / "selftest.json"
    run = launch(
        "--nproc",
        "2",
        "--bandwidth",
        "200mbit",
        "--topology",
        topology,
        "-m",
        "oases.launch._selftest",
        "--mib",
        "4",
        "--repeats",
        "3",
        "--json",
        str(result_path),
        timeout=70,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(result_path.read_text())
    requested = parse_bandwidth("200mbit")
    assert result["requested_bytes_per_s"] == requested
    assert 0.5 <= result["one_way_bytes_per_s"] / requested <= 1.2, result
    both_ways = result["both_ways_bytes_per_s"] / requested  # each way
    if topology == "shared":
        assert 0.25 <= both_ways <= 0.65, result
    else:
        assert 0.5 <= both_ways <= 1.2, result
    assert namespaces_of(run.pid) == []


@needs_shaping
@pytest.mark.timeout(90)
@pytest.mark.parametrize("bandwidth, intra_bandwidth", [("1gbit", None), ("250mbit", "1gbit")])
def test_hosts_selftest_measures_both_link_kinds(tmp_path, bandwidth, intra_bandwidth):
    """--hosts 2: a pair across hosts gets the NIC's rate, each way at once (full duplex); a pair
    inside a host gets the loopback: unshaped (much faster), or --intra-bandwidth shared by both
    directions. Broad bands: shared machine."""
    result_path = tmp_path / "selftest.json"
    intra = ["--intra-bandwidth", intra_bandwidth] if intra_bandwidth else []
    run = launch(
        "--nproc",
        "4",
        "--hosts",
        "2",
        "--bandwidth",
        bandwidth,
        *intra,
        "-m",
        "oases.launch._selftest",
        "--mib",
        "4",
        "--repeats",
        "3",
        "--json",
        str(result_path),
        timeout=70,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(result_path.read_text())
    assert (result["topology"], result["hosts"]) == ("hosts", 2)
    inter, intra_host = result["inter_host"], result["intra_host"]
    assert (inter["ranks"], intra_host["ranks"]) == ([0, 2], [0, 1])
    requested = parse_bandwidth(bandwidth)
    assert inter["requested_bytes_per_s"] == requested
    assert 0.6 <= inter["one_way_bytes_per_s"] / requested <= 1.3, result
    assert 0.6 <= inter["both_ways_bytes_per_s"] / requested <= 1.3, result
    if intra_bandwidth is None:
        assert intra_host["requested"] is None
        assert intra_host["one_way_bytes_per_s"] >= 3 * inter["one_way_bytes_per_s"], result
    else:
        intra_requested = parse_bandwidth(intra_bandwidth)
        assert intra_host["requested_bytes_per_s"] == intra_requested
        assert 0.6 <= intra_host["one_way_bytes_per_s"] / intra_requested <= 1.3, result
        assert 0.25 <= intra_host["both_ways_bytes_per_s"] / intra_requested <= 0.65, result
    assert namespaces_of(run.pid) == []


def test_share_gpu_makes_each_rank_a_host_on_gpu_0(tmp_path, monkeypatch):
    """--share-gpu (a GPU assumed visible): every rank LOCAL_RANK 0 of a one-rank host of its own,
    a distinct NCCL_HOSTID each, NCCL on loopback sockets; NCCL settings the user gave win."""
    monkeypatch.setattr(launch_cli, "visible_gpus", lambda: 1)
    for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")  # the user's own setting
    nproc = 3
    assert main(["--nproc", str(nproc), "--share-gpu", write_script(tmp_path, ENV_SCRIPT), str(tmp_path)]) == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert len({rank["NCCL_HOSTID"] for rank in ranks}) == nproc
    for r, rank in enumerate(ranks):
        assert (rank["RANK"], rank["WORLD_SIZE"]) == (str(r), str(nproc))
        assert (rank["LOCAL_RANK"], rank["LOCAL_WORLD_SIZE"]) == ("0", "1")
        assert (rank["GROUP_RANK"], rank["GROUP_WORLD_SIZE"]) == (str(r), str(nproc))
        assert rank["NCCL_HOSTID"] == f"oases-share-{r}" and rank["OASES_SHARE_GPU"] == str(nproc)
        assert (rank["NCCL_SOCKET_IFNAME"], rank["NCCL_P2P_DISABLE"], rank["NCCL_SHM_DISABLE"]) == ("lo", "1", "1")
        assert rank["NCCL_IB_DISABLE"] == "0"
        assert rank["all_reduce"] == nproc * (nproc + 1) / 2  # rendezvous worked


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nproc", "4", "--hosts", "2", "--bandwidth", "1gbit"], "give no --hosts"),
        (["--nproc", "2", "--bandwidth", "1gbit", "--topology", "switch"], "--topology shared"),
    ],
)
def test_share_gpu_refuses_hosts_and_a_switch(capsys, monkeypatch, options, message):
    monkeypatch.setattr(launch_cli, "visible_gpus", lambda: 1)
    with pytest.raises(SystemExit) as stop:
        main([*options, "--share-gpu", "x.py"])
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no GPU")
def test_share_gpu_without_a_gpu_is_refused_in_one_line(tmp_path):
    run = launch("--nproc", "2", "--share-gpu", write_script(tmp_path, ENV_SCRIPT), str(tmp_path))
    assert run.returncode == 2
    assert "--share-gpu runs every rank on one GPU over NCCL, but torch sees no GPU here" in run.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no rank started
