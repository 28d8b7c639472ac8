"""The planner: ZeRO paper numbers, recommendations, bad input, and the predictions of docs/PLANNER.md.

All in-process and single-process: the whole file runs in a few seconds.
"""
from __future__ import annotations

import json

import pytest

from trainmesh.cli import main
from trainmesh.config.parallel import ParallelConfig
from trainmesh.models.gpt import PRESETS
from trainmesh.planner import Cluster, ModelShape, plan
from trainmesh.planner.activations import (
    gpt_block_bytes,
    gpt_head_bytes,
    inflight_chunks,
)
from trainmesh.planner.steptime import pipeline_slots
from trainmesh.planner.traffic import dp_ops, wire_bytes
from trainmesh.planner.units import parse_bandwidth, parse_size

GPT3 = dict(layers=96, hidden=12288, heads=96, seq_len=2048)
SHAPE_7B = ("--layers", "32", "--hidden", "4096", "--heads", "32")


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``trainmesh ARGV`` in process -> (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *args: str) -> dict:
    code, out, err = run_cli(capsys, ["plan", *args, "--json"])
    assert code == 0, err
    return json.loads(out)  # stdout holds exactly one JSON object


def layout_of(c: dict) -> dict:
    return c["layout"]


# ---------------------------------------------------------------- the ZeRO paper's table
def test_zero_paper_table_7_5b_on_64_gpus(capsys):
    result = plan_json(capsys, "--params", "7.5e9", "--gpus", "64", "--gpu-mem", "80GB", *SHAPE_7B)
    expected = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    for zero, want in expected.items():
        [c] = [c for c in result["candidates"]
               if layout_of(c) | {"zero": zero} == layout_of(c) and layout_of(c)["dp"] == 64
               and layout_of(c)["dp_shard"] == 64 and layout_of(c)["offload"] == "none"
               and layout_of(c)["recompute"] == "none"]
        mem = c["memory_per_gpu_bytes"]
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        assert states == pytest.approx(want, rel=0.01), f"ZeRO-{zero}"
        assert mem["activations"] > 0  # the shape is given: activations counted


def test_json_follows_the_contract(capsys):
    result = plan_json(capsys, "--params", "1.3e9", "--gpus", "8", "--layers", "24",
                       "--hidden", "2048", "--heads", "16")
    assert set(result) == {"candidates", "recommended", "why"}
    layout_keys = set(ParallelConfig().layout_record())
    for c in result["candidates"]:
        assert set(c) == {"layout", "memory_per_gpu_bytes", "comm_bytes_per_step", "fits",
                          "est_step_time_s"}
        assert set(c["layout"]) == layout_keys
        assert {"params", "grads", "optimizer", "activations", "total"} <= set(c["memory_per_gpu_bytes"])
        assert isinstance(c["fits"], bool) and c["est_step_time_s"] > 0
    assert result["recommended"] in result["candidates"]
    assert result["why"].count(". ") == 0 and result["why"].endswith(".")  # one sentence


# ---------------------------------------------------------------- recommendations
def test_one_gpu_model_does_not_fit_gives_zero3_offload(capsys):
    rec = plan_json(capsys, "--params", "30e9", "--gpus", "1", "--gpu-mem", "80GB", "--layers", "48",
                    "--hidden", "7168", "--heads", "56", "--seq-len", "512")["recommended"]
    assert (rec["layout"]["zero"], rec["layout"]["offload"]) == (3, "cpu") and rec["fits"]


def test_one_gpu_model_that_needs_offload_only_for_the_optimizer():
    rec = plan(ModelShape(params=10 * 10**9), Cluster(gpus=1)).recommended
    assert rec.fits and rec.layout.offload == "cpu" and rec.layout.zero >= 1


def test_one_node_model_that_fits_gives_ddp(capsys):
    result = plan_json(capsys, "--params", "1.3e9", "--gpus", "8", "--layers", "24",
                       "--hidden", "2048", "--heads", "16", "--seq-len", "2048")
    lay = result["recommended"]["layout"]
    assert (lay["dp"], lay["pp"], lay["tp"], lay["zero"], lay["offload"]) == (8, 1, 1, 0, "none")
    assert "DDP" in result["why"]


def test_175b_on_64_gpus_is_split_three_ways_inside_nodes(capsys):
    args = ["--params", "175e9", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem", "80GB"]
    shaped = plan_json(capsys, *args, *[f"--{k.replace('_', '-')}={v}" for k, v in GPT3.items()])
    lay = shaped["recommended"]["layout"]
    assert lay["dp"] * lay["pp"] * lay["tp"] == 64 and shaped["recommended"]["fits"]
    assert 1 < lay["tp"] <= 8 and lay["pp"] > 1 and lay["zero"] <= 1
    code, out, err = run_cli(capsys, ["plan", *args])   # no shape: no activations to count
    assert code == 2 and out == "" and "--layers, --hidden, --heads" in err


def test_fast_links_between_nodes_favour_zero():
    shape = ModelShape(params=13 * 10**9, layers=40, hidden=5120, heads=40)
    rec = plan(shape, Cluster(gpus=64, inter_node_bw=200e9)).recommended.layout
    assert (rec.dp, rec.pp, rec.tp) == (64, 1, 1) and rec.zero >= 1


@pytest.mark.parametrize("gpus,per_node", [(1, 8), (4, 8), (8, 8), (16, 8), (64, 8), (16, 4), (32, 2)])
def test_tp_never_crosses_a_node(gpus, per_node):
    for params in (1e8, 1.3e9, 7.5e9, 70e9, 175e9, 1e12):
        for inter in (25e9, 400e9):
            cluster = Cluster(gpus=gpus, gpus_per_node=per_node, inter_node_bw=inter)
            result = plan(ModelShape(params=int(params)), cluster)
            for c in [result.recommended, *result.candidates]:
                cfg = c.layout
                assert cfg.dp * cfg.pp * cfg.tp == gpus
                assert cfg.tp <= min(gpus, per_node) and min(gpus, per_node) % cfg.tp == 0


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("argv,field", [
    (["--params", "7e9", "--gpus", "8", "--gpu-mem", "80XB", *SHAPE_7B], "--gpu-mem"),
    (["--params", "7e9", "--gpus", "8", "--gpu-mem=-5GB", *SHAPE_7B], "--gpu-mem"),
    (["--params", "7e9", "--gpus", "8", "--gpu-mem", "0GB", *SHAPE_7B], "--gpu-mem"),
    (["--params", "0", "--gpus", "8", *SHAPE_7B], "--params"),
    (["--params", "7e9", "--gpus", "0", *SHAPE_7B], "--gpus"),
    (["--params", "7e9", "--gpus", "12", "--gpus-per-node", "8", *SHAPE_7B], "--gpus"),
    (["--params", "7e9", "--gpus", "8", "--inter-node-bw", "25GB", *SHAPE_7B], "--inter-node-bw"),
    (["--params", "7e9", "--gpus", "8"], "--layers"),
    (["--params", "7e9", "--gpus", "8", "--layers", "32"], "--hidden"),
    (["--model", "gpt3-175b", "--gpus", "8", "--gpu", "h1000"], "--gpu"),
    (["--model", "gpt5", "--gpus", "8"], "--model"),
    (["--params", "7e9", "--gpus", "8", "--hidden", "1000", "--heads", "3"], "--heads"),
    (["--params", "7e9", "--gpus", "8", "--dp", "2"], "--dp"),
    (["--params", "7e9"], "--gpus"),
    (["--gpus", "8"], "--params"),
    (["--params", "7e9", "--gpus", "x"], "--gpus"),
    (["--model", "tiny", "--gpus", "2"], "--gpus"),
    (["--model", "tiny", "--dp", "3"], "global-batch"),
])
def test_bad_input_exits_2_naming_the_field(capsys, argv, field):
    code, out, err = run_cli(capsys, ["plan", *argv])
    assert code == 2 and out == ""
    assert field in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ---------------------------------------------------------------- prediction for this machine
TINY = PRESETS["tiny"]
PSI = TINY.num_params()
STEP_COUNTERS = 4 * (2 + 16 * 4 + 3)  # AdamW keeps a 4-byte step per parameter tensor


def predict(capsys, *args: str) -> dict:
    return plan_json(capsys, "--model", "tiny", *args)


def rank0(result: dict) -> tuple[dict, dict]:
    r = result["ranks"][0]
    return r["model_state_bytes"], r["comm_bytes_per_step"]


def test_tiny_parameter_count():
    v, s, d, n = 512, 64, 64, 4
    assert PSI == 2 * v * d + s * d + n * (12 * d * d + 13 * d) + 2 * d


def test_prediction_ddp(capsys):
    result = predict(capsys, "--dp", "2")
    states, comm = rank0(result)
    assert states == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer": 8 * PSI + STEP_COUNTERS}
    assert comm["dp"] == {"all_reduce": 4 * PSI} and comm["tp"] == comm["pp"] == {}
    assert 0 < comm["other"]["all_reduce"] <= 64  # loss, token count and grad norm: small
    assert len(result["ranks"]) == 2 and result["params"] == PSI
    r0 = result["ranks"][0]            # on this process's measured base, whatever the torch wheel
    assert 0 < r0["peak_mem_bytes"] - r0["base_mem_bytes"] < 300 * 2**20


@pytest.mark.parametrize("zero,m,params,grads,optim,rs,ag", [
    (1, 1, 4, 4, 8 / 2, 4, 4),
    (2, 2, 4, 4 / 2, 8 / 2, 2 * 4, 4),
    (3, 2, 4 / 2, 4 / 2, 8 / 2, 2 * 4, 2 * 2 * 4),
])
def test_prediction_zero_stages(capsys, zero, m, params, grads, optim, rs, ag):
    states, comm = rank0(predict(capsys, "--dp", "2", "--zero", str(zero), "--microbatches", str(m)))
    for kind, per_param in (("params", params), ("grads", grads), ("optimizer", optim)):
        assert states[kind] == pytest.approx(per_param * PSI, rel=1e-3), kind
    assert comm["dp"] == {"reduce_scatter": pytest.approx(rs * PSI, rel=1e-3),
                          "all_gather": pytest.approx(ag * PSI, rel=1e-3)}


@pytest.mark.parametrize("zero,params,grads,optim", [
    (0, 2, 2, 12), (1, 2, 2, 12 / 2), (2, 2, 2 / 2, 12 / 2), (3, 4 / 2, 4 / 2, 8 / 2)])
def test_prediction_mixed_precision_holds_the_zero_paper_bytes(capsys, zero, params, grads, optim):
    """bf16 AdamW at dp 2: 16-bit params and grads, fp32 masters with the optimizer (ZeRO 0-2);
    fp32 shards at ZeRO-3. Parameters are all-gathered in 16 bits."""
    states, comm = rank0(predict(capsys, "--dp", "2", "--zero", str(zero), "--precision", "bf16"))
    for kind, per_param in (("params", params), ("grads", grads), ("optimizer", optim)):
        assert states[kind] == pytest.approx(per_param * PSI, rel=1e-3), kind
    if zero in (1, 2):
        assert comm["dp"]["all_gather"] == pytest.approx(2 * PSI, rel=1e-3)


def test_prediction_sgd_has_no_optimizer_state(capsys):
    states, _ = rank0(predict(capsys, "--dp", "2", "--optimizer", "sgd"))
    assert states["optimizer"] == 0 and states["params"] == 4 * PSI


def test_prediction_tensor_and_pipeline_traffic(capsys):
    b, s, h, L = 16, TINY.seq_len, TINY.d_model, TINY.n_layers
    _, comm = rank0(predict(capsys, "--tp", "2"))
    assert comm["tp"] == {"all_reduce": (4 * L + 2) * b * s * h * 4 + 3 * b * s * 4}
    result = predict(capsys, "--pp", "2", "--microbatches", "4")
    act = (b // 4) * s * h * 4
    for r in result["ranks"]:
        assert r["comm_bytes_per_step"]["pp"] == {"send": 4 * act, "recv": 4 * act}
    held = sum(r["model_state_bytes"]["params"] for r in result["ranks"])
    assert held == 4 * PSI  # the two stages hold the model once between them


def test_prediction_human_table(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)   # a pipe (pytest-xdist sets 80)
    code, out, _ = run_cli(capsys, ["plan", "--model", "tiny", "--dp", "2", "--zero", "1"])
    assert code == 0 and "predicted metrics" in out and "dp.reduce_scatter" in out


def test_advisor_human_table(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)   # a pipe (pytest-xdist sets 80)
    code, out, _ = run_cli(capsys, ["plan", "--params", "7.5B", "--gpus", "16", *SHAPE_7B])
    assert code == 0 and "Recommended:" in out and "Why:" in out and "->" in out
    assert "no --gpu: assuming h100" in out        # the assumption is said, not silent
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert "->" in rows[0]                          # the recommended layout first
    assert out.index("Recommended:") < out.index("Why:") < out.index(rows[0])
    assert "…" not in out                           # a pipe: nothing cut


def test_gpt3_175b_on_1024_a100s(capsys):
    """GPT-3 175B on 1024 A100s at Narayanan et al.'s batch (1536 x 2048): all GPUs used, TP inside
    nodes, activations counted, and an estimate no slower than their run's own layout (140
    TFLOP/s per GPU counted with recomputation, 31.5 s per step: their full recomputation and
    no sequence parallelism cost time a layout with both avoids) nor implausibly faster."""
    result = plan_json(capsys, "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb")
    rec = result["recommended"]
    lay = rec["layout"]
    assert lay["dp"] * lay["pp"] * lay["tp"] * lay["cp"] == 1024 and rec["fits"] and lay["tp"] == 8
    assert rec["memory_per_gpu_bytes"]["activations"] > 0
    published_s = 96 * 1536 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288)) \
        / (1024 * 140e12)
    assert published_s / 2 < rec["est_step_time_s"] < published_s * 1.25
    assert result["why"].endswith(".") and "tp=" in result["why"]


def test_the_assumed_efficiency_is_stated(capsys, monkeypatch):
    """The human output says which efficiency the estimate assumes and which runs it comes from."""
    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, _ = run_cli(capsys, ["plan", "--model", "llama3-8b", "--gpus", "64", "--gpu",
                                    "a100-80gb", "--peak-tflops", "312"])
    assert code == 0 and "64 x a100-80gb" in out and "MFU" in out
    assert "efficiency" in out and "published runs" in out and "torchtitan Llama 3 8B" in out


def test_list_gpus(capsys):
    code, out, _ = run_cli(capsys, ["plan", "--list-gpus"])
    assert code == 0
    for name in ("h100", "h200", "a100-40gb", "a100-80gb", "l4", "mi300x"):
        assert f"│ {name} " in out


# ---------------------------------------------------------------- the models underneath
def test_units():
    assert parse_size("x", "80GB") == 80 * 10**9 and parse_size("x", "80GiB") == 80 * 2**30
    assert parse_size("x", "512MiB") == 512 * 2**20 and parse_size("x", "8e10") == 8 * 10**10
    assert parse_bandwidth("x", "25GB/s") == 25e9 and parse_bandwidth("x", "1.5TiB/s") == 1.5 * 2**40


def test_ring_wire_bytes_zero_paper_ratios():
    n, psi = 64, 10**9
    ddp = wire_bytes(dp_ops(psi, dp=n, zero=0, microbatches=1, grad_bytes=2, param_bytes=2), n)
    zero1 = wire_bytes(dp_ops(psi, dp=n, zero=1, microbatches=1, grad_bytes=2, param_bytes=2), n)
    zero3 = wire_bytes(dp_ops(psi, dp=n, zero=3, microbatches=1, grad_bytes=2, param_bytes=2), n)
    assert ddp == pytest.approx(2 * (n - 1) / n * 2 * psi) and zero1 == pytest.approx(ddp)
    assert zero3 == pytest.approx(1.5 * ddp)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3)])
def test_pipeline_bubble(p, m):
    slots = pipeline_slots("1f1b", microbatches=m, pp=p)
    assert (slots - m) / slots == pytest.approx((p - 1) / (m + p - 1))
    interleaved = pipeline_slots("interleaved", microbatches=m, pp=p, virtual_stages=2)
    assert interleaved - m == pytest.approx((p - 1) / 2)


@pytest.mark.parametrize("name,p,m,v", [("naive", 3, 4, 1), ("gpipe", 4, 3, 1), ("1f1b", 4, 8, 1),
                                        ("1f1b", 4, 3, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 4, 4, 2), ("interleaved", 2, 6, 3)])
def test_inflight_matches_the_schedule_analysis(name, p, m, v):
    from trainmesh.pipeline_parallel.analysis import peak_inflight_microbatches
    from trainmesh.pipeline_parallel.schedules import build_schedule
    measured = peak_inflight_microbatches(build_schedule(name, p, m, v))
    assert [inflight_chunks(name, pp=p, microbatches=m, rank=r, virtual_stages=v)
            for r in range(p)] == measured


def test_activation_count_matches_the_gpt_saved_tensors():
    torch = pytest.importorskip("torch")
    from trainmesh.models.gpt import Block, CrossEntropySum, Embedding, Head
    cfg, b = TINY, 8
    # the GPT's own layers, built directly on CPU (GPT() goes through the meta device, slow to warm)
    layers = [Embedding(cfg), *(Block(cfg) for _ in range(cfg.n_layers)), Head(cfg)]
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len))
    saved = _saved_bytes(torch.nn.Sequential(*layers), idx,
                         loss=lambda out: CrossEntropySum()(out, idx))
    shape = dict(seq=cfg.seq_len, batch=b, hidden=cfg.d_model)
    predicted = (cfg.n_layers * gpt_block_bytes(heads=cfg.n_heads, ffn=cfg.d_ff, **shape)
                 + gpt_head_bytes(vocab=cfg.vocab_size, **shape))
    assert predicted == pytest.approx(saved, rel=0.05)


@pytest.mark.parametrize("dtype_name, value_bytes", [("float32", 4), ("bfloat16", 2)])
def test_activation_count_matches_a_gated_layers_saved_tensors(dtype_name, value_bytes):
    """A SwiGLU decoder layer as --model-dir trains it (transformers' Llama layer: gated MLP,
    RMSNorm written out in PyTorch ops, fused attention), no recompute: the count of the planner
    for the shape its config.json gives, against what autograd keeps. The MLP keeps 4 T f (gate
    and up outputs, the activation, the product: 25% of this layer, so a count of 3 or 2 is
    13% or 25% off); the eager RMSNorms 4 bytes a value more than a fused one (19% of the layer
    in bf16); the planner leaves out only rotary's cos and sin, 2 T d values (d = h/a: 2.3%)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from trainmesh.planner.activations import Kernels, layer_bytes
    from trainmesh.planner.model_dir import shape_from_config
    cfg = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=1, vocab_size=128,
                      max_position_embeddings=64, attn_implementation="sdpa")
    dtype, b, s = getattr(torch, dtype_name), 4, 32
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).to(dtype)
    x = torch.randn(b, s, cfg.hidden_size, dtype=dtype, requires_grad=True)
    positions = torch.arange(s)[None].expand(b, s)
    rotary = tuple(t.to(dtype) for t in LlamaRotaryEmbedding(cfg)(x, positions))
    saved = _saved_bytes(lambda inp: layer(inp, position_embeddings=rotary, attention_mask=None,
                                           position_ids=positions), x, params=layer.parameters())
    shape = shape_from_config(cfg.to_dict())
    assert shape.gated and shape.norm == "rmsnorm"
    predicted = layer_bytes(shape, Kernels(rmsnorm="eager"), seq=s, batch=b, value_bytes=value_bytes)
    assert predicted == pytest.approx(saved, rel=0.10), (predicted, saved)


def _saved_bytes(layer, x, loss=None, params=None) -> int:
    """Bytes of the distinct storages autograd saves running ``layer`` on ``x`` (and ``loss`` on
    its output), parameters (``layer``'s, or ``params`` for a function) aside."""
    import torch
    params = {p.untyped_storage().data_ptr() for p in (params or layer.parameters())}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
        if loss is not None:
            loss(out)
    return sum(saved.values())


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_activation_count_matches_the_saved_tensors(top_k):
    """A MoE block saves the dense block's norms and attention plus the routed tokens' expert
    activations (k copies of each token through an expert MLP), the dispatch and combine rows and
    the routing state: the count of planner/activations.py, against what autograd keeps."""
    torch = pytest.importorskip("torch")
    from trainmesh.models.gpt import Block, GPTConfig
    from trainmesh.models.moe import MoE, MoEStats
    from trainmesh.planner.activations import moe_mlp_bytes
    cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=1, n_heads=4, n_experts=4,
                    top_k=top_k, moe_every=1)
    b, h = 4, cfg.moe_hidden
    moe = MoE(cfg.d_model, cfg.n_experts, top_k, h, aux_coef=0.01, index=0, stats=MoEStats(1, 4))
    torch.manual_seed(0)
    block = Block(cfg, moe)
    x = torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True)
    shape = dict(seq=cfg.seq_len, batch=b, hidden=cfg.d_model)
    dense = gpt_block_bytes(heads=cfg.n_heads, ffn=cfg.d_ff, **shape) - 2 * b * cfg.seq_len * cfg.d_ff * 4
    predicted = dense + moe_mlp_bytes(experts=cfg.n_experts, top_k=top_k, expert_hidden=h, **shape)
    assert predicted == _saved_bytes(block, x)    # exact: every row and index counted
    # the experts' hidden activations: k copies of every token, whatever the routing
    expert_part = 2 * b * cfg.seq_len * top_k * h * 4
    assert _saved_bytes(block.mlp.experts["0"], torch.randn(10, cfg.d_model, requires_grad=True)) \
        == 2 * 10 * h * 4 + 10 * cfg.d_model * 4
    assert expert_part > 0.3 * predicted


def test_peak_prediction_stands_on_the_measured_base():
    """The base footprint is measured where the run happens: a CUDA build of torch imports
    ~650 MiB where the CPU wheel imports ~220 MiB; a constant base fits only one wheel."""
    from trainmesh.config.train import build_train_config
    from trainmesh.planner.predict import (
        RUNTIME_BYTES,
        compare,
        measured_base_bytes,
        predict_run,
    )
    cfg = build_train_config({"model": "tiny", "dp": 2, "device": "cpu"})
    here = measured_base_bytes("cpu")
    assert 50 * 2**20 < here < 4 * 2**30            # this process's RSS, torch imported
    pred = predict_run(cfg, base_bytes=100 * 2**20)
    rank = pred.ranks[0]
    model_part = rank.peak_mem_bytes - 100 * 2**20 - RUNTIME_BYTES
    assert model_part > 0 and rank.base_mem_bytes == 100 * 2**20
    heavy_base = 650 * 2**20                         # what a CUDA wheel's worker records
    measured = {"params": pred.params, "ranks": [
        {"rank": r.rank, "model_state_bytes": r.model_state_bytes, "comm_bytes_per_step": r.comm_bytes_per_step,
         "base_mem_bytes": heavy_base, "peak_mem_bytes": heavy_base + RUNTIME_BYTES + model_part}
        for r in pred.ranks]}
    assert compare(pred, measured) == []
    without_base = {**measured, "ranks": [{k: v for k, v in r.items() if k != "base_mem_bytes"}
                                          for r in measured["ranks"]]}
    assert any("peak_mem_bytes" in p for p in compare(pred, without_base))
    assert predict_run(cfg, base_bytes=None).ranks[0].base_mem_bytes >= here * 0.9
