"""HSDP (``--dp-shard S``) through ``trainmesh train``: dp 4 with shard groups of 2 trains as one
process does at ZeRO-2 and ZeRO-3 (loss within 1e-3, grad_norm within 1e-3 relative, 20 steps:
ZeRO-2 in one run, ZeRO-3 in a run saved at step 10 and resumed at dp 2 with shard groups of 1),
each rank holds the ZeRO model states with N = S, and its DP traffic is keyed ``dp_shard`` and
``dp_replicate`` as docs/HSDP.md's formulas say (and as ``trainmesh plan`` predicts)."""
from __future__ import annotations

import pytest
from helpers import (
    SMALL,
    assert_equivalent,
    check_prediction,
    one_process,
    run_train,
    steps,
    summary,
)

DP, S = 4, 2
HSDP = ["--dp", str(DP), "--dp-shard", str(S)]
PADDING = 0.01      # flat shards are padded to whole chunks: within 1% on this model


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run(one_process("adamw"))


def _check_accounting(summ: dict, zero: int) -> None:
    """model_state_bytes follow the ZeRO formulas with N = S (fp32 AdamW); the DP traffic is
    keyed dp_shard / dp_replicate: reduce_scatter 4Ψ (one microbatch), all_gather 4Ψ (ZeRO-3:
    2·4Ψ), and the reduced shard 4Ψ/S all-reduced across the replicas."""
    psi = summ["params"]
    want_states = {"params": 4 * psi / (S if zero == 3 else 1), "grads": 4 * psi / S,
                   "optimizer": 8 * psi / S}
    gathers = 2 if zero == 3 else 1
    want_comm = {"dp_shard": {"reduce_scatter": 4 * psi, "all_gather": gathers * 4 * psi},
                 "dp_replicate": {"all_reduce": 4 * psi / S}}
    for r in summ["ranks"]:
        for kind, want in want_states.items():
            assert r["model_state_bytes"][kind] == pytest.approx(want, rel=PADDING), (r["rank"], kind)
        comm = r["comm_bytes_per_step"]
        assert not comm.get("dp"), (r["rank"], comm)       # nothing keyed dp under HSDP
        for axis, ops in want_comm.items():
            assert set(comm[axis]) == set(ops), (r["rank"], axis, comm[axis])
            for op, want in ops.items():
                assert comm[axis][op] == pytest.approx(want, rel=PADDING), (r["rank"], axis, op)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_zero2_matches_one_process_with_its_memory_and_traffic(reference, tmp_path):
    args = [*SMALL, "--optimizer", "adamw", *HSDP, "--zero", "2"]
    proc, run = run_train(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_equivalent(reference, run)
    summ = summary(run)
    assert summ["layout"]["dp_shard"] == S
    _check_accounting(summ, zero=2)
    check_prediction(args, summ)                  # the planner models HSDP the same way
    _check_rank_table(summ)


def _check_rank_table(summ: dict) -> None:
    """The summary's rank table: rank r (dp index r) sits at shard index r % S of replica r // S
    (docs/HSDP.md: dp = replicate x dp_shard + shard)."""
    from trainmesh.observe.progress import rank_table
    headers, rows = rank_table(summ)
    cells = [(row[headers.index("dp")], row[headers.index("dp-shard")], row[headers.index("dp-replicate")])
             for row in rows]
    assert cells == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")], (headers, rows)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hsdp_zero3_saves_and_resumes_under_other_shard_groups(reference, tmp_path):
    ck = tmp_path / "ck"
    args = [*SMALL, "--optimizer", "adamw", *HSDP, "--zero", "3"]
    proc, first = run_train([*args, "--save-dir", str(ck), "--save-every", "10", "--exit-after", "10"],
                            tmp_path, name="a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_accounting(summary(first), zero=3)
    check_prediction(args, summary(first))
    # Resharded: from shard groups of 2 (of 4 ranks) to shard groups of 1 (of 2 ranks).
    proc, second = run_train([*SMALL, "--optimizer", "adamw", "--dp", "2", "--dp-shard", "1",
                              "--zero", "3", "--save-dir", str(ck), "--resume"], tmp_path, name="b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in steps(first) + steps(second)] == list(range(1, 21))
    assert_equivalent(reference, first + second)


@pytest.mark.parametrize("extra, flag", [
    (["--dp", "4", "--dp-shard", "2"], "--dp-shard"),                  # ZeRO 0 shards nothing
    (["--dp", "4", "--dp-shard", "3", "--zero", "1"], "--dp-shard"),
    (["--dp", "4", "--dp-shard", "2", "--zero", "2", "--min-dp", "2"], "--dp-shard"),
])
def test_meaningless_hsdp_layouts_exit_2_naming_the_flag(refused, no_launch, extra, flag):
    line = refused(["train", *SMALL, *extra], flag)
    assert "dp-shard" in line


def test_plan_models_hsdp_memory_and_both_traffic_terms(capsys):
    """``trainmesh plan --model tiny --dp 4 --dp-shard 2 --zero 3 --json``: states with N = S,
    traffic under dp_shard and dp_replicate (docs/HSDP.md); the advisor's scoring agrees."""
    import json

    from trainmesh import ParallelConfig
    from trainmesh.cli import main
    from trainmesh.planner.candidate import evaluate
    from trainmesh.planner.cluster import Cluster
    from trainmesh.planner.shapes import ModelShape
    assert main(["plan", "--model", "tiny", "--dp", "4", "--dp-shard", "2", "--zero", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    psi = out["params"]
    for r in out["ranks"]:
        assert r["model_state_bytes"]["grads"] == pytest.approx(4 * psi / 2, rel=PADDING)
        comm = r["comm_bytes_per_step"]
        assert comm["dp"] == {}
        assert comm["dp_shard"]["all_gather"] == pytest.approx(2 * 4 * psi, rel=PADDING)
        assert comm["dp_replicate"]["all_reduce"] == pytest.approx(4 * psi / 2, rel=PADDING)
    model, cluster = ModelShape(params=10**9), Cluster(gpus=8)
    full, hsdp = (evaluate(ParallelConfig(dp=8, zero=3, dp_shard=s), model, cluster) for s in (8, 2))
    assert hsdp.memory.params == pytest.approx(full.memory.params * 4, rel=1e-6)   # N = 2 vs 8
    assert set(hsdp.traffic) >= {"dp_shard", "dp_replicate"} and not hsdp.traffic["dp"]
