"""The advisor with ``--optimizer muon``: the memory of each layout holds Muon's states (one
moment on the hidden matrices, AdamW's two on the rest) and the step time its Newton-Schulz
iteration and the owners' collectives (docs/PLANNER.md, "Optimizers").

All in process. The expected figures are derived here from the shape by hand (the matrices of a
Llama layer, the iteration's multiply-adds, ring wire bytes), not from the planner's helpers.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from test_planner import plan_json, run_cli

from trainmesh.config.parallel import ParallelConfig
from trainmesh.planner.advisor import plan
from trainmesh.planner.candidate import _split, evaluate, matrices, muon_work
from trainmesh.planner.cluster import Cluster
from trainmesh.planner.published import published

LLAMA8B = published("llama3-8b").shape
MIXTRAL = published("mixtral-8x7b").shape
CLUSTER = Cluster(gpus=16, efficiency=0.4)
NS_STEPS = 5   # torch.optim.Muon's default


def llama_matrices(shape) -> float:
    """Values of a Llama's hidden matrices: per layer q and o (h x h), k and v (h x kv), the
    gated MLP's three h x f (no expert)."""
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_width
    return shape.layers * (2 * h * h + 2 * h * kv + 3 * h * f)


def ns(m: int, n: int) -> float:
    """The iteration on an m x n matrix: per step the gram A A^T (2 m^2 n), its square's
    (2 m^3) and the product with A (2 m^2 n), m the shorter side."""
    m, n = min(m, n), max(m, n)
    return NS_STEPS * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def llama_ns(shape) -> float:
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn_width
    return shape.layers * (2 * ns(h, h) + 2 * ns(kv, h) + 3 * ns(h, f))


LAYOUTS = [ParallelConfig(dp=16, precision="bf16"),
           ParallelConfig(dp=16, zero=1, precision="bf16"),
           ParallelConfig(dp=8, tp=2, zero=1, precision="bf16", sequence_parallel=True),
           ParallelConfig(dp=8, tp=2, precision="bf16"),
           ParallelConfig(dp=4, pp=2, tp=2, zero=1, microbatches=8, precision="bf16"),
           ParallelConfig(dp=16, zero=3, precision="fp32"),
           ParallelConfig(dp=16, zero=2, dp_shard=8, precision="bf16")]


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: c.layout.describe("flags"))
def test_muon_keeps_one_moment_on_the_matrices(cfg):
    """Against AdamW on the same layout: parameters, gradients, activations and buffers equal;
    the optimizer states 4 bytes (the second moment) less per hidden-matrix value the rank
    keeps states for (its tp x pp share, over its ZeRO group)."""
    adamw = evaluate(cfg, LLAMA8B, CLUSTER)
    muon = evaluate(cfg, LLAMA8B, CLUSTER, optimizer="muon")
    keep = llama_matrices(LLAMA8B) / (cfg.pp * cfg.tp) / (cfg.shard_size if cfg.zero else 1)
    assert (muon.memory.params, muon.memory.grads, muon.memory.activations, muon.memory.overhead) \
        == (adamw.memory.params, adamw.memory.grads, adamw.memory.activations, adamw.memory.overhead)
    assert adamw.memory.optimizer - muon.memory.optimizer == pytest.approx(4 * keep, rel=1e-9)


def test_muon_experts_keep_one_moment_over_edp():
    """A mixture of experts: the experts' matrices (3 per expert, gated) over edp, the dense
    ones over dp, each 4 bytes less than AdamW's; the experts' owners exchange over edp."""
    cfg = ParallelConfig(dp=16, ep=8, zero=1, microbatches=4, precision="bf16")
    h, f, e, layers = MIXTRAL.hidden, MIXTRAL.expert_width, MIXTRAL.experts, MIXTRAL.layers
    dense = layers * (2 * h * h + 2 * h * MIXTRAL.kv_dim + e * h)       # attention, routers
    experts = layers * e * 3 * h * f
    keep = dense / 16 + experts / 8 / 2                                 # dp 16; ep 8, edp 2
    adamw, muon = (evaluate(cfg, MIXTRAL, CLUSTER, optimizer=o) for o in ("adamw", "muon"))
    assert adamw.memory.optimizer - muon.memory.optimizer == pytest.approx(4 * keep, rel=1e-9)
    # the experts' owners over edp (2): their stretches there, owned matrices back, 1/2 each
    assert muon.traffic["edp"]["all_to_all"] == pytest.approx(2 * 4 * experts / 8 / 2, rel=1e-9)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: c.layout.describe("flags"))
def test_muon_step_time_counts_the_iteration_and_the_owners_collectives(cfg):
    """The step's added time is the rank's Newton-Schulz FLOPs at the bf16 rate (each matrix
    whole; under ZeRO the owners share them, over tp the tp owners share the owner group's:
    a Llama's matrices are all cut) plus, under ZeRO, the owners' two all-to-alls over the
    shard group (the rank's stretches of the 4-byte matrices there, 1/n of them, and its owned
    matrices back, as many on average) and, under tp, the two all-to-alls of the rank's shards
    (to the owners and back), under tp x ZeRO of those its group owns (1/n of them); every
    all-to-all counted at 1 wire byte per byte."""
    adamw = evaluate(cfg, LLAMA8B, CLUSTER)
    muon = evaluate(cfg, LLAMA8B, CLUSTER, optimizer="muon")
    n = cfg.shard_size if cfg.zero else 1
    flops = llama_ns(LLAMA8B) / cfg.pp / n / cfg.tp
    held = llama_matrices(LLAMA8B) / (cfg.pp * cfg.tp)           # this rank's tp shards
    bw = CLUSTER.bandwidth(cfg.dp * cfg.tp)
    comm = 2 * 4 * held / n / bw if n > 1 else 0.0     # all_to_all there and back: 1/n each
    if cfg.tp > 1:                # all_to_all there and back: its shards (of its group's 1/n)
        comm += 2 * 4 * held / n / CLUSTER.bandwidth(cfg.tp)
    expected = flops / CLUSTER.flops_per_s("bf16") + comm
    assert muon.time.optimizer_s == pytest.approx(expected, rel=1e-9)
    assert muon.time.total - adamw.time.total == pytest.approx(expected, rel=1e-9)
    assert muon_work(LLAMA8B, cfg, CLUSTER, _split(LLAMA8B, cfg))[1] == pytest.approx(flops, rel=1e-12)


def test_the_planner_counts_the_flops_muon_counts_on_the_built_in_gpt():
    """The matrices the planner iterates for the built-in GPT are those MuonAdamW takes from the
    model (data_parallel.muon.is_hidden_matrix over its parameters), and their FLOPs its own
    count (ns_flops, what MuonAdamW.flops_run adds up): the planner reads the same split."""
    from trainmesh.data_parallel.muon import is_hidden_matrix, ns_flops
    from trainmesh.models.gpt import GPT, GPTConfig
    from trainmesh.planner.builtin import gpt_shape
    gpt = GPTConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=64)
    model = GPT(gpt)
    taken = [tuple(p.shape) for name, p in model.named_parameters() if is_hidden_matrix(name, tuple(p.shape))]
    shape = gpt_shape(gpt)
    kinds = matrices(shape)
    assert sorted(sorted(s) for n, s, _ in kinds for _ in range(n)) == sorted(sorted(s) for s in taken)
    cfg = ParallelConfig(dp=2, zero=1)
    assert muon_work(shape, cfg, CLUSTER, _split(shape, cfg))[1] == pytest.approx(
        sum(ns_flops(s) for s in taken) / 2, rel=1e-12)


def test_advisor_and_cli_score_every_layout_with_muon(capsys):
    """plan(optimizer="muon") and `trainmesh plan --optimizer muon`: every layout both plans
    score holds 4 bytes less per matrix value it keeps states for, and takes longer by the
    Newton-Schulz work; the header says muon."""
    cluster = replace(CLUSTER, gpus=8)
    adamw = {str(c.layout): c for c in plan(LLAMA8B, cluster, global_batch=64).candidates}
    muon = {str(c.layout): c for c in plan(LLAMA8B, cluster, global_batch=64, optimizer="muon").candidates}
    both = [k for k in adamw if k in muon]
    assert len(both) > 10
    for k in both:
        cfg = muon[k].layout
        keep = llama_matrices(LLAMA8B) / (cfg.pp * cfg.tp) / (cfg.shard_size * cfg.cp if cfg.zero else 1)
        offloaded = cfg.offload != "none"
        assert adamw[k].memory.optimizer - muon[k].memory.optimizer == pytest.approx(
            0 if offloaded else 4 * keep, rel=1e-9, abs=1e-3), k
        assert muon[k].time.optimizer_s > 0 and adamw[k].time.optimizer_s == 0
    args = ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--global-batch", "64"]
    by_json = {o: {json_key(c): c for c in plan_json(capsys, *args, "--optimizer", o)["candidates"]}
               for o in ("adamw", "muon")}
    shared = [k for k in by_json["adamw"] if k in by_json["muon"]]
    assert shared and all(by_json["muon"][k]["memory_per_gpu_bytes"]["optimizer"]
                          < by_json["adamw"][k]["memory_per_gpu_bytes"]["optimizer"]
                          for k in shared if "offload=none" in k)
    code, out, err = run_cli(capsys, ["plan", *args, "--optimizer", "muon"])
    assert code == 0 and ", muon, global batch 64" in out.replace("\n", "")


def json_key(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(c["layout"].items()))


def test_calibrating_on_a_muon_run_takes_its_step_out_of_the_efficiency(tmp_path):
    """A run trained with Muon measured S seconds per step: calibrated with optimizer="muon",
    the planner's step time for the run's own layout (Muon's step included) is S again."""
    import json

    from trainmesh.planner.calibrate import calibrate
    cfg = ParallelConfig(dp=16, zero=1, microbatches=4, precision="bf16")
    path = tmp_path / "run.jsonl"
    steps = [{"event": "step", "step": i, "tokens": 64 * 8192, "step_time_s": 9.0} for i in (1, 2)]
    summ = {"event": "summary", "params": LLAMA8B.params, "layout": cfg.layout_record(),
            "ranks": [{"rank": 0, "peak_mem_bytes": 60 * 2**30}]}
    path.write_text("\n".join(json.dumps(r) for r in [*steps, summ]) + "\n")
    model = replace(LLAMA8B, seq_len=8192)
    cal = calibrate(str(path), model, replace(CLUSTER, efficiency=None), optimizer="muon")
    run = evaluate(cfg, model, replace(CLUSTER, efficiency=cal.efficiency), optimizer="muon")
    assert run.time.optimizer_s > 0 and run.time.total == pytest.approx(9.0, rel=1e-6)
