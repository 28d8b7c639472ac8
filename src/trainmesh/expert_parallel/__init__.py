"""Expert parallelism: MoE experts spread over the ``ep`` ranks, tokens moved by all-to-all.

Imports core, comm, models and data_parallel (layer 5); never the engine, run/ or the CLI.
"""
from __future__ import annotations

from .dispatch import AllToAll, ExpertExchange
from .shard import expert_names, shard_experts

__all__ = ["AllToAll", "ExpertExchange", "expert_names", "shard_experts"]
