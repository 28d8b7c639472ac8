"""Hugging Face GPT-2 and Llama under tensor parallelism, against one process.

Two launches — world 2 (tp 2) and world 4 (dp 2 x tp 2, ZeRO-1 for GPT-2, ZeRO-3 for Llama) —
each run both models back to back; every check in a rank reports its values or its traceback,
so a failure is an assertion here that names the check. The one-process references run in the
pytest process. Small configs, random init, nothing downloaded; Llama with grouped-query
attention (4 heads, 2 kv heads).

Checked: 10 AdamW steps under the automatic plan (``tm.hf_tp_plan``: GPT-2's fused ``Conv1D``
``c_attn`` split per q/k/v block, local head counts; Llama's ``parallel_input`` on
``LlamaAttention``, which Hugging Face calls with ``hidden_states=`` by keyword) follow the
one-process losses within 1e-3 and gradient norms within 1e-3 relative. A model saved with
``save_pretrained`` loads into tp 2 through ``tm.from_pretrained`` (and into dp 2 x tp 2 as
``trainmesh train --model-dir`` builds it), each rank reading only its slices, and gives the
unsharded model's first loss; at tp 2 its consolidated weights, and a checkpoint of them
(consolidated, or reloaded after a step), are the saved ones exactly. Plans refuse indivisible
head counts, and sequence parallelism for GPT-2 (no pipeline plan to place the sequence split);
``--model-dir`` refuses a missing directory or config.json before any worker starts.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tolerances import LOSS_ABS, NORM_REL, loss_one_step_atol

from trainmesh.testing import run_distributed

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, GLOBAL_BATCH, VOCAB, SEQ = 10, 8, 64, 16
KINDS = ("gpt2", "llama")
DP2_TP2 = {"gpt2": {"dp": 2, "tp": 2, "zero": 1}, "llama": {"dp": 2, "tp": 2, "zero": 3}}
TP2 = {kind: {"tp": 2} for kind in KINDS}


def hf_model(kind: str) -> torch.nn.Module:
    """A small, randomly initialised Hugging Face model without dropout."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      use_cache=False, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=SEQ, use_cache=False,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _batch(step: int, dp_rank: int = 0, dp: int = 1) -> dict[str, torch.Tensor]:
    from trainmesh.data.corpus import SyntheticCorpus, dp_slice
    return dp_slice(SyntheticCorpus(VOCAB, SEQ).batch(0, step, GLOBAL_BATCH), dp_rank, dp)


def _train(model: torch.nn.Module, layout: dict, mesh=None) -> dict[str, list[float]]:
    import trainmesh as tm
    engine = tm.Engine(model, _adamw, tm.causal_lm_loss, tm.ParallelConfig(**layout), mesh=mesh)
    dp_rank, dp = engine.mesh.index("dp"), engine.mesh.size("dp")
    losses, norms = [], []
    for k in range(STEPS):
        losses.append(engine.train_step(_batch(k, dp_rank, dp)))
        norms.append(engine.last["grad_norm"])
    return {"loss": losses, "grad_norm": norms}


def _load(directory: str, layout: dict) -> dict[str, Any]:
    """A saved model built on meta, each rank filled with its slices: its first loss and, at
    zero 0, the largest difference from the saved weights of its consolidated weights, and of
    them again after a step and a reload of a checkpoint written before it (``DIR-ckpt``)."""
    from safetensors.torch import load_file

    import trainmesh as tm
    if layout.get("zero", 0):    # as `trainmesh train --model-dir` builds it
        from trainmesh.config.train import build_train_config
        from trainmesh.run.trainer import build_model
        cfg = build_train_config({"model_dir": directory, "seq_len": SEQ, "global_batch": GLOBAL_BATCH,
                                  **layout})
        model, loss_fn, init_fn = build_model(cfg)
        engine = tm.Engine(model, _adamw, loss_fn, cfg.parallel, init_fn=init_fn)
    else:
        engine = tm.Engine(tm.from_pretrained(directory), _adamw, tm.causal_lm_loss,
                           tm.ParallelConfig(**layout))
    out: dict[str, Any] = {}
    saved = load_file(f"{directory}/model.safetensors")

    def diff() -> float:
        full = engine.full_state_dict()
        out["missing"] = sorted(set(saved) - set(full) - {"lm_head.weight"})   # tied to wte
        return max(float((full[k] - v).abs().max()) for k, v in saved.items() if k in full)

    at_zero0 = layout.get("zero", 0) == 0
    if at_zero0:
        out["weights_diff"] = diff()
        engine.save(f"{directory}-ckpt")
    out["first_loss"] = engine.train_step(_batch(0, engine.mesh.index("dp"), engine.mesh.size("dp")))
    if at_zero0:
        engine.load(f"{directory}-ckpt")
        out["reloaded_diff"] = diff()
    return out


def _checked(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return "FAILED\n" + traceback.format_exc()


def _rank(layouts: dict[str, dict], dirs: dict[str, str]) -> dict[str, Any]:
    """In every rank: train each model under its layout, then load each saved one."""
    out = {}
    for kind in KINDS:
        out[f"train {kind}"] = _checked(_train, hf_model(kind), layouts[kind])
        out[f"load {kind}"] = _checked(_load, dirs[kind], layouts[kind])
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Any]:
    """One process: each model's 10-step run, and the saved model's first loss."""
    from trainmesh import ParallelMesh
    root = tmp_path_factory.mktemp("hf")
    ref: dict[str, Any] = {"dirs": {}}
    for kind in KINDS:
        ref[kind] = _train(hf_model(kind), {}, mesh=ParallelMesh(local=True))
        directory = str(root / kind)
        hf_model(kind).save_pretrained(directory)
        unsharded = transformers.AutoModelForCausalLM.from_pretrained(directory)
        import trainmesh as tm
        with torch.no_grad():
            loss_sum, count = tm.causal_lm_loss(unsharded, _batch(0))
        ref[f"first {kind}"] = float(loss_sum) / count
        ref["dirs"][kind] = directory
    return ref


def _assert_matches(results: dict[int, dict], ref: dict[str, Any], layouts: dict[str, dict]) -> None:
    for rank, res in results.items():
        for check, value in res.items():
            assert not isinstance(value, str), f"rank {rank} {check}: {value}"
        for kind in KINDS:
            run, want = res[f"train {kind}"], ref[kind]
            for k in range(STEPS):
                what = f"rank {rank} {kind} {layouts[kind]} step {k + 1}"
                loss, norm = (run["loss"][k], want["loss"][k]), (run["grad_norm"][k], want["grad_norm"][k])
                assert abs(loss[0] - loss[1]) <= LOSS_ABS, f"{what}: loss {loss[0]} vs {loss[1]}"
                assert abs(norm[0] - norm[1]) <= NORM_REL * norm[1], f"{what}: grad_norm {norm[0]} vs {norm[1]}"
            assert want["loss"][0] - want["loss"][-1] > 0.1, f"{kind}: the reference does not learn"
            load, first = res[f"load {kind}"], ref[f"first {kind}"]
            assert abs(load["first_loss"] - first) <= loss_one_step_atol(first, GLOBAL_BATCH * SEQ), \
                f"rank {rank} {kind} loaded: first loss {load['first_loss']} vs unsharded {first}"
            if "weights_diff" in load:
                assert load["missing"] == [], f"rank {rank} {kind}: not in the model {load['missing']}"
                for diff in ("weights_diff", "reloaded_diff"):   # consolidated; after a reload
                    assert load[diff] == 0.0, f"rank {rank} {kind}: {diff} from the saved weights {load[diff]}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_models_under_tp2(references):
    from safetensors.torch import load_file

    from trainmesh.checkpoint.sharded import consolidate
    results = run_distributed(_rank, 2, TP2, references["dirs"], timeout_s=120)
    _assert_matches(results, references, TP2)
    for kind, directory in references["dirs"].items():   # the checkpoint holds the saved weights
        whole = load_file(consolidate(f"{directory}-ckpt", f"{directory}-whole.safetensors"))
        for name, value in load_file(f"{directory}/model.safetensors").items():
            if name in whole or name != "lm_head.weight":                # GPT-2's is wte's
                assert torch.equal(whole[name], value), f"{kind} checkpoint: {name}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_models_under_dp2_tp2(references):
    results = run_distributed(_rank, 4, DP2_TP2, references["dirs"], timeout_s=120)
    _assert_matches(results, references, DP2_TP2)


# ---------------------------------------------------------------- refused before any communication
class _FakeMesh:
    def __init__(self, tp: int) -> None:
        self.tp = tp

    def size(self, axis: str) -> int:
        return self.tp


def test_plans_refuse_indivisible_heads_and_sequence_parallel():
    from trainmesh import ConfigError
    from trainmesh.tensor_parallel import hf_tp_plan, parallelize
    llama = hf_model("llama")                 # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="num_key_value_heads = 2 is not divisible by --tp 4") as err:
        parallelize(llama, _FakeMesh(4), None)  # type: ignore[arg-type]
    assert err.value.field == "tp"
    with pytest.raises(ConfigError, match="gpt2 family declares no pipeline plan") as err:
        parallelize(hf_model("gpt2"), _FakeMesh(2), None, sequence_parallel=True)  # type: ignore[arg-type]
    assert err.value.field == "--sequence-parallel"
    assert hf_tp_plan(llama)["model.layers.*.self_attn"] == ("parallel_input", "local_heads")
    assert hf_tp_plan(llama)["model.layers.*.self_attn.q_proj"] == "colwise"   # as Llama declares
    with pytest.raises(ValueError, match="no Hugging Face tensor-parallel plan"):
        hf_tp_plan(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------- trainmesh train --model-dir
LAUNCHED = 99


@pytest.fixture
def no_launch(monkeypatch):
    """Validation only: no worker ever starts; the process is a launcher, not a worker."""
    import trainmesh.run.launch
    monkeypatch.setattr(trainmesh.run.launch, "launch_local", lambda *a, **k: LAUNCHED)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def test_model_dir_bad_input_exits_2_naming_the_flag(references, no_launch, tmp_path, capsys):
    import shutil

    from trainmesh.cli import main
    llama = references["dirs"]["llama"]
    no_weights = tmp_path / "no_weights"
    shutil.copytree(llama, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    (tmp_path / "empty").mkdir()
    base = ["train", "--seq-len", "16", "--global-batch", "8", "--steps", "2"]
    cases = [(["--model-dir", str(tmp_path / "absent")], "--model-dir", "no such directory"),
             (["--model-dir", str(tmp_path / "empty")], "--model-dir", "no config.json"),
             (["--model-dir", str(no_weights)], "--model-dir", "model.safetensors"),
             (["--model-dir", llama, "--strategy", "ps"], "--strategy", "trains the built-in GPT"),
             (["--model-dir", llama, "--tp", "4"], "--tp", "2 key/value heads"),
             (["--model-dir", llama, "--seq-len", "32"], "--seq-len", "16 positions"),
             (["--model-dir", llama, "--layers", "2"], "--layers", "set by --model-dir")]
    for args, flag, words in cases:
        code = main([*base, *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (args, code, err)
        assert f"error: {flag}:" in err[0], (args, err)
        assert words in err[0] and "Traceback" not in err[0], (args, err)
    assert main([*base, "--model-dir", llama, "--tp", "2"]) == LAUNCHED   # a valid one passes
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    cfg = build_train_config(collect(build_parser().parse_args([*base, "--model-dir", llama]), True))
    assert cfg.vocab_size == VOCAB
    assert cfg.num_params() == sum(p.numel() for p in hf_model("llama").parameters())
