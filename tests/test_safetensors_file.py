"""A model directory's safetensors files are read by their header and by the byte ranges of the
slices asked for, so a shard larger than what the process may map is checked and read.

``SafetensorsFile`` gives what ``safe_open`` gives (every dtype a hub model uses, the slices
the engine asks for: rows, columns, an integer, a strided step, ``...``, an empty range) and
``read_header`` refuses what safetensors refuses (a header longer than the file, a tensor's
bytes outside the file or of another size, two tensors overlapping).

The shard here is a sparse 64 GiB file (``truncate``: its header real, one (16384, 1048576)
float32 tensor of zeros and a small one holding 0..5 after it), opened in a process of its own
(forked from the test zygote) that may map at most 4 GiB more than it maps at its start
(``RLIMIT_AS``; a host with less memory and swap than
the shard, under strict overcommit, refuses the whole-file map alike): the preflight's header
check passes, the small tensor reads as written and two rows of the large one as zeros (the
rows' 8 MiB read, not the file).

A checkpoint of the first format (checkpoint/legacy.py) is read through it too.

A slice reads the bytes of the box it spans and nothing else: one read per contiguous run
(rows: one; columns: one per row), a strided or integer index its bounding box (what a hub
model's stacked experts read: tests/test_hf_expert_rows.py).

Planted bugs this module catches (each seen failing with an assertion, the child's error in
it): a slice read as the rows it spans, whole (as the map of those rows did), fails
test_a_slice_reads_the_bytes_of_its_box with "AssertionError: ((slice(None, None, None),
slice(2, 5, None)), [840]) assert 840 == (8 * 45)"; one read taken for a whole run (not read
on) fails test_a_read_returning_less_than_asked_reads_on with "AssertionError: ((Ellipsis,),
SafetensorsError('.../t.safetensors: a: the file ended within its bytes'))"; the header check
through safetensors' ``safe_open`` (as before) fails
test_a_shard_larger_than_the_address_space_is_read with "ConfigError: --model-dir: cannot read
.../model-00001-of-00001.safetensors as safetensors: Cannot allocate memory (os error 12)"; the
reads through ``safe_open`` with "MemoryError: Cannot allocate memory (os error 12)"; the first
checkpoint format's reader through ``safe_open`` (as before) fails
test_a_checkpoint_of_the_first_format_reads_each_tensor_by_its_bytes with "AssertionError:
('param/blocks.0.attn.k.bias', []) assert 0 == (8 * 4)".
"""
from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from trainmesh.models.safetensors_file import SafetensorsError, SafetensorsFile, read_header

ROWS, COLS = 1 << 14, 1 << 20          # float32: 64 GiB, a row 4 MiB
HEADROOM = 4 << 30
"""The address space the reading process may map beyond what it maps at the start: two 4 MiB
rows' maps and copies, the header, Python's and torch's allocations; the shard is 16 x that."""


def _write(path, entries: dict, data: dict[int, bytes], size: int) -> None:
    """A safetensors file of header ``entries``, ``data`` (offset in the data -> bytes) written,
    the rest a hole, ``size`` bytes of data."""
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for offset, raw in data.items():
            f.seek(8 + len(header) + offset)
            f.write(raw)
        f.truncate(8 + len(header) + size)


INDICES = [(slice(1, 3),), (slice(None), slice(2, 5)), (2,), (slice(0, 5, 2), slice(1, 2)),
           (..., slice(0, 1)), (slice(1, 4), 3, slice(0, 2)), (slice(3, 3),), (-1, slice(1, 7, 3)),
           (slice(None), slice(None), slice(1, 2)), (slice(2, 4), slice(-3, None)), ()]
"""Every index kind a rank may ask for, of a (5, 7, 3) tensor (and (4, 6))."""


def test_slices_equal_safe_opens(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    torch.manual_seed(0)
    tensors = {"a": torch.randn(5, 7, 3), "b": torch.randn(9).to(torch.bfloat16),
               "c": torch.tensor(3.5, dtype=torch.float64), "d": torch.randint(0, 99, (4, 6)),
               "e": torch.zeros(0, 3, dtype=torch.float16), "f": torch.rand(3) > 0.5,
               "g": torch.randn(4).to(torch.float8_e4m3fn), "h": torch.arange(6).to(torch.uint32)}
    save_file(tensors, tmp_path / "t.safetensors")
    path = tmp_path / "t.safetensors"
    ref, got = safe_open(str(path), framework="pt"), SafetensorsFile(path)
    assert sorted(got.keys()) == sorted(ref.keys())
    for key, want in tensors.items():
        assert got.get_slice(key).get_shape() == ref.get_slice(key).get_shape(), key
        value = got.get_tensor(key)
        as_bytes = [t.reshape(-1).view(torch.uint8) for t in (value, want)]
        assert value.dtype == want.dtype and torch.equal(*as_bytes), key
    for index in INDICES:
        assert torch.equal(got.get_slice("a")[index], tensors["a"][index]), index
        assert torch.equal(got.get_slice("d")[index[:2]], tensors["d"][index[:2]]), index


@pytest.mark.parametrize("entries,size,why", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8, "within the file"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, 16, "do not hold"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 16, "overlap"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, 8, "not a tensor entry"),
    ([1, 2], 8, "not a JSON object"),
])
def test_a_header_that_does_not_fit_its_file_is_refused(tmp_path, entries, size, why):
    _write(tmp_path / "x.safetensors", entries, {}, size)
    with pytest.raises(SafetensorsError, match=why):
        read_header(tmp_path / "x.safetensors")
    (tmp_path / "y.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(SafetensorsError, match="does not fit"):
        read_header(tmp_path / "y.safetensors")


def read_huge(argv: list[str]) -> int:
    """In a process of its own: its address space limited to what it maps now plus HEADROOM, the
    preflight's header check of shard ``argv[0]``, then its small tensor and two rows of the
    large one read."""
    import resource

    from trainmesh.models.hf import check_weights_header
    mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + HEADROOM, resource.RLIM_INFINITY))
    check_weights_header(argv[0])
    f = SafetensorsFile(argv[0])
    assert torch.equal(f.get_tensor("small"), torch.arange(6.0).view(2, 3)), f.get_tensor("small")
    rows = f.get_slice("big")[5:7, :]
    assert rows.shape == (2, COLS) and not rows.any(), rows.shape
    print("read", flush=True)
    return 0


def test_a_shard_larger_than_the_address_space_is_read(tmp_path):
    from helpers import run_in_child
    big = ROWS * COLS * 4
    path = tmp_path / "model-00001-of-00001.safetensors"
    _write(path, {"big": {"dtype": "F32", "shape": [ROWS, COLS], "data_offsets": [0, big]},
                  "small": {"dtype": "F32", "shape": [2, 3], "data_offsets": [big, big + 24]}},
           {big: struct.pack("<6f", *range(6))}, big + 24)
    code, stdout, stderr = run_in_child("test_safetensors_file", "read_huge", [str(path)], tmp_path)
    assert code == 0 and "read" in stdout, stderr[-800:]


def test_a_slice_reads_the_bytes_of_its_box(tmp_path, monkeypatch):
    """Each index of INDICES reads from the file the bytes of the box it spans (per dimension
    from its first to its last index) and nothing else, in one read per contiguous run."""
    from safetensors.torch import save_file

    from trainmesh.models import safetensors_file
    full = torch.arange(5 * 7 * 3, dtype=torch.float64).view(5, 7, 3)
    save_file({"a": full}, tmp_path / "t.safetensors")
    reads: list[int] = []
    read_at = safetensors_file._read_at
    monkeypatch.setattr(safetensors_file, "_read_at", lambda fd, buffer, offset:
                        reads.append(len(buffer)) or read_at(fd, buffer, offset))
    f = SafetensorsFile(tmp_path / "t.safetensors")
    runs = {repr(i): n for i, n in [((slice(1, 3),), 1), ((slice(None), slice(2, 5)), 5),
                                    ((slice(1, 4), 3, slice(0, 2)), 3), ((), 1),
                                    ((slice(None), slice(None), slice(1, 2)), 35),
                                    ((slice(3, 3),), 0)]}
    for index in INDICES:
        reads.clear()
        assert torch.equal(f.get_slice("a")[index], full[index]), index
        at = index.index(...) if ... in index else len(index)
        whole = (*index[:at], *[slice(None)] * (3 - len(index) + (at < len(index))),
                 *index[at + 1:])
        spans = [range(n)[i] for n, i in zip(full.shape, whole)]
        spans = [1 if isinstance(r, int) else len(r) and r[-1] - r[0] + 1 for r in spans]
        assert sum(reads) == 8 * math.prod(spans), (index, reads)
        assert len(reads) == runs.get(repr(index), len(reads)), (index, reads)


def test_a_read_returning_less_than_asked_reads_on(tmp_path, monkeypatch):
    """A read may return fewer bytes than asked (Linux: about 2 GiB at most a call, so any
    larger tensor): the rest is read on, here from a read returning 5 bytes at a time."""
    import os

    from safetensors.torch import save_file
    full = torch.randn(7, 9)
    save_file({"a": full}, tmp_path / "t.safetensors")
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset:
                        preadv(fd, [buffers[0][:5]], offset))
    f = SafetensorsFile(tmp_path / "t.safetensors")
    for index in [(...,), (slice(None), slice(2, 5))]:
        try:
            got = f.get_slice("a")[index]
        except SafetensorsError as exc:     # as a read taken for the end of the file
            got = exc
        assert isinstance(got, torch.Tensor) and torch.equal(got, full[index]), (index, got)


def test_a_checkpoint_of_the_first_format_reads_each_tensor_by_its_bytes(monkeypatch):
    """The first checkpoint format's pieces (checkpoint/legacy.py) are read as the weights
    are: each tensor equals safe_open's, and reading it reads its own bytes, not its file."""
    from pathlib import Path

    from safetensors import safe_open

    from trainmesh.checkpoint.legacy import Reader
    from trainmesh.models import safetensors_file
    directory = Path(__file__).parent / "data" / "checkpoint_v1" / "step-00000003"
    reads: list[int] = []
    read_at = safetensors_file._read_at
    monkeypatch.setattr(safetensors_file, "_read_at", lambda fd, buffer, offset:
                        reads.append(len(buffer)) or read_at(fd, buffer, offset))
    reader = Reader(directory)
    for key, piece in sorted(reader.manifest["tensors"].items()):
        reads.clear()
        got = reader.get(key)
        with safe_open(str(directory / piece), framework="pt") as f:
            want = f.get_tensor(key)
        assert got.dtype == want.dtype and torch.equal(got, want), key
        assert sum(reads) == want.numel() * want.element_size(), (key, reads)
