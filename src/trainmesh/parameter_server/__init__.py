"""RPC parameter-server training: servers hold parameters and optimizer states, trainers compute.

``PSEngine`` is the entry point (any ``nn.Module``); ``server.py`` holds a shard and steps it,
``client.py`` is the trainer's side (push, pull, the ``ps`` ledger axis).
Imports core, comm, config, data, data_parallel and observe.
"""
from .client import PSClient, shard_by_bytes
from .engine import PSEngine
from .server import ParameterServer

__all__ = ["PSClient", "PSEngine", "ParameterServer", "shard_by_bytes"]
