"""Elastic resize: a job that loses a node keeps training at a smaller dp and grows back when the
node returns, on the uninterrupted loss curve.

The layout choice is a pure function, checked without processes; one real trial (two of
torchrun's elastic agents of 2 ranks each, configured from torchrun's flags, their workers forked
from a preloaded server: tests/elastic_run.py) shrinks dp 4 -> 2 -> 4; one torchrun run with too
few processes checks the runtime error. The soak: benchmarks/soak_elastic.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from elastic_run import ARGS, STEPS, last_per_step, run_trial
from helpers import SMALL, steps
from tolerances import LOSS_ABS, NORM_REL

from trainmesh.config.train import build_train_config
from trainmesh.run.elastic import Layout, ResizeError, fit_world, layout_change, resize


# ---------------------------------------------------------------- the pure function
@pytest.mark.parametrize("world, dp, micro, min_dp, want", [
    (4, 4, 1, 2, Layout(4, 1, 4)),   # the full world: the full layout
    (3, 4, 1, 2, Layout(2, 2, 2)),   # dp 3 would not keep the global batch: dp 2, one rank idle
    (2, 4, 1, 1, Layout(2, 2, 2)),
    (1, 4, 2, 1, Layout(1, 8, 1)),   # microbatches raised so that dp x microbatches stays 8
    (8, 4, 1, 1, Layout(4, 1, 4)),   # never beyond --dp
    (6, 6, 1, 1, Layout(6, 1, 6)),
    (5, 6, 1, 1, Layout(3, 2, 3)),   # 5 and 4 do not divide 6
])
def test_resize_picks_the_largest_dp_that_keeps_the_global_batch(world, dp, micro, min_dp, want):
    assert resize(world, dp=dp, pp=1, tp=1, microbatches=micro, min_dp=min_dp) == want


def test_resize_keeps_tp_and_pp():
    # 12 ranks of pp 2 x tp 2 lost 5: 7 hold one dp replica of 4 ranks
    assert resize(7, dp=3, pp=2, tp=2, microbatches=2, min_dp=1) == Layout(1, 6, 4)
    # interleaved: the microbatches stay a multiple of pp (dp 2 would leave 3 for pp 2)
    assert resize(4, dp=3, pp=2, tp=1, microbatches=2, min_dp=1) == Layout(2, 3, 4)
    assert resize(4, dp=3, pp=2, tp=1, microbatches=2, min_dp=1, microbatch_multiple=2) == Layout(1, 6, 2)


def test_resize_errors_say_which_axis_cannot_shrink():
    with pytest.raises(ResizeError) as err:
        resize(2, dp=1, pp=2, tp=2, microbatches=1, min_dp=1)
    assert str(err.value) == ("--min-dp: 2 processes left cannot hold pp 2 x tp 2 with dp >= "
                              "--min-dp 1 (needs 4)")
    with pytest.raises(ResizeError, match=r"cannot hold pp 1 x tp 1 with dp >= --min-dp 3"):
        resize(2, dp=4, pp=1, tp=1, microbatches=1, min_dp=3)
    with pytest.raises(ResizeError, match=r"hold dp 3\.\.3 .* none keeps the global batch: dp must "
                                          r"divide dp x microbatches = 4"):
        resize(3, dp=4, pp=1, tp=1, microbatches=1, min_dp=3)


def test_fit_world_changes_only_dp_and_microbatches():
    cfg = build_train_config({"dp": 4, "min_dp": 2, "global_batch": 8, "zero": 1})
    small = fit_world(cfg, 2)
    assert (small.parallel.dp, small.parallel.microbatches, small.parallel.zero) == (2, 2, 1)
    assert small.global_batch == 8 and fit_world(cfg, 4) is cfg
    fixed = build_train_config({"dp": 4, "global_batch": 8})
    assert fit_world(fixed, 2) is fixed          # not elastic: the mesh refuses a wrong world
    change = layout_change(cfg.parallel.layout_record(), small.parallel.layout_record(), step=11, world=2)
    assert change == {"event": "resize", "step": 11, "world_size": 2,
                      "from": {"dp": 4, "microbatches": 1}, "to": {"dp": 2, "microbatches": 2}}
    assert layout_change(cfg.parallel.layout_record(), cfg.parallel.layout_record(), step=3, world=4) is None


def test_join_leaves_out_the_ranks_beyond_the_layout(monkeypatch):
    """3 processes for a dp 4 job: dp 2 x 2 microbatches on ranks 0-1, whose process group
    holds 2 (the fitted world size, passed to init_distributed), and rank 2 ends at once. The
    environment is left alone (no hidden global state)."""
    from trainmesh.run.elastic import join
    cfg = build_train_config({"dp": 4, "min_dp": 1, "global_batch": 8})
    monkeypatch.setenv("WORLD_SIZE", "3")
    fitted, takes_part = join(cfg, rank=2, world=3)
    assert not takes_part and fitted.parallel.dp == 2
    fitted, takes_part = join(cfg, rank=1, world=3)
    assert takes_part and (fitted.parallel.dp, fitted.parallel.microbatches) == (2, 2)
    assert fitted.parallel.world_size == 2 and os.environ["WORLD_SIZE"] == "3"
    fixed = build_train_config({"dp": 4, "global_batch": 8})
    assert join(fixed, rank=3, world=3) == (fixed, True)   # not elastic: untouched


@pytest.mark.parametrize("args", [["--dp", "2", "--min-dp", "3"], ["--min-dp", "2"],
                                  ["--dp", "2", "--min-dp", "0"]])
def test_min_dp_beyond_the_layout_exits_2_naming_it(no_launch, refused, args):
    refused(["train", *SMALL, *args], "--min-dp")
    assert no_launch == []


# ---------------------------------------------------------------- real processes
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_layout_left_ends_the_job_with_one_line(tmp_path):
    """pp 2 x tp 2 cannot run on the 2 processes torchrun gives: exit 1, the reason in one line."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "trainmesh", "train",
         *SMALL, "--pp", "2", "--tp", "2", "--min-dp", "1"],
        env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("trainmesh train: rank")]
    assert lines, proc.stderr[-2000:]
    assert lines[0].endswith("--min-dp: 2 processes left cannot hold pp 2 x tp 2 with dp >= "
                             "--min-dp 1 (needs 4)"), lines
    assert "ResizeError" not in proc.stderr and "trainmesh/" not in proc.stderr  # no worker traceback


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_lose_a_node_then_get_it_back(reference_run, tmp_path):
    """dp 4 over two agents; one is killed after step 5 (dp 2 goes on), started again (dp 4
    again): every record of every step, recomputed ones included, on the single-process curve."""
    ref_at = last_per_step(reference_run(ARGS))
    trial = run_trial(tmp_path, deadline_s=300)
    assert trial.codes == [0, 0] and "error" not in trial.seconds, (trial.seconds, trial.errors)
    done = last_per_step(trial.records)
    assert sorted(done) == list(range(1, STEPS + 1))
    for r in steps(trial.records):
        want = ref_at[r["step"]]
        assert abs(r["loss"] - want["loss"]) <= LOSS_ABS, \
            (r["step"], r["world_size"], r["loss"], want["loss"])
        assert abs(r["grad_norm"] - want["grad_norm"]) <= NORM_REL * want["grad_norm"], r["step"]
    worlds = [done[s]["world_size"] for s in sorted(done)]
    phases = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert phases == [4, 2, 4], phases
    assert all(done[s]["dp"] == done[s]["world_size"] for s in done)
    # resumed from the newest checkpoint (saved after each step's record), not from the start
    shrink = next(i for i, r in enumerate(trial.records) if r["event"] == "resize")
    last_big = max(r["step"] for r in steps(trial.records[:shrink]))
    assert trial.records[shrink]["step"] in (last_big, last_big + 1), (last_big, trial.records[shrink])
    resized = [(r["from"]["dp"], r["to"]["dp"], r["to"]["microbatches"])
               for r in trial.records if r["event"] == "resize"]
    assert resized == [(4, 2, 2), (2, 4, 1)], resized
    assert trial.records[-1]["event"] == "summary" and trial.records[-1]["world_size"] == 4
