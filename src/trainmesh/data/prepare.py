"""Progress of long data preparation: training a tokenizer, encoding text, building a token cache.

The data layer says what it does and how far it got; whoever called it decides what to show.
A caller passes ``progress``, a :data:`Begin`: called with what is being done, the total (bytes
of text, None where unknown before the pass) and the cache being written, it returns a context
manager whose :class:`Work` is told each step (``trainmesh train``'s launcher passes
:func:`trainmesh.observe.progress.preparing`: a bar on a terminal, a line now and then
otherwise). Without one, nothing is shown (:func:`quiet`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol


class Work(Protocol):
    """One preparation under way."""

    def advance(self, n: int) -> None:
        """``n`` more bytes of text done."""

    def phase(self, text: str) -> None:
        """What it does now, where the bytes no longer tell (e.g. computing the merges)."""


Begin = Callable[..., AbstractContextManager[Work]]
"""``begin(what, total=bytes or None, cache=path)``: a context manager around the work."""


class _Silent:
    def advance(self, n: int) -> None:
        pass

    def phase(self, text: str) -> None:
        pass


@contextlib.contextmanager
def quiet(what: str, *, total: int | None = None, cache: Path | str | None = None) -> Iterator[Work]:  # noqa: ARG001
    """A :data:`Begin` that shows nothing."""
    yield _Silent()


class Counted:
    """``pieces`` as they are, each one's UTF-8 bytes told to ``work`` once it was used and
    summed in :attr:`bytes`; ``then``: the phase to announce once they are all used."""

    def __init__(self, pieces: Iterable[str], work: Work, *, then: str | None = None) -> None:
        self.pieces, self.work, self.then = pieces, work, then
        self.bytes = 0

    def __iter__(self) -> Iterator[str]:
        for piece in self.pieces:
            yield piece
            n = len(piece.encode("utf-8", "replace"))
            self.bytes += n
            self.work.advance(n)
        if self.then is not None:
            self.work.phase(self.then)
