"""The quorum protocol's records and store keys, shared by the coordinator and the replicas.

Every key lives in the coordinator's store (docs/FAULT_TOLERANCE.md gives the protocol). The
store is the coordinator's memory and nothing else: a coordinator started again has an empty
one and rebuilds what it needs from the replicas' requests.

- ``epoch``: this coordinator's id, random, set before anything else (a replica that finds
  another one after reconnecting knows the coordinator was restarted);
- ``hb/{r}``: replica r's heartbeat (from its first rank), ``"{incarnation}:{counter}"``,
  rewritten every :data:`HEARTBEAT_S`;
- ``next``: the number of the quorum the coordinator is collecting; ``next_step``: the step it
  would run;
- ``req/{q}/{r}``: replica r asks to take part in quorum q (a :class:`Request`, from its first
  rank, which passes the decision and the commit on to the replica's other ranks);
- ``dec/{q}``: the coordinator's decision (a :class:`Decision`);
- ``ok/{q}/{r}``: replica r's outcome of the step attempt of quorum q (an :class:`Outcome`,
  the one its ranks agreed on);
- ``commit/{q}``: ``"1"`` when every member succeeded (the step is applied), else ``"0"``;
- ``arrive/{q}/{r}/{j}``: rank j of member r is about to build quorum q's group j (every member
  waits for the others first, so a member lost meanwhile abandons q instead of a connect
  waiting for it until ``--timeout``);
- ``abandon/{q}``: set once a member of q failed or was lost (the others stop waiting on it,
  inside a collective too);
- ``state/{q}/{j}``: the description of the live state rank j of the source sends to rank j of
  the receivers, with its training state (:class:`~trainmesh.engine.train_state.TrainState`);
- ``pg/{q}/{j}/...``: process group j of quorum q, rank j of every member (a ``PrefixStore``);
- ``rec/{r}/{i}/{n}``: the n-th metrics record of replica r's incarnation i (a run on one host,
  whose coordinator writes the metrics file);
- ``done``: set once the last step is committed (a replica still asking in ends).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

HEARTBEAT_S = 0.2
"""How often a replica rewrites its heartbeat."""
HEARTBEAT_TIMEOUT_S = 2.0
"""A replica whose heartbeat has not changed for this long is lost (a restarted replica's new
incarnation supersedes the old one at once)."""
POLL_S = 0.02
"""How often the coordinator and the replicas look at the store."""
DONE = "done"
INJECT_ENV = "TRAINMESH_FT_INJECT"
"""Test-only fault injection (:mod:`trainmesh.fault_tolerance.inject`)."""


def key(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


_R = TypeVar("_R", bound="_Record")


class _Record:
    """A dataclass record written to the store as JSON."""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls: type[_R], raw: bytes) -> _R:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Request(_Record):
    """A replica asking to take part in a quorum."""

    replica: int
    incarnation: str
    """Its process (re)start: a launcher's own id and its agent's restart count."""
    step: int
    """Optimizer steps it has applied (its state is the run's state after that step)."""
    needs_state: bool
    """Its state is not the live one (a restarted replica, or one that missed a commit)."""
    pid: int
    pids: list[int] = field(default_factory=list)
    """The process ids of all its ranks (a replica of several ranks), in rank order."""
    last: int = 0
    """The run's last step (every replica says the same; a restarted coordinator learns it)."""
    timeout_s: float = 300.0
    """The replica's collective timeout (how long a live member may take to report)."""


@dataclass(frozen=True)
class Decision(_Record):
    """The members of quorum q and the step they run, the same for every replica."""

    quorum: int
    members: list[list[Any]] = field(default_factory=list)
    """``[replica, incarnation]`` pairs, by replica id: the process-group ranks in this order."""
    step: int = 0
    """The step this quorum attempts."""
    source: int | None = None
    """The replica that sends the live state to ``receivers`` (None when nobody needs it)."""
    receivers: list[int] = field(default_factory=list)
    abort: str | None = None
    """Set when the run cannot go on: the reason, in one line."""
    restarted: bool = False
    """The first decision of a coordinator started again (its state rebuilt from the requests)."""
    lost: list[int] = field(default_factory=list)
    """Members of the previous quorum left out of this one."""
    joined: list[int] = field(default_factory=list)
    """Members of this quorum that were not in the previous one."""

    @property
    def replicas(self) -> list[int]:
        return [r for r, _ in self.members]

    def has(self, replica: int, incarnation: str) -> bool:
        return [replica, incarnation] in self.members


@dataclass(frozen=True)
class Outcome(_Record):
    """How a member's attempt at the step of a quorum went, with its metrics row when it did."""

    replica: int
    incarnation: str
    ok: bool
    error: str = ""
    row: dict[str, Any] = field(default_factory=dict)


def split_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part ``index`` of ``rows`` split into ``parts`` contiguous pieces whose
    sizes differ by at most one (the first ``rows % parts`` pieces take one more)."""
    base, extra = divmod(rows, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
