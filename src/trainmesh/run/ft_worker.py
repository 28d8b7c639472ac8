"""One replica of a ``--fault-tolerant`` run (docs/FAULT_TOLERANCE.md).

Each replica is one process under its own elastic agent, in a world of its own (a one-process
default group: the engine runs the plain single-process step). Per step it asks the
coordinator for a place in the quorum; the members form a gloo process group over a
PrefixStore of the coordinator's store (a fresh one whenever membership changed or an attempt
failed), a receiver gets the live state from the source over it, each member runs forward and
backward on its rows of the step's global batch (split among the members present, sizes
differing by at most one), and the members sum the loss, the token count and the gradients over
the group. The step is applied only when the coordinator commits it (every member succeeded);
otherwise the gradients are dropped and the step is redone from unchanged weights.
"""
from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainmesh.config.train import TrainConfig
from trainmesh.core.distributed import pick_device
from trainmesh.data.corpus import make_datasets
from trainmesh.engine.engine import Engine
from trainmesh.fault_tolerance.inject import Injector
from trainmesh.fault_tolerance.protocol import Decision, Outcome, split_rows
from trainmesh.fault_tolerance.replica import QuorumClient


@record
def ft_worker_main(cfg: TrainConfig, replica: int, address: str) -> int:
    """Replica ``replica`` of the run whose coordinator serves ``address``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os._exit(128 + signum))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = pick_device(cfg.device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=cfg.parallel.timeout_s))
    try:
        return Replica(cfg, replica, address, device).run()
    finally:
        dist.destroy_process_group()


class Replica:
    """The training loop of one replica."""

    def __init__(self, cfg: TrainConfig, replica: int, address: str, device: torch.device) -> None:
        from trainmesh.run.trainer import build_engine
        self.cfg, self.replica, self.device = cfg, replica, device
        self.incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        local = dataclasses.replace(cfg.parallel, dp=1, fault_tolerant=False)
        one = dataclasses.replace(cfg, parallel=local)
        self.engine: Engine = build_engine(one, device, local.build_mesh())
        gpt = cfg.gpt_config()
        self.dataset, _ = make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                                        held_out=False, tokenizer=cfg.tokenizer)
        self.tokens = cfg.global_batch * gpt.seq_len
        self.client = QuorumClient(address, replica, self.incarnation, timeout_s=cfg.parallel.timeout_s)
        self.inject = Injector(replica, self.incarnation)
        self.steps_done = 0
        self.needs_state = self.incarnation > 0   # a restarted replica copies the live state
        self.pg: Any = None
        self.pg_members: list[list[int]] | None = None
        self.pg_quorum = -1
        self.norm = 0.0

    def run(self) -> int:
        last = self.cfg.exit_after or self.cfg.steps
        if self.incarnation > 0:
            self.inject.maybe_wait_to_join(self.client.next_step)
        q = 0 if self.incarnation == 0 else self.client.next_quorum()
        first = self.incarnation == 0
        try:
            while self.steps_done < last:
                self.inject.maybe_hold(self.steps_done + 1, lambda: self.client.everyone_asked(
                    q, self.cfg.parallel.dp))
                decision = self.client.request(q, step=self.steps_done, needs_state=self.needs_state,
                                               pid=os.getpid(), first=first)
                first = False
                if decision is None:      # the run reached its last step meanwhile
                    break
                if decision.abort:    # the launcher reports the reason and exits 1
                    break
                if decision.has(self.replica, self.incarnation):
                    self._member(decision)
                else:                     # left out: the others may commit a step without it
                    self.needs_state = True
                q += 1
        finally:
            self.client.close()
        return 0

    def _member(self, decision: Decision) -> None:
        # the same choice on every member: all were in quorum q-1 and saw it committed, or not
        fresh = (self.pg is None or self.pg_members != decision.members
                 or self.pg_quorum != decision.quorum - 1)
        self.pg_members, self.pg_quorum = decision.members, decision.quorum
        outcome = self._attempt(decision, fresh)
        if self.client.report(decision.quorum, outcome):
            self._apply()
            self.steps_done = decision.step
        else:
            self.engine.grad_sync.zero_grad()   # discarded: the weights stay as they were
            self._drop_group()                  # a group that saw a failure is not reused

    def _drop_group(self) -> None:
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:   # noqa: BLE001 - already broken: nothing left to close
                pass
        self.pg = None

    def _attempt(self, d: Decision, fresh: bool) -> Outcome:
        began = time.perf_counter()
        row: dict[str, Any] = {}
        try:
            if fresh:
                self._drop_group()
                self.pg = self.client.process_group(d)
            if d.source == self.replica and d.receivers:
                self.inject.maybe_die(d.step, "send")
                params, optim = self.engine.grad_sync.logical_state()
                self.client.send_state(self.pg, d, list(params.items()), optim,
                                       self.engine.checkpoint_state())
            if self.replica in d.receivers:
                self._receive(d)
                row["state_transfer_s"] = time.perf_counter() - began
            loss, norm = self._forward_backward_reduce(d)
        except Exception as exc:   # noqa: BLE001 - a failed attempt: the coordinator decides
            self.engine.grad_sync.zero_grad()
            self._drop_group()   # its connections closed: a peer still inside a collective fails now
            return Outcome(self.replica, self.incarnation, False, f"{type(exc).__name__}: {exc}"[:300])
        dt = time.perf_counter() - began
        if not (math.isfinite(loss) and math.isfinite(norm)):
            row["nonfinite"] = f"loss {loss}" if not math.isfinite(loss) else f"grad_norm {norm}"
        row.update(loss=loss, grad_norm=norm, lr=self.engine.optimizer.param_groups[0]["lr"],
                   tokens=self.tokens, step_time_s=dt,
                   tokens_per_s=self.tokens / dt if dt > 0 else 0.0, mfu=None)
        return Outcome(self.replica, self.incarnation, True, row=row)

    def _receive(self, d: Decision) -> None:
        named = list(self.engine.grad_sync.logical_state()[0].items())
        params, optim, trainer = self.client.recv_state(self.pg, d, named)
        self.engine.grad_sync.load_logical_state(params, optim)
        self.engine.restore_checkpoint_state(trainer)
        self.steps_done = int(trainer["step"])
        self.needs_state = False

    def _forward_backward_reduce(self, d: Decision) -> tuple[float, float]:
        """This member's rows of step ``d.step``: forward, backward; the sums over the members;
        the gradient scaled to the mean over every token of the global batch. (loss, norm)."""
        cfg, engine = self.cfg, self.engine
        batch = self.dataset.batch(cfg.seed, d.step, cfg.global_batch)
        start, end = split_rows(cfg.global_batch, len(d.members), d.replicas.index(self.replica))
        mine = {k: v[start:end].to(self.device) for k, v in batch.items()}
        parts = min(cfg.parallel.microbatches, end - start)
        loss_sum, count = engine.executor.run(_split(mine, parts), engine.hooks)
        engine.grad_sync.finish(1.0)
        self.inject.maybe_die(d.step, "reduce")
        totals = torch.tensor([loss_sum, count], dtype=torch.float64)
        self.pg.allreduce([totals]).wait()
        for buf in engine.grad_sync.reduced_grads():
            held = buf.cpu()
            self.pg.allreduce([held]).wait()
            buf.copy_(held.div_(totals[1].item()))
        self.norm = _norm(engine)
        return (totals[0] / totals[1]).item(), self.norm

    def _apply(self) -> None:
        """The committed step: clip, optimizer and LR schedule, as the single-process engine."""
        engine, clip = self.engine, self.cfg.parallel.grad_clip
        if clip > 0 and self.norm > clip:
            engine.grad_sync.clip(clip / (self.norm + 1e-6))
        engine.grad_sync.step()
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        engine.grad_sync.zero_grad()
        engine.step_count += 1


def _norm(engine: Engine) -> float:
    """The global gradient norm (the reduced gradients are whole on every member)."""
    return math.sqrt(sum(float(torch.dot(g.float(), g.float())) for g in engine.grad_sync.reduced_grads()))


def _split(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``parts`` microbatches of nearly equal rows (the loss is a sum over tokens: exact)."""
    chunks = {k: torch.tensor_split(v, parts) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]
