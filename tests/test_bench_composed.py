"""benchmarks/bench_composed.py's flags, in process: the plan a dry run prints, and bad input
refused with exit 2 and one line naming the flag, before anything is launched."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_composed  # noqa: E402


def test_dry_run_prints_the_plan_and_launches_nothing(capsys, monkeypatch):
    import trainmesh.testing
    monkeypatch.setattr(trainmesh.testing, "run_distributed", lambda *a, **k: pytest.fail("launched"))
    bench_composed.main(["--dry-run", "--layouts", "zero3-tp,hsdp-tp", "--steps", "4"])
    out = capsys.readouterr().out
    assert "zero3-tp (4 processes), hsdp-tp (8 processes)" in out and "3 runs x 4 timed steps" in out


@pytest.mark.parametrize("argv, flag", [
    (["--layouts", "zero3-tp,tp-ep"], "--layouts"),
    (["--layouts", ","], "--layouts"),
    (["--runs", "0"], "--runs"),
    (["--warmup", "-1"], "--warmup"),
    (["--layouts", "hsdp-tp", "--batch", "6"], "--batch"),                     # dp 4
    (["--layouts", "zero3-tp-pp", "--batch", "2", "--microbatches", "2"], "--batch"),   # dp 2 x 2
    (["--heads", "3", "--d-model", "96"], "--heads"),
    (["--d-model", "90"], "--d-model"),
    (["--seq", "30"], "--seq"),
])
def test_bad_flags_exit_2_naming_them(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_composed.main([*argv, "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith(flag), err


@pytest.mark.timeout(30)
def test_torch_comm_meter_books_bytes_and_waits_by_axis():
    """PyTorch's side of the benchmark is measured by wrapping its collectives: a blocking call
    and an async one (still a Work, as FSDP2 checks) each book their payload under the group's
    axis, and their time; nothing while stopped; all put back after. (The functional
    collectives' path costs 1.4 s of torch._dynamo import here; the benchmark checks it: its tp
    bytes are the derivation in docs/BENCHMARKS.md exactly.)"""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from common import TorchCommMeter
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # torch < 2.12
    originals = (dist.all_reduce, gather, funcol.all_reduce, funcol.wait_tensor)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    meter = TorchCommMeter({frozenset({0}): "dp"})
    try:
        t, out = torch.ones(10), torch.empty(10)
        meter.start()
        dist.all_reduce(t)
        work = getattr(dist, gather.__name__)(out, t, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
        meter.stop()
        dist.all_reduce(t)                               # stopped: not booked
        assert meter.bytes == {"dp": {"all_reduce": 40, "all_gather": 40}}, meter.bytes
        assert set(meter.seconds) == {"dp"}, meter.seconds
    finally:
        meter.uninstall()
        dist.destroy_process_group()
    assert (dist.all_reduce, getattr(dist, gather.__name__), funcol.all_reduce, funcol.wait_tensor) == originals
