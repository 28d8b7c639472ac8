"""Which (query, key) blocks of a zigzag-split sequence are computed, and how, when the sequence
holds packed documents (attention causal within a document, never across one) and/or a
sliding window.

The documents of a row: ``document_ids(position_ids)`` = ``cumsum(position_ids == 0)`` along
the row (positions restart at 0 at the first token of every document and every piece of one).
Under cp each rank holds only its zigzag share of ``position_ids``; :func:`gather_documents`
all-gathers those shares over the CP group (ints, ``b·s`` of them: negligible beside the K/V)
and rebuilds the whole row's document ids, so every rank knows the document of every position
before any K/V block moves, and every rank computes the same plan. Every layer of a forward is
handed the same ``position_ids``: :class:`GatheredDocuments`, shared by a model's attention
layers, gathers them once per forward and hands the result to every layer; it keeps the plan
(below) of that result too, made at the first layer of each (sliding window, chunk size) and
handed to the others and to a recomputation (the plan is pure: a function of the document ids,
the rank, cp, the chunk size and the window).

The plan (:func:`plan_pair`) of one (query chunk, key chunk) pair is a list of
:class:`Piece`: for each document present in both chunks, the query rows and key columns of
that document (contiguous: document ids never decrease along a row), trimmed to the rows and
columns that a causal mask (and the window) leave any pair in. A piece is

- ``full``: every pair attended (a key range wholly before the query range): no mask;
- ``causal``: the same positions on both sides: the kernels' causal (diagonal) mask;
- ``mask``: an explicit boolean mask (the sliding window cutting through the piece).

A pair whose chunks share no document has no piece: skipped, never computed, like the causal
future blocks. Without documents a pair is one piece over the whole chunk (today's ring). When
the rows of a micro-batch are packed differently, each row gets its own pieces.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .partition import chunk_ids, unshard_sequence


@dataclass(frozen=True)
class Piece:
    """One computed sub-block: ``rows`` of the micro-batch (``slice(None)``: all), query
    positions ``q`` and key positions ``k`` within their chunks, and how it is masked."""

    rows: slice
    q: slice
    k: slice
    kind: str                          # "full", "causal" or "mask"
    mask: torch.Tensor | None = None   # (nq, nk) bool, True = attended; kind "mask" only

    @property
    def computed_pairs(self) -> int:
        """Query-key pairs the kernel computes for one row (a causal piece: its triangle)."""
        nq, nk = self.q.stop - self.q.start, self.k.stop - self.k.start
        return nq * (nq + 1) // 2 if self.kind == "causal" else nq * nk

    @property
    def attended_pairs(self) -> int:
        """Query-key pairs the mask keeps, for one row."""
        if self.kind == "mask":
            return int(self.mask.sum())  # type: ignore[union-attr]
        return self.computed_pairs


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) position ids of whole rows -> (b, s) document index of each token (from 1)."""
    return torch.cumsum(position_ids == 0, dim=-1)


def gather_documents(position_ids: torch.Tensor, ring) -> torch.Tensor:
    """Every rank's zigzag share (b, 2c) of ``position_ids`` gathered over the CP ``ring``
    -> the whole rows' document ids (b, s), the same on every rank."""
    every = ring.all_gather(position_ids.to(torch.int64).contiguous())     # (cp, b, 2c)
    return document_ids(unshard_sequence(list(every.unbind(0)), dim=1))


class GatheredDocuments:
    """The document ids of the ``position_ids`` the layers of one forward are handed, gathered
    over the CP ``ring`` once: the first layer handed a ``position_ids`` tensor gathers it
    (:func:`gather_documents`); every later call with the same tensor object, unmodified (the
    forward's other layers, a recomputation in backward), gets that result without a
    collective. Held by the model's context-parallel attention (one per model and ring).

    An entry is keyed by the tensor itself: a weak reference compared by identity (``ref() is
    position_ids``, never an id, which a freed tensor's successor may reuse) and its version
    counter (written in place, it is another batch). Whether a call gathers depends only on
    which tensor objects the program hands over, never on timing or garbage collection: the
    tensor looked up is alive (the caller holds it), so is its entry if it has one, and a dead
    entry matches nothing. The ranks of a cp group run the same program on their shares, so
    they gather at the same calls, in the same order. An entry lasts while its tensor does
    (a step's microbatches), and goes at the next gather after that."""

    def __init__(self, ring) -> None:
        self.ring = ring
        self._held: list[tuple[weakref.ref, int, torch.Tensor, dict]] = []   # (ids, version, docs, plans)
        self._plain: dict[tuple, dict] = {}      # the plans without documents, by (rank, cp, c, window)

    def __call__(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(b, 2c) this rank's share of ``position_ids`` -> (b, s) the whole rows' document
        ids on the CPU, the same on every rank (module docstring)."""
        if position_ids.is_inference():                   # no version counter: not kept
            return gather_documents(position_ids, self.ring).to("cpu")
        version = position_ids._version
        for ref, seen, docs, _ in self._held:
            if ref() is position_ids and seen == version:
                return docs
        docs = gather_documents(position_ids, self.ring).to("cpu")
        self._held = [e for e in self._held if (t := e[0]()) is not None and t is not position_ids]
        self._held.append((weakref.ref(position_ids), version, docs, {}))
        return docs

    def plan(self, docs: torch.Tensor | None, rank: int, cp: int, c: int,
             window: int | None = None) -> dict[tuple[int, int, int], list[Piece]]:
        """:func:`plan_of` ``docs``, made once per (rank, cp, c, window) for a result of this
        object (kept with its entry, going with it) or for None (no documents: kept here, a
        few sequence lengths and windows); other ``docs`` are planned anew at each call."""
        key = (rank, cp, c, window)
        if docs is None:
            plans = self._plain
            if key not in plans and len(plans) >= 16:   # lengths changing every batch: bounded
                plans.clear()
        else:
            plans = next((e[3] for e in self._held if e[2] is docs), None)
            if plans is None:
                return plan_of(docs, rank, cp, c, window)
        if key not in plans:
            plans[key] = plan_of(docs, rank, cp, c, window)
        return plans[key]

    def __len__(self) -> int:
        """The entries held (a freed tensor's until the next gather)."""
        return len(self._held)


def _trim(i0: int, i1: int, j0: int, j1: int, window: int | None):
    """Query range [i0, i1) and key range [j0, j1) (global positions) cut to the rows and
    columns with any attended pair (j <= i, i - j < window); None when there is none."""
    i0, j1 = max(i0, j0), min(j1, i1)
    if window is not None:
        i1, j0 = min(i1, j1 - 1 + window), max(j0, i0 - window + 1)
    if i0 >= i1 or j0 >= j1:
        return None
    return i0, i1, j0, j1


def _kind(i0: int, i1: int, j0: int, j1: int, window: int | None):
    """How the rectangle (already trimmed) is masked: (kind, mask or None)."""
    cut = window is not None and (i1 - 1) - j0 >= window
    if not cut and i0 == j0 and i1 == j1:
        return "causal", None
    if not cut and j1 - 1 <= i0:
        return "full", None
    i = torch.arange(i0, i1).unsqueeze(1)
    j = torch.arange(j0, j1).unsqueeze(0)
    mask = j <= i
    if window is not None:
        mask &= (i - j) < window
    return "mask", mask


def _runs(docs: torch.Tensor) -> list[tuple[int, int, int]]:
    """(document, start, stop) of each run of equal ids in a 1-D tensor."""
    values, counts = torch.unique_consecutive(docs, return_counts=True)
    out, start = [], 0
    for d, n in zip(values.tolist(), counts.tolist()):
        out.append((d, start, start + n))
        start += n
    return out


def _row_pieces(qdocs, kdocs, qc: int, kc: int, c: int, window: int | None) -> list[tuple]:
    """Pieces (q0, q1, k0, k1, kind, mask) of one row for query chunk ``qc`` x key chunk ``kc``."""
    out = []
    if qdocs is None:
        pairs = [(0, c, 0, c)]
    else:
        kruns = {d: (lo, hi) for d, lo, hi in _runs(kdocs)}
        pairs = [(lo, hi, *kruns[d]) for d, lo, hi in _runs(qdocs) if d in kruns]
    for qlo, qhi, klo, khi in pairs:
        cut = _trim(qc * c + qlo, qc * c + qhi, kc * c + klo, kc * c + khi, window)
        if cut is None:
            continue
        i0, i1, j0, j1 = cut
        kind, mask = _kind(i0, i1, j0, j1, window)
        out.append((i0 - qc * c, i1 - qc * c, j0 - kc * c, j1 - kc * c, kind, mask))
    return out


def plan_pair(docs: torch.Tensor | None, qc: int, kc: int, c: int,
              window: int | None = None) -> list[Piece]:
    """The pieces of query chunk ``qc`` against key chunk ``kc`` (chunks of ``c`` tokens);
    ``docs``: (b, s) document ids on the CPU (None: one document per row); ``window``: keys
    at most ``window - 1`` positions back (None: no window)."""
    if kc > qc:
        return []
    if docs is None:
        rows = [_row_pieces(None, None, qc, kc, c, window)]
    else:
        q, k = docs[:, qc * c:(qc + 1) * c], docs[:, kc * c:(kc + 1) * c]
        if bool((docs == docs[:1]).all()):
            rows = [_row_pieces(q[0], k[0], qc, kc, c, window)]
        else:
            rows = [_row_pieces(q[r], k[r], qc, kc, c, window) for r in range(docs.shape[0])]
    every = slice(None)
    return [Piece(every if len(rows) == 1 else slice(r, r + 1), slice(q0, q1), slice(k0, k1),
                  kind, mask)
            for r, pieces in enumerate(rows) for q0, q1, k0, k1, kind, mask in pieces]


def plan(docs: torch.Tensor | None, rank: int, cp: int, c: int, window: int | None = None
         ) -> dict[tuple[int, int, int], list[Piece]]:
    """{(query chunk slot a, source rank, key chunk slot b): pieces} of CP rank ``rank``'s two
    query chunks against every rank's two key chunks (pairs without a piece left out)."""
    out = {}
    for src in range(cp):
        for a, qc in enumerate(chunk_ids(rank, cp)):
            for b, kc in enumerate(chunk_ids(src, cp)):
                pieces = plan_pair(docs, qc, kc, c, window)
                if pieces:
                    out[(a, src, b)] = pieces
    return out


def plan_of(docs: torch.Tensor | None, rank: int, cp: int, c: int, window: int | None = None
            ) -> dict[tuple[int, int, int], list[Piece]]:
    """:func:`plan` of ``docs`` as ring attention is handed them ((b or 1, s) document ids, or
    None): on the CPU as int64, and one document per row planned as none (the causal ring)."""
    if docs is not None:
        docs = docs.detach().to("cpu", torch.int64)
        if bool((docs == docs[:, :1]).all()):
            docs = None
    return plan(docs, rank, cp, c, window)


def rank_work(docs: torch.Tensor | None, cp: int, seq_len: int, window: int | None = None,
              rows: int = 1) -> list[dict[str, int]]:
    """Per CP rank: the query-key pairs its blocks compute and attend (summed over ``rows``
    rows when ``docs`` is None, else over the rows of ``docs``) and the blocks it runs: the
    load each rank carries under the zigzag split, from the pairs actually attended."""
    c = seq_len // (2 * cp)
    out = []
    for r in range(cp):
        work = {"computed_pairs": 0, "attended_pairs": 0, "pieces": 0}
        for pieces in plan(docs, r, cp, c, window).values():
            for p in pieces:
                n = (docs.shape[0] if docs is not None else rows) if p.rows == slice(None) else 1
                work["computed_pairs"] += n * p.computed_pairs
                work["attended_pairs"] += n * p.attended_pairs
                work["pieces"] += 1
        out.append(work)
    return out
