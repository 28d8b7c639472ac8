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
    bench_composed.main(["--dry-run", "--layouts", "zero3,zero3-tp,hsdp-tp", "--steps", "4"])
    out = capsys.readouterr().out
    assert "zero3 (2 processes), zero3-tp (4 processes), hsdp-tp (8 processes)" in out, out
    assert "3 runs x 4 timed steps" in out


@pytest.mark.parametrize("argv, flag", [
    (["--layouts", "zero3-tp,tp-ep"], "--layouts"),
    (["--layouts", ","], "--layouts"),
    (["--runs", "0"], "--runs"),
    (["--warmup", "-1"], "--warmup"),
    (["--layouts", "hsdp-tp", "--batch", "6"], "--batch"),                     # dp 4
    (["--layouts", "zero3", "--batch", "3"], "--batch"),                        # dp 2
    (["--layouts", "zero3-tp-pp", "--batch", "2", "--microbatches", "2"], "--batch"),   # dp 2 x 2
    (["--heads", "3", "--d-model", "96"], "--heads"),
    (["--d-model", "90"], "--d-model"),
    (["--seq", "30"], "--seq"),
    (["--zero3-reshard", "unit"], "--zero3-reshard"),
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


def test_the_memory_and_dp_blocked_verdicts_are_printed(capsys):
    """Each layout says whether trainmesh's peak per rank is within 5% of PyTorch's and whether
    its blocked share on each data-parallel axis is at most PyTorch's."""
    s = {"layout": "hsdp-tp", "processes": 8, "ratio": 2.0, "ratios": [2.0], "max_abs_dloss": 0.0, "tokens_per_s": {"trainmesh": 2.0, "torch": 1.0},
         "step_ms": {"trainmesh": 10.0, "torch": 20.0}, "cpu_s_per_step_all_ranks": {"trainmesh": 1, "torch": 1},
         "peak_mib_max_rank": {"trainmesh": 10.6, "torch": 10.0},
         "held_and_step_mib_rank0": {"trainmesh": [1, 2], "torch": [1, 2]},
         "bytes_per_step_rank0": {"trainmesh": {}, "torch": {}}, "trainmesh_comm_buffer_peak_mib": 1.0,
         "exposed_share": {"trainmesh": {"dp_shard": 0.2, "dp_replicate": 0.05, "tp": 0.5},
                           "torch": {"dp_shard": 0.1, "dp_replicate": 0.06, "tp": 0.1}},
         "exposed_ms_per_step": {"trainmesh": {"dp_shard": 2.0, "dp_replicate": 0.5, "tp": 5.0},
                                 "torch": {"dp_shard": 2.0, "dp_replicate": 1.2, "tp": 2.0}}}
    bench_composed._print(s, {"steps": 6, "warmup": 2})
    out = capsys.readouterr().out
    assert "trainmesh / PyTorch 1.060 (ABOVE 1.05)" in out, out
    assert "dp_shard blocked share: trainmesh 20.0% (2.0 ms), PyTorch 10.0% (2.0 ms): ABOVE" in out
    assert "dp_replicate blocked share: trainmesh 5.0% (0.5 ms), PyTorch 6.0% (1.2 ms): at most" in out
    assert "tp blocked share" not in out
    s["peak_mib_max_rank"]["trainmesh"] = 10.4
    bench_composed._print(s, {"steps": 6, "warmup": 2})
    assert "1.040 (within 1.05)" in capsys.readouterr().out
