"""The step policy of one replica of a ``--fault-tolerant`` run (docs/FAULT_TOLERANCE.md; its
workers start in :func:`trainmesh.run.ft_launch.ft_worker_main`).

A replica is the ranks of one dp index (its cp x pp x tp ranks), or, with ``--dp-shard S`` and
ZeRO, of the S dp indices of one shard group, under its own elastic agent, in a world of its
own: the engine's mesh of dp = S (plain ZeRO over them), cp, pp, tp and ep. It runs the training
loop of :mod:`trainmesh.run.trainer` like any run; :class:`QuorumSteps` gives that loop its
steps. Per step the replica's first rank asks the coordinator for a place in the quorum and
passes the decision on to the replica's other ranks; rank j of every member joins the quorum's
gloo group j (a fresh one whenever membership changed or an attempt failed); rank j of a
receiver gets rank j's live state and training state from the source over it; each rank runs
the engine's step (:meth:`~trainmesh.engine.engine.Engine.compute`) on its dp index's rows of
the step's global batch (split among the members' dp indices, sizes differing by at most one),
the engine summing the loss, the token count, the gradient and the MoE statistics over group j
after its own reductions inside the replica. The replica's ranks agree whether every one of
them succeeded, its first rank reports, and the step is applied
(:meth:`~trainmesh.engine.engine.Engine.apply`) only when the coordinator commits it; otherwise
it is dropped (:meth:`~trainmesh.engine.engine.Engine.discard`) and redone from unchanged
weights.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.config.train import TrainConfig
from trainmesh.core.errors import CommTimeout
from trainmesh.core.layout import Group
from trainmesh.core.step import StepResult
from trainmesh.data.packing import documents_in
from trainmesh.observe.flops import document_len
from trainmesh.engine.engine import Engine
from trainmesh.fault_tolerance.inject import Injector
from trainmesh.fault_tolerance.protocol import Decision, Outcome, Request, split_rows
from trainmesh.fault_tolerance.replica import CoordinatorRestarted, QuorumClient
from trainmesh.observe.layout import layout_record
from trainmesh.observe.metrics import MetricsWriter
from trainmesh.observe.progress import Progress
from trainmesh.observe.tensorboard import TensorBoardLog
from trainmesh.run.steps import Records, StepDone, nonfinite_ends_run


class ReplicaRankLost(RuntimeError):
    """A collective inside the replica failed: one of its ranks was lost, and its agent restarts
    them all (this rank ends with one line, no traceback)."""


class QuorumSteps:
    """The steps of one rank of a fault-tolerant replica (module docstring)."""

    def __init__(self, cfg: TrainConfig, engine: Engine, dataset: Any, client: QuorumClient, *,
                 replica: int, restart: int, control: Any, own_records: bool) -> None:
        self.cfg, self.engine, self.dataset, self.client = cfg, engine, dataset, client
        self.replica, self.restart, self.control, self.own = replica, restart, control, own_records
        self.rank, self.ranks = client.rank, cfg.parallel.replica_ranks
        self.shards = cfg.parallel.replica_dp
        self.inject = Injector(replica, restart, rank=self.rank)
        self.pids = [os.getpid()]
        if self.ranks > 1:
            self.pids = [0] * self.ranks
            dist.all_gather_object(self.pids, os.getpid(), group=control)
        self.needs_state = restart > 0
        """Restarted by its agent: its fresh weights are no committed state even at step 0 (any
        replica behind the committed step copies the live state: the coordinator compares)."""
        self.pg: Any = None
        self.pg_members: list[list[Any]] | None = None
        self.pg_quorum = -1
        self.led_last = False
        self.summary = own_records   # across hosts, each replica reports its own run
        self._out: Records | None = None
        self._across_error = ""
        self.failed = self.degraded = self.reconnected = 0   # what this replica saw
        self.restarted = False   # the coordinator was found restarted during the last attempt
        self._floor = 0          # the lowest quorum not yet decided without this replica
        self._unconfirmed: dict[str, Any] | None = None
        """The row of a step this replica computed whose commit it never learned (its coordinator
        died first): written, marked copied, once the live state it copies holds that step."""
        self._documents: int | None = None
        self._document_len: float | None = None
        """Documents in the global batch of the step attempted (packed data; else None)."""

    # ---------------------------------------------------------------- the policy
    def resumes(self) -> bool:
        """--resume on a fresh start only: a restarted replica copies the live state."""
        return self.restart == 0

    def records(self, start: int, board: TensorBoardLog) -> Records:
        """Across hosts rank 0 writes the replica's own metrics file (and ``board``: its
        TensorBoard); on one host it posts them to the coordinator, whose launcher writes both."""
        if self.rank != 0:
            self._out = MetricsWriter(None)
        elif self.own:   # a restart by its agent adds to the file of its first start
            self._out = MetricsWriter(self.cfg.metrics_out, keep_steps_before=start,
                                      append=self.restart > 0, also=board.record)
        else:
            self._out = _Posted(self.client)
        return self._out

    def summarize(self, summary: dict[str, Any]) -> dict[str, Any]:
        """A replica's own summary (a run across hosts): the run's layout, this replica, its
        ranks' process ids and what it saw of the failures."""
        p = self.cfg.parallel
        return {**summary, "layout": layout_record(self.cfg),
                "replica": self.replica, "replicas": p.replicas, "pids": self.pids,
                "restarts": self.restart,
                "fault_tolerance": {"failed_attempts": self.failed, "degraded_steps": self.degraded,
                                    "coordinator_restarts": self.reconnected}}

    def run(self, start: int, last: int, *, enabled: bool,
            before_step: Callable[[int], None] | None) -> Iterator[StepDone]:
        q: int | None = 0 if self.restart == 0 else None
        first = True
        tokens = self.cfg.global_batch * self.cfg.gpt_config().seq_len
        with Progress(total=last, enabled=enabled, start=start - 1) as bar:
            while self.engine.step_count < last:
                d, q = self._decision(q, first, last)
                first = False
                if d is None or d.abort:   # the run is over, or cannot go on (the coordinator says why)
                    break
                member = d.has(self.replica, self.client.incarnation)
                self._note(d, member)
                if not member:   # left out (the others may commit steps without it): asks into
                    q, self._floor = None, d.quorum + 1   # the next one, with the step it holds
                    continue
                if before_step is not None:
                    before_step(d.step)
                done = self._member(d)
                q = None if self.restarted else q + 1
                if done is not None:
                    self.led_last = done.lead
                    yield done
                    bar.update(done.step, loss=done.loss,
                               tokens_per_s=tokens / done.dt if done.dt > 0 else 0.0)

    def _note(self, d: Decision, member: bool) -> None:
        """A replica writing its own metrics file: the coordinator's restart and, as a member,
        the membership changes it sees."""
        if self._out is None or not self.own:
            return
        if d.restarted:
            self.reconnected += 1
            self._out.write({"event": "coordinator", "step": d.step, "restarted": True})
        if member and d.quorum > 0 and (d.lost or d.joined):
            self._out.write({"event": "quorum", "step": d.step, "replicas": len(d.members),
                             "lost": d.lost, "joined": d.joined})

    # ---------------------------------------------------------------- decisions
    def _decision(self, q: int | None, first: bool, last: int) -> tuple[Decision | None, int]:
        """The decision of the replica's next quorum, the same on all its ranks: its first rank
        asks (after a coordinator restart, into the new coordinator's quorums) and passes it on."""
        msg: list[Any] = [None, q, False]
        if self.rank == 0:
            msg = list(self._ask(q, first, last))
        if self.ranks > 1:
            dist.broadcast_object_list(msg, src=0, group=self.control)
            if msg[2] and self.rank != 0:   # the coordinator was restarted: find it too
                self.client.reconnect()
        decision, q, _ = msg   # (among the replica's own ranks)
        return decision, q

    def _ask(self, q: int | None, first: bool, last: int) -> tuple[Decision | None, int, bool]:
        """(the decision, its quorum, whether the coordinator was found restarted meanwhile)."""
        restarted = False
        while True:
            try:
                if q is None:
                    if self.restart > 0 and first:
                        self.inject.maybe_wait_to_join(self.client.next_step)
                    q = max(self.client.next_quorum(), self._floor)
                asked = q
                self.inject.maybe_hold(self.engine.step_count + 1,
                                       lambda: self.client.everyone_asked(asked, self.cfg.parallel.replicas))
                request = Request(self.replica, self.client.incarnation, self.engine.step_count,
                                  self.needs_state, os.getpid(), self.pids,
                                  last=last, timeout_s=self.cfg.parallel.timeout_s, quorum=q)
                return self.client.request(q, request, first=first), q, restarted
            except CoordinatorRestarted:   # its quorums start afresh; it may wait for everyone
                self._drop_group()
                q, restarted, first, self._floor = None, True, True, 0

    # ---------------------------------------------------------------- one attempt
    def _member(self, d: Decision) -> StepDone | None:
        """Attempt step ``d.step`` as a member of quorum ``d``; the step if it was committed."""
        # the same choice on every member: all were in quorum q-1 and saw it committed, or not
        fresh = (self.pg is None or self.pg_members != d.members or self.pg_quorum != d.quorum - 1)
        self.pg_members, self.pg_quorum = d.members, d.quorum
        epoch = self.client.epoch   # the coordinator that decided
        t0 = time.perf_counter()
        result, row, error = self._attempt(d, fresh)
        outcome = Outcome(self.replica, self.client.incarnation, not error, error,
                          row=row if not error else {}, quorum=d.quorum)
        committed = self._commit(d.quorum, d.step, outcome, epoch)
        if not committed and self.restarted and result is not None and not error:
            self._unconfirmed = {"event": "step", "step": d.step, "loss": row["loss"],
                                 "grad_norm": row["grad_norm"], "replicas": len(d.members),
                                 "copied": True}
        if not committed:
            self.failed += 1
            if result is not None:
                self.engine.discard()   # the weights, the schedule, the loss scale stay as they were
            self._drop_group()          # a group that saw a failure is not reused
            return None
        if self._unconfirmed is not None and self._unconfirmed["step"] <= d.step:
            self._unconfirmed = None   # redone and applied here: its row is the applied one
        with self._inside():
            report = self.engine.apply(result)
        self.needs_state = False
        self.degraded += len(d.members) < self.cfg.parallel.replicas
        extra: dict[str, Any] = {"replicas": len(d.members)}
        if self._documents is not None:
            extra["documents"], extra["document_len"] = self._documents, self._document_len
        if "state_transfer_s" in row:
            extra["state_transfer_s"] = round(row["state_transfer_s"], 4)
        return StepDone(d.step, report, t0, time.perf_counter() - t0, extra,
                        lead=d.replicas[0] == self.replica)

    def _commit(self, q: int, step: int, outcome: Outcome, epoch: str) -> bool:
        """Report the replica's outcome (its first rank) and learn the commit, the same on all
        its ranks; the coordinator of the decision (``epoch``) lost meanwhile: not committed
        here (if it was, a peer applied it, and this replica copies the live state)."""
        msg: list[Any] = [False, False]
        if self.rank == 0:
            try:
                if self.client.epoch != epoch:   # found restarted during the attempt
                    raise CoordinatorRestarted("during the attempt")
                msg = [self.client.report(q, outcome, lambda: self.inject.maybe_wait_until(
                    step, "late", self.client.gone)), False]
            except CoordinatorRestarted:
                msg = [False, True]
        if self.ranks > 1:
            dist.broadcast_object_list(msg, src=0, group=self.control)
            if msg[1] and self.rank != 0:
                self.client.reconnect()
        self.restarted = bool(msg[1])   # its quorums start afresh: asks into the one it collects
        if self.restarted:
            self._floor = 0
        return bool(msg[0])

    def _attempt(self, d: Decision, fresh: bool) -> tuple[StepResult | None, dict[str, Any], str]:
        """(the computed step, the outcome's row, the first error of any rank: empty if none).
        What involves other replicas may fail on some ranks of this one and not on others:
        after each such part the ranks agree (:meth:`_agree`), so they go on, or give up,
        together; what happens inside the replica never fails alone (a rank lost takes the
        whole replica down: its agent restarts every rank)."""
        began = time.perf_counter()
        row: dict[str, Any] = {}
        got = None
        try:
            if fresh:
                self._drop_group()
                self.pg = self.client.process_group(d)
            if d.source == self.replica and d.receivers:
                self.inject.maybe_die(d.step, "send")
                named, optim = self.engine.live_state()
                self.client.send_state(self.pg, d, named, optim, self.engine.trainer_state())
            if self.replica in d.receivers:
                self.inject.maybe_die(d.step, "recv")
                got = self.client.recv_state(self.pg, d, self.engine.live_state()[0])
            error = ""
        except Exception as exc:   # noqa: BLE001 - a failed attempt: the coordinator decides
            error = self._failed(exc)
        error = self._agree(error)
        if error:
            return None, row, error
        self._across_error = ""
        with self._inside():
            if got is not None:   # every rank of the replica received its part: load it
                self._load(*got)
                row["state_transfer_s"] = time.perf_counter() - began
                self._confirmed_by_copy()
            result = self.engine.compute(self._microbatches(d), across=self._across(d))
        error = self._agree(self._across_error)
        if error:
            return result, row, error
        self.inject.maybe_die(d.step, "report")
        row.update(loss=result.loss, grad_norm=result.grad_norm, overflow=result.overflow)
        if result.nonfinite:   # and whether --on-nonfinite ends the run at it (else: skipped)
            ends = nonfinite_ends_run(self.cfg.on_nonfinite, self.engine.nonfinite_run + 1)
            row.update(nonfinite=result.nonfinite, **({"nonfinite_ends": ends} if ends else {}))
        return result, row, ""

    def _across(self, d: Decision) -> Callable[[torch.Tensor], None]:
        """The engine's sum over the members: rank j's tensor all-reduced over group j (a copy:
        an op left behind when the quorum is abandoned writes where nobody reads). The first
        failure drops the group and makes the rest of the attempt's sums no-ops; the replica's
        ranks then agree on it."""
        first = [True]

        def reduce(t: torch.Tensor) -> None:
            if self._across_error:
                return
            try:
                if first[0]:
                    first[0] = False
                    self.inject.maybe_die(d.step, "reduce")
                    self.inject.maybe_fail(d.step)
                    self.inject.maybe_pause(d.step, self.client.silence)
                buf = t.detach().to("cpu", copy=True)
                self.client.wait_work(self.pg.allreduce([buf]), d.quorum, self.pg)
                t.copy_(buf)
            except Exception as exc:   # noqa: BLE001 - as above
                self._across_error = self._failed(exc)
        return reduce

    def _microbatches(self, d: Decision) -> list[dict[str, torch.Tensor]]:
        """This rank's rows of step ``d.step`` (member i's dp index s takes piece i * S + s,
        the same on its cp, pp and tp ranks), as ``--microbatches`` nearly equal parts."""
        cfg, engine = self.cfg, self.engine
        batch = self.dataset.batch(cfg.seed, d.step, cfg.global_batch)
        self._documents = documents_in(batch)   # a packed batch's, for the step's row
        if self._documents is not None:
            self._document_len = document_len(batch["position_ids"])
        piece = d.replicas.index(self.replica) * self.shards + engine.mesh.index(Group.dp)
        start, end = split_rows(cfg.global_batch, len(d.members) * self.shards, piece)
        mine = {k: v[start:end].to(engine.device) for k, v in batch.items()}
        parts = min(cfg.parallel.microbatches, end - start)
        chunks = {k: torch.tensor_split(v, parts) for k, v in mine.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]

    # ---------------------------------------------------------------- failures
    def _drop_group(self) -> None:
        """Its ops left behind time out on their own, holding it until then (nothing waits)."""
        self.pg = None

    def _failed(self, exc: Exception) -> str:
        """A part involving other replicas failed on this rank: drop the group."""
        self._drop_group()
        where = f"rank {self.rank}: " if self.ranks > 1 else ""
        return f"{where}{type(exc).__name__}: {exc}"[:300]

    def _agree(self, error: str) -> str:
        """The first error of any rank of the replica (empty: none), the same on all of them."""
        if self.ranks == 1:
            return error
        seen: list[Any] = [None] * self.ranks
        with self._inside():
            dist.all_gather_object(seen, error, group=self.control)
        return next((e for e in seen if e), "")

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        """Collectives among the replica's ranks: a failure there is the loss of one of them."""
        try:
            yield
        except RuntimeError as exc:   # gloo's transport errors are plain RuntimeErrors
            if self.ranks == 1 or not (isinstance(exc, (dist.DistError, CommTimeout))
                                       or "gloo" in str(exc)):
                raise   # not a collective's failure: the traceback says what it was
            first = (str(exc).splitlines() or [""])[0][:200]
            raise ReplicaRankLost(f"replica {self.replica} rank {self.rank}: a collective inside "
                                  f"the replica failed ({first}); its agent restarts it") from None

    # ---------------------------------------------------------------- live state
    def _confirmed_by_copy(self) -> None:
        """The state just copied holds the step whose commit this replica missed: the peers
        applied it, so it was committed with this replica's outcome among the members'; its row
        (loss and grad norm are the members' common values) goes into the replica's own file,
        marked copied, so no committed step is missing from it. A step the new coordinator
        redoes instead is applied, and its row written, as any other."""
        missed, self._unconfirmed = self._unconfirmed, None
        if missed is not None and self.engine.step_count >= missed["step"] and self._out is not None \
                and self.own:
            self._out.write(missed)

    def _load(self, params: dict[str, torch.Tensor], optim: dict[str, dict[str, torch.Tensor]],
              trainer: dict[str, Any]) -> None:
        """Take the source's live state and training state (every rank of the replica, together)."""
        self.engine.load_live_state(params, optim, trainer)
        self.needs_state = False


class _Posted:
    """A run on one host: the replica's first rank posts its step, eval and save records to the
    coordinator, which writes each once (every member posts its step rows); at the run's end
    (its summary, which the coordinator's launcher writes itself) it waits until the coordinator
    wrote them all (bounded: :data:`FLUSH_S`)."""

    KINDS = ("step", "eval", "save")
    FLUSH_S = 10.0

    def __init__(self, client: QuorumClient) -> None:
        self.client, self.n = client, 0

    def write(self, record: dict[str, Any]) -> None:
        if record.get("event") == "summary":
            with contextlib.suppress(CoordinatorRestarted):
                self.client.flush(self.FLUSH_S)
        if record.get("event") in self.KINDS:
            try:
                self.client.post(self.n, record)
            except CoordinatorRestarted:   # not on one host: its coordinator dies with it
                return
            self.n += 1
