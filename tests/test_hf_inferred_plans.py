"""Plans inferred from a Hugging Face model's modules where its family declares none, and the
first-layer check of a tensor-parallel plan at start (in this process, no launch).

- The inferred tensor-parallel plans of Llama and Qwen3 are the plans those families declare
  (the same module -> style pairs: q/k/v and gate/up by columns, o and down by rows, Qwen3's
  per-head norms replicated with their gradient summed); StableLM's is the same shape.
- The inferred pipeline plans of StableLM, GraniteMoE, PhiMoE and Llama 4 name the token
  embedding, the layer list and the final norm, and read as the structure the pipeline cuts.
- The inferred expert plans of GraniteMoE and PhiMoE are the ones they declare; Llama 4's
  experts, which take their tokens in expert-major blocks, get one; with a bias they are
  refused naming the module.
- The first layer, split by a plan, against the unsplit layer: the inferred and the declared
  plans pass; a projection split along the wrong dimension is refused naming the module.
- `trainmesh train --model-dir` exits 2 before any worker where a plan cannot be inferred,
  naming the module (StableLM's per-head norm list under tp, GPT-2's position embedding under
  pp).
- The first-layer check runs once per run: `trainmesh train`'s preflight runs it, its workers'
  engines do not, `tm.Engine` on `tm.from_pretrained` does; each rank's part of a checked module
  holds views of the module's weights, not copies.

Planted bugs this module catches (each seen failing with an assertion): the inferred output
projection split by columns instead of rows (the plans differ from the declared ones); the
trainer's engine not told the preflight checked the first layer (checks [2, 2, 2]); the engine
never checking it (checks [2]); a rank's part deep-copying the module's weights (copies
[(32, 32), ...]).
"""
from __future__ import annotations

import pytest
import torch
from helpers import LAUNCHED

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SEQ = 16
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
              bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=8),
    "stablelm": lambda: transformers.StableLmConfig(**COMMON),
    "stablelm-qk-norms": lambda: transformers.StableLmConfig(**COMMON, qk_layernorm=True),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**COMMON, **MOE),
    "phimoe": lambda: transformers.PhimoeConfig(**COMMON, **MOE),
    "llama4": lambda: transformers.Llama4TextConfig(**COMMON, num_local_experts=4,
                                                    intermediate_size_mlp=64, head_dim=8),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32,
                                            n_layer=2, n_head=4)}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("inferred")
    out = {}
    for kind in ("stablelm", "stablelm-qk-norms", "gpt2", "granitemoe"):
        _model(kind).save_pretrained(str(root / kind))
        out[kind] = str(root / kind)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_inferred_tp_plan_is_the_declared_one(kind):
    from trainmesh.core.hf_infer import infer_tp_plan
    model = _model(kind)
    declared = {p: s for p, s in model.config.base_model_tp_plan.items() if p.startswith("layers.")}
    assert infer_tp_plan(model) == declared


def test_stablelm_gets_the_plans_of_a_llama_shaped_decoder(dirs):
    from trainmesh.core.hf_infer import plan_source
    from trainmesh.core.hf_plan import hf_structure
    from trainmesh.models.hf import build_on_meta
    model = build_on_meta(dirs["stablelm"])
    assert type(model.config).base_model_tp_plan is None       # declares none: inferred
    attention = {f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"}
    assert model.config.base_model_tp_plan == {
        **attention, "layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    assert [plan_source(model, a) for a in ("tp", "pp", "ep")] == ["inferred", "inferred", None]
    s = hf_structure(model)
    assert (s.pre, s.layers, s.post, s.head) == (("model.embed_tokens",), "model.layers",
                                                 ("model.norm",), "lm_head")


@pytest.mark.parametrize("kind", ["granitemoe", "phimoe", "llama4"])
def test_moe_families_get_a_layer_list(kind):
    from trainmesh.core.hf_plan import hf_structure
    from trainmesh.models.hf_plans import install_plans
    model = install_plans(_model(kind))
    s = hf_structure(model)
    assert (s.pre, s.layers, s.post, s.head) == (("model.embed_tokens",), "model.layers",
                                                 ("model.norm",), "lm_head")


@pytest.mark.parametrize("kind", ["granitemoe", "phimoe"])
def test_inferred_ep_plan_is_the_declared_one(kind):
    from trainmesh.core.hf_infer import infer_ep_plan
    model = _model(kind)
    assert infer_ep_plan(model) == dict(model.config.base_model_ep_plan)


def test_experts_in_expert_major_blocks_get_a_plan_and_biased_ones_are_refused():
    """Llama 4's experts take the tokens alone (repeated per expert, scaled by the router's
    scores): dispatched by their non-zero rows, which needs experts without biases."""
    from trainmesh.core.hf_infer import Uninferable, infer_ep_plan
    model = _model("llama4")
    assert infer_ep_plan(model) == {"layers.*.feed_forward.experts": "ep_dispatch_experts",
                                    "layers.*.feed_forward.experts.gate_up_proj": "grouped_gemm",
                                    "layers.*.feed_forward.experts.down_proj": "grouped_gemm"}
    experts = model.model.layers[0].feed_forward.experts
    experts.bias = torch.nn.Parameter(torch.zeros(4, 32))          # (E, d): a zero row -> bias
    with pytest.raises(Uninferable) as err:
        infer_ep_plan(model)
    assert err.value.module == "model.layers.0.feed_forward.experts", err.value
    assert "neither the routing" in err.value.why


def test_first_layer_check_passes_the_inferred_and_declared_plans(dirs, tmp_path):
    from trainmesh.models.hf import build_on_meta
    from trainmesh.tensor_parallel.hf_check import check_first_layer
    check_first_layer(build_on_meta(dirs["stablelm"]), 2)
    for kind in ("qwen3", "llama"):
        _model(kind).save_pretrained(str(tmp_path / kind))
        check_first_layer(build_on_meta(str(tmp_path / kind)), 2)


@pytest.mark.parametrize("entry,style,words", [
    ("self_attn.o_proj", "colwise", "no row layer of model.layers.0.self_attn sums"),
    ("self_attn.q_proj", "rowwise", "cannot split model.layers.0.self_attn over 2 ranks"),
    ("mlp.down_proj", "colwise", "no row layer of model.layers.0.mlp sums"),
    ("mlp.gate_proj", "rowwise", "cannot split model.layers.0.mlp over 2 ranks")])
def test_first_layer_check_refuses_a_split_along_the_wrong_dimension(dirs, entry, style, words):
    from trainmesh.core.errors import ConfigError
    from trainmesh.models.hf import build_on_meta
    from trainmesh.tensor_parallel.hf_check import check_first_layer
    model = build_on_meta(dirs["stablelm"])
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan, f"layers.*.{entry}": style}
    with pytest.raises(ConfigError) as err:
        check_first_layer(model, 2)
    assert err.value.field == "--tp" and words in err.value.message, err.value


def test_first_layer_check_measures_the_difference(dirs):
    """A split that runs but computes something else (the value heads of rank 1 read as rank
    0's): refused with the difference against the float32 bound."""
    from trainmesh.core.errors import ConfigError
    from trainmesh.models.hf import build_on_meta
    from trainmesh.tensor_parallel import hf_check
    model = build_on_meta(dirs["stablelm"])
    real = hf_check._Slice.__init__

    def same_rows(self, linear, style, rank, tp):
        real(self, linear, style, 0 if linear.out_features == 16 and style == "colwise" else rank, tp)
    hf_check._Slice.__init__ = same_rows
    try:
        with pytest.raises(ConfigError, match=r"self_attn split over 2 ranks differs by .* \(float32 "
                                              r"rounding allows"):
            hf_check.check_first_layer(model, 2)
    finally:
        hf_check._Slice.__init__ = real


def test_refusals_name_the_module_that_could_not_be_placed(dirs, no_launch, capsys):
    from trainmesh.cli import main
    base = ["train", "--seq-len", str(SEQ), "--global-batch", "4", "--steps", "2"]
    cases = [("stablelm-qk-norms", ["--tp", "2"], "--tp",
              "model.layers.0.self_attn.q_layernorm.norms.0"),
             ("gpt2", ["--pp", "2"], "--pp", "transformer.wpe")]
    for kind, flags, flag, words in cases:
        code = main([*base, "--model-dir", dirs[kind], *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err and f"error: {flag}:" in err[-1] and words in err[-1], (kind, flags, err)
    assert not no_launch


def _engine_refusal(model: torch.nn.Module):
    """What ``tm.Engine`` raises for ``model`` under tp 2, in this process (no process group:
    the check comes before any collective)."""
    import trainmesh as tm
    with pytest.raises(Exception) as err:
        tm.Engine(model, lambda ps: torch.optim.SGD(ps, lr=0.1), tm.causal_lm_loss,
                  tm.ParallelConfig(tp=2))
    return err.value


def test_the_python_api_refuses_a_plan_file_as_the_preflight_does(dirs, tmp_path, refused, no_launch):
    """A plan file whose MLP split has no row layer: ``trainmesh train`` exits 2 before any
    worker, and ``tm.Engine`` on ``tm.from_pretrained`` of the same directory and file raises
    the ConfigError the CLI printed, flag and words."""
    import json

    import trainmesh as tm
    from trainmesh.core.errors import ConfigError
    from trainmesh.models.hf_plans import PlanFiles
    plan = tmp_path / "tp.json"
    plan.write_text(json.dumps({"layers.*.mlp.up_proj": "colwise"}))
    line = refused(["train", "--model-dir", dirs["stablelm"], "--seq-len", str(SEQ),
                    "--global-batch", "4", "--steps", "2", "--tp", "2", "--tp-plan", str(plan)],
                   "--tp-plan")
    exc = _engine_refusal(tm.from_pretrained(dirs["stablelm"], plans=PlanFiles(tp=str(plan))))
    assert isinstance(exc, ConfigError) and line.endswith(str(exc)), (line, repr(exc))
    assert "no row layer of model.layers.0.mlp sums" in exc.message, exc
    assert not no_launch


def test_the_python_api_refuses_an_inferred_plan_as_the_preflight_does(dirs):
    """An inferred plan that splits the output projection by columns: the preflight's check of
    the model directory and ``tm.Engine`` raise the same ConfigError naming ``--tp``."""
    import trainmesh as tm
    from trainmesh.core.errors import ConfigError
    from trainmesh.engine.pretrained import check_model_dir
    model = tm.from_pretrained(dirs["stablelm"])
    model.config.base_model_tp_plan = {**model.config.base_model_tp_plan,
                                       "layers.*.self_attn.o_proj": "colwise"}
    with pytest.raises(ConfigError) as preflight:
        check_model_dir(dirs["stablelm"], model, tp=2)
    exc = _engine_refusal(model)
    assert isinstance(exc, ConfigError) and exc.field == "--tp", repr(exc)
    assert str(exc) == str(preflight.value), (exc, preflight.value)


def test_the_first_layer_is_checked_once_per_run(dirs, no_launch, monkeypatch):
    """``trainmesh train --tp 2`` on a model whose tensor-parallel plan is inferred checks the
    first layer in its preflight and its workers' engines (``build_engine`` of the run's config)
    do not check it again; ``tm.Engine`` on ``tm.from_pretrained`` checks it itself. Counted in
    this process, each engine stopped where it would set up its first collective."""
    import trainmesh as tm
    from trainmesh.cli import main
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.engine import engine as engine_module
    from trainmesh.run.trainer import build_engine
    from trainmesh.tensor_parallel import hf_check

    class Reached(Exception):
        """The engine got past the check to its communicator."""

    def stop(_mesh):
        raise Reached

    checks: list[int] = []
    real = hf_check.check_first_layer
    monkeypatch.setattr(hf_check, "check_first_layer",
                        lambda model, tp: checks.append(tp) or real(model, tp))
    monkeypatch.setattr(engine_module, "Comm", stop)
    flags = ["--model-dir", dirs["stablelm"], "--seq-len", str(SEQ), "--global-batch", "4",
             "--steps", "2", "--tp", "2"]
    assert main(["train", *flags]) == LAUNCHED and checks == [2], checks    # the preflight
    for _worker in range(2):
        with pytest.raises(Reached):
            build_engine(no_launch[0], torch.device("cpu"), ParallelMesh(local=True))
    assert checks == [2], f"the workers' engines checked the first layer again: {checks}"
    with pytest.raises(Reached):
        tm.Engine(tm.from_pretrained(dirs["stablelm"]), lambda ps: torch.optim.SGD(ps, lr=0.1),
                  tm.causal_lm_loss, tm.ParallelConfig(tp=2), mesh=ParallelMesh(local=True))
    assert checks == [2, 2], f"tm.Engine did not check the first layer: {checks}"


def test_the_first_layer_check_holds_the_layers_weights_once(dirs, monkeypatch):
    """Each TP rank's part of a checked module (the attention, the MLP) holds views of that
    module's own weights: the check holds the first layer's weights once, whatever tp."""
    from trainmesh.models.hf import build_on_meta
    from trainmesh.tensor_parallel import hf_check
    parts: list[tuple[torch.nn.Module, torch.nn.Module]] = []
    real = hf_check._rank_unit

    def rank_unit(unit, styles, rank, tp):
        parts.append((unit, real(unit, styles, rank, tp)))
        return parts[-1][1]
    monkeypatch.setattr(hf_check, "_rank_unit", rank_unit)
    hf_check.check_first_layer(build_on_meta(dirs["stablelm"]), 2)
    assert len(parts) == 4, len(parts)          # attention and MLP, 2 ranks each
    for unit, part in parts:
        held = {t.untyped_storage().data_ptr() for t in unit.parameters()}
        tensors = [t for m in part.modules() for t in (*m.parameters(recurse=False),
                   *(getattr(m, a) for a in ("weight", "bias")
                     if isinstance(getattr(m, a, None), torch.Tensor)))]
        copied = [tuple(t.shape) for t in tensors if t.untyped_storage().data_ptr() not in held]
        assert tensors and not copied, f"a rank's part holds copies of weights {copied}"
