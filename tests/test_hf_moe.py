"""Hugging Face mixture-of-experts directories (Mixtral, Qwen2-MoE) under `trainmesh train`.

transformers holds their experts stacked (``mlp.experts.gate_up_proj``, ``(E, 2h, d)``) and
``save_pretrained`` writes them one expert at a time (Mixtral ``block_sparse_moe.experts.{e}.w1``,
Qwen2-MoE ``mlp.experts.{e}.gate_proj``); trainmesh reads and exports them through transformers'
own conversion mapping. Tiny random models saved with ``save_pretrained`` (the Qwen one with 12
experts, so a file order that sorts expert 10 before expert 2 shows) are trained by one real
`python -m trainmesh train` launch each — Mixtral at dp 2 ZeRO-3, Qwen2-MoE at dp 2 ZeRO-2 with
2 microbatches — and compared with plain PyTorch training of the model ``from_pretrained`` loads:
the same batches, AdamW, warm-up and clipping, loss within LOSS_ABS and grad norm within
NORM_REL every step. The HF load-balancing loss is left out on both sides (trainmesh's loss is
the exact mean cross-entropy over the global batch). The Mixtral checkpoint resumes at dp 1 on
the reference's curve; both checkpoints export to directories ``from_pretrained`` loads with
exactly the checkpoint's tensors, written under the names ``save_pretrained`` writes.

Planted bugs this module catches (each seen failing with an assertion): experts ordered as
strings (expert 10 read as expert 2: ``test_weights_read_...`` and the Qwen run's loss, off by
4.7e-2 at step 1); the router's routing weights detached (the runs stop: the engine names the
router weights as receiving no gradient); the export writing the stacked names (key set).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_train, steps, summary
from tolerances import LOSS_ABS, NORM_REL

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, SEQ, BATCH = 4, 16, 4
SCHEDULE = STEPS + 2          # the runs stop after STEPS of a SCHEDULE-step schedule (resumed later)
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, tie_word_embeddings=False, num_experts_per_tok=2)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")    # read and written; the first two trained
LAYOUTS = {"mixtral": ["--dp", "2", "--zero", "3"],
           "qwen2_moe": ["--dp", "2", "--zero", "2", "--microbatches", "2"]}
BASE = ["--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(SCHEDULE),
        "--warmup-steps", "1", "--lr", "0.01", "--seed", "3"]


def moe_model(kind: str) -> torch.nn.Module:
    """A tiny random ``kind``; matrices drawn at std 0.2, not HF's 0.02, so that each expert's
    output, and so an expert read in another's place, shows in the loss."""
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=8,
                                             num_experts=12, head_dim=8)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=8,
                                             shared_expert_intermediate_size=24, num_experts=12)
        model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hfmoe")
    out = {}
    for kind in FAMILIES:
        moe_model(kind).save_pretrained(str(root / kind))
        out[kind] = str(root / kind)
    return out


def _config(directory: str, flags: list[str]):
    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    return build_train_config(collect(build_parser().parse_args(
        ["train", "--model-dir", directory, *BASE, *flags]), True))


def _reference(directory: str) -> list[tuple[float, float]]:
    """Plain PyTorch on the model ``from_pretrained`` loads: [(loss, grad norm)] per step."""
    from trainmesh import causal_lm_loss
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.optimizers import no_decay
    from trainmesh.run.schedule_lr import warmup_cosine
    cfg = _config(directory, [])
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).train()
    groups: dict[float, list] = {}
    for name, p in model.named_parameters():
        groups.setdefault(no_decay(name)["weight_decay"], []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()],
                            lr=cfg.peak_lr, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
    data, _ = make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=SEQ, held_out=False)
    curve = []
    for step in range(1, SCHEDULE + 1):
        loss_sum, count = causal_lm_loss(model, data.batch(cfg.seed, step, BATCH))
        (loss_sum / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.parallel.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        curve.append(((loss_sum / count).item(), float(norm)))
    return curve


@pytest.fixture(scope="module")
def runs(dirs, tmp_path_factory) -> dict[str, dict]:
    """One `trainmesh train` launch per family, and its reference."""
    out = {}
    for kind, layout in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(kind)
        save = str(tmp / "ckpt")
        proc, records = run_train(["--model-dir", dirs[kind], *BASE, *layout, "--save-dir", save,
                                   "--exit-after", str(STEPS)], tmp, timeout=240)
        out[kind] = {"proc": proc, "records": records, "save": save, "ref": _reference(dirs[kind])}
    return out


def _differences(ref, run, what: str, first: int = 1) -> list[str]:
    out = [] if run else [f"{what}: no steps"]
    for step, ((a, na), (b, nb)) in enumerate(zip(ref[first - 1:], run), first):
        if abs(a - b) > LOSS_ABS:
            out.append(f"{what} step {step}: loss {b} vs plain PyTorch {a}")
        if abs(na - nb) > NORM_REL * na:
            out.append(f"{what} step {step}: grad_norm {nb} vs plain PyTorch {na}")
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_moe_model_dir_trains_like_plain_pytorch(runs, kind):
    """Bugs: experts read in another order; the router's gradient dropped."""
    run = runs[kind]
    assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
    curve = [(r["loss"], r["grad_norm"]) for r in steps(run["records"])]
    assert len(curve) == STEPS, curve
    failures = _differences(run["ref"], curve, f"trainmesh train {' '.join(LAYOUTS[kind])}")
    assert not failures, "\n".join(failures)
    layout = summary(run["records"])["layout"]
    assert layout["dp"] == 2 and layout["zero"] == int(LAYOUTS[kind][3]), layout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_resumes_at_dp1_and_exports_what_from_pretrained_loads(runs, dirs, tmp_path):
    """Bugs: the export writing stacked names (not what save_pretrained writes) or experts in
    another order; a ZeRO-3 checkpoint of 3-D experts not resuming at dp 1."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from trainmesh.checkpoint.export_hf import export_hf
    from trainmesh.checkpoint.sharded import consolidate
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.trainer import build_engine
    for kind in LAYOUTS:
        assert runs[kind]["proc"].returncode == 0, runs[kind]["proc"].stderr[-3000:]
        whole = load_file(str(consolidate(runs[kind]["save"], tmp_path / f"{kind}.safetensors")))
        exported = export_hf(runs[kind]["save"], tmp_path / f"{kind}-hf")
        with safe_open(str(exported / "model.safetensors"), "pt") as f, \
                safe_open(str(Path(dirs[kind]) / "model.safetensors"), "pt") as g:
            assert sorted(f.keys()) == sorted(g.keys()), "export-hf wrote other names than save_pretrained"
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(exported), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        loaded = dict(model.named_parameters())
        assert sorted(loaded) == sorted(whole), (sorted(loaded), sorted(whole))
        for name, tensor in whole.items():
            assert torch.equal(loaded[name], tensor), f"{kind}: {name} differs after export-hf"
    # the Mixtral dp-2 ZeRO-3 checkpoint resumed by one process: the reference's next steps
    cfg = _config(dirs["mixtral"], [])
    engine = build_engine(cfg, torch.device("cpu"), ParallelMesh(local=True))
    engine.load(runs["mixtral"]["save"])
    data, _ = make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=SEQ, held_out=False)
    curve = []
    for step in range(STEPS + 1, SCHEDULE + 1):
        curve.append((engine.train_step(data.batch(cfg.seed, step, BATCH)), engine.last["grad_norm"]))
    failures = _differences(runs["mixtral"]["ref"], curve, "dp2 zero3 resumed at dp1", STEPS + 1)
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", FAMILIES)
def test_weights_read_under_the_models_names_equal_from_pretrained(dirs, kind):
    """Every parameter trainmesh builds from the directory, whole and a slice of it, equals
    what transformers' from_pretrained loads. Bug: experts ordered as strings (10 before 2)."""
    from trainmesh.engine.pretrained import check_model_dir, from_pretrained
    model = from_pretrained(dirs[kind])
    check_model_dir(dirs[kind], model)
    want = dict(transformers.AutoModelForCausalLM.from_pretrained(dirs[kind]).named_parameters())
    assert sorted(n for n, _ in model.named_parameters()) == sorted(want)
    for name, p in want.items():
        whole = tuple(slice(None) for _ in p.shape)
        assert torch.equal(model.init_parameter(name, tuple(p.shape), whole), p), name
        rows = (slice(1, 3), *whole[1:])
        assert torch.equal(model.init_parameter(name, tuple(p.shape), rows), p[1:3]), name


@pytest.mark.timeout(120)
def test_a_sharded_directory_reads_like_one_file(tmp_path):
    """``save_pretrained`` above ``max_shard_size`` writes shards and an index (as large MoE
    checkpoints come): read as the single file is; an index naming a file that is not there
    is a ConfigError naming --model-dir."""
    import json

    from trainmesh import ConfigError
    from trainmesh.engine.pretrained import check_model_dir, from_pretrained
    directory = tmp_path / "sharded"
    moe_model("qwen2_moe").save_pretrained(str(directory), max_shard_size="20KB")
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (directory / "model.safetensors").exists(), shards
    model = from_pretrained(str(directory))
    check_model_dir(str(directory), model)
    for name, p in transformers.AutoModelForCausalLM.from_pretrained(str(directory)).named_parameters():
        whole = tuple(slice(None) for _ in p.shape)
        assert torch.equal(model.init_parameter(name, tuple(p.shape), whole), p), name
    index = directory / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["lm_head.weight"] = "model-99999-of-99999.safetensors"
    index.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="model-99999") as err:
        from_pretrained(str(directory))
    assert err.value.field == "--model-dir"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", FAMILIES)
def test_weights_written_are_what_save_pretrained_writes(dirs, kind):
    """The export's conversion of a state dict under the model's names: the file
    ``save_pretrained`` wrote, name for name and tensor for tensor. Bugs: the stacked names
    written; experts split in another order or gate and up swapped."""
    import json

    from safetensors.torch import load_file

    from trainmesh.models.hf_weights import file_state
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[kind])
    config = json.loads(model.config.to_json_string(use_diff=False))
    state = {n: p.detach() for n, p in model.named_parameters()}
    written = file_state(config, state, field="DIR")
    want = load_file(str(Path(dirs[kind]) / "model.safetensors"))
    assert sorted(written) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(written[name], tensor), name


@pytest.mark.timeout(120)
def test_layouts_a_plan_cannot_honour_and_a_missing_expert_exit_2(dirs, tmp_path, capsys, monkeypatch):
    """Before any worker starts, exit 2 in one line naming the flag (and the family where its
    plan is the reason): --ep not dividing the experts; --ep for a dense model; an expert-parallel
    or an expert tensor-parallel style trainmesh does not map; a file lacking one expert."""
    from helpers import assert_refused
    from safetensors.torch import load_file, save_file
    mix = dirs["mixtral"]
    base = ["train", "--model-dir", mix, "--seq-len", str(SEQ), "--global-batch", "6"]
    assert "4 experts" in assert_refused(capsys, [*base, "--dp", "3", "--ep", "3"], "--ep")
    dense = tmp_path / "dense"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=SEQ)).save_pretrained(str(dense))
    capsys.readouterr()                                     # save_pretrained's progress bar
    line = assert_refused(capsys, ["train", "--model-dir", str(dense), "--seq-len", str(SEQ),
                                   "--global-batch", "4", "--dp", "2", "--ep", "2"], "--ep")
    assert "llama" in line and "none" in line, line
    ep_plan = dict(transformers.MixtralConfig.base_model_ep_plan)
    monkeypatch.setattr(transformers.MixtralConfig, "base_model_ep_plan",
                        {**ep_plan, "layers.*.mlp.experts": "ep_router"})
    line = assert_refused(capsys, [*base, "--dp", "2", "--ep", "2"], "--ep")
    assert "mixtral" in line and "ep_router" in line, line
    monkeypatch.setattr(transformers.MixtralConfig, "base_model_ep_plan", ep_plan)
    tp_plan = dict(transformers.MixtralConfig.base_model_tp_plan)
    monkeypatch.setattr(transformers.MixtralConfig, "base_model_tp_plan",
                        {**tp_plan, "layers.*.mlp.experts.down_proj": "packed_rowwise"})
    line = assert_refused(capsys, [*base, "--tp", "2"], "--tp")
    assert "mixtral" in line and "packed_rowwise" in line, line
    monkeypatch.setattr(transformers.MixtralConfig, "base_model_tp_plan", tp_plan)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((Path(mix) / "config.json").read_text())
    tensors = load_file(str(Path(mix) / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    line = assert_refused(capsys, ["train", "--model-dir", str(broken), "--seq-len", str(SEQ),
                                   "--global-batch", "4"], "--model-dir")
    assert "layers.1.mlp.experts.down_proj" in line, line
