"""Joining the RPC world: trainers and servers are ranks of one job (trainers first).

The RPC agent meets its peers over the default process group's store (under its own key
prefix), through a rendezvous handler registered with ``torch.distributed``: no store of its
own, so nothing new listens and no port is picked. TensorPipe's transports listen on
``TP_SOCKET_IFNAME``'s interface, which ``init_distributed`` chose with gloo's: loopback for a
single-node run, the interface that reaches the master otherwise (see docs/SECURITY.md).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from trainmesh.core.compat import default_store

RDZV_SCHEME = "trainmesh-pg"
"""``init_method`` scheme of the rendezvous over the default process group's store."""


def worker_name(rank: int, n_trainers: int) -> str:
    """``trainer{i}`` for ranks below ``n_trainers``, ``server{j}`` for the rest."""
    return f"trainer{rank}" if rank < n_trainers else f"server{rank - n_trainers}"


def _pg_store_rendezvous(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """Yield (the default group's store under the ``trainmesh/rpc/`` prefix, rank, world)."""
    store = default_store()
    if store is None:
        raise RuntimeError(f"{RDZV_SCHEME}:// needs an initialised default process group")
    yield dist.PrefixStore("trainmesh/rpc/", store), dist.get_rank(), dist.get_world_size()


def _register_rendezvous() -> None:
    try:
        dist.register_rendezvous_handler(RDZV_SCHEME, _pg_store_rendezvous)
    except RuntimeError:   # registered by an earlier call in this process
        pass


def start_rpc(n_trainers: int, timeout_s: float) -> None:
    """init_rpc on every rank of the (already initialised) process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _register_rendezvous()
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"{RDZV_SCHEME}://", rpc_timeout=timeout_s,
                                              num_worker_threads=max(8, 2 * world))
    rpc.init_rpc(worker_name(rank, n_trainers), rank=rank, world_size=world, rpc_backend_options=options)
