"""`trainmesh bench comm` and `trainmesh launch slurm`."""
from __future__ import annotations

import json

import pytest

from trainmesh.cli import main


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_comm_json(capsys):
    assert main(["bench", "comm", "--sizes", "4KB,64KB", "--iters", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    for r in rows:
        assert r["time_s"] > 0 and r["busbw"] > 0 and r["backend"] == "gloo"
        if r["op"] == "all_reduce":   # nccl-tests: busbw = algbw * 2(n-1)/n = algbw at n=2
            assert r["busbw"] == pytest.approx(r["algbw"])


@pytest.mark.parametrize("args, field", [
    (["bench", "comm", "--sizes", "12XB"], "sizes"),
    (["bench", "comm", "--ops", "all_scatter"], "ops"),
    (["bench", "comm", "--nproc", "1"], "nproc"),
    (["launch", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--", "--dp", "4"], "dp*cp*pp*tp"),
    (["launch", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--", "--dp", "1", "--tp", "8"], "tp"),
    (["launch", "slurm", "--nodes", "0", "--gpus-per-node", "4"], "nodes"),
])
def test_bad_input(args, field, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_slurm_script(capsys):
    assert main(["launch", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu",
                 "--", "--dp", "2", "--tp", "4", "--steps", "50"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --partition=gpu" in script
    assert "srun torchrun" in script and "--nproc-per-node 4" in script
    assert "--rdzv-backend c10d" in script
    assert script.rstrip().endswith("-m trainmesh train --dp 2 --tp 4 --steps 50")
