"""Opt-in pytest plugin: the CPU-seconds each test costs, its processes and every process they
start included (launchers, workers, fork servers, simulated hosts).

The suite is CPU-bound on 2 cores: its wall time is about its CPU-seconds over 2, so CPU is
what to measure when it grows. Each pytest process (each xdist worker) moves itself into a
cgroup of its own; a test's cost is what that cgroup's CPU counter gained while it ran. Needs
root and a cgroup v1 ``cpuacct`` or cgroup v2 hierarchy; elsewhere it records nothing.

    CPU_LOG=cpu.jsonl python -m pytest -q -n 2

appends one JSON line per test: ``{"id", "cpu", "wall"}``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup")
_group: Path | None = None
_log: str = ""
"""Where the lines go (read once: tests may clear os.environ)."""


def _join_own_group(name: str) -> Path | None:
    """A new cgroup holding this process (its children follow it), or None where none can be made."""
    base = V1 if V1.is_dir() else V2 if (V2 / "cgroup.controllers").exists() else None
    if base is None:
        return None
    for stale in base.glob("trainmesh-tests-*"):   # earlier runs' (their zygotes outlived
        try:                                        # the unconfigure hook); rmdir only empties
            stale.rmdir()
        except OSError:
            pass
    group = base / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def _cpu_s(group: Path) -> float:
    if (group / "cpuacct.usage").exists():
        return int((group / "cpuacct.usage").read_text()) / 1e9
    usage = next(line for line in (group / "cpu.stat").read_text().splitlines()
                 if line.startswith("usage_usec"))
    return int(usage.split()[1]) / 1e6


def pytest_configure(config: pytest.Config) -> None:
    global _group, _log
    _log = os.environ.get("CPU_LOG", "")
    if _log:
        worker = getattr(config, "workerinput", {}).get("workerid", "main")
        _group = _join_own_group(f"trainmesh-tests-{worker}-{os.getpid()}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back to the parent group; the group removed once nothing else is in it."""
    if _group is not None:
        try:
            (_group.parent / "cgroup.procs").write_text(str(os.getpid()))
            _group.rmdir()
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _group is None:
        yield
        return
    cpu, wall = _cpu_s(_group), time.monotonic()
    yield
    with open(_log, "a") as out:
        out.write(json.dumps({"id": item.nodeid, "cpu": round(_cpu_s(_group) - cpu, 2),
                              "wall": round(time.monotonic() - wall, 2)}) + "\n")
