"""Hang diagnosis: when an op fails or times out, ranks compare their recent op histories.

Each failing rank publishes its last ops (sequence number, op, axis, shape) in the job's store,
waits briefly for the others, and names the rank(s) whose history departs from the majority
and where: e.g. ``rank 2 diverged at op #3: it ran broadcast@dp(6,) while ranks 0, 1 ran
all_reduce@dp(6,)``. A rank that never reports (dead, or stuck outside the comm layer) is named
as silent.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import torch.distributed as dist

History = list[tuple[int, str, str, tuple[int, ...]]]
KEY = "trainmesh/diag/{}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a torch without the helper
        return None


def _fmt(entry) -> str:
    seq, op, axis, shape = entry
    return f"{op}@{axis}{tuple(shape)}"


def exchange(rank: int, world: int, history: History, wait_s: float) -> dict[int, History]:
    """Publish this rank's history; collect the others' for up to ``wait_s`` seconds."""
    store = _store()
    if store is None or world == 1:
        return {rank: history}
    store.set(KEY.format(rank), json.dumps(history))
    found = {rank: history}
    deadline = time.monotonic() + wait_s
    while len(found) < world and time.monotonic() < deadline:
        for r in range(world):
            if r not in found and store.check([KEY.format(r)]):
                found[r] = [tuple(e[:3]) + (tuple(e[3]),) for e in json.loads(store.get(KEY.format(r)))]
        time.sleep(0.05)
    return found


def verdict(histories: dict[int, History], world: int) -> str:
    """Name the rank(s) whose op sequence departs from the majority, and where."""
    silent = sorted(set(range(world)) - set(histories))
    parts = []
    if silent:
        parts.append(f"ranks {', '.join(map(str, silent))} sent no history (dead or stuck outside trainmesh)")
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
