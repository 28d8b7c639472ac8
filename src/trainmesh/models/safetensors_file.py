"""A safetensors file read by its header and by the byte ranges of the slices asked for.

safetensors' own ``safe_open`` maps the whole file at once: a shard larger than what the
process may map (its address-space limit, or a host's memory and swap under strict
overcommit) cannot even be opened ("Cannot allocate memory"). Here the header is parsed
directly (8 bytes of little-endian length, then JSON: per tensor its dtype, shape and byte
range), with the checks safetensors makes (every range within the file, of its tensor's size,
no two overlapping), and a slice ``full[index]`` reads from the file only the bytes of the box
it spans (per dimension, from its first index to its last), straight into the tensor
returned, one read per contiguous run of them: a range of rows is one run, a range of columns
one run per row (a strided or integer index reads its bounding box, then takes its elements).
So what opening a file costs grows with its header, and reading a slice with the box it spans,
never with the tensor or the file. Imports torch only.
"""
from __future__ import annotations

import json
import os
import struct
from itertools import product
from math import prod
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
          **({"F8_E8M0": torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else {})}
MAX_HEADER = 100 << 20
"""safetensors' own bound on a header's size (100 MB)."""


class SafetensorsError(ValueError):
    """A file that is not safetensors, or whose header does not fit it."""


def read_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """(tensor name -> {dtype, shape, data_offsets}, where the data starts) of safetensors file
    ``path``, checked against the file's size; SafetensorsError saying what is wrong."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{size} bytes: shorter than a header's length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"header length {n} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    header.pop("__metadata__", None)
    start, spans = 8 + n, []
    for name, entry in header.items():
        try:
            dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
            begin, end = entry["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise SafetensorsError(f"{name}: not a tensor entry (dtype, shape, data_offsets): "
                                   f"{entry}")
        if end - begin != prod(shape) * dtype.itemsize or start + end > size:
            raise SafetensorsError(f"{name}: bytes {begin}..{end} do not hold {entry['dtype']} "
                                   f"{shape} within the file's {size - start} bytes of data")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise SafetensorsError(f"{a} and {b} overlap")
    return header, start


class SafetensorsFile:
    """``safe_open(path, framework="pt")``'s reading methods (``keys``, ``get_slice(k).get_shape()``
    and ``[index]``, ``get_tensor``) without mapping the whole file."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.header, self.start = read_header(path)

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[...]

    def read(self, key: str, index: tuple | type(Ellipsis)) -> torch.Tensor:
        """``full[index]`` of tensor ``key`` (a tuple of slices and integers, or ``...``), a copy:
        only the bytes of the box it spans are read, one read per contiguous run (a row range:
        one run; a column range: one per row; a strided or integer index reads its bounding box
        and is applied to it)."""
        entry = self.header[key]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        box, post = box_of(shape, index)
        out = torch.empty([hi - lo for lo, hi in box], dtype=dtype)
        if out.numel() == 0:                        # no bytes to read (an empty tensor or range)
            return out[post]
        strides = [prod(shape[d + 1:]) * dtype.itemsize for d in range(len(shape))]
        k = max((d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])), default=-1)
        run = (box[k][1] - box[k][0]) * strides[k] if k >= 0 else out.numel() * dtype.itemsize
        base = self.start + entry["data_offsets"][0] + sum(lo * st for (lo, _), st
                                                           in zip(box, strides))
        buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(self.path, "rb", buffering=0) as f:
            for n, at in enumerate(product(*(range(hi - lo) for lo, hi in box[:max(k, 0)]))):
                offset = base + sum(i * st for i, st in zip(at, strides))
                if _read_at(f.fileno(), buffer[n * run:(n + 1) * run], offset) != run:
                    raise SafetensorsError(f"{self.path}: {key}: the file ended within its bytes")
        return out if post == () else out[post].clone()


def _read_at(fd: int, buffer: memoryview, offset: int) -> int:
    """Read ``len(buffer)`` bytes of file ``fd`` at ``offset`` into ``buffer`` (every read of a
    tensor's bytes goes through here); the count read, short only at the end of the file. A
    read may return less than asked (Linux: at most about 2 GiB a call): read on."""
    done = 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def box_of(shape: tuple[int, ...], index: tuple | type(Ellipsis)
           ) -> tuple[list[tuple[int, int]], tuple]:
    """(per dimension the range ``index`` spans, the index into that box giving
    ``full[index]``: ``()`` when the box is it)."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = (*index[:at], *[slice(None)] * (len(shape) - len(index) + 1), *index[at + 1:])
    if len(index) > len(shape):
        raise IndexError(f"{len(index)} indices for a tensor of shape {list(shape)}")
    box, post = [], []
    for n, i in zip(shape, (*index, *[slice(None)] * (len(shape) - len(index)))):
        span = range(n)[i]                          # IndexError as torch's where out of range
        if isinstance(span, int):
            box.append((span, span + 1))
            post.append(0)
        elif len(span) == 0 or span.step < 0:       # empty; a negative step: torch refuses it
            box.append((span.start, span.start) if len(span) == 0 else (span[-1], span[0] + 1))
            post.append(slice(None, None, span.step) if len(span) else slice(None))
        else:
            box.append((span[0], span[-1] + 1))
            post.append(slice(None, None, span.step))
    trivial = all(p == slice(None, None, 1) or p == slice(None) for p in post)
    return box, () if trivial else tuple(post)


class _Slice:
    def __init__(self, file: SafetensorsFile, key: str) -> None:
        self.file, self.key = file, key

    def get_shape(self) -> list[int]:
        return list(self.file.header[self.key]["shape"])

    def __getitem__(self, index: tuple | type(Ellipsis)) -> torch.Tensor:
        return self.file.read(self.key, index)
