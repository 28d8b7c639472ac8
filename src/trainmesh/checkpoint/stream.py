"""Whole weights tensor by tensor: a lazy mapping over a checkpoint, and a safetensors file
written one tensor at a time (consolidation and Hugging Face export in bounded memory).

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, byte range) and the tensors' bytes. Shapes and dtypes are known from the checkpoint's
metadata, so the header is written first and each tensor is read, written and dropped in turn.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}


class LazyWeights(Mapping):
    """name -> whole tensor, read from the checkpoint when asked (nothing kept)."""

    def __init__(self, reader: Any, keys: dict[str, str]) -> None:
        self.reader, self.keys_ = reader, keys

    @staticmethod
    def of(weights: dict[str, torch.Tensor]) -> "LazyWeights":
        """Weights already in memory (a checkpoint of the first format)."""
        return LazyWeights(None, {k: k for k in weights})._with(weights)

    def _with(self, weights: dict[str, torch.Tensor]) -> "LazyWeights":
        self._held = weights
        return self

    def __getitem__(self, name: str) -> torch.Tensor:
        if getattr(self, "_held", None) is not None:
            return self._held[name]
        return self.reader.get(self.keys_[name])

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.keys_))

    def __len__(self) -> int:
        return len(self.keys_)

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of ``name`` without reading it."""
        if getattr(self, "_held", None) is not None:
            t = self._held[name]
            return t.dtype, tuple(t.shape)
        md = self.reader.meta(self.keys_[name])
        return md.properties.dtype, tuple(md.size)


def write_safetensors(path: Path, weights: LazyWeights | Mapping[str, Callable[[], torch.Tensor]],
                      *, metadata: dict[str, str] | None = None,
                      specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None) -> None:
    """Write ``weights`` as a safetensors file, one tensor in memory at a time. ``weights``: a
    :class:`LazyWeights`, or name -> a function making the tensor with ``specs`` giving each
    one's (dtype, shape)."""
    names = sorted(weights)
    specs = specs or {n: weights.spec(n) for n in names}   # type: ignore[union-attr]
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        dtype, shape = specs[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                     # the data starts 8-aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            value = weights[name]
            t = value() if callable(value) else value
            dtype, shape = specs[name]
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)} where {dtype} {shape} was announced")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            del t
