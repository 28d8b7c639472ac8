"""One replica of a ``--fault-tolerant`` run (docs/FAULT_TOLERANCE.md).

A replica is the T = ``--tp`` ranks of one dp index, or (``--dp-shard S`` with ZeRO) of the S
dp indices of one HSDP shard group, under its own elastic agent, in a world of its own: its
default group holds its S x T ranks (one: the plain single-process engine), laid out as the
engine's mesh of dp = S, tp = T (rank = dp index x T + tp index). Per step its
first rank asks the coordinator for a place in the quorum and every rank reads the decision;
rank j of every member joins the quorum's gloo group j over a PrefixStore of the coordinator's
store (a fresh one whenever membership changed or an attempt failed); rank j of a receiver gets
rank j's live state from the source over it (the same (dp, tp) coordinates: the same shard of
the same tp slice); each rank runs forward and backward on its dp index's rows of the step's
global batch (split among the members' dp indices present, sizes differing by at most one; the
tp ranks of a dp index see the same rows), reduces its gradient shard inside the replica and
all-reduces it, with the loss and the token count (counted on tp rank 0 only), over group j. The replica's ranks then agree (one all-reduce over the replica) whether
every one of them succeeded, so they report, apply or discard the step together. The step is
applied only when the coordinator commits it (every member succeeded); otherwise the gradients
are dropped and the step is redone from unchanged weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import Iterator
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
    """Rank ``LOCAL_RANK`` of replica ``replica`` of the run whose coordinator serves ``address``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os._exit(128 + signum))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = pick_device(cfg.device)
    ranks, rank = cfg.parallel.replica_ranks, int(os.environ.get("LOCAL_RANK", "0"))
    client = QuorumClient(address, replica, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                          timeout_s=cfg.parallel.timeout_s, rank=rank)
    # the replica's own group: its ranks, in this incarnation (one rank: a world of its own)
    store = dist.HashStore() if ranks == 1 else client.shard_store()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=cfg.parallel.timeout_s))
    try:
        return Replica(cfg, replica, client, device).run()
    finally:
        client.close()
        dist.destroy_process_group()


class ReplicaRankLost(RuntimeError):
    """A collective inside the replica failed: one of its ranks was lost, and its agent restarts
    them all (this rank ends with one line, no traceback)."""


class Replica:
    """The training loop of one rank of a replica."""

    def __init__(self, cfg: TrainConfig, replica: int, client: QuorumClient, device: torch.device) -> None:
        from trainmesh.run.trainer import build_engine
        self.cfg, self.replica, self.device, self.client = cfg, replica, device, client
        self.incarnation, self.rank = client.incarnation, client.rank
        self.ranks, self.shards = cfg.parallel.replica_ranks, cfg.parallel.replica_dp
        # the replica's mesh: dp = S (plain ZeRO over them), tp = T; one rank: the single process
        local = dataclasses.replace(cfg.parallel, dp=self.shards, dp_shard=None, fault_tolerant=False)
        one = dataclasses.replace(cfg, parallel=local)
        self.engine: Engine = build_engine(one, device, local.build_mesh())
        gpt = cfg.gpt_config()
        self.dataset, _ = make_datasets(cfg.data, vocab_size=gpt.vocab_size, seq_len=gpt.seq_len,
                                        held_out=False, **cfg.data_options())
        self.tokens = cfg.global_batch * gpt.seq_len
        self.inject = Injector(replica, self.incarnation, rank=self.rank)
        self.pids = [os.getpid()]
        if self.ranks > 1:
            self.pids = [0] * self.ranks
            dist.all_gather_object(self.pids, os.getpid())
        self.steps_done = 0
        self.needs_state = self.incarnation > 0   # a restarted replica copies the live state
        self.pg: Any = None
        self.pg_members: list[list[int]] | None = None
        self.pg_quorum = -1
        self.norm = 0.0

    def run(self) -> int:
        last = self.cfg.exit_after or self.cfg.steps
        lead = self.rank == 0   # asks into quorums and reports for the replica
        if self.incarnation > 0 and lead:
            self.inject.maybe_wait_to_join(self.client.next_step)
        q = 0 if self.incarnation == 0 else self.client.start_quorum(self.ranks)
        first = self.incarnation == 0
        while self.steps_done < last:
            if lead:
                self.inject.maybe_hold(self.steps_done + 1, lambda: self.client.everyone_asked(
                    q, self.cfg.parallel.replicas))
                decision = self.client.request(q, step=self.steps_done, needs_state=self.needs_state,
                                               pid=os.getpid(), first=first, pids=self.pids)
            else:
                decision = self.client.decision(q)
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
        return 0

    def _member(self, decision: Decision) -> None:
        # the same choice on every member: all were in quorum q-1 and saw it committed, or not
        fresh = (self.pg is None or self.pg_members != decision.members
                 or self.pg_quorum != decision.quorum - 1)
        self.pg_members, self.pg_quorum = decision.members, decision.quorum
        outcome = self._attempt(decision, fresh)   # the same on every rank of the replica
        if self.client.report(decision.quorum, outcome if self.rank == 0 else None):
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
        """One attempt at step ``d.step``. What involves other replicas may fail on some ranks
        of this one and not on others: after each such part the ranks agree (:meth:`_agree`),
        so they go on, or give up, together; what happens inside the replica (forward,
        backward, the reductions of ZeRO) never fails alone (a rank lost takes the whole
        replica down: its agent restarts every rank)."""
        began = time.perf_counter()
        row: dict[str, Any] = {}
        got = None
        try:
            if fresh:
                self._drop_group()
                self.pg = self.client.process_group(d)
            if d.source == self.replica and d.receivers:
                self.inject.maybe_die(d.step, "send")
                named, optim = self._local_state()
                self.client.send_state(self.pg, d, named, optim, self.engine.checkpoint_state())
            if self.replica in d.receivers:
                self.inject.maybe_die(d.step, "recv")
                got = self.client.recv_state(self.pg, d, self._local_state()[0])
            error = ""
        except Exception as exc:   # noqa: BLE001 - a failed attempt: the coordinator decides
            error = self._failed(exc)
        error, _ = self._agree(error)
        if error:
            return Outcome(self.replica, self.incarnation, False, error)
        with self._inside():
            if got is not None:   # every rank of the replica received its part: load it
                self._load(*got)
                row["state_transfer_s"] = time.perf_counter() - began
            totals = self._forward_backward(d)
        try:
            self.inject.maybe_die(d.step, "reduce")
            self.inject.maybe_fail(d.step)
            sq = self._reduce_across(totals)
            error = ""
        except Exception as exc:   # noqa: BLE001 - as above
            error, sq = self._failed(exc), 0.0
        error, sq = self._agree(error, sq)
        if error:
            return Outcome(self.replica, self.incarnation, False, error)
        loss, norm = (totals[0] / totals[1]).item(), math.sqrt(sq)
        self.norm = norm
        dt = time.perf_counter() - began
        if not (math.isfinite(loss) and math.isfinite(norm)):
            row["nonfinite"] = f"loss {loss}" if not math.isfinite(loss) else f"grad_norm {norm}"
        row.update(loss=loss, grad_norm=norm, lr=self.engine.optimizer.param_groups[0]["lr"],
                   tokens=self.tokens, step_time_s=dt,
                   tokens_per_s=self.tokens / dt if dt > 0 else 0.0, mfu=None)
        return Outcome(self.replica, self.incarnation, True, row=row)

    def _failed(self, exc: Exception) -> str:
        """A part involving other replicas failed on this rank: drop the group at once (its
        connections close, so a peer still inside a collective with it fails now)."""
        self._drop_group()
        where = f"rank {self.rank}: " if self.ranks > 1 else ""
        return f"{where}{type(exc).__name__}: {exc}"[:300]

    def _agree(self, error: str, sq: float = 0.0) -> tuple[str, float]:
        """What every rank of the replica takes from a part that may have failed on some of
        them: the first error (empty: none), and the sum of ``sq`` over the ranks."""
        if self.ranks == 1:
            return error, sq
        seen: list[Any] = [None] * self.ranks
        with self._inside():
            dist.all_gather_object(seen, (error, sq))
        errors = [e for e, _ in seen if e]
        return (errors[0] if errors else ""), sum(s for _, s in seen)

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        """Collectives among the replica's ranks: a failure there is the loss of one of them."""
        try:
            yield
        except RuntimeError as exc:   # gloo's transport errors are plain RuntimeErrors
            if self.ranks == 1 or not (isinstance(exc, dist.DistError) or "gloo" in str(exc)):
                raise   # not a collective's failure: the traceback says what it was
            first = (str(exc).splitlines() or [""])[0][:200]
            raise ReplicaRankLost(f"replica {self.replica} rank {self.rank}: a collective inside "
                                  f"the replica failed ({first}); its agent restarts it") from None

    def _local_state(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
        """What this rank sends as a source: without ZeRO, its whole tp slice of the model (one
        rank: the whole model); a shard group, this rank's shards (the same rank of every
        replica holds the same shard of the same tp slice)."""
        if self.cfg.parallel.zero == 0:
            params, optim = self.engine.grad_sync.logical_state()
            return list(params.items()), optim
        return self.engine.grad_sync.local_shards()

    def _load(self, params: dict[str, torch.Tensor], optim: dict[str, dict[str, torch.Tensor]],
              trainer: dict[str, Any]) -> None:
        if self.cfg.parallel.zero == 0:
            self.engine.grad_sync.load_logical_state(params, optim)
        else:   # then every rank gathers its parameters whole (ZeRO-1/2): together
            self.engine.grad_sync.load_local_shards(params, optim)
        self.engine.restore_checkpoint_state(trainer)
        self.steps_done = int(trainer["step"])
        self.needs_state = False

    def _forward_backward(self, d: Decision) -> torch.Tensor:
        """This rank's rows of step ``d.step`` (member i's dp index s takes piece i * S + s,
        the same on its tp ranks): forward, backward, the reductions inside the replica; the
        replica's (loss sum, count), counted on tp rank 0 only."""
        cfg, engine = self.cfg, self.engine
        batch = self.dataset.batch(cfg.seed, d.step, cfg.global_batch)
        piece = d.replicas.index(self.replica) * self.shards + engine.mesh.index("dp")
        start, end = split_rows(cfg.global_batch, len(d.members) * self.shards, piece)
        mine = {k: v[start:end].to(self.device) for k, v in batch.items()}
        parts = min(cfg.parallel.microbatches, end - start)
        loss_sum, count = engine.executor.run(_split(mine, parts), engine.hooks)
        engine.grad_sync.finish(1.0)
        holds = engine.executor.holds_loss and engine.mesh.index("tp") == 0   # last stage, tp rank 0
        totals = torch.tensor([loss_sum, count] if holds else [0.0, 0.0], dtype=torch.float64)
        if self.ranks > 1:
            dist.all_reduce(totals)
        return totals

    def _reduce_across(self, totals: torch.Tensor) -> float:
        """The sums over the members (this rank's group: the same rank of every member); the
        gradient scaled to the mean over every token of the global batch. This rank's part of
        the squared gradient norm (each logical parameter counted once, as the engine does)."""
        engine = self.engine
        self.pg.allreduce([totals]).wait()
        for buf in engine.grad_sync.reduced_grads():
            held = buf.cpu()
            self.pg.allreduce([held]).wait()
            buf.copy_(held.div_(totals[1].item()))
        return float(engine.local_grad_sq_sum())

    def _apply(self) -> None:
        """The committed step: clip, optimizer and LR schedule, as the single-process engine."""
        engine, clip = self.engine, self.cfg.parallel.grad_clip
        if clip > 0 and self.norm > clip:
            engine.grad_sync.clip(clip / (self.norm + 1e-6))
        with self._inside():
            engine.grad_sync.step()
        if engine.lr_scheduler is not None:
            engine.lr_scheduler.step()
        engine.grad_sync.zero_grad()
        engine.step_count += 1


def _split(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """``parts`` microbatches of nearly equal rows (the loss is a sum over tokens: exact)."""
    chunks = {k: torch.tensor_split(v, parts) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]
