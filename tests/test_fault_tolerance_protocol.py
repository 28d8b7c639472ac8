"""The fault-tolerance coordinator's records, in process: every kind parsed from bytes by its
one parse function, a malformed, impossible, unauthenticated, replayed or stale record rejected
with its reason; the job's secret (none, or a file open to others: exit 2, one line); the
coordinator outlives garbage in its store, and a replica refuses a coordinator of another
protocol version naming both."""
from __future__ import annotations

import json
import time

import pytest
from helpers import assert_refused

from trainmesh.fault_tolerance import auth
from trainmesh.fault_tolerance.auth import SECRET_ENV, Codec, load_secret
from trainmesh.fault_tolerance.protocol import (
    PROTOCOL_VERSION,
    Beat,
    Commit,
    Decision,
    Done,
    Mark,
    Next,
    Outcome,
    Posted,
    Rejected,
    Request,
    StateHeader,
    key,
    parse_abandon,
    parse_arrival,
    parse_beat,
    parse_commit,
    parse_decision,
    parse_done,
    parse_next,
    parse_outcome,
    parse_posted,
    parse_request,
    parse_state,
)

SECRET = "s3cret-of-this-job-0123456789"
EPOCH = "e" * 32


def codec(writer: int, *, secret: str = SECRET, epoch: str = EPOCH) -> Codec:
    return Codec(secret, writer=writer, replicas=3, epoch=epoch, last=20)


REQ = Request(1, "abc.0", 4, False, 123, [123], last=20, timeout_s=30.0, quorum=5)
DEC = Decision(5, [[0, "a.0"], [1, "abc.0"], [2, "b.0"]], step=5, source=0, receivers=[1])
OUT = Outcome(1, "abc.0", True, row={"loss": 3.5, "grad_norm": 0.25, "overflow": False}, quorum=5)
# (key, record, writer, parse(codec, raw))
GOOD = [
    (key("req", 5, 1), REQ, 1, lambda c, raw: parse_request(c, raw, 5, 1)),
    (key("dec", 5), DEC, -1, lambda c, raw: parse_decision(c, raw, 5)),
    (key("ok", 5, 1), OUT, 1, lambda c, raw: parse_outcome(c, raw, 5, 1)),
    (key("commit", 5), Commit(5, True), -1, lambda c, raw: Commit(5, parse_commit(c, raw, 5))),
    (key("hb", 2), Beat("b.0", 7), 2, lambda c, raw: parse_beat(c, raw, 2)),
    ("next", Next(5, 5), -1, parse_next),
    (key("abandon", 5), Mark(5), -1, lambda c, raw: parse_abandon(c, raw, 5)),
    (key("arrive", 5, 2, 0), Mark(5, 2, 0), 2, lambda c, raw: parse_arrival(c, raw, 5, 2, 0)),
    (key("state", 5, 0), StateHeader([["w", "exp_avg", [4, 2], "float32"]], {"step": 4}), 0,
     lambda c, raw: parse_state(c, raw, 5, 0, 0)),
    (key("rec", 1, "abc.0", 3), Posted(record={"event": "step", "step": 4, "loss": 3.5}), 1,
     lambda c, raw: Posted(record=parse_posted(c, raw, 1, "abc.0", 3))),
    ("done", Done(20), -1, lambda c, raw: Done(parse_done(c, raw))),
]


@pytest.mark.parametrize("k, record, writer, parse", GOOD, ids=[g[0] for g in GOOD])
def test_a_good_record_round_trips(k, record, writer, parse):
    assert parse(codec(-1 if writer >= 0 else 0), codec(writer).seal(k, record)) == record


def _body(record) -> dict:
    from dataclasses import asdict
    return asdict(record)


def _forged(k: str, body: dict, writer: int, **head) -> bytes:
    """A record sealed with the job's secret whose body is ``body`` (a member's bug)."""
    payload = json.dumps({"v": PROTOCOL_VERSION, "epoch": EPOCH, "by": writer, "body": body,
                          **head}).encode()
    return auth.authenticator(SECRET, k, payload).encode() + b"." + payload


BAD_REQUESTS = [
    (b"{not json", "no authenticator"),
    (b"\xff\xfe\x00garbage", "no authenticator"),
    (codec(1).seal(key("req", 5, 1), REQ)[:-7], "wrong authenticator"),   # truncated
    (codec(1, secret="another-secret-0123456789").seal(key("req", 5, 1), REQ), "wrong authenticator"),
    (codec(1).seal(key("req", 4, 1), REQ), "wrong authenticator"),        # another key
    (codec(1, epoch="f" * 32).seal(key("req", 5, 1), REQ), "stale"),      # another coordinator
    (codec(2).seal(key("req", 5, 1), REQ), "written by 2"),
    (_forged(key("req", 5, 1), {**_body(REQ), "step": "4"}, 1), "Request.step: str"),
    (_forged(key("req", 5, 1), {**_body(REQ), "needs_state": 1}, 1), "Request.needs_state: int"),
    (_forged(key("req", 5, 1), {**_body(REQ), "quorum": 4}, 1), "claims quorum 4, its key names 5"),
    (_forged(key("req", 5, 1), {**_body(REQ), "step": 21}, 1), "step 21 outside 0..20"),
    (_forged(key("req", 5, 1), {**_body(REQ), "step": -1}, 1), "step -1 outside"),
    (_forged(key("req", 5, 1), {**_body(REQ), "replica": 2}, 1), "for replica 2"),
    (_forged(key("req", 5, 1), {**_body(REQ), "timeout_s": float("nan")}, 1), "timeout nan"),
    (_forged(key("req", 5, 1), {**_body(REQ), "step": 2**70}, 1), "Request.step: int"),
    (_forged(key("req", 5, 1), {**_body(REQ), "extra": 1}, 1), "unknown fields ['extra']"),
    (_forged(key("req", 5, 1), {"replica": 1}, 1), "Request: no incarnation"),
    (_forged(key("req", 5, 1), [1, 2], 1), "Request: not an object"),
    (auth.authenticator(SECRET, key("req", 5, 1), b"[1, 2").encode() + b".[1, 2", "no JSON object"),
    (auth.authenticator(SECRET, key("req", 5, 1), b"[1]").encode() + b".[1]", "no JSON object"),
    (_forged(key("req", 5, 1), _body(REQ), 1, v=PROTOCOL_VERSION + 1),
     f"protocol version {PROTOCOL_VERSION + 1}, this one speaks version {PROTOCOL_VERSION}"),
]


@pytest.mark.parametrize("raw, reason", BAD_REQUESTS, ids=[b[1][:30] for b in BAD_REQUESTS])
def test_a_bad_request_is_rejected_with_its_reason(raw, reason):
    with pytest.raises(Rejected) as exc:
        parse_request(codec(-1), raw, 5, 1)
    assert reason in exc.value.reason, exc.value.reason


@pytest.mark.parametrize("body, reason", [
    ({"quorum": 6}, "claims quorum 6"),
    ({"step": 0}, "step 0 is outside 1..20"),
    ({"step": 21}, "step 21 is outside 1..20"),
    ({"members": [[0, "a.0"], [3, "x.0"]]}, "replica 3 is not one of 0..2"),
    ({"members": [[1, "a.0"], [0, "x.0"]]}, "not sorted and unique"),
    ({"members": [[0, 5]]}, "is not [replica, incarnation]"),
    ({"members": []}, "no members"),
    ({"receivers": [2], "source": 2}, "source 2 for receivers [2]"),
    ({"receivers": [], "source": 0}, "source 0 for receivers []"),
    ({"source": 7}, "source 7"),
    ({"lost": [-1]}, "replica -1 is not one of"),
])
def test_an_impossible_decision_is_rejected(body, reason):
    k = key("dec", 5)
    with pytest.raises(Rejected) as exc:
        parse_decision(codec(1), _forged(k, {**_body(DEC), **body}, -1), 5)
    assert reason in exc.value.reason and exc.value.authentic, exc.value.reason


@pytest.mark.parametrize("body, reason", [
    ({"row": {"loss": "3"}}, "row field loss='3'"),
    ({"row": {"loss": 3.5, "overflow": False}}, "without its loss, gradient norm"),
    ({"row": {"bogus": 1.0, "loss": 1.0, "grad_norm": 1.0, "overflow": False}}, "row field bogus"),
    ({"ok": False, "error": ""}, "a failure without its error"),
    ({"replica": 0}, "for replica 0 under replica 1's key"),
])
def test_an_impossible_outcome_is_rejected(body, reason):
    k = key("ok", 5, 1)
    with pytest.raises(Rejected) as exc:
        parse_outcome(codec(-1), _forged(k, {**_body(OUT), **body}, 1), 5, 1)
    assert reason in exc.value.reason, exc.value.reason


def test_a_record_replayed_under_another_key_or_from_another_coordinator_is_rejected():
    old = codec(-1).seal(key("commit", 3), Commit(3, True))
    with pytest.raises(Rejected, match="wrong authenticator"):
        parse_commit(codec(1), old, 9)            # quorum 3's commit replayed as quorum 9's
    assert parse_commit(codec(1), old, 3) is True
    with pytest.raises(Rejected, match="stale"):  # the same key, a coordinator started again
        parse_commit(codec(1, epoch="0" * 32), old, 3)
    done = codec(-1).seal("done", Done(20))
    with pytest.raises(Rejected, match="no authenticator"):
        parse_done(codec(1), b"1")
    with pytest.raises(Rejected, match="written by 1, where only -1 writes"):
        parse_done(codec(-1), codec(1).seal("done", Done(20)))   # a replica cannot end the run
    assert parse_done(codec(1), done) == 20


def test_the_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(auth.ConfigError, match="--secret-file PATH"):
        load_secret(None)
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o644)
    with pytest.raises(auth.ConfigError, match="open to group or others .*chmod 600"):
        load_secret(str(f))
    f.chmod(0o600)
    assert load_secret(str(f)) == SECRET
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(auth.ConfigError, match="at least 16 characters"):
        load_secret(None)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    assert load_secret(None) == SECRET


@pytest.mark.timeout(60)
def test_a_coordinator_or_replica_without_a_secret_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    line = assert_refused(capsys, ["coordinator", "--bind", "127.0.0.1:0", "--replicas", "2"],
                          SECRET_ENV)
    assert "--secret-file" in line
    assert_refused(capsys, ["train", "--fault-tolerant", "--coordinator", "127.0.0.1:1",
                            "--replica-id", "0", "--replicas", "2", "--steps", "2", "--warmup-steps", "1"],
                   SECRET_ENV)
    f = tmp_path / "secret"
    f.write_text(SECRET)
    f.chmod(0o640)
    assert_refused(capsys, ["coordinator", "--bind", "127.0.0.1:0", "--replicas", "2",
                            "--secret-file", str(f)], "--secret-file")
    assert_refused(capsys, ["train", "--fault-tolerant", "--dp", "2", "--steps", "2",
                            "--warmup-steps", "1", "--secret-file", str(f)], "--secret-file")


@pytest.mark.timeout(60)
def test_the_coordinator_ignores_garbage_and_an_unauthenticated_done():
    """The reported failure: ``req/0/0 = "{not json"`` ended the coordinator, and ``done = 1``
    ended every replica. Both are logged (with the key and the writer it claims) and ignored."""
    from trainmesh.core.stores import client_store
    from trainmesh.fault_tolerance.coordinator import Coordinator
    lines: list[str] = []
    coordinator = Coordinator(replicas=2, secret=SECRET, notify=lines.append, startup_timeout_s=30)
    coordinator.start()
    try:
        store = client_store(coordinator.address, timeout_s=10)
        store.set("req/0/0", "{not json")
        store.set("req/0/1", json.dumps({"v": PROTOCOL_VERSION, "by": 1, "body": {}}))
        store.set("done", "1")
        deadline = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert coordinator._thread.is_alive() and coordinator.error is None, coordinator.error
        assert any("req/0/0 (from an unknown writer): no authenticator" in x for x in lines), lines
        assert any("req/0/1 (from replica 1): no authenticator" in x for x in lines), lines
    finally:
        coordinator.stop()
        coordinator.join(5)


@pytest.mark.timeout(60)
def test_a_replica_refuses_a_coordinator_of_another_version(monkeypatch):
    from trainmesh.core.stores import server_store
    from trainmesh.fault_tolerance.protocol import Epoch
    from trainmesh.fault_tolerance.replica import ProtocolMismatch, find_coordinator
    server = server_store(timeout_s=10)
    address = f"127.0.0.1:{server.port}"
    monkeypatch.setattr(auth, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    server.set("epoch", codec(-1).seal("epoch", Epoch(EPOCH)))
    monkeypatch.undo()
    with pytest.raises(ProtocolMismatch) as exc:
        find_coordinator(address, time.monotonic() + 5, codec(0), timeout_s=5, what="replica 0")
    message = str(exc.value)
    assert f"protocol version {PROTOCOL_VERSION + 1}" in message and \
        f"speaks version {PROTOCOL_VERSION}" in message and "\n" not in message, message


@pytest.mark.timeout(60)
def test_the_coordinator_waits_for_a_replica_holding_the_committed_step():
    """The replica holding the committed step is stalled (or cut off) while the others, back
    from a partition, are behind it: the quorum waits for it (it returns and is the source)
    instead of ending the run; it waits at most the members' timeout, then ends the run in one
    line (planted: the quorum collected without it fails with the thread no longer alive)."""
    import threading

    from trainmesh.core.stores import client_store
    from trainmesh.fault_tolerance.coordinator import Coordinator
    c = Coordinator(replicas=3, secret=SECRET, notify=lambda line: None, startup_timeout_s=30)
    store = client_store(c.address, timeout_s=10)
    c.committed, c.last, c.step_timeout_s = 99, 250, 40.0
    members = [[0, "a.0"], [1, "b.0"], [2, "c.0"]]

    def ask(q: int, r: int, step: int, timeout_s: float = 30.0, needs_state: bool = False) -> None:
        req = Request(r, members[r][1], step, needs_state, 100 + r, last=250, timeout_s=timeout_s,
                      quorum=q)
        k = key("req", q, r)
        store.set(k, Codec(SECRET, writer=r, replicas=3, epoch=c.codec.epoch, last=250).seal(k, req))

    got: dict = {}
    ask(5, 1, 55)
    ask(5, 2, 55)
    collect = threading.Thread(target=lambda: got.update(c._collect(store, 5, members, time.monotonic())))
    collect.start()
    collect.join(1.5)
    assert collect.is_alive(), f"the quorum was collected without a replica at step 99: {sorted(got)}"
    ask(5, 0, 99)
    collect.join(10)
    decision = c._decide(5, got, members)
    assert (decision.abort, decision.step, decision.source, decision.receivers) == (None, 100, 0, [1, 2])
    ask(6, 1, 55, timeout_s=0.5)   # the holder never returns: the run ends, saying why
    ask(6, 2, 55, timeout_s=0.5)
    decision = c._decide(6, c._collect(store, 6, members, time.monotonic()), members)
    assert decision.abort.startswith("no replica holding the live state is left"), decision.abort
    for r in range(3):   # every replica asked, none holding it (the holder died, restarted): at once
        ask(7, r, 0 if r == 0 else 55, needs_state=r == 0)
    began = time.monotonic()
    decision = c._decide(7, c._collect(store, 7, members, began), members)
    assert decision.abort.startswith("no replica holding") and time.monotonic() - began < 10


@pytest.mark.timeout(60)
def test_a_coordinator_that_took_over_redoes_a_step_whose_only_holder_was_lost():
    """The chaos soak's failure: the new coordinator took over at step 15 (replica 1 had read the
    commit of step 14, replicas 0 and 2 had not: they hold step 13), and replica 1 was lost in its
    first quorum. Replicas 0 and 2 redo step 14 (a step is a function of the state before it),
    once, and only before this coordinator commits a step (planted: the old decision fails with
    the abort "no replica holding the live state is left")."""
    from trainmesh.fault_tolerance.coordinator import Coordinator

    def asked(q: int, steps: dict[int, int]) -> dict[int, Request]:
        return {r: Request(r, f"{r}.0", s, False, 100 + r, last=50, timeout_s=30.0, quorum=q)
                for r, s in steps.items()}

    lines: list[str] = []
    c = Coordinator(replicas=3, secret=SECRET, notify=lines.append, startup_timeout_s=30)
    first = c._decide(0, asked(0, {0: 13, 1: 14, 2: 13}), [])
    assert (first.abort, first.step, first.source, first.receivers, first.restarted) == \
        (None, 15, 1, [0, 2], True)
    second = c._decide(1, asked(1, {0: 13, 2: 13}), first.members)
    assert (second.abort, second.step, second.source, second.receivers, second.lost) == \
        (None, 14, None, [], [1]), second.abort
    assert c.committed == 13 and "step 14 was held only by replicas since lost" in lines[-1], lines
    third = c._decide(2, asked(2, {0: 12}), second.members)   # once: not from two steps back
    assert third.abort and third.abort.startswith("no replica holding the live state is left"), third.abort
    again = Coordinator(replicas=3, secret=SECRET, notify=lines.append, startup_timeout_s=30)
    took = again._decide(0, asked(0, {0: 13, 1: 14, 2: 13}), [])
    done = [Outcome(r, f"{r}.0", True, row={"loss": 3.5}, quorum=0) for r in range(3)]
    again._committed(took, done, None)   # this coordinator committed step 15 itself
    later = again._decide(1, asked(1, {0: 14}), took.members)   # (cut off before its commit)
    assert later.abort and later.abort.startswith("no replica holding the live state is left"), later.abort
