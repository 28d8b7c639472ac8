"""`trainmesh plan --model-dir` offers the axes the run can take: the plans trainmesh train picks
(a plan file's, else the declared one, else one inferred from the modules), read by the same
function on the model built on the meta device from config.json alone (no weights).

All in process, tiny configs written by transformers (StableLM declares no tp or pp plan,
Llama 4 no pp or ep plan; StableLM with per-head q/k norms in a list cannot be split by heads).
"""
from __future__ import annotations

import json

import pytest
from test_planner import plan_json, run_cli

from trainmesh.planner import model_dir

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
ADVISE = ["--gpus", "8", "--gpu", "h100", "--seq-len", "16"]


def _dir(tmp_path, name, config):
    path = tmp_path / name
    config.save_pretrained(path)    # config.json only: the planner reads no weights
    return str(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    return {"stablelm": _dir(tmp, "stablelm", transformers.StableLmConfig(**COMMON)),
            "qk-norms": _dir(tmp, "qk", transformers.StableLmConfig(**COMMON, qk_layernorm=True)),
            "llama4": _dir(tmp, "llama4", transformers.Llama4TextConfig(
                **COMMON, num_local_experts=4, intermediate_size_mlp=64, head_dim=8))}


def _axes_used(result: dict) -> set[str]:
    return {axis for c in result["candidates"] for axis in ("tp", "pp", "ep") if c["layout"][axis] > 1}


def test_inferred_plans_are_offered(dirs, capsys):
    """StableLM's tp and pp plans and Llama 4's pp and ep plans, inferred as the run infers them:
    the advisor scores layouts on those axes (config.json alone declares none of them)."""
    for name, want in (("stablelm", {"tp", "pp"}), ("llama4", {"pp", "ep"})):
        config = json.loads(open(f"{dirs[name]}/config.json").read())
        assert not model_dir.declared_axes(config) & want        # nothing declared on them
        shape, axes, _, notes = model_dir.read(dirs[name])
        assert want <= axes, (name, axes)
        assert all(any(n.startswith(f"{axis}: ") and "inferred" in n for n in notes) for axis in want)
        assert want <= _axes_used(plan_json(capsys, "--model-dir", dirs[name], *ADVISE)), name


def test_uninferable_plan_is_not_offered_and_the_note_names_the_module(dirs, capsys):
    """StableLM with its q/k norms kept one per head in a list: no tp plan can be inferred, so
    no layout splits over tp, and the note names the module inference could not place."""
    _, axes, _, notes = model_dir.read(dirs["qk-norms"])
    assert "tp" not in axes and "pp" in axes
    assert any(n.startswith("tp: not offered") and "model.layers.0.self_attn.q_layernorm.norms.0" in n
               and "--tp-plan FILE" in n for n in notes), notes
    code, out, err = run_cli(capsys, ["plan", "--model-dir", dirs["qk-norms"], *ADVISE])
    assert code == 0 and "q_layernorm.norms.0" in out.replace("\n", "")
    assert "tp" not in _axes_used(plan_json(capsys, "--model-dir", dirs["qk-norms"], *ADVISE))


def test_a_plan_file_is_read_as_the_run_reads_it(dirs, tmp_path, capsys):
    """--tp-plan FILE supplies the plan the model lacks (tp offered again); a file naming no
    module of the model exits 2 naming --tp-plan, as trainmesh train does; plan files without
    --model-dir exit 2 naming the flag."""
    plan = tmp_path / "tp.json"
    plan.write_text(json.dumps({"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj":
                                "colwise", "layers.*.self_attn.v_proj": "colwise",
                                "layers.*.self_attn.o_proj": "rowwise"}))
    result = plan_json(capsys, "--model-dir", dirs["qk-norms"], "--tp-plan", str(plan), *ADVISE)
    assert "tp" in _axes_used(result)
    plan.write_text(json.dumps({"layers.*.attn.nothing": "colwise"}))
    for argv in (["--model-dir", dirs["stablelm"], "--tp-plan", str(plan)],
                 ["--model", "llama3-8b", "--tp-plan", str(plan)]):
        code, out, err = run_cli(capsys, ["plan", *argv, *ADVISE])
        assert code == 2 and out == "" and "--tp-plan" in err and len(err.strip().splitlines()) == 1


def test_a_large_model_is_read_without_allocating_its_weights(tmp_path):
    """DeepSeek-V3's widths (256 experts of 2048 x 7168: one stacked gate/up tensor is 30 GB
    in fp32) cut to 2 layers: the model is built with every tensor on the meta device, so
    reading its plans allocates none of it (made on the CPU first, this machine refuses
    the 30 GB)."""
    path = tmp_path / "deepseek"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 2,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "silu"}))
    try:
        outcome = model_dir.read(str(path))
    except RuntimeError as exc:    # the allocator's refusal
        outcome = exc
    assert not isinstance(outcome, Exception), outcome
    assert {"tp", "pp", "ep"} <= outcome[1]
