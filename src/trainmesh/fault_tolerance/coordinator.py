"""The coordinator of a ``--fault-tolerant`` run: a thread of the launcher that serves the
replicas' store (loopback only, a kernel-picked port) and decides, for every step attempt, which
replicas take part (the quorum) and whether the attempt is applied (the commit).

Every replica reads the same decision from the store, so membership, the split of the global
batch and the outcome of a step can never differ between replicas. The coordinator also writes
the metrics file (the step rows the members report, ``quorum`` events where membership changes,
``discarded`` events for step attempts not applied) and keeps the counts of the summary.
docs/FAULT_TOLERANCE.md describes the protocol.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainmesh.core.stores import LOOPBACK, client_store, server_store
from trainmesh.observe.metrics import MetricsWriter

from .protocol import (
    DONE,
    HEARTBEAT_TIMEOUT_S,
    POLL_S,
    Decision,
    Outcome,
    Request,
    key,
)

log = logging.getLogger("trainmesh")


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
    """Decides quorums and commits for ``replicas`` replicas until step ``last`` is committed.

    ``startup_timeout_s`` bounds the wait for the first quorum (every replica), ``step_timeout_s``
    the wait for a member's outcome (its collective timeout plus slack)."""

    def __init__(self, *, replicas: int, last: int, metrics_out: str | None, tokens: int,
                 startup_timeout_s: float = 300.0, step_timeout_s: float = 330.0,
                 notify: Callable[[str], None] | None = None) -> None:
        self.replicas, self.last, self.tokens = replicas, last, tokens
        self.notify = notify or log.info
        """Where the one-line notices of membership changes and discarded steps go."""
        self.startup_timeout_s, self.step_timeout_s = startup_timeout_s, step_timeout_s
        self._server = server_store(LOOPBACK, timeout_s=step_timeout_s, multi_tenant=True)
        self.address = f"{LOOPBACK}:{self._server.port}"
        self.metrics = MetricsWriter(metrics_out)
        self.tally = Tally()
        self.error: str | None = None
        """Why the run could not go on (None: it reached its last step, or was stopped)."""
        self.final_loss = float("nan")
        self.committed = 0
        self._stop = threading.Event()
        self._beats: dict[int, tuple[str, float]] = {}
        self._suspects: set[int] = set()
        """Members lost during the last attempt: the next quorum does not wait for them (they
        are let in if they ask in time)."""
        self._thread = threading.Thread(target=self._run, name="trainmesh-ft-coordinator", daemon=True)

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Every agent has ended: stop waiting for replicas."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        store = None
        try:
            store = client_store(self.address, timeout_s=self.step_timeout_s)
            self._loop(store)
        except _Stopped:
            pass
        except Exception as exc:   # noqa: BLE001 - reported by the launcher as the run's failure
            self.error = f"the fault-tolerance coordinator failed: {type(exc).__name__}: {exc}"
        finally:   # whatever ended the loop: replicas still waiting end at once
            if store is not None:
                store.set(DONE, str(self.committed))

    # ---------------------------------------------------------------- liveness
    def _alive(self, store: Any, replica: int, incarnation: int) -> bool:
        """Whether the heartbeat of ``replica`` in ``incarnation`` changed recently."""
        now = time.monotonic()
        if store.check([key("hb", replica)]):
            beat = store.get(key("hb", replica)).decode()
            seen = self._beats.get(replica)
            if seen is None or seen[0] != beat:
                self._beats[replica] = (beat, now)
        seen = self._beats.get(replica)
        return (seen is not None and seen[0].split(":")[0] == str(incarnation)
                and now - seen[1] < HEARTBEAT_TIMEOUT_S)

    def _requests(self, store: Any, q: int) -> dict[int, Request]:
        keys = [key("req", q, r) for r in range(self.replicas)]
        return {r: Request.decode(store.get(k)) for r, k in enumerate(keys) if store.check([k])}

    # ---------------------------------------------------------------- the loop
    def _loop(self, store: Any) -> None:
        members: list[list[int]] = []
        q, began = 0, time.monotonic()
        failed_at: float | None = None   # start of the first failed attempt since the last commit
        while self.committed < self.last:
            store.set("next", str(q))
            store.set("next_step", str(self.committed + 1))
            requests = self._collect(store, q, members, began)
            decision = self._decide(q, requests)
            lost = [r for r, inc in members if not decision.has(r, inc)]
            joined = [r for r, inc in decision.members if [r, inc] not in members]
            store.set(key("dec", q), decision.encode())
            if decision.abort:
                self.error = decision.abort
                return
            for req in requests.values():
                pids = self.tally.pids.setdefault(req.replica, [])
                pids += [pid for pid in req.pids or [req.pid] if pid not in pids]
            if q > 0 and (lost or joined):
                event = {"event": "quorum", "step": decision.step, "replicas": len(decision.members),
                         "lost": lost, "joined": joined}
                if failed_at is not None:
                    event["recovering_s"] = round(time.monotonic() - failed_at, 3)
                elif lost:   # lost between two steps: the wait for its heartbeat to stop
                    waited = time.monotonic() - began
                    event["recovering_s"] = round(waited, 3)
                    self.tally.recovery_s += waited
                self.metrics.write(event)
                self.notify(f"trainmesh: step {decision.step}: {len(decision.members)} replicas"
                            + (f", lost {lost}" if lost else "") + (f", joined {joined}" if joined else ""))
            members = decision.members
            attempt = time.monotonic()
            outcomes = self._outcomes(store, q, decision)
            ok = len(outcomes) == len(decision.members) and all(o.ok for o in outcomes)
            nonfinite = outcomes[0].row.get("nonfinite") if ok else None
            store.set(key("commit", q), "1" if ok and not nonfinite else "0")
            if nonfinite:   # the same on every member (the sums are reduced): never applied
                self.error = (f"step {decision.step}: non-finite {nonfinite} (--on-nonfinite stop); "
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

    def _collect(self, store: Any, q: int, members: list[list[int]], began: float) -> dict[int, Request]:
        """The requests for quorum q, once every live member of the last quorum made one (the
        first quorum: every replica, within the start-up timeout)."""
        while True:
            if self._stop.is_set():
                raise _Stopped
            requests = self._requests(store, q)
            if q == 0:
                if len(requests) == self.replicas:
                    return requests
                if time.monotonic() - began > self.startup_timeout_s:
                    missing = sorted(set(range(self.replicas)) - set(requests))
                    raise RuntimeError(f"replicas {missing} did not start within "
                                       f"{self.startup_timeout_s:.0f} s")
            else:
                waiting = [r for r, inc in members if r not in requests
                           and r not in self._suspects and self._alive(store, r, inc)]
                if requests and not waiting:
                    return requests
            time.sleep(POLL_S)

    def _decide(self, q: int, requests: dict[int, Request]) -> Decision:
        members = [[r, requests[r].incarnation] for r in sorted(requests)]
        holders = [req for req in requests.values() if not req.needs_state]
        if not holders:
            return Decision(q, members, abort=f"no replica holding the live state is left (the "
                                              f"last committed step is {self.committed}); the run "
                                              "cannot go on")
        step = max(req.step for req in holders)
        if step != self.committed:
            return Decision(q, members, abort=f"internal: replicas hold step {step}, but step "
                                              f"{self.committed} is the last committed")
        source = min(req.replica for req in holders if req.step == step)
        receivers = sorted(r for r, req in requests.items() if req.needs_state or req.step != step)
        return Decision(q, members, step=step + 1, source=source if receivers else None,
                        receivers=receivers)

    def _outcomes(self, store: Any, q: int, decision: Decision) -> list[Outcome]:
        """Each member's outcome. A member lost meanwhile (its heartbeat stopped) or silent past
        the step timeout has none, and becomes a suspect: the next quorum does not wait for it.
        A live member is always waited for (one stuck in a collective with a failed peer fails
        when that peer drops the group, at the latest after ``--timeout``)."""
        got: dict[int, Outcome] = {}
        deadline = time.monotonic() + self.step_timeout_s
        first_failure: float | None = None
        while True:
            if self._stop.is_set():
                raise _Stopped
            pending = []
            for r, inc in decision.members:
                k = key("ok", q, r)
                if r not in got and store.check([k]):
                    got[r] = Outcome.decode(store.get(k))
                if r not in got and self._alive(store, r, inc):
                    pending.append(r)
            now = time.monotonic()
            if first_failure is None and (any(not o.ok for o in got.values())
                                          or len(got) + len(pending) < len(decision.members)):
                first_failure = now
                store.set(key("abandon", q), "1")   # a member failed or was lost: stop waiting
            if not pending or now > deadline:
                self._suspects = {r for r, _ in decision.members if r not in got}
                return [got[r] for r in sorted(got)]
            time.sleep(POLL_S)

    def _committed(self, decision: Decision, outcomes: list[Outcome], failed_at: float | None) -> None:
        self.committed = decision.step
        n = len(decision.members)
        if n < self.replicas:
            self.tally.degraded_steps += 1
        if failed_at is not None:
            self.tally.recovery_s += time.monotonic() - failed_at
        self.tally.transfer_s += sum(o.row.get("state_transfer_s", 0.0) for o in outcomes)
        row = dict(outcomes[0].row)
        row.pop("state_transfer_s", None)
        transfer = max((o.row.get("state_transfer_s", 0.0) for o in outcomes), default=0.0)
        row.update(replicas=n, **({"state_transfer_s": round(transfer, 4)} if transfer else {}))
        self.final_loss = row.get("loss", self.final_loss)
        self.metrics.write({"event": "step", "step": decision.step, **row})


class _Stopped(Exception):
    """The launcher stopped the coordinator (every agent ended)."""
