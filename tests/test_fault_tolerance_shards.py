"""--fault-tolerant with replicas of several ranks (``--dp 4 --dp-shard 2``: two replicas, each
an HSDP shard group of 2 ranks under its own elastic agent). A rank lost takes its whole replica
down and never the other; the survivors redo the step; the restarted replica's rank j gets rank
j's live shard from the same rank of a peer; the loss curve is the single process's. Failures
during the recovery of a 2-rank replica end recovered or with exit 1 naming why, never hung.
Faults are injected with TRAINMESH_FT_INJECT (``R/J@K``: rank J of replica R at step K)."""
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

FT = ["--dp", "4", "--dp-shard", "2", "--fault-tolerant", "--timeout", "30", "--optimizer", "adamw"]


def _quorums(records: list[dict]) -> list[tuple]:
    return [(q["step"], q["replicas"], q["lost"], q["joined"]) for q in records
            if q["event"] == "quorum"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_lost_takes_its_replica_down_and_it_rejoins(reference_run, tmp_path, monkeypatch):
    """ZeRO-2. Rank 1 of replica 1 is SIGKILLed at step 5 just before the all-reduce across
    replicas (its shard peer, rank 0, is already in it with replica 0's rank 0: that collective
    succeeds, replica 0's rank 1 sees its own fail, and replica 0's two ranks must agree to
    discard). Replica 0 redoes step 5 alone, on the whole global batch; replica 1's agent
    restarts both its ranks, which rejoin at step 10 with the live shards of replica 0."""
    ref = reference_run(one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1/1@5,1.1@10:join,0@10:hold")
    proc, records = run_train([*SMALL, *FT, "--zero", "2", "--exit-after", "13"], tmp_path,
                              timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 13)
    assert _quorums(records) == [(5, 1, [1], []), (10, 2, [], [1])], _quorums(records)
    assert [r["replicas"] for r in steps(records)] == [2] * 4 + [1] * 5 + [2] * 4
    assert steps(records)[9]["state_transfer_s"] > 0            # step 10: the shards copied
    check_one_replica_restarted(records, ranks=2, degraded=5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failures_during_the_recovery_of_a_two_rank_replica(reference_run, tmp_path, monkeypatch):
    """ZeRO-3. At step 2 the all-reduce across replicas of replica 0's rank 1 fails, the process
    alive, while its rank 0's goes through: both ranks discard step 2 and every replica redoes
    it. Replica 1 fails at step 3 (its rank 0). Rejoining at step 6, its rank 1 dies
    before receiving its shard (a receiver lost during recovery): discarded, replica 0 goes on
    alone and replica 1 is restarted again. Rejoining at step 9, the source's rank 1 dies before
    sending (the source lost during recovery): no replica holding the live state is left, so
    the run ends with exit 1 naming why, the steps committed before still exact."""
    ref = reference_run(one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", ",".join([
        "0/1@2:fail", "1@3", "1.1@6:join", "0@6:hold", "1/1.1@6:recv",
        "1.2@9:join", "0@9:hold", "0/1@9:send"]))
    proc, records = run_train([*SMALL, *FT, "--zero", "3"], tmp_path, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "no replica holding the live state is left" in last and "Traceback" not in last, last
    _same_curve(ref, records, 8)
    assert _quorums(records)[:4] == [(3, 1, [1], []), (6, 2, [], [1]), (6, 1, [1], []),
                                     (9, 2, [], [1])], _quorums(records)
    s = summary(records)
    assert s["steps"] == 8 and s["fault_tolerance"]["failed_attempts"] == 4, s
    assert [r["replicas"] for r in steps(records)][:3] == [2, 2, 1]   # step 2 redone by both
