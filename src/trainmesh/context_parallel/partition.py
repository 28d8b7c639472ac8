"""The zigzag partition of a sequence over the cp ranks of a CP group.

The sequence is cut into ``2·cp`` equal chunks; rank ``r`` holds chunks ``r`` and
``2·cp-1-r`` (in that order), so every rank holds one early and one late chunk and does the
same share of causal attention's work::

    cp = 2, chunks 0..3:   rank 0: [0, 3]   rank 1: [1, 2]
"""
from __future__ import annotations

from typing import Any

import torch

from trainmesh.core.errors import ConfigError


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp``) of every sequence that CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(local_len: int, rank: int, cp: int, device: torch.device | None = None
                     ) -> torch.Tensor:
    """Global positions (``local_len``,) of the tokens CP rank ``rank`` holds, in its order."""
    c = local_len // 2
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunk_ids(rank, cp)])


def shard_sequence(t: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (its length divisible by ``2·cp``)."""
    if cp == 1:
        return t
    if t.shape[dim] % (2 * cp):
        raise ConfigError("--seq-len", f"each of the cp ranks holds 2 of 2cp equal chunks: the "
                          f"length {t.shape[dim]} must be divisible by 2 x cp = {2 * cp}")
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, cp)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`shard_sequence` (rank order)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunk_ids(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def shard_batch(batch: Any, rank: int, cp: int) -> Any:
    """This rank's share of a microbatch: every tensor of two or more dimensions (input ids,
    labels, masks: ``(batch, seq, ...)``) cut along dim 1; others pass unchanged."""
    if cp == 1:
        return batch
    if isinstance(batch, torch.Tensor):
        return shard_sequence(batch, rank, cp) if batch.dim() >= 2 else batch
    if isinstance(batch, dict):
        return {k: shard_batch(v, rank, cp) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(shard_batch(v, rank, cp) for v in batch)
    return batch
