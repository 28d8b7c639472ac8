"""--fault-tolerant with everything on, on one host: checkpoints (async), evaluation, TensorBoard
and a trace on a mixture-of-experts model; context parallelism in fp16 (its loss scaler agreed
across replicas) and tensor parallelism with sequence parallelism inside each replica. A
replica is SIGKILLed mid-run in each; the others are never restarted and every step equals
the single process with the same flags. The checkpoints written through the fault resume at
plain --dp 1 and continue the same curve."""
from __future__ import annotations

import shutil

import pytest
from helpers import EVAL, SMALL, one_process, run_train, steps, summary
from test_fault_tolerance import _same_curve
from tolerances import LOSS_ABS

FT = ["--dp", "3", "--fault-tolerant", "--timeout", "30"]
MOE = [*SMALL[:-4], "--steps", "12", "--warmup-steps", "3", "--optimizer", "adamw", "--experts", "4",
       "--top-k", "2", "--moe-every", "2"]
"""SMALL (global batch 8: 3 + 3 + 2 rows over three replicas, 4 + 4 over two) with MoE layers."""
FP16_MOE = ["--precision", "fp16", "--experts", "4", "--top-k", "2", "--moe-every", "2"]
"""The one process of the cp case: fp16, MoE layers (context parallelism is inside a replica)."""


def _survivors_kept(records: list[dict], ranks: int = 1) -> None:
    """Replicas 0 and 2 never restarted; replica 1 restarted once."""
    pids = {r["replica"]: r["pids"] for r in summary(records)["ranks"]}
    assert len(pids[0]) == len(pids[2]) == ranks and len(pids[1]) == 2 * ranks, pids


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_checkpoints_eval_board_trace_moe_through_a_fault(reference_run, tmp_path, monkeypatch):
    """Replica 1 is SIGKILLed at step 8 after its all-reduce went through, before it reported
    (the others' attempts succeeded; step 8, a checkpoint step, is discarded and redone by
    replicas 0 and 2), and rejoins at step 10. Checkpoints every 4 steps in the background,
    evaluation every 4: the same held-out losses as one process; the step-8 checkpoint resumes at
    --dp 1 and continues the one-process curve."""
    ref = reference_run([*MOE, *EVAL[:1], "4", *EVAL[2:]])
    ck, board, trace = tmp_path / "ck", tmp_path / "tb", tmp_path / "trace.json"
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1@8:report,1.1@10:join,0@10:hold")
    proc, records = run_train([*MOE, *FT, "--save-dir", str(ck), "--save-every", "4", "--async-save",
                               "--eval-every", "4", *EVAL[2:], "--tensorboard", str(board),
                               "--trace-out", str(trace)], tmp_path, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 12)
    assert [r["replicas"] for r in steps(records)] == [3] * 7 + [2] * 2 + [3] * 3
    evals = {r["step"]: r["loss"] for r in records if r["event"] == "eval"}
    want = {r["step"]: r["loss"] for r in ref if r["event"] == "eval"}
    assert sorted(evals) == [4, 8, 12] and all(abs(evals[k] - want[k]) <= LOSS_ABS for k in evals)
    assert sorted(r["step"] for r in records if r["event"] == "save") == [4, 8, 12]
    assert sorted(p.name for p in ck.glob("step-*")) == [f"step-{k:08d}" for k in (4, 8, 12)]
    assert any(board.rglob("events.out.tfevents.*")) and "traceEvents" in trace.read_text()
    assert all("moe" in r for r in steps(records))
    _survivors_kept(records)
    again = tmp_path / "again"
    shutil.copytree(ck / "step-00000008", again / "step-00000008")
    proc, resumed = run_train([*MOE, "--save-dir", str(again), "--resume"], tmp_path, name="resumed",
                              timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in steps(resumed)] == list(range(9, 13))
    _same_curve(ref, [r for r in steps(ref) if r["step"] <= 8] + steps(resumed), 12)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("layout, model", [(["--cp", "2"], FP16_MOE),
                                           (["--tp", "2", "--sequence-parallel"], [])],
                         ids=["cp2-moe-fp16", "tp2-sp"])
def test_parallelism_inside_each_replica(layout, model, reference_run, tmp_path, monkeypatch):
    """Replicas of 2 ranks (a CP group running MoE layers in fp16; a TP group with sequence
    parallelism): rank 1 of replica 1 is SIGKILLed at step 4 just before the sums across
    replicas; replicas 0 and 2 redo it (4 + 4 rows), replica 1's agent restarts both its ranks,
    which copy their live state at step 7. fp16 starts at the default scale 2^16, so the first
    steps overflow and back off, across the fault: every step's skip and scale are the single
    process's (the replicas decide on the gradient summed across them; one deciding on its own
    gradient disagrees with its peers, which the coordinator refuses), and the rejoining replica
    takes its source's scaler."""
    base = [*SMALL, "--optimizer", "adamw"]
    ref = reference_run([*base, *model] if model else one_process())
    monkeypatch.setenv("TRAINMESH_FT_INJECT", "1/1@4,1.1@7:join,0@7:hold")
    proc, records = run_train([*base, *model, *FT, *layout, "--exit-after", "9"],
                              tmp_path, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same_curve(ref, records, 9)
    assert [r["replicas"] for r in steps(records)] == [3] * 3 + [2] * 3 + [3] * 3
    _survivors_kept(records, ranks=2)
    if model:
        got, want = steps(records), steps(ref)[:9]
        assert [(r["skipped"], r["loss_scale"]) for r in got] == \
            [(r["skipped"], r["loss_scale"]) for r in want]
        assert any(r["skipped"] for r in got[:4]), got
