"""A replica's side of the quorum protocol: its heartbeat, asking for a place in each quorum,
reporting the outcome of its step attempt, the process group of the members, and the transfer
of the live state from the source to the receivers over that group.

Every wait is bounded: by the start-up timeout for the first quorum and by the collective
timeout (``--timeout``) plus the heartbeat timeout afterwards.
"""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
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


class Abandoned(RuntimeError):
    """The coordinator gave up the quorum this replica was waiting in."""


class QuorumClient:
    """Rank ``rank`` of replica ``replica`` (in its ``incarnation``: the agent's restart count)
    of the run whose coordinator serves ``address``. The replica's first rank (rank 0) beats,
    asks into quorums and reports; every rank reads the decisions and the commits."""

    def __init__(self, address: str, replica: int, incarnation: int, *, timeout_s: float,
                 startup_timeout_s: float = 300.0, rank: int = 0) -> None:
        self.replica, self.incarnation, self.rank = replica, incarnation, rank
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.store = client_store(address, timeout_s=timeout_s + startup_timeout_s)
        self._stop = threading.Event()
        if rank == 0:
            self._beat_store = client_store(address, timeout_s=timeout_s)
            self._beat()
            threading.Thread(target=self._beats, name="trainmesh-ft-heartbeat", daemon=True).start()

    def _beat(self, n: int = 0) -> None:
        self._beat_store.set(key("hb", self.replica), f"{self.incarnation}:{n}")

    def _beats(self) -> None:
        n = 0
        while not self._stop.wait(HEARTBEAT_S):
            n += 1
            try:
                self._beat(n)
            except Exception:   # noqa: BLE001 - the coordinator is gone: the launcher ends us
                return

    def close(self) -> None:
        self._stop.set()

    def next_quorum(self) -> int:
        """The quorum the coordinator is collecting now (where a returning replica asks in)."""
        self._wait(["next"], self.startup_timeout_s, "the coordinator")
        return int(self.store.get("next"))

    def start_quorum(self, ranks: int) -> int:
        """Where a restarted replica of ``ranks`` ranks asks in first, the same for all of them:
        its first rank picks :meth:`next_quorum`, the others read it."""
        at = key("start", self.replica, self.incarnation)
        if self.rank == 0:
            q = self.next_quorum()
            if ranks > 1:
                self.store.set(at, str(q))
            return q
        self._wait([at], self.startup_timeout_s, "the first rank of this replica")
        return int(self.store.get(at))

    def shard_store(self) -> Any:
        """The store of this replica incarnation's own process group (its ranks)."""
        return dist.PrefixStore(key("shard", self.replica, self.incarnation), self.store)

    def next_step(self) -> int:
        """The step the quorum being collected now would run (0 before the first quorum)."""
        return int(self.store.get("next_step")) if self.store.check(["next_step"]) else 0

    def request(self, q: int, *, step: int, needs_state: bool, pid: int,
                first: bool, pids: list[int] | None = None) -> Decision | None:
        """Ask for a place in quorum ``q``; the coordinator's decision, or None when the run
        already reached its last step."""
        self.store.set(key("req", q, self.replica),
                       Request(self.replica, self.incarnation, step, needs_state, pid,
                               pids or [pid]).encode())
        bound = self.startup_timeout_s if first else self.timeout_s + 2 * HEARTBEAT_TIMEOUT_S
        return self.decision(q, bound)

    def decision(self, q: int, bound: float | None = None) -> Decision | None:
        """The decision of quorum ``q`` (or None once the run is over); the ranks other than
        the first wait as long as the start-up timeout (the first may hold back, in tests)."""
        bound = self.startup_timeout_s if bound is None else bound
        self._wait([key("dec", q)], bound, f"the decision of quorum {q}", done_ok=True)
        if not self.store.check([key("dec", q)]):
            return None
        return Decision.decode(self.store.get(key("dec", q)))

    def everyone_asked(self, q: int, replicas: int) -> bool:
        """Whether every other replica has asked into quorum ``q``."""
        return self.store.check([key("req", q, r) for r in range(replicas) if r != self.replica])

    def report(self, q: int, outcome: Outcome | None) -> bool:
        """Post this member's outcome of quorum ``q``'s attempt (the first rank; the others pass
        None); whether the step is committed."""
        if outcome is not None:
            self.store.set(key("ok", q, self.replica), outcome.encode())
        self._wait([key("commit", q)], self.timeout_s + 2 * HEARTBEAT_TIMEOUT_S,
                   f"the commit of quorum {q}")
        return self.store.get(key("commit", q)) == b"1"

    def _wait(self, keys: list[str], bound: float, what: str, *, done_ok: bool = False,
              abandon: int | None = None) -> None:
        """Until ``keys`` exist (or, ``done_ok``, the run is over), at most ``bound`` seconds;
        raises :class:`Abandoned` once quorum ``abandon`` is given up."""
        deadline = time.monotonic() + bound
        while not self.store.check(keys):
            if done_ok and self.store.check([DONE]):
                return
            if abandon is not None and self.store.check([key("abandon", abandon)]):
                raise Abandoned(f"quorum {abandon} was given up (a member failed or was lost)")
            if time.monotonic() > deadline:
                raise CommTimeout(f"replica {self.replica}: no answer from the fault-tolerance "
                                  f"coordinator for {what} within {bound:.0f} s")
            time.sleep(POLL_S)

    def process_group(self, decision: Decision) -> Any:
        """The gloo process group of quorum ``decision.quorum`` that connects this rank with
        the same rank of every other member, over a PrefixStore of the coordinator's store (a
        fresh one per quorum: a failed group is never reused)."""
        q, j = decision.quorum, self.rank   # everyone there first: a member lost abandons q at once
        self.store.set(key("arrive", q, self.replica, j), "1")
        self._wait([key("arrive", q, r, j) for r in decision.replicas], self.timeout_s,
                   f"the members of quorum {q}", abandon=q)
        prefix = dist.PrefixStore(key("pg", q, j), self.store)
        rank = decision.replicas.index(self.replica)
        return dist.ProcessGroupGloo(prefix, rank, len(decision.members),
                                     timedelta(seconds=self.timeout_s))

    # ---------------------------------------------------------------- live state
    def send_state(self, pg: Any, decision: Decision, params: list[tuple[str, torch.Tensor]],
                   optim: dict[str, dict[str, torch.Tensor]], trainer: dict[str, Any]) -> None:
        """The source (each of its ranks): describe the state in the store, then send it to
        the same rank of every receiver."""
        layout = [[name, k, list(t.shape), str(t.dtype).removeprefix("torch.")]
                  for name, _ in params for k, t in sorted(optim.get(name, {}).items())]
        self.store.set(key("state", decision.quorum, self.rank), json.dumps({"optim": layout, "trainer": trainer}))
        flat = _flatten([t for _, t in params]
                        + [optim[name][k] for name, k, _, _ in layout] + [torch.get_rng_state()])
        for r in decision.receivers:
            dst = decision.replicas.index(r)
            for i, buf in enumerate(flat):
                pg.send([buf], dst, i).wait()

    def recv_state(self, pg: Any, decision: Decision, params: list[tuple[str, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """A receiver: the source's (params, optimizer states, trainer state); sets the RNG."""
        at = key("state", decision.quorum, self.rank)
        self._wait([at], self.timeout_s, "the source's state", abandon=decision.quorum)
        header = json.loads(self.store.get(at))
        shapes = ([(t.shape, t.dtype) for _, t in params]
                  + [(torch.Size(shape), getattr(torch, dtype)) for _, _, shape, dtype in header["optim"]]
                  + [(torch.get_rng_state().shape, torch.uint8)])
        src = decision.replicas.index(decision.source)
        tensors = _unflatten(shapes, lambda i, buf: pg.recv([buf], src, i).wait())
        got_params = {name: t for (name, _), t in zip(params, tensors)}
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for (name, k, _, _), t in zip(header["optim"], tensors[len(params):]):
            optim.setdefault(name, {})[k] = t
        torch.set_rng_state(tensors[-1])
        return got_params, optim, header["trainer"]


def _flatten(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One contiguous CPU buffer per dtype, in the order each dtype first appears."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1).cpu())
    return [torch.cat(ts) for ts in groups.values()]


def _unflatten(shapes: list[tuple[torch.Size, torch.dtype]], recv) -> list[torch.Tensor]:
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
