"""Hosts for tests, made of Linux network namespaces: each host is a namespace with one ``eth0``
on a shared /24, joined through a bridge that lives in a namespace of its own (so nothing is added
to the machine's own network). Names carry this process's id, so concurrent runs never collide;
:meth:`Hosts.remove` deletes every namespace, which takes the veth pairs and the bridge with it.
"""

from __future__ import annotations

import os
import subprocess


class NamespacesUnavailable(RuntimeError):
    """This machine cannot create network namespaces (no root, no CAP_SYS_ADMIN, no ``ip``)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Hosts:
    """``Hosts({"gw": 1, "pf": 2})`` → namespaces ``<tag>-gw`` at 10.211.0.1, ``<tag>-pf`` at .2."""

    SUBNET = "10.211.0"

    def __init__(self, numbers: dict[str, int], tag: str | None = None):
        self.tag = tag or f"or{os.getpid()}"
        self.numbers = numbers
        self.created: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.SUBNET}.{self.numbers[host]}"

    def prefix(self, host: str) -> list[str]:
        """Command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def _add_namespace(self, name: str) -> None:
        try:
            result = _ip("netns", "add", name, check=False)
        except FileNotFoundError:
            raise NamespacesUnavailable("the `ip` command (iproute2) is not installed") from None
        if result.returncode != 0:
            raise NamespacesUnavailable(f"`ip netns add` failed: {result.stderr.strip()}")
        self.created.append(name)

    def create(self) -> "Hosts":
        switch = f"{self.tag}-sw"
        self._add_namespace(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host, number in self.numbers.items():
            name = self.namespace(host)
            self._add_namespace(name)
            port = f"v{number}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        return self

    def remove(self) -> list[str]:
        """Delete every namespace this object made; returns the names that could not be deleted."""
        left = []
        for name in reversed(self.created):
            if _ip("netns", "del", name, check=False).returncode != 0:
                left.append(name)
        self.created = []
        return left

    def existing(self) -> list[str]:
        listing = _ip("netns", "list", check=False).stdout
        return [line.split()[0] for line in listing.splitlines() if line.startswith(self.tag + "-")]
