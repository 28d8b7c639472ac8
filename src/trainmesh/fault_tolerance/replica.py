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

import json
import socket
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
    Decision,
    Outcome,
    Request,
    key,
)

CONNECT_TRY_S = 0.5
"""How long one attempt to reach a coordinator address waits."""


class Abandoned(RuntimeError):
    """The coordinator gave up the quorum this replica was waiting in."""


class CoordinatorRestarted(RuntimeError):
    """The coordinator found after a lost connection is another one: its quorums start afresh."""


def addresses_of(spec: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]``, or ``@FILE`` holding such a list (read again at each
    reconnection, so an operator can point the replicas at a coordinator moved elsewhere)."""
    if spec.startswith("@"):
        try:
            spec = Path(spec[1:]).read_text()
        except OSError:
            return []
    return [a.strip() for a in spec.replace("\n", ",").split(",") if a.strip()]


def find_coordinator(spec: str, deadline: float, *, timeout_s: float, what: str
                     ) -> tuple[Any, str, str]:
    """(client, epoch, address) of the first coordinator of ``spec`` that answers (its epoch
    set), trying each address in turn until ``deadline``."""
    while True:
        for address in addresses_of(spec):
            if not _listening(address):   # probed first: a failed store connect logs pages
                continue
            try:
                store = client_store(address, timeout_s=CONNECT_TRY_S)
                if store.check(["epoch"]):
                    store.set_timeout(timedelta(seconds=timeout_s))
                    return store, store.get("epoch").decode(), address
            except (RuntimeError, ValueError, OSError):   # not (yet) there
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

    def __init__(self, coordinator: str, replica: int, incarnation: str, *, timeout_s: float,
                 startup_timeout_s: float = 300.0, rank: int = 0) -> None:
        self.spec, self.replica, self.incarnation, self.rank = coordinator, replica, incarnation, rank
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.epoch = ""
        self.address = ""
        self._lock = threading.Lock()
        self.store = self._find(time.monotonic() + startup_timeout_s)
        self._stop = threading.Event()
        self._silent_until = 0.0
        if rank == 0:
            self._beat_store = self.store_like()
            self._beat_store.set(key("hb", replica), f"{incarnation}:0")
            threading.Thread(target=self._beats, name="trainmesh-ft-heartbeat", daemon=True).start()

    # ---------------------------------------------------------------- connection
    def _find(self, deadline: float) -> Any:
        """A client of a coordinator that answers; records its epoch and address."""
        store, self.epoch, self.address = find_coordinator(
            self.spec, deadline, timeout_s=self.timeout_s + self.startup_timeout_s,
            what=f"replica {self.replica}")
        return store

    def reconnect(self) -> bool:
        """After a failed store operation: find a coordinator again; whether it is another one
        (restarted) than before."""
        with self._lock:
            before = self.epoch
            self.store = self._find(time.monotonic() + self.startup_timeout_s)
            if self.rank == 0 and self.epoch != before:   # alive, before the beats find it
                self.store.set(key("hb", self.replica), f"{self.incarnation}:found")
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

    def set(self, k: str, value: str) -> None:
        self._call("set", k, value)

    def _beats(self) -> None:
        """Rewrite the heartbeat every :data:`HEARTBEAT_S`; the coordinator lost, beat to the
        one found next (on its own client: the main thread keeps its own)."""
        n, store = 0, self._beat_store
        while not self._stop.wait(HEARTBEAT_S):
            n += 1
            if time.monotonic() < self._silent_until:
                continue
            try:
                store.set(key("hb", self.replica), f"{self.incarnation}:{n}")
            except (RuntimeError, OSError):
                try:
                    store = find_coordinator(self.spec, time.monotonic() + self.startup_timeout_s,
                                             timeout_s=self.timeout_s, what="heartbeat")[0]
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
    def next_quorum(self) -> int:
        """The quorum the coordinator is collecting now (where a returning replica asks in)."""
        self._wait(["next"], self.startup_timeout_s, "the coordinator")
        return int(self.get("next"))

    def next_step(self) -> int:
        """The step the quorum being collected now would run (0 before the first quorum)."""
        return int(self.get("next_step")) if self.check(["next_step"]) else 0

    def request(self, q: int, request: Request, *, first: bool) -> Decision | None:
        """Ask for a place in quorum ``q``; the coordinator's decision, or None when the run
        already reached its last step."""
        self.set(key("req", q, self.replica), request.encode())
        bound = self.startup_timeout_s if first else self.timeout_s + 2 * HEARTBEAT_TIMEOUT_S
        self._wait([key("dec", q)], bound, f"the decision of quorum {q}", done_ok=True)
        if not self.check([key("dec", q)]):
            return None
        return Decision.decode(self.get(key("dec", q)))

    def everyone_asked(self, q: int, replicas: int) -> bool:
        """Whether every other replica has asked into quorum ``q``."""
        return self.check([key("req", q, r) for r in range(replicas) if r != self.replica])

    def report(self, q: int, outcome: Outcome, posted: Callable[[], None] | None = None) -> bool:
        """Post this replica's outcome of quorum ``q``'s attempt (then ``posted()``); whether
        the step is committed."""
        self.set(key("ok", q, self.replica), outcome.encode())
        if posted is not None:
            posted()
        self._wait([key("commit", q)], self.timeout_s + 2 * HEARTBEAT_TIMEOUT_S,
                   f"the commit of quorum {q}")
        return self.get(key("commit", q)) == b"1"

    def abandoned(self, q: int) -> bool:
        return self.check([key("abandon", q)])

    def gone(self) -> bool:
        """Whether the coordinator this client reached no longer answers (a fresh connection)."""
        return not _listening(self.address)

    def post(self, n: int, record: dict[str, Any]) -> None:
        """The n-th metrics record of this incarnation, for the coordinator to write."""
        self.set(key("rec", self.replica, self.incarnation, n), json.dumps(record))

    def _wait(self, keys: list[str], bound: float, what: str, *, done_ok: bool = False,
              abandon: int | None = None) -> None:
        """Until ``keys`` exist (or, ``done_ok``, the run is over), at most ``bound`` seconds;
        raises :class:`Abandoned` once quorum ``abandon`` is given up."""
        deadline = time.monotonic() + bound
        while not self.check(keys):
            if done_ok and self.check([DONE]):
                return
            if abandon is not None and self.abandoned(abandon):
                raise Abandoned(f"quorum {abandon} was given up (a member failed or was lost)")
            if time.monotonic() > deadline:
                raise CommTimeout(f"replica {self.replica}: no answer from the fault-tolerance "
                                  f"coordinator for {what} within {bound:.0f} s")
            time.sleep(POLL_S)

    # ---------------------------------------------------------------- group j
    def process_group(self, decision: Decision) -> Any:
        """The gloo process group of quorum ``decision.quorum`` that connects this rank with
        the same rank of every other member, over a PrefixStore of the coordinator's store (a
        fresh one per quorum: a failed group is never reused), listening on this host's
        address towards the coordinator only."""
        q, j = decision.quorum, self.rank   # everyone there first: a member lost abandons q at once
        self.set(key("arrive", q, self.replica, j), "1")
        self._wait([key("arrive", q, r, j) for r in decision.replicas], self.timeout_s,
                   f"the members of quorum {q}", abandon=q)
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
            if polls % 4 == 0 and self.abandoned(q):
                raise Abandoned(f"quorum {q} was given up (a member failed or was lost)")
        if failed:
            raise failed[0]

    # ---------------------------------------------------------------- live state
    def send_state(self, pg: Any, decision: Decision, params: list[tuple[str, torch.Tensor]],
                   optim: dict[str, dict[str, torch.Tensor]], trainer: dict[str, Any]) -> None:
        """The source (each of its ranks): describe the state in the store, with its training
        state, then send the tensors to the same rank of every receiver."""
        layout = [[name, k, list(t.shape), str(t.dtype).removeprefix("torch.")]
                  for name, _ in params for k, t in sorted(optim.get(name, {}).items())]
        self.set(key("state", decision.quorum, self.rank), json.dumps({"optim": layout, "trainer": trainer}))
        flat = _flatten([t for _, t in params] + [optim[name][k] for name, k, _, _ in layout])
        for r in decision.receivers:
            dst = decision.replicas.index(r)
            for i, buf in enumerate(flat):
                self.wait_work(pg.send([buf], dst, i), decision.quorum, pg)

    def recv_state(self, pg: Any, decision: Decision, params: list[tuple[str, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """A receiver: the source's (params, optimizer states, training state)."""
        at = key("state", decision.quorum, self.rank)
        self._wait([at], self.timeout_s, "the source's state", abandon=decision.quorum)
        header = json.loads(self.get(at))
        shapes = ([(t.shape, t.dtype) for _, t in params]
                  + [(torch.Size(shape), getattr(torch, dtype)) for _, _, shape, dtype in header["optim"]])
        src = decision.replicas.index(decision.source)
        tensors = _unflatten(shapes, lambda i, buf: self.wait_work(pg.recv([buf], src, i),
                                                                   decision.quorum, pg))
        got_params = {name: t for (name, _), t in zip(params, tensors)}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for (name, k, _, _), t in zip(header["optim"], tensors[len(params):]):
            optim.setdefault(name, {})[k] = t
        return got_params, optim, header["trainer"]


class _Thunk:
    """A blocking call as a work whose ``wait()`` runs it (:meth:`QuorumClient.wait_work`)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.wait = fn


def _flatten(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One contiguous CPU buffer per dtype, in the order each dtype first appears."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1).cpu())
    return [torch.cat(ts) for ts in groups.values()]


def _unflatten(shapes: list[tuple[torch.Size, torch.dtype]],
               recv: Callable[[int, torch.Tensor], None]) -> list[torch.Tensor]:
    """Receive the buffers of :func:`_flatten` (``recv(index, buffer)``) and cut them up."""
    order: list[torch.dtype] = []
    for _, dtype in shapes:
        if dtype not in order:
            order.append(dtype)
    pieces: dict[torch.dtype, list[torch.Tensor]] = {}
    for i, dtype in enumerate(order):
        sizes = [s.numel() for s, d in shapes if d == dtype]
        buf = torch.empty(sum(sizes), dtype=dtype)
        recv(i, buf)
        pieces[dtype] = list(torch.split(buf, sizes))
    return [pieces[dtype].pop(0).reshape(shape) for shape, dtype in shapes]
