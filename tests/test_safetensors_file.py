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
rows' 8 MiB mapped, not the file).

A model saved expert by expert and held stacked (Qwen3-MoE): a share of a layer's experts
(an ep shard) reads the file tensors of those experts alone and equals the stacked whole's
slice; a column slice (tp) reads every expert.

Planted bugs this module catches (each seen failing with an assertion, the child's error in
it): every expert read for an ep shard (as before) fails
test_a_share_of_stacked_experts_reads_only_its_experts with "assert ['0', '1', '2', '3'] ==
['2', '3']"; the header check through safetensors' ``safe_open`` (as before) fails
test_a_shard_larger_than_the_address_space_is_read with "ConfigError: --model-dir: cannot read
.../model-00001-of-00001.safetensors as safetensors: Cannot allocate memory (os error 12)"; the
reads through ``safe_open`` with "MemoryError: Cannot allocate memory (os error 12)".
"""
from __future__ import annotations

import json
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
    for index in [(slice(1, 3),), (slice(None), slice(2, 5)), (2,), (slice(0, 5, 2), slice(1, 2)),
                  (..., slice(0, 1)), (slice(1, 4), 3, slice(0, 2)), (slice(3, 3),)]:
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


def test_a_share_of_stacked_experts_reads_only_its_experts(tmp_path, monkeypatch):
    """Qwen3-MoE saved expert by expert, held stacked: a slice of experts 2..3 of 4 (an ep
    shard) equals the stacked whole's slice and reads the file tensors of experts 2 and 3
    alone; a column slice (tp) still reads every expert."""
    transformers = pytest.importorskip("transformers")
    from trainmesh.engine.pretrained import from_pretrained
    from trainmesh.models import safetensors_file
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         moe_intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         num_experts=4, num_experts_per_tok=2)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "m")
    whole = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    model = from_pretrained(str(tmp_path / "m"))
    read: list[str] = []
    original = safetensors_file.SafetensorsFile.read
    monkeypatch.setattr(safetensors_file.SafetensorsFile, "read",
                        lambda self, key, index: read.append(key) or original(self, key, index))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        want = whole.get_parameter(name)
        index = (slice(2, 4), slice(1, 5), slice(None))
        read.clear()
        got = model.init_parameter(name, tuple(want.shape), index)
        assert torch.equal(got, want[index]), name
        experts = sorted({key.split(".experts.")[1].split(".")[0] for key in read})
        assert experts == ["2", "3"], (name, sorted(read))
        read.clear()
        columns = (slice(None), slice(0, 4))
        assert torch.equal(model.init_parameter(name, tuple(want.shape), columns), want[columns])
        assert len({key.split(".experts.")[1].split(".")[0] for key in read}) == 4, sorted(read)
