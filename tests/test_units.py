"""Cheap unit tests for the fast tier (``pytest -m "not slow"``): every module imports, and the
modules otherwise reached only by multi-process tests get a direct check."""
from __future__ import annotations

import importlib
import logging
import pkgutil
import runpy
import sys

import pytest
import torch

import trainmesh


@pytest.mark.timeout(120)
def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(trainmesh.__path__, "trainmesh.")
             if m.name != "trainmesh.__main__"]   # runs the CLI on import: below
    assert len(names) > 80, names
    for name in names:
        importlib.import_module(name)


@pytest.mark.timeout(60)
def test_python_dash_m_trainmesh_runs_the_cli(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["trainmesh", "schedule", "--pp", "2", "--microbatches", "2",
                                      "--json"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("trainmesh", run_name="__main__")
    assert exc.value.code == 0
    assert '"schedule": "1f1b"' in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_worker_logging_is_set_up_by_the_cli_once():
    from trainmesh.cli.logs import configure_worker_logging
    log = logging.getLogger("trainmesh")
    before = (log.level, list(log.handlers))
    try:
        configure_worker_logging(1)
        assert log.level == logging.WARNING
        configure_worker_logging(0)
        configure_worker_logging(0)
        assert log.level == logging.INFO
        added = [h for h in log.handlers if h not in before[1]]
        assert len(added) == 1 and added[0].stream is sys.stdout
    finally:
        log.setLevel(before[0])
        log.handlers[:] = before[1]


@pytest.mark.timeout(30)
def test_library_import_leaves_logging_alone():
    assert not any(type(h).__module__.startswith("trainmesh") for h in logging.getLogger().handlers)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("t", [torch.zeros(2, 3), torch.ones(4, dtype=torch.bfloat16),
                               torch.zeros(1, 2, 3, 4, dtype=torch.int64)])
def test_p2p_shape_header_round_trips(t):
    from trainmesh.pipeline_parallel.p2p import decode_header, encode_header
    assert decode_header(encode_header(t)) == (t.shape, t.dtype)


@pytest.mark.timeout(30)
def test_p2p_plan_pairs_every_send_with_the_next_or_previous_stage():
    from trainmesh.pipeline_parallel.p2p import plan_messages
    from trainmesh.pipeline_parallel.schedules import build_schedule
    s = build_schedule("interleaved", 2, 4, 2)
    plan = plan_messages(s, headers=True)
    for rank, msgs in enumerate(plan):
        for m in msgs:
            kind, stage, _ = m.key
            assert m.src == rank and m.dst == s.stage_to_rank(stage)
            sender_stage = stage - 1 if kind == "act" else stage + 1   # the adjacent stage sends
            assert s.stage_to_rank(sender_stage) == rank
    acts = [m for msgs in plan for m in msgs if m.key[0] == "act"]
    assert len(acts) == 4 * (s.num_stages - 1)               # every microbatch into every later stage
    assert sum(m.header for m in acts) == s.num_stages - 1   # a header on each stage's first one


@pytest.mark.timeout(60)
def test_init_distributed_reads_the_environment_and_writes_only_the_interfaces(monkeypatch):
    import os

    import torch.distributed as dist

    from trainmesh.core.distributed import (
        env_job,
        init_distributed,
        local_world_size,
        shutdown,
    )
    from trainmesh.core.interfaces import IFNAME_VARS, loopback_interface
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", *IFNAME_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "mine")          # the user's own: kept
    assert env_job() is None and local_world_size(3) == 3
    before = dict(os.environ)
    init_distributed(device="cpu", timeout_s=30)   # a world of one, no launcher
    try:
        assert dist.get_world_size() == 1
        added = {k: v for k, v in os.environ.items() if k not in before}
        assert added == {v: loopback_interface() for v in IFNAME_VARS if v != "NCCL_SOCKET_IFNAME"}
        assert os.environ["NCCL_SOCKET_IFNAME"] == "mine"
    finally:
        shutdown()
        for var in IFNAME_VARS:
            if var not in before:
                os.environ.pop(var, None)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
             "SLURM_NTASKS_PER_NODE": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
             "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    for var, value in slurm.items():
        monkeypatch.setenv(var, value)
    assert env_job() == (3, 8, 1, 4) and local_world_size() == 4
