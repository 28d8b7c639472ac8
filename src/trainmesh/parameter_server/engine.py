"""PSEngine: training any model with an RPC parameter server (``ParallelConfig(strategy="ps")``).

Every process of a job of ``dp + ps_servers`` ranks builds a PSEngine with the same arguments;
ranks ``0..dp-1`` become trainers (a replica for compute), the rest servers (a shard of the
parameters and their optimizer states, balanced by bytes). Trainers call ``train_step`` with
their slice of the global batch; servers call ``serve`` (returns when the trainers ``close``).

sync: the step of plain data-parallel training — gradients of the loss *sum* are summed on the
servers and divided by the global token count; the global gradient norm (before clipping) is
assembled from each server's shard; every server applies the same clipping coefficient.
async (Hogwild): each trainer clips its own mean gradient by its own norm, pushes and pulls
without waiting for the others; with ``ps_staleness`` K a trainer starting step t first waits
until the slowest trainer finished step t-1-K (K=0: lock-step). The observed staleness — how
many steps this trainer is ahead of the slowest when it starts a step — is in the step's report.

A trainer offers the training loop of :mod:`trainmesh.run.trainer` what the mesh's engine
offers it (:meth:`PSEngine.step` returning a :class:`~trainmesh.core.step.StepReport`, its
share of the batch, the last step's traffic, the summary's rank rows): every strategy runs that
one loop.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from trainmesh.config.parallel import ParallelConfig
from trainmesh.core.errors import ConfigError
from trainmesh.core.randomness import Draws, drawing
from trainmesh.core.step import StepReport
from trainmesh.models.hf_random import install_draws

from ..comm.ledger import Ledger
from .client import PSClient, shard_by_bytes
from .rpc_setup import start_rpc, worker_name
from .server import ParameterServer, local_server


class PSEngine:
    """One rank of a parameter-server job: a trainer (``train_step``) or a server (``serve``)."""

    def __init__(self, model: nn.Module, optimizer: Callable[[Any], torch.optim.Optimizer],
                 loss_fn: Callable[[nn.Module, Any], Any], config: ParallelConfig, *,
                 param_groups: Callable[[str], dict] | None = None,
                 lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                 seed: int = 0) -> None:
        if config.strategy != "ps":
            raise ConfigError("strategy", "PSEngine needs ParallelConfig(strategy='ps')")
        self.config, self.model, self.loss_fn = config, model, loss_fn
        self.seed = seed
        """The run's seed: a Hugging Face model's dropout and router noise are drawn from it by
        position, as the mesh's engine draws them (:mod:`trainmesh.models.hf_random`)."""
        self.random = install_draws(model)
        self.n_trainers, world = config.dp, dist.get_world_size()
        if world != config.world_size:
            raise ConfigError("dp+ps-servers", f"{config.dp}+{config.ps_servers} must equal the world size {world}")
        self.rank = dist.get_rank()
        self.is_server = self.rank >= self.n_trainers
        self.ledger = Ledger()
        self.step_count = 0
        self.max_staleness = 0   # the most steps this trainer ran ahead of the slowest (async)
        self.report: StepReport | None = None
        """The last step's report (None before the first)."""
        self.state_bytes = {"params": 0, "grads": 0, "optimizer": 0}
        self.nonfinite_run = 0   # the loop's count (no step here is reported non-finite)
        self.flops_per_token: float | None = None   # no MFU reported
        self.trainers = dist.new_group(list(range(self.n_trainers)))   # collective: every rank
        start_rpc(self.n_trainers, config.timeout_s)
        if self.is_server:
            ParameterServer(n_trainers=self.n_trainers, mode=config.ps_mode, optimizer=optimizer,
                            param_groups=param_groups, lr_scheduler=lr_scheduler).register()
        dist.barrier()   # every server registered before any trainer asks for it
        self.client: PSClient | None = None
        if not self.is_server:
            self._connect()

    def _connect(self) -> None:
        named = list(self.model.named_parameters())
        rrefs = [rpc.remote(worker_name(self.n_trainers + s, self.n_trainers), local_server)
                 for s in range(self.config.ps_servers)]
        plan = shard_by_bytes(named, self.config.ps_servers)
        self.client = PSClient(named, rrefs, plan, self.ledger, first_server_rank=self.n_trainers)
        if self.rank == 0:
            self.client.load_servers()
        dist.barrier(group=self.trainers)
        self.client.pull()   # set-up: every replica starts from the servers' values

    # ---------------------------------------------------------------- trainer
    @property
    def last(self) -> Any:
        """The last step's metrics (read-only; empty before the first)."""
        return self.report.metrics() if self.report is not None else {}

    @property
    def world_size(self) -> int:
        """Trainers and servers."""
        return self.config.world_size

    def batch_share(self) -> tuple[int, int]:
        """(this trainer's index, the trainers): its slice of the global batch."""
        return self.rank, self.n_trainers

    def last_step_traffic(self) -> dict[str, Any]:
        """The ledger's record of the last step (axis -> op -> stats)."""
        return self.ledger.steps[-1]

    def train_step(self, batch: Any) -> float:
        """One step on this trainer's slice; returns the global-batch loss (sync) or this
        trainer's loss (async)."""
        return self.step(batch).loss

    def step(self, batch: Any) -> StepReport:
        """:meth:`train_step`, returning the step's report (``staleness`` in async mode)."""
        assert self.client is not None, "train_step runs on trainer ranks; servers call serve()"
        self.ledger.begin_step()
        self.step_count += 1
        loss_sum, count = self._forward_backward(batch)
        if self.config.ps_mode == "sync":
            loss, norm = self.client.push_sync(self.step_count, loss_sum, count)
            lr = self.client.update_and_pull(self.step_count, self._clip_coef(norm))
            extra: dict[str, Any] = {}
        else:
            k = self.config.ps_staleness
            need = max(0, self.step_count - 1 - k) if k is not None else 0
            slowest = self.client.wait_clock(need)
            sq = sum(p.grad.double().pow(2).sum() for p in self.model.parameters() if p.grad is not None)
            loss, norm = loss_sum / count, math.sqrt(float(sq)) / count
            lr = self.client.push_pull_async(self._clip_coef(norm) / count)
            self.client.tick(self.rank, self.step_count)
            extra = {"staleness": self.step_count - 1 - slowest}
            self.max_staleness = max(self.max_staleness, extra["staleness"])
        self.ledger.end_step()
        self.state_bytes = self._held()
        self.model.zero_grad(set_to_none=False)
        self.report = StepReport(loss, norm, lr, extra=extra)
        return self.report

    def _forward_backward(self, batch: Any) -> tuple[float, float]:
        """Backward of the loss sum over this trainer's microbatches; -> (loss sum, count)."""
        from trainmesh.data.corpus import split_microbatches
        parts = split_microbatches(batch, self.config.microbatches) if isinstance(batch, dict) else [batch]
        draws = self._draws(parts)
        loss_sum, count = 0.0, 0.0
        for mb, drawn in zip(parts, draws):
            with drawing(drawn):          # the global rows of this trainer's microbatch
                out = self.loss_fn(self.model, mb)
                total, n = out if isinstance(out, tuple) else (out, 1.0)   # a mean loss weighs 1
                total.backward()
            loss_sum, count = loss_sum + float(total.detach()), count + float(n)
        for p in self.model.parameters():   # an unused parameter pushes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return loss_sum, count

    def _draws(self, parts: list) -> list[Draws | None]:
        """Where each microbatch's elements sit in the step's global batch, as the mesh's
        engine says it (:mod:`trainmesh.engine.draws`): this trainer's rows start at its index
        x its rows, its microbatches follow one another; whole sequences (None for a microbatch
        without a (batch, seq) tensor)."""
        def shape(mb: Any) -> torch.Size | None:
            parts = mb.values() if isinstance(mb, dict) else mb if isinstance(mb, (tuple, list)) else [mb]
            return next((t.shape for t in parts if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
        shapes = [shape(mb) for mb in parts]
        row0 = self.rank * sum(s[0] for s in shapes if s is not None)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        out: list[Draws | None] = []
        for s in shapes:
            out.append(None if s is None else Draws(self.seed, self.step_count - 1, row0, s[0],
                                                     torch.arange(s[1], device=device)))
            row0 += 0 if s is None else s[0]
        return out

    def _clip_coef(self, norm: float) -> float:
        clip = self.config.grad_clip
        return clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0

    def _held(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {"params": sum(p.numel() * p.element_size() for p in params),
                "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
                "optimizer": 0}

    def server_bytes(self) -> list[dict[str, int]]:
        """Bytes each server holds (trainer side; one RPC per server)."""
        assert self.client is not None
        return self.client.server_bytes()

    def summary_ranks(self, probes: dict[str, int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Collective over the trainers: the summary's rank rows (each trainer's, with the
        ``setup_mem_bytes`` and ``peak_mem_bytes`` of ``probes``; on rank 0 the servers' too:
        what they hold, their traffic mirroring the trainers' (each push in, each pull out))
        and the summary's ``max_staleness``."""
        axes = ("dp", "tp", "pp", "other", "ps")
        mine = {"rank": self.rank, "role": "trainer", "coords": {"dp": self.rank, "pp": 0, "tp": 0},
                "setup_mem_bytes": probes["setup_mem_bytes"], "peak_mem_bytes": probes["peak_mem_bytes"],
                "model_state_bytes": self.state_bytes, "comm_buffer_peak_bytes": 0,
                "comm_bytes_per_step": self.ledger.bytes_per_step(axes),
                "max_staleness": self.max_staleness}
        ranks: list[Any] = [None] * self.n_trainers
        dist.all_gather_object(ranks, mine, group=self.trainers)
        servers = [{"rank": self.n_trainers + s, "role": "server", "coords": {"dp": "-", "pp": "-", "tp": "-"},
                    "model_state_bytes": {k: held[k] for k in ("params", "grads", "optimizer")},
                    "peak_mem_bytes": held["peak_mem_bytes"], "comm_bytes_per_step": {"ps": {}}}
                   for s, held in enumerate(self.server_bytes())] if self.rank == 0 else []
        return ranks + servers, {"max_staleness": max(r["max_staleness"] for r in ranks)}

    # ---------------------------------------------------------------- both
    def serve(self) -> None:
        """Servers: answer trainers until every rank closes."""
        self.close()

    def close(self) -> None:
        """Leave the RPC world (waits for every rank: a graceful shutdown is a barrier)."""
        rpc.shutdown(graceful=True)
