"""Hang diagnosis: when an op fails or times out, ranks compare their recent op histories.

Each failing rank publishes its last ops (sequence number, op, axis, shape) in a store, waits
briefly for the others, and names the rank(s) whose history departs from the majority and
where: e.g. ``rank 2 diverged at op #3: it ran broadcast@dp(6,) while ranks 0, 1 ran
all_reduce@dp(6,)``. A rank that never reports (dead, stopped, or stuck outside the comm layer)
is named as silent: it is the suspect when the others merely timed out waiting.

The exchange is bounded whatever the peers do: every store call carries a short timeout, and
the exchange runs in a thread that is abandoned after ``wait_s`` plus a little. Local runs use a store hosted by the launcher
(``TRAINMESH_LAUNCHER_STORE=host:port``), so a stalled worker cannot block it; under torchrun it is
the default group's store (torchrun's agent hosts it unless sharing is disabled).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from typing import Any

from trainmesh.core.stores import failure_store, host_of

History = list[tuple[int, str, str, tuple[int, ...]]]
EXCHANGE_WAIT_S = 1.0
"""How long a failing rank waits for its peers' histories. Ranks in the same broken collective
time out together, within far less; a rank still silent after it is stopped or dead."""
CALL_TIMEOUT_S = 2.0   # one store call; a store that does not answer within it is unreachable


def _key(rank: int) -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")   # restarts reuse the store
    return f"trainmesh/diag/{attempt}/{rank}"


def _store() -> Any | None:
    """A store every rank reaches, with short call timeouts; None without one."""
    return failure_store(CALL_TIMEOUT_S)


def _fmt(entry) -> str:
    seq, op, axis, shape = entry
    return f"{op}@{axis}{tuple(shape)}"


def exchange(rank: int, world: int, history: History, wait_s: float) -> dict[int, History]:
    """Publish this rank's history; collect the others' for up to ``wait_s`` seconds.

    Returns the histories found ({rank: history}); ranks missing from it never reported (or the
    store stopped answering). The store is used from a daemon thread that is abandoned when it
    overruns: a TCPStore client does not always honour its timeout against a host that accepts
    connections but never answers (a stopped process)."""
    found = {rank: history}
    if world == 1:
        return found
    worker = threading.Thread(target=_collect, args=(found, rank, world, history, wait_s),
                              daemon=True, name="trainmesh-diagnosis")
    worker.start()
    worker.join(wait_s + 2 * CALL_TIMEOUT_S)
    return dict(found)


def _collect(found: dict[int, History], rank: int, world: int, history: History, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    try:
        store = _store()
        if store is None:
            return
        store.set(_key(rank), json.dumps(history))
        while len(found) < world and time.monotonic() < deadline:
            for r in range(world):
                if r not in found and store.check([_key(r)]):
                    found[r] = [tuple(e[:3]) + (tuple(e[3]),) for e in json.loads(store.get(_key(r)))]
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store timed out or went away: report what we have
        pass


def hosts_of(ranks: list[int], wait_s: float = CALL_TIMEOUT_S) -> dict[int, str]:
    """The host names ``ranks`` published when they joined the job, as far as the store still
    answers within ``wait_s`` (read on a thread abandoned after that)."""
    found: dict[int, str] = {}

    def read() -> None:
        store = _store()
        for r in ranks:
            host = host_of(r, store)
            if host is not None:
                found[r] = host
    worker = threading.Thread(target=read, daemon=True, name="trainmesh-hosts")
    worker.start()
    worker.join(wait_s)
    return dict(found)


def silent_ranks(histories: dict[int, History], world: int) -> list[int]:
    """Ranks that sent no history: the suspects of a timeout."""
    return sorted(set(range(world)) - set(histories))


def verdict(histories: dict[int, History], world: int) -> str:
    """Name the rank(s) whose op sequence departs from the majority, and where."""
    silent = silent_ranks(histories, world)
    parts = []
    if silent:
        parts.append(f"ranks {', '.join(map(str, silent))} sent no history (dead, stopped or stuck outside trainmesh)")
    by_seq = {r: {e[0]: e for e in h} for r, h in histories.items()}
    seqs = sorted({s for h in by_seq.values() for s in h})
    for seq in seqs:
        seen = {r: _fmt(h[seq]) if seq in h else "nothing" for r, h in by_seq.items()}
        if len(set(seen.values())) <= 1:
            continue
        common, _ = Counter(seen.values()).most_common(1)[0]
        odd = sorted(r for r, what in seen.items() if what != common)
        agree = sorted(r for r, what in seen.items() if what == common)
        ran = "; ".join(f"rank {r} ran {seen[r]}" for r in odd)
        parts.append(f"rank {', '.join(map(str, odd))} diverged at op #{seq}: {ran} while "
                     f"ranks {', '.join(map(str, agree))} ran {common}")
        break
    if not parts:
        last = {r: (h[-1][0] if h else 0) for r, h in histories.items()}
        behind = [r for r, s in last.items() if s < max(last.values())]
        if behind:
            parts.append(f"ranks {', '.join(map(str, sorted(behind)))} are behind at op "
                         f"#{min(last.values())} (others reached #{max(last.values())})")
    return "; ".join(parts) or "all ranks agree on their recent ops"
