"""Fixtures shared by the test modules.

* :func:`no_launch` — validation only: ``trainmesh train`` in process with the launcher and the
  worker replaced by stubs (a run that gets past validation returns :data:`LAUNCHED`).
* :func:`refused` — ``trainmesh ARGV`` in process exits 2 with one line naming a flag.
* :func:`reference_run` — one-process reference runs of ``trainmesh train``, computed once per
  test session and shared by every module that compares a layout with them (keyed by their
  arguments).
* :func:`metrics_path` — a fresh metrics file path under the test's tmp dir.
* :func:`observed_run` — runs of every layout and mode with every observation on (tests/observed.py),
  once per session.

Tests that start processes or take more than a few seconds carry ``@pytest.mark.slow``; the
fast tier is ``pytest -m "not slow"``.
"""
from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
"""One intra-op thread per process, workers and one-process runs alike: the suite's processes
outnumber the cores (two xdist workers, each with its runs), and a second OpenMP thread that spins
at its barriers while another process holds the core makes a tiny step hundreds of times slower."""

from helpers import LAUNCHED, assert_refused

pytest_plugins = ["cpu_log"] if os.environ.get("CPU_LOG") else []
"""CPU_LOG=FILE: each test's CPU-seconds into FILE (tests/cpu_log.py)."""

WORKER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID")


@pytest.fixture
def no_launch(monkeypatch) -> list:
    """Validation only: no worker ever starts and the process is a launcher, not a worker.
    Returns the list of configs the stubs were handed (empty while nothing got past validation)."""
    import trainmesh.run.ft_launch
    import trainmesh.run.launch
    import trainmesh.run.trainer
    started: list = []

    def launch(cfg, *args, **kwargs):
        started.append(cfg)
        return LAUNCHED

    def worker(cfg, *args, **kwargs):
        started.append(cfg)
        return LAUNCHED

    monkeypatch.setattr(trainmesh.run.launch, "launch_local", launch)
    monkeypatch.setattr(trainmesh.run.ft_launch, "launch_fault_tolerant", launch)
    monkeypatch.setattr(trainmesh.run.trainer, "worker_main", worker)
    for var in WORKER_ENV:
        monkeypatch.delenv(var, raising=False)
    return started


@pytest.fixture
def refused(capsys) -> Callable[[list[str], str], str]:
    """``refused(argv, flag)``: ``trainmesh ARGV`` (in process) exits 2 with exactly one line on
    stderr naming ``flag``, without a traceback; returns that line."""
    return lambda argv, flag: assert_refused(capsys, argv, flag)


@pytest.fixture
def counted(monkeypatch) -> list[int]:
    """[bytes read from safetensors files since the last reset] (every read goes through
    ``trainmesh.models.safetensors_file._read_at``)."""
    from trainmesh.models import safetensors_file
    count, read_at = [0], safetensors_file._read_at

    def counting(fd: int, buffer: memoryview, offset: int) -> int:
        count[0] += len(buffer)
        return read_at(fd, buffer, offset)
    monkeypatch.setattr(safetensors_file, "_read_at", counting)
    return count


@pytest.fixture
def metrics_path(tmp_path: Path) -> Path:
    """Where a run writes its ``--metrics-out`` file."""
    return tmp_path / "metrics.jsonl"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Callable[..., list[dict]]:
    """``reference_run(args)``: the metrics records of ``trainmesh train ARGS`` (a one-process
    reference, by default), run once per session for each distinct argument list; with
    pytest-xdist (``-n``), once for all its workers (a file per argument list under the
    session's tmp root, written under a lock)."""
    from helpers import run_train
    cache: dict[tuple[str, ...], list[dict]] = {}
    shared = (tmp_path_factory.getbasetemp().parent / "references"
              if os.environ.get("PYTEST_XDIST_WORKER") else None)

    def run(args: tuple[str, ...], timeout: float) -> list[dict]:
        proc, records = run_train(list(args), tmp_path_factory.mktemp("reference"), timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return records

    def get(args: list[str], *, timeout: float = 180) -> list[dict]:
        key = tuple(args)
        if key not in cache:
            if shared is None:
                cache[key] = run(key, timeout)
            else:
                shared.mkdir(exist_ok=True)
                path = shared / hashlib.sha256("\0".join(key).encode()).hexdigest()
                with open(path.with_suffix(".lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)   # the other workers wait for this one
                    if not path.exists():
                        path.write_text(json.dumps(run(key, timeout)))
                cache[key] = json.loads(path.read_text())
        return copy.deepcopy(cache[key])   # a test may edit its records
    return get


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory) -> Callable[[str], Path]:
    """``observed_run(name)``: the directory of the run ``name`` of tests/observed.py (its
    metrics, console, checkpoints, TensorBoard), run at most once per session; with
    pytest-xdist, once for all its workers (under a lock, as :func:`reference_run`)."""
    from observed import run_observed
    root = (tmp_path_factory.getbasetemp().parent / "observed"
            if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path_factory.mktemp("observed"))
    root.mkdir(exist_ok=True)

    def get(name: str) -> Path:
        out, failed = root / name, root / f"{name}.failed"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # the other workers wait for this one
            if not (out / "run.jsonl").exists() and not failed.exists():
                try:
                    run_observed(name, out)
                except Exception as exc:   # noqa: BLE001 - recorded for every worker
                    failed.write_text(str(exc))
        if failed.exists():
            raise AssertionError(failed.read_text())
        return out
    return get
