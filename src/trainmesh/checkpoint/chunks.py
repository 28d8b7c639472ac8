"""The pieces of a logical tensor one rank holds, as rectangular chunks of the global tensor.

A checkpoint stores every logical tensor (a parameter under its single-process name, with its
full global shape) as chunks at global offsets, the way ``torch.distributed.checkpoint``
(DCP) stores a DTensor or a ShardedTensor. A rank's pieces of a tensor come from two
cuttings, composed here:

* **data parallel (ZeRO)**: a flat range ``[lo, hi)`` of the tensor a rank holds whole along
  DP. In row-major order such a range is a handful of boxes (:func:`flat_boxes`); of a 2-D
  tensor at most three: a partial first row, whole rows, a partial last row.
* **tensor / expert parallel**: the tensor held whole along DP is itself a slice of the global
  one (:class:`GlobalMap`): along ``tp_dim`` the rank's slice of each of the dimension's
  blocks (a fused q|k|v has three), along ``ep_dim`` the rank's run of stacked experts.

:class:`Chunks` holds the result — views into the rank's own tensors, never copies — and speaks
DCP's protocol for objects that are several chunks of one tensor (``__create_write_items__``,
``__create_chunk_list__``), which :class:`ChunkSavePlanner` and :class:`ChunkLoadPlanner`
resolve back to the views.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a rectangular block of a tensor."""


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The boxes covering the row-major elements ``[lo, hi)`` of a tensor of ``shape``, in
    order; each is a contiguous run of the flat tensor."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    boxes: list[Box] = []
    if first == last or lo % inner:   # a partial first row (maybe all there is)
        end = min(hi, (first + 1) * inner)
        boxes += [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo - first * inner, end - first * inner)]
        first += 1
        lo = end
    if lo >= hi:
        return boxes
    whole_end = hi // inner           # rows [first, whole_end) are whole
    if whole_end > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if hi % inner and whole_end * inner >= lo:   # a partial last row
        boxes += [((whole_end, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, hi - whole_end * inner)]
    return boxes


@dataclass(frozen=True)
class Segment:
    """Along one dimension: local indices ``[start, start + length)`` are global ones from ``to``."""

    start: int
    length: int
    to: int


@dataclass(frozen=True)
class GlobalMap:
    """How the tensor a rank holds whole along DP (its *local* tensor) sits in the global one."""

    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    segments: dict[int, tuple[Segment, ...]]
    """dim -> where the local indices of that dimension go (dims not named: the same)."""

    @staticmethod
    def whole(shape: Sequence[int]) -> "GlobalMap":
        return GlobalMap(tuple(shape), tuple(shape), {})

    def place(self, box: Box) -> list[tuple[Box, tuple[int, ...]]]:
        """A box of the local tensor -> [(part of the box, its global offsets)]."""
        out = [(box, tuple(box[0]))]
        for dim, segments in self.segments.items():
            split = []
            for (offs, sizes), goffs in out:
                lo, hi = offs[dim], offs[dim] + sizes[dim]
                for seg in segments:
                    a, b = max(lo, seg.start), min(hi, seg.start + seg.length)
                    if a < b:
                        o, s, g = list(offs), list(sizes), list(goffs)
                        o[dim], s[dim], g[dim] = a, b - a, seg.to + (a - seg.start)
                        split.append(((tuple(o), tuple(s)), tuple(g)))
            out = split
        return out


def tp_ep_map(local_shape: Sequence[int], *, tp_dim: int | None, tp_rank: int, tp: int,
              parts: int | tuple[int, ...] = 1, ep_dim: int | None = None, ep_rank: int = 0,
              ep: int = 1) -> GlobalMap:
    """The :class:`GlobalMap` of a local tensor that is, along ``tp_dim``, rank ``tp_rank``'s
    slice of each block (``parts``: a count of equal blocks or the full block sizes) and,
    along ``ep_dim``, rank ``ep_rank``'s run of ``ep`` equal runs."""
    local = tuple(local_shape)
    shape = list(local)
    segments: dict[int, tuple[Segment, ...]] = {}
    if ep_dim is not None and ep > 1 and local:
        shape[ep_dim] = local[ep_dim] * ep
        segments[ep_dim] = (Segment(0, local[ep_dim], ep_rank * local[ep_dim]),)
    if tp_dim is not None and tp > 1 and local:
        full = local[tp_dim] * tp
        blocks = [full // parts] * parts if isinstance(parts, int) else list(parts)
        segs, start, to = [], 0, 0
        for size in blocks:   # the rank's slice of each block, concatenated locally
            width = size // tp
            segs.append(Segment(start, width, to + tp_rank * width))
            start += width
            to += size
        shape[tp_dim] = full
        segments[tp_dim] = tuple(segs)
    return GlobalMap(local, tuple(shape), segments)


class Chunks:
    """Chunks of one global tensor held by this rank: views at global offsets."""

    def __init__(self, global_shape: Sequence[int], dtype: torch.dtype) -> None:
        self.global_size = torch.Size(global_shape)
        self.dtype = dtype
        self.pieces: dict[tuple[int, ...], torch.Tensor] = {}

    def add(self, offsets: Sequence[int], tensor: torch.Tensor) -> None:
        self.pieces[tuple(offsets)] = tensor

    def add_local(self, gmap: GlobalMap, local: torch.Tensor, box: Box) -> None:
        """Add ``box`` of the local tensor, whose elements are ``local`` (shaped as the box)."""
        for (offs, sizes), goffs in gmap.place(box):
            view = local
            for dim, (o, s) in enumerate(zip(offs, sizes)):
                if s != view.shape[dim]:
                    view = view.narrow(dim, o - box[0][dim], s)
            self.add(goffs, view)

    def size(self) -> torch.Size:
        """The global tensor's shape (DCP checks it against the checkpoint's)."""
        return self.global_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pieces.values())

    # DCP's protocol for an object that is several chunks of one tensor
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offs)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offs), t.shape),
                              properties=props, size=self.global_size))
                for offs, t in self.pieces.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offs), t.shape) for offs, t in self.pieces.items()]

    def at(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[tuple(index.offset or ())]


def _rows(offsets: tuple[int, ...], t: torch.Tensor, cap: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``t`` (at global ``offsets``) cut along its first dimension into runs of at most ``cap``
    bytes (one row at least)."""
    if t.dim() == 0 or t.nbytes <= cap:
        return [(offsets, t)]
    step = max(1, cap // max(1, t[0].nbytes))
    return [((offsets[0] + r, *offsets[1:]), t.narrow(0, r, min(step, t.shape[0] - r)))
            for r in range(0, t.shape[0], step)]


Key = tuple[str, tuple[int, ...] | None]
"""A piece of the state dict: (key, its chunk's global offsets; None: not a chunk)."""


def holdings(state_dict: dict[str, Any]) -> list[tuple[Key, int]]:
    """(piece, its bytes) of every piece of ``state_dict``: what is exchanged to agree who
    writes a piece several ranks hold (:func:`writers`)."""
    out: list[tuple[Key, int]] = []
    for fqn, value in state_dict.items():
        if isinstance(value, Chunks):
            out += [((fqn, offs), t.nbytes) for offs, t in value.pieces.items()]
        else:
            out.append(((fqn, None), value.nbytes if torch.is_tensor(value) else 0))
    return out


def writers(everyone: Sequence[list[tuple[Key, int]]]) -> dict[Key, int]:
    """Which rank writes each piece of every rank's :func:`holdings`: as DCP's deduplication
    of save plans chooses, the holder that has the fewest bytes to write so far, in order."""
    holders: dict[Key, list[int]] = {}
    size: dict[Key, int] = {}
    for rank, held in enumerate(everyone):
        for key, n in held:
            holders.setdefault(key, []).append(rank)
            size[key] = n
    load = [0] * len(everyone)
    out = {}
    for key, ranks in holders.items():
        out[key] = min(ranks, key=lambda r: load[r])
        load[out[key]] += size[key] or 1
    return out


def own_pieces(state_dict: dict[str, Any], mine: set[Key], parts: int) -> tuple[dict[str, Any], int]:
    """(what this rank writes of ``state_dict``: the pieces in ``mine``, each chunk cut along
    its first dimension into runs of at most ``cap`` bytes; ``cap``, 1/``parts`` of the bytes
    it writes, rounded up): the one staging buffer a save copies chunks through."""
    total = sum(n for key, n in holdings(state_dict) if key in mine)
    cap = -(-total // parts)
    out: dict[str, Any] = {}
    for fqn, value in state_dict.items():
        if not isinstance(value, Chunks):
            if (fqn, None) in mine:
                out[fqn] = value
            continue
        chunks = Chunks(value.global_size, value.dtype)
        for offs, t in value.pieces.items():
            if (fqn, offs) in mine:
                for at, piece in _rows(offs, t, cap):
                    chunks.add(at, piece)
        if chunks.pieces:
            out[fqn] = chunks
    return out, cap


def _lookup(state_dict: dict, index: MetadataIndex) -> object:
    obj = state_dict[index.fqn]
    return obj.at(index) if isinstance(obj, Chunks) else obj


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (pieces held by several ranks are written once, balanced over
    them) resolving :class:`Chunks` to their views."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> object:
        return _lookup(self.state_dict, index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (each chunk read from the saved chunks overlapping it)
    resolving :class:`Chunks` to their views."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # the default's first pass over the values knows tensors only (it would drop Chunks)
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        """A non-tensor value (an optimizer's number) read with the weights-only unpickler."""
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def tensor_meta(md: object) -> TensorStorageMetadata | None:
    return md if isinstance(md, TensorStorageMetadata) else None
