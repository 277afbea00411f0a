"""Emulated hosts for tests: Linux network namespaces joined by one bridge (root only).

Theory of operation
-------------------
Each host is a network namespace with its own loopback and one veth whose other end is a port
of a bridge. The bridge lives in a namespace of its own, so the machine's firewall never sees
the bridged frames (a host with ``br_netfilter`` and a ``FORWARD DROP`` policy, as Docker sets
up, would drop them in the root namespace). The root namespace gets one more veth into the
bridge with the subnet's ``.1``, so the test process reaches every host directly::

    root ns: veth 10.213.0.1 ─┐
                              ├─ bridge ns: br0 ─┬─ veth ── ns h1: 10.213.0.11 + lo
                              │                  ├─ veth ── ns h2: 10.213.0.12 + lo
                              │                  └─ veth ── ns h3: 10.213.0.13 + lo

Names carry a tag made of the process id (``rmx<pid>``), so two runs never share a namespace;
:func:`reap_stale` deletes the namespaces of a run whose process is gone (killed with -9, so
its tear-down never ran) before a new run starts.
:meth:`EmulatedHosts.link_down` takes a host's bridge port down (a partition: the host hears
nobody, nobody hears it), :meth:`link_up` heals it. :meth:`spawn` starts a process inside a
host (``ip netns exec``; it execs, so the child's pid is the program's) in its own session and
with ``PR_SET_PDEATHSIG``, so it dies if the test process does.

Tear-down (``__exit__``, also after a failure, and idempotent): SIGTERM to every process still
running, SIGKILL after a grace, then ``ip netns del`` of every namespace made here; a veth dies
with the namespace holding either end, so the root namespace is left as it was.
:func:`leftovers` lists anything carrying the tag (the tests check it is empty afterwards).

Only the standard library; every command has a timeout.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from radixmesh.child_process import die_with_parent

DEFAULT_SUBNET = "10.213.0.0/24"
TAG_PREFIX = "rmx"  # + the creating process's id: rmx<pid>-h1, rmx<pid>-br, rmx<pid>p0, ...
_CMD_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no ``ip``, not permitted)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True,
                         timeout=_CMD_TIMEOUT_S, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: rc {out.returncode}: {out.stderr.strip()}")
    return out


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can (tries one)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (ip netns, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"{TAG_PREFIX}{os.getpid()}-probe"
    try:
        added = _ip("netns", "add", probe, check=False)
        if added.returncode != 0:
            return f"'ip netns add' is not permitted: {added.stderr.strip()}"
        link = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if link.returncode != 0:
            return f"cannot create a bridge in a namespace: {link.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"'ip netns' failed: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _ip("netns", "del", probe, check=False)
    return None


def leftovers(tag: str) -> list[str]:
    """Namespaces and root-namespace links whose name contains ``tag`` (should be none)."""
    found: list[str] = []
    for kind, args in (("netns", ("netns", "list")), ("link", ("-o", "link", "show"))):
        out = _ip(*args, check=False).stdout
        found += [f"{kind}: {line.split()[0 if kind == 'netns' else 1]}"
                  for line in out.splitlines() if tag in line]
    return found


def reap_stale() -> list[str]:
    """Delete namespaces ``rmx<pid>-*`` whose creating process no longer exists; their names."""
    reaped: list[str] = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(TAG_PREFIX):].partition("-")[0]
        if not (name.startswith(TAG_PREFIX) and "-" in name and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its run is still going
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _ip("netns", "del", name, check=False)
        reaped.append(name)
    return reaped


@dataclass
class NetnsHost:
    name: str
    netns: str
    address: str  # the host's IPv4 address on the bridge
    port: str  # the bridge-side veth (in the bridge namespace)
    inside: str  # the host-side veth's name before it moves in (then: eth0)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)


class EmulatedHosts:
    """Hosts ``names`` on one bridge in ``subnet`` (``.11``, ``.12``, ...); see module doc."""

    def __init__(self, names: Sequence[str], subnet: str = DEFAULT_SUBNET,
                 tag: str | None = None) -> None:
        net = ipaddress.IPv4Network(subnet)
        if net.prefixlen > 24 or not net.is_private:
            raise ValueError("subnet must be a private /24 or larger")
        if len(set(names)) != len(names) or not 0 < len(names) <= 80:
            raise ValueError("need 1-80 distinct host names")
        self.subnet = net
        self.tag = tag or f"{TAG_PREFIX}{os.getpid()}"
        self.gateway = str(net.network_address + 1)  # the root namespace's address
        self.bridge_ns = f"{self.tag}-br"
        self._root_veth = f"{self.tag}t"
        self.hosts = {name: NetnsHost(name, f"{self.tag}-{name}",
                                 str(net.network_address + 11 + i), f"{self.tag}p{i}",
                                 f"{self.tag}i{i}")
                      for i, name in enumerate(names)}
        self._made: list[str] = []  # namespaces created, for tear-down

    # ------------------------------------------------------------------------- set-up
    def __enter__(self) -> EmulatedHosts:
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.teardown()

    def setup(self) -> None:
        routes = _ip("-4", "-o", "route", "show", "match", self.gateway, check=False).stdout
        if any(line.split()[0] not in ("default", "0.0.0.0/0") for line in routes.splitlines()):
            raise NetnsUnavailable(f"{self.subnet} is already routed on this machine: {routes}")
        self._netns_add(self.bridge_ns)
        br = ("-n", self.bridge_ns)
        _ip(*br, "link", "add", "br0", "type", "bridge")
        _ip(*br, "link", "set", "lo", "up")
        _ip(*br, "link", "set", "br0", "up")
        # the root namespace's way in: <tag>t (here) <-> <tag>tb (a bridge port)
        _ip("link", "add", self._root_veth, "type", "veth", "peer", "name", f"{self._root_veth}b")
        _ip("link", "set", f"{self._root_veth}b", "netns", self.bridge_ns)
        _ip(*br, "link", "set", f"{self._root_veth}b", "master", "br0", "up")
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self._root_veth)
        _ip("link", "set", self._root_veth, "up")
        for host in self.hosts.values():
            self._netns_add(host.netns)
            inside = host.inside
            _ip("link", "add", inside, "type", "veth", "peer", "name", host.port)
            _ip("link", "set", host.port, "netns", self.bridge_ns)
            _ip(*br, "link", "set", host.port, "master", "br0", "up")
            _ip("link", "set", inside, "netns", host.netns)
            ns = ("-n", host.netns)
            _ip(*ns, "link", "set", inside, "name", "eth0")
            _ip(*ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip(*ns, "link", "set", "eth0", "up")
            _ip(*ns, "link", "set", "lo", "up")

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    # ------------------------------------------------------------------------- use
    def address(self, name: str) -> str:
        return self.hosts[name].address

    def exec_argv(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``name``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def spawn(self, name: str, argv: Sequence[str], log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``name`` (own session, dies with us); output to ``log``."""
        with open(log, "ab") as handle:
            proc = subprocess.Popen(
                self.exec_argv(name, argv), stdin=subprocess.DEVNULL, stdout=handle,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.hosts[name].processes.append(proc)
        return proc

    def link_down(self, name: str) -> None:
        """Partition host ``name``: its bridge port goes down (no frames either way)."""
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[name].port, "down")

    def link_up(self, name: str) -> None:
        """Heal :meth:`link_down`."""
        _ip("-n", self.bridge_ns, "link", "set", self.hosts[name].port, "up")

    # ------------------------------------------------------------------------- tear-down
    def teardown(self, grace_s: float = 10.0) -> None:
        """Stop every process started here, delete every namespace made here. Idempotent."""
        procs = [p for h in self.hosts.values() for p in h.processes]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(grace_s)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # normally gone already
            if _ip("link", "show", self._root_veth, check=False).returncode == 0:
                _ip("link", "del", self._root_veth, check=False)
