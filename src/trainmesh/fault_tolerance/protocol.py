"""The quorum protocol's records and store keys, shared by the coordinator and the replicas.

Every key lives in the coordinator's store (docs/FAULT_TOLERANCE.md gives the protocol). The
store is the coordinator's memory and nothing else: a coordinator started again has an empty
one and rebuilds what it needs from the replicas' requests.

Every value is a sealed record (:class:`Codec`): ``MAC.PAYLOAD``, the payload a JSON object
``{"v": protocol version, "epoch": the coordinator's epoch, "by": the writer (a replica id, -1
the coordinator), "body": the record}`` and MAC its authenticator under the key
(:func:`~trainmesh.fault_tolerance.auth.authenticator`). Readers never touch the raw bytes:
one ``parse_*`` function per kind checks the authenticator, the version, the epoch (a record of
another coordinator is stale), the writer, every field's type and range, and the quorum, step
and replica the key names, and raises :class:`Rejected` with the reason otherwise.

- ``epoch``: this coordinator's id, random, set before anything else (a replica that finds
  another one after reconnecting knows the coordinator was restarted);
- ``hb/{r}``: replica r's heartbeat (from its first rank), a :class:`Beat`, rewritten every
  :data:`HEARTBEAT_S` with a counter that only grows;
- ``next``: the quorum the coordinator is collecting and the step it would run (a :class:`Next`);
- ``req/{q}/{r}``: replica r asks to take part in quorum q (a :class:`Request`, from its first
  rank, which passes the decision and the commit on to the replica's other ranks);
- ``dec/{q}``: the coordinator's decision (a :class:`Decision`);
- ``ok/{q}/{r}``: replica r's outcome of the step attempt of quorum q (an :class:`Outcome`,
  the one its ranks agreed on);
- ``commit/{q}``: whether the step is applied (a :class:`Commit`: every member succeeded);
- ``arrive/{q}/{r}/{j}``: rank j of member r is about to build quorum q's group j (every member
  waits for the others first, so a member lost meanwhile abandons q instead of a connect
  waiting for it until ``--timeout``);
- ``abandon/{q}``: set once a member of q failed or was lost (the others stop waiting on it,
  inside a collective too);
- ``state/{q}/{j}``: the description of the live state rank j of the source sends to rank j of
  the receivers, with its training state (a :class:`StateHeader`);
- ``pg/{q}/{j}/...``: process group j of quorum q, rank j of every member (a ``PrefixStore``;
  gloo's own keys, not records);
- ``rec/{r}/{i}/{n}``: the n-th metrics record of replica r's incarnation i (a run on one host,
  whose coordinator writes the metrics file); ``drained/{r}/{i}``: how many of them it wrote;
- ``done``: set once the last step is committed (a replica still asking in ends).
"""
from __future__ import annotations

import contextlib
import json
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from .auth import COORDINATOR_ID, MAX_INT, PROTOCOL_VERSION, Codec, Rejected, VersionMismatch

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
MAX_TEXT = 4096
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool"})
"""The dtypes a state description may name."""


def key(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


def _check(condition: bool, reason: str) -> None:
    if not condition:
        raise Rejected(reason)


@contextlib.contextmanager
def _written_by(writer: int) -> Iterator[None]:
    """The checks of an authentic record (sealed by ``writer``): one that fails is its
    writer's bug."""
    try:
        yield
    except Rejected as exc:
        raise Rejected(exc.reason, writer, authentic=True) from None


# ---------------------------------------------------------------- the records
@dataclass(frozen=True)
class Epoch:
    epoch: str


@dataclass(frozen=True)
class Beat:
    incarnation: str
    beat: int
    """Grows with every beat of the incarnation (an older one replayed is stale)."""


@dataclass(frozen=True)
class Next:
    quorum: int
    step: int


@dataclass(frozen=True)
class Request:
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
    quorum: int = 0
    """The quorum it asks into (its key's)."""


@dataclass(frozen=True)
class Decision:
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
class Outcome:
    """How a member's attempt at the step of a quorum went, with its metrics row when it did."""

    replica: int
    incarnation: str
    ok: bool
    error: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    quorum: int = 0


ROW = {"loss": float, "grad_norm": float, "overflow": bool, "nonfinite": str,
       "nonfinite_ends": str, "state_transfer_s": float}
"""The fields an outcome's row may hold."""


@dataclass(frozen=True)
class Commit:
    quorum: int
    applied: bool


@dataclass(frozen=True)
class Mark:
    """``abandon/q`` (rank -1) and ``arrive/q/r/j``."""

    quorum: int
    replica: int = -1
    rank: int = -1


@dataclass(frozen=True)
class StateHeader:
    """What the source's rank j sends: ``[name, optimizer key, shape, dtype]`` per optimizer
    tensor (after the parameters), and its training state."""

    optim: list[list[Any]]
    trainer: dict[str, Any]


@dataclass(frozen=True)
class Posted:
    """A metrics record a replica posts (``rec/r/i/n``), or how many were written (``drained``)."""

    record: dict[str, Any] = field(default_factory=dict)
    count: int = 0


@dataclass(frozen=True)
class Done:
    committed: int


def _open(c: Codec, k: str, raw: bytes, cls: type, *, by: int | None, any_epoch: bool = False) -> Any:
    """The record of type ``cls`` at ``k``, written by ``by`` (:meth:`Codec.open`)."""
    return c.open(k, raw, lambda body: _typed(cls, body), by=by, any_epoch=any_epoch)


_HINTS: dict[type, dict[str, Any]] = {}


def _typed(cls: type, body: Any) -> Any:
    """``cls(**body)`` once every field is known, present (unless it has a default) and of its
    annotated type."""
    _check(isinstance(body, dict), f"{cls.__name__}: not an object")
    hints = _HINTS.setdefault(cls, typing.get_type_hints(cls))
    unknown = sorted(set(body) - set(hints))
    _check(not unknown, f"{cls.__name__}: unknown fields {unknown[:3]}")
    for f in fields(cls):
        if f.name not in body:
            _check(f.default is not MISSING or f.default_factory is not MISSING,
                   f"{cls.__name__}: no {f.name}")
        elif not _is(body[f.name], hints[f.name]):
            raise Rejected(f"{cls.__name__}.{f.name}: {type(body[f.name]).__name__} where "
                           f"{hints[f.name]} is valid")
    return cls(**body)


def _is(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return type(value) is bool
    if tp is int:
        return type(value) is int and -MAX_INT <= value <= MAX_INT
    if tp is float:
        return type(value) in (int, float)
    if tp is str:
        return type(value) is str and len(value) <= MAX_TEXT
    if origin is list:
        return type(value) is list and all(_is(v, args[0]) for v in value)
    if origin is dict:
        return type(value) is dict and all(type(k) is str for k in value)
    return False


# ---------------------------------------------------------------- one parse per kind
def _replica(c: Codec, r: Any, what: str) -> None:
    _check(type(r) is int and 0 <= r < c.replicas, f"{what}: replica {r!r} is not one of 0..{c.replicas - 1}")


def _quorum(got: int, q: int, what: str) -> None:
    _check(got == q, f"{what}: claims quorum {got}, its key names {q}")


def _step(c: Codec, step: int, what: str, *, low: int = 1) -> None:
    top = c.last if c.last is not None else MAX_INT
    _check(low <= step <= top, f"{what}: step {step} is outside {low}..{top}")


def _finite(x: float) -> bool:
    return math.isfinite(x)


def parse_epoch(c: Codec, raw: bytes) -> str:
    """The coordinator's epoch (any epoch: this is how a replica learns it)."""
    e = _open(c, "epoch", raw, Epoch, by=COORDINATOR_ID, any_epoch=True)
    with _written_by(COORDINATOR_ID):
        _check(0 < len(e.epoch) <= 64, "epoch: empty or too long")
        return e.epoch


def parse_beat(c: Codec, raw: bytes, r: int) -> Beat:
    b = _open(c, key("hb", r), raw, Beat, by=r)
    with _written_by(r):
        _check(0 < len(b.incarnation) <= 200 and b.beat >= 0, "heartbeat: bad incarnation or counter")
        return b


def parse_next(c: Codec, raw: bytes) -> Next:
    n = _open(c, "next", raw, Next, by=COORDINATOR_ID)
    with _written_by(COORDINATOR_ID):
        _check(n.quorum >= 0, f"next: quorum {n.quorum} < 0")
        _step(c, n.step, "next", low=1)
        return n


def parse_request(c: Codec, raw: bytes, q: int, r: int) -> Request:
    req = _open(c, key("req", q, r), raw, Request, by=r)
    with _written_by(r):
        _quorum(req.quorum, q, "request")
        _check(req.replica == r, f"request: for replica {req.replica} under replica {r}'s key")
        _check(0 < len(req.incarnation) <= 200, "request: bad incarnation")
        _check(1 <= req.last and 0 <= req.step <= req.last,
               f"request: step {req.step} outside 0..{req.last} (its last step)")
        _check(req.pid > 0 and all(p > 0 for p in req.pids), "request: process ids must be > 0")
        _check(_finite(req.timeout_s) and req.timeout_s > 0, f"request: timeout {req.timeout_s} s")
        return req


def parse_decision(c: Codec, raw: bytes, q: int) -> Decision:
    d = _open(c, key("dec", q), raw, Decision, by=COORDINATOR_ID)
    with _written_by(COORDINATOR_ID):
        _quorum(d.quorum, q, "decision")
        if d.abort is not None:
            return d
        _check(bool(d.members), "decision: no members")
        for m in d.members:
            _check(len(m) == 2 and type(m[1]) is str, f"decision: member {m!r} is not [replica, incarnation]")
            _replica(c, m[0], "decision")
        ids = d.replicas
        _check(ids == sorted(set(ids)), f"decision: members {ids} not sorted and unique")
        _step(c, d.step, "decision")
        _check(set(d.receivers) <= set(ids) and d.receivers == sorted(set(d.receivers)),
               f"decision: receivers {d.receivers} are not members {ids}")
        _check((d.source is None) == (not d.receivers) and d.source not in d.receivers
               and (d.source is None or d.source in ids), f"decision: source {d.source} for receivers {d.receivers}")
        for r in (*d.lost, *d.joined):
            _replica(c, r, "decision")
        return d


def parse_outcome(c: Codec, raw: bytes, q: int, r: int) -> Outcome:
    o = _open(c, key("ok", q, r), raw, Outcome, by=r)
    with _written_by(r):
        _quorum(o.quorum, q, "outcome")
        _check(o.replica == r, f"outcome: for replica {o.replica} under replica {r}'s key")
        for name, value in o.row.items():
            _check(name in ROW and _is(value, ROW[name]), f"outcome: row field {name}={value!r}")
        _check(not o.ok or ("loss" in o.row and "grad_norm" in o.row and "overflow" in o.row),
               "outcome: a success without its loss, gradient norm and overflow")
        _check(o.ok or (bool(o.error) and not o.row), "outcome: a failure without its error")
        _check(o.row.get("state_transfer_s", 0.0) >= 0, "outcome: negative transfer time")
        return o


def parse_commit(c: Codec, raw: bytes, q: int) -> bool:
    commit = _open(c, key("commit", q), raw, Commit, by=COORDINATOR_ID)
    with _written_by(COORDINATOR_ID):
        _quorum(commit.quorum, q, "commit")
        return commit.applied


def parse_abandon(c: Codec, raw: bytes, q: int) -> Mark:
    m = _open(c, key("abandon", q), raw, Mark, by=COORDINATOR_ID)
    with _written_by(COORDINATOR_ID):
        _quorum(m.quorum, q, "abandon")
        return m


def parse_arrival(c: Codec, raw: bytes, q: int, r: int, j: int) -> Mark:
    m = _open(c, key("arrive", q, r, j), raw, Mark, by=r)
    with _written_by(r):
        _check((m.quorum, m.replica, m.rank) == (q, r, j), f"arrival: claims {m}, its key names "
               f"quorum {q} replica {r} rank {j}")
        return m


def parse_state(c: Codec, raw: bytes, q: int, j: int, source: int) -> StateHeader:
    h = _open(c, key("state", q, j), raw, StateHeader, by=source)
    with _written_by(source):
        for entry in h.optim:
            _check(len(entry) == 4 and type(entry[0]) is str and type(entry[1]) is str
                   and _is(entry[2], list[int]) and all(n >= 0 for n in entry[2])
                   and entry[3] in DTYPES, f"state: bad optimizer entry {str(entry)[:80]}")
        return h


def parse_posted(c: Codec, raw: bytes, r: int, incarnation: str, n: int) -> dict[str, Any]:
    record = _open(c, key("rec", r, incarnation, n), raw, Posted, by=r).record
    with _written_by(r):
        _check(record.get("event") in ("step", "eval", "save"), f"metrics record: event {record.get('event')!r}")
        _check(type(record.get("step")) is int, "metrics record: no step")
        _step(c, record["step"], "metrics record")
        return record


def parse_drained(c: Codec, raw: bytes, r: int, incarnation: str) -> int:
    count = _open(c, key("drained", r, incarnation), raw, Posted, by=COORDINATOR_ID).count
    with _written_by(COORDINATOR_ID):
        _check(count >= 0, "drained: negative count")
        return count


def parse_done(c: Codec, raw: bytes) -> int:
    done = _open(c, DONE, raw, Done, by=COORDINATOR_ID)
    with _written_by(COORDINATOR_ID):
        _check(done.committed >= 0, "done: negative step")
        return done.committed


class Rejections:
    """Logs each rejected record once per key and reason (``notify``: one line each) and counts
    them all."""

    LIMIT = 1000

    def __init__(self, notify: Callable[[str], None], *, who: str) -> None:
        self.notify, self.who, self.count = notify, who, 0
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, k: str, exc: Rejected) -> None:
        self.count += 1
        reason = exc.reason.split(":", 1)[0] if exc.reason.startswith("stale") else exc.reason
        if (k, reason) in self._seen or len(self._seen) >= self.LIMIT:
            return
        self._seen.add((k, reason))
        writer = {None: "an unknown writer", COORDINATOR_ID: "the coordinator"}.get(
            exc.writer, f"replica {exc.writer}")
        self.notify(f"trainmesh: {self.who} ignored the record at {k} (from {writer}): {exc.reason}"
                    + ("; further rejected records are counted, not shown"
                       if len(self._seen) == self.LIMIT else ""))

    def read(self, store: Any, k: str, parse: Callable[[bytes], Any]) -> Any:
        """``parse(value)`` of the record at ``k`` of ``store`` (c10d's ``check`` and ``get``);
        None when there is none or it is rejected (then logged here, once)."""
        if not store.check([k]):
            return None
        try:
            return parse(store.get(k))
        except Rejected as exc:
            self(k, exc)
            return None


def split_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part ``index`` of ``rows`` split into ``parts`` contiguous pieces whose
    sizes differ by at most one (the first ``rows % parts`` pieces take one more)."""
    base, extra = divmod(rows, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
