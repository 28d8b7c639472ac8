"""Key-value stores that listen only where the run needs them, on a port the kernel picked.

Every listening socket trainmesh opens is a ``torch.distributed.TCPStore`` server. Given a host
name, TCPStore listens on every interface (``[::]``); given ``master_listen_fd``, it serves a
socket the caller already bound and put in listening state. So each server here is built from
a socket bound to one address -- the loopback address for a single-node run, the master
address for a multi-node one -- and, unless the caller names a port, to port 0: the kernel
picks a free port at bind time, so two runs started together can never collide (nothing picks
a port, releases it, and binds it later).

A store server has no authentication: anyone who can reach its address can read and write
it. docs/SECURITY.md says what listens where and the trust boundary that follows.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
STORE_ENV = "TRAINMESH_LAUNCHER_STORE"
"""``host:port`` of the store a local launcher hosts: the workers' rendezvous, their hang
diagnosis, and where rank 0 hands its process-group store's port to the others."""
PG_PORT_KEY = "trainmesh/pg_port"
HOST_KEY = "trainmesh/host"
"""Where each rank leaves its host name (``HOST_KEY/<attempt>/<rank>``), for failure reports."""


def listening_socket(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` only (``port`` 0: one the kernel picks now), listening."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def server_store(host: str = LOOPBACK, port: int = 0, *, world_size: int | None = None,
                 timeout_s: float = 300.0, multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` alone (``port`` 0: a kernel-picked free port).

    The store takes over the socket (its file descriptor is detached from Python). It is
    torch's classic server (``use_libuv=False``): the libuv one refuses a given socket before
    torch 2.6, and both serve the same protocol to clients."""
    sock = listening_socket(host, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, bound_port, world_size, is_master=True, master_listen_fd=fd,
                             wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                             multi_tenant=multi_tenant, use_libuv=False)
    except BaseException:
        os.close(fd)
        raise


def client_store(address: str, *, world_size: int | None = None,
                 timeout_s: float = 300.0) -> dist.TCPStore:
    """A client of the store at ``host:port``."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def attempt_key(key: str) -> str:
    """``key`` for this attempt of an elastic job (restarted workers must not read the dead
    attempt's values)."""
    return f"{key}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def process_group_store(rank: int, world_size: int, *, master: tuple[str, int] | None,
                        timeout_s: float) -> Any:
    """The store the default process group is built on, or None to let torch build it (env://).

    - Under a local launcher (``TRAINMESH_LAUNCHER_STORE`` set): rank 0 serves a store on the
      loopback address, port picked by the kernel, and hands the port to the others through the
      launcher's store.
    - Under torchrun sharing its agent's store (``TORCHELASTIC_USE_AGENT_STORE``): None; the
      workers are clients of the agent's store and listen on nothing.
    - Otherwise (torchrun with sharing disabled, srun): rank 0 serves ``master``'s port
      (``MASTER_ADDR``/``MASTER_PORT``, or the address srun's environment implies) on the
      interface of its address only; the others connect to it.
    """
    launcher = os.environ.get(STORE_ENV)
    if launcher:
        handoff = client_store(launcher, timeout_s=timeout_s)
        if rank == 0:
            store = server_store(LOOPBACK, world_size=world_size, timeout_s=timeout_s)
            handoff.set(attempt_key(PG_PORT_KEY), str(store.port))
            return store
        port = handoff.get(attempt_key(PG_PORT_KEY)).decode()
        return client_store(f"{LOOPBACK}:{port}", world_size=world_size, timeout_s=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return None
    if master is None:
        raise ValueError("MASTER_ADDR: not set, and no srun step to derive it from")
    addr, port = master
    if rank == 0:
        return server_store(addr, port, world_size=world_size, timeout_s=timeout_s)
    return client_store(f"{addr}:{port}", world_size=world_size, timeout_s=timeout_s)


def failure_store(timeout_s: float) -> Any | None:
    """A store every rank of the job reaches, for failure reports (short ``timeout_s`` per
    call): the local launcher's, else the default group's; None without one."""
    from trainmesh.core.compat import default_store
    try:
        address = os.environ.get(STORE_ENV)
        if address:
            return client_store(address, timeout_s=timeout_s)
        store = default_store()
        if store is not None:
            store.set_timeout(timedelta(seconds=timeout_s))
        return store
    except Exception:  # noqa: BLE001 - an unreachable store: reports do without it
        return None


def publish_host(rank: int) -> None:
    """Leave this rank's host name where a failing peer's report can read it."""
    import socket

    from trainmesh.core.compat import default_store
    address = os.environ.get(STORE_ENV)
    store = client_store(address) if address else default_store()   # its own timeouts untouched
    if store is not None:
        store.set(attempt_key(f"{HOST_KEY}/{rank}"), socket.gethostname())


def host_of(rank: int, store: Any | None) -> str | None:
    """The host ``rank`` said it runs on (:func:`publish_host`), or None."""
    if store is None:
        return None
    try:
        return store.get(attempt_key(f"{HOST_KEY}/{rank}")).decode()
    except Exception:  # noqa: BLE001 - not published, or the store is gone
        return None
