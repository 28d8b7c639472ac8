"""Run a function on N local worker processes (gloo, CPU) through torch's elastic launcher.

Used by the test suite and the benchmarks::

    results = run_distributed(check_ddp, 2, arg1, timeout_s=120)   # {rank: return value}

``fn`` must be importable by module path (defined at module level). Each worker uses one
thread, joins a gloo group whose collectives time out after ``timeout_s``, runs ``fn(*args)``
and returns its result to the caller. A failing rank raises ``ChildFailedError`` here naming
that rank and its error.
"""
from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record


@record
def _worker(fn: Callable[..., Any], timeout_s: float, threads: int, args: tuple,
            env: dict[str, str] | None = None) -> Any:
    import torch

    from trainmesh.run.launch import apply_env, run_exit_handlers
    apply_env(env or {})

    from trainmesh.core.distributed import init_distributed, shutdown
    torch.set_num_threads(threads)
    init_distributed(timeout_s=timeout_s, device="cpu")
    try:
        result = fn(*args)
    except BaseException:
        shutdown(barrier=False)
        raise
    shutdown()
    run_exit_handlers()   # as a spawned worker's interpreter would at exit
    return result


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
                    threads: int = 1) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return {rank: result}. Where this
    process has imported transformers, the workers' fork server imports it too (once)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainmesh.core.compat import cheap_rendezvous_event_names
    from trainmesh.core.stores import STORE_ENV
    from trainmesh.run.launch import local_rendezvous, worker_start_method
    cheap_rendezvous_event_names()
    with local_rendezvous() as rendezvous:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world_size,
                              run_id=f"tm-{uuid.uuid4().hex[:8]}", max_restarts=0,
                              monitor_interval=0.05, start_method=worker_start_method("transformers" in sys.modules),
                              **rendezvous)
        # the workers' environment, not ours: this process's as it is now (the fork server
        # holds the one of its start) and the store
        env = {**os.environ, STORE_ENV: rendezvous["rdzv_endpoint"]}
        return elastic_launch(config, _worker)(fn, timeout_s, threads, args, env)


def worker_pids(launcher: int) -> list[int]:
    """The worker processes of the local launcher ``launcher`` (``trainmesh train``), by pid
    (started in rank order): the children of its fork server (named by its command line, or by
    its process name where it was forked rather than started), or its spawned children. Linux
    (/proc) only; for tests and benchmarks that signal or measure workers."""
    pids = []
    for child in _children(launcher):
        cmdline = _cmdline(child)
        if b"forkserver" in cmdline or _name(child) == "forkserver":
            pids.extend(_children(child))
        elif b"spawn_main" in cmdline:
            pids.append(child)
    return sorted(pids)


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    except OSError:
        return []


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ---------------------------------------------------------------- fault tolerance across hosts
def coordinator_args(bind: str, replicas: int) -> list[str]:
    """``trainmesh``'s arguments for a coordinator (``bind``: HOST:PORT, port 0 for one the
    kernel picks)."""
    return ["coordinator", "--bind", bind, "--replicas", str(replicas)]


def replica_args(train: list[str], coordinator: str, replica: int, replicas: int,
                 metrics: str | os.PathLike) -> list[str]:
    """``trainmesh``'s arguments for replica ``replica`` of a run across hosts (``train TRAIN
    --fault-tolerant ...``)."""
    return ["train", *train, "--fault-tolerant", "--coordinator", coordinator,
            "--replica-id", str(replica), "--replicas", str(replicas), "--metrics-out", str(metrics)]


def coordinator_argv(bind: str, replicas: int) -> list[str]:
    """``python -m trainmesh coordinator ...`` (:func:`coordinator_args`)."""
    return [sys.executable, "-m", "trainmesh", *coordinator_args(bind, replicas)]


def replica_argv(train: list[str], coordinator: str, replica: int, replicas: int,
                 metrics: str | os.PathLike) -> list[str]:
    """``python -m trainmesh train ... --fault-tolerant ...`` (:func:`replica_args`)."""
    return [sys.executable, "-m", "trainmesh", *replica_args(train, coordinator, replica, replicas, metrics)]


def serving_address(output: str) -> str | None:
    """The address a ``trainmesh coordinator``'s output says it serves, if it says so yet."""
    for line in output.splitlines():
        if "serving" in line:
            return line.split("serving", 1)[1].split()[0]
    return None


def served_address(proc: Any, timeout_s: float = 120.0) -> str:
    """The address a ``trainmesh coordinator`` started with ``stdout=PIPE`` (text) says it
    serves; the rest of its output is drained on a thread."""
    import threading
    import time
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        address = serving_address("".join(lines))
        if address is not None:
            return address
        if proc.poll() is not None and not lines:
            break
        time.sleep(0.05)
    raise RuntimeError(f"trainmesh coordinator did not start: {''.join(lines)[-2000:]}")


def metrics_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics file being written (a partial last line left out)."""
    import json
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
