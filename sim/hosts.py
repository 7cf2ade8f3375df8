"""Two hosts on one machine: two network namespaces joined by a veth pair, each with its own address.

A multi-rank job on ``--hosts 2`` (``sim.ranks``, the ``multirank`` tier with ``--hosts 2``) runs one
``paddle.distributed.launch --nnodes 2`` per namespace, the master on the first host's address: ranks 0
and 1 on the first host, ranks 2 and 3 on the second (local ranks 0 and 1 there). Their traffic (the
launchers' rendezvous, the TCP store, gloo) stays on the veth pair; nothing else reaches those addresses.
What the ranks share with the orchestrator goes through the file system and ``/dev/shm``, which a
network namespace does not separate (the trainers' ``ipc://`` sockets are files).

Names carry the creating process's pid (``wscf{pid}h{i}`` for the namespaces, ``wscf{pid}v{i}`` for
the two ends of the veth pair), so the namespaces of a run that was SIGKILLed are swept by the next one
(``sweep_dead``). Creating them needs root (``CAP_NET_ADMIN``) and ``ip``; where either is missing,
``Hosts.create`` raises ``Unavailable`` naming the command that failed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from weightsync.wire.handles import PREFIX

from .leftovers import pid_alive

NETNS_NAME = re.compile(rf"^{PREFIX}(\d+)h\d+$")
VETH_NAME = re.compile(rf"^{PREFIX}(\d+)v\d+$")
COMMAND_TIMEOUT_S = 10.0


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, EPERM): the reason names the command."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    ip = shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
    if ip is None:
        raise Unavailable("`ip` (iproute2) is not installed: two hosts need network namespaces")
    proc = subprocess.run([ip, *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise Unavailable(f"`ip {' '.join(args)}` failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip() or 'no message'}")
    return proc


class Hosts:
    """``count`` network namespaces joined by one veth pair (two hosts), addresses 10.{a}.{b}.1 and .2."""

    def __init__(self, names: list[str], interfaces: list[str], addresses: list[str]):
        self.names, self.interfaces, self.addresses = names, interfaces, addresses

    @classmethod
    def create(cls, count: int = 2) -> "Hosts":
        if count != 2:
            raise ValueError(f"two hosts are supported, not {count}")
        if os.geteuid() != 0:
            raise Unavailable(f"`ip netns add` needs root (CAP_NET_ADMIN); this process runs as uid {os.geteuid()}")
        sweep_dead()
        pid = os.getpid()
        names = [f"{PREFIX}{pid}h{i}" for i in range(count)]
        interfaces = [f"{PREFIX}{pid}v{i}" for i in range(count)]
        # Each namespace routes on its own: the subnet only has to be one, and the pid's keeps logs apart.
        subnet = f"10.{100 + (pid >> 8) % 150}.{pid % 256}"
        addresses = [f"{subnet}.{i + 1}" for i in range(count)]
        hosts = cls(names, interfaces, addresses)
        try:
            for name in names:
                _ip("netns", "add", name)
            _ip("link", "add", interfaces[0], "type", "veth", "peer", "name", interfaces[1])
            for name, iface, address in zip(names, interfaces, addresses):
                _ip("link", "set", iface, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", iface)
                _ip("-n", name, "link", "set", iface, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program on ``host`` (inside its namespace)."""
        ip = shutil.which("ip") or "/usr/sbin/ip"
        return [ip, "netns", "exec", self.names[host]]

    def remove(self) -> None:
        """Delete the namespaces (their veth ends go with them) and a veth end still outside one."""
        existing = set(_netns_names())
        for name in self.names:
            if name in existing:
                _ip("netns", "delete", name, check=False)
        for iface in self.interfaces:
            if os.path.exists(f"/sys/class/net/{iface}"):
                _ip("link", "delete", iface, check=False)


def _netns_names() -> list[str]:
    try:
        proc = _ip("netns", "list", check=False)
    except (Unavailable, OSError, subprocess.SubprocessError):
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def sweep_dead() -> list[str]:
    """Delete the namespaces and veth ends of our runs whose process is dead; returns their names."""
    removed = []
    for name in _netns_names():
        m = NETNS_NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            if _ip("netns", "delete", name, check=False).returncode == 0:
                removed.append(f"netns {name}")
    try:
        links = os.listdir("/sys/class/net")
    except OSError:
        links = []
    for name in links:
        m = VETH_NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            if _ip("link", "delete", name, check=False).returncode == 0:
                removed.append(f"veth {name}")
    return removed


def unavailable() -> str | None:
    """Why two hosts cannot be made here, or None: creates a pair and removes it (a few ms)."""
    try:
        Hosts.create(2).remove()
    except Unavailable as e:
        return str(e)
    except (OSError, subprocess.SubprocessError) as e:
        return f"network namespaces: {type(e).__name__}: {e}"
    return None
