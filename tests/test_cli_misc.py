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
    (["launch", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--", "--dp", "4"], "--dp"),
    (["launch", "slurm", "--nodes", "2", "--", "--pp", "3"], "--pp"),
    (["launch", "slurm", "--nodes", "2", "--gpus-per-node", "2", "--ntasks-per-node", "4"], "--ntasks-per-node"),
    (["launch", "slurm", "--nodes", "2", "--cpus-per-task", "0"], "--cpus-per-task"),
    (["launch", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--", "--dp", "1", "--tp", "8"], "tp"),
    (["launch", "slurm", "--nodes", "0", "--gpus-per-node", "4"], "nodes"),
])
def test_bad_input(args, field, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_slurm_script(capsys):
    """GPUs: one srun task per GPU, the train flags as given, the directives an admin expects."""
    assert main(["launch", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu",
                 "--cpus-per-task", "8", "--time", "2:00:00", "--", "--dp", "2", "--tp", "4",
                 "--steps", "50"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash")
    for directive in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=8",
                      "--partition=gpu", "--time=2:00:00"):
        assert f"#SBATCH {directive}\n" in script, directive
    assert 'OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK"' in script
    assert "torchrun" not in script and "srun --kill-on-bad-exit=1 " in script
    assert script.rstrip().endswith("-m trainmesh train --dp 2 --tp 4 --steps 50")


def test_slurm_script_without_gpus_is_a_cpu_job(capsys):
    """No --gpus-per-node: no GPU request at all, one rank per node, the layout from the world."""
    assert main(["launch", "slurm", "--nodes", "2", "--", "--steps", "20"]) == 0
    script = capsys.readouterr().out
    assert "gpu" not in script.lower() and "gres" not in script.lower(), script
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=1\n" in script
    assert "dp 2" in script and script.rstrip().endswith("-m trainmesh train --steps 20")
    assert main(["launch", "slurm", "--nodes", "2", "--ntasks-per-node", "2", "--", "--tp", "2"]) == 0
    assert "dp 2 x cp 1 x pp 1 x tp 2" in capsys.readouterr().out
