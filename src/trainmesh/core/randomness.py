"""Randomness that does not depend on the layout: a counter-based generator keyed by position.

Dropout and router noise drawn from a rank's own generator depend on how the batch, the
sequence, the heads and the features are split: one process draws other numbers for the same
element than a rank holding it under dp, tp, cp or pp. Here each element's number is a hash of
``(seed, step, site, its global indices)`` (:func:`uniform`): the run's seed, the optimizer
step, the call site (a hash of the module's qualified name in the single-process model) and
the element's row in the global batch, its token position in the sequence, its head, feature
or expert. Any split of a tensor draws the pieces of the whole tensor's numbers, on CPU and
CUDA alike (plain int64 tensor ops, no state).

The hash is Wellons' ``lowbias32`` 32-bit mixer folded over the key words; its multiplications
are done in 16-bit halves so every intermediate stays below ``2**49`` in int64 (no overflow).
A number is the top 24 bits over ``2**24``: uniform on ``[0, 1)``, exact in float32.

Where each element sits is :class:`Draws`, which the engine sets per microbatch with
:func:`drawing` (a context manager it owns; :func:`current` reads it): the seed and step, the
global row of the microbatch's first row, the sequence's global positions (context
parallelism's zigzag chunks), the tensor-parallel rank (heads and features it holds; sequence
parallelism's chunk of the tokens). Imports nothing of trainmesh.
"""
from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Iterator

import torch

_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``x`` in ``[0, 2**32)``, every intermediate below ``2**49``."""
    lo = x * (c & 0xFFFF)                                  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16                  # < 2**32
    return (lo + hi) & _MASK


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32: a bijection of 32-bit words with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def site_of(name: str) -> int:
    """The 32-bit site key of a module's qualified name in the single-process model."""
    return zlib.crc32(name.encode())


def uniform(seed: int, step: int, site: int, *indices: torch.Tensor) -> torch.Tensor:
    """Numbers uniform on ``[0, 1)`` (float32), one per element of the broadcast of
    ``indices`` (int64 tensors, each below ``2**32``), a function of nothing else than
    ``(seed, step, site)`` and the element's indices."""
    device = indices[0].device if indices else None
    h = torch.tensor(0, dtype=torch.int64, device=device)
    for word in (seed & _MASK, (seed >> 32) & _MASK, step & _MASK, site & _MASK):
        h = _mix(h ^ word)
    for index in indices:
        h = _mix(h ^ (index.to(torch.int64) & _MASK))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def keep_mask(u: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout's scaled keep mask from uniform numbers: ``1/(1-p)`` where ``u >= p``, else 0."""
    return (u >= p).to(torch.float32) * (1.0 / (1.0 - p))


@dataclasses.dataclass(frozen=True)
class Draws:
    """Where this rank's elements sit in the single-process computation, for one microbatch."""

    seed: int
    """The run's seed."""
    step: int
    """Optimizer steps taken before this one."""
    row0: int
    """Global row (in the step's global batch) of the microbatch's first row."""
    rows: int
    """Rows of the microbatch on this rank."""
    positions: torch.Tensor
    """(s_local,) global positions of the rank's tokens of each sequence (cp: zigzag chunks)."""
    tp_index: int = 0
    tp: int = 1
    sequence_parallel: bool = False
    """Tensor parallelism: this rank's index, the degree and whether it splits the sequence
    between its regions (each rank a contiguous chunk of the rank's tokens)."""

    def row_ids(self, n: int | None = None) -> torch.Tensor:
        """(n,) global rows of the microbatch's rows."""
        n = self.rows if n is None else n
        return torch.arange(self.row0, self.row0 + n, device=self.positions.device)

    def tokens(self, n: int) -> torch.Tensor:
        """(n,) global positions of the ``n`` tokens a tensor holds of each sequence: all of the
        rank's, or its sequence-parallel chunk of them."""
        whole = self.positions.shape[0]
        if n == whole:
            return self.positions
        if self.sequence_parallel and n * self.tp == whole:
            return self.positions[self.tp_index * n:(self.tp_index + 1) * n]
        raise RuntimeError(f"a tensor of {n} tokens per sequence where the rank holds {whole}"
                           f"{f' (or {whole // self.tp} per tp rank)' if self.sequence_parallel else ''}")

    def split(self, n: int, whole: int) -> torch.Tensor:
        """(n,) global indices of the ``n`` of ``whole`` heads or features a tensor holds: all of
        them, or this tp rank's contiguous share."""
        device = self.positions.device
        if n == whole:
            return torch.arange(n, device=device)
        if n * self.tp == whole:
            return torch.arange(self.tp_index * n, (self.tp_index + 1) * n, device=device)
        raise RuntimeError(f"{n} of {whole} heads or features on tensor-parallel rank "
                           f"{self.tp_index} of {self.tp}")

    def uniform(self, site: int, *indices: torch.Tensor) -> torch.Tensor:
        """:func:`uniform` at this step."""
        return uniform(self.seed, self.step, site, *indices)

    def hidden_uniform(self, site: int, shape: torch.Size, width: int) -> torch.Tensor:
        """Numbers for a (b, s, f) activation or its (b·s, f) flattening, keyed by row, token
        and feature (``width``: the activation's full feature count)."""
        f = shape[-1]
        if len(shape) == 3:
            b, s = shape[0], shape[1]
        elif len(shape) == 2:
            b = self.rows
            s = shape[0] // b
        else:
            raise RuntimeError(f"an activation of shape {tuple(shape)}: valid (batch, seq, "
                               "features) or (batch·seq, features)")
        rows = self.row_ids(b).view(b, 1, 1)
        tokens = self.tokens(s).view(1, s, 1)
        feats = self.split(f, width).view(1, 1, f)
        return self.uniform(site, rows, tokens, feats).reshape(shape)


class _Current:
    """The engine's :class:`Draws` of the microbatch being computed: a plain attribute, not a
    context variable, so autograd's device threads (a recomputed forward in the backward)
    see it too."""

    draws: Draws | None = None


def current() -> Draws | None:
    """The :class:`Draws` of the microbatch being computed, or None outside the engine."""
    return _Current.draws


@contextlib.contextmanager
def drawing(draws: Draws | None) -> Iterator[None]:
    """Within: :func:`current` is ``draws`` (the engine's, around each microbatch's forward
    and backward)."""
    before, _Current.draws = _Current.draws, draws
    try:
        yield
    finally:
        _Current.draws = before
