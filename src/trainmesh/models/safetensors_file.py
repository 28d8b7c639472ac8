"""A safetensors file read by its header and by the byte ranges of the slices asked for.

safetensors' own ``safe_open`` maps the whole file at once: a shard larger than what the
process may map (its address-space limit, or a host's memory and swap under strict
overcommit) cannot even be opened ("Cannot allocate memory"). Here the header is parsed
directly (8 bytes of little-endian length, then JSON: per tensor its dtype, shape and byte
range), with the checks safetensors makes (every range within the file, of its tensor's size,
no two overlapping), and a slice ``full[index]`` maps only the rows of the tensor it spans
(along the first dimension; a column shard spans them all), read-only, copies out the slice
and lets the map go. So what opening a file costs grows with its header, and reading a slice
with the tensor rows it spans, never with the file. Imports torch only.
"""
from __future__ import annotations

import json
import mmap
import struct
import warnings
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
        """``full[index]`` of tensor ``key`` (a tuple of slices and integers, or ``...``), a copy;
        only the rows of the first dimension it spans are mapped."""
        entry = self.header[key]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        index = (index,) if not isinstance(index, tuple) else index
        whole = not shape or not index or index[0] is Ellipsis
        rows = None if whole else range(shape[0])[index[0]]
        if isinstance(rows, int):
            lo, hi, rest = rows, rows + 1, (0, *index[1:])
        elif rows is not None and rows.step == 1:
            lo, hi, rest = rows.start, max(rows.stop, rows.start), (slice(None), *index[1:])
        else:                                       # a 0-d tensor, a strided row slice: whole
            lo, hi, rest = 0, shape[0] if shape else 1, index
        row = prod(shape[1:]) * dtype.itemsize
        begin = self.start + entry["data_offsets"][0] + lo * row
        count = (hi - lo) * row if shape else dtype.itemsize
        if count == 0:                              # no bytes to map (an empty tensor or range)
            return torch.empty((hi - lo, *shape[1:]), dtype=dtype)[rest]
        aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), begin - aligned + count, access=mmap.ACCESS_READ,
                               offset=aligned)
        with warnings.catch_warnings():             # read-only: the copy below is what is kept
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=count, offset=begin - aligned)
        part = flat.view(dtype).view((hi - lo, *shape[1:]) if shape else ())
        out = part[rest].clone()
        del flat, part
        mapped.close()
        return out


class _Slice:
    def __init__(self, file: SafetensorsFile, key: str) -> None:
        self.file, self.key = file, key

    def get_shape(self) -> list[int]:
        return list(self.file.header[self.key]["shape"])

    def __getitem__(self, index: tuple | type(Ellipsis)) -> torch.Tensor:
        return self.file.read(self.key, index)
