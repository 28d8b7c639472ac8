"""Hand-built all-reduce algorithms (ring, tree, naive) against the backend's, a float64 sum and
their traffic theory; DDP with them end to end against the one-process run."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from helpers import SMALL, assert_equivalent, run_train, summary

from trainmesh.cli import main
from trainmesh.comm import Comm
from trainmesh.comm.algorithms import all_reduce, theory_sent_bytes
from trainmesh.core.mesh import ParallelMesh
from trainmesh.testing import run_distributed

NUMELS = (1, 7, 1001, 4099)     # below N, odd, and not divisible by 2, 3 or 4
EPS = torch.finfo(torch.float32).eps


def _check_all() -> dict:
    """Every algorithm on every size: result, max sent bytes and total sent bytes per call."""
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Comm(ParallelMesh(dp=n))
    out: dict = {}
    for numel in NUMELS:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(17 * numel + rank))
        everyone = [torch.empty(numel) for _ in range(n)]
        dist.all_gather(everyone, x)
        exact = torch.stack(everyone).double().sum(0)               # (numel,) float64 reference
        bound = (n - 1) * EPS * torch.stack(everyone).double().abs().sum(0)   # summation error bound
        native = x.clone()
        comm.all_reduce(native, "dp")
        for algorithm in ("native", "ring", "tree", "naive"):
            t = x.clone()
            comm.ledger.begin_step()
            all_reduce(comm, t, "dp", algorithm=algorithm)
            window = comm.ledger.end_step()
            sent = torch.tensor([float(window["dp"]["send"].bytes if "send" in window["dp"] else 0)])
            gathered = [torch.empty(1) for _ in range(n)]
            dist.all_gather(gathered, sent)
            results = [torch.empty(numel) for _ in range(n)]
            dist.all_gather(results, t)
            out[(algorithm, numel)] = {
                "err": ((t.double() - exact).abs() - bound).max().item(),   # <= 0 when within bound
                "vs_native": ((t - native).abs().double() - 2 * bound).max().item(),
                "same_on_all_ranks": all(torch.equal(r, results[0]) for r in results),
                "sent": [g.item() for g in gathered]}
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_algorithms_match_native_and_theory(n):
    res = run_distributed(_check_all, n, timeout_s=120)[0]
    for (algorithm, numel), r in res.items():
        where = f"{algorithm} N={n} numel={numel}"
        assert r["err"] <= 0, f"{where}: off the float64 sum by {r['err']} beyond (N-1)·eps·Σ|x|"
        assert r["vs_native"] <= 0, f"{where}: off the backend's result beyond 2(N-1)·eps·Σ|x|"
        assert r["same_on_all_ranks"], f"{where}: ranks disagree"
        if algorithm == "native":
            continue
        size = numel * 4
        # every algorithm moves 2(N-1) S in total (each contribution in, each result out)
        assert sum(r["sent"]) == pytest.approx(2 * (n - 1) * size, rel=0.02 if numel > 100 else 1), where
        if numel > 100:   # chunks of ring differ by one element: within 2% only for real sizes
            theory = theory_sent_bytes(algorithm, size, n)
            assert max(r["sent"]) == pytest.approx(theory, rel=0.02), f"{where}: {r['sent']} vs {theory}"
            if algorithm == "ring":   # every rank alike
                assert min(r["sent"]) == pytest.approx(theory, rel=0.02), f"{where}: {r['sent']}"
            if algorithm == "naive":  # everyone but the root sends its tensor once
                assert r["sent"][1:] == [size] * (n - 1), f"{where}: {r['sent']}"


def test_theory_of_tree_and_naive():
    assert theory_sent_bytes("tree", 100, 4) == 200 and theory_sent_bytes("tree", 100, 5) == 300
    assert theory_sent_bytes("naive", 100, 4) == 300
    assert theory_sent_bytes("ring", 100, 4) == 150
    assert theory_sent_bytes("tree", 100, 8) == 100 * math.log2(8)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_comm_algorithms_json(capsys):
    assert main(["bench", "comm", "--ops", "all_reduce", "--sizes", "4001B", "--iters", "1",
                 "--algorithms", "native,ring,tree,naive", "--nproc", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["algorithm"] for r in rows] == ["native", "ring", "tree", "naive"]
    for r in rows:
        assert set(r) >= {"op", "algorithm", "size_bytes", "time_s", "algbw", "busbw",
                          "sent_bytes_max_rank", "sent_bytes_theory", "max_abs_diff_vs_native"}
        assert r["size_bytes"] == 4000 and r["time_s"] > 0
        assert r["max_abs_diff_vs_native"] < 1e-4     # randn inputs: |sum| ~ 10, eps 1.2e-7
        if r["algorithm"] != "native":
            assert r["sent_bytes_max_rank"] == pytest.approx(r["sent_bytes_theory"], rel=0.02)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ddp_with_algorithms_is_equivalent(tmp_path):
    """SGD (sensitive to any gradient error), 12 sequences, ~12 buckets of 2,621 elements (not
    divisible by 3): ring at dp 2 and 3, tree at dp 3."""
    common = [*SMALL, "--global-batch", "12", "--optimizer", "sgd", "--bucket-mb", "0.01"]
    proc, ref = run_train(common, tmp_path, name="ref")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for dp, algorithm in ((2, "ring"), (3, "ring"), (3, "tree")):
        proc, run = run_train([*common, "--dp", str(dp), "--allreduce", algorithm], tmp_path,
                              name=f"{algorithm}{dp}", timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert_equivalent(ref, run)
        dp_bytes = summary(run)["ranks"][0]["comm_bytes_per_step"]["dp"]
        assert "all_reduce" not in dp_bytes and dp_bytes["send"] > 0, dp_bytes


@pytest.mark.parametrize("args, field", [
    (["--allreduce", "butterfly"], "allreduce"),
    (["--allreduce", "ring", "--zero", "1", "--dp", "2"], "allreduce"),
])
def test_bad_allreduce(args, field, capsys):
    assert main(["train", *SMALL, *args]) == 2   # refused before any worker starts
    err = capsys.readouterr().err
    assert f"{field}:" in err and len(err.strip().splitlines()) == 1, err
