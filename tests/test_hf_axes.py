"""Hugging Face models on the pipeline, context and sequence-parallel axes and under selective
recomputation, from the plans they declare (`trainmesh train --model-dir`).

Tiny random Llama and Qwen3 (grouped-query attention: 4 heads, 2 key/value heads; Qwen3's
per-head q/k norms), matrices drawn at std 0.2 so attention is far from uniform and a position
or a key read in another's place shows in the loss, saved with ``save_pretrained``. For each:

- plain PyTorch on the model ``from_pretrained`` loads (AdamW, the trainer's warm-up, no decay
  on norms and biases, clipping) against the one-process engine ``trainmesh train`` builds (in
  this process): loss and grad norm every step;
- one real `trainmesh train` launch per layout — ``--pp 2 --microbatches 2``, ``--cp 2``,
  ``--tp 2 --sequence-parallel``, ``--dp 2 --recompute selective`` — against that one-process
  run, each writing a checkpoint at step STEPS of a SCHEDULE-step run;
- each checkpoint resumed by one process (another layout) on the reference's curve, and
  exported by ``checkpoint export-hf`` to a directory ``from_pretrained`` loads with the
  checkpoint's weights (the same logits as those weights in the model).

In this process (no launch): a pipeline's stages composed by hand give the whole model's
logits for Llama, Qwen3 and Gemma2 (its scaled embeddings, per-layer sliding masks and
soft-capped logits are the model's own code) with positions that do not start at 0; selective
recomputation runs every attention call twice; families whose plans cannot be honoured exit 2
before any worker, naming family and axis.

Planted bugs this module catches (each seen failing with an assertion): rotary positions local
to the chunk under cp (the positions hook removed: ``--cp 2`` run, loss at step 1); a pipeline
stage dropping the position state (the batch's positions not passed to the model's forward on
a stage: the composed stages' logits); the sequence-parallel norms' gradients not summed over
tp (grad norm); selective recomputation not checkpointing (attention calls counted).
"""
from __future__ import annotations

import pytest
import torch
from helpers import LAUNCHED, run_train, saved_models, step_differences, steps, train_config, widened

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, SEQ, BATCH, VOCAB = 4, 16, 4, 64
SCHEDULE = STEPS + 2          # the runs stop after STEPS of a SCHEDULE-step schedule (resumed later)
FAMILIES = ("llama", "qwen3")
LAYOUTS = {"pp2": ["--pp", "2", "--microbatches", "2"], "cp2": ["--cp", "2"],
           "tp2-sp": ["--tp", "2", "--sequence-parallel"],
           "dp2-selective": ["--dp", "2", "--recompute", "selective"]}
BASE = ["--seq-len", str(SEQ), "--global-batch", str(BATCH), "--steps", str(SCHEDULE),
        "--warmup-steps", "1", "--lr", "0.01", "--seed", "3"]
LOGITS_ABS = 1e-4
"""The same weights through the same kernels in another grouping (stages, a reloaded copy):
float32 rounding of sums of ~32-64 terms of magnitude ~1 is ~1e-6, x100 headroom. A position
or a weight read in another's place moves logits by ~1e-1 at std-0.2 weights."""


def family_model(kind: str, **extra) -> torch.nn.Module:
    """A tiny random causal LM of ``kind`` (matrices at std 0.2: attention far from uniform)."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4 * SEQ, "bos_token_id": 0, "eos_token_id": 0,
              "pad_token_id": 0, "tie_word_embeddings": False}
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    if kind in ("qwen3", "gemma2"):
        common["head_dim"] = 8
    model = model_cls(config_cls(**{**common, **extra}))
    return widened(model)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return saved_models(tmp_path_factory, "hfaxes", family_model, FAMILIES)


def _config(directory: str, flags: list[str]):
    return train_config(["--model-dir", directory, *BASE, *flags])


def _plain(directory: str) -> list[tuple[float, float]]:
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


def _one_process(directory: str, first: int = 1, load: str | None = None) -> list[tuple[float, float]]:
    """The engine `trainmesh train --model-dir` builds, in one process (this one): steps
    ``first``..SCHEDULE, after loading the checkpoint ``load`` if given."""
    from trainmesh.core.mesh import ParallelMesh
    from trainmesh.data.corpus import make_datasets
    from trainmesh.run.trainer import build_engine
    cfg = _config(directory, [])
    engine = build_engine(cfg, torch.device("cpu"), ParallelMesh(local=True))
    if load is not None:
        engine.load(load)
    data, _ = make_datasets(cfg.data, vocab_size=cfg.vocab_size, seq_len=SEQ, held_out=False)
    return [(engine.train_step(data.batch(cfg.seed, step, BATCH)), engine.last["grad_norm"])
            for step in range(first, SCHEDULE + 1)]


@pytest.fixture(scope="module")
def runs(dirs, tmp_path_factory):
    """``runs(kind, layout)``: the `trainmesh train` launch of that family and layout, stopped
    after STEPS with a checkpoint (launched once, when a test first asks for it)."""
    out: dict[tuple[str, str], dict] = {}

    def get(kind: str, layout: str) -> dict:
        if (kind, layout) not in out:
            tmp = tmp_path_factory.mktemp(f"{kind}-{layout}")
            save = str(tmp / "ckpt")
            proc, records = run_train(["--model-dir", dirs[kind], *BASE, *LAYOUTS[layout],
                                       "--save-dir", save, "--exit-after", str(STEPS)],
                                      tmp, timeout=240)
            out[kind, layout] = {"proc": proc, "records": records, "save": save}
        return out[kind, layout]
    return get


@pytest.fixture(scope="module")
def references(dirs) -> dict[str, list[tuple[float, float]]]:
    return {kind: _one_process(dirs[kind]) for kind in FAMILIES}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", FAMILIES)
def test_one_process_trains_like_plain_pytorch(dirs, references, kind):
    failures = step_differences(_plain(dirs[kind]), references[kind], f"{kind} one process vs plain PyTorch")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", FAMILIES)
def test_layout_trains_like_one_process(runs, references, kind, layout):
    """Bugs: rotary positions local to the chunk under cp; the sequence-parallel norms'
    gradients not summed over tp; a stage without the position state (the run fails)."""
    run = runs(kind, layout)
    assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
    curve = [(r["loss"], r["grad_norm"]) for r in steps(run["records"])]
    assert len(curve) == STEPS, curve
    failures = step_differences(references[kind], curve, f"{kind} {' '.join(LAYOUTS[layout])}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", FAMILIES)
def test_checkpoints_resume_in_one_process_and_export(runs, references, dirs, kind, tmp_path):
    """Each layout's checkpoint continues the reference's curve in one process; export-hf
    writes what from_pretrained loads, with the checkpoint's weights (the same logits)."""
    from safetensors.torch import load_file

    from trainmesh.checkpoint.export_hf import export_hf
    from trainmesh.checkpoint.sharded import consolidate
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    for layout in LAYOUTS:
        run = runs(kind, layout)
        assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
        resumed = _one_process(dirs[kind], STEPS + 1, load=run["save"])
        failures = step_differences(references[kind], resumed, f"{kind} {layout} resumed", STEPS + 1)
        assert not failures, "\n".join(failures)
        whole = load_file(str(consolidate(run["save"], tmp_path / f"{layout}.safetensors")))
        exported, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(export_hf(run["save"], tmp_path / f"{layout}-hf")), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (layout, info)
        plain = family_model(kind).eval()
        assert not torch.equal(whole["model.norm.weight"], plain.model.norm.weight), "did not train"
        plain.load_state_dict(whole)
        with torch.no_grad():
            err = float((exported.eval()(ids).logits - plain(ids).logits).abs().max())
        assert err <= LOGITS_ABS, f"{kind} {layout}: exported logits off by {err}"


# ---------------------------------------------------------------- in this process
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma2"])
def test_pipeline_stages_compose_to_the_whole_model(kind):
    """The stages' layers, run stage by stage as the pipeline runs them (each computing the
    position state from the microbatch), give the model's own logits; positions 0..7, 24..31
    here (rotary embeddings see only differences: a shift would hide a stage that drops them;
    transformers also reads the jump as a second packed sequence, masked apart). Gemma2: half
    its layers sliding-window (window 4), scaled embeddings, soft-capped logits. Bug: a stage
    dropping the position state (the batch's positions not reaching the model's forward there:
    0..15)."""
    from trainmesh.pipeline_parallel.hf import HFPipeline
    from trainmesh.pipeline_parallel.partition import named_pipeline_layers
    extra = {"sliding_window": 4, "num_hidden_layers": 4} if kind == "gemma2" else {}
    model = family_model(kind, **extra).eval()
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(SEQ // 2), torch.arange(3 * SEQ // 2, 2 * SEQ)])[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        view = HFPipeline(model)
        layers = named_pipeline_layers(view)
        names = [n for n, _ in layers]
        assert names[0] == "model.embed_tokens" and names[-2:] == ["model.norm", "lm_head"], names
        x = view.pipeline_input(batch)
        for cut in ((0, 2), (2, 3), (3, len(layers))):      # embed + layer 0 | layer 1 | rest
            part = layers[cut[0]:cut[1]]
            x = view.pipeline_forward([n for n, _ in part], [m for _, m in part], x, batch)
        got = view.pipeline_output(x, input_ids=ids, labels=ids)
    assert got.loss is not None
    err = float((got.logits - want).abs().max())
    assert err <= LOGITS_ABS, f"{kind}: the stages' logits differ from the model's by {err}"


def test_selective_recompute_checkpoints_the_attention_call():
    """Under --recompute selective every attention call runs again in the backward (2 per
    layer and microbatch), the model's own implementation (sdpa) inside; without, once."""
    from transformers.modeling_utils import AttentionInterface

    import trainmesh as tm
    from trainmesh.core.mesh import ParallelMesh
    sdpa = AttentionInterface._global_mapping["sdpa"]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    ids = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    counts = {}
    AttentionInterface._global_mapping["sdpa"] = counted
    try:
        for mode in ("none", "selective"):
            model = family_model("llama")
            assert model.config._attn_implementation == "sdpa"
            engine = tm.Engine(model, lambda ps: torch.optim.SGD(ps, lr=0.1), tm.causal_lm_loss,
                               tm.ParallelConfig(recompute=mode), mesh=ParallelMesh(local=True))
            calls.clear()
            engine.train_step({"input_ids": ids, "labels": ids})
            counts[mode] = len(calls)
    finally:
        AttentionInterface._global_mapping["sdpa"] = sdpa
    assert counts == {"none": 2, "selective": 4}, counts


@pytest.fixture(scope="module")
def refused_dirs(tmp_path_factory) -> dict[str, str]:
    """Families whose plans cannot be honoured on some axis, Mistrals whose window covers the
    sequence and is shorter than it (both exact under cp), a Llama with tied embeddings (the
    head's weight is the input module's: summed over the pipeline stages before the DP
    reduction, under ZeRO 0-1)."""
    root = tmp_path_factory.mktemp("hfrefused")
    models = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)),
        "gemma2": family_model("gemma2"),
        "mistral-window8": family_model("mistral", sliding_window=8),
        "mistral-window16": family_model("mistral", sliding_window=SEQ),
        "mamba": transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4)),
        "llama-tied": family_model("llama", tie_word_embeddings=True)}
    out = {}
    for name, model in models.items():
        model.save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


def test_plans_that_cannot_be_honoured_exit_2_naming_family_and_axis(refused_dirs, no_launch, capsys):
    from trainmesh.cli import main
    base = ["train", "--seq-len", str(SEQ), "--global-batch", "4", "--steps", "2"]
    cases = [("gpt2", ["--pp", "2"], "--pp", "gpt2 family declares no pipeline plan"),
             ("gpt2", ["--tp", "2", "--sequence-parallel"], "--sequence-parallel", "gpt2"),
             ("gemma2", ["--cp", "2"], "--cp", "gemma2 family"),
             ("mamba", ["--recompute", "selective"], "--recompute", "mamba family"),
             ("mamba", ["--cp", "2"], "--cp", "mamba family"),
             ("mamba", ["--pp", "2"], "--pp", "mamba family"),
             ("llama-tied", ["--pp", "2", "--dp", "2", "--zero", "2"], "--zero",
              "ties weights across pipeline")]
    for name, flags, flag, words in cases:
        code = main([*base, "--model-dir", refused_dirs[name], *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, (name, flags, code, err)
        assert f"error: {flag}:" in err[0] and words in err[0] and "Traceback" not in err[0], err
    assert not no_launch
    for name, flags in (("mistral-window16", ["--cp", "2"]), ("mistral-window8", ["--cp", "2"]),
                        ("gemma2", ["--pp", "2"]),
                        ("llama-tied", ["--pp", "2", "--dp", "2", "--zero", "1"]),
                        ("gemma2", ["--tp", "2", "--sequence-parallel"])):
        assert main([*base, "--model-dir", refused_dirs[name], *flags]) == LAUNCHED, \
            (name, flags, capsys.readouterr().err)


def test_model_dir_layout_rules_exit_2(dirs, no_launch, refused):
    """--seq-len must split over --cp's chunks and --sequence-parallel's ranks; the pipeline
    needs a layer per stage (embedding, 2 layers, norm, head: 5)."""
    base = ["train", "--model-dir", dirs["llama"], "--global-batch", "4", "--steps", "2"]
    assert "2 x --cp = 4" in refused([*base, "--seq-len", "14", "--cp", "2"], "--seq-len")
    assert "divisible by --tp 2" in refused(
        [*base, "--seq-len", "15", "--tp", "2", "--sequence-parallel"], "--seq-len")
    assert "6 stages need at least 6 pipeline layers" in refused(
        [*base, "--seq-len", "16", "--pp", "3", "--virtual-stages", "2", "--microbatches", "3",
         "--global-batch", "6", "--schedule", "interleaved"], "pp")
    assert not no_launch


def test_structure_read_from_the_declared_pipeline_plan():
    """Llama's plan: input module, layer list, norm, head, under the model's names."""
    from trainmesh.core.hf_plan import hf_structure
    s = hf_structure(family_model("llama"))
    assert (s.family, s.base, s.pre, s.layers, s.post, s.head) == \
        ("llama", "model", ("model.embed_tokens",), "model.layers", ("model.norm",), "lm_head")
