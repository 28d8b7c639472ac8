"""The coordinator of a ``--fault-tolerant`` run: it serves the replicas' store (on one address
only: loopback for a run on one host, the ``--bind`` address of ``trainmesh coordinator``) and
decides, for every step attempt, which replicas take part (the quorum) and whether the attempt
is applied (the commit).

Every replica reads the same decision from the store, so membership, the split of the global
batch and the outcome of a step can never differ between replicas. Its state (the members, the
last committed step, who holds the live state, the run's last step) is rebuilt from the
replicas' requests, so a coordinator started again, empty, goes on where the dead one stopped:
the last committed step is the newest one a replica applied (a replica applies a step only
after reading its commit), every replica behind it copies the live state. A run on one host
runs it as a thread of the launcher, which also has it write the metrics file (the records the
replicas post, ``quorum`` events where membership changes, ``discarded`` events for step
attempts not applied) and keep the summary's counts.
docs/FAULT_TOLERANCE.md describes the protocol.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainmesh.core.stores import LOOPBACK, client_store, server_store
from trainmesh.observe.metrics import MetricsWriter

from .inject import COORDINATOR, Injector
from .ledger import Ledger
from .protocol import (
    COORDINATOR_ID,
    DONE,
    HEARTBEAT_TIMEOUT_S,
    POLL_S,
    Codec,
    Commit,
    Decision,
    Done,
    Epoch,
    Mark,
    Next,
    Outcome,
    Posted,
    Rejected,
    Request,
    key,
    parse_outcome,
    parse_posted,
    parse_request,
)

log = logging.getLogger("trainmesh")
REJOIN_GRACE_S = 1.0
"""A coordinator started again: how long its first quorum waits for every replica to find it
before going on with those whose heartbeat it sees."""


@dataclass
class Tally:
    """What the summary reports about the run's failures."""

    degraded_steps: int = 0
    """Committed steps that ran with fewer replicas than --dp."""
    failed_attempts: int = 0
    """Step attempts discarded because a member failed (each redone by those present)."""
    recovery_s: float = 0.0
    """Seconds from the start of each failed attempt to the next committed step, summed."""
    transfer_s: float = 0.0
    """Seconds the receivers spent getting the live state, summed."""
    pids: dict[int, list[int]] = field(default_factory=dict)
    """Each replica's process ids, one per rank of each incarnation, in order."""


class Coordinator:
    """Decides quorums and commits for ``replicas`` replicas until the last step is committed
    (``last``, or the one the replicas' requests name).

    ``startup_timeout_s`` bounds the wait for the first quorum (every replica), ``step_timeout_s``
    the wait for a member's outcome (default: the members' collective timeout plus slack).
    ``metrics_out``: write the replicas' records there (a run on one host), each handed to
    ``also`` too (its TensorBoard). ``secret``: the job's (every record is sealed with it, and
    a record that is not, or is malformed, stale or impossible, is logged once and ignored)."""

    def __init__(self, *, replicas: int, secret: str, host: str = LOOPBACK, port: int = 0,
                 last: int | None = None,
                 metrics_out: str | None = None, startup_timeout_s: float = 300.0,
                 step_timeout_s: float | None = None,
                 notify: Callable[[str], None] | None = None,
                 also: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.replicas, self.last = replicas, last
        self.notify = notify or log.info
        """Where the one-line notices of membership changes and discarded steps go."""
        self.startup_timeout_s, self.step_timeout_s = startup_timeout_s, step_timeout_s
        self._server = server_store(host, port, timeout_s=startup_timeout_s, multi_tenant=True)
        self.address = f"{host}:{self._server.port}" if ":" not in host else f"[{host}]:{self._server.port}"
        self.codec = Codec(secret, writer=COORDINATOR_ID, replicas=replicas, epoch=uuid.uuid4().hex,
                           last=last)
        self.ledger = Ledger(self.codec, self.notify)
        self.ledger.set(self._server, "epoch", Epoch(self.codec.epoch))
        self.metrics = MetricsWriter(metrics_out, also=also)
        self.tally = Tally()
        self.error: str | None = None
        """Why the run could not go on (None: it reached its last step, or was stopped)."""
        self.final_loss = float("nan")
        self.committed = 0
        self._rebuilt = False
        """The last committed step was rebuilt from the requests, none committed here since."""
        self._stop = threading.Event()
        self._suspects: set[int] = set()
        """Members lost during the last attempt: the next quorum does not wait for them (they
        are let in if they ask in time)."""
        self._posters: dict[tuple[int, str], int] = {}
        """(replica, incarnation) -> the number of the next record it posts."""
        self._written: set[tuple[str, int]] = set()
        self._transfer: dict[int, float] = {}
        self._inject = Injector(COORDINATOR, 0)
        self._thread = threading.Thread(target=self._run, name="trainmesh-ft-coordinator", daemon=True)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Every replica has ended: stop waiting for them."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def serve(self) -> None:
        """Run in this thread until the last step is committed (``trainmesh coordinator``)."""
        self._run(tail=False)

    def linger(self, bound_s: float = 60.0) -> None:
        """After the last commit: until no replica has beaten for the heartbeat timeout (they
        have read it and left), at most ``bound_s``."""
        store = getattr(self, "_store", None)
        deadline = time.monotonic() + bound_s
        while store is not None and time.monotonic() < deadline:
            if not any(self.ledger.alive(store, r) for r in range(self.replicas)):
                return
            self.ledger.heal(store, every=1)   # done, for a replica still to read it
            time.sleep(POLL_S * 5)

    def _run(self, tail: bool = True) -> None:
        store = None
        try:
            store = client_store(self.address, timeout_s=self.startup_timeout_s)
            self._store = store
            self._loop(store)
        except _Stopped:
            pass
        except Exception as exc:   # noqa: BLE001 - reported by the launcher as the run's failure
            self.error = f"the fault-tolerance coordinator failed: {type(exc).__name__}: {exc}"
        finally:   # whatever ended the loop: replicas still waiting end at once
            if store is not None:
                self.ledger.set(store, DONE, Done(self.committed))
        while tail and store is not None and not self._stop.wait(POLL_S * 5):
            with contextlib.suppress(RuntimeError, OSError):   # a run on one host: the records
                self._drain(store)                              # posted after the last commit,
                self.ledger.heal(store, every=1)                # until its replicas ended

    def _requests(self, store: Any, q: int) -> dict[int, Request]:
        """The valid requests for quorum q (of the run's last step, once known)."""
        got = {}
        for r in range(self.replicas):
            req = self.ledger.read(store, key("req", q, r),
                                   lambda raw, r=r: parse_request(self.codec, raw, q, r))
            if req is not None:
                got[r] = req
        return got

    # ---------------------------------------------------------------- the loop
    def _loop(self, store: Any) -> None:
        members: list[list[Any]] = []
        q, began = 0, time.monotonic()
        failed_at: float | None = None   # start of the first failed attempt since the last commit
        while self.last is None or self.committed < self.last:
            self.ledger.forget(q)
            self.ledger.set(store, "next", Next(q, self.committed + 1))
            requests = self._collect(store, q, members, began)
            decision = self._decide(q, requests, members)
            self.ledger.set(store, key("dec", q), decision, q)
            if decision.abort:
                self.error = decision.abort
                return
            for req in requests.values():
                pids = self.tally.pids.setdefault(req.replica, [])
                pids += [pid for pid in req.pids or [req.pid] if pid not in pids]
                self._posters.setdefault((req.replica, req.incarnation), 0)
            self._membership(decision, failed_at, began)
            members = decision.members
            attempt = time.monotonic()
            outcomes = self._outcomes(store, q, decision)
            ok = len(outcomes) == len(decision.members) and all(o.ok for o in outcomes)
            if ok and not _same_step(outcomes):   # a bug, not a fault: never applied
                self.ledger.set(store, key("commit", q), Commit(q, False), q)
                said_ends = any("nonfinite_ends" in o.row for o in outcomes)
                self.error = (f"internal: the members of step {decision.step} computed different "
                              "steps: " + "; ".join(f"replica {o.replica}: loss {o.row.get('loss')}"
                                                    f" overflow {o.row.get('overflow')}"
                                                    + (f" run ends: {o.row.get('nonfinite_ends', 'no')}"
                                                       if said_ends else "") for o in outcomes))
                break
            nonfinite = outcomes[0].row.get("nonfinite") if ok else None
            ends = outcomes[0].row.get("nonfinite_ends") if nonfinite else None   # else skipped
            self.ledger.set(store, key("commit", q), Commit(q, bool(ok and not ends)), q)
            if ok and self._inject.maybe_wait_until(decision.step, "commit", lambda: any(
                    store.check([key("req", q + 1, r)]) for r in range(self.replicas))):
                os.kill(os.getpid(), signal.SIGKILL)   # tests: a replica applied the step
            if ends:   # the same on every member (the sums are reduced): never applied
                self.error = (f"step {decision.step}: non-finite {nonfinite} (--on-nonfinite {ends}); "
                              "the run stops, nothing of the step was applied")
                break
            if ok:
                self._committed(decision, outcomes, failed_at)
                failed_at = None
            else:
                self.tally.failed_attempts += 1
                failed_at = attempt if failed_at is None else failed_at
                errors = [f"replica {o.replica}: {o.error}" for o in outcomes if not o.ok]
                missing = sorted(set(decision.replicas) - {o.replica for o in outcomes})
                why = "; ".join(errors + [f"replica {r} lost" for r in missing])[:300]
                self.metrics.write({"event": "discarded", "step": decision.step,
                                    "replicas": len(decision.members),
                                    "attempt_s": round(time.monotonic() - attempt, 3), "why": why})
                self.notify(f"trainmesh: step {decision.step} discarded ({why}); redone by the "
                            "replicas present")
            q += 1
            began = time.monotonic()

    def _membership(self, decision: Decision, failed_at: float | None, began: float) -> None:
        """The ``quorum`` event and notice of a changed membership."""
        if decision.quorum == 0 or not (decision.lost or decision.joined):
            return
        event = {"event": "quorum", "step": decision.step, "replicas": len(decision.members),
                 "lost": decision.lost, "joined": decision.joined}
        if failed_at is not None:
            event["recovering_s"] = round(time.monotonic() - failed_at, 3)
        elif decision.lost:   # lost between two steps: the wait for its heartbeat to stop
            waited = time.monotonic() - began
            event["recovering_s"] = round(waited, 3)
            self.tally.recovery_s += waited
        self.metrics.write(event)
        self.notify(f"trainmesh: step {decision.step}: {len(decision.members)} replicas"
                    + (f", lost {decision.lost}" if decision.lost else "")
                    + (f", joined {decision.joined}" if decision.joined else ""))

    def _collect(self, store: Any, q: int, members: list[list[Any]], began: float) -> dict[int, Request]:
        """The requests for quorum q, once every live member of the last quorum made one. The
        first quorum: every replica, within the start-up timeout; but once a request shows a
        run under way (this coordinator was started again), those that find it within
        :data:`REJOIN_GRACE_S` and then every replica whose heartbeat it sees."""
        resumed_at: float | None = None
        behind_since: float | None = None
        while True:
            if self._stop.is_set():
                raise _Stopped
            self._drain(store)
            requests = self._requests(store, q)
            now = time.monotonic()
            self.ledger.heal(store)
            if q == 0:
                if len(requests) == self.replicas:
                    return requests
                if resumed_at is None and any(r.step > 0 or r.needs_state for r in requests.values()):
                    resumed_at = now
                if resumed_at is not None and now - resumed_at > REJOIN_GRACE_S:
                    waiting = [r for r in range(self.replicas)
                               if r not in requests and self.ledger.alive(store, r)]
                    if not waiting:
                        return requests
                if now - began > self.startup_timeout_s:
                    missing = sorted(set(range(self.replicas)) - set(requests))
                    raise RuntimeError(f"replicas {missing} did not start within "
                                       f"{self.startup_timeout_s:.0f} s")
            else:
                waiting = [r for r, inc in members if r not in requests
                           and r not in self._suspects and self.ledger.alive(store, r, inc)]
                if requests and not waiting:
                    # none asked holds the committed step: one holding it may be stalled or
                    # cut off, not gone; wait for it while a replica is missing (one restarted
                    # asks in needing the state), within the members' timeout
                    if len(requests) == self.replicas or any(
                            not r.needs_state and r.step == self.committed for r in requests.values()):
                        return requests
                    behind_since = behind_since or now
                    if now - behind_since > min(r.timeout_s for r in requests.values()):
                        return requests
            time.sleep(POLL_S)

    def _decide(self, q: int, requests: dict[int, Request], previous: list[list[Any]]) -> Decision:
        members = [[r, requests[r].incarnation] for r in sorted(requests)]
        for r, inc in members:
            self.ledger.asked(r, inc)
        lost = [r for r, inc in previous if [r, inc] not in members]
        joined = [r for r, inc in members if [r, inc] not in previous] if previous else []
        lasts = {req.last for req in requests.values()}
        if len(lasts) > 1:
            return Decision(q, members, abort=f"the replicas disagree on the last step ({sorted(lasts)}); "
                                              "start them with the same --steps and --exit-after")
        self.last = self.codec.last = self.last or lasts.pop()
        if self.step_timeout_s is None:
            self.step_timeout_s = max(req.timeout_s for req in requests.values()) + 30.0
        holders = [req for req in requests.values() if not req.needs_state]
        step = max((req.step for req in holders), default=-1)
        restarted = q == 0 and step > 0
        if restarted:   # rebuilt: the newest step a replica applied was committed
            self.committed, self._rebuilt = step, True
            self.notify(f"trainmesh: coordinator at {self.address} took over at step {step + 1} "
                        f"with replicas {sorted(requests)}")
        if self._rebuilt and holders and step == self.committed - 1:
            # those that applied the rebuilt step were lost before another took it; the others
            # missed its commit when the old coordinator died: as if lost with it, it is redone
            self.notify(f"trainmesh: coordinator at {self.address}: step {self.committed} was "
                        f"held only by replicas since lost; redone from step {step}")
            self.committed, self._rebuilt = step, False
        if step < self.committed:   # (those behind it cannot be the source)
            return Decision(q, members, abort=f"no replica holding the live state is left (the "
                                              f"last committed step is {self.committed}); the run "
                                              "cannot go on")
        if step != self.committed:
            return Decision(q, members, abort=f"internal: replicas hold step {step}, but step "
                                              f"{self.committed} is the last committed")
        source = min(req.replica for req in holders if req.step == step)
        receivers = sorted(r for r, req in requests.items() if req.needs_state or req.step != step)
        return Decision(q, members, step=step + 1, source=source if receivers else None,
                        receivers=receivers, restarted=restarted, lost=lost, joined=joined)

    def _outcomes(self, store: Any, q: int, decision: Decision) -> list[Outcome]:
        """Each member's outcome. A member lost meanwhile (its heartbeat stopped) or silent past
        the step timeout has none, and becomes a suspect: the next quorum does not wait for it.
        A live member is always waited for (one stuck in a collective with a failed peer fails
        when the quorum is abandoned, at the latest after ``--timeout``)."""
        got: dict[int, Outcome] = {}
        deadline = time.monotonic() + (self.step_timeout_s or 330.0)
        first_failure: float | None = None
        while True:
            if self._stop.is_set():
                raise _Stopped
            pending = []
            for r, inc in decision.members:
                if r not in got and (outcome := self._outcome(store, q, r, inc)) is not None:
                    got[r] = outcome
                if r not in got and self.ledger.alive(store, r, inc):
                    pending.append(r)
            now = time.monotonic()
            if first_failure is None and (any(not o.ok for o in got.values())
                                          or len(got) + len(pending) < len(decision.members)):
                first_failure = now
                self.ledger.set(store, key("abandon", q), Mark(q), q)   # a member failed or was lost
            if not pending or now > deadline:
                self._suspects = {r for r, _ in decision.members if r not in got}
                return [got[r] for r in sorted(got)]
            self._drain(store)
            self.ledger.heal(store)
            time.sleep(POLL_S)

    def _outcome(self, store: Any, q: int, r: int, incarnation: str) -> Outcome | None:
        """Member r's outcome of quorum q: None while there is no valid one; one sealed by r but
        impossible (its fields wrong) is its failure."""
        k = key("ok", q, r)
        if not store.check([k]):
            return None
        try:
            outcome = parse_outcome(self.codec, store.get(k), q, r)
        except Rejected as exc:
            self.ledger.rejected(k, exc)
            if not exc.authentic:
                return None
            return Outcome(r, incarnation, False, f"an invalid outcome: {exc.reason}"[:300], quorum=q)
        return outcome if outcome.incarnation == incarnation else None

    def _committed(self, decision: Decision, outcomes: list[Outcome], failed_at: float | None) -> None:
        self.committed, self._rebuilt = decision.step, False
        if len(decision.members) < self.replicas:
            self.tally.degraded_steps += 1
        if failed_at is not None:
            self.tally.recovery_s += time.monotonic() - failed_at
        self.tally.transfer_s += sum(o.row.get("state_transfer_s", 0.0) for o in outcomes)
        transfer = max((o.row.get("state_transfer_s", 0.0) for o in outcomes), default=0.0)
        if transfer:
            self._transfer[decision.step] = round(transfer, 4)
        self.final_loss = outcomes[0].row.get("loss", self.final_loss)

    # ---------------------------------------------------------------- records
    def _drain(self, store: Any) -> None:
        """Write the records the replicas posted (a run on one host): each step's row, eval and
        save once (every member posts its row; the first one is written)."""
        if self.metrics.path is None:
            return
        for poster, start in list(self._posters.items()):
            n = start
            while (record := self.ledger.read(store, key("rec", *poster, n), lambda raw, p=poster, n=n:
                                        parse_posted(self.codec, raw, *p, n))) is not None:
                n += 1   # (one not valid: written again by its replica, read then)
                once = (record.get("event"), record.get("step"))
                if record.get("event") in ("step", "eval", "save"):
                    if once in self._written:
                        continue
                    self._written.add(once)
                if record.get("event") == "step" and record["step"] in self._transfer:
                    record["state_transfer_s"] = self._transfer[record["step"]]
                self.metrics.write(record)
            self._posters[poster] = n
            if n != start:   # the replica keeps writing those not yet drained again
                self.ledger.set(store, key("drained", *poster), Posted(count=n))

    def drain(self) -> None:
        """The records posted since the loop ended (the replicas have ended)."""
        store = getattr(self, "_store", None)
        if store is not None:
            self._drain(store)


def _same_step(outcomes: list[Outcome]) -> bool:
    """Whether every member reports the step alike: the loss (summed across them), fp16's
    overflow, on which each member decides alone whether it steps, and whether a non-finite
    step ends the run (from the count in the training state each holds)."""
    def same(a: float, b: float) -> bool:
        return a == b or (a != a and b != b) or abs(a - b) <= 1e-9 * max(1.0, abs(b))
    first = outcomes[0].row
    return all(o.row.get("overflow") == first.get("overflow")
               and o.row.get("nonfinite_ends") == first.get("nonfinite_ends")
               and same(o.row.get("loss", 0.0), first.get("loss", 0.0)) for o in outcomes)


class _Stopped(Exception):
    """The launcher stopped the coordinator (every replica ended)."""
