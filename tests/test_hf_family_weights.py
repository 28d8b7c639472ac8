"""Every hub family transformers converts on load reads back through the weights reader.

transformers 5 loads some families' files through a conversion (``conversion_mapping``:
renamings, experts stacked, gate and up joined, fused projections chunked or split, Qwen3-VL-MoE's
experts transposed where the file's shape is not the model's). trainmesh reads a hub model's
weights through ``CheckpointView`` (models/hf_weights.py), which runs those conversions itself.
Here every model type of that mapping that ``AutoModelForCausalLM`` builds (what ``--model-dir``
builds), tiny (2 layers, hidden 32, 4 experts; each family's default config cut down), is saved
with ``save_pretrained`` and built again on meta as ``--model-dir`` builds it; the reader's shape
check passes, and every parameter read whole and, along each dimension, its second half (a tp 2
rank's piece) equals the saved model's tensor (``torch.equal``). Qwen3-VL-MoE, which no
``AutoModelForCausalLM`` builds, is read as its ``ForConditionalGeneration``, both as
``save_pretrained`` writes it and as its published checkpoints store the experts (transposed,
which its shape-checking ``Transpose`` turns back); a rank's piece of its experts reads exactly
the piece's bytes.

Planted bugs this module catches (each seen failing with an assertion): the model and config
not passed to the conversion: "qwen3_vl_moe: the reader failed: AttributeError("'NoneType'
object has no attribute 'get_parameter'")" (and the same for lara_mini, sarvam_moe and
param2moe, whose ``Split`` sizes its parts by the model's; inkling2_text and
inkling2_loop_text, whose vocabulary unpadding reads the config, with 'get_text_config'); the
parameters after the first that one fused file tensor makes left unread: "hrm_text: the reader
failed: ConfigError(... has no tensor for 'model.L_module.layers.0.self_attn.q_proj.weight'"
(lara_mini, sarvam_moe alike); a key renamed to a name the model lacks not read under its own
name, as transformers falls back to (DeepSeek-V4's ``model.norm.weight`` taken for a
``kv_norm``): "deepseek_v4: the reader failed: ConfigError(... has no tensor for
'model.norm.weight'"; the shape-checking ``Transpose`` run on the parts it reads (it then
decides on the part's shape): "AssertionError: qwen3_vl_moe
model.language_model.layers.0.mlp.experts.gate_up_proj (slice(0, 4, None), slice(0, 16, None),
slice(0, 32, None))" (torch.equal False); a shape-checking ``Transpose`` read whole: "saved
model.language_model.layers.0.mlp.experts.down_proj (slice(2, 4, None), slice(0, 32, None),
slice(0, 8, None)): read 4096 bytes, the piece is 2048".
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM,
)

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
            num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
            num_experts_per_tok=2, moe_k=2, moe_topk=2, moe_intermediate_size=8,
            expert_intermediate_size=8, shared_expert_intermediate_size=16, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, tie_word_embeddings=False)
"""Every config field of these names, wherever a family's config (or a sub-config) has it."""
OVERRIDES = {
    "longcat_flash": dict(num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=8,
                          zero_expert_num=2),
    "dory": dict(num_hidden_layers=4, n_input_layers=2, n_recurrent_layers=0, n_output_layers=2,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp"]),  # its blocks
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=64,
                         hidden_size_per_layer_input=8, laurel_rank=4),
    "gemma4_unified": dict(text_config=dict(per_layer_config={})),
    "kolibri1_1": dict(index_layers=[1], kv_source_layers=[0, 1], mlp_only_layers=[0],
                       head_dim=16, index_num_heads=2),
    "got_ocr2": dict(vision_config=dict(output_channels=16, mlp_dim=64, image_size=64,
                                        global_attn_indexes=[1])),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                           indexer_budget=8, indexer_compress_ratio=4),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                             shared_intermediate_size=32),
    "inkling2_text": dict(unpadded_vocab_size=60),
    "inkling2_loop_text": dict(unpadded_vocab_size=60),
}
"""Fields a family's config checks against others, or that name its layer count otherwise."""
CONVERTED = sorted(t for t in CAUSAL_LM if get_checkpoint_conversion_mapping(t) is not None)
FAMILIES = [*CONVERTED, "qwen3_vl_moe"]


def _shrunk(fields: dict, layers: int | None) -> dict:
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            out[key] = _shrunk(value, value.get("num_hidden_layers", layers))
        elif key in TINY:
            out[key] = TINY[key]
        elif isinstance(value, list) and layers and len(value) == layers:
            out[key] = value[:1] + value[-1:]       # a per-layer list: the first and last layer's
        else:
            out[key] = value
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if out.get(key) is not None:
            out[key] = 0
    return out


def tiny_config(family: str):
    """``family``'s default config (its published model's) cut down to a tiny model."""
    fields = CONFIG_MAPPING[family]().to_dict()
    fields = _shrunk(fields, fields.get("num_hidden_layers"))
    for key, value in OVERRIDES.get(family, {}).items():
        fields[key] = {**fields[key], **value} if isinstance(value, dict) and value else value
    return CONFIG_MAPPING[family](**fields)


def tiny_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(family)
    if family == "qwen3_vl_moe":
        config.vision_config = type(config.vision_config)(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
            deepstack_visual_indexes=[0])
        return transformers.Qwen3VLMoeForConditionalGeneration(config).float()
    return transformers.AutoModelForCausalLM.from_config(config).float()


def on_meta(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    """The model the reader gets: built from the directory on meta as ``--model-dir`` builds
    it (Qwen3-VL-MoE, which it does not build: its class on meta)."""
    from trainmesh.models.hf import build_on_meta
    if model.config.model_type in CAUSAL_LM:
        return build_on_meta(str(directory))
    with torch.device("meta"):
        return type(model)(model.config)


def indices(shape: torch.Size) -> list[tuple[slice, ...]]:
    """The whole tensor, and along each dimension its second half (a tp 2 rank's piece)."""
    whole = tuple(slice(0, n) for n in shape)
    return [whole, *(whole[:d] + (slice(n // 2, n),) + whole[d + 1:]
                     for d, n in enumerate(shape) if n >= 2)]


def read_back(family: str, model: torch.nn.Module, directory: Path,
              transposed: bool = False) -> None:
    from trainmesh.models.hf import weight_files
    from trainmesh.models.hf_weights import CheckpointView
    try:
        meta = on_meta(model, directory)
        view = CheckpointView(weight_files(str(directory)), meta, field="--model-dir")
        view.check(meta)
    except Exception as exc:   # noqa: BLE001 - the family and the error, not a traceback
        pytest.fail(f"{family}: the reader failed: {exc!r}")
    for name, p in model.named_parameters():
        for index in indices(p.shape):
            try:
                got = view.read(name, tuple(p.shape), index)
            except Exception as exc:   # noqa: BLE001 - named with the family
                pytest.fail(f"{family}: the reader failed: {name} {index}: {exc!r}")
            assert torch.equal(got, p.detach()[index]), f"{family} {name} {index}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_reads_back_whole_and_by_halves(family, tmp_path):
    try:
        model = tiny_model(family)
    except Exception as exc:   # noqa: BLE001 - named with the family
        pytest.fail(f"{family}: transformers cannot build it tiny: {exc!r}")
    model.save_pretrained(str(tmp_path))
    read_back(family, model, tmp_path)


def test_qwen3_vl_moe_experts_as_published_read_only_a_ranks_piece(tmp_path, counted):
    """Qwen3-VL-MoE's published checkpoints hold each layer's experts transposed from the
    model's (``gate_up_proj`` (E, hidden, 2 x inter), the model (E, 2 x inter, hidden));
    transformers' shape-checking ``Transpose`` turns them (and leaves ``save_pretrained``'s, of
    the model's shape, as they are). Both read back equal, and a rank's piece of an expert
    parameter (its half along any dimension) reads exactly its own bytes from either."""
    from safetensors.torch import load_file, save_file
    model = tiny_model("qwen3_vl_moe")
    saved, published = tmp_path / "saved", tmp_path / "published"
    model.save_pretrained(str(saved))
    state = load_file(str(saved / "model.safetensors"))
    experts = [key for key in state if ".mlp.experts." in key]
    assert len(experts) == 4 and all(state[key].shape[1] != state[key].shape[2] for key in experts)
    published.mkdir()
    save_file({key: t.transpose(1, 2).contiguous() if key in experts else t
               for key, t in state.items()}, str(published / "model.safetensors"),
              metadata={"format": "pt"})
    (published / "config.json").write_text((saved / "config.json").read_text())
    for directory in (saved, published):
        read_back(f"qwen3_vl_moe {directory.name}", model, directory)
        from trainmesh.models.hf import weight_files
        from trainmesh.models.hf_weights import CheckpointView
        view = CheckpointView(weight_files(str(directory)), on_meta(model, directory),
                              field="--model-dir")
        for name in experts:
            p = model.get_parameter(name)
            for index in indices(p.shape)[1:]:
                counted[0] = 0
                got = view.read(name, tuple(p.shape), index)
                assert torch.equal(got, p.detach()[index]), f"{directory.name} {name} {index}"
                assert counted[0] == got.numel() * 4, \
                    f"{directory.name} {name} {index}: read {counted[0]} bytes, the piece is {got.numel() * 4}"
