"""A hub model is built wholly on the meta device wherever trainmesh needs its shapes: no rank,
and no launcher's preflight, pays for a parameter it does not hold.

The model here is a one-layer Qwen3-MoE whose stacked experts are 51 GB in float32 (64
experts: ``gate_up_proj`` (64, 65536, 2048) is 34 GB, ``down_proj`` 17 GB), its weights 13
sparse safetensors shards of at most 4 GB, as a hub model's are (the headers real: each
expert's projections apart, as Qwen3-MoE is saved; no data written). ``trainmesh train``'s
preflight on it (every tensor of the files checked against the model, the layout checked) runs
in a process of its own (forked from the test zygote) whose peak RSS may grow by at most
``PREFLIGHT_BYTES`` over its RSS before: the preflight holds the config, the model's meta
tensors (no storage), its buffers (rotary frequencies: head_dim / 2 floats), the headers (~200
entries) and the family's modeling module, imported by the build; 32 to 36 MB seen. 256 MiB is
1/200 of the model. Built as before (each parameter first made on the CPU, then moved to meta)
the 34 GB ``torch.empty`` is an allocation a host with less memory refuses, while a host with
more grants it untouched (no RSS): so the fast test beside counts what the build makes off the
meta device: nothing larger than the largest buffer, where the model's largest parameter is
4.3 GB (8 experts).

``TrainConfig.num_params()`` builds a model directory's model once per config, however often
it is asked (the run's header and its summary both ask).

Planted bugs this module catches (each seen failing with an assertion): the parameters made on
the CPU and moved to meta, as before (``params_on_meta`` alone): the preflight's process fails
(on a 23 GB host: "DefaultCPUAllocator: can't allocate memory: you tried to allocate
34359738368 bytes") and the fast test sees a 4294967296-byte CPU tensor where the largest
buffer is 32 bytes; a family whose ``_init_weights`` leaves a buffer unfilled kept as built
(no fallback): its rotary frequencies stay NaN ("model.rotary_emb.inv_freq", tensor([nan, nan,
nan, nan])); ``num_params`` not cached: two calls build twice.
"""
from __future__ import annotations

import json
import resource
import struct
from pathlib import Path

import pytest
import torch
from helpers import run_in_child
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

PREFLIGHT_BYTES = 256 << 20
SHARD = 4 << 30
SMALL = dict(vocab_size=64, hidden_size=2048, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32768,
             num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def model_dir(path: Path, experts: int) -> int:
    """A Qwen3-MoE directory of ``experts`` experts with a sparse weights file of the names and
    shapes ``save_pretrained`` writes (the data never written); returns the model's bytes."""
    path.mkdir()
    config = transformers.Qwen3MoeConfig(**SMALL, num_experts=experts)
    config.save_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = {}     # as Qwen3-MoE is saved: each expert's gate, up and down projections apart
    for name, t in model.state_dict().items():
        stem, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e in range(experts):
                state |= {f"{stem}.{e}.{p}.weight": t[e, :t.shape[1] // 2] for p in ("gate_proj", "up_proj")}
        elif kind == "down_proj" and stem.endswith("experts"):
            state |= {f"{stem}.{e}.down_proj.weight": t[e] for e in range(experts)}
        else:
            state[name] = t
    index, shard, offset, shards = {}, {}, 0, []
    for name, t in state.items():     # shards of at most SHARD bytes, as save_pretrained's
        size = t.numel() * 4
        if shard and offset + size > SHARD:
            shards.append((shard, offset))
            shard, offset = {}, 0
        shard[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    shards.append((shard, offset))
    for i, (header, size) in enumerate(shards):
        file = f"model-{i:05d}.safetensors"
        index.update(dict.fromkeys(header, file))
        raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + size)       # sparse: no data written
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return sum(p.numel() * 4 for p in model.parameters())


def preflight_peak(argv: list[str]) -> int:
    """Run in a process of its own: ``trainmesh train``'s preflight on the model directory
    ``argv[0]``; prints the peak RSS before it and after it, in bytes."""
    from helpers import train_config

    from trainmesh.cli.train import preflight
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    preflight(train_config(["--model-dir", argv[0], "--force", "--steps", "1"]),
              local_ranks=1, launching=False)
    print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
    return 0


@pytest.mark.slow
def test_preflight_of_a_51_gb_model_holds_no_parameter(tmp_path):
    total = model_dir(tmp_path / "big", experts=64)
    assert total > 50e9
    code, stdout, stderr = run_in_child("test_hf_meta_build", "preflight_peak",
                                        [str(tmp_path / "big")], tmp_path)
    assert code == 0, stderr[-2000:]
    before, peak = map(int, stdout.split()[-2:])
    assert peak - before <= PREFLIGHT_BYTES, (peak - before, total)


class _Made(TorchDispatchMode):
    """Records the largest tensor any op makes off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_build_makes_nothing_off_meta_beyond_a_buffer(tmp_path):
    from trainmesh.models.hf import build_on_meta
    (tmp_path / "m").mkdir()
    transformers.Qwen3MoeConfig(**SMALL, num_experts=8).save_pretrained(tmp_path / "m")
    for buffers in (True, False):
        with _Made() as made:
            model = build_on_meta(str(tmp_path / "m"), weights=False, buffers=buffers)
        largest_param = max(p.numel() * 4 for p in model.parameters())
        assert largest_param > 4e9 and all(p.is_meta for p in model.parameters())
        held = list(model.buffers())
        assert all(not b.is_meta for b in held) if buffers else all(b.is_meta for b in held)
        largest_buffer = max((b.numel() * b.element_size() for b in held), default=0)
        assert made.largest <= largest_buffer, (made.largest, largest_buffer, largest_param)


def test_buffers_are_the_constructors(tmp_path):
    """The buffers ``_init_weights`` fills equal those the model's constructor makes (rotary
    frequencies, a router's correction bias), persistence included."""
    from trainmesh.models.hf import meta_model
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=8, n_routed_experts=4,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    real, meta = transformers.AutoModelForCausalLM.from_config(config), meta_model(transformers, config)
    want, got = dict(real.named_buffers()), dict(meta.named_buffers())
    assert sorted(want) == sorted(got) and len(want) >= 3
    for name, b in want.items():
        assert got[name].dtype == b.dtype and torch.equal(got[name], b), name
    assert real.state_dict().keys() == meta.state_dict().keys()


def test_a_buffer_init_leaves_unfilled_is_the_constructors(monkeypatch):
    """A family whose ``_init_weights`` does not fill a buffer is built with its parameters
    moved to meta as they are made, its buffers the constructor's (no NaN placeholder kept)."""
    from trainmesh.models.hf import meta_model
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4)
    real = transformers.AutoModelForCausalLM.from_config(config)
    monkeypatch.setattr(transformers.LlamaPreTrainedModel, "_init_weights", lambda self, m: None)
    meta = meta_model(transformers, config)
    assert all(p.is_meta for p in meta.parameters())
    want, got = dict(real.named_buffers()), dict(meta.named_buffers())
    assert sorted(want) == sorted(got) and want
    for name, b in want.items():
        assert torch.equal(got[name], b), (name, got[name])


def test_num_params_builds_once(tmp_path, monkeypatch):
    import trainmesh.models.hf as hf
    from helpers import train_config
    (tmp_path / "m").mkdir()
    transformers.Qwen3MoeConfig(**{**SMALL, "hidden_size": 32, "moe_intermediate_size": 8},
                                num_experts=4).save_pretrained(tmp_path / "m")
    builds = []
    build = hf.build_on_meta
    monkeypatch.setattr(hf, "build_on_meta", lambda *a, **k: builds.append(a) or build(*a, **k))
    cfg = train_config(["--model-dir", str(tmp_path / "m")])
    first = cfg.num_params()
    assert first == cfg.num_params() and len(builds) == 1, builds
    assert first == sum(p.numel() for p in build(str(tmp_path / "m"), weights=False).parameters())
