"""`trainmesh train` end to end: equivalence across DP layouts, accounting, bad input, faults."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from helpers import (
    SMALL,
    Launched,
    assert_equivalent,
    check_prediction,
    one_process,
    run_train,
    steps,
    summary,
    trainmesh_process,
)

from trainmesh.cli import main
from trainmesh.testing import worker_pids

LAYOUTS = {"dp2": ["--dp", "2"], "dp4": ["--dp", "4"], "mb4": ["--microbatches", "4"],
           "dp2mb2": ["--dp", "2", "--microbatches", "2"]}


@pytest.fixture(scope="module", params=["adamw", "sgd"])
def reference(request, reference_run):
    return request.param, reference_run(one_process(request.param))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_is_equivalent_to_one_process(reference, layout, tmp_path):
    optimizer, ref = reference
    proc, run = run_train([*SMALL, "--optimizer", optimizer, *LAYOUTS[layout]], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_equivalent(ref, run)
    if optimizer == "adamw" and layout == "dp2":
        check_ddp_accounting(summary(run))
    check_prediction([*SMALL, "--optimizer", optimizer, *LAYOUTS[layout]], summary(run))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lr_column_is_the_lr_each_step_used(reference):
    """The metrics' ``lr``: linear warm-up to the peak on step --warmup-steps (5 here), then a
    cosine to 10% of the peak at --steps (catches a warm-up off by one and an lr read after the
    scheduler stepped)."""
    import math

    from trainmesh.cli import build_parser
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    optimizer, records = reference
    cfg = build_train_config(collect(build_parser().parse_args(["train", *SMALL, "--optimizer", optimizer]), True))
    warm, total = cfg.warmup_steps, cfg.steps
    want = [cfg.peak_lr * (k / warm if k <= warm else
                           0.1 + 0.45 * (1 + math.cos(math.pi * (k - 1 - warm) / (total - warm))))
            for k in range(1, total + 1)]
    assert (warm, total) == (5, 20)
    assert [r["lr"] for r in steps(records)] == pytest.approx(want, rel=1e-9)


def check_ddp_accounting(s: dict) -> None:
    """docs/METRICS.md: dp.all_reduce 4Ψ per step; params 4Ψ, grads 4Ψ, optimizer 8Ψ (AdamW)."""
    psi = s["params"]
    for r in s["ranks"]:
        assert r["comm_bytes_per_step"]["dp"]["all_reduce"] == pytest.approx(4 * psi, rel=0.02)
        held = r["model_state_bytes"]
        assert held["params"] == pytest.approx(4 * psi, rel=0.02)
        assert held["grads"] == pytest.approx(4 * psi, rel=0.02)
        assert held["optimizer"] == pytest.approx(8 * psi, rel=0.02)
        assert r["comm_buffer_peak_bytes"] == 0
        assert r["peak_mem_bytes"] >= r["setup_mem_bytes"] >= r["base_mem_bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bare_demo_learns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    t0 = time.time()
    proc = trainmesh_process(["train"], tmp_path, env=env, timeout=110, name="demo", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "world 2" in proc.stdout
    assert "on 2 processes (cpu): dp 2 x cp 1 x pp 1 x tp 1" in proc.stdout   # rank 0's log line: the
                                                                        # CLI set up its logging
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < 0.6 * first, (first, last)
    assert time.time() - t0 < 110


@pytest.mark.parametrize("args, field", [
    (["--dp", "3", "--global-batch", "8"], "global-batch"),
    (["--dp", "0"], "dp"),
    (["--zero", "7"], "zero"),
    (["--precision", "fp8"], "precision"),
    (["--schedule", "zigzag"], "schedule"),
    (["--optimizer", "lion"], "optimizer"),
    (["--model", "huge"], "model"),
    (["--heads", "5"], "heads"),
    (["--data", "/no/such/file.txt"], "data"),
    (["--offload", "cpu"], "offload"),
    (["--exit-after", "500", "--steps", "10"], "exit-after"),
    (["--recompute-segment", "0"], "recompute-segment"),
    (["--config", "/no/such.toml"], "config"),
    (["--device", "cuda"], "device"),
])
def test_bad_input_exits_2_naming_the_field(args, field, capsys):
    if field == "device":
        import torch
        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    assert "Traceback" not in err[0]


def test_unknown_flag_exits_2(capsys):
    assert main(["train", "--dpp", "2"]) == 2
    assert "did you mean --dp?" in capsys.readouterr().err


def test_toml_config_and_flags_win(tmp_path):
    from trainmesh.cli.train import collect
    from trainmesh.config.train import build_train_config
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('[parallel]\ndp = 2\nmicrobatches = 2\n[train]\nsteps = 7\nglobal-batch = 8\n')
    from trainmesh.cli import build_parser
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--steps", "9"])
    cfg = build_train_config(collect(args, True))
    assert (cfg.parallel.dp, cfg.parallel.microbatches, cfg.steps, cfg.global_batch) == (2, 2, 9, 8)
    cfg_file.write_text("bogus = 1\n")
    assert main(["train", "--config", str(cfg_file)]) == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_worker_fails_the_run_naming_the_rank(metrics_path):
    """A launcher of its own (its process tree a fresh launcher's, forked from the test zygote:
    tests/helpers.py ``Launched``) whose worker is SIGKILLed."""
    metrics = metrics_path
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = Launched(["train", *SMALL[:-4], "--steps", "100000", "--dp", "2", "--metrics-out",
                     str(metrics), "--timeout", "30"], metrics.parent, env=env, name="killed")
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.2)
        workers = worker_pids(proc.pid)
        assert len(workers) == 2, workers
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.end()
    assert proc.returncode == 1
    assert re.search(r"rank \d failed", err), err[-2000:]
    assert "SIGKILL" in err
    for pid in workers:   # every worker torn down
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
