"""--fault-tolerant with shard groups of tensor-parallel or pipeline ranks inside each replica
(tensor parallelism alone, with sequence parallelism: test_fault_tolerance_everything). A rank
lost takes its whole replica down and never the other; the survivor redoes the step on the
whole global batch; the restarted replica's rank j gets rank j's shard of its slice of the live
state from the same rank of a peer; the loss curve is the single process's. Faults are injected
with TRAINMESH_FT_INJECT (``R/J@K``: rank J of replica R at step K)."""
from __future__ import annotations

import pytest
from helpers import SMALL, one_process, run_train, steps, summary
from test_fault_tolerance import _same_curve

TP = ["--tp", "2", "--fault-tolerant", "--timeout", "30", "--optimizer", "adamw"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shard_groups_of_tp_groups(reference_run, tmp_path, monkeypatch):
    """``--dp 4 --dp-shard 2 --zero 2 --tp 2``: two replicas of 4 ranks (rank j = dp index x 2 +
    tp index). Rank 3 of replica 1 (dp index 1, tp rank 1) is SIGKILLed at step 3; the replica
    rejoins at step 5 with each rank's shard of its tp slice; the curve is the single process's."""
    ref = reference_run(one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1/3@3,1.1@5:join,0@5:hold")
    proc, records = run_train([*SMALL, *TP, "--dp", "4", "--dp-shard", "2", "--zero", "2",
                               "--exit-after", "6"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 6)
    assert [r["replicas"] for r in steps(records)] == [2, 2, 1, 1, 2, 2]
    s = summary(records)
    assert [len(r["pids"]) for r in s["ranks"]] == [4, 8], s["ranks"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_stages_with_zero_in_a_replica(reference_run, tmp_path, monkeypatch):
    """``--dp 4 --dp-shard 2 --zero 1 --pp 2 --microbatches 2``: two replicas of two pipeline
    stages of a ZeRO-1 group of 2 each (rank j = stage x 2 + dp index). Stage 1's dp index 1 of
    replica 1 is SIGKILLed at step 3; replica 0 redoes it on the whole global batch (each dp
    index 2 microbatches of 2 rows); the restarted replica's rank j copies rank j's shard."""
    ref = reference_run(one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1/3@3,1.1@5:join,0@5:hold")
    proc, records = run_train([*SMALL, "--dp", "4", "--dp-shard", "2", "--zero", "1", "--pp", "2",
                               "--microbatches", "2", *TP[2:], "--exit-after", "6"], tmp_path,
                              timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 6)
    assert [r["replicas"] for r in steps(records)] == [2, 2, 1, 1, 2, 2]
    assert [len(r["pids"]) for r in summary(records)["ranks"]] == [4, 8]
