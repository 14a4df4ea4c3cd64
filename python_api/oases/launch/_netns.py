"""Rate-limited links for the ranks of one run, built from Linux network namespaces and tc.

Two topologies of one server, and a cluster of servers (`hosts`, below); each link is
`tc qdisc add dev DEV root tbf rate R burst 128kb latency 200ms` (tbf shapes what a device
sends). The burst must exceed the 64 KiB loopback/GSO packets, or TCP stalls; and it should not
be much larger: a link left idle refills its bucket and then passes `burst` bytes at memory speed,
a gift no PCIe or Ethernet link gives, worth most to blocking schedules that idle the link between
collectives (with 1mb, megatron's 12 blocking 1 MiB all-reduces at 500mbit waited 228 ms per step
in all, against 401 ms for the same all-reduces back to back). 128kb holds 0.5, 1 and 8 Gbit/s
(selftest):

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

`hosts` emulates H servers (`build_hosts`): a namespace per host, the host's ranks all in it.

    host 0: oases-<pid>-h0                     bridge: oases-<pid>-br
    +----------------------------------+
    | rank0 rank1 .. rank(k-1)         |
    |   lo (unshaped, or tbf INTRA)    |
    |   eth0 10.88.0.1 =tbf R=>  <=tbf R= port0 --+
    +----------------------------------+           br0
    host 1: oases-<pid>-h1 (ranks k..2k-1)         |
    |   eth0 10.88.0.2 =tbf R=>  <=tbf R= port1 --+

Every rank of host h binds gloo to eth0 (GLOO_SOCKET_IFNAME), so its address is the host's. A
packet to an address of its own namespace never leaves through eth0: the kernel delivers it
over `lo`. So a pair inside a host talks over the host's loopback (one queue for the host, like
`shared`, at INTRA or memory speed) and a pair across hosts over the two hosts' shaped NICs:
each host sends at R and receives at R at once, whatever the other hosts do (full duplex).

Namespaces are named after the launcher's pid, so one run never meets another's; deleting a
namespace removes the devices in it (veth pairs, the bridge) with it. A rank's /etc/hosts (`ip
netns exec` mounts /etc/netns/NAME/hosts over it) also names its peers' addresses (`switch`:
rank0, rank1, ...; `hosts`: host0, host1, ...), for reverse lookups that DNS, unreachable from a
namespace, cannot answer.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Literal, Mapping, Optional, Sequence

from oases.launch._signals import signals_deferred

Topology = Literal["shared", "switch"]
TOPOLOGIES: tuple[Topology, ...] = ("shared", "switch")
# NIC addresses: rank i's in `switch`, host i's in `hosts`: the (i+1)-th address of this net.
_NET = ipaddress.ip_network("10.88.0.0/16")
_HOST_NIC = "eth0"
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
    address: str = "127.0.0.1"  # reachable from every other rank
    env: Mapping[str, str] = field(default_factory=dict)  # GLOO_SOCKET_IFNAME: the rank's device


UNSHAPED = Placement()


class Namespaces:
    """Namespaces (and their links) made for one run; `close()` deletes every one of them.

        with Namespaces(tools, f"oases-{os.getpid()}") as spaces:
            placements = spaces.build("switch", nproc=4, rate_bits=10**9)   # one per rank
            # or: hosts = spaces.build_hosts(2, rate_bits=10**9)            # one per host
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
        self._made_netns_etc = False  # whether /etc/netns itself is ours to remove

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

    def build_hosts(self, hosts: int, rate_bits: int, intra_rate_bits: Optional[int] = None) -> list[Placement]:
        """Create `hosts` emulated servers: a namespace each, whose NIC sends and receives at
        `rate_bits` bit/s; traffic inside a host goes over its loopback, shaped to
        `intra_rate_bits` if given, else unshaped. Returns one placement per host."""
        if not 2 <= hosts <= _NET.num_addresses - 2:
            raise ValueError(f"hosts must be in 2..{_NET.num_addresses - 2}, got {hosts}")
        bridge = self._add_bridge()
        addresses = [str(_NET[host + 1]) for host in range(hosts)]
        names = [(address, f"host{host}") for host, address in enumerate(addresses)]
        placements = []
        for host, address in enumerate(addresses):
            name = self._add_namespace(f"{self._prefix}-h{host}")
            self._write_hosts(name, names)
            self._plug(bridge, f"port{host}", name, _HOST_NIC, address, rate_bits)
            if intra_rate_bits is not None:
                self._shape(name, "lo", intra_rate_bits)
            placements.append(
                Placement(prefix=self._exec(name), address=address, env={"GLOO_SOCKET_IFNAME": _HOST_NIC})
            )
        return placements

    def close(self) -> None:
        """Delete the namespaces made so far (idempotent; SIGINT/SIGTERM wait until it is done)."""
        with signals_deferred():
            while self._names:
                name = self._names.pop()
                subprocess.run(
                    [self._tools.ip, "netns", "del", name],
                    check=False,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
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
        if nproc > _NET.num_addresses - 2:
            raise ValueError(f"switch topology supports at most {_NET.num_addresses - 2} ranks")
        bridge = self._add_bridge()
        addresses = [str(_NET[rank + 1]) for rank in range(nproc)]
        names = [(address, f"rank{rank}") for rank, address in enumerate(addresses)]
        placements = []
        for rank, address in enumerate(addresses):
            name = self._add_namespace(f"{self._prefix}-r{rank}")
            self._write_hosts(name, names)
            nic = f"nic{rank}"
            self._plug(bridge, f"port{rank}", name, nic, address, rate_bits)
            placements.append(Placement(prefix=self._exec(name), address=address, env={"GLOO_SOCKET_IFNAME": nic}))
        return placements

    def _add_bridge(self) -> str:
        """The namespace of the switch: a bridge `br0` that the NICs' far ends join."""
        bridge = self._add_namespace(f"{self._prefix}-br")
        self._ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        self._ip("-n", bridge, "link", "set", "br0", "up")
        return bridge

    def _plug(self, bridge: str, port: str, namespace: str, nic: str, address: str, rate_bits: int) -> None:
        """A veth pair from `nic` (with `address`, in `namespace`) to `port` on the bridge, each
        end shaped to `rate_bits`: the nic shapes what the namespace sends, the port what it receives."""
        self._ip("-n", bridge, "link", "add", port, "type", "veth", "peer", "name", nic, "netns", namespace)
        self._ip("-n", bridge, "link", "set", port, "master", "br0", "up")
        self._ip("-n", namespace, "addr", "add", f"{address}/{_NET.prefixlen}", "dev", nic)
        self._ip("-n", namespace, "link", "set", nic, "up")
        self._ip("-n", namespace, "link", "set", "lo", "up")
        self._shape(namespace, nic, rate_bits)
        self._shape(bridge, port, rate_bits)

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
        self._run(
            self._tools.tc,
            "-n",
            namespace,
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{rate_bits}bit",
            "burst",
            _BURST,
            "latency",
            _LATENCY,
        )

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
