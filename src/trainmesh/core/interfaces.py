"""Which network interface the communication backends listen on.

gloo, NCCL and TensorPipe each open listening sockets of their own: gloo's device for its
pairs, NCCL's bootstrap, TensorPipe's transports. Left alone, gloo binds the address the
machine's hostname resolves to -- on a cluster node that is its LAN address, even for a run whose
ranks all sit on this machine. Each backend takes its interface only from an environment
variable read when a process group (or the RPC agent) is created, so this is the one place
trainmesh writes the environment: those variables, where the user has not set them.

- A local run (every rank on this machine) uses the loopback interface.
- A multi-host run uses the interface that reaches the master (the route the kernel picks to
  it), the same one its store listens on.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import MutableMapping

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
"""The variables gloo, NCCL and TensorPipe read for the interface to listen on."""
SIOCGIFADDR = 0x8915


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), or None."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def source_address(host: str) -> str:
    """The local address the kernel would send from to reach ``host`` (a route lookup: a UDP
    socket's connect sends nothing)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def _ipv4_of(name: str) -> str | None:
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_of(name: str) -> list[str]:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [str(ipaddress.IPv6Address(bytes.fromhex(r[0]))) for r in rows if len(r) >= 6 and r[5] == name]


def interface_of(address: str) -> str | None:
    """The name of the local interface holding ``address`` (Linux), or None."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if ip.is_loopback:
        return loopback_interface()
    for _, name in socket.if_nameindex():
        held = [_ipv4_of(name)] if ip.version == 4 else _ipv6_of(name)
        if any(a is not None and ipaddress.ip_address(a) == ip for a in held):
            return name
    return None


def backend_interface(*, local: bool, master: str | None) -> str | None:
    """The interface the backends should listen on: loopback for a ``local`` run, else the one
    that reaches ``master``; None where it cannot be told (the backends' own choice stays)."""
    if local or master is None:
        return loopback_interface()
    try:
        return interface_of(source_address(master))
    except (OSError, ValueError):
        return None


def bind_backends(interface: str | None, env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Point gloo, NCCL and TensorPipe at ``interface`` in ``env``, each variable only where it
    is unset (the user's choice wins); returns what was set."""
    if interface is None:
        return {}
    added = {var: interface for var in IFNAME_VARS if not env.get(var)}
    env.update(added)
    return added
