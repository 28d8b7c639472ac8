"""The coordinator's side of its store: the records it writes (sealed, and written again while
they are read: the store answers anyone who reaches it, who may overwrite or delete a key), the
records it reads (each through its parse function; one rejected is logged once and ignored),
and the replicas' heartbeats (a counter that only grows, per incarnation: one replayed is
stale, and an incarnation superseded never comes back)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .protocol import HEARTBEAT_TIMEOUT_S, Codec, Rejected, Rejections, key, parse_beat

HEAL_EVERY = 5
"""Every how many polls the coordinator writes its live records again (one overwritten or
deleted by a writer from outside the job is restored)."""


class Ledger:
    """What the coordinator of ``codec``'s job wrote, read and heard (``notify``: its log)."""

    def __init__(self, codec: Codec, notify: Callable[[str], None]) -> None:
        self.codec = codec
        self.rejected = Rejections(notify, who="the coordinator")
        self._own: dict[str, tuple[int, bytes]] = {}
        """The records it wrote that may still be read: key -> (quorum, sealed)."""
        self._polls = 0
        self._beats: dict[int, tuple[str, int, float]] = {}
        """replica -> (incarnation, heartbeat counter, when it last grew)."""
        self._superseded: set[tuple[int, str]] = set()

    # ---------------------------------------------------------------- its own records
    def set(self, store: Any, k: str, record: Any, quorum: int = -1) -> None:
        """Seal ``record`` under ``k`` and write it; kept to be written again while a reader
        may still look for it (``quorum``: until two quorums later; -1: always)."""
        sealed = self.codec.seal(k, record)
        self._own[k] = (quorum, sealed)
        store.set(k, sealed)

    def heal(self, store: Any, every: int = HEAL_EVERY) -> None:
        """Every ``every`` calls: its records written again (one overwritten, deleted or
        squatted by another writer is restored)."""
        self._polls += 1
        if self._polls % every == 0:
            for k, (_, sealed) in list(self._own.items()):
                store.set(k, sealed)

    def forget(self, q: int) -> None:
        """The records of quorums before q - 1 are read no more."""
        self._own = {k: v for k, v in self._own.items() if v[0] < 0 or v[0] >= q - 1}

    # ---------------------------------------------------------------- what it reads
    def read(self, store: Any, k: str, parse: Callable[[bytes], Any]) -> Any:
        """``parse(value)`` of the record at ``k``; None when there is none or it is rejected
        (logged once)."""
        return self.rejected.read(store, k, parse)

    # ---------------------------------------------------------------- liveness
    def alive(self, store: Any, replica: int, incarnation: str | None = None) -> bool:
        """Whether the heartbeat of ``replica`` (in ``incarnation``, if given) grew recently."""
        now = time.monotonic()
        k = key("hb", replica)
        beat = self.read(store, k, lambda raw: parse_beat(self.codec, raw, replica))
        seen = self._beats.get(replica)
        if beat is not None:
            if seen is None or (seen[0] != beat.incarnation
                                and (replica, beat.incarnation) not in self._superseded):
                if seen is not None:   # a new incarnation: the old one never beats again
                    self._superseded.add((replica, seen[0]))
                self._beats[replica] = (beat.incarnation, beat.beat, now)
            elif seen[0] == beat.incarnation and beat.beat > seen[1]:
                self._beats[replica] = (beat.incarnation, beat.beat, now)
            elif seen[0] != beat.incarnation or beat.beat < seen[1]:   # replayed
                self.rejected(k, Rejected(f"stale heartbeat {beat.incarnation}:{beat.beat} (seen "
                                          f"{seen[0]}:{seen[1]})", replica, authentic=True))
        seen = self._beats.get(replica)
        return (seen is not None and now - seen[2] < HEARTBEAT_TIMEOUT_S
                and (incarnation is None or seen[0] == incarnation))

    def asked(self, replica: int, incarnation: str) -> None:
        """Its request is a sign of life: its beats may not be here yet (a new incarnation's,
        or one back from a partition whose last beat is stale)."""
        seen = self._beats.get(replica)
        counter = seen[1] if seen is not None and seen[0] == incarnation else -1
        self._beats[replica] = (incarnation, counter, time.monotonic())
        self._superseded.discard((replica, incarnation))
