"""Rate-limited links for the ranks of one run, built from Linux network namespaces and tc.

Two topologies; each link is `tc qdisc add dev DEV root tbf rate R burst 128kb latency 200ms` (tbf
shapes what a device sends). The burst must exceed the 64 KiB loopback/GSO packets, or TCP stalls;
and it should not be much larger: a link left idle refills its bucket and then passes `burst`
bytes at memory speed, a gift no PCIe or Ethernet link gives, worth most to blocking schedules
that idle the link between collectives (with 1mb, megatron's 12 blocking 1 MiB all-reduces at
500mbit waited 228 ms per step in all, against 401 ms for the same all-reduces back to back).
128kb holds 0.5, 1 and 8 Gbit/s (selftest):

    shared: one namespace                   switch: a namespace per rank, the bridge in its own
    +------------------------------+        rank0 [nic0] =tbf=>  <=tbf= [port0] --+
    | rank0  rank1  ...  rank(n-1) |                                               br0
    |         lo (tbf R)           |        rank1 [nic1] =tbf=>  <=tbf= [port1] --+
    +------------------------------+
    every byte between any two ranks        nic<i> shapes what rank i sends, port<i> what it
    passes one queue of rate R              receives: each rank sends and receives at R at once,
                                            whatever the others do (a full-duplex NIC per rank)

In `switch`, R is the rate on the wire of 1500-byte frames, as on a real NIC: TCP payload gets
about 0.96 R (1gbit -> ~119.5 MB/s); `shared` runs over 64 KiB loopback packets (~R).

Namespaces are named after the launcher's pid, so one run never meets another's; deleting a
namespace removes the devices in it (veth pairs, the bridge) with it. A rank's /etc/hosts (`ip
netns exec` mounts /etc/netns/NAME/hosts over it) also names its peers' addresses (`switch`:
rank0, rank1, ...), for reverse lookups that DNS, unreachable from a namespace, cannot answer.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from oases.launch._signals import signals_deferred

Topology = Literal["shared", "switch"]
TOPOLOGIES: tuple[Topology, ...] = ("shared", "switch")
# Rank i's NIC address in the switch topology: the (i+1)-th host of this private net.
_SWITCH_NET = ipaddress.ip_network("10.88.0.0/16")
_NETNS_ETC = "/etc/netns"
_BURST = "128kb"
_LATENCY = "200ms"


class ShapingUnavailable(RuntimeError):
    """The links cannot be shaped here; the message says why, for a one-line notice."""


@dataclass(frozen=True)
class Tools:
    """Absolute paths of iproute2's `ip` and `tc`."""

    ip: str
    tc: str


def find_tools() -> Tools:
    """The tools that shaping needs, or ShapingUnavailable(reason) without root or iproute2."""
    if os.geteuid() != 0:
        raise ShapingUnavailable("needs root")
    ip, tc = shutil.which("ip"), shutil.which("tc")
    missing = [name for name, path in (("ip", ip), ("tc", tc)) if path is None]
    if missing:
        raise ShapingUnavailable(f"needs iproute2 {' and '.join(repr(m) for m in missing)} on PATH")
    assert ip is not None and tc is not None
    return Tools(ip, tc)


@dataclass(frozen=True)
class Placement:
    """Where a rank runs: the command prefix that enters its namespace and its address."""

    prefix: tuple[str, ...] = ()  # e.g. ("/usr/sbin/ip", "netns", "exec", "oases-123")
    address: str = "127.0.0.1"    # reachable from every other rank
    env: Mapping[str, str] = field(default_factory=dict)  # GLOO_SOCKET_IFNAME: the rank's device


UNSHAPED = Placement()


class Namespaces:
    """Namespaces (and their links) made for one run; `close()` deletes every one of them.

        with Namespaces(tools, f"oases-{os.getpid()}") as spaces:
            placements = spaces.build("switch", nproc=4, rate_bits=10**9)   # one per rank
            ...                                                             # run the ranks
        # all namespaces gone, also after an exception

    `build` raises ShapingUnavailable when a command fails (e.g. no CAP_SYS_ADMIN in a container);
    what it made so far is still deleted by `close()`.
    """

    def __init__(self, tools: Tools, prefix: str) -> None:
        self._tools = tools
        self._prefix = prefix
        self._names: list[str] = []  # in creation order; recorded before `ip netns add` runs
        self._etc_dirs: list[str] = []  # /etc/netns/NAME: files `ip netns exec` mounts over /etc
        self._made_netns_etc = False    # whether /etc/netns itself is ours to remove

    def __enter__(self) -> "Namespaces":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def build(self, topology: Topology, nproc: int, rate_bits: int) -> list[Placement]:
        """Create the namespaces and shaped links of `topology` for `nproc` ranks at `rate_bits` bit/s."""
        if topology == "shared":
            return self._shared(nproc, rate_bits)
        if topology == "switch":
            return self._switch(nproc, rate_bits)
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")

    def close(self) -> None:
        """Delete the namespaces made so far (idempotent; SIGINT/SIGTERM wait until it is done)."""
        with signals_deferred():
            while self._names:
                name = self._names.pop()
                subprocess.run([self._tools.ip, "netns", "del", name], check=False,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while self._etc_dirs:
                shutil.rmtree(self._etc_dirs.pop(), ignore_errors=True)
            if self._made_netns_etc:
                self._made_netns_etc = False
                with contextlib.suppress(OSError):  # not empty: another run uses it now
                    os.rmdir(_NETNS_ETC)

    def _shared(self, nproc: int, rate_bits: int) -> list[Placement]:
        name = self._add_namespace(self._prefix)
        self._write_hosts(name, [])
        self._ip("-n", name, "link", "set", "lo", "up")
        self._shape(name, "lo", rate_bits)
        # Gloo binds where the hostname resolves unless told: here only `lo` exists.
        placement = Placement(prefix=self._exec(name), env={"GLOO_SOCKET_IFNAME": "lo"})
        return [placement] * nproc

    def _switch(self, nproc: int, rate_bits: int) -> list[Placement]:
        if nproc > _SWITCH_NET.num_addresses - 2:
            raise ValueError(f"switch topology supports at most {_SWITCH_NET.num_addresses - 2} ranks")
        bridge = self._add_namespace(f"{self._prefix}-br")
        self._ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        self._ip("-n", bridge, "link", "set", "br0", "up")
        addresses = [str(_SWITCH_NET[rank + 1]) for rank in range(nproc)]
        names = [(address, f"rank{rank}") for rank, address in enumerate(addresses)]
        placements = []
        for rank, address in enumerate(addresses):
            name = self._add_namespace(f"{self._prefix}-r{rank}")
            self._write_hosts(name, names)
            nic, port = f"nic{rank}", f"port{rank}"
            self._ip("-n", bridge, "link", "add", port, "type", "veth", "peer", "name", nic, "netns", name)
            self._ip("-n", bridge, "link", "set", port, "master", "br0", "up")
            self._ip("-n", name, "addr", "add", f"{address}/{_SWITCH_NET.prefixlen}", "dev", nic)
            self._ip("-n", name, "link", "set", nic, "up")
            self._ip("-n", name, "link", "set", "lo", "up")
            self._shape(name, nic, rate_bits)     # what the rank sends
            self._shape(bridge, port, rate_bits)  # what the rank receives
            placements.append(Placement(prefix=self._exec(name), address=address,
                                        env={"GLOO_SOCKET_IFNAME": nic}))
        return placements

    def _add_namespace(self, name: str) -> str:
        self._names.append(name)  # first: an interrupt right after `add` still deletes it
        self._ip("netns", "add", name)
        return name

    def _write_hosts(self, namespace: str, names: Sequence[tuple[str, str]]) -> None:
        """/etc/hosts inside `namespace`: the system's plus `names` ((IPv4, name) pairs), each also
        as the IPv4-mapped IPv6 address a dual-stack server sees. c10d's store looks its clients
        up by address; without an entry the lookup goes to DNS, unreachable from the namespace,
        and c10d warns. Best effort: only names depend on it."""
        directory = os.path.join(_NETNS_ETC, namespace)
        try:
            with open("/etc/hosts") as hosts:
                lines = hosts.read().rstrip("\n").splitlines()
        except OSError:
            lines = []
        for address, name in [("127.0.0.1", "localhost"), *names]:
            lines += [f"{address} {name}", f"::ffff:{address} {name}"]
        try:
            if not os.path.isdir(_NETNS_ETC):
                os.mkdir(_NETNS_ETC)
                self._made_netns_etc = True
            self._etc_dirs.append(directory)
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "hosts"), "w") as hosts:
                hosts.write("\n".join(lines) + "\n")
        except OSError:
            pass

    def _shape(self, namespace: str, device: str, rate_bits: int) -> None:
        self._run(self._tools.tc, "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                  "rate", f"{rate_bits}bit", "burst", _BURST, "latency", _LATENCY)

    def _exec(self, namespace: str) -> tuple[str, ...]:
        return (self._tools.ip, "netns", "exec", namespace)

    def _ip(self, *args: str) -> None:
        self._run(self._tools.ip, *args)

    @staticmethod
    def _run(*command: str) -> None:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
            raise ShapingUnavailable(f"`{_display(command)}` failed: {reason}")


def _display(command: Sequence[str]) -> str:
    return " ".join([os.path.basename(command[0]), *command[1:]])
