"""--fault-tolerant with tensor (and pipeline) parallelism inside each replica (``--dp 2 --tp 2``:
two replicas, each the 2 tp ranks of one dp index under its own elastic agent). A tp rank lost takes its whole
replica down and never the other; the survivor redoes the step on the whole global batch; the
restarted replica's tp rank j gets tp rank j's slice of the live state from the same rank of a
peer; the loss curve is the single process's. Faults are injected with TRAINMESH_FT_INJECT
(``R/J@K``: rank J of replica R at step K)."""
from __future__ import annotations

import pytest
from helpers import (
    SMALL,
    check_one_replica_restarted,
    one_process,
    run_train,
    steps,
    summary,
)
from test_fault_tolerance import _same_curve

TP = ["--tp", "2", "--fault-tolerant", "--timeout", "30", "--optimizer", "adamw"]
FT = ["--dp", "2", *TP]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tp_rank_lost_takes_its_replica_down_and_it_rejoins(reference_run, tmp_path, monkeypatch):
    """tp rank 1 of replica 1 is SIGKILLed at step 4 just before the all-reduce across replicas
    (its tp peer, rank 0, is already in it with replica 0's rank 0). Replica 0 redoes step 4
    alone, both its tp ranks on the whole global batch; replica 1's agent restarts both its
    ranks, which rejoin at step 7, each with its own tp slice of replica 0's live state (a slice
    sent to the wrong tp rank, or rows split by rank instead of dp index, breaks the curve)."""
    ref = reference_run(one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1/1@4,1.1@7:join,0@7:hold")
    proc, records = run_train([*SMALL, *FT, "--exit-after", "9"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 9)
    quorums = [(q["step"], q["replicas"], q["lost"], q["joined"]) for q in records
               if q["event"] == "quorum"]
    assert quorums == [(4, 1, [1], []), (7, 2, [], [1])], quorums
    assert [r["replicas"] for r in steps(records)] == [2] * 3 + [1] * 3 + [2] * 3
    assert steps(records)[6]["state_transfer_s"] > 0            # step 7: the slices copied
    assert summary(records)["world_size"] == 4, summary(records)
    check_one_replica_restarted(records, ranks=2, degraded=3)


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
def test_pipeline_stages_in_a_replica(reference_run, tmp_path, monkeypatch):
    """``--dp 2 --pp 2 --microbatches 2``: two replicas of two pipeline stages. Stage 1 of
    replica 1 is SIGKILLed at step 3; replica 0's two stages redo it on the whole global batch
    (2 microbatches of 4 rows); the restarted replica's stage j copies stage j's live state."""
    ref = reference_run(one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1/1@3,1.1@5:join,0@5:hold")
    proc, records = run_train([*SMALL, "--dp", "2", "--pp", "2", "--microbatches", "2", *TP[2:],
                               "--exit-after", "6"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 6)
    assert [r["replicas"] for r in steps(records)] == [2, 2, 1, 1, 2, 2]
    assert [len(r["pids"]) for r in summary(records)["ranks"]] == [2, 4]
