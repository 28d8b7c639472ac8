"""Hugging Face mixture-of-experts directories (Mixtral, Qwen2-MoE, Qwen3-MoE) under `trainmesh train`.

transformers holds their experts stacked (``mlp.experts.gate_up_proj``, ``(E, 2h, d)``) and
``save_pretrained`` writes them one expert at a time (Mixtral ``block_sparse_moe.experts.{e}.w1``,
Qwen2-MoE ``mlp.experts.{e}.gate_proj``); trainmesh reads and exports them through transformers'
own conversion mapping. Tiny random models saved with ``save_pretrained`` (the Qwen2 one with 12
experts, so a file order that sorts expert 10 before expert 2 shows), asking for their router's
aux loss (``output_router_logits``, ``router_aux_loss_coef``), are trained by real
`python -m trainmesh train` launches, one per layout:

- Mixtral and Qwen3-MoE at ``--dp 2 --ep 2``, ``--dp 2 --zero 3 --ep 2`` (experts spread over ep
  from ``base_model_ep_plan``, tokens dispatched by all-to-all) and ``--tp 2`` (the stacked
  experts split by the ``moe_tp_experts`` styles transformers 5.24 declares, whole on every TP
  rank under 5.25's plans), ``--cp 2`` (each sequence's slot counts summed over cp), ``--tp 2
  --sequence-parallel`` (router and whole experts on the rank's chunk, counts summed over tp)
  and ``--pp 2 --microbatches 2`` (each stage's routing carried to the last with the hidden states);
- Qwen2-MoE (a gated shared expert, dense) at ``--dp 2 --tp 2 --ep 2 --zero 2 --microbatches 2``
  (the experts spread over ep and whole on every TP rank, the attention split over tp).

Each is compared, every step, with the single process (the engine `trainmesh train` builds at
one process, run here): loss within LOSS_ABS, grad norm within NORM_REL, and the router aux loss
(``moe.aux_loss``) within LOSS_ABS — the same number under every layout. The single process is
compared the same way with plain PyTorch on the model ``from_pretrained`` loads: the same
batches, AdamW, warm-up and clipping, the objective cross-entropy + ``router_aux_loss_coef`` x the
mean over sequences of transformers' own ``load_balancing_loss_func`` on each sequence. The
ZeRO-3 ep checkpoints resume at dp 1 on the single process's curve; the checkpoints export to
directories ``from_pretrained`` loads with exactly the checkpoint's tensors, under the names
``save_pretrained`` writes.

Planted bugs this module catches (each seen failing with an assertion): experts ordered as
strings (expert 10 read as expert 2: ``test_weights_read_...`` and the Qwen2 run's loss, off by
4.7e-2 at step 1); the router's routing weights detached (the runs stop: the engine names the
router weights as receiving no gradient); the export writing the stacked names (key set);
experts reduced over dp instead of edp (the Mixtral ep run: grad norm 1.1e-3 relative at step
1, loss 1.3e-2 at step 2); the shared expert placed as a routed expert, reduced over edp (the
Qwen2 run: grad norm 1.9e-3 relative at step 1); the aux loss formed over a rank's batch, not
per sequence, or left out of the gradient (the single process against plain PyTorch: aux 8.4 vs
2.2, or the grad norm, at step 1); the slot counts not summed over cp (Mixtral cp 2: aux 2.2437
vs 2.2331 at step 1), nor over tp under sequence parallelism (Qwen3-MoE: aux 2.787 vs 2.683 at step 1); under pp
the first stage's probability sums dropped (aux 0.0), its slot counts not carried (aux 0.0), or
its sums carried without their gradient (Mixtral: grad norm 3.8834 vs 3.8918 at step 1); the
carry packed in bf16 (the boundary test: a count of 12289 arrives as 12288).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import run_train, saved_models, steps, summary, train_config, widened
from tolerances import LOSS_ABS, NORM_REL, fp32_atol, scale_of

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, SEQ, BATCH = 4, 16, 4
SCHEDULE = STEPS + 2          # the runs stop after STEPS of a SCHEDULE-step schedule (resumed later)
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
              pad_token_id=0, tie_word_embeddings=False, num_experts_per_tok=2,
              output_router_logits=True, router_aux_loss_coef=0.05)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
LAYOUTS = {"mixtral ep": ["--dp", "2", "--ep", "2"],
           "mixtral zero3 ep": ["--dp", "2", "--zero", "3", "--ep", "2"],
           "mixtral tp": ["--tp", "2"],
           "qwen3_moe ep": ["--dp", "2", "--ep", "2", "--recompute", "selective"],
           "qwen3_moe zero3 ep": ["--dp", "2", "--zero", "3", "--ep", "2"],
           "qwen3_moe tp": ["--tp", "2"],
           "qwen2_moe tp ep zero2": ["--dp", "2", "--tp", "2", "--ep", "2", "--zero", "2",
                                     "--microbatches", "2"],
           "mixtral cp": ["--cp", "2"],
           "mixtral tp sp": ["--tp", "2", "--sequence-parallel"],
           "mixtral pp": ["--pp", "2", "--microbatches", "2"],
           "qwen3_moe cp": ["--cp", "2"],
           "qwen3_moe tp sp": ["--tp", "2", "--sequence-parallel"],
           "qwen3_moe pp": ["--pp", "2", "--microbatches", "2"]}
SAVED = ("mixtral zero3 ep", "qwen3_moe zero3 ep", "mixtral tp", "qwen2_moe tp ep zero2")
"""The runs that save a checkpoint (resumed, exported)."""
BASE = ["--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(SCHEDULE),
        "--warmup-steps", "1", "--lr", "0.01", "--seed", "3"]


def _kind(run: str) -> str:
    return run.split()[0]


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
    return widened(model)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return saved_models(tmp_path_factory, "hfmoe", moe_model, FAMILIES)


def _config(directory: str, flags: list[str]):
    return train_config(["--model-dir", directory, *BASE, *flags])


def _data(cfg):
    from trainmesh.data.corpus import make_datasets
    return make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=SEQ, held_out=False)[0]


def _sequence_aux(model, router_logits) -> torch.Tensor:
    """transformers' own load-balancing loss of the model's family, on each sequence alone
    (the MoE layers' logits of its tokens), averaged over the batch."""
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    per_sequence = [balance(tuple(layer.view(BATCH, SEQ, -1)[b] for layer in router_logits),
                            model.num_experts, model.num_experts_per_tok) for b in range(BATCH)]
    return torch.stack(per_sequence).mean()


def _reference(directory: str) -> list[tuple[float, float, float]]:
    """Plain PyTorch on the model ``from_pretrained`` loads: [(cross-entropy, grad norm, aux)]
    per step, the objective cross-entropy + router_aux_loss_coef x aux."""
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
    data = _data(cfg)
    curve = []
    for step in range(1, SCHEDULE + 1):
        batch = data.batch(cfg.seed, step, BATCH)
        out = model(input_ids=batch["input_ids"], output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten())
        aux = _sequence_aux(model, out.router_logits)
        (loss + model.config.router_aux_loss_coef * aux).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.parallel.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        curve.append((loss.item(), float(norm), aux.item()))
    return curve


def _one_process(directory: str, first: int = 1, checkpoint: str | None = None
                 ) -> list[tuple[float, float, float]]:
    """The engine `trainmesh train` builds at one process (here, in this process), from step
    ``first`` (after loading ``checkpoint``) to the end of the schedule."""
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.run.trainer import build_engine
    cfg = _config(directory, [])
    engine = build_engine(cfg, torch.device("cpu"), ParallelMesh(local=True))
    if checkpoint is not None:
        engine.load(checkpoint)
    data = _data(cfg)
    curve = []
    for step in range(first, SCHEDULE + 1):
        loss = engine.train_step(data.batch(cfg.seed, step, BATCH))
        curve.append((loss, engine.last["grad_norm"], engine.last["moe"]["aux_loss"]))
    return curve


@pytest.fixture(scope="module")
def references(dirs) -> dict[str, dict]:
    """Per family: plain PyTorch and the single process."""
    return {kind: {"plain": _reference(dirs[kind]), "one": _one_process(dirs[kind])} for kind in FAMILIES}


@pytest.fixture(scope="module")
def runs(dirs, tmp_path_factory) -> dict[str, dict]:
    """One `trainmesh train` launch per layout (the SAVED ones with a checkpoint)."""
    out = {}
    for run, layout in LAYOUTS.items():
        tmp = tmp_path_factory.mktemp(run.replace(" ", "-"))
        save = ["--save-dir", str(tmp / "ckpt")] if run in SAVED else []
        proc, records = run_train(["--model-dir", dirs[_kind(run)], *BASE, *layout, *save,
                                   "--exit-after", str(STEPS)], tmp, timeout=240)
        out[run] = {"proc": proc, "records": records, "save": str(tmp / "ckpt")}
    return out


def _differences(ref, run, what: str, first: int = 1) -> list[str]:
    out = [] if run else [f"{what}: no steps"]
    for step, ((a, na, xa), (b, nb, xb)) in enumerate(zip(ref[first - 1:], run), first):
        if abs(a - b) > LOSS_ABS:
            out.append(f"{what} step {step}: loss {b} vs {a}")
        if abs(na - nb) > NORM_REL * na:
            out.append(f"{what} step {step}: grad_norm {nb} vs {na}")
        if abs(xa - xb) > LOSS_ABS:
            out.append(f"{what} step {step}: router aux loss {xb} vs {xa}")
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", FAMILIES)
def test_one_process_trains_like_plain_pytorch(references, kind):
    """Bugs: the aux loss left out of the gradient, or formed over the batch, not per sequence."""
    ref = references[kind]
    failures = _differences(ref["plain"], ref["one"], f"{kind} one process vs plain PyTorch")
    assert not failures, "\n".join(failures)
    assert ref["plain"][0][2] > 1.0, "the aux loss is E * sum f P >= 1: not computed"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", list(LAYOUTS))
def test_layouts_train_like_one_process(runs, references, run):
    """Bugs: experts read in another order; the router's gradient dropped; experts reduced over
    dp, not edp; the shared expert marked as an expert; the aux loss per rank, not per sequence;
    a sequence's counts not summed over cp, or over tp under sequence parallelism; a pipeline
    stage's routing not carried to the last."""
    result = runs[run]
    assert result["proc"].returncode == 0, result["proc"].stderr[-3000:]
    curve = [(r["loss"], r["grad_norm"], r["moe"]["aux_loss"]) for r in steps(result["records"])]
    assert len(curve) == STEPS, curve
    failures = _differences(references[_kind(run)]["one"], curve,
                            f"trainmesh train {' '.join(LAYOUTS[run])} vs one process")
    assert not failures, "\n".join(failures)
    layout, given = summary(result["records"])["layout"], LAYOUTS[run]
    flags = {f[2:].replace("-", "_"): True if v.startswith("--") else int(v) if v.isdigit() else v
             for f, v in zip(given, [*given[1:], "--"]) if f.startswith("--")}
    assert all(layout[f] == v for f, v in flags.items()), layout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_resume_at_dp1_and_export_what_from_pretrained_loads(runs, references, dirs, tmp_path):
    """Bugs: the export writing stacked names (not what save_pretrained writes) or experts in
    another order; a checkpoint of experts split over ep (ZeRO-3) not resuming at dp 1."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from trainmesh.checkpoint.export_hf import export_hf
    from trainmesh.checkpoint.sharded import consolidate
    for run in SAVED:
        assert runs[run]["proc"].returncode == 0, runs[run]["proc"].stderr[-3000:]
        name = run.replace(" ", "-")
        whole = load_file(str(consolidate(runs[run]["save"], tmp_path / f"{name}.safetensors")))
        exported = export_hf(runs[run]["save"], tmp_path / f"{name}-hf")
        with safe_open(str(exported / "model.safetensors"), "pt") as f, \
                safe_open(str(Path(dirs[_kind(run)]) / "model.safetensors"), "pt") as g:
            assert sorted(f.keys()) == sorted(g.keys()), f"{run}: export-hf wrote other names than save_pretrained"
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(exported), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        loaded = dict(model.named_parameters())
        assert sorted(loaded) == sorted(whole), (sorted(loaded), sorted(whole))
        for key, tensor in whole.items():
            assert torch.equal(loaded[key], tensor), f"{run}: {key} differs after export-hf"
    for run in [r for r in SAVED if r.endswith("zero3 ep")]:   # ep 2 ZeRO-3 -> one process
        kind = _kind(run)
        curve = _one_process(dirs[kind], STEPS + 1, runs[run]["save"])
        failures = _differences(references[kind]["one"], curve, f"{run} resumed at dp1", STEPS + 1)
        assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", FAMILIES)
def test_weights_read_under_the_models_names_equal_from_pretrained(dirs, kind):
    """Every parameter trainmesh builds from the directory, whole and a slice of it, equals
    what transformers' from_pretrained loads. Bug: experts ordered as strings (10 before 2)."""
    from trainmesh.core.hub_state import init_of
    from trainmesh.engine.pretrained import check_model_dir, from_pretrained
    model = from_pretrained(dirs[kind])
    check_model_dir(dirs[kind], model)
    read = init_of(model)
    want = dict(transformers.AutoModelForCausalLM.from_pretrained(dirs[kind]).named_parameters())
    assert sorted(n for n, _ in model.named_parameters()) == sorted(want)
    for name, p in want.items():
        whole = tuple(slice(None) for _ in p.shape)
        assert torch.equal(read(name, tuple(p.shape), whole), p), name
        rows = (slice(1, 3), *whole[1:])
        assert torch.equal(read(name, tuple(p.shape), rows), p[1:3]), name


def test_trainmesh_sets_no_attribute_on_a_hub_model(dirs):
    """What trainmesh records of a hub model it builds (its plans' sources, its weights reader,
    its router's MoE statistics) is the model's typed HubState: every module of the model
    ``tm.from_pretrained`` builds holds only attributes transformers' own ``from_pretrained``
    gives it (less its loading bookkeeping); the views of it the pipeline makes read its
    record."""
    import trainmesh as tm
    from trainmesh.core.hub_state import init_of, moe_stats_of, recorded
    from trainmesh.models.moe import MoEStats
    model = tm.from_pretrained(dirs["mixtral"])
    theirs = dict(transformers.AutoModelForCausalLM.from_pretrained(dirs["mixtral"]).named_modules())
    added = {name: sorted(set(vars(m)) - set(vars(theirs[name])) - {"_is_hf_initialized"})
             for name, m in model.named_modules()}
    assert not any(added.values()), {n: a for n, a in added.items() if a}
    state = recorded(model)
    assert state is not None and state.plan_sources == {"tp": "declared", "pp": "declared",
                                                         "ep": "declared"}, state
    assert init_of(model) is state.init and isinstance(moe_stats_of(model), MoEStats)
    assert (state.moe_stats.n_layers, state.moe_stats.n_experts) == (2, 4), vars(state.moe_stats)
    # the pipeline's view of the model, and the last stage's that loss_fn is handed, share it
    from trainmesh.models.hf_router import attach_router_stats
    from trainmesh.pipeline_parallel.hf import HFPipeline
    from trainmesh.pipeline_parallel.stage import LastStageModel
    view = LastStageModel(HFPipeline(model), torch.zeros(0), {})
    assert recorded(view) is state and moe_stats_of(view) is state.moe_stats, recorded(view)
    assert attach_router_stats(view) is state.moe_stats


@pytest.mark.timeout(120)
def test_a_sharded_directory_reads_like_one_file(tmp_path):
    """``save_pretrained`` above ``max_shard_size`` writes shards and an index (as large MoE
    checkpoints come): read as the single file is; an index naming a file that is not there
    is a ConfigError naming --model-dir."""
    import json

    from trainmesh import ConfigError
    from trainmesh.core.hub_state import init_of
    from trainmesh.engine.pretrained import check_model_dir, from_pretrained
    directory = tmp_path / "sharded"
    moe_model("qwen2_moe").save_pretrained(str(directory), max_shard_size="20KB")
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    assert len(shards) > 1 and not (directory / "model.safetensors").exists(), shards
    model = from_pretrained(str(directory))
    check_model_dir(str(directory), model)
    for name, p in transformers.AutoModelForCausalLM.from_pretrained(str(directory)).named_parameters():
        whole = tuple(slice(None) for _ in p.shape)
        assert torch.equal(init_of(model)(name, tuple(p.shape), whole), p), name
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
    plan is the reason): --ep not dividing the experts; --sequence-parallel with the experts
    spread over ep (whole on every TP rank, outside any region); --ep for a dense model; an
    expert-parallel or an expert tensor-parallel style trainmesh does not map; a file lacking
    one expert."""
    from helpers import assert_refused
    from safetensors.torch import load_file, save_file
    mix = dirs["mixtral"]
    base = ["train", "--model-dir", mix, "--seq-len", str(SEQ), "--global-batch", "6"]
    assert "4 experts" in assert_refused(capsys, [*base, "--dp", "3", "--ep", "3"], "--ep")
    line = assert_refused(capsys, [*base, "--dp", "2", "--tp", "2", "--ep", "2",
                                   "--sequence-parallel"], "--sequence-parallel")
    assert "mixtral" in line and "--ep 1" in line, line
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


@pytest.mark.timeout(120)
def test_sequence_aux_is_transformers_loss_per_sequence_and_splits_over_ranks(dirs):
    """The per-sequence aux (models/hf_router.py) is transformers' own load_balancing_loss_func
    on each sequence alone; the same sequences cut in two halves (as two ranks of context
    parallelism hold them), their counts summed over the halves, give shares that add up to it,
    with the same gradient. Bug: the rows or counts of one half only."""
    from trainmesh.core.hf_routing import sequence_routing
    from trainmesh.models.hf_router import sequence_aux
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["mixtral"])
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids, output_router_logits=True).router_logits     # L x (b s, E)
    layers, k = len(logits), model.config.num_experts_per_tok
    slots, probs, per_layer = sequence_routing(logits, BATCH, k)
    rows = torch.full((BATCH,), float(layers * SEQ))
    whole, _ = sequence_aux(slots, probs, rows)
    want = _sequence_aux(model, logits).detach()
    budget = fp32_atol(float(want), layers * SEQ)          # two summation orders of L s terms
    assert abs(float(whole.detach().mean()) - float(want)) <= budget, (whole, want)
    assert per_layer.sum() == layers * BATCH * SEQ * k
    (grad_whole,) = torch.autograd.grad(whole.sum(), logits[0], retain_graph=True)
    halves = [tuple(layer.view(BATCH, SEQ, -1)[:, h * SEQ // 2:(h + 1) * SEQ // 2].reshape(-1, layer.shape[-1])
                    for layer in logits) for h in (0, 1)]
    stats = [sequence_routing(half, BATCH, k) for half in halves]

    class OverHalves:              # what an all-reduce over the two halves gives one of them
        parts = 2

        def __init__(self, other: int) -> None:
            self.other = torch.cat([stats[other][0], (rows / 2).unsqueeze(-1)], -1)  # (b, E + 1)

        def __call__(self, t: torch.Tensor) -> None:
            t += self.other

    shares = [sequence_aux(sl, pr, rows / 2, OverHalves(1 - h))[0] for h, (sl, pr, _) in enumerate(stats)]
    assert torch.allclose(shares[0] + shares[1], whole, rtol=0, atol=budget), (shares, whole)
    (grad_split,) = torch.autograd.grad((shares[0] + shares[1]).sum(), logits[0])
    assert torch.allclose(grad_split, grad_whole, rtol=0, atol=fp32_atol(scale_of([grad_whole]), 2))


@pytest.mark.timeout(60)
def test_a_pipeline_boundary_carries_the_routing_exactly_with_its_gradient():
    """The routing a stage sends on with its hidden states (pipeline_parallel/hf_routing.py)
    comes off the next stage as it went in — the counts exact past bf16's integers, the hidden
    states in their own dtype — and the probability sums carry their gradient back. Bug: the
    carry packed in the hidden states' dtype (bf16 rounds the counts)."""
    from trainmesh.core.hf_routing import Routing
    from trainmesh.pipeline_parallel.hf_routing import pack, unpack
    experts = 12
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(2, 5, 8).to(dtype)
        probs = torch.rand(2, experts, requires_grad=True)
        slots = torch.full((2, experts), 3.0 * 4096 + 1)       # no bf16 holds 12289
        rows = torch.full((2,), 3.0 * 4096)
        out_hidden, routing = unpack(pack(hidden, Routing(slots, probs, rows)), experts)
        assert out_hidden.dtype == dtype and torch.equal(out_hidden, hidden), dtype
        for got, want in ((routing.slots, slots), (routing.rows, rows), (routing.probs, probs)):
            assert torch.equal(got, want), (dtype, got, want)
        weight = torch.randn(2, experts)
        (routing.probs * weight).sum().backward()
        assert torch.equal(probs.grad, weight), dtype
