"""How trainmesh reads the plans a Hugging Face model declares, in process (no worker starts).

transformers moves its styles between releases (5.25 took the stacked experts out of
``base_model_tp_plan`` and split DeepSeek-V3's attention with ``mla_kv_a_proj``), so trainmesh
recognises what it splits by what the model holds, and refuses what it cannot map by name:

- a declared style trainmesh has no counterpart for exits 2 in one line naming the style and
  the family (on a projection, on the stacked experts' parameters, on their module);
- experts are the modules holding one slice per expert stacked along dimension 0 of their
  parameters, a matrix each (``(E, out, in)``), whatever their class or parameter names; a
  convolution of that shape is none, and runs on the whole sequence (refused under
  ``--sequence-parallel``); experts the plan leaves whole run on a rank's chunk of the tokens
  with their gradient summed over tp; those a 5.24 plan splits are a region of their own;
- ``mla_kv_a_proj``: the latent attention is entered once and everything it leaves whole gets
  its gradient summed over tp (``partial_grad``), as transformers' backward all-reduces sum it.

Planted bugs this module catches (each seen failing with an assertion): experts recognised by a
class name ending in ``Experts`` (the unseen class is not in the list); ``mla_kv_a_proj`` mapped
to ``colwise`` (the projection split along its output features).
"""
from __future__ import annotations

import pytest
import torch
from helpers import assert_refused

from trainmesh import ConfigError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SEQ = 16
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, tie_word_embeddings=False, num_experts_per_tok=2)
ATTENTION = {f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {
    "layers.*.self_attn.o_proj": "rowwise"}
"""Mixtral's declared attention entries (transformers 5.24 and 5.25 alike)."""
EXPERTS_524 = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise",
               "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}
"""What transformers 5.24 declared for Mixtral's experts (5.25 declares nothing for them)."""
LAUNCHED = 99


def mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=24, num_local_experts=4))


class Blender(torch.nn.Module):
    """Experts of a class and parameter names trainmesh has never seen: stacked all the same."""

    def __init__(self, experts: int, hidden: int, inner: int) -> None:
        super().__init__()
        self.mix_in = torch.nn.Parameter(torch.zeros(experts, 2 * inner, hidden))    # (E, 2h, d)
        self.mix_out = torch.nn.Parameter(torch.zeros(experts, hidden, inner))       # (E, d, h)

    def forward(self, hidden_states, top_k_index, top_k_weights):   # pragma: no cover
        return hidden_states


def _plan(model: torch.nn.Module, **declared: str) -> dict:
    """The SP plan of ``model`` whose config declares ``declared`` besides its own tp plan."""
    from trainmesh.tensor_parallel import hf_tp_plan
    from trainmesh.tensor_parallel.hf_sequence import sequence_parallel_plan
    model.config.base_model_tp_plan = {**ATTENTION, **declared}
    return sequence_parallel_plan(model, hf_tp_plan(model))


@pytest.fixture
def no_launch(monkeypatch):
    """Validation only: no worker ever starts; the process is a launcher, not a worker."""
    import trainmesh.run.launch
    monkeypatch.setattr(trainmesh.run.launch, "launch_local", lambda *a, **k: LAUNCHED)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def test_an_unknown_declared_style_exits_2_naming_it_and_the_family(tmp_path, capsys, monkeypatch,
                                                                   no_launch):
    from trainmesh.cli import main
    from trainmesh.tensor_parallel import hf_tp_plan
    mixtral().save_pretrained(str(tmp_path))
    capsys.readouterr()                                     # save_pretrained's progress bar
    argv = ["train", "--model-dir", str(tmp_path), "--seq-len", str(SEQ), "--global-batch", "4",
            "--tp", "2"]
    declared = ATTENTION                                    # 5.25's: the experts left out
    for pattern, style in (("layers.*.self_attn.q_proj", "colwise_v9"),
                           ("layers.*.mlp.experts.down_proj", "rowwise_v9"),
                           ("layers.*.mlp.experts", "moe_tp_experts_v9")):
        monkeypatch.setattr(transformers.MixtralConfig, "base_model_tp_plan", {**declared, pattern: style})
        line = assert_refused(capsys, argv, "--tp")
        assert style in line and "mixtral" in line, line
    monkeypatch.setattr(transformers.MixtralConfig, "base_model_tp_plan",
                        {**declared, "layers.*.self_attn.q_proj": "colwise_v9"})
    with pytest.raises(ConfigError, match="mixtral family's declared style 'colwise_v9'"):
        hf_tp_plan(mixtral())                               # the Python API: the same words
    for plan in (declared, {**declared, **EXPERTS_524}):   # experts whole on a rank's chunk, or split
        monkeypatch.setattr(transformers.MixtralConfig, "base_model_tp_plan", plan)
        assert main([*argv, "--sequence-parallel"]) == LAUNCHED, capsys.readouterr().err


def test_experts_are_recognised_by_what_they_hold():
    from trainmesh.core.hf_routing import stacked_experts
    from trainmesh.tensor_parallel.hf_experts import check_expert_tp
    model = mixtral()
    model.model.layers[0].mlp.experts = Blender(4, 32, 12)
    experts = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert stacked_experts(model) == experts, stacked_experts(model)
    plan = _plan(model)                                     # 5.25: no style on the experts
    for name in experts:         # whole on every rank, on its chunk: gradients summed over tp
        assert plan.get(name) == ("sequence_parallel",), (name, plan)
    assert plan.get("model.layers.0.mlp.gate") == ("sequence_parallel",), plan   # the router
    with pytest.raises(ConfigError, match="--ep 1") as err:
        check_expert_tp(model, 2, ep=2, sequence_parallel=True)
    assert err.value.field == "--sequence-parallel"

    model.model.layers[1].mlp.mixer = torch.nn.Conv1d(4, 4, 3, bias=False)   # (4, 4, 3): no experts
    assert stacked_experts(model) == experts, stacked_experts(model)
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.mixer \(Conv1d\)") as err:
        _plan(model)
    assert err.value.field == "--sequence-parallel"

    olmoe = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(   # its pp_plan: lm_head alone
        **COMMON, intermediate_size=16, num_experts=4))
    with pytest.raises(ConfigError, match="olmoe family declares no pipeline plan .*valid for it: "
                       "without --sequence-parallel"):
        _plan(olmoe)

    split = mixtral()                                      # 5.24: the experts split over tp
    plan = _plan(split, **EXPERTS_524)
    check_expert_tp(split, 2, sequence_parallel=True)
    assert not any("experts" in name for name in plan), plan   # a region of their own
    split.config.base_model_tp_plan = {**ATTENTION, **EXPERTS_524, "layers.*.self_attn": "moe_tp_experts"}
    with pytest.raises(ConfigError, match="self_attn .*holds no stacked experts") as err:
        check_expert_tp(split, 2)
    assert err.value.field == "--tp"


def test_latent_attention_sums_what_it_leaves_whole_over_tp():
    from trainmesh.tensor_parallel import hf_tp_plan
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **COMMON, intermediate_size=48, moe_intermediate_size=8, n_routed_experts=4,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8))
    model.config.base_model_tp_plan = {     # 5.25's attention entries (5.24 declared none)
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    plan = hf_tp_plan(model)
    attn = "model.layers.*.self_attn"
    assert plan[attn] == ("parallel_input", "local_heads"), plan        # entered once
    assert {p: s for p, s in plan.items() if s == "partial_grad"} == {
        f"{attn}.{leaf}": "partial_grad"
        for leaf in ("kv_a_proj_with_mqa", "q_a_proj", "q_a_layernorm", "kv_a_layernorm")}, plan
    assert plan[f"{attn}.kv_b_proj"] == "colwise" and plan[f"{attn}.o_proj"] == "rowwise", plan
    model.config.base_model_tp_plan = {"layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}
    with pytest.raises(ConfigError, match="'mla_kv_a_proj'.*splits none") as err:
        hf_tp_plan(model)                   # nothing split: its gradients are whole already
    assert "deepseek_v3" in err.value.message and err.value.field == "tp_plan"
