"""Nothing listens beyond what the run needs: a local run's sockets are on loopback, and ports
are bound where they are picked (two runs started together never collide). Linux only
(reads /proc)."""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import Launched

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

T = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--vocab-size", "64",
     "--global-batch", "8"]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
LISTEN = "0A"


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's little-endian-per-word hex address -> its text form."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))


def listening_sockets(pids: list[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that ``pids`` hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue   # the process ended meanwhile
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:   # the kernel lists the listening sockets first: the rest
            next(lines)              # (every connection of the machine) is neither generated
            for line in lines:       # nor read, several times a second
                cols = line.split()
                if cols[3] != LISTEN:
                    break
                if cols[9] in owner:
                    addr, port = cols[1].rsplit(":", 1)
                    found.add((_address(addr), int(port, 16), owner[cols[9]]))
    return found


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def lan_address() -> str | None:
    """An IPv4 address of this machine beyond loopback (None: it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:   # SIOCGIFADDR: the interface's address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue   # no IPv4 address
            addr = socket.inet_ntoa(raw[20:24])
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    return None


def lan_hostname() -> str | None:
    """A hostname that resolves to a network address of this machine, for runs in a UTS
    namespace of their own (a cluster node's hostname resolves to its LAN address, where a
    backend left to pick its own device listens): the address itself. None where no such
    namespace can be made (not root) or the machine has no address beyond loopback."""
    addr = lan_address()
    try:
        made = subprocess.run(["unshare", "--uts", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return addr if addr and made.returncode == 0 else None


def _run_and_watch(args: list[str], env: dict[str, str], tmp: Path, name: str, seen: dict,
                   hostname: str | None = None) -> None:
    """Run `trainmesh train ARGS` (forked from the test zygote, its workers from a fork server
    of its own, as a fresh launcher's; under ``hostname`` where given); while it runs, record
    every listening socket of its launcher and of its workers."""
    metrics = tmp / f"{name}.jsonl"
    proc = Launched(["train", *T, *args, "--metrics-out", str(metrics)], tmp, env={**ENV, **env},
                    name=name, hostname=hostname)
    sockets: set = set()
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                sockets |= listening_sockets([proc.pid, *proc.workers()])
            except OSError:
                pass
            time.sleep(0.3)
    finally:
        proc.end()
    seen[name] = (proc.wait(30), proc.err.read_text()[-3000:], sockets,
                  metrics.read_text().count('"event": "step"') if metrics.exists() else 0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_runs_listen_on_loopback_only_and_never_collide(tmp_path):
    """Four runs started at once (dp 2, pp 2, a parameter server, and a fault-tolerant run of
    two replicas of tp 2: the coordinator, each replica's own group and the groups across
    replicas), on a host whose name resolves to a network address (where one can be made): each
    ends well, and every socket their launchers and workers listen on is a loopback address
    (each run watched on its own). The pipeline run also has the collective-order check on: a
    real layout passes it (no false alarm)."""
    from trainmesh.comm.check import CHECK_ENV
    runs = {"dp": (["--dp", "2", "--steps", "6"], {}),
            "pp": (["--pp", "2", "--microbatches", "2", "--steps", "6"], {CHECK_ENV: "1"}),
            "ps": (["--strategy", "ps", "--dp", "2", "--ps-servers", "1", "--steps", "6"], {}),
            "ft": (["--fault-tolerant", "--dp", "2", "--tp", "2", "--steps", "6"], {})}
    seen: dict = {}
    hostname = lan_hostname()
    threads = [threading.Thread(target=_run_and_watch, args=(args, env, tmp_path, name, seen, hostname))
               for name, (args, env) in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in runs:
        code, err, sockets, steps = seen[name]
        assert code == 0, f"{name}: exit {code}: {err}"
        assert steps == 6, f"{name}: {steps} steps logged"
        assert sockets, f"{name}: no listening socket seen"
        exposed = sorted((a, p, pid) for a, p, pid in sockets if not _is_loopback(a))
        assert not exposed, (f"{name} or a worker listens beyond loopback (address, port, pid) on "
                             f"host {hostname or socket.gethostname()}: {exposed}")


def _all_reduce_ones() -> list[float]:
    import torch
    import torch.distributed as dist
    t = torch.ones(3)
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_port_picked_early_is_never_bound_later(monkeypatch):
    """Another program takes every port torch's launcher picks (as a run started at the same
    time would, between the pick and the bind): the job still forms, since each store binds its
    own kernel-picked port at once."""
    import torch.distributed.elastic.rendezvous.api as rdzv_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from trainmesh.testing import run_distributed
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(rdzv_api, "get_free_port", lambda: port)
        try:
            result = run_distributed(_all_reduce_ones, 2, timeout_s=30)
        except ChildFailedError as exc:
            result = exc.get_first_failure()[1].message
    assert result == {0: [2.0] * 3, 1: [2.0] * 3}, f"the job did not form: {result}"


def test_listening_sockets_reads_proc():
    """The reader itself: a socket this process listens on, on loopback and on every interface."""
    with socket.socket() as lo, socket.socket(socket.AF_INET6) as anywhere:
        lo.bind(("127.0.0.1", 0))
        lo.listen()
        anywhere.bind(("::", 0))
        anywhere.listen()
        mine = listening_sockets([os.getpid()])
        assert ("127.0.0.1", lo.getsockname()[1], os.getpid()) in mine
        assert ("::", anywhere.getsockname()[1], os.getpid()) in mine
    assert _is_loopback("127.0.0.1") and _is_loopback("::ffff:127.0.0.1") and not _is_loopback("::")
