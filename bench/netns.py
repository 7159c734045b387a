"""Test hosts for the chaos soak: one network namespace per host, joined by a bridge.

Each host is a namespace made here (`ip netns add`) with its own loopback and one veth pair to
a bridge in the root namespace; it has an address on the bridge's /24 that only these
namespaces (and the root namespace, where the clients run) can reach. Cutting a host's link
sets its veth down: its connections stall as on a real network (no reset), until it is set up
again. Everything is removed on exit, after a failure too, and names carry a per-run id so runs
never collide (a crashed run's leftovers are removed by `remove_leftovers`).

Where namespaces cannot be made (not root, no `ip`, a kernel without them) `TestHosts` says why
and every host is 127.0.0.1 in the root namespace: the soak then cuts links at its proxies.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

PREFIX = "sdx"  # every namespace, bridge and veth made here starts with it
SUBNET = "10.213"  # hosts are 10.213.<run>.<2...>; the bridge is .1


@dataclass(frozen=True)
class Host:
    """One test host: where its processes run and the address others reach it at."""

    name: str                # its role, e.g. "target-1"
    address: str             # its address on the bridge (127.0.0.1 on loopback)
    netns: str | None = None  # its namespace (None: the root namespace, loopback mode)
    link: str | None = None   # the root side of its veth (None: no link of its own)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_leftovers() -> int:
    """Remove namespaces and links of earlier runs that did not clean up; how many."""
    removed = 0
    names = _ip("netns", "list", check=False).stdout.split("\n")
    for line in names:
        name = line.split(" ")[0]
        if name.startswith(PREFIX):
            removed += _ip("netns", "del", name, check=False).returncode == 0
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0].startswith(PREFIX):
            removed += _ip("link", "del", parts[1].split("@")[0], check=False).returncode == 0
    return removed


class TestHosts:
    """Hosts by name, as namespaces on a bridge (or all on loopback where that is impossible).

    with TestHosts(["redis", "draft-1", ...]) as hosts: hosts["draft-1"].command([...])"""

    __test__ = False  # not a pytest test class

    def __init__(self, names: list[str], loopback: bool = False):
        if len(names) > 250:
            raise ValueError("at most 250 hosts")
        self.names = list(names)
        self.why_loopback = "asked for" if loopback else namespaces_unavailable()
        self.run = secrets.token_hex(2)
        self.subnet = f"{SUBNET}.{int(self.run, 16) % 250 + 1}"
        self.bridge = f"{PREFIX}{self.run}br"
        self.hosts: dict[str, Host] = {}
        self.made: list[tuple[str, str]] = []  # ("netns" | "link", name) to remove, in order

    @property
    def isolated(self) -> bool:
        """Whether the hosts are namespaces (False: all on loopback)."""
        return self.why_loopback is None

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where clients run), or 127.0.0.1."""
        return f"{self.subnet}.1" if self.isolated else "127.0.0.1"

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> "TestHosts":
        if not self.isolated:
            self.hosts = {name: Host(name, "127.0.0.1") for name in self.names}
            return self
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, name in enumerate(self.names, start=2):
            netns = f"{PREFIX}{self.run}h{index}"
            outside, inside = f"{PREFIX}{self.run}v{index}", f"{PREFIX}{self.run}i{index}"
            _ip("netns", "add", netns)
            self.made.append(("netns", netns))
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            self.made.append(("link", outside))
            _ip("link", "set", inside, "netns", netns)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            address = f"{self.subnet}.{index}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            self.hosts[name] = Host(name, address, netns, outside)

    def set_link(self, name: str, up: bool) -> bool:
        """Set a host's link up or down; False where hosts have no links (loopback mode)."""
        host = self.hosts[name]
        if host.link is None:
            return False
        _ip("link", "set", host.link, "up" if up else "down")
        return True

    def close(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "netns":
                _ip("netns", "del", name, check=False)  # takes its veth pair with it
            else:
                _ip("link", "del", name, check=False)
        self.made.clear()
