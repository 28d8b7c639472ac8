"""What the engine reports besides a step: memory, traffic, traces (an :class:`Accounting`
mixin of :class:`~trainmesh.engine.engine.Engine`).

Each is read from the tensors the strategy holds, the communication ledger or the executor's
measured actions (docs/METRICS.md): nothing here takes part in a step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from trainmesh.comm import Comm
from trainmesh.comm.ledger import Span
from trainmesh.core.layout import Group
from trainmesh.core.mesh import ParallelMesh
from trainmesh.core.step import Executor
from trainmesh.data_parallel.base import GradSync
from trainmesh.engine.moe_metrics import MoEMetrics
from trainmesh.observe.metrics import storage_bytes

if TYPE_CHECKING:
    from trainmesh.pipeline_parallel.schedules import Timeline


class Accounting:
    """Memory, traffic and trace reports of an engine (its ``grad_sync``, ``comm``, ``executor``)."""

    grad_sync: GradSync
    comm: Comm
    executor: Executor
    mesh: ParallelMesh
    moe: MoEMetrics
    state_bytes: dict[str, int]
    offloaded_bytes: dict[str, int]

    @property
    def rank(self) -> int:
        """This process's rank in the world."""
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        """How many processes the run has."""
        return self.mesh.world_size

    def batch_share(self) -> tuple[int, int]:
        """(this rank's dp index, dp): the slice of the global batch its replica trains on."""
        return self.mesh.index(Group.dp), self.mesh.size(Group.dp)

    def summary_ranks(self, probes: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Collective: every rank's row of the run's summary, in rank order (its place, the
        memory ``probes`` the loop measured, what it holds and sent, its MoE routing), and the
        summary's own fields the engine adds (the MoE layers' counts) (docs/METRICS.md)."""
        mine = {"rank": self.mesh.rank, "coords": self.mesh.coords, **probes,
                "model_state_bytes": self.state_bytes, "offloaded_bytes": self.offloaded_bytes,
                "comm_buffer_peak_bytes": self.comm_buffer_peak_bytes,
                "comm_bytes_per_step": self.comm_bytes_per_step()}
        if self.moe.stats is None:
            return self.gather_object(mine), {}
        # this rank's routing, for the all-to-all's accounting
        mine["moe_rows"] = {"routed": self.moe.routed.round().long().tolist(),
                            "received": self.moe.received.round().long().tolist()}
        return self.gather_object(mine), {"moe": self.moe.summary()}

    def measure_state(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (distinct storages)."""
        held = self.grad_sync.held_tensors()
        seen: set[int] = set()
        return {k: storage_bytes(held[k], seen) for k in ("params", "grads", "optimizer")}

    @property
    def comm_buffer_peak_bytes(self) -> int:
        """Peak bytes of transient communication buffers (buckets, gathered ZeRO-3 units)."""
        return self.grad_sync.comm_buffer_peak_bytes

    def comm_bytes_per_step(self) -> dict[str, dict[str, float]]:
        """Payload bytes this rank passed to each op, averaged over the steps, by mesh axis."""
        return self.comm.ledger.bytes_per_step()

    def last_step_traffic(self) -> dict[str, Any]:
        """The communication ledger's record of the last step (axis -> op -> stats)."""
        return self.comm.ledger.steps[-1]

    def trace_comm(self, enabled: bool = True) -> None:
        """Keep a span (issue to completion, axis, op, bytes) of every communication op of the
        steps that follow (``--trace-out``), until called with ``False``."""
        self.comm.ledger.tracing = enabled

    def last_step_spans(self) -> list[Span]:
        """The communication spans of the last step (empty unless :meth:`trace_comm` was on)."""
        ledger = self.comm.ledger
        return [s for s in ledger.spans if s.step == ledger.closed - 1]

    @property
    def last_timeline(self) -> Timeline | None:
        """This rank's measured forward/backward spans of the last step (a pipeline's: one row
        per stage rank), None before the first step."""
        return self.executor.last_timeline

    def write_timeline(self, path: str) -> None:
        """Collective (pipeline runs): the measured per-rank timeline of the last step, drawn
        by rank 0 to ``path`` (.svg or .png)."""
        from trainmesh.pipeline_parallel.timeline import write_timeline
        write_timeline(self.executor, self.comm, path)

    def gather_object(self, obj: Any) -> list[Any]:
        """Collective: ``obj`` of every rank of the world, in rank order."""
        return self.comm.all_gather_object(obj)

    def state_is_finite(self) -> bool:
        """Collective: whether every rank's parameters and optimizer states are all finite."""
        held = self.grad_sync.held_tensors()
        finite = all(bool(torch.isfinite(t).all()) for k in ("params", "optimizer") for t in held[k])
        flag = torch.tensor([1.0 if finite else 0.0])
        self._all_reduce_min(flag)
        return flag.item() >= 1.0

    def _all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        self.comm.all_reduce(t, Group.world, op=dist.ReduceOp.MIN)
        return t
