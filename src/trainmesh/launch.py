"""Local workers through PyTorch's elastic launcher (the machinery behind ``torchrun``).

``trainmesh train`` started directly re-runs itself as ``dp*pp*tp`` workers under an elastic
agent (c10d rendezvous on loopback), waits for them, and turns a worker failure into exit 1
with the failing rank and its error. The agent tears every worker down on exit or signal.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid


def _quiet_agent() -> None:
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)


def launch_local(argv: list[str], *, nproc: int, max_restarts: int = 0) -> int:
    """Run ``python -m trainmesh train *argv`` on ``nproc`` local workers; return the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_agent()
    # Restarted workers must not reuse the dead attempt's store (flaky gloo reconnects otherwise).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", run_id=f"trainmesh-{uuid.uuid4().hex[:8]}",
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-m", "trainmesh", "train", *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        first = str(message).strip().splitlines()[0] if str(message).strip() else f"exit code {failure.exitcode}"
        sys.stderr.write(f"trainmesh train: rank {rank} failed (exit code {failure.exitcode}): {first}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("trainmesh train: interrupted; workers stopped\n")
        return 130
    return 0
