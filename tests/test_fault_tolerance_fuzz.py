"""The fault-tolerance coordinator's store belongs to whoever reaches it: 1,000 hostile writes
into a running three-replica run (garbage bytes, truncated records, JSON of the right shape
without an authenticator or with a wrong one, quorum and step numbers out of range, genuine
records replayed under other keys or later, and unauthenticated ``done``, commits and
decisions), while a replica is killed and rejoins. The run reaches its last step with every
step equal to one process, the coordinator logs what it ignored, and nothing else exits."""
from __future__ import annotations

import json
import os
import random
import threading
import time

import pytest
from helpers import SMALL, Launched, one_process, steps, summary
from test_fault_tolerance import _same_curve

from trainmesh.testing import metrics_records, serving_address

WRITES = 1000
BURST = 100
"""Writes at each new quorum (14 quorums in this run: the 1,000 land by the tenth, a trickle
between quorums making them land sooner)."""
KEYS = ("req/{q}/{r}", "dec/{q}", "ok/{q}/{r}", "commit/{q}", "abandon/{q}", "arrive/{q}/{r}/0",
        "state/{q}/0", "hb/{r}", "next", "done", "epoch", "rec/{r}/{inc}/{n}", "drained/{r}/{inc}")


def _body(raw: bytes) -> dict:
    """The payload of a genuine record, unverified (what an outsider can read)."""
    try:
        payload = json.loads(raw.partition(b".")[2])
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


class Fuzzer:
    """Writes :data:`WRITES` hostile values into the store at ``address`` from a thread,
    spread over the run, aimed at the quorums around the one being collected."""

    def __init__(self, address: str, seed: int = 0) -> None:
        from trainmesh.core.stores import client_store
        self.store = client_store(address, timeout_s=30)
        self.rng = random.Random(seed)
        self.kinds: dict[str, int] = {}
        self.seen: list[tuple[str, bytes]] = []   # genuine records read, to replay
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _get(self, k: str) -> bytes | None:
        return self.store.get(k) if self.store.check([k]) else None

    def _now(self) -> tuple[int, list[str]]:
        """The quorum being collected and the incarnations of the last decision."""
        got = _body(self._get("next") or b"").get("body")   # (maybe one of ours)
        q = got.get("quorum") if isinstance(got, dict) else None
        q = q if type(q) is int and 0 <= q < 10**6 else 0
        got = _body(self._get(f"dec/{max(q - 1, 0)}") or b"").get("body")
        members = got.get("members") if isinstance(got, dict) else None
        return q, [m[1] for m in members or [] if isinstance(m, list) and len(m) == 2
                   and isinstance(m[1], str)] or ["x.0"]

    def _key(self, q: int, incs: list[str]) -> str:
        rng = self.rng
        at = rng.choice([q - 1, q, q, q + 1, q + 2, -1, 10**12, 2**63])
        return rng.choice(KEYS).format(q=at, r=rng.choice([0, 1, 2, 3, -1]),
                                       inc=rng.choice(incs), n=rng.randrange(0, 40))

    def _value(self, k: str, q: int) -> tuple[str, bytes]:
        rng = self.rng
        kind = rng.choice(["garbage", "truncated", "no-mac", "wrong-mac", "wrong-types",
                           "replayed", "done", "commit", "decision"])
        genuine = self.seen[rng.randrange(len(self.seen))][1] if self.seen else b"{}"
        head = {"v": 2, "epoch": "0" * 32, "by": rng.choice([-1, 0, 1, 2])}
        if kind == "garbage":
            return kind, os.urandom(rng.randrange(0, 200))
        if kind == "truncated":
            return kind, genuine[:rng.randrange(0, max(1, len(genuine)))]
        if kind == "no-mac":
            return kind, json.dumps({**head, "body": _body(genuine).get("body")}).encode()
        if kind == "wrong-mac":
            return kind, b"0" * 64 + b"." + genuine.partition(b".")[2]
        if kind == "wrong-types":
            body = {"quorum": rng.choice([str(q), -5, 10**20, None]), "step": rng.choice(["1", 1e9, -3]),
                    "members": "everyone", "replica": [], "applied": "yes", "beat": -1}
            return kind, rng.choice([b"", b"0" * 64 + b"."]) + json.dumps({**head, "body": body}).encode()
        if kind == "replayed":   # a genuine record, as it was, under another key (or later)
            return kind, genuine
        if kind == "done":
            return kind, b"1"
        if kind == "commit":
            return kind, rng.choice([b"1", json.dumps({**head, "body": {"quorum": q, "applied": True}}).encode()])
        body = {"quorum": q, "members": [[0, "x.0"]], "step": q + 1, "abort": rng.choice([None, "stop"])}
        return kind, json.dumps({**head, "by": -1, "body": body}).encode()

    def _run(self) -> None:
        """A burst of :data:`BURST` writes at each new quorum, a trickle in between."""
        try:
            top, n = -1, 0
            while n < WRITES:
                q, incs = self._now()
                if q > top:
                    for k in (f"dec/{max(q - 1, 0)}", f"commit/{max(q - 2, 0)}", "hb/1"):
                        if (raw := self._get(k)) is not None:
                            self.seen.append((k, raw))
                for _ in range(min(BURST if q > top else 1, WRITES - n)):
                    self._write(q, incs)
                    n += 1
                top = max(top, q)
                time.sleep(0.01)
        except RuntimeError:   # the store is gone: the run ended (the test says how)
            pass
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            self.error = exc

    def _write(self, q: int, incs: list[str]) -> None:
        kind, value = self._value(k := self._key(q, incs), q)
        if kind == "done":
            k = "done"
        elif kind in ("commit", "decision"):
            k = f"{'dec' if kind == 'decision' else kind}/{q}"
        self.store.set(k, value)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hostile_writes_into_the_store_change_nothing(reference_run, tmp_path):
    """Replica 1 is SIGKILLed inside step 4's sums and rejoins at step 7 (replica 0 holds that
    quorum until it asked in); the writes start once the coordinator serves."""
    ref = reference_run(one_process())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["TRAINMESH_FT_INJECT"] = "1@4,1.1@7:join,0@7:hold"
    out = tmp_path / "ft.jsonl"
    run = Launched(["train", *SMALL, "--optimizer", "adamw", "--exit-after", "12", "--dp", "3",
                    "--fault-tolerant", "--timeout", "30", "--metrics-out", str(out)],
                   tmp_path, env=env, name="ft", own_fork_server=False)
    try:
        deadline = time.monotonic() + 120
        while (address := serving_address(run.err.read_text() if run.err.exists() else "")) is None:
            assert run.poll() is None and time.monotonic() < deadline, run.err.read_text()[-2000:]
            time.sleep(0.02)
        fuzzer = Fuzzer(address)
        fuzzer.thread.start()
        fuzzer.thread.join(240)
        alive = run.poll() is None
        _, err = run.communicate(timeout=240)
    finally:
        run.end()
    assert run.returncode == 0, err[-3000:]
    assert fuzzer.error is None, repr(fuzzer.error)
    assert sum(fuzzer.kinds.values()) == WRITES and alive, ("the run ended first", fuzzer.kinds)
    records = metrics_records(out)
    _same_curve(ref, records, 12)
    assert [r["step"] for r in steps(records)] == list(range(1, 13))
    pids = {r["replica"]: r["pids"] for r in summary(records)["ranks"]}
    assert len(pids[0]) == len(pids[2]) == 1 and len(pids[1]) == 2, pids   # only the one killed
    ignored = [line for line in err.splitlines() if "the coordinator ignored the record at" in line]
    assert len(ignored) >= 10 and any(" at req/" in x for x in ignored), err[-3000:]
    assert "replica 0 ignored the record at " in err, err[-3000:]   # the replicas' reads too
    assert all(k in fuzzer.kinds for k in ("done", "commit", "decision", "replayed")), fuzzer.kinds
