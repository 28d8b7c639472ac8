"""The trainer's side of the parameter server: shard plan, push and pull, and their ledger entries.

A trainer keeps a full replica for compute. Each server owns a set of whole parameters, chosen
by :func:`shard_by_bytes` (the same plan on every process). Per step a trainer pushes, to each
server, one flat tensor of its shard's gradients and pulls one flat tensor of its parameters;
both are booked in the communication ledger on the axis ``ps`` (ops ``push`` and ``pull``), so
``comm_bytes_per_step["ps"]`` is 4Ψ + 4Ψ per trainer per step in fp32 (a shard travels in
:func:`~trainmesh.parameter_server.server.flat_dtype`: a float64 model's in float64, 8Ψ + 8Ψ).
"""
from __future__ import annotations

import math

import torch
import torch.distributed.rpc as rpc
from torch import nn

from ..comm.ledger import Ledger
from .server import ParameterServer, flat_dtype


def shard_by_bytes(named: list[tuple[str, torch.Tensor]], servers: int) -> list[list[str]]:
    """Parameter names per server: largest first onto the least-loaded server (balanced bytes)."""
    load = [0] * servers
    plan: list[list[str]] = [[] for _ in range(servers)]
    order = sorted(range(len(named)), key=lambda i: (-named[i][1].numel(), i))
    for i in order:
        s = min(range(servers), key=lambda j: (load[j], j))
        plan[s].append(named[i][0])
        load[s] += named[i][1].numel() * named[i][1].element_size()
    names = [n for n, _ in named]
    return [sorted(p, key=names.index) for p in plan]   # model order inside a shard


class PSClient:
    """Pushes gradients to and pulls parameters from every server, on behalf of one trainer."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], rrefs: list[rpc.RRef],
                 plan: list[list[str]], ledger: Ledger, *, first_server_rank: int) -> None:
        by_name = dict(named_params)
        self.rrefs, self.ledger, self.first_rank = rrefs, ledger, first_server_rank
        self.shards = [[by_name[n] for n in names] for names in plan]
        self.names = plan
        self.dtypes = [flat_dtype(shard) for shard in self.shards]
        """The dtype each server holds its shard in, which its gradients travel in."""

    # ---------------------------------------------------------------- plumbing
    def _book(self, op: str, t: torch.Tensor) -> None:
        self.ledger.record("ps", op, t.numel() * t.element_size())

    def _wait(self, futures: list) -> list:
        """Results of one future per server; a failure names the server and its rank."""
        out = []
        for s, f in enumerate(futures):
            try:
                out.append(f.wait())
            except Exception as exc:   # noqa: BLE001 (RPC wraps remote errors in many types)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                raise RuntimeError(f"parameter server {s} (rank {self.first_rank + s}) failed: "
                                   f"{first}") from exc
        return out

    def _flat_grads(self, s: int, scale: float = 1.0) -> torch.Tensor:
        flat = torch.cat([p.grad.reshape(-1).to(self.dtypes[s]) for p in self.shards[s]]).cpu()   # (Ψ_s,)
        return flat.mul_(scale) if scale != 1.0 else flat

    @torch.no_grad()
    def _unpack(self, s: int, flat: torch.Tensor) -> None:
        self._book("pull", flat)
        offset = 0
        for p in self.shards[s]:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))   # to the trainer's device
            offset += p.numel()

    # ---------------------------------------------------------------- protocol
    def load_servers(self) -> None:
        """Trainer 0: hand each server its shard's initial values (set-up traffic)."""
        futures = [rpc.rpc_async(r.owner(), ParameterServer.load,
                                 args=(r, [(n, p.detach().cpu()) for n, p in zip(names, shard)]))
                   for r, names, shard in zip(self.rrefs, self.names, self.shards)]
        self._wait(futures)

    def pull(self) -> None:
        flats = self._wait([rpc.rpc_async(r.owner(), ParameterServer.pull, args=(r,)) for r in self.rrefs])
        for s, flat in enumerate(flats):
            self._unpack(s, flat)

    def push_sync(self, step: int, loss_sum: float, tokens: float) -> tuple[float, float]:
        """Push this trainer's gradient sums; -> (global loss, global grad norm) of the step."""
        futures = []
        for s, r in enumerate(self.rrefs):
            flat = self._flat_grads(s)
            self._book("push", flat)
            futures.append(rpc.rpc_async(r.owner(), ParameterServer.push,
                                         args=(r, step, flat, loss_sum, tokens)))
        results = self._wait(futures)
        _, loss_total, token_total = results[0]
        return loss_total / token_total, math.sqrt(sum(sq for sq, _, _ in results))

    def update_and_pull(self, step: int, clip_coef: float) -> float:
        """Every server applies the step; pull the new parameters; -> the step's LR."""
        results = self._wait([rpc.rpc_async(r.owner(), ParameterServer.update_and_pull,
                                            args=(r, step, clip_coef)) for r in self.rrefs])
        for s, (flat, _) in enumerate(results):
            self._unpack(s, flat)
        return results[0][1]

    def push_pull_async(self, scale: float) -> float:
        """Push this trainer's gradient times ``scale`` and pull at once (Hogwild); -> LR."""
        futures = []
        for s, r in enumerate(self.rrefs):
            flat = self._flat_grads(s, scale)
            self._book("push", flat)
            futures.append(rpc.rpc_async(r.owner(), ParameterServer.push_pull, args=(r, flat)))
        results = self._wait(futures)
        for s, (flat, _) in enumerate(results):
            self._unpack(s, flat)
        return results[0][1]

    def wait_clock(self, need: int) -> int:
        """Block until every trainer finished step ``need``; -> the slowest trainer's step."""
        r = self.rrefs[0]
        return self._wait([rpc.rpc_async(r.owner(), ParameterServer.wait_clock, args=(r, need))])[0]

    def tick(self, trainer: int, step: int) -> None:
        r = self.rrefs[0]
        self._wait([rpc.rpc_async(r.owner(), ParameterServer.tick, args=(r, trainer, step))])

    def server_bytes(self) -> list[dict[str, int]]:
        return self._wait([rpc.rpc_async(r.owner(), ParameterServer.held_bytes, args=(r,))
                           for r in self.rrefs])
