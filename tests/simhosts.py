"""Simulated hosts for multi-host tests: network namespaces on one switch, each with its own
address and hostname.

    with SimHosts(3) as hosts:              # pytest.skip with one line where they cannot be made
        h0 = hosts[0]                       # h0.name "tmh0", h0.addr "10.x.y.1", h0.ns
        p = h0.popen([sys.executable, "-m", "trainmesh", ...], env=...)
        hosts[2].link_down(); hosts[2].link_up()     # a partition of one host, then its return
        h0.listening()                      # (address, port) of this host's listening TCP sockets
        h0.pids(); h0.kill_all()            # every process inside the host's namespace

Each host is a namespace with loopback and one veth whose peer sits on a bridge inside a
private switch namespace; ``/etc/netns/<ns>/hosts`` names every host (and the host's own name
resolves to its LAN address, as on a real cluster). Commands run under ``unshare --uts`` with the
host's hostname. Names and the subnet are unique per SimHosts, so concurrent tests never collide;
everything made is removed on exit (the namespaces, their veths, the hosts files) and every
process started through :meth:`SimHost.popen` still alive is killed first, then whatever else
still runs inside the hosts' namespaces. Only the namespaces'
own addresses and loopback are used.
"""
from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import uuid
from dataclasses import dataclass, field

import pytest


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def can_make_hosts() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "simulated hosts need iproute2's ip and util-linux's unshare"
    probe = f"tmprobe{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


SOCK_DIAG_BY_FAMILY, NLMSG_ERROR, NLMSG_DONE, TCP_LISTEN = 20, 2, 3, 10


def _diag_socket(ns: str) -> socket.socket | bool:
    """A sock_diag netlink socket inside namespace ``ns`` (made by a thread that entered it: a
    socket keeps the namespace it was made in); False where none can be made."""
    made: list = []

    def enter_and_make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) == 0:   # CLONE_NEWNET: this thread only
                made.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4))   # SOCK_DIAG
        finally:
            os.close(fd)
    thread = threading.Thread(target=enter_and_make)
    thread.start()
    thread.join()
    return made[0] if made else False


def _listening(diag: socket.socket) -> list[tuple[str, int]]:
    """(address, port) of the listening TCP sockets of ``diag``'s namespace (IPv4 and IPv6)."""
    found = []
    for family in (socket.AF_INET, socket.AF_INET6):
        request = struct.pack("=BBBxI48x", family, socket.IPPROTO_TCP, 0, 1 << TCP_LISTEN)
        diag.send(struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + request)
        done = False
        while not done:
            data = diag.recv(65536)
            at = 0
            while at + 16 <= len(data):
                size, kind = struct.unpack_from("=IH", data, at)
                if kind == NLMSG_DONE:
                    done = True
                    break
                if kind == NLMSG_ERROR:
                    raise OSError(f"sock_diag: error {struct.unpack_from('=i', data, at + 16)[0]}")
                msg = at + 16   # inet_diag_msg: family, state, timer, retrans, then the id
                port = struct.unpack_from("!H", data, msg + 4)[0]
                raw = data[msg + 8:msg + 8 + (4 if data[msg] == socket.AF_INET else 16)]
                found.append((str(ipaddress.ip_address(raw)), port))
                at += (size + 3) & ~3
    return found


@dataclass
class SimHost:
    """One simulated host: a namespace ``ns`` with hostname ``name`` at ``addr``."""

    ns: str
    name: str
    addr: str
    switch: str
    port: str
    """The veth end on the switch's bridge (set down for a partition)."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    diag: socket.socket | bool | None = field(default=None, repr=False)
    """The netlink socket :meth:`listening` asks (made on first use; False: none could be)."""

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host (its namespace and hostname)."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "sh", "-c",
                f'hostname {self.name} && exec "$@"', "sh", *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (killed, with its process group, when the hosts go)."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion."""
        kwargs.setdefault("timeout", 120)
        return subprocess.run(self.command(argv), **kwargs)

    def link_down(self) -> None:
        """Cut this host off the switch (a partition); its processes keep running."""
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def link_up(self) -> None:
        _ip("-n", self.switch, "link", "set", self.port, "up")

    def listening(self) -> list[tuple[str, int]]:
        """(address, port) of every TCP socket listening in this host's namespace: asked of the
        kernel over a sock_diag netlink socket made inside it (a test polls this several times a
        second: no process started each time), else from ``ss`` run in it."""
        if self.diag is None:
            self.diag = _diag_socket(self.ns)
        if self.diag:
            try:
                return _listening(self.diag)
            except OSError:
                pass
        out = subprocess.run(["ip", "netns", "exec", self.ns, "ss", "-Hltn"], capture_output=True,
                             text=True, timeout=30).stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            addr, _, port = local.rpartition(":")
            found.append((addr.strip("[]"), int(port)))
        return found

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Every process started on this host, with its process group (a lost host)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass


    def pids(self) -> list[int]:
        """Every process inside this host's namespace (whoever started it: also the processes
        daemons such as slurmd fork)."""
        out = _ip("netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Every process inside this host's namespace (:meth:`pids`)."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class SimHosts:
    """``n`` simulated hosts on one switch (module docstring)."""

    def __init__(self, n: int) -> None:
        self.n = n
        tag = uuid.uuid4().hex[:5]
        self.tag = tag
        octet = int(tag[:4], 16)
        self.subnet = f"10.{200 + octet % 50}.{octet // 50 % 250}"
        self.switch = f"tmsw{tag}"
        self.hosts: list[SimHost] = []
        self._made: list[str] = []

    def __enter__(self) -> list[SimHost]:
        why = can_make_hosts()
        if why:
            pytest.skip(why)
        try:
            self._build()
        except Exception:
            self.close()
            raise
        return self.hosts

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        names = [f"tmh{i}" for i in range(self.n)]
        lines = ["127.0.0.1 localhost"] + [f"{self.subnet}.{i + 1} {name}" for i, name in enumerate(names)]
        for i, name in enumerate(names):
            ns, port = f"tm{self.tag}h{i}", f"p{i}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("\n".join(lines) + "\n")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.subnet}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            self.hosts.append(SimHost(ns=ns, name=name, addr=f"{self.subnet}.{i + 1}",
                                      switch=self.switch, port=port))

    def close(self) -> None:
        for host in self.hosts:
            host.kill()
            for proc in host.procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            host.kill_all()   # what escaped the process groups (daemons' children), in its namespace
            if host.diag:
                host.diag.close()
        for ns in reversed(self._made):     # deleting a namespace deletes its veth ends
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made.clear()

    def __exit__(self, *exc) -> None:
        self.close()
