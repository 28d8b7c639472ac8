"""A replica's side of the quorum protocol: its heartbeat, asking for a place in each quorum,
reporting the outcome of its step attempt, the process group of the members, the cross-replica
reductions, and the transfer of the live state from the source to the receivers.

The coordinator may be restarted, on the same address or another of the list the replica was
given: a store operation that fails makes the client look for a coordinator on each address in
turn (:meth:`QuorumClient.reconnect`). The same coordinator found again: the operation is
retried, nothing was lost. Another one (its ``epoch`` differs): :class:`CoordinatorRestarted`,
and the replica asks into the new coordinator's quorums with what it holds.

Every wait is bounded: by the start-up timeout for the first quorum and for finding a
coordinator, and by the collective timeout (``--timeout``) plus the heartbeat timeout afterwards.
"""
from __future__ import annotations

import itertools
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.core.errors import CommTimeout
from trainmesh.core.stores import client_store

from .protocol import (
    DONE,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    POLL_S,
    Beat,
    Codec,
    Decision,
    Mark,
    Outcome,
    Posted,
    Rejections,
    Request,
    StateHeader,
    VersionMismatch,
    key,
    parse_abandon,
    parse_arrival,
    parse_commit,
    parse_decision,
    parse_done,
    parse_drained,
    parse_epoch,
    parse_next,
    parse_state,
)
from .transfer import flatten, state_layout, unflatten

CONNECT_TRY_S = 0.5
"""How long one attempt to reach a coordinator address waits."""
HEAL_EVERY = 5
"""Every how many polls a waiting replica writes again the records it waits on an answer to
(one overwritten or deleted by a writer from outside the job is restored)."""


class Abandoned(RuntimeError):
    """The coordinator gave up the quorum this replica was waiting in."""


class CoordinatorRestarted(RuntimeError):
    """The coordinator found after a lost connection is another one: its quorums start afresh."""


class ProtocolMismatch(RuntimeError):
    """The coordinator speaks another protocol version (the message names both)."""


def addresses_of(spec: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]``, or ``@FILE`` holding such a list (read again at each
    reconnection, so an operator can point the replicas at a coordinator moved elsewhere)."""
    if spec.startswith("@"):
        try:
            spec = Path(spec[1:]).read_text()
        except OSError:
            return []
    return [a.strip() for a in spec.replace("\n", ",").split(",") if a.strip()]


def find_coordinator(spec: str, deadline: float, codec: Codec, *, timeout_s: float, what: str
                     ) -> tuple[Any, str, str]:
    """(client, epoch, address) of the first coordinator of ``spec`` that answers (its epoch
    set, sealed with the job's secret), trying each address in turn until ``deadline``; one
    of another protocol version: :class:`ProtocolMismatch`."""
    while True:
        for address in addresses_of(spec):
            if not _listening(address):   # probed first: a failed store connect logs pages
                continue
            try:
                store = client_store(address, timeout_s=CONNECT_TRY_S)
                if store.check(["epoch"]):
                    epoch = parse_epoch(codec, store.get("epoch"))
                    store.set_timeout(timedelta(seconds=timeout_s))
                    return store, epoch, address
            except VersionMismatch as exc:
                raise ProtocolMismatch(f"{what}: refused by the fault-tolerance coordinator at "
                                       f"{address}: its records are {exc.reason}; run the same "
                                       "trainmesh version everywhere") from None
            except (RuntimeError, ValueError, OSError):   # not (yet) there, or not one of ours
                pass
        if time.monotonic() > deadline:
            raise CommTimeout(f"{what}: no fault-tolerance coordinator answered at {spec}")
        time.sleep(POLL_S * 5)


def _listening(address: str) -> bool:
    """Whether something accepts connections at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TRY_S).close()
        return True
    except (OSError, ValueError):
        return False


class QuorumClient:
    """Rank ``rank`` of replica ``replica`` (in its ``incarnation``) of the run whose coordinator
    serves one of ``coordinator``'s addresses (:func:`addresses_of`). The replica's first rank
    (rank 0) beats, asks into quorums and reports; the other ranks use the store for their own
    process groups, the state headers and the abandon marks."""

    def __init__(self, coordinator: str, replica: int, incarnation: str, *, secret: str,
                 replicas: int, timeout_s: float, last: int | None = None,
                 startup_timeout_s: float = 300.0, rank: int = 0) -> None:
        self.spec, self.replica, self.incarnation, self.rank = coordinator, replica, incarnation, rank
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.codec = Codec(secret, writer=replica, replicas=replicas, last=last)
        self.rejected = Rejections(lambda line: print(line, file=sys.stderr, flush=True),
                                   who=f"replica {replica}" + (f" rank {rank}" if rank else ""))
        self.address = ""
        self._lock = threading.Lock()
        self._own: dict[str, tuple[int, bytes]] = {}
        """The records it wrote that await an answer: key -> (quorum, sealed)."""
        self._posted: dict[int, tuple[str, bytes]] = {}
        """Metrics records posted and not yet written by the coordinator: n -> (key, sealed)."""
        self._polls = 0
        self._counter = itertools.count(1)   # heartbeats: one counter, whichever thread beats
        self.store = self._find(time.monotonic() + startup_timeout_s)
        self._stop = threading.Event()
        self._silent_until = 0.0
        if rank == 0:
            self._beat_store = self.store_like()
            self._beat_codec = Codec(secret, writer=replica, replicas=replicas, epoch=self.epoch)
            self._beat(self._beat_store, self._beat_codec)
            threading.Thread(target=self._beats, name="trainmesh-ft-heartbeat", daemon=True).start()

    @property
    def epoch(self) -> str:
        """The epoch of the coordinator this client reaches now."""
        return self.codec.epoch

    # ---------------------------------------------------------------- connection
    def _find(self, deadline: float) -> Any:
        """A client of a coordinator that answers; records its epoch and address."""
        store, self.codec.epoch, self.address = find_coordinator(
            self.spec, deadline, self.codec, timeout_s=self.timeout_s + self.startup_timeout_s,
            what=f"replica {self.replica}")
        return store

    def reconnect(self) -> bool:
        """After a failed store operation: find a coordinator again; whether it is another one
        (restarted) than before."""
        with self._lock:
            before = self.epoch
            self.store = self._find(time.monotonic() + self.startup_timeout_s)
            if self.epoch != before:   # its records were the old coordinator's
                self._own.clear()
                self._posted.clear()
                if self.rank == 0:   # alive, before the beats find it
                    self._beat(self.store, self.codec)
            return self.epoch != before

    def store_like(self) -> Any:
        """Another client of the coordinator this one reaches now (threads keep their own)."""
        return client_store(self.address, timeout_s=self.timeout_s + self.startup_timeout_s)

    def _call(self, op: str, *args: Any) -> Any:
        """``self.store.<op>(*args)``; a failure reconnects, then retries the operation with the
        same coordinator, or raises :class:`CoordinatorRestarted` with another one."""
        while True:
            try:
                return getattr(self.store, op)(*args)
            except (RuntimeError, OSError):   # the connection broke (DistNetworkError, ...)
                if self.reconnect():
                    raise CoordinatorRestarted(f"replica {self.replica}: the fault-tolerance "
                                               f"coordinator was restarted (now at {self.address})") from None

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def get(self, k: str) -> bytes:
        return self._call("get", k)

    def set(self, k: str, record: Any, quorum: int) -> None:
        """Seal ``record`` under ``k`` and write it, again while it awaits an answer (records
        of quorums before ``quorum - 1`` are forgotten)."""
        self._own = {k2: v for k2, v in self._own.items() if v[0] >= quorum - 1}
        sealed = self.codec.seal(k, record)
        self._own[k] = (quorum, sealed)
        self._call("set", k, sealed)

    def read(self, k: str, parse: Callable[[bytes], Any]) -> Any:
        """``parse(value)`` of the record at ``k``; None when there is none or it is rejected
        (logged once)."""
        return self.rejected.read(self, k, parse)

    def _heal(self) -> None:
        """Every :data:`HEAL_EVERY` polls: its records that await an answer written again."""
        self._polls += 1
        if self._polls % HEAL_EVERY:
            return
        if self._posted:
            k = key("drained", self.replica, self.incarnation)
            drained = self.read(k, lambda raw: parse_drained(self.codec, raw, self.replica,
                                                             self.incarnation)) or 0
            self._posted = {n: v for n, v in self._posted.items() if n >= drained}
        for k, sealed in [*((k, v[1]) for k, v in self._own.items()), *self._posted.values()]:
            self._call("set", k, sealed)

    def _beat(self, store: Any, codec: Codec) -> None:
        k = key("hb", self.replica)
        store.set(k, codec.seal(k, Beat(self.incarnation, next(self._counter))))

    def _beats(self) -> None:
        """Rewrite the heartbeat every :data:`HEARTBEAT_S`; the coordinator lost, beat to the
        one found next (on its own client: the main thread keeps its own)."""
        store, codec = self._beat_store, self._beat_codec
        while not self._stop.wait(HEARTBEAT_S):
            if time.monotonic() < self._silent_until:
                continue
            try:
                self._beat(store, codec)
            except (RuntimeError, OSError):
                try:
                    store, codec.epoch, _ = find_coordinator(
                        self.spec, time.monotonic() + self.startup_timeout_s, codec,
                        timeout_s=self.timeout_s, what="heartbeat")
                except (RuntimeError, OSError):
                    return   # none within the start-up timeout: the main thread fails too

    def close(self) -> None:
        self._stop.set()

    def silence(self, seconds: float) -> None:
        """Tests: stop beating for ``seconds`` (the coordinator loses sight of this replica)."""
        self._silent_until = time.monotonic() + seconds

    def local_address(self) -> str:
        """This host's address on the route to the coordinator (where group j listens)."""
        host = self.address.rsplit(":", 1)[0].strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))   # no packet is sent: this only picks the route
            return s.getsockname()[0]

    # ---------------------------------------------------------------- the quorum
    def _next(self) -> Any:
        return self.read("next", lambda raw: parse_next(self.codec, raw))

    def next_quorum(self) -> int:
        """The quorum the coordinator is collecting now (where a returning replica asks in)."""
        return self._wait({"next": lambda raw: parse_next(self.codec, raw)}, self.startup_timeout_s,
                          "the coordinator")["next"].quorum

    def next_step(self) -> int:
        """The step the quorum being collected now would run (0 before the first quorum)."""
        n = self._next()
        return n.step if n is not None else 0

    def request(self, q: int, request: Request, *, first: bool) -> Decision | None:
        """Ask for a place in quorum ``q``; the coordinator's decision, or None when the run
        already reached its last step."""
        self.set(key("req", q, self.replica), request, q)
        bound = self.startup_timeout_s if first else self.timeout_s + 2 * HEARTBEAT_TIMEOUT_S
        k = key("dec", q)
        got = self._wait({k: lambda raw: parse_decision(self.codec, raw, q)}, bound,
                         f"the decision of quorum {q}", done_ok=True)
        return got.get(k)

    def everyone_asked(self, q: int, replicas: int) -> bool:
        """Whether every other replica has asked into quorum ``q``."""
        return self.check([key("req", q, r) for r in range(replicas) if r != self.replica])

    def report(self, q: int, outcome: Outcome, posted: Callable[[], None] | None = None) -> bool:
        """Post this replica's outcome of quorum ``q``'s attempt (then ``posted()``); whether
        the step is committed."""
        self.set(key("ok", q, self.replica), outcome, q)
        if posted is not None:
            posted()
        k = key("commit", q)
        return self._wait({k: lambda raw: parse_commit(self.codec, raw, q)},
                          self.timeout_s + 2 * HEARTBEAT_TIMEOUT_S, f"the commit of quorum {q}")[k]

    def abandoned(self, q: int) -> bool:
        k = key("abandon", q)
        return self.read(k, lambda raw: parse_abandon(self.codec, raw, q)) is not None

    def gone(self) -> bool:
        """Whether the coordinator this client reached no longer answers (a fresh connection)."""
        return not _listening(self.address)

    def post(self, n: int, record: dict[str, Any]) -> None:
        """The n-th metrics record of this incarnation, for the coordinator to write (written
        again while it waits, until the coordinator says it wrote it)."""
        k = key("rec", self.replica, self.incarnation, n)
        sealed = self.codec.seal(k, Posted(record=record))
        self._posted[n] = (k, sealed)
        self._call("set", k, sealed)

    def flush(self, bound_s: float) -> None:
        """Until the coordinator wrote every record posted (at most ``bound_s``)."""
        deadline = time.monotonic() + bound_s
        while self._posted and time.monotonic() < deadline:
            self._polls = HEAL_EVERY - 1
            self._heal()
            time.sleep(POLL_S * 5)

    def _wait(self, reads: dict[str, Callable[[bytes], Any]], bound: float, what: str, *,
              done_ok: bool = False, abandon: int | None = None) -> dict[str, Any]:
        """{key: parse(value)} once every key of ``reads`` holds a valid record (or, with
        ``done_ok``, {} once the run is over), at most ``bound`` seconds; meanwhile its own
        records awaiting an answer are written again; raises :class:`Abandoned` once quorum
        ``abandon`` is given up."""
        deadline = time.monotonic() + bound
        got: dict[str, Any] = {}
        while True:
            for k, parse in reads.items():
                if k not in got and (value := self.read(k, parse)) is not None:
                    got[k] = value
            if len(got) == len(reads):
                return got
            if done_ok and self.read(DONE, lambda raw: parse_done(self.codec, raw)) is not None:
                return {}
            if abandon is not None and self.abandoned(abandon):
                raise Abandoned(f"quorum {abandon} was given up (a member failed or was lost)")
            if time.monotonic() > deadline:
                raise CommTimeout(f"replica {self.replica}: no answer from the fault-tolerance "
                                  f"coordinator for {what} within {bound:.0f} s")
            self._heal()
            time.sleep(POLL_S)

    # ---------------------------------------------------------------- group j
    def process_group(self, decision: Decision) -> Any:
        """The gloo process group of quorum ``decision.quorum`` that connects this rank with
        the same rank of every other member, over a PrefixStore of the coordinator's store (a
        fresh one per quorum: a failed group is never reused), listening on this host's
        address towards the coordinator only."""
        q, j = decision.quorum, self.rank   # everyone there first: a member lost abandons q at once
        self.set(key("arrive", q, self.replica, j), Mark(q, self.replica, j), q)
        self._wait({key("arrive", q, r, j): lambda raw, r=r: parse_arrival(self.codec, raw, q, r, j)
                    for r in decision.replicas}, self.timeout_s, f"the members of quorum {q}", abandon=q)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.local_address())]
        options._timeout = timedelta(seconds=self.timeout_s)
        prefix = dist.PrefixStore(key("pg", q, j), self.store_like())   # its own connection
        made: list[Any] = []
        work = _Thunk(lambda: made.append(dist.ProcessGroupGloo(
            prefix, decision.replicas.index(self.replica), len(decision.members), options)))
        self.wait_work(work, q)   # a member lost while connecting: abandoned, not --timeout
        return made[0]

    def wait_work(self, work: Any, q: int, group: Any = None) -> None:
        """Until the cross-replica op ``work`` of quorum ``q`` completes (waited for on a
        helper thread: gloo's point-to-point ops say they are complete only once waited for);
        raises (leaving it behind: it writes into a buffer nobody reads again, and ends at the
        group's timeout) once the coordinator abandons the quorum, so a member cut off the
        network stalls the others no longer than its heartbeat timeout, not ``--timeout``.
        The helper holds ``group`` until the op ends: a gloo group destroyed with an op in
        flight waits for it, and whoever drops the group must not."""
        done, failed = threading.Event(), []

        def waiter(held: Any = group) -> None:   # noqa: ARG001 - held until the op ends
            try:
                work.wait()
            except BaseException as exc:   # noqa: BLE001 - raised on the caller's thread
                failed.append(exc)
            finally:
                done.set()
        threading.Thread(target=waiter, name="trainmesh-ft-wait", daemon=True).start()
        polls = 0
        while not done.wait(POLL_S / 4):
            polls += 1
            if polls % 4 == 0:
                if self.abandoned(q):
                    raise Abandoned(f"quorum {q} was given up (a member failed or was lost)")
                self._heal()
        if failed:
            raise failed[0]

    # ---------------------------------------------------------------- live state
    def send_state(self, pg: Any, decision: Decision, params: list[tuple[str, torch.Tensor]],
                   optim: dict[str, dict[str, torch.Tensor]], trainer: dict[str, Any]) -> None:
        """The source (each of its ranks): describe the state in the store, with its training
        state, then send the tensors to the same rank of every receiver."""
        layout = state_layout(params, optim)
        self.set(key("state", decision.quorum, self.rank), StateHeader(layout, trainer), decision.quorum)
        flat = flatten([t for _, t in params] + [optim[name][k] for name, k, _, _ in layout])
        for r in decision.receivers:
            dst = decision.replicas.index(r)
            for i, buf in enumerate(flat):
                self.wait_work(pg.send([buf], dst, i), decision.quorum, pg)

    def recv_state(self, pg: Any, decision: Decision, params: list[tuple[str, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """A receiver: the source's (params, optimizer states, training state)."""
        q, at = decision.quorum, key("state", decision.quorum, self.rank)
        header = self._wait({at: lambda raw: parse_state(self.codec, raw, q, self.rank, decision.source)},
                            self.timeout_s, "the source's state", abandon=q)[at]
        shapes = ([(t.shape, t.dtype) for _, t in params]
                  + [(torch.Size(shape), getattr(torch, dtype)) for _, _, shape, dtype in header.optim])
        src = decision.replicas.index(decision.source)
        tensors = unflatten(shapes, lambda i, buf: self.wait_work(pg.recv([buf], src, i),
                                                                   decision.quorum, pg))
        got_params = {name: t for (name, _), t in zip(params, tensors)}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for (name, k, _, _), t in zip(header.optim, tensors[len(params):]):
            optim.setdefault(name, {})[k] = t
        return got_params, optim, header.trainer


class _Thunk:
    """A blocking call as a work whose ``wait()`` runs it (:meth:`QuorumClient.wait_work`)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.wait = fn
