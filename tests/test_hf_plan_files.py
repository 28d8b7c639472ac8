"""A user's plans for a Hugging Face model: ``--tp-plan FILE``, ``--pp-plan FILE``,
``--ep-plan FILE`` (JSON in the config's own format), over the declared or inferred plans.

- In this process: a plan file replaces the declared plan in the model's config (its source
  recorded as a file), a pipeline plan file names the layer list, and every bad file — not
  readable, not JSON, not an object, a value of the wrong kind, a pattern naming no module, a
  style trainmesh does not map, a layout its plan cannot split, no --model-dir — exits 2 before
  any worker with one line naming the flag and what is wrong.
- One world-2 launch of the engine `trainmesh train`'s workers build (``build_engine`` of the
  run's config): a StableLM (which declares no tensor-parallel plan) under ``--tp 2 --tp-plan
  FILE`` splitting only its MLPs holds its attention whole and its MLP split, and equals the
  one-process engine (loss 1e-3 abs, grad norm 1e-3 rel, 2 steps).

Planted bugs this module catches (each seen failing with an assertion): the plan files not
handed to the workers (trainer's ``build_model`` without them: the workers split the inferred
plan: rank 0 holds q_proj as (16, 32)).
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers import LAUNCHED, step_differences, train_config, widened

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, SEQ, BATCH = 2, 16, 4
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
MLP_ONLY = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise"}
PP = {"embed_tokens": [["input_ids"], ["inputs_embeds"]],
      "layers": [["hidden_states", "attention_mask"], ["hidden_states"]],
      "norm": [["hidden_states"], ["hidden_states"]]}
BASE = ["--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(STEPS),
        "--warmup-steps", "1", "--lr", "0.01", "--seed", "3"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("planfiles")
    torch.manual_seed(0)
    models = {"stablelm": transformers.StableLmForCausalLM(transformers.StableLmConfig(**COMMON)),
              "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))}
    out = {}
    for kind, model in models.items():
        widened(model).save_pretrained(str(root / kind))
        out[kind] = str(root / kind)
    return out


def _file(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_a_plan_file_replaces_the_declared_plan(dirs, tmp_path):
    from trainmesh.core.hf_infer import plan_source
    from trainmesh.core.hf_plan import hf_structure
    from trainmesh.models.hf import build_on_meta
    from trainmesh.models.hf_plans import PlanFiles
    tp, pp = _file(tmp_path, "tp.json", MLP_ONLY), _file(tmp_path, "pp.json", PP)
    model = build_on_meta(dirs["llama"], plans=PlanFiles(tp=tp, pp=pp))
    assert model.config.base_model_tp_plan == MLP_ONLY
    assert plan_source(model, "tp") == plan_source(model, "pp") == "file"
    assert hf_structure(model).layers == "model.layers"
    assert plan_source(build_on_meta(dirs["llama"]), "tp") == "declared"


def test_bad_plan_files_exit_2_before_any_worker_naming_the_flag(dirs, tmp_path, refused, no_launch):
    base = ["train", "--model-dir", dirs["stablelm"], *BASE]
    cases = [
        ("--tp-plan", str(tmp_path / "missing.json"), ["--tp", "2"], "cannot read"),
        ("--tp-plan", _file(tmp_path, "text.json", "colwise"), ["--tp", "2"], "not JSON"),
        ("--tp-plan", _file(tmp_path, "list.json", ["colwise"]), ["--tp", "2"], "a list"),
        ("--tp-plan", _file(tmp_path, "int.json", {"layers.*.mlp.up_proj": 1}), ["--tp", "2"],
         "not a style"),
        ("--tp-plan", _file(tmp_path, "none.json", {"layers.*.mlp.fc9": "colwise"}), ["--tp", "2"],
         "'layers.*.mlp.fc9' names no module"),
        ("--tp-plan", _file(tmp_path, "style.json", {**MLP_ONLY, "layers.*.mlp.up_proj": "warp"}),
         ["--tp", "2"], "'warp'"),
        ("--tp-plan", _file(tmp_path, "half.json", {"layers.*.mlp.up_proj": "colwise"}),
         ["--tp", "2"], "no row layer of model.layers.0.mlp sums"),
        ("--pp-plan", _file(tmp_path, "pp-io.json", {**PP, "norm": ["hidden_states"]}),
         ["--pp", "2"], "not [inputs, outputs]"),
        ("--pp-plan", _file(tmp_path, "pp-nolist.json", {"embed_tokens": PP["embed_tokens"],
                                                         "norm": PP["norm"]}),
         ["--pp", "2"], "0 layer lists"),
        ("--ep-plan", _file(tmp_path, "ep.json", {"layers.*.mlp": "ep_dispatch_experts"}),
         ["--dp", "2", "--ep", "2"], "has no num_experts")]
    for flag, path, layout, words in cases:
        line = refused([*base, *layout, flag, path], flag)
        assert words in line, (flag, layout, line)
    line = refused(["train", *BASE, "--tp", "2", "--tp-plan", _file(tmp_path, "t.json", MLP_ONLY)],
                   "--tp-plan")
    assert "needs --model-dir" in line, line
    assert not no_launch


def test_a_good_plan_file_launches(dirs, tmp_path, no_launch):
    from trainmesh.cli import main
    tp = _file(tmp_path, "tp.json", MLP_ONLY)
    assert main(["train", "--model-dir", dirs["stablelm"], *BASE, "--tp", "2", "--tp-plan", tp]) == LAUNCHED
    assert no_launch[0].tp_plan == tp and no_launch[0].plan_files().tp == tp


def _curve(cfg, mesh=None) -> dict:
    """STEPS steps of the engine `trainmesh train` builds for ``cfg`` (its workers' build_engine),
    and the local shapes of layer 0's q_proj and gate_proj."""
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.trainer import build_engine
    mesh = mesh if mesh is not None else cfg.parallel.build_mesh()
    engine = build_engine(cfg, torch.device("cpu"), mesh)
    data, _ = make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=SEQ, held_out=False)
    curve = [(engine.train_step(data.batch(cfg.seed, step, BATCH)), engine.last["grad_norm"])
             for step in range(1, STEPS + 1)]
    layer = engine.model.get_submodule("model.layers.0")
    return {"curve": curve, "q_proj": tuple(layer.self_attn.q_proj.weight.shape),
            "gate_proj": tuple(layer.mlp.gate_proj.weight.shape)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_with_a_plan_file_equals_one_process(dirs, tmp_path):
    """The workers' engine is built with the file's plan (the attention stays whole on each
    rank, the MLP split), and trains as one process."""
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.testing import run_distributed
    tp = _file(tmp_path, "tp.json", MLP_ONLY)
    want = _curve(train_config(["--model-dir", dirs["stablelm"], *BASE]), ParallelMesh(local=True))
    cfg = train_config(["--model-dir", dirs["stablelm"], *BASE, "--tp", "2", "--tp-plan", tp])
    for rank, got in run_distributed(_curve, 2, cfg, timeout_s=200).items():
        # q_proj whole (32, 32); gate_proj's 64 output features split: (32, 32)
        assert (got["q_proj"], got["gate_proj"]) == ((32, 32), (32, 32)), (rank, got)
        failures = step_differences(want["curve"], got["curve"], f"rank {rank} --tp 2 --tp-plan")
        assert not failures, "\n".join(failures)
