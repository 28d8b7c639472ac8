"""Parameter-server training: sync equals the one-process run, async learns within its staleness
bound, traffic is pull + push of the parameters, bad input and a dead server end cleanly."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from helpers import (
    SMALL,
    Launched,
    assert_equivalent,
    one_process,
    run_train,
    steps,
    summary,
)

from trainmesh.cli import main
from trainmesh.parameter_server import shard_by_bytes


def _ps_bytes_ok(run: list[dict]) -> None:
    """Every trainer pushes 4Ψ and pulls 4Ψ per step (fp32); servers hold the shards."""
    s = summary(run)
    psi = s["params"]
    trainers = [r for r in s["ranks"] if r["role"] == "trainer"]
    assert len(trainers) == s["layout"]["dp"]
    for r in trainers:
        ps = r["comm_bytes_per_step"]["ps"]
        assert ps["push"] == pytest.approx(4 * psi, rel=0.02), ps
        assert ps["pull"] == pytest.approx(4 * psi, rel=0.02), ps
    held = [r["model_state_bytes"]["params"] for r in s["ranks"] if r["role"] == "server"]
    assert sum(held) == 4 * psi and len(held) == s["layout"]["ps_servers"]


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[str, list[dict]]:
    """The one-process runs, per optimizer (shared with the other modules for the session)."""
    return {optimizer: reference_run(one_process(optimizer)) for optimizer in ("sgd", "adamw")}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer, servers", [("sgd", 1), ("adamw", 2)])
def test_sync_is_data_parallel(optimizer, servers, reference, tmp_path):
    """Each optimizer once, one server holding every parameter and two splitting them."""
    ref = reference[optimizer]
    proc, run = run_train([*SMALL, "--optimizer", optimizer, "--strategy", "ps", "--dp", "2",
                           "--ps-servers", str(servers)], tmp_path, name=f"ps{servers}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_equivalent(ref, run)
    _ps_bytes_ok(run)
    # the trainers ran the loop every run runs: its summary's throughput and closing lines
    s = summary(run)
    assert s.get("tokens_per_s", 0) > 0 and s["steps"] == len(steps(run)), s
    assert "trainmesh: done in" in proc.stdout and "metrics" in proc.stderr, proc.stdout[-500:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_with_one_trainer_is_the_single_process(reference, tmp_path):
    """No other trainer, no staleness: async's clipping, scaling and LR schedule are the engine's."""
    ref = reference["adamw"]
    proc, run = run_train([*SMALL, "--strategy", "ps", "--dp", "1", "--ps-servers", "2",
                           "--ps-mode", "async"], tmp_path, name="async1", timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_equivalent(ref, run)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_learns_within_staleness(tmp_path):
    """The default model, 2 trainers, 2 servers, at most 1 step ahead of the slowest. 30 steps:
    the loss falls below 0.8 of the first once the warm-up (20 steps) is nearly over (to about
    0.65 of it by step 30)."""
    proc, run = run_train(["--strategy", "ps", "--dp", "2", "--ps-servers", "2", "--ps-mode", "async",
                           "--ps-staleness", "1", "--steps", "30"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [r["loss"] for r in steps(run)]
    assert len(losses) == 30 and min(losses) < 0.8 * losses[0], losses
    assert all(0 <= r["staleness"] <= 1 for r in steps(run))
    assert 0 <= summary(run)["max_staleness"] <= 1
    _ps_bytes_ok(run)


def test_shards_balance_bytes():
    import torch
    named = [(f"p{i}", torch.empty(n)) for i, n in enumerate([100, 60, 50, 40, 10])]
    plan = shard_by_bytes(named, 2)
    sizes = [sum(dict(named)[n].numel() for n in shard) for shard in plan]
    # largest first onto the lighter server: 100 | 60, 50 | 40 onto 100 | 10 onto 110
    assert sizes == [140, 120], sizes
    assert max(sizes) - min(sizes) <= 100   # list scheduling: imbalance below the largest tensor
    assert sorted(sum(plan, [])) == sorted(n for n, _ in named)


@pytest.mark.parametrize("args, field", [
    (["--strategy", "ps", "--ps-servers", "0"], "ps-servers"),
    (["--strategy", "ps", "--dp", "2", "--tp", "2"], "tp"),
    (["--strategy", "ps", "--pp", "2"], "pp"),
    (["--strategy", "ps", "--dp", "2", "--zero", "1"], "zero"),
    (["--strategy", "ps", "--ps-mode", "eventually"], "ps-mode"),
    (["--strategy", "ps", "--ps-staleness", "-1"], "ps-staleness"),
    (["--strategy", "star"], "strategy"),
    (["--strategy", "ps", "--precision", "bf16"], "precision"),
    (["--strategy", "ps", "--ps-staleness", "2"], "ps-staleness"),     # sync has no staleness
    (["--ps-servers", "2"], "ps-servers"),                              # without --strategy ps
    (["--strategy", "ps", "--save-dir", "ck"], "save-dir"),
])
def test_bad_input(args, field, capsys):
    assert main(["train", *SMALL, *args]) == 2   # refused before any worker starts
    err = capsys.readouterr().err
    assert f"{field}:" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker through /proc")
@pytest.mark.timeout(600)
def test_killed_server_ends_the_job(tmp_path):
    """The second server is SIGKILLed mid-run: the job ends with exit 1 naming its rank. (The
    launcher forks from the test zygote: no interpreter or fork server started for it.)"""
    out = tmp_path / "ps.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = Launched(["train", *SMALL, "--steps", "100000", "--strategy", "ps", "--dp", "2",
                    "--ps-servers", "2", "--timeout", "60", "--metrics-out", str(out)], tmp_path,
                   env=env, name="ps", own_fork_server=False)
    try:
        while not out.exists() or len(out.read_text().splitlines()) < 3:   # bounded by the test's
            assert run.poll() is None, run.communicate()[1][-2000:]     # timeout (after the
            time.sleep(0.5)                                              # zygote's start-up)
        pids = run.workers()
        assert len(pids) == 4, pids
        os.kill(pids[3], signal.SIGKILL)   # RANK 3: the second server
        _, err = run.communicate(timeout=120)
    finally:   # a failed test ends the run
        run.end()
    assert run.returncode == 1, err[-2000:]
    assert "rank 3" in err.splitlines()[-1], err[-2000:]


def _api_check() -> dict | None:
    """Any nn.Module through PSEngine: 2 trainers + 1 server, 3 SGD steps, mean-loss form."""
    import torch
    import torch.distributed as dist

    import trainmesh as tm
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    engine = tm.PSEngine(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                         lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                         tm.ParallelConfig(strategy="ps", dp=2, ps_servers=1))
    if engine.is_server:
        engine.serve()
        return None
    rank = dist.get_rank()
    losses = [engine.train_step((x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4])) for _ in range(3)]
    engine.close()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "ps_bytes": engine.ledger.bytes_per_step(("ps",))["ps"]}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_python_api_any_model():
    import torch

    from trainmesh.testing import run_distributed
    res = run_distributed(_api_check, 3, timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    x, y = torch.randn(8, 5), torch.randn(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(3):   # the one-process reference on the whole batch
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    assert res[2] is None
    for rank in (0, 1):   # fp32 sums of 8 terms: a few ulps of values of order 1
        assert res[rank]["losses"] == pytest.approx(ref_losses, abs=1e-6)
        psi = sum(p.numel() for p in model.parameters())
        assert res[rank]["ps_bytes"] == {"push": 4 * psi, "pull": 4 * psi}, res[rank]["ps_bytes"]
        for got, want in zip(res[rank]["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-6)
