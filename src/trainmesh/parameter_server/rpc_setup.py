"""Joining the RPC world: trainers and servers are ranks of one job (trainers first)."""
from __future__ import annotations

import os

import torch.distributed as dist
import torch.distributed.rpc as rpc

from ..distributed import _free_port


def worker_name(rank: int, n_trainers: int) -> str:
    """``trainer{i}`` for ranks below ``n_trainers``, ``server{j}`` for the rest."""
    return f"trainer{rank}" if rank < n_trainers else f"server{rank - n_trainers}"


def start_rpc(n_trainers: int, timeout_s: float) -> None:
    """init_rpc on every rank of the (already initialised) process group; rank 0 picks the port."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{addr}:{port[0]}",
                                              rpc_timeout=timeout_s, num_worker_threads=max(8, 2 * world))
    rpc.init_rpc(worker_name(rank, n_trainers), rank=rank, world_size=world, rpc_backend_options=options)
